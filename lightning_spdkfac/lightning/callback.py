"""The ``KFAC`` Lightning callback: K-FAC on any optimizer from ``configure_optimizers``.

It builds a :class:`~lightning_spdkfac.kfac.KFACPreconditioner` on the LightningModule at fit
start and preconditions in ``on_before_optimizer_step``: Lightning calls that hook once per
optimizer step (at the accumulation boundary), after the closure ran backward and after a
fp16 GradScaler unscaled the gradients, and before gradient clipping and ``optimizer.step()``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback

from ..kfac import hparams as hp
from ..kfac.preconditioner import KFACPreconditioner


class KFAC(Callback):
    """K-FAC preconditioning for ``Trainer(callbacks=[KFAC(...)])``.

    Args:
        damping: added to each factor's diagonal before inversion (>= 0). This and the next three
            are numbers or schedules: callables of the optimizer step index (in YAML, the
            import path of a function such as ``mypkg.schedules.damping``).
        factor_decay: running-average decay of the factors, in [0, 1).
        kl_clip: KL-clip bound (> 0), or None to turn clipping off.
        lr: the learning rate the KL clip assumes; None (default) reads
            ``param_groups[0]["lr"]`` of the optimizer at every step, so LR schedulers are followed.
        factor_update_steps: factors are updated every this many optimizer steps.
        inv_update_steps: inverses are recomputed every this many optimizer steps.
        skip_layers: regular expressions on module names or class names of layers to leave alone.
        factor_dtype: dtype of the stored factors ("float32" default; "float64" allowed).
        inv_dtype: dtype of inversions and preconditioning ("float32" or "float64").
        log_step_time: log, per optimizer step, ``kfac/step_ms`` (the K-FAC step), ``kfac/fwd_bwd_ms``
            (forward and backward of the step, hooks included) and ``kfac/<phase>_ms`` for every phase of
            :mod:`lightning_spdkfac.telemetry` through the Trainer's logger.
        trace_step: record optimizer step ``trace_step`` (forward, backward, K-FAC, optimizer) with the
            PyTorch profiler and write a Chrome trace per rank to
            ``trace_dir/kfac_step{trace_step}_rank{rank}.json`` (open it in chrome://tracing or Perfetto).
        trace_dir: folder of the trace (relative paths are relative to the working directory).
    """

    def __init__(
        self,
        damping: float | Callable[[int], float] = 1e-3,
        factor_decay: float | Callable[[int], float] = 0.95,
        kl_clip: float | Callable[[int], float] | None = 1e-3,
        lr: float | Callable[[int], float] | None = None,
        factor_update_steps: int = 1,
        inv_update_steps: int = 10,
        skip_layers: str | Iterable[str] = (),
        factor_dtype: str | torch.dtype = "float32",
        inv_dtype: str | torch.dtype = "float32",
        log_step_time: bool = True,
        trace_step: int | None = None,
        trace_dir: str = "kfac_traces",
    ):
        super().__init__()
        self.kwargs: dict[str, Any] = dict(
            damping=damping,
            factor_decay=factor_decay,
            kl_clip=kl_clip,
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            skip_layers=skip_layers,
            factor_dtype=_dtype("factor_dtype", factor_dtype),
            inv_dtype=_dtype("inv_dtype", inv_dtype),
        )
        if lr is not None:
            hp.check_schedule("lr", lr, hp.NONNEGATIVE)
        self.lr = lr
        self.log_step_time = log_step_time
        if trace_step is not None and (isinstance(trace_step, bool) or not isinstance(trace_step, int) or trace_step < 0):
            raise ValueError(f"trace_step must be None or a non-negative integer, got {trace_step!r}")
        self.trace_step = trace_step
        self.trace_dir = trace_dir
        self._profiler = None
        self._t_step_start: float | None = None
        # Validate everything now (a bad YAML value fails at construction, not at fit start).
        self._validate()
        self.preconditioner: KFACPreconditioner | None = None
        self._pending_state: dict | None = None  # loaded before setup built the preconditioner
        self._final_state: dict | None = None  # kept after teardown, for save_checkpoint after fit
        self._trainer: pl.Trainer | None = None

    def _validate(self) -> None:
        # The probe layer must not draw from the global generator: LightningCLI builds callbacks
        # before the model, and the model's initial weights must not depend on KFAC being there.
        with torch.random.fork_rng(devices=[]):
            probe = torch.nn.Linear(1, 1)
        KFACPreconditioner(probe, lr=0.0 if self.lr is None else self.lr, **self.kwargs).remove_hooks()

    @property
    def state_key(self) -> str:
        return "KFAC"

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.preconditioner is not None:
            return
        self._trainer = trainer
        self._final_state = None
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.preconditioner = KFACPreconditioner(
            pl_module,
            lr=self.lr if self.lr is not None else self._optimizer_lr,
            grad_scaler=scaler,
            distributor=self._distributor(trainer),
            grad_access=self._grad_access(trainer),
            **self.kwargs,
        )
        if self._pending_state is not None:
            self.preconditioner.load_state_dict(self._pending_state)
            self._pending_state = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.preconditioner is not None:
            self._final_state = self.preconditioner.state_dict()
            self.preconditioner.remove_hooks()
            self.preconditioner = None

    @staticmethod
    def _distributor(trainer: pl.Trainer):
        """The strategy's K-FAC distributor; refuses to run unsynchronized K-FAC on several ranks."""
        make = getattr(trainer.strategy, "make_kfac_distributor", None)
        if make is not None:
            return make()
        if trainer.world_size > 1:
            raise RuntimeError(
                f"KFAC on {trainer.world_size} processes needs a K-FAC-aware strategy, otherwise every rank "
                f"would precondition with its own factors and the replicas would drift apart; "
                f"{type(trainer.strategy).__name__} is not one: use Trainer(strategy='spdkfac')"
            )
        return None

    @staticmethod
    def _grad_access(trainer: pl.Trainer):
        make = getattr(trainer.strategy, "make_kfac_grad_access", None)
        return None if make is None else make()

    def _final_micro_batch(self, trainer: pl.Trainer) -> bool:
        """Does the coming micro-batch end an optimizer step?"""
        ask_strategy = getattr(trainer.strategy, "kfac_final_micro_batch", None)
        final = None if ask_strategy is None else ask_strategy()
        if final is not None:  # DeepSpeed: the engine decides, across epoch ends too
            return final
        should_accumulate = getattr(trainer.fit_loop.epoch_loop, "_should_accumulate", None)
        return True if should_accumulate is None else not should_accumulate()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.preconditioner is None:
            return
        if self._t_step_start is None:  # first micro-batch of an optimizer step
            self._t_step_start = time.perf_counter()
            if self.trace_step is not None and self.preconditioner.steps == self.trace_step:
                self._start_trace()
        # Pipelined factor reductions wait for the micro-batch that ends the optimizer step.
        self.preconditioner.final_micro_batch = self._final_micro_batch(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.preconditioner is not None and self.preconditioner.final_micro_batch:
            self._t_step_start = None
            if self._profiler is not None:
                self._stop_trace(trainer)

    def _start_trace(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=activities)
        self._profiler.__enter__()

    def _stop_trace(self, trainer: pl.Trainer) -> None:
        import os

        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        os.makedirs(self.trace_dir, exist_ok=True)
        path = os.path.join(self.trace_dir, f"kfac_step{self.trace_step}_rank{trainer.global_rank}.json")
        prof.export_chrome_trace(path)
        self.trace_path = path

    def _optimizer_lr(self, step: int) -> float:
        return float(self._trainer.optimizers[0].param_groups[0]["lr"])

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        pre = self.preconditioner
        if pre is None or not pre.final_micro_batch:
            # DeepSpeed calls this hook on every micro-batch; K-FAC steps at the accumulation boundary.
            return
        t0 = time.perf_counter()
        pre.step()
        if self.log_step_time:
            metrics = {"kfac/step_ms": (time.perf_counter() - t0) * 1e3}
            if self._t_step_start is not None:
                metrics["kfac/fwd_bwd_ms"] = (t0 - self._t_step_start) * 1e3
            metrics.update({f"kfac/{k}_ms": v * 1e3 for k, v in pre.timer.last.items()})
            pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        if self.preconditioner is None:
            return dict(self._pending_state or self._final_state or {})
        return self.preconditioner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.preconditioner is None:
            self._pending_state = state_dict
        else:
            self.preconditioner.load_state_dict(state_dict)


def _dtype(name: str, value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    dt = getattr(torch, str(value), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"{name} must be a torch dtype name such as 'float32' or 'float64', got {value!r}")
    return dt
