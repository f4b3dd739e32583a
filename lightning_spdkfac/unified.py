"""K-FAC for the unified ``lightning`` package: ``import lightning as L`` / ``import lightning.pytorch as L``.

``lightning.pytorch`` and ``pytorch_lightning`` are two copies of Lightning with distinct classes: a
``lightning.pytorch.Trainer`` accepts only ``lightning.pytorch`` strategies (and its LightningCLI only
its callbacks). This module has the same ``KFAC``, ``SPDKFACStrategy`` and ``SPDKFACDeepSpeedStrategy``
as the package root, as subclasses of ``lightning.pytorch``'s classes::

    import lightning.pytorch as L
    from lightning_spdkfac.unified import KFAC, SPDKFACStrategy

    L.Trainer(callbacks=[KFAC()], strategy=SPDKFACStrategy())   # or strategy="spdkfac"

The code is the package's one implementation (``KFACCallbackBody``, ``SPDKFACStrategyBody``,
``SPDKFACDeepSpeedStrategyBody``); only the Lightning base class differs. Importing this module registers
the ``"spdkfac*"`` strategy names in ``lightning.pytorch``'s ``StrategyRegistry``; that also happens by
itself once both ``lightning_spdkfac`` and ``lightning`` are imported, in either order.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, StrategyRegistry

from .lightning.callback import KFACCallbackBody
from .lightning.deepspeed import SPDKFACDeepSpeedStrategyBody
from .lightning.strategy import SPDKFACStrategyBody

__all__ = ["KFAC", "SPDKFACDeepSpeedStrategy", "SPDKFACStrategy"]

_PACKAGE = "lightning.pytorch"


# (The type checker sees each body with pytorch_lightning's base; here the base is lightning.pytorch's.)
class KFAC(KFACCallbackBody, Callback):  # type: ignore[misc]
    __doc__ = KFACCallbackBody.__doc__


class SPDKFACStrategy(SPDKFACStrategyBody, DDPStrategy):  # type: ignore[misc]
    __doc__ = SPDKFACStrategyBody.__doc__
    lightning_package = _PACKAGE


class SPDKFACDeepSpeedStrategy(SPDKFACDeepSpeedStrategyBody, DeepSpeedStrategy):  # type: ignore[misc]
    __doc__ = SPDKFACDeepSpeedStrategyBody.__doc__
    lightning_package = _PACKAGE


SPDKFACStrategy.register_strategies(StrategyRegistry)
SPDKFACDeepSpeedStrategy.register_strategies(StrategyRegistry)
