"""Layer types beyond Linear/Conv2d (issue 18): Conv1d/Conv3d, nn.MultiheadAttention (and Transformer stacks),
nn.Embedding, and the one setup warning naming the layers K-FAC leaves alone.

Every reference is built here from the definitions, float64, independently of the library: explicit loops over
the output positions of a convolution, a hand-written attention whose projections are leaves (so autograd gives
each token's projected-output gradient), one-hot rows for embeddings; then A = mean_r a_r a_r^T,
G = N sum_r d_r d_r^T, the pi-damped inverses and P = G_inv [dW, db] A_inv (tests/helpers/dense_reference.py).
"""

from __future__ import annotations

import copy
import itertools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers.dense_reference import F64, assert_close, damped_invs
from torch import nn

from lightning_spdkfac import KFACPreconditioner

DAMPING = 0.05


def kfac(model, **kw):
    kw = {"damping": DAMPING, "factor_update_steps": 1, "inv_update_steps": 1, "lr": 0.1, "kl_clip": None,
          "factor_approx": "expand", "factor_dtype": F64, "inv_dtype": F64, **kw}
    return KFACPreconditioner(model, **kw)


def kfac_warnings(record):
    return [str(w.message) for w in record if "K-FAC" in str(w.message)]


def reference(a, d, grad, examples):
    """P = G_inv grad A_inv of the dense factors of rows a (with their bias 1s) and d."""
    A = a.T @ a / a.shape[0]
    G = examples * (d.T @ d)
    A_inv, G_inv = damped_invs(A, G, DAMPING)
    return A, G, G_inv @ grad @ A_inv


def with_ones(a, bias):
    return torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1) if bias else a


# --------------------------------------------------------------------------- Conv1d / Conv3d
def patch_rows(x, conv):
    """One row per output position (example-major), the kernel's window, loops over offsets."""
    n = len(conv.kernel_size)
    pad = conv._reversed_padding_repeated_twice
    x = F.pad(x.to(F64), pad, mode="constant" if conv.padding_mode == "zeros" else conv.padding_mode)
    outs = [(s - d * (k - 1) - 1) // st + 1
            for s, k, d, st in zip(x.shape[2:], conv.kernel_size, conv.dilation, conv.stride)]
    rows = []
    for b in range(x.shape[0]):
        for pos in itertools.product(*map(range, outs)):
            patch = torch.empty(x.shape[1], *conv.kernel_size, dtype=F64)
            for off in itertools.product(*map(range, conv.kernel_size)):
                idx = tuple(p * conv.stride[i] + o * conv.dilation[i] for i, (p, o) in enumerate(zip(pos, off)))
                patch[(slice(None), *off)] = x[(b, slice(None), *idx)]
            rows.append(patch.reshape(-1))
    assert len(outs) == n
    return torch.stack(rows)


CONV_CASES = [
    (nn.Conv1d, dict(kernel_size=3, stride=2, padding=1), (3, 2, 9)),
    (nn.Conv1d, dict(kernel_size=2, dilation=2, padding="same", padding_mode="reflect", bias=False), (2, 2, 7)),
    (nn.Conv3d, dict(kernel_size=(2, 3, 2), stride=(1, 2, 1), padding=1), (2, 2, 4, 5, 3)),
    (nn.Conv3d, dict(kernel_size=2, dilation=(1, 2, 1), padding_mode="circular", padding=1, bias=False),
     (2, 2, 3, 5, 4)),
]


@pytest.mark.parametrize("cls,kw,shape", CONV_CASES)
@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_conv1d_and_conv3d_match_the_dense_reference(cls, kw, shape, approx):
    torch.manual_seed(0)
    conv = cls(2, 3, **kw).double()
    pre = kfac(conv, factor_approx=approx)
    x = torch.randn(*shape, dtype=F64)
    out = conv(x)
    out.retain_grad()
    out.pow(2).sum(1).mean().backward()
    bias = conv.bias is not None
    grad = conv.weight.grad.reshape(3, -1)
    grad = torch.cat([grad, conv.bias.grad[:, None]], 1) if bias else grad
    a = patch_rows(x, conv)
    torch.testing.assert_close(a @ conv.weight.detach().reshape(3, -1).T + (conv.bias.detach() if bias else 0),
                               out.detach().flatten(2).transpose(1, 2).reshape(-1, 3))  # the rows are the conv's
    d = out.grad.flatten(2).transpose(1, 2).reshape(-1, 3)
    if approx == "reduce":  # per example: the mean row, the summed output gradient
        a = a.reshape(shape[0], -1, a.shape[1]).mean(1)
        d = d.reshape(shape[0], -1, 3).sum(1)
    A, G, P = reference(with_ones(a, bias), d, grad.clone(), shape[0])
    pre.step()
    layer = pre.layers[""]
    assert_close(layer.A, A, 1e-9)
    assert_close(layer.G, G, 1e-9)
    got = conv.weight.grad.reshape(3, -1)
    assert_close(torch.cat([got, conv.bias.grad[:, None]], 1) if bias else got, P, 1e-9)


def test_unsupported_layers_are_named_in_one_setup_warning():
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ConvTranspose2d(4, 2, 3), nn.Bilinear(4, 4, 4),
                          nn.LSTM(4, 4), nn.Linear(4, 2), nn.Conv2d(2, 2, 1).requires_grad_(False))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pre = kfac(model)
    msgs = kfac_warnings(record)
    assert set(pre.layers) == {"0", "4"} and set(pre.skipped) == {"1", "2", "3"}
    assert set(pre.frozen_layers) == {"5"}  # frozen at setup: registered once it trains
    combined = [m for m in msgs if "'1'" in m]
    assert len(combined) == 1 and "ConvTranspose2d" in combined[0] and "'3' (LSTM" in combined[0], msgs
    assert "'2' (Bilinear" in combined[0]


# --------------------------------------------------------------------------- attention
def mha_inputs(kdim, batch_first, batched=True, L=4, S=5, N=3, E=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (lambda n, s, e: (n, s, e) if batch_first else (s, n, e)) if batched else (lambda n, s, e: (s, e))
    q = torch.randn(*shape(N, L, E), generator=g, dtype=F64)
    if kdim is None:
        return q, q, q
    k = torch.randn(*shape(N, S, kdim), generator=g, dtype=F64)
    return q, k, torch.randn(*shape(N, S, kdim + 1), generator=g, dtype=F64)


ATTN_CASES = {
    "self-bf": dict(batch_first=True),
    "self-seqfirst-nobias": dict(bias=False),
    "cross-kdim-vdim": dict(kdim=6, batch_first=True),
    "bias-kv-zero-attn": dict(add_bias_kv=True, add_zero_attn=True),
}
CALLS = {
    "weights": dict(need_weights=True),
    "weights-per-head": dict(need_weights=True, average_attn_weights=False),
    "sdpa": dict(need_weights=False),
    "attn-mask-bool": dict(need_weights=False, attn_mask="bool"),
    "attn-mask-float-3d": dict(need_weights=True, attn_mask="float3d"),
    "key-padding": dict(need_weights=False, key_padding_mask=True),
    "causal": dict(need_weights=False, attn_mask="causal", is_causal=True),
    "both-masks": dict(need_weights=True, attn_mask="bool", key_padding_mask=True),
}


def build_call(mha, call, q, k, batch_first, batched=True):
    call = dict(call)
    L, S = q.shape[-2 if batch_first or not batched else 0], k.shape[-2 if batch_first or not batched else 0]
    N = q.shape[0 if batch_first else 1] if batched else 1
    g = torch.Generator().manual_seed(7)
    kind = call.pop("attn_mask", None)
    if kind == "bool":
        call["attn_mask"] = torch.rand(L, S, generator=g) < 0.3
        call["attn_mask"][:, 0] = False  # no query with every key masked (NaN rows either way)
    elif kind == "float3d":
        call["attn_mask"] = torch.randn(N * mha.num_heads, L, S, generator=g, dtype=F64)
    elif kind == "causal":
        call["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(L, dtype=F64)[:, :S]
    if call.pop("key_padding_mask", False):
        kpm = torch.zeros(N, S, dtype=torch.bool)
        kpm[0, -2:] = True
        call["key_padding_mask"] = kpm if batched else kpm[0]
    return call


def attn_module(cfg, seed=0):
    torch.manual_seed(seed)
    cfg = dict(cfg)
    kdim = cfg.pop("kdim", None)
    extra = dict(kdim=kdim, vdim=kdim + 1) if kdim else {}
    return nn.MultiheadAttention(8, 2, **extra, **cfg).double(), kdim


@pytest.mark.parametrize("case", list(ATTN_CASES))
@pytest.mark.parametrize("call", list(CALLS))
def test_attention_forward_and_gradients_are_unchanged(case, call):
    mha, kdim = attn_module(ATTN_CASES[case])
    plain = copy.deepcopy(mha)
    kfac(mha)
    bf = mha.batch_first
    if call == "causal" and kdim is not None:
        return  # (a causal mask is square)
    for batched in (True, False):
        q, k, v = mha_inputs(kdim, bf, batched)
        kw = build_call(mha, CALLS[call], q, k, bf, batched)
        outs = []
        for m in (mha, plain):
            m.zero_grad()
            xs = [t.clone().requires_grad_() for t in (q, k, v)] if kdim else [q.clone().requires_grad_()] * 3
            out, w = m(*xs, **kw)
            (out.pow(2).sum() + (w.sum() if w is not None else 0)).backward()
            outs.append([out, w] + [x.grad for x in xs] + [p.grad for p in m.parameters()])
        for got, want in zip(*outs, strict=True):
            assert (got is None) == (want is None)
            if got is not None:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def ref_attention(mha, q, k, v, mask):
    """Batch-first (N, L, E) inputs; the projections are leaves so that their gradients are the d rows."""
    H, E = mha.num_heads, mha.embed_dim
    W = mha.in_proj_weight if mha._qkv_same_embed_dim else None
    ws = [W[i * E:(i + 1) * E] for i in range(3)] if W is not None else [
        mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight]
    bs = [None] * 3 if mha.in_proj_bias is None else [mha.in_proj_bias[i * E:(i + 1) * E] for i in range(3)]
    proj = [F.linear(x, w.detach(), None if b is None else b.detach()).requires_grad_()
            for x, w, b in zip((q, k, v), ws, bs)]
    N, L, _ = q.shape
    heads = [p.reshape(N, p.shape[1], H, E // H).transpose(1, 2) for p in proj]
    scores = heads[0] @ heads[1].transpose(-1, -2) / math.sqrt(E // H)
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    o = (scores.softmax(-1) @ heads[2]).transpose(1, 2).reshape(N, L, E)
    lin = mha.out_proj
    out = F.linear(o, lin.weight.detach(), None if lin.bias is None else lin.bias.detach())
    out.retain_grad()
    return proj, o, out


@pytest.mark.parametrize("case", ["self-bf", "self-seqfirst-nobias", "cross-kdim-vdim"])
def test_attention_projections_match_the_dense_per_token_reference(case):
    mha, kdim = attn_module(ATTN_CASES[case], seed=3)
    pre = kfac(mha)
    bf = mha.batch_first
    q, k, v = mha_inputs(kdim, bf, seed=4)
    kpm = torch.zeros(3, q.shape[1 if bf else 0], dtype=torch.bool) if kdim is None else None
    if kpm is not None:
        kpm[1, -1] = True
    out, _ = mha(q, k, v, key_padding_mask=kpm, need_weights=False)
    loss = lambda y: (0.5 * y.pow(2) + 0.1 * y).sum(-1).mean()  # noqa: E731
    loss(out).backward()
    # The reference, batch-first, from the definitions.
    bq, bk, bv = (x if bf else x.transpose(0, 1) for x in (q, k, v))
    proj, o, ref_out = ref_attention(mha, bq, bk, bv, None if kpm is None else kpm[:, None, None, :])
    loss(ref_out).backward()
    torch.testing.assert_close(ref_out, out if bf else out.transpose(0, 1))
    bias = mha.in_proj_bias is not None
    blocks = {"q_proj": (bq, proj[0]), "k_proj": (bk, proj[1]), "v_proj": (bv, proj[2]),
              "out_proj": (o, None)}
    refs = {}
    for name, (x, p) in blocks.items():
        a = x.detach().reshape(-1, x.shape[-1])
        d = (p if p is not None else ref_out).grad.reshape(-1, 8)
        lin_bias = bias if name != "out_proj" else mha.out_proj.bias is not None
        grad = d.T @ with_ones(a, lin_bias)
        # the captures themselves: the block's gradient is sum_r d_r a_r^T
        assert_close(pre.layers[name].helper.grad_matrix({p: p.grad for p in mha.parameters()}), grad, 1e-9)
        refs[name] = reference(with_ones(a, lin_bias), d, grad, a.shape[0])
    pre.step()
    for n, (A, G, P) in refs.items():
        layer = pre.layers[n]
        assert_close(layer.A, A, 1e-9)
        assert_close(layer.G, G, 1e-9)
        assert_close(layer.helper.grad_matrix({p: p.grad for p in mha.parameters()}), P, 1e-9)


def test_attention_in_eval_or_without_grad_collects_nothing_and_keeps_the_fast_path():
    mha, _ = attn_module(dict(batch_first=True))
    pre = kfac(mha)
    x = torch.randn(2, 3, 8, dtype=F64)
    mha.eval()
    with torch.no_grad():
        mha(x, x, x)
    assert all(ly.a_calls == 0 and ly.rows == 0 for ly in pre.layers.values())


def test_transformer_stacks_precondition_every_layer():
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0), 2, enable_nested_tensor=False)
    dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 1)
    model = nn.ModuleDict({"enc": enc, "dec": dec}).double()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pre = kfac(model)
    assert not kfac_warnings(record) and not pre.skipped
    expected = set()
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            expected.add(name)
        if isinstance(m, nn.MultiheadAttention):
            expected |= {f"{name}.{p}_proj" for p in "qkv"}
    assert set(pre.layers) == expected
    src, tgt = torch.randn(5, 2, 8, dtype=F64), torch.randn(2, 4, 8, dtype=F64)
    mem = enc(src, mask=nn.Transformer.generate_square_subsequent_mask(5, dtype=F64), is_causal=True)
    dec(tgt, mem.transpose(0, 1)).pow(2).mean().backward()
    raw = {p: p.grad.clone() for p in model.parameters()}
    pre.step()
    assert all(ly.A is not None for ly in pre.layers.values())  # every layer collected
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.grad, raw[p])}
    weights = {n for n, p in model.named_parameters() if "norm" not in n}
    assert changed == weights


# --------------------------------------------------------------------------- embeddings
class TokenModel(nn.Module):
    def __init__(self, vocab=7, dim=4, tied=False, **emb):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, dim, **emb).double()
        self.head = nn.Linear(dim, vocab, bias=False).double()
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def capture(into):
    """A forward hook storing the input ("a") and output gradient ("d") of one call."""

    def hook(module, inputs, output):
        into["a"] = inputs[0].detach()
        output.register_hook(lambda g: into.__setitem__("d", g.detach()))

    return hook


def token_ids(vocab=7):
    ids = torch.randint(0, vocab, (3, 5), generator=torch.Generator().manual_seed(2))
    ids[0, :2] = 0  # padding at the start of one sequence
    return ids


def token_loss(model, ids):
    out = model(ids)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), ids.roll(1, 1).reshape(-1))


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_embedding_matches_the_dense_one_hot_reference(approx):
    model = TokenModel(padding_idx=0)
    pre = kfac(model, factor_approx=approx)
    assert not pre.layers["emb"].reduce  # an embedding's A is diagonal in expand only
    ids = token_ids()
    captured = {}
    model.emb.register_forward_hook(capture(captured))
    token_loss(model, ids).backward()
    onehot = F.one_hot(ids.reshape(-1), 7).to(F64)
    onehot[ids.reshape(-1) == 0] = 0  # padding rows: no gradient reaches weight row 0
    d = captured["d"].reshape(-1, 4)
    grad = model.emb.weight.grad.T.clone()  # (dim x vocab): out x in
    assert_close(d.T @ onehot, grad, 1e-12)
    A, G, P = reference(onehot, d, grad, ids.numel())
    pre.step()
    layer = pre.layers["emb"]
    assert layer.A.shape == (A.shape[0],)  # stored as its diagonal
    assert_close(torch.diag(layer.A), A, 1e-12)
    assert_close(layer.G, G, 1e-9)
    assert_close(model.emb.weight.grad.T, P, 1e-9)
    assert torch.equal(model.emb.weight.grad[0], torch.zeros(4, dtype=F64))  # the padding row stays zero


@pytest.mark.parametrize("kw,why", [(dict(sparse=True), "sparse=True"), (dict(max_norm=1.0), "max_norm"),
                                    (dict(scale_grad_by_freq=True), "scale_grad_by_freq")])
def test_embeddings_k_fac_cannot_model_are_skipped_with_a_warning_and_left_untouched(kw, why, monkeypatch):
    kw = dict(kw)
    model = TokenModel(**kw)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pre = kfac(model)
    msgs = kfac_warnings(record)
    assert len(msgs) == 1 and "'emb'" in msgs[0] and why in msgs[0], msgs
    assert set(pre.layers) == {"head"}
    if kw.get("sparse"):
        return  # (a sparse gradient: nothing to compare densely)
    token_loss(model, token_ids()).backward()
    raw = model.emb.weight.grad.clone()
    pre.step()
    assert torch.equal(model.emb.weight.grad, raw)


def test_a_tied_embedding_is_preconditioned_once_by_the_heads_block():
    model = TokenModel(tied=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pre = kfac(model)
    msgs = kfac_warnings(record)
    assert len(msgs) == 1 and "'emb'" in msgs[0] and "tied to 'head'" in msgs[0], msgs
    assert set(pre.layers) == {"head"} and "emb" in pre.skipped
    ids = token_ids()
    captured = {}
    model.head.register_forward_hook(capture(captured))
    token_loss(model, ids).backward()
    grad = model.head.weight.grad.clone()  # both uses' parts
    a, d = captured["a"].reshape(-1, 4), captured["d"].reshape(-1, 7)
    assert not torch.allclose(d.T @ a, grad)  # the embedding's part is in the gradient
    _, _, P = reference(a, d, grad, ids.numel())
    pre.step()
    assert_close(model.emb.weight.grad, P, 1e-9)


@pytest.mark.parametrize("need_weights", [True, False])
def test_attention_dropout_draws_the_same_masks(need_weights):
    mha, _ = attn_module(dict(dropout=0.3, batch_first=True))
    plain = copy.deepcopy(mha)
    kfac(mha)
    q = torch.randn(2, 4, 8, dtype=F64)
    outs = []
    for m in (mha, plain):
        torch.manual_seed(5)
        outs.append(m(q, q, q, need_weights=need_weights)[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8, padding_idx=0)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 11)

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(self.attn(h, h, h, need_weights=False)[0])


def test_embedding_and_attention_factors_round_trip_through_a_checkpoint():
    model = Tiny()
    pre = kfac(model, factor_dtype=torch.float32, inv_dtype=torch.float32)
    ids = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(0))
    token_loss(model, ids).backward()
    pre.step()
    twin = Tiny()  # (a deepcopy would carry pre's hooks)
    other = kfac(twin, factor_dtype=torch.float32, inv_dtype=torch.float32)
    other.load_state_dict(pre.state_dict())
    for name, layer in pre.layers.items():
        assert torch.equal(other.layers[name].A, layer.A) and torch.equal(other.layers[name].G, layer.G), name
    for m in (model, twin):
        m.zero_grad()
        token_loss(m, ids).backward()
    pre.step()
    other.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def _train_tiny(ids_per_step, ddp=None, distributor=None):
    model = Tiny()
    net = model if ddp is None else ddp(model)
    pre = kfac(model, factor_dtype=torch.float32, inv_dtype=torch.float32, factor_decay=0.5,
               **({} if distributor is None else {"distributor": distributor}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for ids in ids_per_step:
        opt.zero_grad()
        token_loss(net, ids).backward()
        pre.step(opt)
        opt.step()
    return {n: (ly.A.clone(), ly.G.clone()) for n, ly in pre.layers.items()}, [p.detach().clone() for p in
                                                                              model.parameters()]


def _steps(n=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 11, (4, 6), generator=g) for _ in range(n)]


def _tiny_on_ranks(rank, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_spdkfac.comm.scheduler import SPDDistributor, SPDOptions

    torch.set_num_threads(1)
    distributor = SPDDistributor(SPDOptions.from_schedule("spd"), process_group=dist.new_group())
    return _train_tiny([ids[2 * rank:2 * rank + 2] for ids in _steps()], ddp=DDP, distributor=distributor)


@pytest.mark.slow
def test_embedding_and_attention_on_two_ranks_match_one_process():
    """The dense diagonal A and the attention blocks through the SPD-KFAC distributed path: two ranks of half
    the batch each give the factors and the parameters of one process on the whole batch."""
    from lightning_spdkfac.multiprocess import run_distributed

    factors, params = _train_tiny(_steps())
    runs = run_distributed(_tiny_on_ranks, 2, timeout=180)
    for got_factors, got_params in runs:
        for name, (A, G) in factors.items():
            torch.testing.assert_close(got_factors[name][0], A, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got_factors[name][1], G, rtol=1e-5, atol=1e-6)
        for p, q in zip(got_params, params, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_an_attention_subclass_with_its_own_forward_is_skipped_with_its_out_proj():
    class Custom(nn.MultiheadAttention):
        def forward(self, query, key, value, **kw):
            return super().forward(query, key, value, **kw)

    model = nn.ModuleDict({"attn": Custom(8, 2), "head": nn.Linear(8, 2)})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pre = kfac(model)
    msgs = kfac_warnings(record)
    assert len(msgs) == 1 and "'attn'" in msgs[0] and "overrides" in msgs[0], msgs
    assert set(pre.layers) == {"head"} and {"attn", "attn.out_proj"} <= set(pre.skipped)


def test_an_embedding_or_attention_added_after_setup_fails_naming_it():
    model = nn.ModuleDict({"head": nn.Linear(8, 2)})
    pre = kfac(model)
    model["emb"] = nn.Embedding(5, 8)
    model["emb"](torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="'emb'"):
        pre.step()


def test_a_routed_attention_pickles_and_deep_copies_with_its_module():
    import io

    mha, _ = attn_module(dict(batch_first=True))
    kfac(mha).remove_hooks()
    buf = io.BytesIO()
    torch.save(mha, buf)
    buf.seek(0)
    q = torch.randn(2, 3, 8, dtype=F64)
    for twin in (torch.load(buf, weights_only=False), copy.deepcopy(mha)):
        assert twin.forward.module is twin and twin._kfac_projections[0].owner is twin
        torch.testing.assert_close(twin(q, q, q)[0], mha(q, q, q)[0])
        assert set(kfac(twin).layers) == {"q_proj", "k_proj", "v_proj", "out_proj"}  # routed again, once
