"""The KFAC callback under a real Trainer, checked against a hand-written loop over the core."""

from __future__ import annotations

import copy

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from helpers.lightning_models import KW, Tiny, data, trainer

from lightning_spdkfac import KFAC, KFACPreconditioner


def manual(steps, batch_size, kfac_kwargs, lr=0.2, scheduler=False, clip=None):
    """The same training written by hand over KFACPreconditioner."""
    model = Tiny(lr=lr).net
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduler else None
    pre = KFACPreconditioner(model, lr=lambda s: opt.param_groups[0]["lr"], **kfac_kwargs)
    x, y = data()
    i = 0
    for _ in range(steps):
        xb, yb = x[i:i + batch_size], y[i:i + batch_size]
        i = (i + batch_size) % len(x)
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        pre.step()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
    return model


def assert_same_params(net, ref, rtol=1e-5, atol=1e-6):
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=rtol, atol=atol)


def test_callback_equals_manual_loop_with_lr_schedule():
    model = Tiny(scheduler=True)
    trainer(max_steps=7, callbacks=[KFAC(**KW)]).fit(model)
    assert_same_params(model.net, manual(7, 8, KW, scheduler=True))
    # And K-FAC really acted: plain SGD ends elsewhere.
    sgd = Tiny(scheduler=True)
    trainer(max_steps=7).fit(sgd)
    assert not torch.allclose(sgd.net[0].weight, model.net[0].weight, atol=1e-4)


def test_accumulate_grad_batches_equals_larger_batch():
    model = Tiny(batch_size=4)
    trainer(max_steps=3, accumulate_grad_batches=2, callbacks=[KFAC(**KW)]).fit(model)
    assert_same_params(model.net, manual(3, 8, KW), rtol=1e-4, atol=1e-5)


def test_gradient_clipping_runs_after_preconditioning():
    model = Tiny()
    kw = dict(KW, kl_clip=None)
    trainer(max_steps=4, gradient_clip_val=0.05, callbacks=[KFAC(**kw)]).fit(model)
    assert_same_params(model.net, manual(4, 8, kw, clip=0.05))
    # clipping before preconditioning would give a different result
    other = manual(4, 8, kw, clip=None)
    assert not torch.allclose(other[0].weight, model.net[0].weight, atol=1e-4)


def test_checkpoint_resume_equals_uninterrupted(tmp_path):
    full = Tiny()
    trainer(max_epochs=2, callbacks=[KFAC(**KW)]).fit(full)  # 2 epochs x 4 steps

    first = Tiny()
    t1 = trainer(max_epochs=1, callbacks=[KFAC(**KW)])
    t1.fit(first)
    ckpt = tmp_path / "epoch1.ckpt"
    t1.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)
    assert saved["callbacks"]["KFAC"]["steps"] == 4

    resumed = Tiny()
    cb = KFAC(**KW)
    trainer(max_epochs=2, callbacks=[cb]).fit(resumed, ckpt_path=ckpt)
    assert_same_params(resumed.net, full.net, rtol=0, atol=0)


class LoggingTiny(Tiny):
    """Tiny that logs its loss every step: Lightning writes a CSV row exactly on the steps it logs."""

    def training_step(self, batch, _):
        loss = super().training_step(batch, _)
        self.log("loss", loss, on_step=True, on_epoch=False)
        return loss


def csv_rows(t):
    """step -> the non-empty cells of metrics.csv's rows of that step (Lightning's row has the loss,
    KFAC writes a row of its own with the same step), for the steps that have any."""
    import csv

    rows: dict[int, dict] = {}
    with open(f"{t.logger.log_dir}/metrics.csv") as f:
        for r in csv.DictReader(f):
            cells = {k: v for k, v in r.items() if v != ""}
            seen = rows.setdefault(int(r["step"]), {})
            assert not (set(cells) & set(seen)) - {"step", "epoch"}, r  # no metric twice in a step
            seen.update(cells)
    return rows


def logged(row, prefix="kfac/"):
    return {k: float(v) for k, v in row.items() if k.startswith(prefix)}


class Record(pl.Callback):
    """After KFAC (later in the callback list): each step's phase seconds and whether it inverted."""

    def __init__(self, cb):
        self.cb, self.phases, self.inverted = cb, [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pre = self.cb.preconditioner
        self.phases.append(dict(pre.timer.last))
        self.inverted.append(pre.last_step_inverted)


def test_step_times_are_logged_as_window_aggregates_when_lightning_writes(tmp_path):
    from pytorch_lightning.loggers import CSVLogger

    from lightning_spdkfac.telemetry import PHASES

    cb = KFAC(**dict(KW, inv_update_steps=2))
    rec = Record(cb)
    t = trainer(max_steps=6, logger=CSVLogger(tmp_path), log_every_n_steps=2, callbacks=[cb, rec])
    t.fit(LoggingTiny())
    assert rec.inverted == [True, False] * 3
    rows = csv_rows(t)
    assert sorted(rows) == [1, 3, 5]  # Lightning's cadence: the 2nd, 4th and 6th step
    assert all("loss" in row and "kfac/step_ms" in row for row in rows.values())  # KFAC writes where Lightning does
    for end, row in rows.items():
        got = logged(row)
        assert got["kfac/steps_in_window"] == 2 and got["kfac/inverse_step_share"] == 0.5
        assert got["kfac/skipped_factor_steps"] == got["kfac/skipped_precondition_steps"] == 0
        window = rec.phases[end - 1:end + 1]  # the two steps since the previous log
        # One process, synchronous inverses: no peer to wait for, no worker; those phases are not logged.
        absent = {"factor_comm_wait", "factor_comm_inflight", "factor_pack", "inverse_comm_wait",
                  "precondition_comm_wait", "inverse_async", "inverse_wait"}
        for phase in PHASES:
            values = [1e3 * step[phase] for step in window]
            if phase in absent:
                assert sum(values) == 0 and f"kfac/{phase}_ms" not in got and f"kfac/{phase}_ms_max" not in got
                continue
            assert got[f"kfac/{phase}_ms"] == pytest.approx(sum(values) / 2, rel=1e-5, abs=1e-6), (end, phase)
            assert got[f"kfac/{phase}_ms_max"] == pytest.approx(max(values), rel=1e-5, abs=1e-6), (end, phase)
        for name in ("step", "fwd_bwd", "factor_compute", "precondition"):
            assert got[f"kfac/{name}_ms_max"] >= got[f"kfac/{name}_ms"] > 0, (end, name)
        # The K-FAC step holds its factor update, inversions and preconditioning.
        inside = sum(got[f"kfac/{p}_ms"] for p in ("factor_update", "inverse_compute", "precondition"))
        assert got["kfac/step_ms"] >= inside * (1 - 1e-5)
    # An inverse step in every window: the max of the inversion time is its one inverse step's.
    assert all(logged(r)["kfac/inverse_compute_ms_max"] == pytest.approx(2 * logged(r)["kfac/inverse_compute_ms"],
                                                                         rel=1e-5) for r in rows.values())


def test_counters_alone_follow_the_cadence_with_accumulation(tmp_path):
    from pytorch_lightning.loggers import CSVLogger

    cb = KFAC(**KW, log_step_time=False)
    t = trainer(max_steps=8, logger=CSVLogger(tmp_path), log_every_n_steps=3, accumulate_grad_batches=2,
                callbacks=[cb])
    t.fit(LoggingTiny())
    rows = csv_rows(t)
    assert sorted(rows) == [2, 5]  # the 3rd and 6th optimizer step; the last two are not written
    assert all("loss" in row for row in rows.values())
    for row in rows.values():
        assert set(logged(row)) == {"kfac/skipped_factor_steps", "kfac/skipped_precondition_steps",
                                    "kfac/inverse_fallbacks"}
    assert cb.state_dict()["steps"] == 8


def test_after_should_stop_every_step_is_written(tmp_path):
    """Stopping early is refused until min_steps: Lightning then writes every step, and so does KFAC."""
    from pytorch_lightning.loggers import CSVLogger

    class StopAfterEpoch(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            trainer.should_stop = True

    t = trainer(max_steps=7, min_steps=7, logger=CSVLogger(tmp_path), log_every_n_steps=3,
                callbacks=[KFAC(**KW), StopAfterEpoch()])
    t.fit(LoggingTiny())  # 4 steps an epoch
    rows = csv_rows(t)
    assert sorted(rows) == [2, 4, 5, 6] and all("loss" in row for row in rows.values())
    assert [logged(rows[s])["kfac/steps_in_window"] for s in sorted(rows)] == [3, 2, 1, 1]


def test_without_a_logger_nothing_is_timed_or_logged():
    cb = KFAC(**KW)
    t = trainer(max_steps=4, logger=False, log_every_n_steps=1, callbacks=[cb])
    t.fit(Tiny())
    assert not t.loggers and cb.state_dict()["steps"] == 4
    assert cb._window.steps == 0 and not any(k.startswith("kfac/") for k in t.logged_metrics)


def test_fast_dev_run_logs_every_step(monkeypatch, tmp_path):
    from pytorch_lightning.loggers import CSVLogger
    from pytorch_lightning.loggers.logger import DummyLogger

    calls = []
    monkeypatch.setattr(DummyLogger, "log_metrics", lambda self, metrics, step=None: calls.append((step, metrics)))
    # fast_dev_run swaps the logger for a DummyLogger and writes every step
    t = trainer(fast_dev_run=3, logger=CSVLogger(tmp_path), callbacks=[KFAC(**KW)])
    t.fit(Tiny())
    kfac = [(step, m) for step, m in calls if "kfac/steps_in_window" in m]
    assert [step for step, _ in kfac] == [0, 1, 2]
    assert [m["kfac/steps_in_window"] for _, m in kfac] == [1.0, 1.0, 1.0]
    assert [m["kfac/inverse_step_share"] for _, m in kfac] == [1.0, 0.0, 0.0]  # inverses at step 0 of every 3


def test_chrome_trace_of_one_step_shows_the_kfac_phases(tmp_path):
    import json

    cb = KFAC(**KW, trace_step=3, trace_dir=str(tmp_path))  # 3: an inverse step
    trainer(max_steps=4, callbacks=[cb]).fit(Tiny())
    events = json.loads((tmp_path / "kfac_step3_rank0.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"kfac/factor_compute", "kfac/inverse_compute", "kfac/precondition"} <= names


def test_bf16_mixed_precision_trains_with_fp32_factors():
    model = Tiny()
    cb = KFAC(**KW)
    seen = {}

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            pre = cb.preconditioner
            seen.update({n: (ly.A.dtype, ly.G.dtype, bool(torch.isfinite(ly.G).all())) for n, ly in pre.layers.items()})

    trainer(max_steps=4, precision="bf16-mixed", callbacks=[cb, Probe()]).fit(model)
    assert seen and all(v == (torch.float32, torch.float32, True) for v in seen.values())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bad_callback_arguments_fail_at_construction():
    with pytest.raises(ValueError, match="damping must be >= 0"):
        KFAC(damping=-1)
    with pytest.raises(ValueError, match="factor_dtype must be a torch dtype name"):
        KFAC(factor_dtype="float33")
    with pytest.raises(ValueError, match="lr must be >= 0"):
        KFAC(lr=-1.0)


def test_callback_is_deepcopyable_before_fit():
    cb = KFAC(**KW)
    assert copy.deepcopy(cb).options == cb.options


def damping_schedule(step: int) -> float:
    return 0.05 if step < 2 else 0.01


def test_yaml_schedule_is_an_import_path_to_a_function():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(KFAC, "kfac")
    cfg = parser.parse_string(
        "kfac:\n  damping: test_callback.damping_schedule\n  skip_layers: ['^net[.]2$']\n"
    )
    cb = parser.instantiate(cfg).kfac
    assert cb.options.damping(0) == 0.05 and cb.options.damping(5) == 0.01
    model = Tiny()
    trainer(max_steps=3, callbacks=[cb]).fit(model)
    assert set(cb._final_state["layers"]) == {"net.0"}
    with pytest.raises(ValueError, match="damping must be >= 0"):
        parser.instantiate(parser.parse_string("kfac:\n  damping: -1.0\n"))


def test_final_micro_batch_follows_accumulation_boundaries():
    cb = KFAC(**KW)
    seen = []

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            seen.append(cb.preconditioner.final_micro_batch)

    # 5 batches of 4 per epoch with accumulation 2: steps after batches 2, 4 and 5 (epoch end)
    model = Tiny(batch_size=4, n=20)
    trainer(max_epochs=1, accumulate_grad_batches=2, callbacks=[cb, Probe()]).fit(model)
    assert seen == [False, True, False, True, True]


def test_constructing_kfac_leaves_the_global_rng_alone():
    # LightningCLI builds callbacks before the model: KFAC must not shift the model's initial weights.
    torch.manual_seed(0)
    KFAC(**KW)
    after = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(4))
