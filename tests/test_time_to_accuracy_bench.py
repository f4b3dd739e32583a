"""benchmarks/time_to_accuracy.py (issue 27): the new baselines (Muon, SOAP, Shampoo) build and step, every
workload module's ``kfac_loss_parts`` gives exactly its training step's loss, the new workloads train a few
steps with the new optimizers, and the protocol (sweep, widening, --no-kfac, --baselines-from over several files,
--candidates passed to KFAC() unchanged) runs on a stub of ``run_one``. Fast: seconds, no full training."""

from __future__ import annotations

import importlib
import json
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    """(time_to_accuracy, _tta_optimizers), imported from benchmarks/ (their sibling imports need it on sys.path)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(REPO / "benchmarks"))
        tta = importlib.import_module("time_to_accuracy")
        opt = importlib.import_module("_tta_optimizers")
        yield tta, opt


class _Tiny(nn.Module):
    """Every kind of parameter the Muon split distinguishes."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.dw = nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.hidden = nn.Linear(4 + 8, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.dw(self.conv(x))).mean((2, 3))
        return self.head(torch.relu(self.hidden(torch.cat([h, self.emb(t)], 1))))


def test_muon_split(bench):
    _, opt = bench
    m = _Tiny()
    muon, adamw = opt.split_muon_params(m)
    assert {id(p) for p in muon} == {id(m.conv.weight), id(m.hidden.weight)}
    assert {id(p) for p in adamw} == {id(p) for p in m.parameters()} - {id(p) for p in muon}
    # the output layer is the module's own choice where it says
    m.muon_output_layer = lambda: m.hidden
    muon, _ = opt.split_muon_params(m)
    assert {id(p) for p in muon} == {id(m.conv.weight), id(m.head.weight)}


@pytest.mark.parametrize("name", ["sgd", "adamw", "muon", "soap", "shampoo"])
def test_optimizer_builds_and_steps(bench, name):
    _, opt = bench
    torch.manual_seed(0)
    m = _Tiny()
    o = opt.build_optimizer(m, name, lr=1e-2, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))  # the benchmark's kind of schedule
    x, t = torch.randn(6, 3, 5, 5), torch.randint(0, 10, (6,))
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(3):  # SOAP's first step only sets its preconditioner up
            o.zero_grad()
            m(x, t).square().mean().backward()
            o.step()
            sched.step()
    moved = {n for n, p in m.named_parameters() if not torch.equal(p, before[n])}
    assert moved == set(before), f"{name} left {set(before) - moved} unchanged"
    assert all(torch.isfinite(p).all() for p in m.parameters())
    assert math.isclose(o.param_groups[0]["lr"], 1e-2 / 4)
    if name == "muon":  # one optimizer over both inner ones: the schedule drives both
        assert o.muon is not None and o.adamw is not None
        assert all(g in o.param_groups for g in o.adamw.param_groups)
        # Muon's inner groups hold 2-D views of the filters; they took the lr of the last step (1 / 3 of the peak)
        assert all(math.isclose(g["lr"], 1e-2 / 3) for g in o.muon.param_groups)
        # the outer groups hold every parameter itself, once (K-FAC finds a layer's lr by the weight's identity)
        outer = [p for g in o.param_groups for p in g["params"]]
        assert len(outer) == len({id(p) for p in outer}) and {id(p) for p in outer} == {id(p) for p in m.parameters()}
        o.zero_grad()
        assert m.conv.weight.grad is None  # a flattened filter's own gradient is cleared too
    if name in ("soap", "shampoo"):
        import heavyball

        assert heavyball.utils.compile_mode is None  # eager on the CPU
        assert o.compile_step is False


def _one_batch(w, seed: int = 0):
    data = w.data(seed)
    data.setup("fit")
    if hasattr(data, "batch_size"):
        data.batch_size = min(data.batch_size, 8)
    return next(iter(data.train_dataloader()))


@pytest.mark.parametrize("workload", ["digits", "resnet", "textlm", "transformer", "autoencoder", "depthwise", "gpt2",
                                      "gpt2_long", "resnet18w"])
def test_kfac_loss_parts_is_the_training_loss(bench, workload):
    tta, _ = bench
    w = tta.WORKLOADS[workload]
    batch = _one_batch(w)
    model = w.model("adamw", 1e-3, 0)
    model.train()
    forward, loss = model.kfac_loss_parts(batch)
    with torch.no_grad():
        ours = loss(forward())
        again = loss(forward())  # recomputed each call, the same parameters: the same value
        # (BatchNorm's running statistics, which these extra forwards update, are the rule's to restore:
        # tests/test_step_size.py checks that it does)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log without a Trainer
            step = model.training_step(batch, 0)
    assert ours.dim() == 0
    assert torch.equal(ours, again)
    torch.testing.assert_close(ours, step, rtol=0, atol=0)
    # the parts follow the parameters (recomputed from the current ones, not cached)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
        assert not torch.equal(loss(forward()), ours)


@pytest.mark.parametrize(("workload", "opt_name", "steps"), [("depthwise", "shampoo", 2), ("gpt2", "muon", 1),
                                                          ("resnet18w", "muon", 2), ("gpt2_long", "soap", 1)])
def test_new_workloads_train(bench, workload, opt_name, steps):
    """The minimal equivalent of --quick on the new workloads: optimizer steps and one validation batch through
    Lightning, with the workload's schedule, finite losses (heavyball on 4-D filters and BatchNorm; Muon + AdamW
    on transformers' Conv1D with the tied 50257-token head)."""
    import pytorch_lightning as pl

    tta, _ = bench
    w = tta.WORKLOADS[workload]
    pl.seed_everything(0, verbose=False)
    model = w.model(opt_name, w.lrs[opt_name][0], 0)
    data = w.data(0)
    hist = tta.History(w.monitor, 0.0)
    trainer = pl.Trainer(max_steps=steps, limit_train_batches=steps, limit_val_batches=1, accelerator="cpu", devices=1,
                         logger=False, callbacks=[hist], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=data)
    assert trainer.global_step == steps
    assert hist.history and math.isfinite(hist.history[-1][w.monitor]) and not hist.nonfinite


# ------------------------------------------------------------------------------ the protocol, on a stub
def _stub_run_one(tta, calls):
    """run_one's stand-in: a run reaches the target sooner the closer log10(lr) is to the optimizer's optimum."""
    best = {"sgd": 0.1, "adamw": 1e-2, "muon": 3e-3, "soap": 3e-3, "shampoo": 0.3}

    def run_one(w, opt_name, lr, seed, epochs, kfac):
        calls.append({"opt": opt_name, "lr": lr, "seed": seed, "kfac": kfac})
        off = abs(math.log10(lr / best[opt_name]))
        hist = []
        for e in range(1, epochs + 1):
            metric = min(0.99, 0.5 + e * 0.1 / (1 + 2 * off))
            hist.append({"epoch": e, "step": e, w.monitor: metric, "train_loss": 1.0 / e, "seconds": float(e)})
        hit = next((h for h in hist if w.reached(h[w.monitor])), None)
        return {"workload": w.name, "optimizer": opt_name, "lr": lr, "seed": seed, "kfac": kfac, "epochs": epochs,
                "reached": hit is not None, "seconds_to_target": hit and hit["seconds"],
                "epoch_to_target": hit and hit["epoch"], "final_metric": hist[-1][w.monitor], "first_loss": 2.0,
                "last_train_loss": 1.0 / epochs, "diverged": False, "error": None, "wall_seconds": 0.1,
                "history": hist}

    return run_one


def test_protocol_sweep_widen_reuse_and_candidates(bench, monkeypatch, tmp_path):
    tta, _ = bench
    calls: list[dict] = []
    monkeypatch.setattr(tta, "run_one", _stub_run_one(tta, calls))
    w = tta.Workload("toy", "toy", None, None, "val_acc", "max", 0.9, budget=8,
                     lrs={"sgd": [0.03, 0.1, 0.3], "adamw": [3e-3, 1e-2, 3e-2], "muon": [1e-2, 3e-2, 0.1],
                          "soap": [1e-3, 3e-3, 1e-2], "shampoo": [1e-2, 3e-2]}, quick_budget=2)
    log = lambda msg: None  # noqa: E731
    # the new optimizers alone, no K-FAC phase. Muon's optimum (3e-3) lies below its grid: widened to 3.3e-3, the
    # winner, and once more to 1.1e-3 (the winner was still at the edge); soap's (3e-3) is inside; shampoo's above.
    jl = tmp_path / "runs.jsonl"
    res = tta.run_workload(w, [0, 1], False, None, log, optimizers=["muon", "soap", "shampoo"], kfac_phase=False,
                           widen=2, runs_log=str(jl))
    # the run-by-run log holds the same sweep (what an interrupted invocation would leave)
    from_log = tta.recorded_sweep(str(jl), "toy")
    assert tta._recorded_lrs(from_log) == res["lrs"] and len(from_log["runs"]) == len(res["runs"])
    assert res["best_baseline"] is None and not any(c["kfac"] for c in calls)
    assert [round(x, 6) for x in res["widened"]["muon"]] == [round(1e-2 / 3, 6), round(1e-2 / 9, 6)]
    assert math.isclose(res["winners"]["muon"]["lr"], 1e-2 / 3)
    assert res["widened"].get("shampoo") and "soap" not in res["widened"]
    assert not any(res["winner_at_grid_edge"][o] for o in ("muon", "soap"))
    p1 = tmp_path / "new.json"
    p1.write_text(json.dumps({"workloads": [res]}, default=str))
    # SGD and AdamW from another "file", the K-FAC phase reusing both: nothing is swept again
    calls.clear()
    res2 = tta.run_workload(w, [0, 1], False, None, log, optimizers=["sgd", "adamw"], kfac_phase=False, widen=0)
    p2 = tmp_path / "old.json"
    p2.write_text(json.dumps({"workloads": [res2]}, default=str))
    calls.clear()
    rec = tta.recorded_sweep(f"{p2},{p1}", "toy")
    cands = {"rule": {"step_size": "quadratic", "lr_factor": 2.0}, "on_sgd": {"optimizer": "sgd", "damping": 0.1}}
    res3 = tta.run_workload(w, [0], False, None, log, candidates=cands, recorded=rec, widen=2)
    swept_again = [c for c in calls if c["kfac"] is None and c["opt"] in ("muon", "soap", "shampoo")
                   and c["opt"] != res3["best_overall"]["optimizer"]]
    assert not swept_again  # the recorded sweeps are reused (only re-runs of winners happen)
    assert set(res3["winners"]) == {"sgd", "adamw", "muon", "soap", "shampoo"}
    assert res3["best_baseline"]["optimizer"] in ("sgd", "adamw")
    kf = [c["kfac"] for c in calls if c["kfac"]]
    assert {"log_step_time": False, "step_size": "quadratic"} in kf  # passed through unchanged, lr_factor taken off
    assert {"log_step_time": False, "damping": 0.1} in kf
    rule = next(c for c in calls if c["kfac"] == {"log_step_time": False, "step_size": "quadratic"})
    assert math.isclose(rule["lr"], 2.0 * res3["best_baseline"]["lr"])
    assert any(c["kfac"] is None and c["opt"] == res3["best_overall"]["optimizer"]
               and math.isclose(c["lr"], res3["best_overall"]["lr"]) for c in calls)  # the best of all is re-run
    assert "kfac_defaults_over_best_overall_rerun" in res3["ratios"]


def test_candidates_checked_before_any_run(monkeypatch, capsys):
    """A --candidates entry KFAC() refuses stops the script at once (argparse error), before any training."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    tta = importlib.import_module("time_to_accuracy")
    monkeypatch.setattr(tta, "run_workload", lambda *a, **k: pytest.fail("ran a workload"))
    monkeypatch.setattr(sys, "argv", ["time_to_accuracy.py", "--workloads", "digits", "--no-kfac",
                                      "--candidates", '{"bad": {"no_such_option": 1}}', "--out", "/nonexistent/x"])
    with pytest.raises(SystemExit):
        tta.main()


@pytest.mark.parametrize("candidates", ['{"reduce": {"damping": 0.1}}', '{"defaults": {}}', '{"tuned": {}}'])
def test_a_candidate_may_not_take_a_built_in_rows_name(monkeypatch, capsys, candidates):
    """A candidate named like one of the K-FAC phase's own rows would overwrite that row's summary and ratios."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    tta = importlib.import_module("time_to_accuracy")
    monkeypatch.setattr(tta, "run_workload", lambda *a, **k: pytest.fail("ran a workload"))
    with pytest.raises(SystemExit):
        tta.main(["--workloads", "digits", "--candidates", candidates, "--out", "/nonexistent/x"])
    assert "names one of the K-FAC phase's own rows" in capsys.readouterr().err


def test_a_non_empty_out_folder_is_refused_before_any_run(monkeypatch, tmp_path):
    """runs.jsonl is appended to: an --out holding an earlier run's files is refused, nothing runs."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    tta = importlib.import_module("time_to_accuracy")
    monkeypatch.setattr(tta, "run_workload", lambda *a, **k: pytest.fail("ran a workload"))
    (tmp_path / "runs.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit, match="exists and is not empty"):
        tta.main(["--workloads", "digits", "--out", str(tmp_path)])
    assert (tmp_path / "runs.jsonl").read_text() == "{}\n"


def test_candidate_lr_from_and_no_reruns(bench, monkeypatch):
    """Issue 37: a candidate's ``lr_from`` takes its lr from that optimizer's sweep winner (K-FAC on Muon at Muon's
    tuned lr, not AdamW's); ``reruns=False`` runs no baseline again and compares K-FAC with the winners' sweep runs."""
    tta, _ = bench
    calls: list[dict] = []
    monkeypatch.setattr(tta, "run_one", _stub_run_one(tta, calls))
    w = tta.Workload("toy", "toy", None, None, "val_acc", "max", 0.9, budget=8,
                     lrs={"sgd": [0.1], "adamw": [3e-3, 1e-2, 3e-2], "muon": [1e-3, 3e-3, 1e-2]}, quick_budget=2)
    cands = {"on_muon": {"optimizer": "muon", "lr_from": "muon", "lr_factor": 0.5}}
    res = tta.run_workload(w, [0], False, None, lambda m: None, candidates=cands, optimizers=["adamw", "muon"],
                           widen=0, kfac_rows=(), reruns=False)
    # the stub's optima: adamw 1e-2, muon 3e-3 (inside both grids)
    assert math.isclose(res["winners"]["muon"]["lr"], 3e-3) and math.isclose(res["winners"]["adamw"]["lr"], 1e-2)
    kfac = [(c["opt"], round(c["lr"], 9)) for c in calls if c["kfac"] == {"log_step_time": False}]
    assert kfac == [("sgd", 0.1), ("adamw", 1e-2), ("muon", 1.5e-3)]  # a K-FAC warm-up, defaults, the candidate
    plain = [c for c in calls if c["kfac"] is None]
    assert len(plain) == 6 + 3  # the sweep, and untimed warm-ups of adamw, muon and sgd; no re-run
    assert res["reruns"] is False and res["rerun"] == res["winners"]["adamw"]
    assert "no re-runs" in res["table"]
    # lr_from names an optimizer that was not swept: a clear error before any K-FAC run
    calls.clear()
    with pytest.raises(SystemExit, match="lr_from 'soap' was not swept"):
        tta.run_workload(w, [0], False, None, lambda m: None, candidates={"x": {"lr_from": "soap"}},
                         optimizers=["adamw", "muon"], widen=0, kfac_rows=())
    assert [c["opt"] for c in calls if c["kfac"]] == ["sgd"]  # the untimed K-FAC warm-up only


def test_issue37_workloads(bench):
    """gpt2_long: GPT-2's model with 20 steps an epoch (validation every 20), at least 400 steps, AdamW's target;
    resnet18w: ResNet-18's widths with BasicBlocks and BatchNorm on 3x32x32 inputs. Every baseline has a grid of at
    least 3 points (the quick budgets are one epoch)."""
    tta, opt = bench
    from lightning_spdkfac.demo.cifar import BasicBlock

    g = tta.WORKLOADS["gpt2_long"]
    data = g.data(0)
    assert data.batches_per_epoch == 20 and g.budget * data.batches_per_epoch >= 400
    assert g.target_from == "adamw" and g.mode == "min" and g.quick_budget == 1
    ref = tta.gpt2_data(0)  # the "gpt2" workload's data but for the epoch length
    assert {k: v for k, v in data.hparams.items() if k != "batches_per_epoch"} == \
        {k: v for k, v in ref.hparams.items() if k != "batches_per_epoch"}
    r = tta.WORKLOADS["resnet18w"]
    m = r.model("sgd", 0.1, 0)
    blocks = [b for b in m.modules() if isinstance(b, BasicBlock)]
    assert [b.conv2.out_channels for b in blocks] == [64, 128, 256, 512]
    assert sum(isinstance(x, nn.BatchNorm2d) for x in m.modules()) >= 2 * len(blocks)
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10) and r.quick_budget == 1
    for w in (g, r):
        assert set(w.lrs) == set(opt.BASELINE_OPTIMIZERS)
        assert all(len(w.lrs[o]) >= 3 for o in ("sgd", "adamw", "muon", "soap"))
