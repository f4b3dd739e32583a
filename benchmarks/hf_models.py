"""K-FAC on models people bring: ``transformers`` models built offline from their config classes (random weights).

Three measurements (issue 26), each printed and written to a fresh folder (``results.json``):

``coverage``
    For every model (the five of tests/test_hf_models.py and others not in the tests): the share of trainable
    parameters in K-FAC blocks and the share named in the summary with a reason (together 100% by construction:
    the check is that nothing is unaccounted for), the blocks by layout, the K-FAC memory the summary predicts and
    the bytes held after a factor + inverse step (the prediction must be within 5%), and the process's peak RSS;
    then the summary's peak of an inverse step beside the measured one (the bytes held before an inverse step plus
    the peak RSS growth across it, the median of three) and their ratio (issue 35: within 10%).
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

    python benchmarks/hf_models.py                       # all three (about 10 minutes on 1 thread)
    python benchmarks/hf_models.py --only coverage --quick
    python benchmarks/hf_models.py --only max-side       # what a dense factor side costs (the default's basis)
"""

from __future__ import annotations

import os
import resource
import statistics
import time
import warnings

import torch
from _common import bench_parser, env_info, interleave, out_dir, parse, save_json, set_threads, spread
from torch import nn

from lightning_spdkfac.factor_shapes import FactorShape, numel
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


def step_peak_rss(pre: KFACPreconditioner, opt: torch.optim.Optimizer, model: nn.Module, batch,
                  repeats: int = 3) -> dict:
    """``pre.step(opt)`` (the first factor + inverse step, which allocates the K-FAC state and the libraries' one-off
    buffers), then ``repeats`` more forward, backward and inverse steps, each with the process's peak RSS growth
    across its ``pre.step``: freed heap memory is given back first (malloc_trim) and the high-water mark reset
    (/proc/self/clear_refs), so that what the step allocates shows as RSS growth. ``measured_peak`` adds the K-FAC
    tensors held before the step to that growth (the median over the repeats: the allocator adds a few MiB to one
    step now and then): K-FAC's peak as the process saw it, beside the summary's peak (``peak_ratio``)."""
    import ctypes

    pre.step(opt)
    growths, helds = [], []
    for _ in range(repeats):
        opt.step()
        opt.zero_grad()
        model(**batch()).loss.backward()
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


def coverage(names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        torch.manual_seed(0)
        try:
            model, batch = MODELS[name]()
        except Exception as e:  # a config this transformers release does not take: recorded, not hidden
            rows.append(dict(model=name, error=f"{type(e).__name__}: {e}"))
            print(f"{name}: could not build ({e})")
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
        s = pre.summary()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        try:
            loss = model(**batch()).loss
            opt.zero_grad()
            loss.backward()
            peak = step_peak_rss(pre, opt, model, batch)  # pre.step(opt), and one more with its peak RSS growth
            opt.step()
        except Exception as e:  # recorded in the table, not hidden
            rows.append(dict(model=name, error=f"{type(e).__name__}: {e}"))
            print(f"{name}: the K-FAC step failed ({type(e).__name__}: {e})")
            continue
        held = held_bytes(pre)
        named = sum(x.params for x in s.left_out)
        rows.append(dict(model=name, trainable=s.trainable, preconditioned=s.preconditioned / s.trainable,
                         named=named / s.trainable, accounted=(s.preconditioned + named) / s.trainable,
                         blocks=len(s.rows), layouts=layouts(pre), predicted_bytes=s.total_bytes, held_bytes=held,
                         prediction_error=(s.total_bytes - held) / max(held, 1), loss_finite=bool(torch.isfinite(loss)),
                         left_out_reasons=sorted({x.kind for x in s.left_out}), **peak))
        r = rows[-1]
        print(f"{name:13s} params {s.trainable:>11,}  preconditioned {100 * r['preconditioned']:5.1f}%  named "
              f"{100 * r['named']:4.1f}%  blocks {len(s.rows):3d} {r['layouts']}  memory {format_bytes(s.total_bytes)}"
              f" (held {format_bytes(held)}, {100 * r['prediction_error']:+.1f}%)  left: {r['left_out_reasons']}")
        if peak:
            print(f"{'':13s} peak: summary {format_bytes(peak['summary_peak_bytes'])}, measured "
                  f"{format_bytes(peak['measured_peak_bytes'])} (RSS growth across an inverse step, median of "
                  f"{len(peak['rss_growths'])}: {format_bytes(peak['rss_growth_bytes'])}); summary / measured "
                  f"{peak['peak_ratio']:.2f}")
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
    return {"precondition": p, "factors": f, "inverses": i}


def step_time(reps: int, batch: int, tokens: int, layers: int, width: int = 768, vocab: int = 50257) -> dict:
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
        pre = KFACPreconditioner(kfac_model)  # the library defaults: factors every 5 steps, inverses every 50
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


def main(argv: list[str] | None = None) -> None:
    p = bench_parser(__doc__.split("\n\n")[0], reps=5,
                     quick="a smoke run: two models, a 128-wide GPT-2 of one layer for the step time")
    p.add_argument("--only", choices=["coverage", "gpt2-small", "step-time", "max-side"], action="append")
    args = parse(p, argv)
    only = args.only or ["coverage", "gpt2-small", "step-time"]
    folder = out_dir(args, "hf_models")
    results: dict = {"env": env_info(), "quick": args.quick}
    if "coverage" in only:
        results["coverage"] = coverage(["gpt2", "convnext"] if args.quick else list(MODELS))
    if "gpt2-small" in only and not args.quick:
        results["gpt2_small"] = gpt2_small()
    if "max-side" in only:
        results["max_side"] = max_side([512, 1024] if args.quick else [1024, 2048, 4096, 4608, 8192])
    if "step-time" in only:
        results["step_time"] = (step_time(1, 1, 16, 1, width=128, vocab=1000) if args.quick
                                else step_time(args.reps, 8, 256, 2))
    save_json(folder, "results.json", results)


if __name__ == "__main__":
    main()
