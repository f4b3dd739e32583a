"""WindowStats: mean and max of per-step values over the steps since the last reset."""

from __future__ import annotations

import pytest

from lightning_spdkfac.telemetry import WindowStats


def test_mean_max_and_flagged_share_over_a_window():
    w = WindowStats()
    assert (w.steps, w.means(), w.maxima(), w.flagged_share) == (0, {}, {}, 0.0)
    w.add({"step": 1.0, "a": 0.5}, flagged=True)
    w.add({"step": 3.0, "a": 0.25})
    w.add({"step": 2.0})  # "a" missing in this step: its mean is over the two steps that had it
    w.add({"step": 2.0, "a": 0.0, "b": -1.0})
    assert w.steps == 4 and w.flagged == 1 and w.flagged_share == 0.25
    assert w.means() == pytest.approx({"step": 2.0, "a": 0.75 / 3, "b": -1.0})
    assert w.maxima() == {"step": 3.0, "a": 0.5, "b": -1.0}
    assert list(w.means()) == ["step", "a", "b"]  # first-seen order


def test_reset_starts_a_new_window():
    w = WindowStats()
    w.add({"x": 5.0}, flagged=True)
    w.reset()
    assert (w.steps, w.flagged, w.means(), w.maxima(), w.flagged_share) == (0, 0, {}, {}, 0.0)
    w.add({"x": 1.0})
    w.add({"x": 2.0}, flagged=True)
    assert (w.means(), w.maxima(), w.flagged_share) == ({"x": 1.5}, {"x": 2.0}, 0.5)


def test_maxima_is_a_copy():
    w = WindowStats()
    w.add({"x": 1.0})
    w.maxima()["x"] = 9.0
    assert w.maxima() == {"x": 1.0}
