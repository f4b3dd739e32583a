"""Execution of SPD-KFAC plans on torch.distributed.

- :mod:`.triangle`: upper-triangle packing of symmetric factors (only n(n+1)/2 elements travel).
- :class:`FusedAllReduce`: a fusion plan's groups of factors, each one asynchronous all-reduce launched as
  soon as its last factor is submitted (from a hook), waited explicitly before the optimizer step.
- :class:`InverseBroadcaster`: owners broadcast inverses asynchronously in one global order; replicated
  factors are inverted everywhere.
- :mod:`.profile`: collective timings identical on every rank, and ``broadcast_object``.

Nothing here imports the planners: plans come in as plain data (groups of indices, owner ranks).
"""

from .broadcast import InverseBroadcaster, RoundTimings
from .fused import FusedAllReduce, StepTimings
from .profile import broadcast_object, measure_allreduce, measure_broadcast
from .triangle import pack_triu, triu_size, unpack_triu

__all__ = [
    "FusedAllReduce",
    "InverseBroadcaster",
    "RoundTimings",
    "StepTimings",
    "broadcast_object",
    "measure_allreduce",
    "measure_broadcast",
    "pack_triu",
    "triu_size",
    "unpack_triu",
]
