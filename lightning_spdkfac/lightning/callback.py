"""The ``KFAC`` Lightning callback: K-FAC on any optimizer from ``configure_optimizers``.

It builds a :class:`~lightning_spdkfac.kfac.KFACPreconditioner` on the LightningModule at fit
start (``on_fit_start``, or earlier when ``fit(ckpt_path=...)`` reads its checkpoint: in both cases
after ``LightningModule.configure_model()``, so layers created there get K-FAC) and preconditions in ``on_before_optimizer_step``: Lightning calls that hook once per
optimizer step (at the accumulation boundary), after the closure ran backward and after a
fp16 GradScaler unscaled the gradients, and before gradient clipping and ``optimizer.step()``.

Telemetry: per-step times are aggregated in plain floats (:class:`~lightning_spdkfac.telemetry.WindowStats`)
and written to the Trainer's loggers only on the steps whose logs Lightning writes (every
``log_every_n_steps``), with ``logger.log_metrics`` at Lightning's step index rather than through
``LightningModule.log_dict``: Lightning's ``self.log`` costs about a millisecond per metric on a CPU
(it moves its whole result record to the value's device), which for two dozen metrics every 50 steps
was still about 5% of K-FAC's cost on the digits CNN (``benchmarks/telemetry_overhead.py``).
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn

from .. import validation as val
from ..kfac.distributor import Distributor
from ..kfac.gradients import GradAccess
from ..kfac.options import KFACOptions
from ..kfac.preconditioner import KFACPreconditioner
from ..kfac.step_size import LOSS_PARTS_HELP
from ..telemetry import PHASES, WindowStats
from ..vocabulary import FactorApproxName, GraftingName, InverseMethodName, StepSizeName, UpdateName
from .protocol import KFACStrategy, model_parallel
from .run_report import KFACRunRecord, kfac_line, possible_phases, thread_note
from .step_scope import StepScope
from .trainer_rules import _logs_written_this_step, _refuse_uninitialized_lazy_layers, _steps_before, _where

if TYPE_CHECKING:
    from torch.profiler import profile

    _CallbackBase = Callback  # what the type checker sees; at run time each flavour adds its namespace's Callback
else:
    _CallbackBase = object

_D = KFACOptions()  # the defaults of the K-FAC hyperparameters, shown in KFAC's signature
_FACTOR_DTYPE = str(_D.factor_dtype).removeprefix("torch.")  # as a name: what a YAML config shows
_INV_DTYPE = str(_D.inv_dtype).removeprefix("torch.")


class KFACCallbackBody(_CallbackBase):
    """K-FAC preconditioning for ``Trainer(callbacks=[KFAC(...)])``.

    Args:
        damping: the Tikhonov damping of each layer's Kronecker block (>= 0), split between A and G by
            pi-balancing so that every direction of the block is damped by at least ``damping``; ``"auto"`` (the
            default): 1e-3 under an Adam-type optimizer, else 3e-2 (KFACOptions, docs/math.md). This and the next three
            are numbers or schedules: callables of the optimizer step index (in YAML, the
            import path of a function such as ``mypkg.schedules.damping``). A schedule is called
            once with step 0 at construction, and must accept one argument and return a number in
            the argument's range there (and at every later step, where it is checked again).
        factor_decay: running-average decay of the factors, in [0, 1).
        kl_clip: KL-clip bound (> 0), or None to turn clipping off.
        lr: the learning rate the KL clip assumes; None (default): the learning rate of each layer's own
            param group in the optimizer that is stepping, read at every step (LR schedulers, per-group
            learning rates and several optimizers are followed; with several optimizers, each
            ``optimizer.step()`` preconditions the layers that optimizer holds).
        factor_update_steps: factors are updated every this many optimizer steps.
        inv_update_steps: inverses are recomputed every this many optimizer steps.
        skip_layers: a regular expression, or a list of them, on module names or class names of
            layers to leave alone.
        factor_dtype: dtype of the stored factors ("float32" default; "float64", "bfloat16" and
            "float16" allowed; a ``torch.dtype`` too).
        inv_dtype: dtype of inversions and preconditioning ("float32" or "float64").
        log_step_time: time every optimizer step (``time.perf_counter``: ``step``, the K-FAC step;
            ``fwd_bwd``, forward and backward of the step, hooks included; and every phase of
            :mod:`lightning_spdkfac.telemetry`) and write to the Trainer's loggers, on the steps whose
            logs Lightning writes (every ``log_every_n_steps`` optimizer steps, at the step index
            Lightning's rows have, and every step once ``trainer.should_stop`` is set), aggregates over
            the steps since the previous write: ``kfac/<name>_ms`` (mean), ``kfac/<name>_ms_max``
            (max; only the phases that can be non-zero in the run: no ``factor_comm_*`` or
            ``inverse_comm_wait`` in one process, no ``inverse_async``/``inverse_wait`` without
            asynchronous inverses), ``kfac/inverse_step_share`` (the fraction of those steps that recomputed inverses,
            so that a mean can be read against the inverse schedule) and ``kfac/steps_in_window``.
            The steps after the last write of a fit are not logged (Lightning writes no step metrics
            there either). They go to ``logger.log_metrics`` directly, not through ``self.log``, so
            they are not in ``trainer.logged_metrics`` or ``callback_metrics`` (a CSVLogger has them in
            rows of their own, with the step of Lightning's row). Without a logger
            (``Trainer(logger=False)``) nothing is timed or logged.
        trace_step: record optimizer step ``trace_step`` (forward, backward, K-FAC, optimizer) with the
            PyTorch profiler and write a Chrome trace per rank to
            ``trace_dir/kfac_step{trace_step}_rank{rank}.json`` (open it in chrome://tracing or Perfetto).
        trace_dir: folder of the trace (relative paths are relative to the working directory).
        max_bad_steps: raise a RuntimeError naming the layers and what was non-finite after this many
            consecutive factor steps skipped for non-finite activations, output gradients, received
            factors or gradients (default 100: room for a fp16 loss scaler to back off, see
            :class:`~lightning_spdkfac.kfac.KFACPreconditioner`); None never raises. The counters
            ``kfac/skipped_factor_steps``, ``kfac/skipped_precondition_steps`` and
            ``kfac/inverse_fallbacks`` (factor inversions Cholesky could not do) are logged, as their
            running totals, on the steps whose logs Lightning writes, whatever ``log_step_time`` says.
        factor_approx: how layers with weight sharing (Conv2d, and Linear on inputs with more than two
            dims such as ``(batch, seq, features)``) form their factors: ``"expand"`` (one row per
            position, KFC), ``"reduce"`` (one row per example, its positions aggregated first: the
            factor statistics cost about positions times fewer flops), or ``"auto"`` (default: reduce
            for Conv2d, expand for Linear). 2-D Linear inputs are the same under all. The formulas
            are in docs/math.md.
        inverse_method: how each layer's damped curvature block is inverted: ``"cholesky"`` (default:
            each factor by Cholesky, the damping split between them by pi-balancing, so every direction
            is damped by at least ``damping``) or ``"eigen"`` (eigendecompositions of both factors, the
            block damped by exactly ``damping``; costlier per inversion, and its inverse broadcasts carry
            twice the bytes). A checkpoint saved with the other method resumes with a warning, its
            inverses recomputed at the next step. See docs/math.md.
        async_inverses: on an inverse step, precondition with the inverses already held and compute the
            new ones on a worker thread (a side stream on CUDA; distributed, their broadcasts on a process
            group of their own) while the optimizer steps and the next batch runs forward and backward; the
            next step swaps them in, waiting only for what is not done. Each step then uses inverses exactly
            one step staler (a layer's first ones are computed at once). A K-FAC strategy's own
            ``async_inverses``, when set, decides instead. Default False. See docs/math.md.
        grafting: None (default), ``"sgd"`` or ``"adam"``: rescale each layer's preconditioned gradient to
            the norm of the gradient (SGD's step) or of Adam's direction (from second moments kept by
            K-FAC), so that the base optimizer's tuned lr carries over; ``"adam"`` is for an SGD-type base
            optimizer run at an Adam lr (see :mod:`lightning_spdkfac.kfac.grafting`).
        max_factor_side: the largest factor side kept dense; larger sides (an LM head's vocabulary) are kept
            diagonal. Default 4608 (see :class:`~lightning_spdkfac.kfac.options.KFACOptions`).
        memory_limit: None, or the most K-FAC memory a rank may take at once ("4GB"), the peak of an inverse step:
            a model above it stops at setup with the K-FAC summary, before anything is allocated.
        step_size: None (default), ``"quadratic"`` or ``"quadratic_momentum"``: rescale the optimizer's update
            after each step by the minimizer of the exact damped quadratic model of the loss along it (Martens &
            Grosse 2015). Needs ``kfac_loss_parts(batch)`` on the LightningModule (forward() recomputing the
            outputs, loss(outputs) the training loss); not under DeepSpeed. See
            :mod:`lightning_spdkfac.kfac.step_size`.
        step_size_every: measure the quadratic model every this many steps (default 5); alpha is reused between.
        step_size_clip: (low, high), alpha's range (default (0.1, 10)).
        step_size_damping: the quadratic model's damping; None (default): K-FAC's ``damping``.
        adapt_damping: Levenberg-Marquardt adaptation of ``damping`` from the quadratic model's reduction ratio at
            each measurement (default False); needs ``kfac_loss_parts`` like ``step_size``.
        capture: following weights used through functions: ``"auto"`` (default), True, False (KFACOptions' docs).
        update: ``"kfac"`` (default) or ``"eigen_adam"``, the eigenbasis mode (docs/math.md "The eigenbasis mode").
        eigen_beta2: the eigenbasis mode's moment decay in [0, 1) (default 0.95).
        eigen_eps: the eigenbasis mode's epsilon (> 0, default 1e-8).
        summary: print the K-FAC summary (each block's factor layout and bytes; every trainable parameter left
            to the optimizer, with the reason) on rank 0 when the fit starts, and one line of what K-FAC added
            when training ends (its ms per step and share of the step, inverse steps, fallbacks: the line the
            ``spdkfac`` CLI prints; :attr:`run_record` holds its figures). Default True.
        load_state: what ``trainer.fit(ckpt_path=...)`` does with the checkpoint's K-FAC state.
            ``"strict"`` (default) restores it, and refuses a state saved for another model (layers
            missing or unexpected, other factor shapes) or a corrupt one (missing keys, wrong types,
            tensors of the wrong shape or dtype, non-finite factors, a newer state version) with a
            ValueError listing every problem, raised as soon as the file is read: before Lightning
            restores the weights, the optimizer or anything else. ``"skip"`` ignores the K-FAC state:
            K-FAC starts fresh (step 0, no factors) with a warning, and the rest of the checkpoint
            loads normally. A checkpoint without K-FAC state (saved by a run without this callback)
            starts K-FAC fresh, with a warning, in both modes.

    Several fits: a second ``trainer.fit(model)`` of the same model object, on the same Trainer or on a new
    one with this callback (the notebook pattern), continues K-FAC where the previous fit ended: the
    factors, inverses, counters and the K-FAC step (which indexes the schedules) carry over, like the
    weights do. On the same Trainer this continues the run exactly (Lightning continues from
    ``global_step``; it re-creates the optimizer, so a stateless optimizer continues exactly too); on a new
    Trainer it is a warm start (its step count starts at 0, K-FAC's does not). A fit with ``ckpt_path``
    takes the checkpoint's K-FAC state instead (or starts fresh, see ``load_state``), and so does a state
    given to :meth:`load_state_dict` before the fit; a fit of another model starts K-FAC fresh. To start
    K-FAC fresh on the same model, use a new ``KFAC`` callback.

    Layers are registered at fit start, after ``LightningModule.configure_model()``; a layer whose
    parameters are still uninitialized (``nn.LazyLinear`` before its first forward) is refused with a
    ValueError naming it: run a forward pass on an example batch first, or create it in
    ``configure_model()`` with its sizes.

    Every argument is checked at construction, so that a bad value in a YAML config fails before
    anything is built: a value of the wrong type (a string for a number, a float or bool for an
    integer, None where None is not listed, a list for a number) raises ``TypeError``, a value of
    the right type that is not accepted (out of range, NaN or infinite, an unknown dtype name, an
    invalid regular expression, a schedule that fails at step 0) raises ``ValueError``; the
    message names the argument, the value and what is accepted.
    """

    def __init__(
        self,
        damping: float | Callable[[int], float] | Literal["auto"] = _D.damping,
        factor_decay: float | Callable[[int], float] = _D.factor_decay,
        kl_clip: float | Callable[[int], float] | None = _D.kl_clip,
        lr: float | Callable[[int], float] | None = _D.lr,
        factor_update_steps: int = _D.factor_update_steps,
        inv_update_steps: int = _D.inv_update_steps,
        skip_layers: str | Iterable[str] = _D.skip_layers,
        factor_dtype: str | torch.dtype = _FACTOR_DTYPE,
        inv_dtype: str | torch.dtype = _INV_DTYPE,
        log_step_time: bool = True,
        trace_step: int | None = None,
        trace_dir: str = "kfac_traces",
        max_bad_steps: int | None = _D.max_bad_steps,
        factor_approx: FactorApproxName = _D.factor_approx,
        inverse_method: InverseMethodName = _D.inverse_method,
        async_inverses: bool = _D.async_inverses,
        grafting: GraftingName | None = _D.grafting,
        load_state: Literal["strict", "skip"] = "strict",
        max_factor_side: int = _D.max_factor_side,
        memory_limit: int | str | None = _D.memory_limit,
        summary: bool = True,
        step_size: StepSizeName | None = _D.step_size,
        step_size_every: int = _D.step_size_every,
        step_size_clip: tuple[float, float] = _D.step_size_clip,
        step_size_damping: float | None = _D.step_size_damping,
        adapt_damping: bool = _D.adapt_damping,
        capture: bool | str = _D.capture,
        update: UpdateName = _D.update,
        eigen_beta2: float = _D.eigen_beta2,
        eigen_eps: float = _D.eigen_eps,
    ) -> None:
        super().__init__()
        # Every argument is checked here (TypeError: wrong type, ValueError: a value that is not
        # accepted; the message names the argument), so that a bad YAML value fails at construction:
        # the K-FAC hyperparameters by KFACOptions (a schedule called once with step 0 there), the callback's own
        # below, the rest by annotation.
        val.check_annotations(KFACCallbackBody.__init__, locals(), skip=_CHECKED)
        self.options = KFACOptions(
            damping=damping, factor_decay=factor_decay, kl_clip=kl_clip, lr=lr,
            factor_update_steps=factor_update_steps, inv_update_steps=inv_update_steps, skip_layers=skip_layers,
            factor_dtype=factor_dtype, inv_dtype=inv_dtype, max_bad_steps=max_bad_steps,
            factor_approx=factor_approx, inverse_method=inverse_method, async_inverses=async_inverses,
            grafting=grafting, max_factor_side=max_factor_side, memory_limit=memory_limit,
            step_size=step_size, step_size_every=step_size_every, step_size_clip=step_size_clip,
            step_size_damping=step_size_damping, adapt_damping=adapt_damping, capture=capture,
            update=update, eigen_beta2=eigen_beta2, eigen_eps=eigen_eps,
        )
        self.summary = val.check_bool("summary", summary)
        self.log_step_time = val.check_bool("log_step_time", log_step_time)
        self.trace_step = val.check_int("trace_step", trace_step, low=0, optional=True)
        self.trace_dir = val.check_folder("trace_dir", trace_dir)
        self._profiler: profile | None = None  # recording trace_step
        self._t_step_start: float | None = None
        self._window = WindowStats()  # step times since the last log (log_step_time)
        self._phases: tuple[str, ...] | None = None  # the phases that can be non-zero in this fit (logged)
        self.run_record = KFACRunRecord()  # this fit's K-FAC steps: the line printed at the end
        self.print_run_line = True  # (the spdkfac CLI prints the line in its own outcome and sets this False)
        self._kfac_stepped = False  # K-FAC stepped in the optimizer step under way
        self.preconditioner: KFACPreconditioner | None = None
        self._pending_state: dict | None = None  # loaded before setup built the preconditioner
        # The state at the end of the last fit: for save_checkpoint after fit, and continued by the next
        # fit of the same model (_final_model) that loads no other state (see "Several fits").
        self._final_state: dict | None = None
        self._final_model: weakref.ref[pl.LightningModule] | None = None
        self._trainer: pl.Trainer | None = None
        self.load_state = load_state
        self._checkpoint_seen = False  # this fit's checkpoint was inspected (and any warning given)
        self._start_fresh = False  # ... and its K-FAC state is not to be loaded
        self._unguard: Callable[[], None] | None = None
        self._batch: Any = None  # step_size: the batch of the step's last micro-batch
        self._gathered = False  # schedule="dpkfac": _final_state was gathered at the end of training
        self._scope = StepScope()  # function capture around training_step's own code (lightning/step_scope.py)

    @property
    def lr(self) -> float | Callable[[int], float] | None:
        """The learning rate the KL clip assumes (``options.lr``; None: each param group's own)."""
        return self.options.lr

    @property
    def state_key(self) -> str:
        return "KFAC"

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The preconditioner is built later (_build): at on_fit_start, or when fit(ckpt_path=...) reads its
        # checkpoint, whichever comes first; both follow LightningModule.configure_model(), whose layers
        # this hook (called before it) would miss.
        if stage != "fit" or self.preconditioner is not None:
            return
        self._trainer = trainer
        self._distributor(trainer, check_only=True)  # refuse unsynchronized K-FAC on several ranks now
        previous = self._final_model() if self._final_model is not None else None
        if previous is not pl_module or self._pending_state is not None:
            self._final_state = None  # another model, or a state given to load_state_dict: nothing to continue
        self._window.reset()
        self.run_record.reset()
        self._phases = None
        self._checkpoint_seen = self._start_fresh = False
        self._guard_checkpoint_loading(trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._build(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Every restore of this fit is done (DeepSpeed restores after on_fit_start): with no checkpoint
        # loaded, the K-FAC state of the previous fit of this model continues.
        carried, self._final_state = self._final_state, None
        pre = self.preconditioner
        if carried is None or pre is None or self._checkpoint_seen:
            return
        try:
            pre.load_state_dict(carried)
        except ValueError as e:  # the model's layers changed between the fits
            rank_zero_warn(f"KFAC: the K-FAC state of the previous fit of this model does not fit it any more, "
                           f"so K-FAC starts fresh (step 0, no factors): {e}")

    def _build(self, trainer: pl.Trainer) -> KFACPreconditioner:
        """The preconditioner of this fit, built on the first call (after configure_model)."""
        if self.preconditioner is not None:
            return self.preconditioner
        pl_module = trainer.lightning_module
        _refuse_uninitialized_lazy_layers(pl_module)
        if ((self.options.step_size is not None or self.options.adapt_damping)
                and not callable(getattr(pl_module, "kfac_loss_parts", None))):
            self._loss_parts(pl_module)  # raises, naming what to define: before the first step, not at it
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        with warnings.catch_warnings():
            if not trainer.is_global_zero:  # the setup warnings (skipped or tied layers) are every rank's: rank 0's
                warnings.simplefilter("ignore")
            self.preconditioner = pre = KFACPreconditioner(  # (the K-FAC hyperparameters: the options alone)
                pl_module, self.options, grad_scaler=scaler, distributor=self._distributor(trainer),
                grad_access=self._grad_access(trainer))
        self._final_model = weakref.ref(pl_module)
        if self.summary and trainer.is_global_zero:
            rank_zero_info("K-FAC summary\n" + str(pre.summary()) + thread_note(pre.timer.thread_cap))
        if self._pending_state is not None:
            pre.load_state_dict(self._pending_state)
            self._pending_state = None
        return pre

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning skips the teardown hooks when fit raises (a refused checkpoint, for one): detach
        # the hooks from the model here, keeping the state for state_dict().
        self._release()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pre = self.preconditioner
        if pre is not None:
            self.run_record.finish(pre)
            if self.summary and self.print_run_line and trainer.is_global_zero:
                rank_zero_info("K-FAC: " + kfac_line(self.run_record))
        if pre is not None and pre.distributor.layer_owners is not None:
            # schedule="dpkfac": a rank holds its own layers only, and the state is gathered from their owners (a
            # collective). Here every rank is still in step and the process group is alive; at teardown it may
            # be gone, and after an exception a peer may be.
            self._final_state = pre.state_dict()
            self._gathered = True

    def _release(self) -> None:
        self._scope.close()
        if self._unguard is not None:
            self._unguard()
        self._checkpoint_seen = self._start_fresh = False  # decisions about this fit's checkpoint
        pre, self.preconditioner = self.preconditioner, None
        if pre is not None:
            if pre.distributor.layer_owners is None:
                self._final_state = pre.state_dict()
            elif not self._gathered:
                self._final_state = None
                rank_zero_warn("KFAC: the fit ended before its end of training (an exception?), so the K-FAC state "
                               "of this schedule='dpkfac' fit, spread over the ranks, was not gathered: "
                               "resume from its last checkpoint")
            self._gathered = False
            pre.remove_hooks()

    @staticmethod
    def _distributor(trainer: pl.Trainer, check_only: bool = False) -> Distributor | None:
        """The strategy's K-FAC distributor; refuses unsynchronized K-FAC on several ranks (FSDP2 hook: protocol.py)."""
        if isinstance(trainer.strategy, KFACStrategy):
            return None if check_only else trainer.strategy.make_kfac_distributor()
        if trainer.world_size > 1 and not model_parallel(trainer.strategy, trainer.lightning_module, check_only):
            raise RuntimeError(
                f"KFAC on {trainer.world_size} processes needs a K-FAC-aware strategy, otherwise every rank "
                f"would precondition with its own factors and the replicas would drift apart; "
                f"{type(trainer.strategy).__name__} is not one: use Trainer(strategy='spdkfac')"
            )
        return None

    @staticmethod
    def _grad_access(trainer: pl.Trainer) -> GradAccess | None:
        return trainer.strategy.make_kfac_grad_access() if isinstance(trainer.strategy, KFACStrategy) else None

    def _final_micro_batch(self, trainer: pl.Trainer) -> bool:
        """Does the coming micro-batch end an optimizer step?"""
        strategy = trainer.strategy
        final = strategy.kfac_final_micro_batch() if isinstance(strategy, KFACStrategy) else None
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
        self.preconditioner.registry.register_unfrozen()  # layers frozen at setup that train now, before the forward
        self.preconditioner.final_micro_batch = self._final_micro_batch(trainer)  # (pipelining waits for the last)
        # Lightning's StochasticWeightAveraging recomputes BatchNorm statistics in an epoch of forwards without
        # backward (fit_loop._skip_backward), still ending each batch in an optimizer step on the last real
        # gradients: K-FAC neither collects those forwards nor preconditions those (already preconditioned)
        # gradients a second time.
        self.preconditioner.paused = bool(getattr(trainer.fit_loop, "_skip_backward", False))
        if self.preconditioner.step_size is not None:
            self._batch = batch  # the last micro-batch's: kfac_loss_parts(batch) at the optimizer step
        self._scope.open(self.preconditioner, pl_module)  # (closed once the backward is launched)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._scope.close()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._scope.close()  # (a training_step that returned no loss: no backward)
        if self.preconditioner is not None and self.preconditioner.final_micro_batch:
            if self._kfac_stepped and self._t_step_start is not None:
                self.run_record.add_step_time(time.perf_counter() - self._t_step_start)
            self._t_step_start, self._kfac_stepped = None, False
            prof = self._profiler
            if prof is not None:
                self._stop_trace(trainer, prof)

    def _start_trace(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._profiler = prof = profile(activities=activities)
        prof.__enter__()

    def _stop_trace(self, trainer: pl.Trainer, prof: profile) -> None:
        self._profiler = None
        prof.__exit__(None, None, None)
        os.makedirs(self.trace_dir, exist_ok=True)
        path = os.path.join(self.trace_dir, f"kfac_step{self.trace_step}_rank{trainer.global_rank}.json")
        prof.export_chrome_trace(path)
        self.trace_path = path

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        pre = self.preconditioner
        if pre is None or not pre.final_micro_batch or pre.paused:
            # DeepSpeed calls this hook on every micro-batch; K-FAC steps at the accumulation boundary.
            return
        t0 = time.perf_counter()
        # the layers this optimizer steps, each at its param group's lr
        pre.step(optimizer, loss_parts=self._loss_parts(pl_module) if pre.step_size is not None else None)
        t1 = time.perf_counter()
        self.run_record.add_step(pre.timer.last, pre.last_step_inverted)
        self._kfac_stepped = True
        if not trainer.loggers:  # nothing would be written
            return
        if self.log_step_time:  # seconds, as host floats: no tensor, no sync
            times = {"step": t1 - t0}
            if self._t_step_start is not None:
                times["fwd_bwd"] = t0 - self._t_step_start
            times.update(pre.timer.last)
            self._window.add(times, flagged=pre.last_step_inverted)
        if _logs_written_this_step(trainer):
            metrics, step = self._metrics(pre), _steps_before(trainer)
            for logger in trainer.loggers:  # (rank-zero-only, as Lightning's own writes)
                logger.log_metrics(metrics, step=step)

    def _loss_parts(self, pl_module: pl.LightningModule) -> Any:
        fn = getattr(pl_module, "kfac_loss_parts", None)
        if not callable(fn):
            raise ValueError(f"KFAC(step_size={self.options.step_size!r}, adapt_damping={self.options.adapt_damping}) "
                             "needs the loss as a function of the "
                             f"model's outputs, and {type(pl_module).__name__} has no kfac_loss_parts: "
                             + LOSS_PARTS_HELP)
        return fn(self._batch)

    def _metrics(self, pre: KFACPreconditioner) -> dict[str, float]:
        """The fault counters and, with log_step_time, the window's aggregates (in ms); resets the window."""
        metrics = {  # fault counters, logged whatever log_step_time says
            "kfac/skipped_factor_steps": float(pre.skipped_factor_steps),
            "kfac/skipped_precondition_steps": float(pre.skipped_precondition_steps),
            "kfac/inverse_fallbacks": float(pre.inverse_fallbacks),
        }
        if pre.step_size is not None:  # the step-size rule's current state (kfac/step_size.py)
            metrics["kfac/alpha"] = pre.step_size.alpha
            metrics["kfac/mu"] = pre.step_size.mu
            metrics["kfac/step_size_damping"] = pre.step_size.last_damping
            metrics["kfac/rho"] = pre.step_size.rho
            if pre.step_size.damping is not None:
                metrics["kfac/damping"] = pre.step_size.damping
        window = self._window
        if self.log_step_time and window.steps:
            maxima = window.maxima()
            if self._phases is None:
                self._phases = possible_phases(pre.distributor)
            for name, mean in window.means().items():
                if name in PHASES and name not in self._phases:
                    continue  # cannot be non-zero in this run (a wait for a peer in one process, ...)
                metrics[f"kfac/{name}_ms"] = mean * 1e3
                metrics[f"kfac/{name}_ms_max"] = maxima[name] * 1e3
            metrics["kfac/inverse_step_share"] = window.flagged_share
            metrics["kfac/steps_in_window"] = float(window.steps)
        window.reset()
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        if self.preconditioner is None:
            return dict(self._pending_state or self._final_state or {})
        return self.preconditioner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.load_state == "skip" or self._start_fresh:
            if not self._checkpoint_seen:  # called directly, not from fit(ckpt_path=...)
                rank_zero_warn("KFAC(load_state='skip') ignores the K-FAC state passed to load_state_dict; "
                               "K-FAC starts fresh (step 0, no factors)")
            return
        if self.preconditioner is None:
            self._pending_state = state_dict
        else:
            self.preconditioner.load_state_dict(state_dict)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if not self._checkpoint_seen:  # the strategy's load_checkpoint was not the guarded one
            self._inspect_checkpoint(trainer, checkpoint)

    def _guard_checkpoint_loading(self, trainer: pl.Trainer) -> None:
        """Inspect the checkpoint of ``fit(ckpt_path=...)`` the moment the strategy has read it.

        Lightning restores the model weights before any callback hook sees the checkpoint, so a
        refusal in ``on_load_checkpoint`` would leave the weights loaded and the rest not. This
        wraps the strategy's ``load_checkpoint`` (on the instance, for one call; removed at the
        call, at teardown or on an exception) so that a refused K-FAC state stops the fit before
        anything is restored. (DeepSpeed's engine loads its weights inside that call; everything
        else is still untouched there.)
        """
        strategy = trainer.strategy
        own = vars(strategy)
        had_own, previous = "load_checkpoint" in own, own.get("load_checkpoint")
        inner = strategy.load_checkpoint

        def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
            unguard()
            self._build(trainer)  # (configure_model has run): the layers the state is checked against
            try:
                checkpoint = inner(*args, **kwargs)
            except Exception as e:  # a truncated or corrupt file: torch.load's errors say little
                if hasattr(e, "add_note"):  # Python >= 3.11
                    e.add_note(f"lightning-spdkfac: reading {_where(trainer)} failed (a truncated or corrupt "
                               "file?); the fit stopped before Lightning restored anything from it (weights, "
                               "optimizer, loops, K-FAC state are as they were)")
                raise
            self._inspect_checkpoint(trainer, checkpoint)
            return checkpoint

        def unguard() -> None:
            self._unguard = None
            if vars(strategy).get("load_checkpoint") is load_checkpoint:
                if had_own:
                    own["load_checkpoint"] = previous  # (the instance's own attribute, as vars() reads it)
                else:
                    del strategy.load_checkpoint

        own["load_checkpoint"] = load_checkpoint  # strategy.load_checkpoint, on the instance only
        self._unguard = unguard

    def _inspect_checkpoint(self, trainer: pl.Trainer, checkpoint: Any) -> None:
        """Decide, once per fit, what to do with the checkpoint's K-FAC state; refuse a bad one."""
        self._checkpoint_seen = True  # the checkpoint's state (or a fresh start) replaces the previous fit's
        states = checkpoint.get("callbacks") if isinstance(checkpoint, Mapping) else None
        state = states.get(self.state_key) if isinstance(states, Mapping) else None
        where = _where(trainer)
        fresh = "K-FAC starts fresh (step 0, no factors) while the rest of the checkpoint loads normally"
        if not state:
            self._start_fresh = True
            rank_zero_warn(f"{where} has no K-FAC state (saved by a run without the KFAC callback, e.g. plain "
                           f"SGD): {fresh}")
        elif self.load_state == "skip":
            self._start_fresh = True
            steps = state.get("steps") if isinstance(state, Mapping) else None
            saved = f" (saved at K-FAC step {steps})" if isinstance(steps, int) else ""
            rank_zero_warn(f"KFAC(load_state='skip'): the K-FAC state of {where}{saved} is not loaded; {fresh}")
        elif self.preconditioner is not None or (self._trainer is trainer and trainer.state.fn == TrainerFn.FITTING):
            try:
                self._build(trainer).check_state_dict(state)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None


KFACCallbackBody.__init__.__qualname__ = "KFAC.__init__"  # "KFAC.__init__() got an unexpected keyword ..."

# Arguments KFAC.__init__ checks itself (the K-FAC options by KFACOptions); others are held to their annotation.
_CHECKED = (*(f.name for f in dataclasses.fields(KFACOptions)), "summary", "log_step_time", "trace_step", "trace_dir")


class KFAC(KFACCallbackBody, Callback):
    # The ``pytorch_lightning`` flavour; ``lightning_spdkfac.unified.KFAC`` is the ``lightning.pytorch`` one
    # (the same body; each Trainer accepts the callbacks of its own namespace).
    __doc__ = KFACCallbackBody.__doc__
