"""Planning for SPD-KFAC: pure, deterministic functions over plain numbers (no torch.distributed).

* :mod:`.cost` -- the alpha-beta model of one collective and the inversion-time model, with their fits
  (and a torch helper that measures inversion times on this process's device).
* :mod:`.fusion` -- grouping of the factor all-reduces: dynamic tensor fusion (DTF) and the ablations.
* :mod:`.placement` -- which rank inverts each factor: load-balanced placement (LBP), round-robin,
  replicated.

Every rank that plans from the same inputs (measurements broadcast by rank 0) gets the same plan.
"""

from .cost import (
    AlphaBeta,
    InverseCost,
    fit_alpha_beta,
    fit_inverse_cost,
    measure_inverse_cost,
    measure_inverse_seconds,
)
from .fusion import FusionPlan, FusionPolicy, FusionTimeline, plan_fusion, simulate_fusion
from .layer_placement import (
    LayerPlacement,
    layer_state_bytes,
    plan_layer_placement,
    precondition_flops,
    preconditioned_order,
)
from .placement import (
    REPLICATED,
    Placement,
    PlacementPolicy,
    PlacementTimeline,
    broadcast_order,
    inverted_by,
    owned_by,
    plan_placement,
    simulate_placement,
    task_cost,
)

__all__ = [
    "REPLICATED",
    "AlphaBeta",
    "FusionPlan",
    "FusionPolicy",
    "FusionTimeline",
    "InverseCost",
    "LayerPlacement",
    "Placement",
    "PlacementPolicy",
    "PlacementTimeline",
    "broadcast_order",
    "fit_alpha_beta",
    "fit_inverse_cost",
    "inverted_by",
    "layer_state_bytes",
    "measure_inverse_cost",
    "measure_inverse_seconds",
    "owned_by",
    "plan_layer_placement",
    "plan_fusion",
    "plan_placement",
    "precondition_flops",
    "preconditioned_order",
    "simulate_placement",
    "simulate_fusion",
    "task_cost",
]
