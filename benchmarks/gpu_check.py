"""The GPU check: every CUDA path tested, then K-FAC's step time on a GPU, in one run (``make gpu-check``).

    python benchmarks/gpu_check.py [--out DIR] [--budget 480] [--dry]

Sections, each in a child process under its own time budget (the whole run stays under ``--budget`` seconds,
8 minutes by default on one H100); a section that fails, raises or runs out of time is recorded as such in the
report and the next one runs. The report (``report.md`` and ``report.json``, with ``torch.cuda.get_device_name()``)
is rewritten after every section, so it exists whatever happens.

1. ``tests``: ``pytest -m cuda tests/test_cuda.py`` (async inverses on the side stream, the schedules with CUDA
   tensors, DeepSpeed ZeRO-1/2 against DDP, bf16 autocast, state_bytes against the allocator).
2. ``cnn``: a ResNet-18 (CIFAR variant: 3x3 stem, BatchNorm), batch 128 of 3x32x32, bf16 autocast. Configs:
   ``sgd`` (momentum 0.9), ``adamw``, ``kfac`` (SGD + K-FAC at the library defaults: factors every 5 steps,
   inverses every 50), ``kfac-every`` (factor_update_steps = inv_update_steps = 1), ``kfac-every-async``
   (the same with async_inverses=True).
3. ``transformer``: a GPT-2-small-sized decoder in plain torch (12 layers, d=768, 12 heads, vocabulary 50257,
   learned positions, untied head), batch 8 x 512 tokens, bf16 autocast; the same configs with AdamW as
   K-FAC's base optimizer. Every layer gets K-FAC at the library defaults: the head's 50257-side G and the
   token embedding's A are kept diagonal (max_factor_side), the rest dense.
4. ``overhead``: ``benchmarks/overhead.py --device cuda``, reduced (its MLP and CNN, fewer blocks).

Timing (sections 2-3): every configuration holds its own copy of the model (same initial weights) and a few
fixed random batches on the GPU; after a warm-up (one inverse period for the defaults, 3 steps otherwise,
excluded), rounds of interleaved blocks (one block per configuration per round, the order rotating; a block is
50 steps for the defaults, so it holds one inverse step and 10 factor steps, and ``--block-steps`` otherwise),
each block between two ``torch.cuda.synchronize()``. Reported: medians over blocks of ms per step, the
quartiles, and the ratios of medians against the targets:

* K-FAC at the defaults <= 1.3 x the SGD step on the CNN;
* K-FAC at the defaults <= 1.3 x the AdamW step on the transformer;
* async <= 0.8 x sync at every-step cadence (each model).

Without CUDA (or with ``--dry``) it runs the dry mode: the same sections at tiny sizes on the CPU, one step per
configuration, the tests collected but not run (they need the GPU), a report with ``"dry": true``. CI's
``make test`` runs the dry mode (tests/test_gpu_check.py), so the script cannot rot unnoticed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import REPO, bench_parser, env_info, format_table, out_dir, spread, write_json  # noqa: E402

from lightning_spdkfac import KFACPreconditioner  # noqa: E402

# (section, seconds): the budgets add up to 440 s of the default 480, the rest is start-ups and the report.
BUDGETS = {"tests": 200, "cnn": 70, "transformer": 125, "overhead": 45}
GRACE_S = 20  # a benchmark's timing rounds stop this long before its budget, when its child is killed
TARGETS = (  # (model, ratio, limit, what)
    ("cnn", "kfac/sgd", 1.3, "K-FAC at the defaults vs the SGD step, CNN"),
    ("transformer", "kfac/adamw", 1.3, "K-FAC at the defaults vs the AdamW step, transformer"),
    ("cnn", "kfac-every-async/kfac-every", 0.8, "async vs sync inverses at every-step cadence, CNN"),
    ("transformer", "kfac-every-async/kfac-every", 0.8, "async vs sync inverses at every-step cadence, transformer"),
)
HEAD_NOTE = ("transformer: K-FAC at the library defaults on every layer; the head's 50257-side G and the token "
             "embedding's A are diagonal (max_factor_side=4096)")


# ------------------------------------------------------------------------------ models
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 inputs (3x3 stem, no max-pool), ``width`` channels in its first stage (64)."""

    def __init__(self, width: int = 64, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for i, stride in enumerate((1, 2, 2, 2)):
            cout = width * 2**i
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class DecoderBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A GPT-2-style decoder: token and learned position embeddings, pre-LN blocks, an untied ``head``."""

    def __init__(self, layers: int = 12, d: int = 768, heads: int = 12, vocab: int = 50257, seq: int = 512):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*(DecoderBlock(d, heads) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln_f(self.blocks(self.tok(idx) + self.pos(pos))))


@dataclass(frozen=True)
class Workload:
    """A model at its size, its data and its base optimizer (the one K-FAC preconditions for)."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    base: str  # "sgd" or "adamw"
    lr: dict[str, float]
    skip_layers: tuple[str, ...] = ()


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


def workload(name: str, dry: bool) -> Workload:
    if name == "cnn":
        width, batch, side = (4, 4, 8) if dry else (64, 128, 32)
        return Workload(
            "cnn", lambda: ResNet18(width),
            lambda g: (torch.randn(batch, 3, side, side, generator=g), torch.randint(0, 10, (batch,), generator=g)),
            _ce, "sgd", {"sgd": 0.01, "adamw": 1e-3})
    layers, d, heads, vocab, seq, batch = (2, 32, 2, 101, 16, 2) if dry else (12, 768, 12, 50257, 512, 8)

    def tokens(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

    return Workload("transformer", lambda: GPT(layers, d, heads, vocab, seq), tokens, _ce, "adamw",
                    {"sgd": 0.01, "adamw": 3e-4})


# ------------------------------------------------------------------------------ configurations and timing
CONFIGS = ("sgd", "adamw", "kfac", "kfac-every", "kfac-every-async")
DEFAULT_PERIOD = 50  # the library's inv_update_steps (factor_update_steps 5 divides it)


class Runner:
    """One configuration: its model copy, optimizer, optional K-FAC, fixed batches on the device."""

    def __init__(self, config: str, w: Workload, state: dict, device: torch.device, n_batches: int):
        self.device = device
        self.model = w.build().to(device)
        self.model.load_state_dict(state)
        self.model.train()
        opt_name = config if config in ("sgd", "adamw") else w.base
        lr = w.lr[opt_name]
        self.opt = (torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9) if opt_name == "sgd"
                    else torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01))
        self.pre: KFACPreconditioner | None = None
        if config.startswith("kfac"):
            kw: dict = {"skip_layers": list(w.skip_layers)}
            if config != "kfac":
                kw.update(factor_update_steps=1, inv_update_steps=1, async_inverses=config.endswith("async"))
            self.pre = KFACPreconditioner(self.model, **kw)
        g = torch.Generator().manual_seed(1)
        self.data = [tuple(t.to(device) for t in w.batch(g)) for _ in range(n_batches)]
        self.loss_fn = w.loss
        self.period = DEFAULT_PERIOD if config == "kfac" else 1
        self.i = 0
        self._loss = torch.tensor(float("nan"))

    def step(self) -> None:
        x, y = self.data[self.i % len(self.data)]
        self.i += 1
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            out = self.model(x)
        loss = self.loss_fn(out, y)
        loss.backward()
        if self.pre is not None:
            self.pre.step(self.opt)
        self.opt.step()
        self._loss = loss.detach()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def block(self, steps: int) -> float:
        """Seconds per step over ``steps`` steps, between two synchronizations."""
        self.sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.sync()
        return (time.perf_counter() - t0) / steps

    def facts(self) -> dict:
        out: dict = {"final_loss": float(self._loss)}
        if self.pre is not None:
            out.update(kfac_layers=len(self.pre.layers), skipped_layers=sorted(self.pre.skipped),
                       state_mb=self.pre.state_bytes() / 2**20, inverse_fallbacks=self.pre.inverse_fallbacks,
                       skipped_factor_steps=self.pre.skipped_factor_steps)
        return out


def bench_workload(name: str, args: argparse.Namespace, deadline: float) -> dict:
    """Interleaved blocks of every configuration until ``--rounds`` rounds or the deadline (at least 2 rounds
    when time allows); per-config medians and the ratios."""
    device = torch.device("cpu" if args.dry else "cuda")
    w = workload(name, args.dry)
    torch.manual_seed(0)
    state = w.build().state_dict()
    t0 = time.monotonic()
    runners = {c: Runner(c, w, state, device, 1 if args.dry else 4) for c in CONFIGS}
    build_s = time.monotonic() - t0
    block_steps = {c: (1 if args.dry else (DEFAULT_PERIOD if r.period > 1 else args.block_steps))
                   for c, r in runners.items()}
    for r in runners.values():  # warm-up, excluded: allocations, autotuning, the first inverses
        for _ in range(0 if args.dry else (r.period if r.period > 1 else 3)):
            r.step()
        r.sync()
    times: dict[str, list[float]] = {c: [] for c in runners}
    rounds = 1 if args.dry else args.rounds
    last_round = 0.0
    complete = True
    for rnd in range(rounds):
        if rnd >= 2 and time.monotonic() + last_round > deadline:
            complete = False
            break
        r0 = time.monotonic()
        for j in range(len(CONFIGS)):
            c = CONFIGS[(rnd + j) % len(CONFIGS)]
            times[c].append(runners[c].block(block_steps[c]))
        last_round = time.monotonic() - r0
    configs = {}
    for c, ts in times.items():
        ms = spread(ts, 1e3)
        configs[c] = {"median_ms": ms["median"], "q1_ms": ms["q1"], "q3_ms": ms["q3"],
                      "blocks": len(ts), "steps_per_block": block_steps[c], **runners[c].facts()}
    med = {c: v["median_ms"] for c, v in configs.items()}
    ratios = {f"{a}/{b}": med[a] / med[b] for a, b in (
        ("kfac", "sgd"), ("kfac", "adamw"), ("kfac-every", "sgd"), ("kfac-every", "adamw"),
        ("kfac-every-async", "kfac-every"))}
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    for r in runners.values():
        if r.pre is not None:
            r.pre.remove_hooks()
    return {"model": name, "base_optimizer": w.base, "configs": configs, "ratios": ratios, "complete": complete,
            "rounds": len(times["sgd"]), "build_s": build_s, "peak_gib": peak,
            "notes": [HEAD_NOTE] if w.name == "transformer" else []}


# ------------------------------------------------------------------------------ sections
def _tail(text: str | bytes | None, n: int = 4000) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return text[-n:]


def _run_child(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                               **(env or {})})


def section_tests(args: argparse.Namespace, out: str, budget: float) -> dict:
    xml = os.path.join(out, "cuda-tests.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "cuda", "tests/test_cuda.py", "-p", "no:cacheprovider"]
    if args.dry:
        cmd.append("--collect-only")  # they need the GPU: collected (the module imports), not run
    else:
        cmd += [f"--junitxml={xml}", f"--timeout={int(budget)}"]
    proc = _run_child(cmd, budget)
    result: dict = {"command": " ".join(cmd[1:]), "returncode": proc.returncode, "output_tail": _tail(proc.stdout)}
    if args.dry:
        collected = [ln for ln in proc.stdout.splitlines() if "::" in ln]
        result["collected"] = len(collected)
        ok = proc.returncode == 0 and len(collected) > 0
    elif not os.path.exists(xml):  # pytest itself failed (an import error, a crash): its output says why
        result.update(status="failed", stderr_tail=_tail(proc.stderr))
        return result
    else:
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        result.update(counts)
        ok = proc.returncode == 0 and counts["tests"] > 0 and counts["skipped"] < counts["tests"]
    result["status"] = "passed" if ok else "failed"
    return result


def section_overhead(args: argparse.Namespace, out: str, budget: float) -> dict:
    path = os.path.join(out, "overhead.json")
    if args.dry:
        opts = ["--device", "cpu", "--models", "mlp", "--blocks", "1", "--warmup", "0", "--inv-update-steps", "1",
                "--batch", "8", "--n-batches", "1", "--breakdown-blocks", "0"]
    else:
        opts = ["--device", "cuda", "--blocks", "10", "--warmup", "20", "--breakdown-blocks", "0"]
    cmd = [sys.executable, os.path.join(HERE, "overhead.py"), *opts, "--json", path]
    if args.dry:  # in this process: no start-up to pay, and nothing on the CPU can hang
        import overhead

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            code = overhead.main([*opts, "--json", path])
        proc = subprocess.CompletedProcess(cmd, code, buf.getvalue(), "")
    else:
        proc = _run_child(cmd, budget)
    result: dict = {"command": " ".join(cmd[1:]), "returncode": proc.returncode, "table": _tail(proc.stdout, 6000)}
    if proc.returncode != 0:
        result.update(status="failed", stderr_tail=_tail(proc.stderr))
        return result
    with open(path) as f:
        rows = json.load(f)["results"]
    result["results"] = [{k: r[k] for k in ("model", "sgd_ms", "kfac_ms", "measured_ratio", "floor_ratio", "efficiency")}
                         for r in rows]
    result["status"] = "passed"
    return result


def section_bench(name: str, args: argparse.Namespace, out: str, budget: float) -> dict:
    """The benchmark of ``name`` in a child process (a hang or a crash there cannot take the report with it);
    in this process in the dry mode (tiny, on the CPU)."""
    path = os.path.join(out, f"{name}.json")
    if args.dry:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = bench_workload(name, args, time.monotonic() + budget)
        write_json(path, result)
        result["status"] = "passed"
        return result
    # The timing rounds stop GRACE_S before the budget (building, warm-up and the report fit in it); the child is
    # killed at the budget.
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--out", out, "--deadline",
           str(time.time() + budget - GRACE_S), "--rounds", str(args.rounds), "--block-steps", str(args.block_steps)]
    proc = _run_child(cmd, budget)
    if proc.returncode != 0 or not os.path.exists(path):
        return {"status": "failed", "returncode": proc.returncode, "stderr_tail": _tail(proc.stderr)}
    with open(path) as f:
        result = json.load(f)
    result["status"] = "passed" if result["complete"] else "incomplete (out of time: fewer rounds)"
    return result


def child(args: argparse.Namespace) -> int:
    """``--child NAME``: one benchmark section, written to OUT/NAME.json."""
    warnings.filterwarnings("ignore")
    deadline_mono = time.monotonic() + (args.deadline - time.time())
    result = bench_workload(args.child, args, deadline_mono)
    write_json(os.path.join(args.out, f"{args.child}.json"), result)
    return 0


# ------------------------------------------------------------------------------ report
def targets(report: dict) -> list[dict]:
    rows = []
    for model, ratio, limit, what in TARGETS:
        sec = report["sections"].get(model, {})
        value = sec.get("ratios", {}).get(ratio) if sec.get("status", "").startswith(("passed", "incomplete")) else None
        verdict = "-" if value is None else ("PASS" if value <= limit else "MISS")
        if report["dry"] and value is not None:
            verdict = "dry (not a measurement)"
        rows.append({"what": what, "ratio": ratio, "limit": limit, "value": value, "verdict": verdict})
    return rows


def markdown(report: dict) -> str:
    lines = [f"# GPU check{' (dry run: CPU, tiny models, nothing timed means anything)' if report['dry'] else ''}",
             "", f"- device: {report['device']}", f"- torch {report['env']['torch']}, CUDA {report['cuda']}",
             f"- started {report['started']}, {report['wall_s']:.0f} s in all (budget {report['budget_s']:.0f} s)", ""]
    lines += ["## Targets", "", "```", format_table(report["targets"], [
        ("what", "target", "s"), ("ratio", "ratio", "s"), ("limit", "limit", ".2f"), ("value", "measured", ".3f"),
        ("verdict", "verdict", "s")]), "```", ""]
    for name, sec in report["sections"].items():
        lines += [f"## {name}: {sec.get('status', '?')} ({sec.get('seconds', 0):.0f} s)", ""]
        if "configs" in sec:
            rows = [{"config": c, **v} for c, v in sec["configs"].items()]
            lines += ["```", format_table(rows, [
                ("config", "config", "s"), ("median_ms", "median ms/step", ".2f"), ("q1_ms", "q1", ".2f"),
                ("q3_ms", "q3", ".2f"), ("blocks", "blocks", "d"), ("steps_per_block", "steps/block", "d"),
                ("final_loss", "final loss", ".3f")]), "```", ""]
            lines += [f"- {k}: {v:.3f}" for k, v in sec["ratios"].items()]
            lines += [f"- note: {n}" for n in sec.get("notes", [])] + [""]
        if "table" in sec:
            lines += ["```", sec["table"].rstrip(), "```", ""]
        if "tests" in sec or "collected" in sec:
            lines += ["```", sec.get("output_tail", "").rstrip()[-3000:], "```", ""]
        if "error" in sec or "stderr_tail" in sec:
            lines += ["```", (sec.get("error") or sec.get("stderr_tail", "")).rstrip()[-3000:], "```", ""]
    return "\n".join(lines) + "\n"


def write_report(report: dict, out: str) -> None:
    report["targets"] = targets(report)
    write_json(os.path.join(out, "report.json"), report)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(markdown(report))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bench_parser(__doc__, quick=None, out="report folder (default: a fresh benchmarks/results/run-*-gpu_check/)")
    p.add_argument("--dry", action="store_true", help="tiny models on the CPU, tests collected only (the default "
                   "without CUDA)")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run")
    p.add_argument("--sections", default=",".join(BUDGETS), help="comma-separated subset of " + ",".join(BUDGETS))
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds per benchmark (fewer if out of time)")
    p.add_argument("--block-steps", type=int, default=10, help="steps per block (the defaults' blocks: 50)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if any(s not in BUDGETS for s in args.sections):
        p.error(f"--sections: choose from {', '.join(BUDGETS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child(args)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry:
        print("no CUDA device: dry mode (tiny models on the CPU, the cuda tests collected, not run)")
        args.dry = True
    out = out_dir(args, "gpu_check" + ("_dry" if args.dry else ""))
    t_start = time.monotonic()
    report: dict = {
        "dry": args.dry, "device": torch.cuda.get_device_name() if cuda and not args.dry else "cpu (dry run)",
        "cuda": torch.version.cuda, "env": env_info(), "budget_s": args.budget,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "sections": {}, "wall_s": 0.0,
    }
    scale = args.budget / 480.0
    try:
        for name in args.sections:
            left = args.budget - (time.monotonic() - t_start)
            budget = min(BUDGETS[name] * scale, left - 5)
            print(f"== {name} (budget {budget:.0f} s)", flush=True)
            if budget < 10:
                report["sections"][name] = {"status": "skipped: out of time", "seconds": 0.0}
                continue
            t0 = time.monotonic()
            try:
                if name == "tests":
                    sec = section_tests(args, out, budget)
                elif name == "overhead":
                    sec = section_overhead(args, out, budget)
                else:
                    sec = section_bench(name, args, out, budget)
            except subprocess.TimeoutExpired as e:
                sec = {"status": f"failed: out of time after {e.timeout:.0f} s", "stderr_tail": _tail(e.stderr)}
            except Exception:
                sec = {"status": "failed", "error": traceback.format_exc()}
            sec["seconds"] = time.monotonic() - t0
            report["sections"][name] = sec
            print(f"   {sec['status']} in {sec['seconds']:.0f} s", flush=True)
            report["wall_s"] = time.monotonic() - t_start
            write_report(report, out)
    finally:
        report["wall_s"] = time.monotonic() - t_start
        write_report(report, out)
    print(markdown(report))
    print(f"wrote {os.path.join(out, 'report.md')} and report.json")
    return 0 if all(s.get("status") == "passed" for s in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
