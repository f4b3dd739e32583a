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


def test_step_time_is_logged(tmp_path):
    from pytorch_lightning.loggers import CSVLogger

    model = Tiny()
    t = trainer(max_steps=3, logger=CSVLogger(tmp_path), log_every_n_steps=1, callbacks=[KFAC(**KW)])
    t.fit(model)
    assert "kfac/step_ms" in t.logged_metrics
    assert float(t.logged_metrics["kfac/step_ms"]) > 0
    logged = t.logged_metrics
    for phase in ("factor_compute", "factor_update", "precondition", "fwd_bwd"):
        assert float(logged[f"kfac/{phase}_ms"]) > 0, phase
    assert float(logged["kfac/factor_comm_wait_ms"]) == 0.0  # one process: nothing to wait for


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
