"""The function capture's scope around a training step's own code, for the ``KFAC`` callback.

:class:`~lightning_spdkfac.kfac.capture.FunctionCapture` follows a weight given to a function only while the forward of
a module that may reach it runs. A LightningModule's ``training_step`` is no forward: ``F.linear(h, self.proj.weight)``
written there would not be followed, and the layer would be left to the optimizer. The callback opens the capture's
scope at ``on_train_batch_start`` and closes it once the backward is launched (``on_before_backward``), or at
``on_train_batch_end`` (a step that returned no loss), on an exception and at teardown, whichever comes first.

It is opened only on the micro-batches whose factors are collected and only while the capture follows a layer that a
function may be given outside its module (or ``capture="auto"`` probes): a model that uses no functions pays nothing.
Never under torch.compile: not for a model holding a compiled module or a LightningModule compiled with
``trainer.fit(torch.compile(model))`` (the mode would be traced into the compiled graph; kfac/capture.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from ..kfac.capture import FunctionCapture
    from ..kfac.preconditioner import KFACPreconditioner


class StepScope:
    """The callback's open scope, if any (at most one at a time)."""

    def __init__(self) -> None:
        self._capture: FunctionCapture | None = None

    @property
    def is_open(self) -> bool:
        return self._capture is not None

    def open(self, pre: KFACPreconditioner, pl_module: pl.LightningModule) -> None:
        """Open the scope for this micro-batch's training step where the capture needs it."""
        self.close()
        capture = pre.capture
        if (pre.paused or not pre.collecting or not capture.needs_scope
                or getattr(pl_module, "_compiler_ctx", None) is not None):  # (Lightning's compiled LightningModule)
            return
        if capture.open_scope():
            self._capture = capture

    def close(self) -> None:
        """Close the scope if open (safe to call on every path)."""
        capture, self._capture = self._capture, None
        if capture is not None:
            capture.close_scope()
