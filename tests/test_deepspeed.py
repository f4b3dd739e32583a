"""SPDKFACDeepSpeedStrategy (ZeRO 0/1/2) under a real Trainer on 2 gloo processes, on CPU.

References are independent runs: the same training under ``SPDKFACStrategy`` (DDP), DeepSpeed
without K-FAC, one larger batch instead of accumulation, an uninterrupted run instead of a resumed
one, and DeepSpeed's own per-parameter gradient accessor instead of the fused gather.
"""

from __future__ import annotations

import os
import re
import warnings

import pytest
import pytorch_lightning as pl
import torch

pytest.importorskip("deepspeed")

from helpers import hardware  # noqa: E402
from helpers.lightning_models import KW, TinyInterleaved, fit_on_ranks, trainer  # noqa: E402

from lightning_spdkfac import KFAC, SPDKFACDeepSpeedStrategy  # noqa: E402
from lightning_spdkfac.lightning.deepspeed_grads import DeepSpeedGradAccess, _fusable  # noqa: E402
from lightning_spdkfac.multiprocess import run_distributed  # noqa: E402

STEPS = 6


class TinyInf(TinyInterleaved):
    """Makes the gradient of the last bias non-finite at optimizer step ``inf_at`` (factors stay finite)."""

    def __init__(self, inf_at=None, **kw):
        super().__init__(**kw)
        self.inf_at = inf_at
        self.net[2].bias.register_hook(self._poison)

    def _poison(self, grad):
        if self.inf_at is not None and self.trainer.global_step == self.inf_at:
            return grad * float("inf")
        return grad


class Probe(pl.Callback):
    """Records, after K-FAC's step, the factors, counters, loss scale and parameters of every step."""

    def __init__(self, kfac):
        self.kfac = kfac
        self.steps = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pre = self.kfac.preconditioner
        if pre is None or not pre.final_micro_batch:
            return
        self.steps.append(dict(
            factors={n: (ly.A.clone(), ly.G.clone()) for n, ly in pre.layers.items() if ly.A is not None},
            skipped=(pre.skipped_factor_steps, pre.skipped_precondition_steps),
            loss_scale=pre.grad_access.loss_scale(),
        ))

    def on_train_end(self, trainer, pl_module):
        d = self.kfac.preconditioner.distributor
        plan = d.describe()
        plan.pop("models")  # measured costs: rank 0's are what every rank planned with
        group = d.process_group
        self.plan = dict(plan, own_group=group is not None and group is not torch.distributed.group.WORLD)

    def on_train_batch_end(self, trainer, pl_module, *args):
        if self.steps and "params" not in self.steps[-1]:
            self.steps[-1]["params"] = [p.detach().float().clone() for p in pl_module.net.parameters()]


class GatherCheck(pl.Callback):
    """Before K-FAC's step: the fused gather equals deepspeed.utils.safe_get_full_grad, parameter by parameter."""

    def __init__(self):
        self.checked = 0
        self.paths = set()
        self.access = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        params = [p for p in pl_module.net.parameters()]
        frag = [p for p in params if DeepSpeedGradAccess._partitioned(p)]
        if not frag:
            self.paths.add("param.grad")
            return
        assert _fusable(frag)
        if self.access is None:  # one for the whole run: its second and later gathers reuse the exchanged layout
            self.access = DeepSpeedGradAccess(lambda: trainer.strategy.deepspeed_engine)
        fused = self.access._gather_fused(frag)
        assert fused is not None, "the partitions did not tile the parameters: no fused gather"
        each = DeepSpeedGradAccess._gather_each(frag)
        for p in frag:
            # bitwise, the sign of zeros included
            assert torch.equal(fused[p].view(torch.int32), each[p].float().view(torch.int32)), \
                "fused gather differs from safe_get_full_grad"
        self.paths.add("hp_grad" if getattr(frag[0], "_hp_grad", None) is not None else "hp_mapping")
        self.checked += 1


def ds_fit(rank, world, steps, *, stage=2, precision="32-true", accumulate=1, kfac=True, fused=True,
           check_gather=False, inf_at=None, ckpt_dir=None, resume=None, **strategy_kw):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    hardware.apply_overrides()  # --cpu-fp16=off reaches the ranks too
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model = TinyInf(inf_at=inf_at, batch_size=4 // accumulate)
    strategy = SPDKFACDeepSpeedStrategy(stage=stage, profile_steps=(1, 3), fused_grad_gather=fused,
                                        logging_batch_size_per_gpu=4 // accumulate, **strategy_kw)
    callbacks = []
    gather = GatherCheck() if check_gather else None
    if gather:
        callbacks.append(gather)
    cb = KFAC(**KW) if kfac else None
    probe = Probe(cb) if kfac else None
    if kfac:
        callbacks += [cb, probe]
    if ckpt_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=4, save_top_k=-1))
    t = trainer(max_steps=steps, devices=world, strategy=strategy, callbacks=callbacks, precision=precision,
                use_distributed_sampler=False, accumulate_grad_batches=accumulate,
                enable_checkpointing=bool(ckpt_dir))
    t.fit(model, ckpt_path=resume)
    out = dict(
        params=[p.detach().float().clone() for p in model.net.parameters()],
        optimizer=type(t.strategy.deepspeed_engine.optimizer).__name__,
        micro_steps=t.strategy.deepspeed_engine.micro_steps,
    )
    if kfac:
        out.update(steps=probe.steps, kfac_steps=cb.state_dict()["steps"], plan=probe.plan)
    if gather:
        out.update(gather_checked=gather.checked, gather_paths=sorted(gather.paths))
    return out


@pytest.fixture(scope="module")
def ddp_reference():
    results = run_distributed(fit_on_ranks, 2, "spd", STEPS, timeout=120)
    return results[0][0]


def _relnorm(a, b):
    a, b = torch.cat([x.flatten() for x in a]), torch.cat([x.flatten() for x in b])
    return float((a - b).norm() / b.norm())


def _rel(a, b):
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b))


# Stage 2 in the 10-minute suite, 0 and 1 in make test-slow (~8 s each).
@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), pytest.param(1, marks=pytest.mark.slow), 2])
def test_zero_stage_equals_ddp(stage, ddp_reference):
    results = run_distributed(ds_fit, 2, STEPS, stage=stage, timeout=240)
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)
    for a, b in zip(results[0]["params"], ddp_reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert results[0]["kfac_steps"] == STEPS
    # The SPD schedule ran as under DDP: pipelined, planned (identically on both ranks), on its own group.
    plan = results[0]["plan"]
    assert plan == results[1]["plan"] and plan["pipelined"] and not plan["measuring"] and plan["own_group"]
    # Stage 0 is no ZeRO (the client optimizer, gradients in param.grad); 1 and 2 are DeepSpeed's ZeRO optimizer.
    assert (results[0]["optimizer"] == "DeepSpeedZeroOptimizer") == (stage > 0)


def test_kfac_acts_under_deepspeed(ddp_reference):
    plain = run_distributed(ds_fit, 2, STEPS, kfac=False, timeout=240)[0]["params"]
    assert _rel(plain, ddp_reference) > 0.05  # DeepSpeed SGD alone ends far from the K-FAC run


@pytest.mark.parametrize("stage,precision,fp32_accumulation,path", [
    (1, "32-true", False, "hp_mapping"),
    (2, "32-true", False, "hp_mapping"),
    (2, "bf16-mixed", False, "hp_mapping"),
    # bf16 parameters with fp32 gradient accumulation at stage 1 is DeepSpeed's BF16_Optimizer, which keeps
    # a full fp32 accumulation buffer on every rank.
    (1, "bf16-mixed", True, "hp_grad"),
])
@pytest.mark.slow  # (make test-slow: kept out of the 10-minute suite; tests/test_zero_gather.py keeps a fused-gather case in it)
def test_fused_gather_equals_deepspeeds_accessor(stage, precision, fp32_accumulation, path):
    kw = {}
    if fp32_accumulation:
        kw["config"] = {"zero_optimization": {"stage": stage}, "data_types": {"grad_accum_dtype": "fp32"},
                        "zero_allow_untested_optimizer": True}
    r = run_distributed(ds_fit, 2, 3, stage=stage, precision=precision, check_gather=True, timeout=240, **kw)[0]
    assert r["gather_checked"] == 3 and r["gather_paths"] == [path]


BF16_OPTIMIZER = dict(stage=1, precision="bf16-mixed", config={
    "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}, "zero_allow_untested_optimizer": True,
})


@pytest.mark.slow  # (make test-slow: kept out of the 10-minute suite; ZeRO against DDP stays in it: test_zero_stage_equals_ddp)
@pytest.mark.parametrize("kw", [dict(stage=2), BF16_OPTIMIZER], ids=["zero2", "bf16-optimizer"])
def test_per_parameter_accessor_path_gives_the_same_training(kw, ddp_reference):
    fused = run_distributed(ds_fit, 2, STEPS, timeout=240, **kw)[0]["params"]
    each = run_distributed(ds_fit, 2, STEPS, fused=False, timeout=240, **kw)[0]["params"]
    for a, b in zip(fused, each):
        assert torch.equal(a, b)
    # And K-FAC really reached the optimizer. In bf16 the run is 0.12 (relative norm) from fp32 DDP K-FAC,
    # as the ZeRO-2 bf16 run is (0.11); without K-FAC it would be ~1 away (0.97 measured).
    tol = 1e-6 if kw.get("precision") is None else 0.25
    assert _relnorm(fused, ddp_reference) < tol


@pytest.mark.slow  # ~10 s; accumulation under DDP stays in the suite (test_strategy.py)
def test_accumulation_equals_the_larger_batch(ddp_reference):
    acc = run_distributed(ds_fit, 2, STEPS, stage=2, accumulate=2, timeout=240)[0]
    assert acc["micro_steps"] == 2 * STEPS and acc["kfac_steps"] == STEPS
    # Micro-batches of 2 sum in another order than batches of 4; damped inverses amplify the round-off.
    for a, b in zip(acc["params"], ddp_reference):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


needs_cpu_fp16 = pytest.mark.skipif(not hardware.deepspeed_cpu_fp16(), reason=hardware.no_fp16_reason())


@needs_cpu_fp16
def test_fp16_loss_scale_is_taken_out_of_the_factors():
    fp32 = run_distributed(ds_fit, 2, 4, stage=2, timeout=240)[0]["steps"]
    fp16 = run_distributed(ds_fit, 2, 4, stage=2, precision="16-mixed", loss_scale=1024, timeout=240)[0]["steps"]
    assert fp16[-1]["loss_scale"] == 1024.0
    for name, (A, G) in fp32[-1]["factors"].items():
        A16, G16 = fp16[-1]["factors"][name]
        # fp16 activations and gradients: ~1e-3 relative; an unremoved scale would be 1024^2 times off.
        torch.testing.assert_close(G16, G, rtol=2e-2, atol=2e-2 * float(G.abs().max()))
        torch.testing.assert_close(A16, A, rtol=2e-2, atol=2e-2 * float(A.abs().max()))


@needs_cpu_fp16
def test_fp16_overflow_step_leaves_factors_untouched_and_training_continues():
    inf_at = 3
    r = run_distributed(ds_fit, 2, 6, stage=2, precision="16-mixed", inf_at=inf_at, initial_scale_power=8,
                        timeout=240)[0]
    steps = r["steps"]
    assert len(steps) == 6
    before, bad, after = steps[inf_at - 1], steps[inf_at], steps[inf_at + 1]
    assert before["skipped"] == (0, 0) and bad["skipped"] == (1, 1) and steps[-1]["skipped"] == (1, 1)
    for name, (A, G) in before["factors"].items():
        assert torch.equal(bad["factors"][name][0], A) and torch.equal(bad["factors"][name][1], G)
        assert not torch.equal(after["factors"][name][1], G)  # the next step updates them again
    # DeepSpeed skipped the overflow step (parameters unchanged), then trained on.
    for a, b in zip(bad["params"], before["params"]):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(steps[-1]["params"], bad["params"]))
    assert all(torch.isfinite(p).all() for p in steps[-1]["params"])
    for s in steps:
        for A, G in s["factors"].values():
            assert torch.isfinite(A).all() and torch.isfinite(G).all()


@pytest.mark.slow  # (make test-slow: kept out of the 10-minute suite; ~19 s)
def test_checkpoint_resume_equals_uninterrupted(tmp_path):
    full = run_distributed(ds_fit, 2, 8, stage=2, ckpt_dir=str(tmp_path), timeout=240)[0]
    ckpt = tmp_path / "epoch=0-step=4.ckpt"
    assert ckpt.is_dir(), sorted(p.name for p in tmp_path.iterdir())  # DeepSpeed writes a directory
    client = torch.load(ckpt / "checkpoint" / "mp_rank_00_model_states.pt", weights_only=False, map_location="cpu")
    state = client["callbacks"]["KFAC"]
    assert state["steps"] == 4 and set(state["layers"]) == {"net.0", "net.2"}

    resumed = run_distributed(ds_fit, 2, 8, stage=2, resume=str(ckpt), timeout=240)[0]
    assert resumed["kfac_steps"] == full["kfac_steps"] == 8
    for a, b in zip(resumed["params"], full["params"]):
        assert torch.equal(a, b)
    for name, (A, G) in full["steps"][-1]["factors"].items():
        A_resumed, G_resumed = resumed["steps"][-1]["factors"][name]
        assert torch.equal(A_resumed, A) and torch.equal(G_resumed, G)


def test_registry_names_and_stage_validation(tmp_path):
    t = pl.Trainer(strategy="spdkfac_deepspeed_stage_1", accelerator="cpu", devices=1, logger=False)
    assert isinstance(t.strategy, SPDKFACDeepSpeedStrategy)
    assert t.strategy.config["zero_optimization"]["stage"] == 1
    t = pl.Trainer(strategy="spdkfac_deepspeed", accelerator="cpu", devices=1, logger=False)
    assert t.strategy.config["zero_optimization"]["stage"] == 2 and t.strategy.spd_options.schedule == "spd"
    s = SPDKFACDeepSpeedStrategy(schedule="mpd", stage=0)
    assert s.spd_options.placement == "round_robin"
    with pytest.raises(ValueError, match="ZeRO stages 0 to 3, not stage 4"):  # (stage 3: test_deepspeed_zero3.py)
        SPDKFACDeepSpeedStrategy(stage=4)
    with pytest.raises(ValueError, match="ZeRO stages 0 to 3.*stage 4"):
        SPDKFACDeepSpeedStrategy(config={"zero_optimization": {"stage": 4}})
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 1, "overlap_comm": false}}')
    s = SPDKFACDeepSpeedStrategy(config=str(path))  # a DeepSpeed JSON file, as in Lightning
    assert s.config["zero_optimization"] == {"stage": 1, "overlap_comm": False}
    path.write_text('{"zero_optimization": {"stage": 4}}')
    with pytest.raises(ValueError, match="stage 4 .in config="):
        SPDKFACDeepSpeedStrategy(config=str(path))
    with pytest.raises(TypeError, match="stage must be the ZeRO stage"):  # a wrong type: TypeError
        SPDKFACDeepSpeedStrategy(stage="two")
    with pytest.raises(ValueError, match="schedule must be one of"):
        SPDKFACDeepSpeedStrategy(schedule="fast")


@pytest.mark.parametrize("precision,config", [
    ("16-mixed", None),
    ("16-true", None),
    ("32-true", {"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}),
], ids=["16-mixed", "16-true", "config-fp16"])
def test_fp16_on_a_cpu_without_fp16_is_refused_before_any_process_group(precision, config, monkeypatch):
    """Forces DeepSpeed's CPU accelerator to answer "no fp16" (as on CPUs without AVX512-FP16/AMX), so this
    runs on every machine: the Trainer refuses in the launching process, naming the precision, the cause and
    the fix, with no process group and no engine; precisions DeepSpeed can run are accepted."""
    import torch.distributed as dist
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    monkeypatch.setattr(CPU_Accelerator, "is_fp16_supported", lambda self: False)
    named = f"precision={precision!r}" if config is None else "config['fp16']['enabled']=True"
    with pytest.raises(ValueError) as info:
        pl.Trainer(strategy=SPDKFACDeepSpeedStrategy(config=config), accelerator="cpu", devices=2,
                   precision=precision, logger=False)
    message = str(info.value)
    assert message.startswith(f"{named} cannot run under SPDKFACDeepSpeedStrategy"), message
    assert "CPU accelerator runs fp16 only on CPUs with oneDNN fp16 kernels" in message, message
    assert "precision='bf16-mixed'" in message and "precision='32-true'" in message, message
    assert ("remove the 'fp16' section" in message) == (config is not None), message
    assert not dist.is_initialized()
    for ok in ("bf16-mixed", "32-true"):  # what the message recommends is accepted on the same CPU
        t = pl.Trainer(strategy=SPDKFACDeepSpeedStrategy(), accelerator="cpu", devices=2, precision=ok, logger=False)
        assert isinstance(t.strategy, SPDKFACDeepSpeedStrategy)
    # With fp16 support the same Trainer is built; a strategy whose launcher was configured then is still
    # refused at setup_environment, the first thing a rank runs, before it starts the process group.
    monkeypatch.setattr(CPU_Accelerator, "is_fp16_supported", lambda self: True)
    t = pl.Trainer(strategy=SPDKFACDeepSpeedStrategy(config=config), accelerator="cpu", devices=2,
                   precision=precision, logger=False)
    monkeypatch.setattr(CPU_Accelerator, "is_fp16_supported", lambda self: False)
    with pytest.raises(ValueError, match=f"^{re.escape(named)} cannot run"):
        t.strategy.setup_environment()
    assert not dist.is_initialized()
