"""K-FAC on models people bring, built offline from ``transformers`` config classes (random weights, nothing
downloaded): GPT-2 (Conv1D body, tied 50257-token head), BERT (tied decoder with a bias its parent aliases),
Llama (untied 32000-token head, RMSNorm), ViT (patch-embedding Conv2d) and ConvNeXt (7x7 depthwise convolutions).

For each: the exact set of preconditioned layers, every trainable parameter in a block or named in the summary,
the K-FAC memory as the summary says, one step against a dense float64 reference (GPT-2), a checkpoint round
trip, and a 2-rank SPD-KFAC run equal to one process (GPT-2).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

from lightning_spdkfac.kfac.preconditioner import KFACPreconditioner  # noqa: E402
from tests.helpers.dense_reference import F64, assert_close, damped_invs  # noqa: E402
from tests.helpers.memory import held_bytes  # noqa: E402

NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def gpt2(vocab: int = 50257, **kw):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=vocab, **NO_DROPOUT, **kw)
    return transformers.GPT2LMHeadModel(cfg)


def bert():
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=64))


def vit():
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
        patch_size=8, num_labels=10))


def convnext():
    torch.manual_seed(0)
    return transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
        hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, num_labels=10))


def lm_batch(vocab: int, seed: int = 0, batch: int = 2, length: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    return dict(input_ids=ids, labels=ids)


def image_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return dict(pixel_values=torch.randn(2, 3, 32, 32, generator=g), labels=torch.randint(0, 10, (2,), generator=g))


def names_of(model: nn.Module, *types: type) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, types)}


# name -> (model, batch, expected preconditioned layers (from the module types, independently of K-FAC),
#          expected left out, layout checks)
CASES = {
    "gpt2": (gpt2, lambda: lm_batch(50257),
             lambda m: names_of(m, Conv1D) | {"lm_head", "transformer.wpe"}, {"transformer.wte"},
             {"lm_head": ((32, 32), (50257,)), "transformer.wpe": ((64,), (32, 32))}),
    "bert": (bert, lambda: lm_batch(30522),
             lambda m: names_of(m, nn.Linear) | names_of(m, nn.Embedding) - {"bert.embeddings.word_embeddings"},
             {"bert.embeddings.word_embeddings"},
             {"cls.predictions.decoder": ((33, 33), (30522,))}),
    "llama": (llama, lambda: lm_batch(32000),
              lambda m: names_of(m, nn.Linear) | names_of(m, nn.Embedding), set(),
              {"lm_head": ((32, 32), (32000,)), "model.embed_tokens": ((32000,), (32, 32))}),
    "vit": (vit, image_batch, lambda m: names_of(m, nn.Linear, nn.Conv2d), set(), {}),
    "convnext": (convnext, image_batch, lambda m: names_of(m, nn.Linear, nn.Conv2d), set(),
                 {"convnext.encoder.stages.0.layers.0.dwconv": ((16, 50, 50), (16, 1, 1))}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_preconditioned_layers_coverage_and_memory(name: str) -> None:
    make, batch, expected, left_out, layouts = CASES[name]
    model = make()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
    assert set(pre.layers) == expected(model)
    assert set(pre.skipped) == left_out
    # Nothing is skipped silently: every skip was warned about, by name.
    for skipped in left_out:
        assert any(repr(skipped) in str(w.message) for w in record), skipped
    for layer, (a, g) in layouts.items():
        assert (pre.layers[layer].a_shape, pre.layers[layer].g_shape) == (a, g), layer
    s = pre.summary()
    assert s.preconditioned + sum(x.params for x in s.left_out) == s.trainable
    assert s.preconditioned >= 0.95 * s.trainable, str(s)  # the rest: norms and loose parameters, named
    assert all(x.reason for x in s.left_out)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _step in range(2):
        out = model(**batch())
        opt.zero_grad()
        out.loss.backward()
        pre.step(opt)
        opt.step()
        assert torch.isfinite(out.loss)
    held = held_bytes(pre)
    assert held <= 1.05 * s.total_bytes and held >= 0.95 * s.total_bytes, (held, s.total_bytes)


def test_gpt2_step_against_dense_reference() -> None:
    """GPT-2 with a 300-token vocabulary, max_factor_side 100 (so the tied head's G is diagonal), float64: the
    preconditioned gradients of a Conv1D projection and of the tied head equal dense references from the captured
    inputs and output gradients (the head's block preconditions the shared weight's whole gradient)."""
    model = gpt2(vocab=300).double()
    damping = 1e-2
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, kl_clip=None, damping=damping,
                             max_factor_side=100, factor_dtype="float64", inv_dtype="float64")
    mods = dict(model.named_modules())
    watch = ["transformer.h.1.mlp.c_fc", "lm_head"]
    inputs: dict[str, torch.Tensor] = {}
    gouts: dict[str, torch.Tensor] = {}

    def hook(name):
        def f(module, args, output):
            inputs[name] = args[0].detach().clone()
            output.register_hook(lambda g: gouts.__setitem__(name, g.detach().clone()))
        return f

    handles = [mods[n].register_forward_hook(hook(n)) for n in watch]
    model(**lm_batch(300)).loss.backward()
    for h in handles:
        h.remove()
    want = {}
    for n in watch:
        x = inputs[n].reshape(-1, inputs[n].shape[-1]).to(F64)
        a = torch.cat([x, torch.ones(x.shape[0], 1, dtype=F64)], 1) if mods[n].bias is not None else x
        d = gouts[n].reshape(-1, gouts[n].shape[-1])
        A = a.T @ a / a.shape[0]
        G = a.shape[0] * (d.T @ d)  # K-FAC-expand: every position an example
        if G.shape[0] > 100:
            G = torch.diag(torch.diagonal(G))
        w = mods[n].weight
        grad = w.grad.T if isinstance(mods[n], Conv1D) else w.grad  # out x in
        if mods[n].bias is not None:
            grad = torch.cat([grad, mods[n].bias.grad.reshape(-1, 1)], 1)
        Ai, Gi = damped_invs(A, G, damping)
        want[n] = Gi @ grad @ Ai
    pre.step()
    for n in watch:
        w = mods[n].weight
        got = w.grad.T if isinstance(mods[n], Conv1D) else w.grad
        if mods[n].bias is not None:
            got = torch.cat([got, mods[n].bias.grad.reshape(-1, 1)], 1)
        assert_close(got, want[n], 1e-8)


@pytest.mark.parametrize("name", ["gpt2", "convnext"])
def test_checkpoint_round_trip(name: str) -> None:
    make, batch, *_ = CASES[name]
    model = make()
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=2, lr=1e-3)
    for _step in range(3):
        model.zero_grad()
        model(**batch()).loss.backward()
        pre.step()
    state = pre.state_dict()
    twin = copy.deepcopy(model)
    other = KFACPreconditioner(twin, factor_update_steps=1, inv_update_steps=2, lr=1e-3)
    other.load_state_dict(state)
    for m, p in ((model, pre), (twin, other)):
        m.zero_grad()
        m(**batch()).loss.backward()
        p.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad)


# ------------------------------------------------------------------ 2 ranks
KW = dict(damping=0.05, kl_clip=1e-2, lr=0.05, factor_update_steps=1, inv_update_steps=2, max_factor_side=100)
STEPS, PER_RANK = 4, 2


def _lm_data(step: int, world: int) -> torch.Tensor:
    return lm_batch(300, seed=10 + step, batch=PER_RANK * world)["input_ids"]


def _train(model: nn.Module, net: nn.Module, pre: KFACPreconditioner, world: int, rank: int | None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        ids = _lm_data(step, world)
        if rank is not None:
            ids = ids[rank * PER_RANK:(rank + 1) * PER_RANK]
        opt.zero_grad()
        # Position ids per example (B x T): GPT-2's default 1 x T ids are shared by the batch, and the position
        # embedding's G would then depend on the per-rank batch (K-FAC warns about it).
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        logits = net(input_ids=ids, position_ids=positions).logits[:, :-1]
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
        pre.step()
        opt.step()


def _ranked(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_spdkfac.comm.scheduler import SPDDistributor, SPDOptions

    torch.set_num_threads(1)
    out = {}
    for run in RUNS:
        model = gpt2(vocab=300)
        schedule, asynchronous = run.split("-")[0], run.endswith("async")
        options = SPDOptions.from_schedule(schedule=schedule, profile_steps=(1, 2),
                                           async_inverses=True if asynchronous else None)
        pre = KFACPreconditioner(model, distributor=SPDDistributor(options, process_group=dist.new_group()), **KW)
        _train(model, DDP(model), pre, world, rank)
        out[run] = [p.detach().clone() for p in model.parameters()]
        pre.remove_hooks()
    return out


RUNS = ("spd", "dpkfac", "spd-async")


def test_gpt2_two_ranks_equal_one_process() -> None:
    """GPT-2 (Conv1D body, tied head with a diagonal G, a position embedding with a diagonal A) under SPD-KFAC,
    dpkfac and SPD-KFAC with async inverses on 2 gloo processes: the replicas are bitwise equal and equal one
    process on the joint batch."""
    from lightning_spdkfac.multiprocess import run_distributed

    results = run_distributed(_ranked, 2, timeout=240)
    references = {}
    for asynchronous in (False, True):  # async inverses: one step staler, in one process as on two
        model = gpt2(vocab=300)
        _train(model, model, KFACPreconditioner(model, async_inverses=asynchronous, **KW), 2, None)
        references[asynchronous] = [p.detach() for p in model.parameters()]
    for run in RUNS:
        for a, b in zip(results[0][run], results[1][run]):
            assert torch.equal(a, b), f"{run}: the replicas differ"
        for a, b in zip(results[0][run], references[run.endswith("async")]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=f"{run} vs one process")
