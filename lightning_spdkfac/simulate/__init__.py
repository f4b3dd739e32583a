"""A cluster-scale model of one K-FAC iteration, built on the runtime's own planners.

* :mod:`.workload` -- a model's K-FAC layers (read from a real ``nn.Module``) and their per-GPU times;
* :mod:`.cluster` -- P GPUs: alpha-beta collectives and the inversion-time model;
* :mod:`.sim_schedule` -- how an iteration is scheduled: the named schedules are :data:`SIM_SCHEDULES` (the
  runtime's schedule names are ``lightning_spdkfac.vocabulary.SCHEDULES``);
* :mod:`.timeline_core` -- the compute stream, the communication channel and the events every schedule uses;
* :mod:`.schedules` -- one schedule per module on that core: ``spd`` (and D-KFAC, MPD-KFAC, the paper's SPD-KFAC,
  asynchronous inverses), ``dear``, ``dpkfac``, and ``async_plan`` (the async-period placement);
* :mod:`.timeline` -- :func:`simulate`, which picks the schedule's module: the event timeline of one iteration
  and its breakdown;
* :mod:`.memory` -- bytes per GPU of a simulated schedule;
* :mod:`.paper` -- the SPD-KFAC paper's 64-GPU setup and measurements, and the calibration to them;
* :mod:`.models` -- ResNet-50/152, DenseNet-201 and Inception-v4 as plain modules;
* ``spdkfac plan``: :mod:`.plan` (the recommendation, programmatically), :mod:`.report` (its text and JSON),
  :mod:`.plan_cli` (the command line) and :mod:`.plan_sources` (the model of ``--paper``, ``--model`` or
  ``--config``).
"""

from .cluster import Cluster
from .sim_schedule import SIM_SCHEDULES, SimSchedule, with_schedule
from .timeline import simulate
from .timeline_core import CATEGORIES, Event, Timeline
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
