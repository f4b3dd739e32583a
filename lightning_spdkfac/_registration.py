"""Registering the ``"spdkfac*"`` strategy names with Lightning without importing Lightning early.

``Trainer(strategy="spdkfac")`` needs the names in Lightning's ``StrategyRegistry``, which the
strategy modules fill when they are imported. Lightning comes in two namespaces with a registry each:
``pytorch_lightning`` (filled by :mod:`lightning_spdkfac.lightning`) and the unified package's
``lightning.pytorch`` (filled by :mod:`lightning_spdkfac.unified`). The package root must not import
Lightning (plain PyTorch users, and users who have not imported it yet), so for each namespace:

- if it is already imported, the module that registers in it is imported now;
- otherwise a one-shot import hook waits for it to finish importing, then imports that module
  (and removes itself). Nothing happens if it is never imported or is not installed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

# Lightning namespace -> the module whose import registers the strategies in its StrategyRegistry
_REGISTERING = {
    "pytorch_lightning": "lightning_spdkfac.lightning",
    "lightning.pytorch": "lightning_spdkfac.unified",
}


def _register(namespace: str) -> None:
    importlib.import_module(_REGISTERING[namespace])  # its modules register on import


def _register_quietly(namespace: str) -> None:
    """From inside the user's ``import``: a failure here must not fail that import."""
    try:
        _register(namespace)
    except Exception as e:  # noqa: BLE001 - reported, and raised again when the strategies are used
        import warnings

        warnings.warn(f"lightning_spdkfac could not register its strategies with {namespace}: "
                      f"{type(e).__name__}: {e}", stacklevel=2)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of ``target`` so that ``then`` runs once it is imported."""

    def __init__(self, target: str, then: Any) -> None:
        self.target = target
        self.then = then

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)  # one shot, and no recursion into this finder below
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    """Delegates to the real loader; after the module's code ran without error, calls ``then``."""

    def __init__(self, inner: Any, then: Any) -> None:
        self._inner = inner
        self._then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        module.__loader__ = self._inner  # the module keeps its real loader (resources, sources)
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        self._then()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def register_with_lightning() -> None:
    for namespace in _REGISTERING:
        if namespace in sys.modules:
            _register(namespace)
        elif not any(isinstance(f, _AfterImport) and f.target == namespace for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport(namespace, functools.partial(_register_quietly, namespace)))
