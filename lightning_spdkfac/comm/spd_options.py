"""The options of the distributed schedules (:class:`SPDOptions`): one source of truth, validated by argument name.

They live apart from the distributor that runs them (:mod:`.scheduler`) so that the simulator, the planner and the
strategies read them without the distributor's machinery.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from .. import validation as val
from ..vocabulary import (
    COMM_DTYPE_NAMES,
    FUSIONS,
    LOAD_BALANCED_PLACEMENTS,
    PLACEMENTS,
    SCHEDULE_CHOICES,
    SCHEDULE_PARTS,
    AsyncInversesChoice,
    CommDtypeName,
    FusionName,
    PlacementName,
    ScheduleChoice,
)

__all__ = ["MAX_COMM_TIMEOUT_S", "MIN_COMM_TIMEOUT_S", "SPDOptions"]

_DEFAULT_BUCKET_MB = 4.0
_DEFAULT_PROFILE_STEPS = (3, 8)
_DEFAULT_AUTO_ROUNDS = 3


MIN_COMM_TIMEOUT_S = 1e-3  # comm_timeout_s below a millisecond would round to torch's "no timeout"
MAX_COMM_TIMEOUT_S = 1e9  # about 31 years: above it torch's timedelta overflows (at 999999999 days)


@dataclass(frozen=True)
class SPDOptions:
    """One source of truth for the schedule's options (validated here, by argument name).

    Every field is checked at construction: a value of the wrong type raises ``TypeError``, a
    value that is not accepted ``ValueError``, each message naming the option. The schedule name
    only chooses the defaults of ``pipelining``, ``fusion`` and ``placement``; each of them can be
    overridden for any schedule (the ablations), and what the resulting combination does not use
    must not be set:

    - ``bucket_mb`` (other than its default 4.0) only with ``fusion="bucket"``;
    - ``replan_every`` only with ``pipelining=True`` and ``fusion="dtf"`` (the only combination that
      measures factor ready times: re-planning re-measures them);
    - ``small_factor`` only with ``placement="lbp"`` or ``"lbp_channel"`` (the others do not replicate by size);
    - with ``schedule="auto"`` (the strategy times the candidates and keeps the fastest, comm/auto.py), none of
      ``pipelining``, ``fusion``, ``placement``, ``bucket_mb``, ``small_factor``: those are what it chooses, and
      ``replan_every`` re-decides;
    - ``auto_rounds`` (other than its default) only with ``schedule="auto"`` or ``async_inverses="auto"``.

    ``profile_steps`` is validated but inert without ``pipelining=True, fusion="dtf"``: it has a
    non-null default that every strategy passes on, so a composed YAML could not unset it.
    A world size of 1 is fine with every combination (placement and fusion then do nothing).
    """

    schedule: ScheduleChoice = "spd"
    pipelining: bool = True
    fusion: FusionName = "dtf"
    placement: PlacementName = "lbp_channel"
    bucket_mb: float = _DEFAULT_BUCKET_MB
    profile_steps: tuple[int, int] = _DEFAULT_PROFILE_STEPS
    replan_every: int | None = None
    small_factor: int | None = None
    comm_dtype: CommDtypeName = "float32"
    comm_timeout_s: float = 600.0  # bound on each wait for a K-FAC collective (comm/faults.py)
    fuse_g: bool = True  # False: G factors each reduced alone (the original SPD-KFAC code; for ablations)
    # Inversions and inverse broadcasts off the step's path (KFACOptions.async_inverses); None: the preconditioner's
    # option decides; "auto": timed both ways, like schedule="auto".
    async_inverses: AsyncInversesChoice = None
    auto_rounds: int = _DEFAULT_AUTO_ROUNDS  # "auto": inverse periods each candidate is timed over, interleaved

    @classmethod
    def from_schedule(cls, schedule: str = "spd", **overrides: Any) -> SPDOptions:
        """The options of ``schedule``; ``pipelining``, ``fusion`` or ``placement`` None: the schedule's own."""
        name = val.check_choice("schedule", schedule, SCHEDULE_CHOICES)
        fields = {f.name for f in dataclasses.fields(cls)} - {"schedule"}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(f"SPDOptions has no option {unknown[0]!r}; the options are {', '.join(sorted(fields))}")
        # None is "the schedule's own choice" for these three only (checked here so that the message
        # lists None among what is accepted); any other option is passed on as given.
        val.check_bool("pipelining", overrides.get("pipelining"), optional=True)
        val.check_choice("fusion", overrides.get("fusion"), FUSIONS, optional=True)
        val.check_choice("placement", overrides.get("placement"), PLACEMENTS, optional=True)
        values = dict(overrides)
        if name == "auto":
            chosen = [k for k in ("pipelining", "fusion", "placement") if values.get(k) is not None]
            if chosen:
                raise ValueError(f"{chosen[0]} must be None with schedule='auto' (the candidates are timed and the "
                                 f"fastest kept; that is what it chooses), got {chosen[0]}={values[chosen[0]]!r}; set "
                                 f"{', '.join(chosen)} to None (null in YAML), or name a schedule")
        for k, default in SCHEDULE_PARTS["spd" if name == "auto" else name].items():
            if values.get(k) is None:
                values[k] = default
        return cls(schedule=name, **values)

    def __post_init__(self) -> None:
        # Each option alone first, then the combinations (so a combination error always means
        # that every option is valid on its own).
        val.check_choice("schedule", self.schedule, SCHEDULE_CHOICES)
        val.check_bool("pipelining", self.pipelining)
        val.check_choice("fusion", self.fusion, FUSIONS)
        val.check_choice("placement", self.placement, PLACEMENTS)
        val.check_real("bucket_mb", self.bucket_mb, val.POSITIVE)
        object.__setattr__(self, "profile_steps", _profile_steps(self.profile_steps))
        ps = self.profile_steps
        val.check_int("replan_every", self.replan_every, low=ps[1] + 1, optional=True,
                      accepted=f"an integer > profile_steps[1] ({ps[1]})")
        val.check_int("small_factor", self.small_factor, low=0, optional=True)
        val.check_choice("comm_dtype", self.comm_dtype, COMM_DTYPE_NAMES)
        if val.is_real(self.comm_timeout_s) and 0 < float(self.comm_timeout_s) < MIN_COMM_TIMEOUT_S:
            # torch counts waits in whole milliseconds, and a wait of 0 means "no timeout": a bound below
            # 1 ms would silently become no bound at all.
            raise ValueError(f"comm_timeout_s must be >= {MIN_COMM_TIMEOUT_S:g} (seconds; torch's waits count "
                             f"whole milliseconds and 0 means no timeout), got {self.comm_timeout_s!r}")
        val.check_real("comm_timeout_s", self.comm_timeout_s, val.POSITIVE)
        if float(self.comm_timeout_s) > MAX_COMM_TIMEOUT_S:
            raise ValueError(f"comm_timeout_s must be <= {MAX_COMM_TIMEOUT_S:g} (seconds, about 31 years: a longer "
                             f"wait cannot be given to torch), got {self.comm_timeout_s!r}")
        val.check_bool("fuse_g", self.fuse_g)
        if self.async_inverses != "auto":
            val.check_bool("async_inverses", self.async_inverses, optional=True)
        val.check_int("auto_rounds", self.auto_rounds, low=1)
        if self.auto_rounds != _DEFAULT_AUTO_ROUNDS and not self.is_auto:
            raise ValueError(f"auto_rounds must be left at its default ({_DEFAULT_AUTO_ROUNDS}) unless schedule='auto' "
                             f"or async_inverses='auto' (it counts the timing rounds of those), got {self.auto_rounds!r}")
        if self.schedule == "auto":
            for name, given, default in (("bucket_mb", self.bucket_mb, _DEFAULT_BUCKET_MB),
                                         ("small_factor", self.small_factor, None)):
                if given != default:
                    raise ValueError(f"{name} must be left at its default ({default}) with schedule='auto' (the "
                                     f"candidates use their own), got {name}={given!r}")

        if self.schedule == "dpkfac":
            if self.placement != SCHEDULE_PARTS["dpkfac"]["placement"]:
                raise ValueError(f"placement must be None with schedule='dpkfac' (a layer's owner inverts both of its "
                                 f"factors: layers are placed whole, by plan_layer_placement), got "
                                 f"placement={self.placement!r}; leave it unset")
            if self.async_inverses == "auto":
                raise ValueError("async_inverses='auto' is not available with schedule='dpkfac' (the timed candidates "
                                 "hold every layer's state, dpkfac only its owned layers'); set it to True or False")
            if self.small_factor is not None:
                raise ValueError(f"small_factor must be None with schedule='dpkfac' (nothing is replicated: a layer's "
                                 f"owner alone holds its factors), got small_factor={self.small_factor!r}")
        if self.fusion != "bucket" and self.bucket_mb != _DEFAULT_BUCKET_MB:
            raise ValueError(
                f"bucket_mb must be left at its default ({_DEFAULT_BUCKET_MB:g}) unless fusion='bucket': "
                f"bucket_mb is only used with fusion='bucket', got bucket_mb={self.bucket_mb!r} with "
                f"fusion={self.fusion!r}"
            )
        if self.replan_every is not None and not self.needs_profile and self.schedule != "auto":
            raise ValueError(
                f"replan_every must be None unless pipelining=True and fusion='dtf' (re-planning re-measures "
                f"the factor ready times that only that combination uses), got replan_every={self.replan_every!r} "
                f"with schedule={self.schedule!r}, pipelining={self.pipelining!r}, fusion={self.fusion!r}"
            )
        if self.small_factor is not None and self.placement not in LOAD_BALANCED_PLACEMENTS:
            raise ValueError(
                f"small_factor must be None unless placement is {' or '.join(map(repr, LOAD_BALANCED_PLACEMENTS))} (only "
                f"load-balanced placement replicates factors by size), got small_factor={self.small_factor!r} with placement={self.placement!r}"
            )

    @property
    def is_auto(self) -> bool:
        """Does the strategy time candidates and keep the fastest (comm/auto.py)?"""
        return self.schedule == "auto" or self.async_inverses == "auto"

    @property
    def needs_profile(self) -> bool:
        """Does the fusion plan need measured ready times?"""
        return self.pipelining and self.fusion == "dtf"

    @property
    def bytes_per_element(self) -> int:
        return 2 if self.comm_dtype == "bfloat16" else 4

    @property
    def torch_comm_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.comm_dtype == "bfloat16" else torch.float32


def _profile_steps(value: object) -> tuple[int, int]:
    """``profile_steps`` as a tuple: a list or tuple of two integers ``start < end``, ``start >= 0``."""
    what = "two integers [start, end) with 0 <= start < end, as a list or tuple"
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"profile_steps must be {what}, got {val.show(value)}")
    if not all(val.is_int(v) for v in value):
        raise TypeError(f"profile_steps must be {what}, got {val.show(value)}")
    if len(value) != 2 or not 0 <= value[0] < value[1]:
        raise ValueError(f"profile_steps must be {what}, got {value!r}")
    return int(value[0]), int(value[1])
