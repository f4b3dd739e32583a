"""K-FAC on models people bring: ``transformers`` models built offline from their config classes (random weights),
and the look-alike zoo of issue 35 (tests/helpers/lookalikes.py: models of torchvision, timm, Mamba, Whisper,
Wav2Vec2 that use weights through functions, fused kernels, subclasses and in-place writes; a model compiled before
K-FAC attached; tiny ``transformers`` mixture-of-experts models; a PEFT LoRA model).

The measurements (issues 26 and 35), each printed and written to a fresh folder (``results.json``):

``coverage``
    For every model (the five of tests/test_hf_models.py, others not in the tests, and the zoo): two training steps
    with K-FAC at every-step cadence (factors and inverses every step), then, of the trainable parameters, the share
    in blocks that produced factors (measured: the block holds A and G and is not in the preconditioner's
    ``unfactored``), the share named with a reason (the summary's left-out list, which includes ``unfactored``), and
    the SILENT share: parameters that got a gradient but are neither in a block that produced factors nor named
    (the target is 0%). Beside: the summary's own "preconditioned" share, the PARTIAL share (blocks that produced
    factors from their module calls while their weight also went through a linear-map function -- F.linear, a
    matmul, F.conv*d, F.embedding, grouped_mm -- outside any call of a module holding it: its gradient has a part
    the factors did not see; measured in one extra forward), whether the run raised (an error naming the layer is an
    acceptable outcome for a refused layer: it is printed), the blocks by layout, the K-FAC memory the summary
    predicts and the bytes held (the prediction must be within 5%); then the summary's peak of an inverse step
    beside the measured one (the bytes held before an inverse step plus the peak RSS growth across it, the median of
    three) and their ratio (issue 35: within 10%).
``gpt2-small``
    GPT-2 small (12 layers, n_embd 768, vocabulary 50257, tied head) from its config: the summary's K-FAC memory,
    then one factor + inverse step actually taken, with the bytes held and the process's peak RSS.
``step-time``
    The same width with 2 layers, batch 8 x 256 tokens, 1 thread: an AdamW step against K-FAC (library defaults)
    on AdamW. Each kind of K-FAC step (plain: precondition only; factor: + factors, every 5th; inverse: + factors
    and inverses, every 50th) is timed in interleaved repetitions with the AdamW step, and the amortized K-FAC step
    at the defaults is (40 plain + 9 factor + 1 inverse) / 50, from the medians. The FLOPs of both steps are
    printed beside (forward + backward of every matmul of the model; K-FAC's factor, inverse and
    preconditioning matmuls from each block's layout).

``moe-step``
    A tiny Mixtral and a tiny Qwen2-MoE (the zoo's, transformers' own experts implementation unless
    ``--experts-implementation``): the AdamW step against K-FAC (factors every 5 steps, inverses every 50) on AdamW,
    interleaved and amortized as in ``step-time``; the ratio (target <= 2x) and the share of trainable parameters in
    blocks that produced factors (target >= 95%).
``capture-cost``
    K-FAC's whole training step (library defaults, amortized over blocks of consecutive steps) on a model that needs
    no function capture (plain nn.Linear layers) and on the Swin-like model, interleaved; with ``--kfac-kw`` each
    model is also timed with those extra KFACPreconditioner arguments (e.g. ``--kfac-kw capture=True``) and the
    ratio is printed.

``--kfac-kw KEY=VALUE`` (repeatable; VALUE read as a Python literal, else a string) passes extra arguments to every
KFACPreconditioner of ``coverage``, ``step-time`` and ``moe-step``, and to the second timing of ``capture-cost``.

    python benchmarks/hf_models.py                       # all (about 12 minutes on 1 thread)
    python benchmarks/hf_models.py --only coverage --quick
    python benchmarks/hf_models.py --only coverage --models swin_like,eva_like --kfac-kw capture=True
    python benchmarks/hf_models.py --only moe-step --only capture-cost
    python benchmarks/hf_models.py --only max-side       # what a dense factor side costs (the default's basis)
    python benchmarks/hf_models.py --only step-time --kfac-kw update=eigen_adam   # the eigenbasis mode's step
"""

from __future__ import annotations

import ast
import os
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import (
    bench_parser,
    env_info,
    interleave,
    interleaved_blocks,
    out_dir,
    parse,
    save_json,
    set_threads,
    spread,
)
from torch import nn

from lightning_spdkfac.factor_shapes import FactorShape, numel
from lightning_spdkfac.kfac.hook_tools import optimized_module_type
from lightning_spdkfac.kfac.preconditioner import KFACPreconditioner
from lightning_spdkfac.kfac.summary import format_bytes
from lightning_spdkfac.schedule import precondition_flops

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _tf():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def lm(cls: str, cfg: str, vocab: int, **kw):
    def build():
        tf = _tf()
        return getattr(tf, cls)(getattr(tf, cfg)(**kw)), lambda b=2, t=16: dict(
            input_ids=torch.randint(0, vocab, (b, t)), labels=torch.randint(0, vocab, (b, t)))
    return build


def vision(cls: str, cfg: str, size: int = 32, **kw):
    def build():
        tf = _tf()
        return getattr(tf, cls)(getattr(tf, cfg)(num_labels=10, **kw)), lambda b=2, t=0: dict(
            pixel_values=torch.randn(b, 3, size, size), labels=torch.randint(0, 10, (b,)))
    return build


SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
MODELS = {
    # in tests/test_hf_models.py
    "gpt2": lm("GPT2LMHeadModel", "GPT2Config", 50257, n_layer=2, n_head=2, n_embd=64),
    "bert": lm("BertForMaskedLM", "BertConfig", 30522, **SMALL),
    "llama": lm("LlamaForCausalLM", "LlamaConfig", 32000, **SMALL, num_key_value_heads=2),
    "vit": vision("ViTForImageClassification", "ViTConfig", **SMALL, image_size=32, patch_size=8),
    "convnext": vision("ConvNextForImageClassification", "ConvNextConfig", hidden_sizes=[16, 32], depths=[1, 1],
                       num_stages=2),
    # not in the tests
    "distilbert": lm("DistilBertForMaskedLM", "DistilBertConfig", 30522, dim=64, n_layers=2, n_heads=2,
                     hidden_dim=128),
    "mistral": lm("MistralForCausalLM", "MistralConfig", 32000, **SMALL, num_key_value_heads=1),
    "opt": lm("OPTForCausalLM", "OPTConfig", 50272, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
              ffn_dim=128, word_embed_proj_dim=64),
    "t5": lm("T5ForConditionalGeneration", "T5Config", 32128, d_model=64, d_ff=128, num_layers=2, num_heads=2,
             d_kv=32, decoder_start_token_id=0, pad_token_id=0),
    "mobilenet_v2": vision("MobileNetV2ForImageClassification", "MobileNetV2Config", depth_multiplier=0.35),
    "efficientnet": vision("EfficientNetForImageClassification", "EfficientNetConfig", width_coefficient=1.0,
                           depth_coefficient=1.0, hidden_dim=1280, image_size=32),  # B0
    "regnet": vision("RegNetForImageClassification", "RegNetConfig", hidden_sizes=[16, 32], depths=[1, 1],
                     groups_width=8, embedding_size=16),
    "resnet": vision("ResNetForImageClassification", "ResNetConfig", hidden_sizes=[16, 32], depths=[1, 1],
                     embedding_size=16),
    "swin": vision("SwinForImageClassification", "SwinConfig", image_size=32, patch_size=4, embed_dim=16,
                   depths=[1, 1], num_heads=[2, 2], window_size=4),
}


def held_bytes(pre: KFACPreconditioner) -> int:
    return sum(t.numel() * t.element_size() for ly in pre.layers.values()
               for t in (ly.A, ly.G, ly.A_inv, ly.G_inv, ly.xx, ly.dd, ly.x_sum) if t is not None)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss_now() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes (Linux)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def step_peak_rss(pre: KFACPreconditioner, opt: torch.optim.Optimizer, backward, repeats: int = 3) -> dict:
    """``repeats`` more training steps after the K-FAC state exists (factors and inverses every step), each with the
    process's peak RSS growth across its ``pre.step`` (``backward()``: one forward and backward): freed heap memory
    is given back first (malloc_trim) and the high-water mark reset (/proc/self/clear_refs), so that what the step
    allocates shows as RSS growth. ``measured_peak`` adds the K-FAC tensors held before the step to that growth (the
    median over the repeats: the allocator adds a few MiB to one step now and then): K-FAC's peak as the process saw
    it, beside the summary's peak (``peak_ratio``)."""
    import ctypes

    growths, helds = [], []
    for _ in range(repeats):
        opt.zero_grad()
        backward()
        helds.append(held_bytes(pre))
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
            rss0, _ = _rss_now()
        except OSError:  # not Linux/glibc: no figure rather than a wrong one
            pre.step(opt)
            return {}
        pre.step(opt)
        growths.append(_rss_now()[1] - rss0)
        opt.step()
    measured = statistics.median(h + g for h, g in zip(helds, growths))
    peak = pre.summary().peak_bytes
    return dict(summary_peak_bytes=peak, rss_growth_bytes=statistics.median(growths), rss_growths=growths,
                measured_peak_bytes=measured, peak_ratio=peak / max(measured, 1))


def layouts(pre: KFACPreconditioner) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for ly in pre.layers.values():
        for s in (ly.a_shape, ly.g_shape):
            k = {1: "diag", 2: "dense", 3: "grouped"}[len(s)]
            kinds[k] = kinds.get(k, 0) + 1
    return kinds


def zoo():
    """tests/helpers/lookalikes.py, the look-alike zoo the tests use too (one copy of the builders: the repository
    root goes on sys.path, so that this script runs from a checkout as ``python benchmarks/hf_models.py``)."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(1, root)
    from tests.helpers import lookalikes

    return lookalikes


def _hf_case(build):
    """A MODELS entry as a zoo builder: (model, make_batch(seed), loss_fn(model, inputs))."""
    def case():
        model, batch = build()

        def make(seed: int) -> dict:
            torch.manual_seed(1000 + seed)
            return batch()

        return model, make, lambda m, inputs: m(**inputs).loss
    return case


def cases() -> dict:
    """Every coverage model: MODELS, then the zoo (tests/helpers/lookalikes.py)."""
    return {**{k: _hf_case(b) for k, b in MODELS.items()}, **zoo().ZOO}


QUICK_COVERAGE = ["gpt2", "convnext"]  # plus the whole zoo (tiny models; the compiled one compiles for ~10 s)

# The functions that apply a weight as a linear map (a module's own call goes through one of them too).
_LINEAR_MAPS = {F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.einsum, F.conv1d, F.conv2d,
                F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, F.embedding,
                torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.Tensor.matmul, torch.Tensor.mm}
_LINEAR_MAPS |= {f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f is not None}


def _flat(args, kwargs) -> list:
    out = []
    for a in (*args, *kwargs.values()):
        out.extend(a if isinstance(a, (list, tuple)) else (a,))
    return out


def functional_uses(pre: KFACPreconditioner, model: nn.Module, loss_fn, inputs) -> dict[str, int]:
    """One forward (no gradient): per registered layer, the linear-map function calls given its weight (or a view of
    it) while no module holding that weight as its own parameter is running: uses outside a module call (a tied
    embedding's own call counts as a module call, the documented convention of docs/math.md)."""
    weights = {id(ly.helper.params()[0]): name for name, ly in pre.layers.items()}
    owners: dict[int, set[int]] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None and id(p) in weights:
                owners.setdefault(id(p), set()).add(id(m))
    uses = dict.fromkeys(pre.layers, 0)
    running: list[int] = []

    def enter(m, _i):
        running.append(id(m))

    def leave(m, _i, _o):
        if running and running[-1] == id(m):
            running.pop()

    class Uses(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in _LINEAR_MAPS:
                hit = set()
                for a in _flat(args, kwargs):
                    if isinstance(a, torch.Tensor):
                        for t in (a, a._base):
                            if t is not None and id(t) in weights and not owners.get(id(t), set()) & set(running):
                                hit.add(weights[id(t)])
                for name in hit:
                    uses[name] += 1
            return func(*args, **kwargs)

    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    try:
        with torch.no_grad(), Uses():
            loss_fn(model, inputs)
    finally:
        for h in handles:
            h.remove()
    return uses


def measure(name: str, build, steps: int = 2, kfac_kw: dict | None = None) -> dict:
    """Two training steps of ``build()``'s model with K-FAC at every-step cadence; the shares of trainable parameters
    factored / named / silent (see the module docstring), or the error (a build error, or the K-FAC run raising)."""
    torch.manual_seed(0)
    try:
        model, make, loss_fn = build()
    except Exception as e:  # a config this release does not take, peft missing: recorded, not hidden
        return dict(model=name, error=f"could not build: {type(e).__name__}: {e}", stage="build")
    row: dict = dict(model=name, error=None, stage=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, **(kfac_kw or {}))
        except Exception as e:  # refused at setup (a layer named): an acceptable outcome, printed
            row.update(error=f"{type(e).__name__}: {e}", stage="setup")
            return row
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        loss = None
        for step in range(steps):
            try:
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model, make(step))
                loss.backward()
                pre.step(opt)
                opt.step()
            except Exception as e:  # recorded in the table, not hidden
                row.update(error=f"{type(e).__name__}: {e}", stage=f"step {step}")
                break
    kfac_warnings = sorted({str(w.message)[:300] for w in caught if "K-FAC" in str(w.message)})
    params = {id(p): (n, p) for n, p in model.named_parameters() if p.requires_grad}
    trainable = sum(p.numel() for _, p in params.values())
    factored_ids: set[int] = set()
    for ly in pre.layers.values():
        if ly.A is not None and ly.G is not None and ly.name not in pre.unfactored:
            factored_ids.update(id(p) for p in ly.helper.params() if id(p) in params)
    s = pre.summary()
    by_name = {n: i for i, (n, _) in params.items()}
    named_ids = {by_name[x.name] for x in s.left_out if x.name in by_name}
    got_grad = {i for i, (_, p) in params.items() if p.grad is not None}
    silent_ids = got_grad - factored_ids - named_ids

    def share(ids: set[int]) -> float:
        return sum(params[i][1].numel() for i in ids) / max(trainable, 1)

    partial: list[str] = []
    if row["error"] is None and not isinstance(model, optimized_module_type()):  # a probe forward would recompile it
        try:
            for lname, uses in functional_uses(pre, model, loss_fn, make(99)).items():
                # (a layer function capture follows has its functional uses collected: not partial)
                followed = lname in getattr(getattr(pre, "capture", None), "layers", ())
                if uses and pre.layers[lname].A is not None and lname not in pre.unfactored and not followed:
                    partial.append(lname)
        except Exception as e:
            row["partial_probe_error"] = f"{type(e).__name__}: {e}"
    partial_ids = {id(p) for n in partial for p in pre.layers[n].helper.params() if id(p) in params}
    held = held_bytes(pre)
    peak: dict = {}
    if row["error"] is None and not isinstance(model, optimized_module_type()):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                peak = step_peak_rss(pre, opt, lambda: loss_fn(model, make(100)).backward())
        except Exception as e:  # recorded, not hidden
            row["peak_error"] = f"{type(e).__name__}: {e}"
    named_reasons: dict[str, list[str]] = {}
    for x in s.left_out:
        named_reasons.setdefault(x.reason, []).append(x.name)
    layer_names = list(pre.layers) + list(pre.unfactored)
    err = row["error"] or ""
    row.update(
        trainable=trainable, factored=share(factored_ids), named=share(named_ids), silent=share(silent_ids),
        accounted=share(factored_ids | named_ids), preconditioned=s.preconditioned / max(s.trainable, 1),
        partial=share(partial_ids), partial_layers=partial,
        silent_params=sorted(params[i][0] for i in silent_ids), unfactored=dict(pre.unfactored),
        named_reasons=named_reasons, error_names_layer=any(n and f"'{n}'" in err for n in layer_names),
        kfac_warnings=kfac_warnings, blocks=len(s.rows), layouts=layouts(pre), predicted_bytes=s.total_bytes,
        held_bytes=held, prediction_error=(s.total_bytes - held) / max(held, 1),
        loss_finite=None if loss is None else bool(torch.isfinite(loss)),
        left_out_reasons=sorted({x.kind for x in s.left_out}), steps=steps, **peak)
    return row


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def print_row(r: dict) -> None:
    if r.get("stage") in ("build", "setup"):
        print(f"{r['model']:22s} {'could not build' if r['stage'] == 'build' else 'refused at setup'}: {r['error']}")
        return
    print(f"{r['model']:22s} params {r['trainable']:>8,}  factored {_pct(r['factored'])}  named {_pct(r['named'])}  "
          f"SILENT {_pct(r['silent'])}  (summary: preconditioned {_pct(r['preconditioned'])}; partial "
          f"{_pct(r['partial'])})  blocks {r['blocks']:3d}  memory {format_bytes(r['predicted_bytes'])} "
          f"(held {format_bytes(r['held_bytes'])}, {100 * r['prediction_error']:+.1f}%)")
    if r["error"]:
        print(f"    raised at {r['stage']}{' (names the layer)' if r['error_names_layer'] else ''}: "
              f"{r['error'][:300]}")
    if r["silent_params"]:
        print(f"    silent: {', '.join(r['silent_params'][:8])}{' ...' if len(r['silent_params']) > 8 else ''}")
    if r["partial_layers"]:
        print(f"    PARTIAL: weight also used through a function outside its module's call (factors from the module "
              f"call only): "
              f"{', '.join(r['partial_layers'][:6])}")
    for why, names in r["named_reasons"].items():
        print(f"    named ({len(names)}): {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}: {why[:110]}")
    if r.get("summary_peak_bytes"):
        print(f"    peak: summary {format_bytes(r['summary_peak_bytes'])}, measured "
              f"{format_bytes(r['measured_peak_bytes'])} (RSS growth across an inverse step, median of "
              f"{len(r['rss_growths'])}: {format_bytes(r['rss_growth_bytes'])}); summary / measured "
              f"{r['peak_ratio']:.2f}")


def coverage(names: list[str], kfac_kw: dict | None = None) -> list[dict]:
    every = cases()
    rows = []
    for name in names:
        rows.append(measure(name, every[name], kfac_kw=kfac_kw))
        print_row(rows[-1])
    bad = [r["model"] for r in rows if r.get("silent")]
    print(f"coverage: {len(rows)} models; silent share above 0% on {len(bad)}: {', '.join(bad) or 'none'}")
    return rows


def gpt2_small() -> dict:
    tf = _tf()
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config())  # 12 layers, n_embd 768, vocabulary 50257, tied head
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
    s = pre.summary()
    print(s)
    rss0 = peak_rss()
    t0 = time.perf_counter()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (1, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    pre.step(opt)
    opt.step()
    out = dict(predicted_bytes=s.total_bytes, held_bytes=held_bytes(pre), peak_rss_before=rss0,
               peak_rss_after=peak_rss(), step_seconds=time.perf_counter() - t0, blocks=len(s.rows),
               preconditioned=s.preconditioned / s.trainable, trainable=s.trainable)
    print(f"GPT-2 small: K-FAC memory predicted {format_bytes(out['predicted_bytes'])}, held after a factor + "
          f"inverse step {format_bytes(out['held_bytes'])}; peak RSS {format_bytes(out['peak_rss_after'])} "
          f"(before the step {format_bytes(rss0)}); the step took {out['step_seconds']:.1f} s")
    return out


# ---------------------------------------------------------------------------------------------- step time
def _matmul_flops(model: nn.Module, batch: dict) -> int:
    """Forward + backward FLOPs of the model's matmuls (3x the forward's), counted with FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def _kfac_flops(pre: KFACPreconditioner, rows: int) -> dict[str, float]:
    """K-FAC's added FLOPs per kind of step, from each block's layout (R rows per factor: expand, every token)."""
    def gram(s: FactorShape) -> float:
        return 2.0 * rows * numel(s)  # a^T a per block, or the column sums of squares of a diagonal side

    def inv(s: FactorShape) -> float:
        return float(s[0]) if len(s) == 1 else float(numel(s) * s[-1])  # n^3 per dense block

    f = sum(gram(ly.a_shape) + gram(ly.g_shape) for ly in pre.layers.values())
    i = sum(inv(ly.a_shape) + inv(ly.g_shape) for ly in pre.layers.values())
    p = sum(precondition_flops(ly.a_shape, ly.g_shape) for ly in pre.layers.values())
    if pre.options.update == "eigen_adam":
        # Q_G^T M Q_A into the eigenbasis and Q_G R Q_A^T back: two products per dense side where G^-1 M A^-1 has
        # one; an eigendecomposition with its eigenvectors about 9 n^3 (Golub & Van Loan's count for the symmetric
        # QR algorithm) against the n^3 counted for a Cholesky inverse.
        p, i = 2.0 * p, 9.0 * i
    return {"precondition": p, "factors": f, "inverses": i}


def step_time(reps: int, batch: int, tokens: int, layers: int, width: int = 768, vocab: int = 50257,
              kfac_kw: dict | None = None) -> dict:
    tf = _tf()
    set_threads(1)
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64, n_positions=max(tokens, 64),
                        vocab_size=vocab)
    ids = torch.randint(0, cfg.vocab_size, (batch, tokens))
    data = dict(input_ids=ids, labels=ids)
    base = tf.GPT2LMHeadModel(cfg)
    kfac_model = tf.GPT2LMHeadModel(cfg)
    kfac_model.load_state_dict(base.state_dict())
    opt_a = torch.optim.AdamW(base.parameters(), lr=1e-4)
    opt_k = torch.optim.AdamW(kfac_model.parameters(), lr=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the library defaults (factors every 5 steps, inverses every 50), with --kfac-kw's arguments
        pre = KFACPreconditioner(kfac_model, **(kfac_kw or {}))
    o = pre.options

    def adamw() -> None:
        opt_a.zero_grad(set_to_none=True)
        base(**data).loss.backward()
        opt_a.step()

    def kfac(k: int):
        def run() -> None:
            pre.steps = k  # the cadence position: k % 5 == 0 collects factors, k % 50 == 0 inverts too
            opt_k.zero_grad(set_to_none=True)
            kfac_model(**data).loss.backward()
            pre.step(opt_k)
            opt_k.step()
        return run

    kinds = {"adamw": adamw, "kfac_plain": kfac(1), "kfac_factor": kfac(o.factor_update_steps),
             "kfac_inverse": kfac(o.inv_update_steps)}
    kinds["kfac_inverse"]()  # K-FAC's first factors and inverses, and a warm-up of every kind
    for fn in kinds.values():
        fn()
    times = interleave(kinds, reps, order="fixed", label="  rep")
    med = {k: spread(v)["median"] for k, v in times.items()}
    period = o.inv_update_steps
    n_factor = period // o.factor_update_steps
    amortized = ((period - n_factor) * med["kfac_plain"] + (n_factor - 1) * med["kfac_factor"]
                 + med["kfac_inverse"]) / period
    base_flops = _matmul_flops(base, data)
    added = _kfac_flops(pre, batch * tokens)
    kfac_flops = base_flops + added["precondition"] + (added["factors"] / o.factor_update_steps
                                                       + added["inverses"] / o.inv_update_steps)
    out = dict(median_s=med, spread_s={k: [min(v), max(v)] for k, v in times.items()}, amortized_kfac_s=amortized,
               ratio=amortized / med["adamw"], adamw_flops=base_flops, kfac_flops=kfac_flops, kfac_added=added,
               batch=batch, tokens=tokens, layers=layers, reps=reps, threads=torch.get_num_threads())
    print(f"GPT-2 width {width}, {layers} layers, batch {batch} x {tokens} tokens, 1 thread, {reps} interleaved reps:")
    for k, v in times.items():
        print(f"  {k:13s} median {med[k]:.2f} s (min {min(v):.2f}, max {max(v):.2f})")
    print(f"  K-FAC at the defaults, amortized: {amortized:.2f} s = {out['ratio']:.2f}x the AdamW step "
          f"(target <= 1.5x)")
    print(f"  FLOPs per step: AdamW {base_flops / 1e9:.0f} G (forward + backward), K-FAC amortized "
          f"{kfac_flops / 1e9:.0f} G ({kfac_flops / base_flops:.2f}x: preconditioning "
          f"{added['precondition'] / 1e9:.1f} G every step, factors {added['factors'] / 1e9:.1f} G every "
          f"{o.factor_update_steps}, inverses {added['inverses'] / 1e9:.1f} G every {o.inv_update_steps})")
    return out


def max_side(sides: list[int]) -> list[dict]:
    """What a dense factor side costs on this machine (1 thread): the bytes it holds (the running factor, the
    step's Gram sum and the inverse, float32) and the seconds of one damped Cholesky inverse, the work of one
    inverse step for that factor. The default max_factor_side is the largest side whose inverse step stays a
    few seconds on one CPU thread (sub-second on a GPU) while its memory stays below 256 MiB."""
    from lightning_spdkfac.kfac.inverse import robust_inverses

    torch.set_num_threads(1)
    rows = []
    for n in sides:
        x = torch.randn(n, n // 2 + 8)
        f = x @ x.T / x.shape[1]
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            robust_inverses([f], 1e-2, torch.float32)
            times.append(time.perf_counter() - t0)
        rows.append(dict(side=n, mib=3 * n * n * 4 / 2**20, inverse_s=statistics.median(times)))
        print(f"side {n:6d}: {rows[-1]['mib']:8.0f} MiB held (factor, Gram sum, inverse), one inverse "
              f"{rows[-1]['inverse_s']:.2f} s (median of 3, 1 thread)", flush=True)
    return rows


# ---------------------------------------------------------------------------------------- MoE step, capture cost
def _factored_share(pre: KFACPreconditioner, model: nn.Module) -> float:
    """Of the trainable parameters, the share in blocks that produced factors (hold A and G, not unfactored)."""
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    ids = {id(p) for ly in pre.layers.values() if ly.A is not None and ly.G is not None
           and ly.name not in pre.unfactored for p in ly.helper.params() if id(p) in params}
    return sum(params[i].numel() for i in ids) / max(sum(p.numel() for p in params.values()), 1)


def moe_step(reps: int, batch: int, tokens: int, families: tuple[str, ...] = ("mixtral", "qwen2_moe"),
             experts_implementation: str | None = None, kfac_kw: dict | None = None) -> dict:
    """AdamW against K-FAC (factors every 5, inverses every 50) on AdamW for the zoo's tiny MoE models, as step_time."""
    set_threads(1)
    return {fam: _moe_family(fam, reps, batch, tokens, experts_implementation, kfac_kw) for fam in families}


def _moe_family(fam: str, reps: int, batch: int, tokens: int, experts_implementation: str | None,
                kfac_kw: dict | None) -> dict:
    lk = zoo()
    base, make, loss_fn = lk.moe(fam, experts_implementation, seq=tokens, batch=batch)
    kmodel = lk.moe(fam, experts_implementation, seq=tokens, batch=batch)[0]
    kmodel.load_state_dict(base.state_dict())
    data = make(0)
    opt_a = torch.optim.AdamW(base.parameters(), lr=1e-4)
    opt_k = torch.optim.AdamW(kmodel.parameters(), lr=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pre = KFACPreconditioner(kmodel, factor_update_steps=5, inv_update_steps=50, **(kfac_kw or {}))
    o = pre.options

    def adamw() -> None:
        opt_a.zero_grad(set_to_none=True)
        loss_fn(base, data).backward()
        opt_a.step()

    def kfac(k: int):
        def run() -> None:
            pre.steps = k  # the cadence position: k % 5 == 0 collects factors, k % 50 == 0 inverts too
            opt_k.zero_grad(set_to_none=True)
            loss_fn(kmodel, data).backward()
            pre.step(opt_k)
            opt_k.step()
        return run

    kinds = {"adamw": adamw, "kfac_plain": kfac(1), "kfac_factor": kfac(o.factor_update_steps),
             "kfac_inverse": kfac(o.inv_update_steps)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kinds["kfac_inverse"]()  # the first factors and inverses, and a warm-up of every kind
        for fn in kinds.values():
            fn()
        times = interleave(kinds, reps, order="rotate", label=f"  {fam} rep")
    med = {k: spread(v)["median"] for k, v in times.items()}
    period = o.inv_update_steps
    n_factor = period // o.factor_update_steps
    amortized = ((period - n_factor) * med["kfac_plain"] + (n_factor - 1) * med["kfac_factor"]
                 + med["kfac_inverse"]) / period
    s = pre.summary()
    r = dict(median_s=med, spread_s={k: [min(v), max(v)] for k, v in times.items()}, amortized_kfac_s=amortized,
             ratio=amortized / med["adamw"], factored=_factored_share(pre, kmodel),
             summary_preconditioned=s.preconditioned / max(s.trainable, 1), trainable=s.trainable,
             experts_implementation=kmodel.config._experts_implementation, unfactored=dict(pre.unfactored),
             batch=batch, tokens=tokens, reps=reps, threads=torch.get_num_threads())
    print(f"{fam} ({r['trainable']:,} parameters, experts {r['experts_implementation']}), batch {batch} x {tokens} "
          f"tokens, 1 thread, {reps} interleaved reps:")
    for k, v in times.items():
        print(f"  {k:13s} median {1e3 * med[k]:7.2f} ms (min {1e3 * min(v):.2f}, max {1e3 * max(v):.2f})")
    print(f"  K-FAC (factors every {o.factor_update_steps}, inverses every {period}), amortized: "
          f"{1e3 * amortized:.2f} ms = {r['ratio']:.2f}x the AdamW step (target <= 2x); in blocks that produced "
          f"factors: {100 * r['factored']:.1f}% of the trainable parameters (target >= 95%; the summary says "
          f"{100 * r['summary_preconditioned']:.1f}%)")
    return r


def _plain_linear():
    """A model that needs no function capture: nn.Linear layers, each called as a module."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g))
    return model, data, lambda m, d: F.cross_entropy(m(d[0]), d[1])


def capture_cost(blocks: int, steps_per_block: int, kfac_kw: dict | None = None) -> dict:
    """K-FAC's training step (library defaults) on a plain-Linear model and on the Swin-like model, interleaved in
    blocks of consecutive steps; with ``kfac_kw``, each model also with those extra arguments."""
    lk = zoo()
    set_threads(1)

    def swin():
        torch.manual_seed(0)
        model, make, loss_fn = lk.swin_like()
        return model, make(0), loss_fn

    steps: dict[str, object] = {}
    variants = [("", {})] + ([(" +" + ",".join(f"{k}={v}" for k, v in kfac_kw.items()), kfac_kw)] if kfac_kw else [])
    for mname, build in (("plain_linear", _plain_linear), ("swin_like", swin)):
        for suffix, kw in variants:
            model, data, loss_fn = build()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pre = KFACPreconditioner(model, **kw)

            def step(model=model, data=data, loss_fn=loss_fn, opt=opt, pre=pre) -> None:
                opt.zero_grad(set_to_none=True)
                loss_fn(model, data).backward()
                pre.step(opt)
                opt.step()

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                step()  # the first factors and inverses
            steps[mname + suffix] = step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times = interleaved_blocks(steps, blocks, steps_per_block)  # type: ignore[arg-type]
    med = {k: spread(v)["median"] for k, v in times.items()}
    print(f"K-FAC training step (library defaults), medians of {blocks} interleaved blocks of {steps_per_block} "
          "steps, 1 thread:")
    for k, v in times.items():
        print(f"  {k:40s} {1e3 * med[k]:7.2f} ms (min {1e3 * min(v):.2f}, max {1e3 * max(v):.2f})")
    ratios = {}
    if kfac_kw:
        for mname in ("plain_linear", "swin_like"):
            with_kw = next(k for k in med if k.startswith(mname + " +"))
            ratios[mname] = med[with_kw] / med[mname]
            print(f"  {mname}: with {with_kw[len(mname) + 2:]} {ratios[mname]:.3f}x the step without")
    return dict(median_s=med, spread_s={k: [min(v), max(v)] for k, v in times.items()}, ratios=ratios,
                kfac_kw={k: repr(v) for k, v in (kfac_kw or {}).items()}, blocks=blocks,
                steps_per_block=steps_per_block, threads=torch.get_num_threads())


def check_kfac_kw(kw: dict) -> None:
    """Refuse, before anything runs, arguments this KFACPreconditioner does not take (e.g. an option not merged yet):
    a throwaway preconditioner on one Linear is built with them."""
    if not kw:
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            KFACPreconditioner(nn.Sequential(nn.Linear(2, 2)), **kw)
    except TypeError as e:
        raise SystemExit(f"--kfac-kw: {e}") from None


def parse_kfac_kw(items: list[str] | None) -> dict:
    """``KEY=VALUE`` strings as keyword arguments (VALUE a Python literal where it reads as one, else a string)."""
    kw = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise SystemExit(f"--kfac-kw {item!r}: give KEY=VALUE (e.g. capture=True)")
        try:
            kw[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kw[key] = value
    return kw


def main(argv: list[str] | None = None) -> None:
    p = bench_parser(__doc__.split("\n\n")[0], reps=5,
                     quick="a smoke run: two models, a 128-wide GPT-2 of one layer for the step time")
    p.add_argument("--only", choices=["coverage", "gpt2-small", "step-time", "max-side", "moe-step", "capture-cost"],
                   action="append")
    p.add_argument("--models", default=None,
                   help="coverage: comma-separated model names (default: all; --quick: gpt2, convnext and the zoo)")
    p.add_argument("--kfac-kw", action="append", metavar="KEY=VALUE",
                   help="an extra KFACPreconditioner argument (repeatable; e.g. capture=True): see above")
    p.add_argument("--experts-implementation", default=None, choices=["eager", "grouped_mm", "batched_mm"],
                   help="moe-step: the transformers experts forward (default: transformers' own pick)")
    args = parse(p, argv)
    kfac_kw = parse_kfac_kw(args.kfac_kw)
    check_kfac_kw(kfac_kw)
    only = args.only or ["coverage", "gpt2-small", "step-time", "moe-step", "capture-cost"]
    names = list(cases())
    picked = args.models.split(",") if args.models else (QUICK_COVERAGE + list(zoo().ZOO) if args.quick else names)
    unknown = sorted(set(picked) - set(names))
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; known: {', '.join(names)}")
    folder = out_dir(args, "hf_models")
    results: dict = {"env": env_info(), "quick": args.quick, "kfac_kw": {k: repr(v) for k, v in kfac_kw.items()}}
    if "coverage" in only:
        results["coverage"] = coverage(picked, kfac_kw)
    if "gpt2-small" in only and not args.quick:
        results["gpt2_small"] = gpt2_small()
    if "max-side" in only:
        results["max_side"] = max_side([512, 1024] if args.quick else [1024, 2048, 4096, 4608, 8192])
    if "step-time" in only:
        results["step_time"] = (step_time(1, 1, 16, 1, width=128, vocab=1000, kfac_kw=kfac_kw) if args.quick
                                else step_time(args.reps, 8, 256, 2, kfac_kw=kfac_kw))
    if "moe-step" in only:
        results["moe_step"] = moe_step(1 if args.quick else args.reps, 2 if args.quick else 8,
                                       16 if args.quick else 64, experts_implementation=args.experts_implementation,
                                       kfac_kw=kfac_kw)
    if "capture-cost" in only:
        results["capture_cost"] = (capture_cost(1, 5, kfac_kw) if args.quick
                                   else capture_cost(args.reps, 50, kfac_kw))
    save_json(folder, "results.json", results)


if __name__ == "__main__":
    main()
