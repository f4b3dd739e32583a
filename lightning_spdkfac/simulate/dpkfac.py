"""The names this module held before the simulator was split into layers (benchmarks/schedules_64.py and users
import them from here): DP-KFAC's schedule is :mod:`.schedules.dpkfac`, the memory model of every schedule
:mod:`.memory`, and :func:`half_allreduce` a model of the cluster's (:mod:`.cluster`)."""

from __future__ import annotations

from .cluster import half_allreduce
from .memory import MEMORY_ASSUMPTIONS, memory_per_gpu
from .schedules.dpkfac import GRAD_BYTES, STATE_BYTES, gradient_bytes, layer_placement, simulate_dpkfac

__all__ = ["GRAD_BYTES", "MEMORY_ASSUMPTIONS", "STATE_BYTES", "gradient_bytes", "half_allreduce", "layer_placement",
           "memory_per_gpu", "simulate_dpkfac"]
