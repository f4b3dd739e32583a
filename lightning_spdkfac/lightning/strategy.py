"""``SPDKFACStrategy``: Lightning's DDP with the SPD-KFAC factor-communication schedule.

DDP reduces gradients in buckets during backward as usual. Beside it, on a process group of
its own, this strategy runs the K-FAC communication chosen by ``schedule``:

- ``"spd"`` (default): factor all-reduces launched from the hooks as soon as their fusion
  group is complete (pipelining), groups planned by dynamic tensor fusion from a measured
  alpha-beta model and measured factor ready times, inversions placed by load balancing with
  asynchronous inverse broadcasts.
- ``"mpd"``: factors all-reduced after backward, one reduction each; inversions round-robin
  over ranks; inverses broadcast.
- ``"dkfac"``: factors all-reduced after backward, one reduction each; every rank inverts
  every factor.

``pipelining``, ``fusion`` and ``placement`` override the schedule's parts one by one (the
ablations of the paper). The ``KFAC`` callback asks the strategy for its distributor.
"""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

from .. import validation as val
from ..comm.auto import AutoDistributor
from ..comm.dpkfac import DPKFACDistributor
from ..comm.scheduler import SPDDistributor, SPDOptions
from ..kfac.distributor import Distributor
from ..kfac.gradients import GradAccess
from ..vocabulary import (
    DDP_STRATEGY_NAMES,
    AsyncInversesChoice,
    CommDtypeName,
    FusionName,
    PlacementName,
    ScheduleChoice,
)

# The strategies' signature defaults are SPDOptions' own (one test compares them all).
SPD_DEFAULTS = SPDOptions()


# The K-FAC schedule arguments, spelled out in each strategy's signature (LightningCLI reads them there).
SPD_ARGUMENTS = ("pipelining", "fusion", "placement", "bucket_mb", "profile_steps", "replan_every",
                 "small_factor", "comm_dtype", "comm_timeout_s", "async_inverses", "auto_rounds")


def _spd_options(arguments: dict[str, Any]) -> SPDOptions:
    """SPDOptions from a strategy's ``locals()`` (validated there, with errors naming the argument)."""
    options = {k: arguments[k] for k in SPD_ARGUMENTS}
    return SPDOptions.from_schedule(arguments["schedule"], **options)


# The K-FAC schedule arguments as both strategies document them (LightningCLI's --help reads these):
# written once here and put into each strategy's docstring by ``spd_documented``.
SPD_ARGUMENTS_DOC = """        schedule: ``"spd"``, ``"mpd"`` or ``"dkfac"`` (see :mod:`lightning_spdkfac.lightning.strategy`), or
            ``"auto"``: time ``spd``, ``spd`` without pipelining, ``mpd`` and ``dkfac`` on this job, each over
            ``auto_rounds`` slots of whole inverse periods in rotation after ``spd``'s profiling, and keep
            the fastest (each rank's fastest slot, the slowest rank's decides, the same on every rank; the
            table is logged). The schedules
            compute the same updates, so the timing steps train normally.
        pipelining: launch factor reductions from the hooks (default: True for ``spd``).
        fusion: how factor reductions are grouped: ``"dtf"`` (planned from the cost model; the
            default for ``spd``), ``"layerwise"`` (one per factor; the default otherwise),
            ``"all"`` (one for all) or ``"bucket"`` (consecutive factors up to ``bucket_mb``).
        placement: who inverts what: ``"lbp_channel"`` (default for ``spd``: the paper's
            load-balanced placement that also weighs the broadcast channel all ranks share, chosen
            from the cluster simulator, see docs/simulator.md), ``"lbp"`` (the paper's),
            ``"round_robin"`` (``mpd``) or ``"replicated"`` (every rank inverts everything; ``dkfac``).
        bucket_mb: bucket size of ``fusion="bucket"``, in MiB.
        profile_steps: optimizer steps whose factor ready times are measured before the plan is
            made (the steps before it are warm-up); the plan is then fixed until a re-plan.
        replan_every: re-measure and re-plan every this many steps (None: never); with ``schedule="auto"``,
            time the candidates again and re-decide.
        small_factor: factors with a side below this are inverted on every rank; None lets
            the cost model decide (inverting is cheaper than broadcasting the inverse).
        comm_dtype: dtype of factor and inverse messages ("float32" or "bfloat16").
        comm_timeout_s: seconds any rank waits for one K-FAC factor all-reduce or inverse broadcast
            before raising ``KFACCommError`` (naming the collective and phase) instead of hanging
            when a peer crashed or stalls (>= 0.001). It is also the default ``timeout`` of the
            process groups, so that the gradient all-reduce and Lightning's barriers, which a stalled
            rank blocks first, fail after it too (the backend's error then gets a note naming it).
        async_inverses: compute the inverses of an inverse step (and broadcast them, on a process group
            of their own) on a worker thread during the optimizer step and the next forward/backward,
            preconditioning meanwhile with the inverses held: one step staler, off the step's path (see
            the ``KFAC`` callback's ``async_inverses``). None (default): the callback's setting. ``"auto"``:
            timed with and without, like ``schedule="auto"``, and the faster kept (the steps then differ
            in which inverses they use while it times).
        auto_rounds: slots (of whole inverse periods, at least 5 steps) each candidate of
            ``schedule="auto"`` / ``async_inverses="auto"`` is timed over, interleaved."""
SPD_RULES_DOC = """    The K-FAC arguments are checked at construction (no process group is needed for that), by
    :class:`~lightning_spdkfac.comm.scheduler.SPDOptions`: a wrong type raises ``TypeError``, a value
    that is not accepted ``ValueError``, naming the argument. The schedule only picks the defaults of
    ``pipelining``, ``fusion`` and ``placement``; options the resulting combination would ignore are
    refused: ``bucket_mb`` without ``fusion="bucket"``, ``replan_every`` without ``pipelining=True``
    and ``fusion="dtf"``, ``small_factor`` without a load-balanced placement (``"lbp"`` or ``"lbp_channel"``)."""


def spd_documented(cls: type) -> type:
    """Fill ``{spd_arguments}`` and ``{spd_rules}`` in a strategy's docstring."""
    doc = cls.__doc__ or ""
    cls.__doc__ = doc.replace("{spd_arguments}", SPD_ARGUMENTS_DOC).replace("{spd_rules}", SPD_RULES_DOC)
    return cls


def pg_timeout(timeout: timedelta | None, options: SPDOptions) -> timedelta:
    """The process groups' timeout: ``timeout``, or by default ``comm_timeout_s``.

    DDP's gradient all-reduce, DeepSpeed's reductions and Lightning's barriers wait on the process groups,
    not on K-FAC's bounded waits: a stalled or uneven rank leaves the others blocked there, bounded only
    by this timeout (torch's default is 30 minutes). Defaulting it to ``comm_timeout_s`` gives one bound
    for every wait of the run.
    """
    return timeout if timeout is not None else timedelta(seconds=options.comm_timeout_s)


def _timeout_note(exception: BaseException, timeout: timedelta | None) -> None:
    """Say which setting bounded a collective that timed out (the backend's message names neither)."""
    text = str(exception).lower()
    if not hasattr(exception, "add_note") or not ("timed out" in text or "timeout" in text):
        return
    seconds = timeout.total_seconds() if timeout is not None else float("nan")
    exception.add_note(
        f"lightning-spdkfac: a collective waited longer than the process-group timeout ({seconds:g} s: the "
        "strategy's timeout=, by default its comm_timeout_s). Another rank stalled, crashed or ran a different "
        "number of steps (uneven data, a rank-dependent early stop); raise comm_timeout_s (or timeout=) only if "
        "a rank is legitimately that much slower.")


class _SPDKFACStrategyMixin:
    """What every K-FAC-aware strategy adds: SPD options, a factor process group, the distributor."""

    # The Lightning namespace the concrete class subclasses: "pytorch_lightning" or "lightning.pytorch".
    # The bodies are written once; each namespace gets its own thin classes (see lightning_spdkfac.unified).
    lightning_package: ClassVar[str] = "pytorch_lightning"
    spd_options: SPDOptions
    _factor_group: dist.ProcessGroup | None = None
    # Provided by the strategy the mixin is combined with (DDPStrategy, DeepSpeedStrategy):
    _timeout: timedelta | None  # of the process groups

    if TYPE_CHECKING:

        @property
        def root_device(self) -> torch.device: ...

    def _lightning(self, module: str) -> Any:
        """``module`` of this class's Lightning namespace, e.g. ``_lightning("strategies").DDPStrategy``."""
        return importlib.import_module(f"{self.lightning_package}.{module}")

    def _new_factor_group(self) -> None:
        # K-FAC traffic gets a group of its own so that it runs beside the gradient reduction
        # (DDP buckets, DeepSpeed's reduce) instead of queueing behind it. Every rank must create
        # it, in the same order.
        self._factor_group = dist.new_group(backend=dist.get_backend(), timeout=self._timeout)

    def make_kfac_distributor(self) -> Distributor:
        """Called by the ``KFAC`` callback at fit start."""
        group = self._factor_group if dist.is_initialized() else None
        if self.spd_options.is_auto:
            return AutoDistributor(self.spd_options, process_group=group, device=self.root_device)
        if self.spd_options.schedule == "dpkfac":
            return DPKFACDistributor(self.spd_options, process_group=group, device=self.root_device)
        return SPDDistributor(self.spd_options, process_group=group, device=self.root_device)

    def make_kfac_grad_access(self) -> GradAccess:
        """Where the ``KFAC`` callback reads and writes the reduced gradients."""
        return GradAccess()

    def kfac_final_micro_batch(self) -> bool | None:
        """Whether the coming micro-batch ends an optimizer step; None: ask the fit loop."""
        return None

    def on_exception(self, exception: BaseException) -> None:
        _timeout_note(exception, self._timeout)
        super().on_exception(exception)  # type: ignore[misc]  # (DDPStrategy / DeepSpeedStrategy)

    def _destroy_factor_group(self) -> None:
        if self._factor_group is not None and dist.is_initialized():
            dist.destroy_process_group(self._factor_group)
        self._factor_group = None


if TYPE_CHECKING:
    _DDPBase = DDPStrategy  # what the type checker sees; at run time each flavour adds its namespace's DDPStrategy
else:
    _DDPBase = object


@spd_documented
class SPDKFACStrategyBody(_SPDKFACStrategyMixin, _DDPBase):
    """DDP plus the SPD-KFAC scheduler for the ``KFAC`` callback.

    Args:
{spd_arguments}
        timeout: timeout of the process groups (DDP's and the K-FAC factor group), a positive
            ``datetime.timedelta``; None (default): ``comm_timeout_s``. Raise it if a rank may
            legitimately wait longer than that at a barrier (saving a very large checkpoint).
        **kwargs: everything ``DDPStrategy`` accepts.

{spd_rules}
    """

    strategy_name = "spdkfac"

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
        timeout: timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        arguments = dict(locals())
        # Each argument alone first, then the K-FAC options with their combination rules; reported() hands
        # an error to the CLI, which prints it as one line (jsonargparse's Union error does not chain it).
        with val.reported():
            val.check_timedelta("timeout", timeout)
            val.check_annotations(SPDKFACStrategyBody.__init__, arguments, skip=("schedule", *SPD_ARGUMENTS, "timeout"))
            self.spd_options = _spd_options(arguments)
            timeout = pg_timeout(timeout, self.spd_options)
            _refuse_unknown_ddp_kwargs(type(self), kwargs)
            super().__init__(timeout=timeout, **kwargs)

    def setup_distributed(self) -> None:
        super().setup_distributed()
        self._new_factor_group()

    def teardown(self) -> None:
        self._destroy_factor_group()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, fixed in DDP_STRATEGY_NAMES.items():
            what = ", ".join(f"{k} {v!r}" for k, v in fixed.items())
            strategy_registry.register(name, cls, description=f"DDP + SPD-KFAC scheduling, {what}",
                                       override=True, **fixed)


def _refuse_unknown_ddp_kwargs(cls: type, kwargs: dict[str, Any]) -> None:
    """A keyword that neither the strategy, Lightning's DDPStrategy nor DistributedDataParallel takes (a misspelled
    ``schedul=``) is a TypeError now, naming the strategy and the nearest names, instead of going to DDP's
    kwargs and failing (or not) when the model is wrapped."""
    if not kwargs:
        return
    import difflib
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    ddp_strategy = next((c for c in cls.__mro__ if c.__name__ == "DDPStrategy"), DDPStrategy)
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    known = {name for c in (SPDKFACStrategyBody, ddp_strategy, DistributedDataParallel)
             for name, p in inspect.signature(c).parameters.items() if p.kind in named} - {"self", "module"}
    for name in kwargs:
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
            raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {name!r}: neither a strategy "
                            f"argument nor one of DDPStrategy's or DistributedDataParallel's{hint}")


class SPDKFACStrategy(SPDKFACStrategyBody, DDPStrategy):
    # The ``pytorch_lightning`` flavour; ``lightning_spdkfac.unified.SPDKFACStrategy`` is the ``lightning.pytorch`` one.
    __doc__ = SPDKFACStrategyBody.__doc__


SPDKFACStrategy.register_strategies(StrategyRegistry)
