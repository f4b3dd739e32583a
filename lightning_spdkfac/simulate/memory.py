"""The memory model of ``spdkfac plan --gpu-memory``: bytes per GPU of a simulated schedule, for every schedule
(:func:`memory_per_gpu`, under :data:`MEMORY_ASSUMPTIONS`)."""

from __future__ import annotations

from ..factor_shapes import inverse_numel, numel, packed_numel
from ..schedule import REPLICATED, layer_state_bytes
from .schedules.dpkfac import STATE_BYTES
from .timeline_core import Timeline
from .workload import Workload

__all__ = ["MEMORY_ASSUMPTIONS", "memory_per_gpu"]

MEMORY_ASSUMPTIONS = ("fp32 parameters + gradients + SGD momentum; K-FAC factors and inverses of their layouts "
                      "(n x n dense, n diagonal, b x n x n grouped); fused factor and inverse-broadcast buffers; "
                      "activations not counted")


def memory_per_gpu(workload: Workload, timeline: Timeline) -> dict[str, int]:
    """Bytes per GPU of the simulated schedule (:data:`MEMORY_ASSUMPTIONS`), on the rank that holds the most:
    ``model`` (parameters, gradients, momentum), ``kfac_state`` (factors and inverses: every layer's on
    replicated schedules, plus the inverses being computed beside those in use with async inverses; the
    owned layers' under dpkfac), ``buffers`` (fused factor triangles, inverse-broadcast triangles of owned
    factors) and ``total``. Every factor counts as its layout holds it (``timeline.extra["sides"]``, the
    factors' shapes): ``n x n`` dense, ``n`` diagonal, ``b x n x n`` grouped, and is sent packed (a diagonal, or
    the upper triangle of each dense block)."""
    s = timeline.extra["schedule"]
    sides = timeline.extra["sides"]
    world = len(timeline.extra["layer_placement"].load) if "layer_placement" in timeline.extra else None
    model = 3 * 4 * workload.params
    factor_buffers = sum(packed_numel(n) for n in sides) * s.bytes_per_element
    if s.dpkfac != "off":
        lp = timeline.extra["layer_placement"]
        kfac = max(lp.memory)
        buffers = factor_buffers if s.dpkfac == "reduce" and world and world > 1 else 0
    else:
        kfac = sum(layer_state_bytes(x.a_shape, x.g_shape, STATE_BYTES) for x in workload.layers)
        if s.async_inverses:  # the inverses being computed (Cholesky: the factor's shape)
            kfac += sum(numel(n) for n in sides) * STATE_BYTES
        owned = [n for n, o in zip(sides, timeline.owners) if o != REPLICATED]
        buffers = ((factor_buffers if timeline.groups else 0)
                   + sum(inverse_numel(n, "cholesky") for n in owned) * s.bytes_per_element)
    return {"model": model, "kfac_state": kfac, "buffers": buffers, "total": model + kfac + buffers}
