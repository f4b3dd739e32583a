"""A cluster-scale model of one K-FAC iteration, built on the runtime's own planners.

* :mod:`.workload` -- a model's K-FAC layers (read from a real ``nn.Module``) and their per-GPU times;
* :mod:`.cluster` -- P GPUs: alpha-beta collectives and the inversion-time model;
* :mod:`.timeline` -- the event timeline of one iteration under a schedule and its breakdown; the named
  schedules are :data:`SIM_SCHEDULES` (the runtime's schedule names are ``lightning_spdkfac.vocabulary.SCHEDULES``);
* :mod:`.paper` -- the SPD-KFAC paper's 64-GPU setup and measurements, and the calibration to them;
* :mod:`.models` -- ResNet-50/152, DenseNet-201 and Inception-v4 as plain modules;
* ``spdkfac plan``: :mod:`.plan` (the recommendation, programmatically), :mod:`.report` (its text and JSON),
  :mod:`.plan_cli` (the command line) and :mod:`.plan_sources` (the model of ``--paper``, ``--model`` or
  ``--config``).
"""

from .cluster import Cluster
from .timeline import CATEGORIES, SIM_SCHEDULES, Event, SimSchedule, Timeline, simulate, with_schedule
from .workload import LayerSpec, LayerTimes, Workload, profile_layers

__all__ = [
    "CATEGORIES",
    "SIM_SCHEDULES",
    "Cluster",
    "Event",
    "LayerSpec",
    "LayerTimes",
    "SimSchedule",
    "Timeline",
    "Workload",
    "profile_layers",
    "simulate",
    "with_schedule",
]
