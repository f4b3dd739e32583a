"""Registering the ``"spdkfac*"`` strategy names with Lightning without importing Lightning early.

``Trainer(strategy="spdkfac")`` needs the names in Lightning's ``StrategyRegistry``, which the
strategy modules fill when they are imported. The package root must not import Lightning (plain
PyTorch users, and users who have not imported it yet), so:

- if ``pytorch_lightning`` is already imported, the strategy modules are imported now;
- otherwise a one-shot import hook waits for ``pytorch_lightning`` to finish importing, then imports
  them (and removes itself). Nothing happens if Lightning is never imported or is not installed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_LIGHTNING = "pytorch_lightning"


def _register() -> None:
    importlib.import_module("lightning_spdkfac.lightning")  # its modules register on import


def _register_quietly() -> None:
    """From inside the user's ``import pytorch_lightning``: a failure here must not fail that import."""
    try:
        _register()
    except Exception as e:  # noqa: BLE001 - reported, and raised again when the strategies are used
        import warnings

        warnings.warn(f"lightning_spdkfac could not register its Lightning strategies: {type(e).__name__}: {e}",
                      stacklevel=2)


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
    if _LIGHTNING in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_LIGHTNING, _register_quietly))
