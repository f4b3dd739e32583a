"""What the ``KFAC`` callback reads off a Lightning Trainer: when Lightning writes a step's metrics, the step index
its loggers use, where a checkpoint came from, and whether the model's layers are built yet. Duck-typed on the
trainer, so both Lightning namespaces are served by the same functions."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import pytorch_lightning as pl


def _refuse_uninitialized_lazy_layers(model: torch.nn.Module) -> None:
    """K-FAC sizes its factors from each layer's weight: a lazy layer must have run (or be built) by fit start."""
    from torch.nn.parameter import UninitializedParameter

    lazy = [f"{name or '<root>'} ({type(m).__name__})" for name, m in model.named_modules()
            if any(isinstance(p, UninitializedParameter) for p in m.parameters(recurse=False))]
    if lazy:
        raise ValueError(
            f"KFAC: {len(lazy)} layer(s) still have uninitialized (lazy) parameters at fit start: {', '.join(lazy)}. "
            "K-FAC sizes its factors from each layer's weight, so it needs them materialized before training: "
            "run one forward pass on an example batch before trainer.fit(...), or create the layers with their "
            "sizes (e.g. in LightningModule.configure_model())"
        )


def _logs_written_this_step(trainer: pl.Trainer) -> bool:
    """Will Lightning write the metrics logged in this optimizer step to its loggers?

    Lightning's rule (``_LoggerConnector.should_update_logs``, applied by ``update_train_step_metrics``
    after the step's last micro-batch): ``log_every_n_steps`` > 0 and (the step's 1-based index,
    ``_batches_that_stepped + 1``, a multiple of it, or ``trainer.should_stop``), or ``fast_dev_run``.
    ``_batches_that_stepped`` counts the steps before this one here too: Lightning increments it
    after the batch. It writes no step metrics at the end of fit. (A ``should_stop`` set after this
    hook, in an ``on_train_batch_end``, makes Lightning write this step without K-FAC's metrics.)
    """
    if getattr(trainer, "fast_dev_run", False):  # (both set on the instance by Trainer.__init__)
        return True
    every = getattr(trainer, "log_every_n_steps", 0)
    if not every:
        return False
    return (_steps_before(trainer) + 1) % every == 0 or trainer.should_stop


def _steps_before(trainer: pl.Trainer) -> int:
    """Lightning's ``_batches_that_stepped`` (the optimizer steps before this one, here): the step index
    of its rule and of its logger writes; ``global_step``, the same for one optimizer, where it is missing."""
    stepped = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", None)
    return stepped if isinstance(stepped, int) else trainer.global_step


def _where(trainer: pl.Trainer) -> str:
    return f"checkpoint {trainer.ckpt_path}" if trainer.ckpt_path else "the checkpoint"
