"""``SPDKFACDeepSpeedStrategy``: Lightning's DeepSpeed (ZeRO 0/1/2/3) with the SPD-KFAC scheduler.

Everything K-FAC does under ``SPDKFACStrategy`` happens here the same way: factor hooks on the
LightningModule's layers, factor reductions on a process group of their own (launched from the
hooks while DeepSpeed reduces gradients during backward), inversions placed over the ranks with
asynchronous inverse broadcasts. What differs is where the reduced gradients live: at ZeRO 0 in
``param.grad``, at ZeRO 1/2 (and under DeepSpeed's bf16 optimizer) as each rank's fragments of a flat
fp32 buffer, which :class:`~.deepspeed_grads.DeepSpeedGradAccess` assembles with one all-gather and
writes back (:mod:`.deepspeed_grads`); at ZeRO 3, where the parameters are partitioned too, as each rank's
slice of every gradient, which :class:`~.deepspeed_zero3.DeepSpeedZero3GradAccess` assembles the same way,
gathering the K-FAC layers' parameters for the step (:mod:`.deepspeed_zero3`). The arguments, the DeepSpeed config and the machine's fp16 support
are checked before DeepSpeed runs (:mod:`.deepspeed_config`).

DeepSpeed calls the optimizer hooks on every micro-batch; K-FAC preconditions on the micro-batch
that ends the accumulation, as the engine itself decides (``is_gradient_accumulation_boundary``).
Under fp16, gradients and output gradients carry DeepSpeed's dynamic loss scale at that point:
the G factors are divided by its square, the KL clip accounts for it, and an overflow step
(non-finite gradients) updates no factor and is left to DeepSpeed, which skips it.

Lightning's ``DeepSpeedStrategy`` only accepts CUDA. On CPU this strategy initializes the
process group with gloo itself, hands DeepSpeed's communication module that group, and gives
the engine device rank -1; the CUDA path is Lightning's own.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning_fabric.utilities.distributed import _init_dist_connection
from lightning_fabric.utilities.seed import reset_seed
from pytorch_lightning.strategies import DeepSpeedStrategy, StrategyRegistry

from .. import validation as val
from ..kfac.gradients import GradAccess
from ..vocabulary import (
    DEEPSPEED_STRATEGY_NAMES,
    AsyncInversesChoice,
    CommDtypeName,
    FusionName,
    PlacementName,
    ScheduleChoice,
)
from .deepspeed_config import (
    _FP16_PRECISIONS,
    _ZERO_STAGES,
    _announce_op_build,
    _check_zero_stage,
    _deepspeed_fp16_support,
    _fp16_requested,
    _load_config,
    _refuse_stale_op_lock,
)
from .deepspeed_grads import DeepSpeedGradAccess
from .deepspeed_zero3 import DeepSpeedZero3GradAccess
from .strategy import (
    SPD_ARGUMENTS,
    SPD_DEFAULTS,
    _spd_options,
    _SPDKFACStrategyMixin,
    pg_timeout,
    spd_documented,
)

if TYPE_CHECKING:
    import deepspeed
    import pytorch_lightning as pl
    from torch.nn import Module
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

__all__ = ["DeepSpeedGradAccess", "DeepSpeedZero3GradAccess", "SPDKFACDeepSpeedStrategy", "SPDKFACDeepSpeedStrategyBody"]

if TYPE_CHECKING:
    _DeepSpeedBase = DeepSpeedStrategy  # the type checker's view; at run time each flavour adds its namespace's
else:
    _DeepSpeedBase = object


@spd_documented
class SPDKFACDeepSpeedStrategyBody(_SPDKFACStrategyMixin, _DeepSpeedBase):
    """DeepSpeed ZeRO stage 0, 1, 2 or 3 plus the SPD-KFAC scheduler for the ``KFAC`` callback.

    Args:
{spd_arguments}
        stage: ZeRO stage: 0 (plain data parallel), 1 (optimizer states partitioned), 2
            (gradients too) or 3 (parameters too: K-FAC gathers the full gradients and parameters of its
            layers for its step; offload is refused at stage 3).
        config: a DeepSpeed config dict or the path of a JSON file; it overrides ``stage`` and
            the other ZeRO arguments, as in Lightning's ``DeepSpeedStrategy``. Read and checked at
            construction (a missing or non-JSON file, a ZeRO stage other than 0 to 3, or offload at stage 3,
            is refused).
        fused_grad_gather: assemble the full gradients of the K-FAC layers at ZeRO 1/2/3 with one
            all-gather of the partitions (True) or with ``deepspeed.utils.safe_get_full_grad`` per parameter.
        timeout: timeout of the process groups, a positive ``datetime.timedelta``; None (default):
            ``comm_timeout_s`` (see SPDKFACStrategy).
        **kwargs: everything Lightning's ``DeepSpeedStrategy`` accepts.

{spd_rules} The DeepSpeed arguments above are checked at construction too, under the same rule.
    """

    strategy_name = "spdkfac_deepspeed"

    def __init__(
        self,
        schedule: ScheduleChoice = SPD_DEFAULTS.schedule,
        pipelining: bool | None = None,
        fusion: FusionName | None = None,
        placement: PlacementName | None = None,
        bucket_mb: float = SPD_DEFAULTS.bucket_mb,
        profile_steps: tuple[int, int] = SPD_DEFAULTS.profile_steps,
        replan_every: int | None = SPD_DEFAULTS.replan_every,
        small_factor: int | None = SPD_DEFAULTS.small_factor,
        comm_dtype: CommDtypeName = SPD_DEFAULTS.comm_dtype,
        comm_timeout_s: float = SPD_DEFAULTS.comm_timeout_s,
        async_inverses: AsyncInversesChoice = SPD_DEFAULTS.async_inverses,
        auto_rounds: int = SPD_DEFAULTS.auto_rounds,
        stage: int = 2,
        config: str | dict[str, Any] | None = None,
        fused_grad_gather: bool = True,
        timeout: timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        arguments = dict(locals())
        # Each argument alone first, then the K-FAC options with their combination rules (reported(): see
        # SPDKFACStrategy).
        with val.reported():
            val.check_int("stage", stage, low=0, accepted="the ZeRO stage 0, 1, 2 or 3")
            if stage not in _ZERO_STAGES:
                raise ValueError(f"stage must be the ZeRO stage 0, 1, 2 or 3, got {stage!r}: SPDKFACDeepSpeedStrategy "
                                 f"supports ZeRO stages 0 to 3, not stage {stage!r}")
            config, origin = _load_config(config)
            if config is not None:
                _check_zero_stage(config, origin)
            val.check_bool("fused_grad_gather", fused_grad_gather)
            self.fused_grad_gather = fused_grad_gather
            val.check_timedelta("timeout", timeout)
            val.check_annotations(SPDKFACDeepSpeedStrategyBody.__init__, arguments,
                                 skip=("schedule", *SPD_ARGUMENTS, "stage", "config", "fused_grad_gather", "timeout"))
            self.spd_options = _spd_options(arguments)
            timeout = pg_timeout(timeout, self.spd_options)
            super().__init__(stage=stage, config=config, timeout=timeout, **kwargs)
            _check_zero_stage(self.config)

    # -------------------------------------------------------------- CPU (gloo) support
    def _on_cuda(self) -> bool:
        return isinstance(self.accelerator, self._lightning("accelerators").CUDAAccelerator)

    def _configure_launcher(self) -> None:
        # The Trainer calls this once the accelerator and the precision are known, in the launching
        # process and before any process is started: the earliest point a precision can be refused.
        with val.reported():
            self._check_fp16_supported()
        super()._configure_launcher()

    def _check_fp16_supported(self) -> None:
        """Refuse fp16 where DeepSpeed's accelerator cannot run it, before any process group or engine.

        DeepSpeed's engine raises "Type fp16 is not supported on your device." inside
        ``deepspeed.initialize`` on every rank; its CPU accelerator accepts fp16 only where oneDNN
        has fp16 kernels (CPUs with AVX512-FP16 or AMX-FP16), so the same script would run on one
        x86 machine and die on another.
        """
        if self._on_cuda() or self.accelerator is None:
            return
        precision = getattr(self._precision_plugin, "precision", None)
        if not _fp16_requested(self.config, precision):
            return
        supported, device = _deepspeed_fp16_support()
        if supported:
            return
        asked = f"precision={precision!r}" if precision in _FP16_PRECISIONS else "config['fp16']['enabled']=True"
        why = (
            "DeepSpeed's CPU accelerator runs fp16 only on CPUs with oneDNN fp16 kernels (AVX512-FP16 or "
            "AMX-FP16), and torch.ops.mkldnn._is_mkldnn_fp16_supported() is False on this one"
            if device == "cpu" else f"DeepSpeed's {device!r} accelerator reports no fp16 support"
        )
        raise ValueError(
            f"{asked} cannot run under SPDKFACDeepSpeedStrategy on this machine: {why}. Use "
            "precision='bf16-mixed' (DeepSpeed's CPU accelerator supports bf16) or precision='32-true'"
            + ("" if precision in _FP16_PRECISIONS else ", and remove the 'fp16' section from the DeepSpeed config")
        )

    def setup_environment(self) -> None:
        self._check_fp16_supported()  # again, for a strategy whose launcher was configured elsewhere
        if self._on_cuda():
            super().setup_environment()
        else:  # DeepSpeedStrategy refuses non-CUDA accelerators; DDP's setup is what it needs
            self._lightning("strategies").DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        if self._on_cuda():
            super().setup_distributed()
        else:
            # Lightning's version checks CUDA device indices and leaves DeepSpeed's comm backend
            # uninitialized on CPU: start torch.distributed (gloo) here, then let DeepSpeed adopt it.
            import deepspeed

            reset_seed()
            self.set_world_ranks()
            self._set_node_environment_variables()
            self._process_group_backend = self._get_process_group_backend()
            assert self.cluster_environment is not None  # (asserted by _set_node_environment_variables too)
            _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout)
            # init_distributed JIT-builds it on a first run, silently, and waits forever on a killed build's lock
            _refuse_stale_op_lock("ShareMemCommBuilder")
            _announce_op_build("ShareMemCommBuilder")
            deepspeed.init_distributed(self._process_group_backend, timeout=self._timeout)
        self._new_factor_group()

    def setup(self, trainer: pl.Trainer) -> None:
        self._init_config_if_needed()
        _check_zero_stage(self.config)
        super().setup(trainer)

    def _setup_model_and_optimizer(
        self,
        model: Module,
        optimizer: Optimizer | None,
        lr_scheduler: LRScheduler | ReduceLROnPlateau | None = None,
    ) -> tuple[deepspeed.DeepSpeedEngine, Optimizer]:
        import deepspeed

        # The engine compares device_rank with 0; a CPU device has index None: -1 means "no GPU".
        index = self.root_device.index
        deepspeed_engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=-1 if index is None else index),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return deepspeed_engine, deepspeed_optimizer

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        # Lightning already divides the loss by accumulate_grad_batches; the engine would divide
        # it again by gradient_accumulation_steps (Lightning-AI/pytorch-lightning#6170), so that
        # accumulating k micro-batches would not equal one k-times larger batch as under DDP.
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def teardown(self) -> None:
        self._destroy_factor_group()
        super().teardown()

    # -------------------------------------------------------------- K-FAC seams
    def make_kfac_grad_access(self) -> GradAccess:
        # (called once the config is final: at the fit's start, after setup)
        if (self.config or {}).get("zero_optimization", {}).get("stage", 0) == 3:
            return DeepSpeedZero3GradAccess(lambda: self.deepspeed_engine, fused=self.fused_grad_gather)
        return DeepSpeedGradAccess(lambda: self.deepspeed_engine, fused=self.fused_grad_gather)

    def kfac_final_micro_batch(self) -> bool | None:
        engine: Any = self.model  # the DeepSpeedEngine once set up (DeepSpeed has no type information)
        if engine is None or not hasattr(engine, "is_gradient_accumulation_boundary"):
            return None
        return bool(engine.is_gradient_accumulation_boundary())

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, fixed in DEEPSPEED_STRATEGY_NAMES.items():
            strategy_registry.register(
                name, cls, description=f"DeepSpeed ZeRO stage {fixed['stage']} + SPD-KFAC scheduling",
                override=True, **fixed,
            )


class SPDKFACDeepSpeedStrategy(SPDKFACDeepSpeedStrategyBody, DeepSpeedStrategy):
    # The ``pytorch_lightning`` flavour; ``lightning_spdkfac.unified`` has the ``lightning.pytorch`` one.
    __doc__ = SPDKFACDeepSpeedStrategyBody.__doc__


SPDKFACDeepSpeedStrategy.register_strategies(StrategyRegistry)
