"""The simulator and ``spdkfac plan`` on diagonal and grouped factors (lightning_spdkfac.factor_shapes): a model with
a 50257-wide LM head (its G diagonal above max_factor_side), an embedding (its A diagonal: token counts) and a
depthwise convolution (one dense block per group) is profiled in the runtime's layouts, and its plan's messages,
inversions and memory follow them, against hand computations from the layouts. Dense specs keep their numbers."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

from lightning_spdkfac.factor_shapes import inverse_numel, numel, packed_numel, preconditioned_shape
from lightning_spdkfac.kfac.preconditioner import KFACPreconditioner
from lightning_spdkfac.schedule import AlphaBeta, InverseCost
from lightning_spdkfac.simulate import Cluster, LayerSpec, Workload, profile_layers, simulate
from lightning_spdkfac.simulate.memory import memory_per_gpu
from lightning_spdkfac.simulate.plan import PlanInputs, plan
from lightning_spdkfac.simulate.plan_cli import main
from lightning_spdkfac.simulate.sim_schedule import SIM_SCHEDULES

VOCAB, TOKENS, DIM, SEQ = 50257, 30000, 64, 16
INV = InverseCost(c0=1e-4, c1=2e-9, c2=1e-11, c3=1e-13)
AR = AlphaBeta(1e-5, 1e-9)
BC = AlphaBeta(2e-5, 2e-9)


class ShapesNet(nn.Module):
    """Token ids (16 per sample) -> nn.Embedding(30000, 64) -> a depthwise 7x7 conv on the 16 tokens as a 4x4
    image of 64 channels -> a 50257-wide linear head (built by path: ``test_simulate_shapes:ShapesNet``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(TOKENS, DIM)
        self.dw = nn.Conv2d(DIM, DIM, 7, padding=3, groups=DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)  # B x 16 x 64
        b = x.shape[0]
        x = self.dw(x.transpose(1, 2).reshape(b, DIM, 4, 4))
        return self.head(x.reshape(b, DIM, SEQ).transpose(1, 2))  # B x 16 x 50257


def specs(max_factor_side: int | None = 4608) -> list[LayerSpec]:
    with torch.device("meta"):
        model = ShapesNet()
    return profile_layers(model, (SEQ,), dtype=torch.int64, max_factor_side=max_factor_side)


def workload() -> Workload:
    return Workload.from_rates("shapes", specs(), 8, flops_per_s=1e13)


def cluster(world: int = 4) -> Cluster:
    return Cluster(world, AR, BC, AR, INV)


def test_profiled_layouts_are_the_runtimes():
    got = {s.name: (s.a_shape, s.g_shape) for s in specs()}
    runtime = KFACPreconditioner(ShapesNet())
    assert got == {name: (runtime.layers[name].a_shape, runtime.layers[name].g_shape) for name in got}
    assert got == {"emb": ((TOKENS,), (DIM, DIM)), "dw": ((DIM, 50, 50), (DIM, 1, 1)),
                   "head": ((DIM + 1, DIM + 1), (VOCAB,))}
    head = specs()[2]
    assert (head.a_side, head.g_side, head.rows) == (DIM + 1, VOCAB, SEQ)
    # the factor FLOPs follow the layouts: rows * n for a diagonal factor, rows * b * n^2 for a grouped one
    assert head.g_flops == 2.0 * SEQ * VOCAB and head.a_flops == 2.0 * SEQ * (DIM + 1) ** 2
    dw = specs()[1]
    assert dw.a_flops == 2.0 * SEQ * DIM * 50**2 and dw.forward_flops == 2.0 * SEQ * 49 * 1 * DIM  # 49 inputs per group, 64 groups
    # max_factor_side as the runtime's: above the vocabulary the head's G is dense; None: every side dense
    assert specs(60000)[2].g_shape == (VOCAB, VOCAB) == specs(None)[2].g_shape
    assert specs(None)[0].a_shape == (TOKENS,)  # an embedding's A is diagonal whatever the size policy
    runtime = KFACPreconditioner(ShapesNet(), max_factor_side=64)
    assert [(s.a_shape, s.g_shape) for s in specs(64)] == [
        (runtime.layers[n].a_shape, runtime.layers[n].g_shape) for n in ("emb", "dw", "head")]


def test_layer_spec_shapes():
    dense = LayerSpec("l", 4, 2, 1, 1.0, 10)
    assert (dense.a_shape, dense.g_shape) == ((4, 4), (2, 2))
    assert dense == LayerSpec("l", 4, 2, 1, 1.0, 10, a_shape=(4, 4), g_shape=(2, 2))
    assert LayerSpec("l", 4, 2, 1, 1.0, 10, a_shape=[3, 4, 4]).a_shape == (3, 4, 4)
    with pytest.raises(ValueError, match="a_side=4"):
        LayerSpec("l", 4, 2, 1, 1.0, 10, a_shape=(5,))
    with pytest.raises(ValueError, match="g_shape"):
        LayerSpec("l", 4, 2, 1, 1.0, 10, g_shape=(2, 3))


def test_inversion_of_the_diagonal_head_is_linear():
    tl = simulate(workload(), cluster(1), "dkfac", rank_events=None)
    (ev,) = [e for e in tl.events if e.label == "invert (2, 'G')"]
    assert ev.end - ev.start == pytest.approx(INV.c0 + INV.c1 * VOCAB, rel=1e-12)
    assert ev.end - ev.start < 1e-3 < INV.time(VOCAB)  # not the cubic of a dense 50257 x 50257 (about 12.7 s)
    (dw,) = [e for e in tl.events if e.label == "invert (1, 'A')"]  # 64 blocks of 50 x 50, one batched call
    assert dw.end - dw.start == pytest.approx(INV.c0 + DIM * (INV.c1 * 50 + INV.c2 * 50**2 + INV.c3 * 50**3))
    assert tl.extra["lower_bound_terms"]["Inversion"] == max(INV.time_of(s) for s in tl.extra["sides"])


def _hand_memory(wl: Workload, owned_inverses: list = (), async_inverses: bool = False,
                 buffers: bool = True) -> dict[str, int]:
    shapes = [x for s in wl.layers for x in (s.a_shape, s.g_shape)]
    model = 12 * wl.params
    kfac = sum(2 * numel(x) for x in shapes) * 4 + (sum(numel(x) for x in shapes) * 4 if async_inverses else 0)
    buf = (sum(packed_numel(x) for x in shapes) * 4 if buffers else 0) + sum(packed_numel(x) for x in owned_inverses) * 4
    return {"model": model, "kfac_state": kfac, "buffers": buf, "total": model + kfac + buf}


def test_plan_memory_and_bytes_from_the_layouts():
    wl, cl = workload(), cluster(4)
    shapes = [x for s in wl.layers for x in (s.a_shape, s.g_shape)]
    out = plan(PlanInputs(workload=wl, cluster=cl, schedules=[SIM_SCHEDULES[n] for n in
                                                            ("dkfac", "spd", "spd-async", "dpkfac")]))
    rows = {r["name"]: r for r in out["schedules"]}
    assert rows["dkfac"]["memory_bytes"] == _hand_memory(wl)
    assert rows["dkfac"]["memory_bytes"]["kfac_state"] == 8 * (TOKENS + DIM**2 + DIM * 50**2 + DIM + (DIM + 1) ** 2
                                                              + VOCAB)  # about 2 MB, not 10 GB
    by_name = {n: simulate(wl, cl, n) for n in ("spd", "spd-async", "dpkfac")}
    order = by_name["spd"].order
    for name in ("spd", "spd-async"):
        tl = by_name[name]
        owned = [tl.extra["sides"][i] for i, o in enumerate(tl.owners) if o >= 0]
        assert rows[name]["memory_bytes"] == _hand_memory(wl, owned, async_inverses=name == "spd-async")
    # dpkfac: the fullest rank holds its layers' factors and inverses
    lp = by_name["dpkfac"].extra["layer_placement"]
    per_rank = [sum(2 * 4 * (numel(wl.layers[i].a_shape) + numel(wl.layers[i].g_shape)) for i in lp.owned_by(r))
                for r in range(4)]
    assert rows["dpkfac"]["memory_bytes"]["kfac_state"] == max(per_rank)
    # bytes communicated: every factor packed once in the fusion groups (a diagonal, triangles per block)
    assert sum(g["bytes"] for g in out["fusion_groups"]) == 4 * sum(packed_numel(x) for x in shapes)
    assert by_name["spd"].extra["sides"] == [wl.layers[i].a_shape if w == "A" else wl.layers[i].g_shape
                                             for i, w in order]
    # spd's placement: per rank the broadcasts of its owned inverses (packed) and its inversions
    spd = plan(PlanInputs(workload=wl, cluster=cl, schedules=[SIM_SCHEDULES["spd"]]))["placement"]
    tl = by_name["spd"]
    assert any(o >= 0 for o in tl.owners)
    repl = sum(INV.time_of(x) for x, o in zip(tl.extra["sides"], tl.owners) if o < 0)
    for r in spd["ranks"]:
        own = [x for x, o in zip(tl.extra["sides"], tl.owners) if o == r["rank"]]
        assert r["broadcast_s"] == pytest.approx(sum(BC.time(4 * inverse_numel(x, "cholesky")) for x in own))
        assert r["inverse_s"] == pytest.approx(repl + sum(INV.time_of(x) for x in own))
    # dpkfac broadcasts each preconditioned gradient: g x a (x b for the grouped conv) fp32 elements
    sends = [e for e in by_name["dpkfac"].events if e.label.startswith("broadcast preconditioned")]
    expect = {s.name: BC.time(4 * numel(preconditioned_shape(s.a_shape, s.g_shape))) for s in wl.layers}
    assert {e.label.rsplit(" ", 1)[1]: e.end - e.start for e in sends} == pytest.approx(expect)
    assert expect["head"] == BC.time(4 * VOCAB * (DIM + 1)) and expect["dw"] == BC.time(4 * DIM * 50)


def test_fusion_bytes_of_the_reductions():
    wl, cl = workload(), cluster(4)
    tl = simulate(wl, cl, "dkfac", rank_events=None)  # one 64 MiB bucket after backward: all factors at once
    (ev,) = [e for e in tl.events if e.category == "FactorComm"]
    assert ev.end - ev.start == pytest.approx(AR.time(4 * sum(packed_numel(x) for x in tl.extra["sides"])))


def test_dense_specs_unchanged():
    """A dense spec given its shapes simulates exactly as one without (the int -> (n, n) path)."""
    plain = [LayerSpec("l0", 40, 20, 3, 1e6, 800), LayerSpec("l1", 30, 10, 2, 2e6, 300)]
    shaped = [LayerSpec(s.name, s.a_side, s.g_side, s.rows, s.forward_flops, s.params,
                        a_shape=(s.a_side, s.a_side), g_shape=(s.g_side, s.g_side)) for s in plain]
    for name in ("dkfac", "spd", "spd-async", "dpkfac", "spd-dear", "spd-paper"):
        a = simulate(Workload.from_rates("w", plain, 8, flops_per_s=1e9), cluster(4), name)
        b = simulate(Workload.from_rates("w", shaped, 8, flops_per_s=1e9), cluster(4), name)
        assert a.breakdown == b.breakdown and a.owners == b.owners and a.groups == b.groups
        assert memory_per_gpu(Workload.from_rates("w", plain, 8, flops_per_s=1e9), a) == memory_per_gpu(
            Workload.from_rates("w", shaped, 8, flops_per_s=1e9), b)


def test_plan_cli_on_the_model(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["--model", f"{__name__}:ShapesNet", "--input-shape", str(SEQ), "--input-dtype", "int64",
            "--world-size", "8", "--batch-size", "8", "--inverse", "3e-4,1e-9,1.4e-13", "--json", str(path)]
    start = time.perf_counter()
    assert main(argv) == 0, capsys.readouterr().err
    assert time.perf_counter() - start < 30
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    w = data["workload"]
    assert (w["largest_factor"], w["diagonal_factors"], w["largest_diagonal"], w["grouped_factors"],
            w["max_factor_side"]) == (DIM + 1, 2, VOCAB, 2, 4608)
    assert "2 diagonal up to 50257, 2 grouped, max_factor_side 4608" in out
    for row in data["schedules"]:  # parameters (3.3 M fp32, x3) and a few MB of K-FAC state: well under 1 GiB
        assert row["memory_bytes"]["total"] < 2**28 and row["memory_bytes"]["kfac_state"] < 2**24
        assert row["total_s"] < 1.0
    # --max-factor-side above the vocabulary: the head's G dense, 50257^2 fp32 twice (factor and inverse)
    dense = tmp_path / "dense.json"
    assert main([*argv[:-1], str(dense), "--max-factor-side", "60000"]) == 0
    rows = {r["name"]: r for r in json.loads(dense.read_text())["schedules"]}
    assert rows["dkfac"]["memory_bytes"]["kfac_state"] >= 8 * VOCAB**2
    capsys.readouterr()
    assert main(["--paper", "resnet50", "--max-factor-side", "100"]) == 2
    assert "--max-factor-side" in capsys.readouterr().err
    assert main([*argv, "--max-factor-side", "0"]) == 2
