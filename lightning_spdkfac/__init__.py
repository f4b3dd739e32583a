"""lightning-spdkfac: K-FAC second-order optimization for PyTorch Lightning, with SPD-KFAC scheduling.

The package root is lazy: ``from lightning_spdkfac import KFACPreconditioner, SPDDistributor, SPDOptions``
imports the plain-PyTorch core only, and works without Lightning installed. The Lightning adapters
(``KFAC``, ``SPDKFACStrategy``, ``SPDKFACDeepSpeedStrategy``) are imported when first named; these
are ``pytorch_lightning``'s. Users of the unified ``lightning`` package (``import lightning.pytorch as L``)
import the same three names from :mod:`lightning_spdkfac.unified`: the same code on ``lightning.pytorch``'s
base classes, which its Trainer requires.

The ``"spdkfac*"`` strategy names are registered in each namespace's strategy registry as soon as both
this package and that namespace (``pytorch_lightning``, ``lightning.pytorch``) are imported, in either
order (see :mod:`._registration`).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _registration

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "KFACPreconditioner": "lightning_spdkfac.kfac.preconditioner",
    "KFACOptions": "lightning_spdkfac.kfac.options",
    "SPDDistributor": "lightning_spdkfac.comm.scheduler",
    "SPDOptions": "lightning_spdkfac.comm.scheduler",
    "KFAC": "lightning_spdkfac.lightning.callback",
    "SPDKFACStrategy": "lightning_spdkfac.lightning.strategy",
    "SPDKFACDeepSpeedStrategy": "lightning_spdkfac.lightning.deepspeed",
    "register_layer_type": "lightning_spdkfac.kfac.layers",
    "LayerHelper": "lightning_spdkfac.kfac.layer_base",
}
__all__ = [
    "KFAC",
    "LayerHelper",
    "KFACOptions",
    "KFACPreconditioner",
    "SPDDistributor",
    "SPDKFACDeepSpeedStrategy",
    "SPDKFACStrategy",
    "SPDOptions",
    "configs_dir",
    "register_layer_type",
]

if TYPE_CHECKING:
    from .comm.scheduler import SPDDistributor, SPDOptions
    from .kfac.layer_base import LayerHelper
    from .kfac.layers import register_layer_type
    from .kfac.options import KFACOptions
    from .kfac.preconditioner import KFACPreconditioner
    from .lightning.callback import KFAC
    from .lightning.deepspeed import SPDKFACDeepSpeedStrategy
    from .lightning.strategy import SPDKFACStrategy


def configs_dir() -> Path:
    """The folder of the shipped YAML configs (``digits.yaml``, ``digits_sgd.yaml``, ...), as installed.

    ``spdkfac fit --config "$(python -c 'import lightning_spdkfac as s; print(s.configs_dir())')/digits.yaml"``
    runs one from a ``pip install``; in a source checkout it is the repository's ``configs/``.
    """
    return Path(__file__).parent / "configs"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_spdkfac' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # next time, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


_registration.register_with_lightning()
