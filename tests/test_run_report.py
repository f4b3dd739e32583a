"""What K-FAC added to a fit, one line (issue 38): printed by the callback at the end of training on rank 0,
the same line (one function) in the ``spdkfac`` CLI's outcome, counted per K-FAC step of this fit (a resume
counts from the resume); only the phases that can be non-zero in the run are logged."""

from __future__ import annotations

import logging
import math
import re

import pytest
import pytorch_lightning as pl
from helpers.lightning_models import Tiny, trainer

from lightning_spdkfac import KFAC
from lightning_spdkfac.kfac.distributor import Distributor, DistributorContext
from lightning_spdkfac.lightning.run_report import KFACRunRecord, kfac_line, possible_phases
from lightning_spdkfac.telemetry import PHASES

KW = dict(damping=0.01, factor_update_steps=1, inv_update_steps=3)
LINE = re.compile(r"K-FAC: (\d+) steps, ([\d.]+) ms per step in K-FAC \((\d+)% of a ([\d.]+) ms step; "
                  r"[^)]*\); inverse steps (\d+) of (\d+) \(\d+%\); skipped factor steps 0, "
                  r"skipped precondition steps 0, inverse fallbacks 0$")


class Record(pl.Callback):
    """After KFAC in the callback list: each K-FAC step's phase seconds and whether it inverted."""

    def __init__(self, cb):
        self.cb, self.phases, self.inverted = cb, [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.phases.append(dict(self.cb.preconditioner.timer.last))
        self.inverted.append(self.cb.preconditioner.last_step_inverted)


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("K-FAC: ")]


def test_the_callback_prints_one_line_of_what_kfac_added_at_the_end_of_fit(caplog):
    cb = KFAC(**KW)
    rec = Record(cb)
    with caplog.at_level(logging.INFO):
        trainer(max_steps=7, callbacks=[cb, rec]).fit(Tiny())
    (line,) = _lines(caplog)
    m = LINE.match(line)
    assert m, line
    steps, kfac_ms, share, step_ms, inverse, of = m.groups()
    assert int(steps) == int(of) == 7 == len(rec.phases)
    assert int(inverse) == math.ceil(7 / 3) == sum(rec.inverted)  # steps 0, 3, 6
    # ms per step: the mean over the steps of the phases on the training thread, from the recorded seconds
    expected = sum(v for step in rec.phases for k, v in step.items() if k not in ("factor_comm_inflight",
                                                                                    "inverse_async")) * 1e3 / 7
    assert float(kfac_ms) == pytest.approx(expected, abs=0.006)
    # the line prints K-FAC's ms to 2 decimals and the step's to 1 and the share from the unrounded values:
    # the share must lie in the range the printed (rounded) figures allow, plus the share's own rounding
    k, s = float(kfac_ms), float(step_ms)
    assert s + 0.05 >= k
    lo, hi = 100 * (k - 0.005) / (s + 0.05), 100 * (k + 0.005) / max(s - 0.05, 1e-9)
    assert lo - 0.5 <= int(share) <= hi + 0.5, (share, lo, hi)
    assert cb.run_record.steps == 7 and cb.run_record.timed_steps == 7


def test_summary_false_prints_neither_the_summary_nor_the_line(caplog):
    with caplog.at_level(logging.INFO):
        trainer(max_steps=2, callbacks=[KFAC(**KW, summary=False)]).fit(Tiny())
    assert not _lines(caplog) and not any("K-FAC summary" in r.getMessage() for r in caplog.records)


def test_a_resumed_fit_counts_its_own_steps(tmp_path, caplog):
    first = trainer(max_steps=4, callbacks=[KFAC(**KW)])
    first.fit(Tiny())
    ckpt = tmp_path / "step4.ckpt"
    first.save_checkpoint(ckpt)
    cb = KFAC(**KW)
    rec = Record(cb)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        trainer(max_steps=10, callbacks=[cb, rec]).fit(Tiny(), ckpt_path=ckpt)
    assert len(rec.phases) == 6 and cb.run_record.steps == 6  # steps 4..9: this fit's, not 10
    (line,) = _lines(caplog)
    assert line.startswith("K-FAC: 6 steps, ") and "inverse steps 2 of 6" in line  # K-FAC steps 6 and 9


def test_the_record_sums_what_it_is_given_and_the_line_reads_it():
    record = KFACRunRecord()
    assert kfac_line(None) == "off (no KFAC callback: kfac is null)"
    assert kfac_line(record) == "on, no optimizer step taken"
    record.add_step({"factor_compute": 0.002, "precondition": 0.001, "factor_comm_inflight": 0.004}, True)
    record.add_step({"factor_compute": 0.004, "precondition": 0.001, "factor_comm_inflight": 0.0}, False)
    record.add_step_time(0.020)
    record.add_step_time(0.030)
    line = kfac_line(record)
    # K-FAC: (2+1+4+1)/2 = 4 ms a step (inflight overlaps the rest: apart), of a 25 ms step = 16%
    assert line.startswith("2 steps, 4.00 ms per step in K-FAC (16% of a 25.0 ms step; factor_compute 3.00, "
                           "precondition 1.00; factor_comm_inflight 2.00, overlapped); inverse steps 1 of 2 (50%)"), line


class _Remote(Distributor):
    """A distributor that moves data (is_local False by subclassing), synchronous, every layer on every rank."""


class _Owned(_Remote):
    layer_owners = (0, 1)


class _Deciding(Distributor):
    is_local = True

    def use_async_inverses(self) -> bool:
        return True


def test_possible_phases_follow_the_distributor():
    comm = {"factor_comm_wait", "factor_comm_inflight", "factor_pack", "inverse_comm_wait"}
    asynchronous = {"inverse_async", "inverse_wait"}
    local = set(possible_phases(Distributor()))
    assert local == set(PHASES) - comm - asynchronous - {"precondition_comm_wait"}
    assert set(possible_phases(_Remote())) == set(PHASES) - asynchronous - {"precondition_comm_wait"}
    assert set(possible_phases(_Owned())) == set(PHASES) - asynchronous
    on = Distributor()
    on.setup([], DistributorContext(async_inverses=True))
    assert set(possible_phases(on)) == local | asynchronous
    assert set(possible_phases(_Deciding())) == local | asynchronous
    assert list(possible_phases(_Owned())) == [p for p in PHASES if p not in asynchronous]  # PHASES' order


def test_async_inverses_log_their_phases_in_one_process(tmp_path):
    import csv

    from pytorch_lightning.loggers import CSVLogger

    t = trainer(max_steps=4, logger=CSVLogger(tmp_path), log_every_n_steps=1,
                callbacks=[KFAC(**dict(KW, inv_update_steps=2), async_inverses=True)])
    t.fit(Tiny())
    with open(f"{t.logger.log_dir}/metrics.csv") as f:
        columns = set(next(csv.reader(f)))
    assert {"kfac/inverse_async_ms", "kfac/inverse_wait_ms"} <= columns
    assert not {c for c in columns if c.startswith(("kfac/factor_comm", "kfac/inverse_comm", "kfac/factor_pack"))}
