"""The simulator's schedules, one per module, each on the timeline core (:mod:`..timeline_core`) below them;
:func:`~lightning_spdkfac.simulate.timeline.simulate` above them picks the one a
:class:`~lightning_spdkfac.simulate.sim_schedule.SimSchedule` asks for:

* :mod:`.spd` -- every schedule with ``dpkfac="off"`` (D-KFAC, MPD-KFAC, the paper's SPD-KFAC, ``spd`` and its
  variants, synchronous or with asynchronous inverses): factors all-reduced, inverses placed and broadcast;
* :mod:`.dear` -- ``factor_comm="dear"``: spd with the factors reduce-scattered in backward and all-gathered in
  the next forward;
* :mod:`.dpkfac` -- ``dpkfac="reduce"`` / ``"local"``: DP-KFAC, layer owners that invert, precondition and
  broadcast the preconditioned gradient;
* :mod:`.async_plan` -- the placement of ``async_placement="period"``: spd's candidates, by simulated async period.

This package imports none of them, so that importing one loads only what it is built on.
"""
