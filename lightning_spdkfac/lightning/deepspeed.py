"""``SPDKFACDeepSpeedStrategy``: Lightning's DeepSpeed (ZeRO 0/1/2) with the SPD-KFAC scheduler.

Everything K-FAC does under ``SPDKFACStrategy`` happens here the same way: factor hooks on the
LightningModule's layers, factor reductions on a process group of their own (launched from the
hooks while DeepSpeed reduces gradients during backward), inversions placed over the ranks with
asynchronous inverse broadcasts. What differs is where the reduced gradients live:

- ZeRO 0 (fp32): ``param.grad``, averaged by the engine, rewritten in place.
- ZeRO 1/2 and DeepSpeed's bf16 optimizer: ``param.grad`` is None; each rank holds the averaged
  gradient of its partition as fragments of a flat fp32 buffer, which the optimizer reads.
  :class:`DeepSpeedGradAccess` assembles the full gradients of the K-FAC layers with **one**
  all-gather of the partitions (on gloo, one broadcast per rank): each rank sends the elements it
  owns once, half the bytes of an all-reduce. (The public ``deepspeed.utils.safe_get_full_grad``
  all-reduces a zero-padded full gradient once per parameter, i.e. two collectives per layer; the
  result is bitwise the same.) It writes the preconditioned gradient back with ``set_full_hp_grad``,
  which copies only this rank's fragment (no communication).
  Where the engine's internals differ from what that fused path expects, it falls back to
  ``safe_get_full_grad`` / ``safe_set_full_grad`` parameter by parameter.

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
import json
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, TypeGuard

import torch
import torch.distributed as dist
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

    class _ZeroParameter(torch.nn.Parameter):
        """A parameter as DeepSpeed's ZeRO 1/2 and bf16 optimizers leave it: what they attach to it."""

        _hp_mapping: Any  # its deepspeed.utils.tensor_fragment; None outside this rank's partition
        _index_in_param_group: int
        _dp_group: dist.ProcessGroup

        def set_full_hp_grad(self, value: torch.Tensor) -> None: ...


class DeepSpeedGradAccess(GradAccess):
    """Reduced gradients of a DeepSpeed engine at ZeRO stage 0, 1 or 2 (see the module docstring).

    ``open`` is collective: every rank calls it with the same parameters in the same order,
    between the engine's backward and its step.
    """

    def __init__(self, engine_fn: Callable[[], deepspeed.DeepSpeedEngine], fused: bool = True) -> None:
        self._engine_fn = engine_fn  # the engine exists only after the strategy's setup
        self.fused = fused
        self._fragments: list[_ZeroParameter] = []
        self._fused_path = False  # which path open() took, so close() writes back the same way
        # (the engine's optimizer, the parameters, their partition layout) of the last fused gather
        self._plan_cache: tuple[weakref.ref, tuple[weakref.ref, ...], _GatherPlan | None] | None = None

    @property
    def engine(self) -> deepspeed.DeepSpeedEngine:
        return self._engine_fn()

    def loss_scale(self) -> float:
        engine = self.engine
        if not engine.fp16_enabled():
            return 1.0
        opt = engine.optimizer
        scale: Any = getattr(opt, "cur_scale", None)
        if scale is None:
            scale = getattr(opt, "loss_scale", 1.0)
        return float(scale)

    @staticmethod
    def _partitioned(p: torch.nn.Parameter) -> TypeGuard[_ZeroParameter]:
        """Does the optimizer read this parameter's gradient from its fp32 fragments?"""
        if hasattr(p, "ds_id"):
            raise RuntimeError("K-FAC does not support ZeRO stage 3 (partitioned parameters)")
        return getattr(p, "_hp_grad", None) is not None or (p.grad is None and hasattr(p, "_hp_mapping"))

    def open(self, params: Sequence[torch.nn.Parameter]) -> dict[torch.nn.Parameter, torch.Tensor | None]:
        frag = [p for p in params if self._partitioned(p)]
        frag_ids = {id(p) for p in frag}
        grads = {p: None if id(p) in frag_ids else p.grad for p in params}
        fused = self._gather_fused(frag) if frag and self.fused and _fusable(frag) else None
        self._fused_path = fused is not None
        if frag:
            grads.update(fused if fused is not None else self._gather_each(frag))
        self._fragments = frag
        return grads

    @staticmethod
    def _gather_each(params: list[_ZeroParameter]) -> dict[torch.nn.Parameter, torch.Tensor | None]:
        from deepspeed.utils import safe_get_full_grad

        return {p: safe_get_full_grad(p) for p in params}

    def _gather_fused(
        self, params: list[_ZeroParameter], plan: _GatherPlan | None = None
    ) -> dict[torch.nn.Parameter, torch.Tensor | None] | None:
        """Full fp32 gradients of ``params`` with one all-gather of the partitions (see :func:`_gather_partitions`);
        None (on every rank) where the partitions do not tile the parameters. Collective.

        The layout of the partitions is exchanged once per engine and list of parameters, then reused.
        """
        if plan is None:
            plan = self._cached_plan(params)
        return _gather_partitions(params, plan)

    def _cached_plan(self, params: list[_ZeroParameter]) -> _GatherPlan | None:
        # Keyed by identity (weak references, so that an id cannot be reused by another object): every rank
        # calls open() with the same parameters of the same engine, so every rank hits or misses alike, and a
        # new engine (a new fit, a restored checkpoint's relinked optimizer) exchanges its layout again.
        optimizer = getattr(self.engine, "optimizer", None)
        cached = self._plan_cache
        if (cached is not None and cached[0]() is optimizer and len(cached[1]) == len(params)
                and all(ref() is p for ref, p in zip(cached[1], params))):
            return cached[2]
        plan = _exchange_plan(params)
        try:
            self._plan_cache = (weakref.ref(optimizer), tuple(weakref.ref(p) for p in params), plan)
        except TypeError:  # an optimizer without weak references: exchange the layout on every call
            self._plan_cache = None
        return plan

    def close(self, grads: dict[torch.nn.Parameter, torch.Tensor | None]) -> None:
        frag, self._fragments = self._fragments, []
        if not frag:
            return
        if self._fused_path:
            self._scatter(frag, grads)
            return
        from deepspeed.utils import safe_set_full_grad

        for p in frag:
            value = grads.get(p)
            if value is None:
                continue
            if getattr(p, "_hp_grad", None) is not None:
                # safe_set_full_grad would write the bf16 optimizer's low-precision staging gradient,
                # which its step no longer reads, and set_full_hp_grad rejects its full-size fp32
                # buffer when the parameter straddles two partitions: write what the step reads.
                if _fusable([p]):
                    self._scatter([p], grads)
                else:
                    p.set_full_hp_grad(value)
            else:
                safe_set_full_grad(p, value)

    @staticmethod
    def _scatter(params: list[_ZeroParameter], grads: dict[torch.nn.Parameter, torch.Tensor | None]) -> None:
        """Copy this rank's fragment of each full gradient back (local; the inverse of the fused gather).

        ``set_full_hp_grad`` does this too, but fails where the fragment is a full-size buffer
        (the bf16 optimizer's fp32 accumulation buffer, when a parameter straddles two partitions).
        """
        for p in params:
            mapping, value = p._hp_mapping, grads.get(p)
            if mapping is None or value is None:
                continue
            fragment = mapping.get_lp_grad_fragment(p._index_in_param_group)
            flat = value.reshape(-1)
            if fragment.numel() != p.numel():
                address = mapping.lp_fragment_address
                flat = flat.narrow(0, address.start, address.numel)
            fragment.data.copy_(flat.view_as(fragment))
            if hasattr(p, "_zero_optimizer"):  # CPU offload tracks overflow of what is written
                p._zero_optimizer.update_offload_overflow_tracker(value)


class _GatherPlan(NamedTuple):
    """How the fused gather moves the partitions of a list of parameters (the same on every rank but ``owned``)."""

    owned: tuple[tuple[int, int], ...]  # this rank's (start, numel) in each parameter; (0, 0) where it owns none
    chunk: int  # elements each rank sends: the largest share, the smaller ones zero-padded to it
    runs: tuple[tuple[int, int], ...]  # (offset, length) in the gathered buffer; concatenated: the full gradients


def _owned(params: Sequence[_ZeroParameter]) -> tuple[tuple[int, int], ...]:
    """This rank's (start, numel) in each parameter (the ``lp_fragment_address`` of its mapping); (0, 0): none."""
    owned = []
    for p in params:
        mapping = p._hp_mapping
        address = None if mapping is None else mapping.lp_fragment_address
        owned.append((0, 0) if address is None or address.numel == 0 else (int(address.start), int(address.numel)))
    return tuple(owned)


def _plan_layout(table: Sequence[Sequence[Sequence[int]]], numels: Sequence[int], rank: int) -> _GatherPlan | None:
    """The gather plan from every rank's (start, numel) in each parameter (``table[rank][param]``); None unless
    the pieces tile every parameter exactly once (then the fused gather cannot assemble it; nor is it ZeRO 1/2).

    Each rank sends its pieces in parameter order, padded to ``chunk``; a parameter's pieces, in the order
    of their starts, are its full gradient. Adjacent runs merge: where the partitions follow the parameters'
    order (DeepSpeed's flat buffer), the full gradients are one run, a view of the gathered buffer.
    """
    world = len(table)
    chunk = max((sum(n for _, n in row) for row in table), default=0)
    cursor = [r * chunk for r in range(world)]  # where each rank's next piece lands in the gathered buffer
    runs: list[list[int]] = []
    for i, numel in enumerate(numels):
        pieces = sorted((int(table[r][i][0]), int(table[r][i][1]), r) for r in range(world) if table[r][i][1] > 0)
        covered = 0
        for start, n, r in pieces:
            if start != covered:  # a gap or an overlap
                return None
            covered += n
            if runs and runs[-1][0] + runs[-1][1] == cursor[r]:
                runs[-1][1] += n
            else:
                runs.append([cursor[r], n])
            cursor[r] += n
        if covered != numel:
            return None
    owned = tuple((int(s), int(n)) if n > 0 else (0, 0) for s, n in table[rank])
    return _GatherPlan(owned, chunk, tuple((s, n) for s, n in runs))


def _all_gather(output: torch.Tensor, group: dist.ProcessGroup) -> None:
    """All-gather in place: rank r's input is ``output``'s r-th of ``world`` equal chunks, already filled.

    Gloo's all-gather moves its bytes several times slower than its all-reduce (on 2 CPU ranks, 19 MB
    each took 67 ms against 28 ms for an all-reduce of 38 MB); one broadcast per rank sends the same
    bytes in 17 ms. Other backends (NCCL) get their all-gather.
    """
    if dist.get_backend(group) == "gloo":
        chunks = output.chunk(dist.get_world_size(group))
        works = [dist.broadcast(chunk, src=dist.get_global_rank(group, r), group=group, async_op=True)
                 for r, chunk in enumerate(chunks)]
        for work in works:
            assert work is not None
            work.wait()
        return
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (renamed in torch 2.12)
    rank, size = dist.get_rank(group), output.numel() // dist.get_world_size(group)
    gather(output, output.narrow(0, rank * size, size), group=group)


def _exchange_plan(params: Sequence[_ZeroParameter]) -> _GatherPlan | None:
    """Every rank's (start, numel) in each parameter, all-gathered, as a :class:`_GatherPlan`. Collective."""
    group = params[0]._dp_group
    mine = torch.tensor(_owned(params), dtype=torch.int64, device=params[0].device).reshape(-1)
    every = mine.new_empty(dist.get_world_size(group) * mine.numel())
    every.view(-1, mine.numel())[dist.get_rank(group)].copy_(mine)
    _all_gather(every, group)
    table = every.view(-1, len(params), 2).tolist()
    return _plan_layout(table, [p.numel() for p in params], dist.get_rank(group))


def _gather_partitions(
    params: Sequence[_ZeroParameter], plan: _GatherPlan | None
) -> dict[torch.nn.Parameter, torch.Tensor | None] | None:
    """Full fp32 gradients of ``params``: each rank sends the pieces it owns once (an all-gather of
    ``plan.chunk`` elements per rank, see :func:`_all_gather`), every rank copies them into place. Collective; None where ``plan`` is.

    Bitwise what ``safe_get_full_grad`` returns: its all-reduce of zeros and one owner's value leaves the
    value, except that -0.0 + 0.0 is +0.0, which adding 0.0 to each piece as it is packed reproduces.
    """
    if plan is None:
        return None
    if _owned(params) != plan.owned:
        raise RuntimeError("the ZeRO partitions of the K-FAC layers' parameters changed without a new optimizer")
    group, device = params[0]._dp_group, params[0].device
    gathered = torch.empty(dist.get_world_size(group) * plan.chunk, dtype=torch.float32, device=device)
    send = gathered.narrow(0, dist.get_rank(group) * plan.chunk, plan.chunk)  # this rank's chunk, in place
    offset = 0
    for p, (start, numel) in zip(params, plan.owned):
        if numel == 0:
            continue
        fragment = p._hp_mapping.get_lp_grad_fragment(p._index_in_param_group).reshape(-1)
        if fragment.numel() == p.numel() and numel != p.numel():
            # The bf16 optimizer keeps a full accumulation buffer: send this rank's share of it only.
            fragment = fragment.narrow(0, start, numel)
        # + 0.0 in the copy: see the docstring (and it converts a bf16 fragment exactly)
        torch.add(fragment, 0.0, out=send.narrow(0, offset, numel))
        offset += numel
    send.narrow(0, offset, plan.chunk - offset).zero_()
    _all_gather(gathered, group)
    if len(plan.runs) == 1:
        full = gathered.narrow(0, *plan.runs[0])
    else:
        full = torch.cat([gathered.narrow(0, s, n) for s, n in plan.runs]) if plan.runs else gathered[:0]
    return {p: view.view(p.shape) for p, view in zip(params, full.split([p.numel() for p in params]))}


def _fusable(params: Sequence[torch.nn.Parameter]) -> bool:
    """Do the engine's internals look like the ones the fused gather is written against?

    Decided only from what is the same on every rank (a parameter outside this rank's partition
    has no mapping here but one elsewhere), so that all ranks take the same path.
    """
    import importlib

    # (``deepspeed.utils.tensor_fragment`` as an attribute is the class, not the module)
    module = importlib.import_module("deepspeed.utils.tensor_fragment")
    fragment_cls = getattr(module, "tensor_fragment", None)
    fields = getattr(fragment_cls, "__dataclass_fields__", {})
    if not (hasattr(fragment_cls, "get_lp_grad_fragment") and "lp_fragment_address" in fields):
        return False
    group = getattr(params[0], "_dp_group", None)
    return group is not None and all(
        getattr(p, "_dp_group", None) is group and hasattr(p, "_hp_mapping") for p in params
    )


if TYPE_CHECKING:
    _DeepSpeedBase = DeepSpeedStrategy  # the type checker's view; at run time each flavour adds its namespace's
else:
    _DeepSpeedBase = object


@spd_documented
class SPDKFACDeepSpeedStrategyBody(_SPDKFACStrategyMixin, _DeepSpeedBase):
    """DeepSpeed ZeRO stage 0, 1 or 2 plus the SPD-KFAC scheduler for the ``KFAC`` callback.

    Args:
{spd_arguments}
        stage: ZeRO stage: 0 (plain data parallel), 1 (optimizer states partitioned) or 2
            (gradients too). Stage 3 is refused: K-FAC preconditions whole layers.
        config: a DeepSpeed config dict or the path of a JSON file; it overrides ``stage`` and
            the other ZeRO arguments, as in Lightning's ``DeepSpeedStrategy``. Read and checked at
            construction (a missing or non-JSON file, or ``zero_optimization.stage`` 3, is refused).
        fused_grad_gather: assemble the full gradients of the K-FAC layers at ZeRO 1/2 with one
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
            val.check_int("stage", stage, low=0, accepted="the ZeRO stage 0, 1 or 2")
            if stage not in _ZERO_STAGES:
                raise ValueError(f"stage must be the ZeRO stage 0, 1 or 2, got {stage!r}: SPDKFACDeepSpeedStrategy "
                                 f"supports ZeRO stages 0, 1 and 2, not stage {stage!r}{_STAGE_3 if stage == 3 else ''}")
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
            _announce_op_build("ShareMemCommBuilder")  # init_distributed JIT-builds it on a first run, silently
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


_ZERO_STAGES = (0, 1, 2)
_FP16_PRECISIONS = ("16-mixed", "16-true")


def _announce_op_build(builder_name: str) -> bool:
    """One line before DeepSpeed JIT-builds the op ``builder_name`` on a first run (about a minute, which
    it spends silently): only when the op is compatible, not installed prebuilt and not in torch's
    extension cache. Returns whether it announced; a DeepSpeed or torch without these internals: silent."""
    try:
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import installed_ops
        from pytorch_lightning.utilities.rank_zero import rank_zero_info
        from torch.utils.cpp_extension import _get_build_directory

        builder = get_accelerator().create_op_builder(builder_name)
        if builder is None or installed_ops.get(builder.NAME, False):
            return False
        if not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            return False
        folder = _get_build_directory(builder.name, verbose=False)
    except Exception:
        return False
    if os.path.exists(os.path.join(folder, f"{builder.name}.so")):
        return False
    rank_zero_info(
        f"DeepSpeed is building its {builder.name} op once (about a minute, in {folder}); later runs reuse it"
    )
    return True


def _fp16_requested(config: Mapping | None, precision: str | None) -> bool:
    """Will the engine run in fp16? An ``fp16`` section in the DeepSpeed config decides (Lightning adds
    one from the precision only where the config has none), else the Trainer's precision."""
    section = (config or {}).get("fp16")
    if isinstance(section, Mapping):
        return bool(section.get("enabled", False))  # DeepSpeed's default for a section without "enabled"
    return precision in _FP16_PRECISIONS


def _deepspeed_fp16_support() -> tuple[bool, str]:
    """DeepSpeed's own answer (the one its engine checks in ``deepspeed.initialize``) and its device name."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    return bool(accelerator.is_fp16_supported()), str(accelerator.device_name())
_STAGE_3 = " (K-FAC preconditions whole layers, which stage 3 partitions; use stage 2)"


def _load_config(config: object) -> tuple[dict | None, str]:
    """``config`` (or the file named by PL_DEEPSPEED_CONFIG_PATH when it is None) as a dict, and where it
    came from for messages; checked here instead of in Lightning's ``DeepSpeedStrategy``, whose errors
    do not say which argument is wrong."""
    what = "None, a DeepSpeed config dict or the path of a JSON file holding one"
    source = "config"
    if config is None:
        env = os.environ.get(DeepSpeedStrategy.DEEPSPEED_ENV_VAR)
        if not env:
            return None, ""
        config, source = env, f"config (None, so the file named by ${DeepSpeedStrategy.DEEPSPEED_ENV_VAR})"
    if isinstance(config, Mapping):
        if not all(isinstance(k, str) for k in config):
            raise TypeError(f"{source} must be {what}; its keys must be strings, got {val.show(config)}")
        return dict(config), ""
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"{source} must be {what}, got {val.show(config)}")
    path = os.fspath(config)
    if not isinstance(path, str) or not path or "\x00" in path or not os.path.isfile(path):
        raise ValueError(f"{source} must be {what}, got {config!r}, which is not a file")
    try:
        with open(path) as f:
            loaded = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{source} must be {what}, got {config!r}, which cannot be read as JSON: {e}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{source} must be {what}, got {config!r}, which holds {val.show(loaded)}, not an object")
    return loaded, f" (in config={config!r})"


def _check_zero_stage(config: dict | None, origin: str = "") -> None:
    """ZeRO stage 0, 1 or 2 in a DeepSpeed config; ``origin`` names the file it was read from."""
    zero = (config or {}).get("zero_optimization")
    if zero is None:
        return
    if not isinstance(zero, Mapping):
        raise TypeError(
            f"config['zero_optimization'] must be a dict such as {{'stage': 2}}, got {val.show(zero)}{origin}"
        )
    stage = zero.get("stage", 0)
    if not val.is_int(stage):
        raise TypeError(
            f"config['zero_optimization']['stage'] must be the ZeRO stage 0, 1 or 2, got {val.show(stage)}{origin}"
        )
    if stage not in _ZERO_STAGES:
        raise ValueError(
            f"config['zero_optimization']['stage'] must be 0, 1 or 2: SPDKFACDeepSpeedStrategy supports ZeRO stages "
            f"0, 1 and 2, but the DeepSpeed config asks for stage {stage!r}{origin}"
            + (_STAGE_3 if stage == 3 else "")
        )


class SPDKFACDeepSpeedStrategy(SPDKFACDeepSpeedStrategyBody, DeepSpeedStrategy):
    # The ``pytorch_lightning`` flavour; ``lightning_spdkfac.unified`` has the ``lightning.pytorch`` one.
    __doc__ = SPDKFACDeepSpeedStrategyBody.__doc__


SPDKFACDeepSpeedStrategy.register_strategies(StrategyRegistry)
