"""The GPU check: every CUDA path tested, then K-FAC's step time, host syncs, memory and phases on a GPU, in one
run (``make gpu-check``; docs/guide/gpu-check.md).

    python benchmarks/gpu_check.py [--out DIR] [--budget 360] [--tf32 off|on] [--wheels DIR] [--dry]

It needs a CUDA PyTorch (>= 2.1) and nothing else installed: the package is imported from this checkout, and a
section whose dependency is missing (pytest for the tests; DeepSpeed, Lightning or transformers for some of them)
is skipped, or its tests skip, with the reason in the report. ``--wheels DIR``: wheels of pure-Python
dependencies the machine lacks (jsonargparse, pytest, ...), installed for this run only with ``pip install
--no-index --no-deps --target`` into a temporary folder put on the path (unzipped where there is no pip).

Sections, each under its own time budget (they add up to 330 s of the default ``--budget`` of 360 s: the whole
run takes at most 6 minutes on one H100, so it can be rerun within 15 minutes of machine time; what a section
leaves unspent goes to the ones after it, in proportion to their budgets); a section that
fails, raises or runs out of time is recorded as such and the next one runs. The report is rewritten after every
section, so it exists whatever happens.

0. ``smoke`` (this process, first): torch, CUDA, cuDNN, NCCL (``torch.cuda.nccl.version()``), Lightning and the
   optional packages' versions, the TF32 state as found (``torch.backends.cuda.matmul.allow_tf32``,
   ``torch.backends.cudnn.allow_tf32``, ``torch.get_float32_matmul_precision()``), the card and a kernel run on
   it. Without CUDA a run that is not ``--dry`` stops here and exits 2.
1. ``tests``: ``pytest -m cuda tests/test_cuda.py`` (async inverses on the side stream, the schedules with CUDA
   tensors, DeepSpeed ZeRO-1/2 against DDP, bf16 autocast, state_bytes against the allocator, K-FAC steps under
   ``torch.cuda.set_sync_debug_mode("error")``).
2. ``cnn``: a ResNet-18 (CIFAR variant: 3x3 stem, BatchNorm), batch 128 of 3x32x32, bf16 autocast. Configs:
   ``sgd`` (momentum 0.9), ``adamw``, ``kfac`` (SGD + K-FAC at the library defaults: factors every 5 steps,
   inverses every 50), ``kfac-every`` (factor_update_steps = inv_update_steps = 1), ``kfac-every-async``
   (the same with async_inverses=True).
3. ``transformer``: a GPT-2-small-sized decoder in plain torch (12 layers, d=768, 12 heads, vocabulary 50257,
   learned positions, untied head), batch 8 x 512 tokens, bf16 autocast; the same configs with AdamW as
   K-FAC's base optimizer. Every layer gets K-FAC at the library defaults: the head's 50257-side G and the
   token embedding's A are kept diagonal (max_factor_side), the rest dense.
4. ``overhead``: ``benchmarks/overhead.py --device cuda``, reduced (its MLP and CNN, fewer blocks).

TF32 is set for sections 2-4 (``--tf32``, default ``off``: ``allow_tf32`` False for cuBLAS and cuDNN and float32
matmul precision ``highest``, so K-FAC's float32 factors and inverses are float32; the models run under bf16
autocast either way) and the state each section ran with is in the report.

Timing (sections 2-3): every configuration holds its own copy of the model (same initial weights) and a few
fixed random batches on the GPU; after a warm-up (one inverse period for the defaults, 3 steps otherwise,
excluded), rounds of interleaved blocks (one block per configuration per round, the order rotating; a block is
50 steps for the defaults, so it holds one inverse step and 10 factor steps, and ``--block-steps`` otherwise),
each block between two ``torch.cuda.synchronize()``. Reported: medians over blocks of ms per step, the
quartiles, and the ratios of medians against the targets:

* K-FAC at the defaults <= 1.3 x the SGD step on the CNN;
* K-FAC at the defaults <= 1.3 x the AdamW step on the transformer;
* async <= 0.8 x sync at every-step cadence (each model).

Probes (sections 2-3, after the timings, per configuration):

* host syncs: one inverse period of steps (50 at the defaults, else two steps) under
  ``torch.cuda.set_sync_debug_mode("warn")``; every "called a synchronizing CUDA operation" warning is counted by
  the source line that raised it, the innermost ``lightning_spdkfac`` line on the stack, the part of the step
  (forward/backward: the hooks; ``kfac.step``; ``optimizer.step``) and the thread (a C++ backward op's sync shows
  as ``torch/autograd/graph.py``, where the engine replays it); C++ prints without a Python frame (on stderr) are
  counted apart;
* memory: the allocated bytes the configuration added (model copy, optimizer and K-FAC state, after its
  warm-up), and over the same steps the peak (``max_memory_allocated`` after ``reset_peak_memory_stats``),
  the reserved bytes and the allocator's retries (``num_alloc_retries``, a cache flush each);
* phases: one step (an inverse step at the defaults) under ``torch.profiler`` with CUDA activity: the CUDA
  kernel time launched inside each ``kfac/*`` ``record_function`` range (nested ranges counted in their parent
  too; ranges of other threads, the async worker's, may be missing).

One GPU is used: the report says "NCCL with several ranks: not measured".

``--dry`` runs the same sections at tiny sizes on the CPU, one step per configuration, the tests collected but not
run, the probes that need CUDA reported as not available on CPU (the phases from a CPU profile): a report with
``"dry": true``. CI runs it (``make gpu-check-dry``, tests/test_gpu_check.py), so the script cannot rot.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib
import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import REPO, bench_parser, env_info, format_table, out_dir, spread, write_json  # noqa: E402

if REPO not in sys.path:  # the package from this checkout (no install needed), ahead of any installed copy
    sys.path.insert(1, REPO)

# (section, seconds): 330 s of the default 360; the rest is start-ups and the report. smoke runs in this process.
BUDGETS = {"smoke": 5, "tests": 170, "cnn": 45, "transformer": 85, "overhead": 25}
DEFAULT_BUDGET = 360.0
PROBE_RESERVE = {"cnn": 15, "transformer": 25}  # seconds of a benchmark's budget kept for its probes
GRACE_S = 8  # a benchmark child stops its work this long before its budget, when it is killed
NEEDS = {"tests": ("pytest", "numpy")}  # modules a section cannot run without (tests/conftest.py imports numpy;
# the tests skip, saying why, what else they lack)
NCCL_LINE = "NCCL with several ranks: not measured"
NOT_ON_CPU = "not available on CPU"
SYNC_MESSAGE = "called a synchronizing CUDA operation"
DRY_PROBES = ("sgd", "kfac-every-async")  # the dry mode probes these two only (the same code; steps cost CI time)
PACKAGES = ("pytorch-lightning", "lightning", "lightning-fabric", "torchmetrics", "jsonargparse", "deepspeed",
            "transformers", "timm", "pytest", "pytest-timeout", "numpy", "scikit-learn")
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




# ------------------------------------------------------------------------------ environment: smoke, TF32, wheels
def _try(fn: Callable[[], Any]) -> Any:
    """``fn()``, or why it could not be read (a CPU build's missing NCCL, TF32 flags set through both APIs)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - recorded, not raised: the smoke section must finish
        return f"unreadable: {type(e).__name__}: {str(e)[:200]}"


def nccl_version() -> str:
    v = importlib.import_module("torch.cuda.nccl").version()  # an int before torch 1.13, a tuple since
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def tf32_state() -> dict[str, Any]:
    """The TF32 settings as torch reports them (each read on its own: one may raise when both APIs were used)."""
    state = {
        "cuda.matmul.allow_tf32": _try(lambda: torch.backends.cuda.matmul.allow_tf32),
        "cudnn.allow_tf32": _try(lambda: torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": _try(torch.get_float32_matmul_precision),
    }
    for key, read in (("cuda.matmul.fp32_precision", lambda: torch.backends.cuda.matmul.fp32_precision),
                      ("cudnn.conv.fp32_precision", lambda: torch.backends.cudnn.conv.fp32_precision)):
        value = _try(read)  # torch >= 2.9's API; absent before
        if not (isinstance(value, str) and value.startswith("unreadable: AttributeError")):
            state[key] = value
    return state


@contextlib.contextmanager
def tf32_mode(mode: str) -> Iterator[dict[str, Any]]:
    """TF32 ``on`` or ``off`` for cuBLAS and cuDNN (the legacy flags, which every torch >= 2.1 has, and the float32
    matmul precision: ``high`` / ``highest``); yields the state read back; restores the previous one."""
    on = mode == "on"
    try:
        saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                 torch.get_float32_matmul_precision())
    except RuntimeError:  # set through the new API before: not restorable through the old one
        saved = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch >= 2.9 suggests its new API; these still set the same flags
        torch.set_float32_matmul_precision("high" if on else "highest")
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on
    try:
        yield {"set": mode, **tf32_state()}
    finally:
        if saved is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.set_float32_matmul_precision(saved[2])
                torch.backends.cuda.matmul.allow_tf32 = saved[0]
                torch.backends.cudnn.allow_tf32 = saved[1]


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def section_smoke(args: argparse.Namespace, out: str, budget: float) -> dict:
    """Versions, TF32 state, the card: printed, and recorded. Fails (and the run stops) only for a run that
    needs CUDA and has none."""
    cuda = torch.cuda.is_available()
    import torch.distributed as dist

    info: dict[str, Any] = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": cuda,
        "cudnn": _try(torch.backends.cudnn.version), "nccl": _try(nccl_version),
        "nccl_backend": dist.is_available() and dist.is_nccl_available(),
        "tf32_as_found": tf32_state(), "tf32_for_timings": args.tf32,
        "packages": package_versions(), "wheels": args.wheel_rows,
    }
    try:
        import lightning_spdkfac
        from lightning_spdkfac import KFACPreconditioner  # noqa: F401 - the core imports

        info["lightning_spdkfac"] = os.path.dirname(lightning_spdkfac.__file__)
    except Exception as e:  # noqa: BLE001
        info["lightning_spdkfac"] = f"unimportable: {type(e).__name__}: {e}"
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count(),
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    memory_gib=round(props.total_memory / 2**30, 1))
        x = torch.randn(256, 256, device="cuda")
        info["kernel_check"] = _try(lambda: bool(torch.isfinite((x @ x).sum()).item()))
    lines = [f"{k}: {v}" for k, v in info.items() if k not in ("packages", "tf32_as_found", "wheels")]
    lines.append("TF32 as found: " + _kv(info["tf32_as_found"]))
    lines.append("packages: " + ", ".join(f"{k} {v or '-'}" for k, v in info["packages"].items()))
    lines += [f"wheel {w['wheel']}: {w['result']}" for w in args.wheel_rows]
    print("\n".join("   " + ln for ln in lines), flush=True)
    status = "passed"
    if not cuda and not args.dry:
        status = (f"failed: no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
                  "nothing else runs. `make gpu-check-dry` or --dry runs the CPU dry mode")
    elif info["lightning_spdkfac"].startswith("unimportable"):
        status = "failed: lightning_spdkfac does not import"
    return {"status": status, "info": info, "lines": lines}


def install_wheels(folder: str) -> tuple[str, list[dict]]:
    """Install the wheels of ``folder`` for this run only, into a new temporary folder (returned, and put on the
    path by the caller): ``pip install --no-index --no-deps --target``, one wheel at a time (one refused wheel
    leaves the others installed); without pip, pure-Python wheels (``*-none-any.whl``) are unzipped there."""
    target = tempfile.mkdtemp(prefix="gpu-check-wheels-")
    has_pip = importlib.util.find_spec("pip") is not None
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "*.whl"))):
        name = os.path.basename(path)
        if has_pip:
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--quiet",
                 "--disable-pip-version-check", "--target", target, path],
                capture_output=True, text=True, timeout=300)
            result = "installed (pip)" if proc.returncode == 0 else f"refused by pip: {_tail(proc.stderr, 400)}"
        elif name.endswith("-none-any.whl"):
            with zipfile.ZipFile(path) as z:
                z.extractall(target)
            result = "installed (unzipped: no pip here)"
        else:
            result = "not installed: no pip here, and not a pure-Python wheel (*-none-any.whl)"
        rows.append({"wheel": name, "result": result})
    if not rows:
        rows.append({"wheel": "(none)", "result": f"no *.whl in {folder}"})
    return target, rows


# ------------------------------------------------------------------------------ probes: syncs, memory, phases
def _where(filename: str) -> str:
    """A source file as the report shows it: relative to the checkout, or from site-packages on."""
    path = os.path.abspath(filename)
    if path.startswith(REPO + os.sep):
        return os.path.relpath(path, REPO)
    marker = os.sep + "site-packages" + os.sep
    return path.split(marker, 1)[1] if marker in path else path


def _in_package(filename: str) -> bool:
    return f"{os.sep}lightning_spdkfac{os.sep}" in os.path.abspath(filename)


class SyncCounter:
    """Counts the sync debug mode's warnings of a window of steps.

    Each Python warning "called a synchronizing CUDA operation" is counted under (its source line, whether that
    line is in lightning_spdkfac, the innermost lightning_spdkfac line on the stack, the part of the step, the
    thread). A sync inside a C++ backward op (no Python frame: the autograd engine replays its warnings at the
    end of ``backward()``) shows as ``torch/autograd/graph.py``; one that c10 prints on stderr instead (a C++
    thread with no Python caller) is counted as ``cxx_without_python_frame``."""

    def __init__(self) -> None:
        self.part = "between steps"
        self.python: Counter[tuple[str, bool, str | None, str, str]] = Counter()
        self.cxx = 0
        self._lock = threading.Lock()  # the autograd and worker threads warn too

    def set_part(self, part: str) -> None:
        self.part = part

    def showwarning(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    file: Any = None, line: str | None = None) -> None:
        if SYNC_MESSAGE not in str(message):
            return
        frame = sys._getframe(1)
        package_frame = None
        while frame is not None:
            if _in_package(frame.f_code.co_filename):
                package_frame = f"{_where(frame.f_code.co_filename)}:{frame.f_lineno}"
                break
            frame = frame.f_back
        key = (f"{_where(filename)}:{lineno}", _in_package(filename), package_frame, self.part,
               threading.current_thread().name)
        with self._lock:
            self.python[key] += 1

    @contextlib.contextmanager
    def capture(self, debug_mode: bool) -> Iterator[SyncCounter]:
        """Count during the block; ``debug_mode``: under ``torch.cuda.set_sync_debug_mode("warn")`` (CUDA only:
        without it, the counting machinery runs and counts nothing)."""
        with warnings.catch_warnings(), tempfile.TemporaryFile("w+b") as err:
            warnings.simplefilter("always")  # every occurrence, not the first per line
            warnings.showwarning = self.showwarning
            sys.stderr.flush()
            saved = os.dup(2)
            os.dup2(err.fileno(), 2)  # c10's own prints (no Python frame) go to fd 2
            previous = torch.cuda.get_sync_debug_mode() if debug_mode else None
            try:
                if debug_mode:
                    torch.cuda.set_sync_debug_mode("warn")
                yield self
            finally:
                if previous is not None:
                    torch.cuda.set_sync_debug_mode(previous)
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
                err.seek(0)
                text = err.read().decode(errors="replace")
        kept = [ln for ln in text.splitlines() if SYNC_MESSAGE not in ln]
        self.cxx += text.count(SYNC_MESSAGE)
        if kept:  # whatever else was printed meanwhile, passed on
            print("\n".join(kept), file=sys.stderr)

    def summary(self, steps: int) -> dict:
        total = sum(self.python.values()) + self.cxx
        parts: Counter[str] = Counter()
        for (_, _, _, part, _), n in self.python.items():
            parts[part] += n
        lines = [{"line": where, "in_package": own, "package_line": pkg, "part": part, "thread": thread, "count": n}
                 for (where, own, pkg, part, thread), n in self.python.most_common()]
        return {"status": "measured", "steps": steps, "total": total, "per_step": total / max(steps, 1),
                "in_forward_backward": parts["forward/backward"], "by_part": dict(parts),
                "from_package": sum(n for (_, own, pkg, _, _), n in self.python.items() if own or pkg),
                "cxx_without_python_frame": self.cxx, "lines": lines}


def _memory(device: torch.device) -> dict[str, int]:
    stats = torch.cuda.memory_stats(device)
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
            "retries": int(stats.get("num_alloc_retries", 0))}


def kfac_phase_times(events: Any) -> dict[str, dict]:
    """Per ``kfac/*`` range of a profiled step: calls, host time, and the CUDA kernel time launched inside it
    (its children's included: ``device_time_total``, ``cuda_time_total`` before torch 2.4)."""
    phases: dict[str, dict] = {}
    for e in events:
        if not e.name.startswith("kfac/"):
            continue
        row = phases.setdefault(e.name, {"calls": 0, "cpu_ms": 0.0, "cuda_ms": 0.0})
        if str(e.device_type).endswith("CPU"):
            device_us = getattr(e, "device_time_total", None)
            if device_us is None:
                device_us = getattr(e, "cuda_time_total", 0)
            row["calls"] += 1
            row["cpu_ms"] += e.cpu_time_total / 1e3
            row["cuda_ms"] += device_us / 1e3
        else:  # the range as a GPU-side annotation: its span on the device
            row["gpu_span_ms"] = row.get("gpu_span_ms", 0.0) + e.time_range.elapsed_us() / 1e3
    return dict(sorted(phases.items()))


# ------------------------------------------------------------------------------ configurations and timing
CONFIGS = ("sgd", "adamw", "kfac", "kfac-every", "kfac-every-async")
DEFAULT_PERIOD = 50  # the library's inv_update_steps (factor_update_steps 5 divides it)


class Runner:
    """One configuration: its model copy, optimizer, optional K-FAC, fixed batches on the device."""

    def __init__(self, config: str, w: Workload, state: dict, device: torch.device, n_batches: int):
        from lightning_spdkfac import KFACPreconditioner

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
        self.on_part: Callable[[str], None] | None = None  # told which part of the step runs (the sync probe)

    def _part(self, name: str) -> None:
        if self.on_part is not None:
            self.on_part(name)

    def step(self) -> None:
        x, y = self.data[self.i % len(self.data)]
        self.i += 1
        self.opt.zero_grad(set_to_none=True)
        self._part("forward/backward")  # K-FAC's hooks run here
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            out = self.model(x)
        loss = self.loss_fn(out, y)
        loss.backward()
        if self.pre is not None:
            self._part("kfac.step")
            self.pre.step(self.opt)
        self._part("optimizer.step")
        self.opt.step()
        self._part("between steps")
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


def build(w: Workload, device: torch.device, dry: bool) -> tuple[dict[str, Runner], dict[str, dict], float]:
    """Every configuration's runner, warmed up (allocations, autotuning, the first inverses: excluded from the
    timings), and what each added to the allocated memory (its model copy, optimizer and K-FAC state)."""
    torch.manual_seed(0)
    state = w.build().state_dict()
    t0 = time.monotonic()
    runners, memory = {}, {}
    for c in CONFIGS:
        before = _memory(device) if device.type == "cuda" else None
        r = runners[c] = Runner(c, w, state, device, 1 if dry else 4)
        for _ in range(0 if dry else (r.period if r.period > 1 else 3)):
            r.step()
        r.sync()
        if before is None:
            memory[c] = {"status": NOT_ON_CPU}
        else:
            after = _memory(device)
            memory[c] = {"status": "measured", "allocated_delta_mib": (after["allocated"] - before["allocated"]) / 2**20,
                         "retries_while_built": after["retries"] - before["retries"]}
    return runners, memory, time.monotonic() - t0


def time_rounds(runners: dict[str, Runner], rounds: int, block_steps: int, deadline: float, dry: bool) -> dict:
    """Interleaved blocks of every configuration until ``rounds`` rounds or the deadline (at least 2 rounds)."""
    steps = {c: (1 if dry else (DEFAULT_PERIOD if r.period > 1 else block_steps)) for c, r in runners.items()}
    times: dict[str, list[float]] = {c: [] for c in runners}
    last_round = 0.0
    complete = True
    for rnd in range(1 if dry else rounds):
        if rnd >= 2 and time.monotonic() + last_round > deadline:
            complete = False
            break
        r0 = time.monotonic()
        for j in range(len(CONFIGS)):
            c = CONFIGS[(rnd + j) % len(CONFIGS)]
            times[c].append(runners[c].block(steps[c]))
        last_round = time.monotonic() - r0
    configs = {}
    for c, ts in times.items():
        ms = spread(ts, 1e3)
        configs[c] = {"median_ms": ms["median"], "q1_ms": ms["q1"], "q3_ms": ms["q3"],
                      "blocks": len(ts), "steps_per_block": steps[c], **runners[c].facts()}
    med = {c: v["median_ms"] for c, v in configs.items()}
    ratios = {f"{a}/{b}": med[a] / med[b] for a, b in (
        ("kfac", "sgd"), ("kfac", "adamw"), ("kfac-every", "sgd"), ("kfac-every", "adamw"),
        ("kfac-every-async", "kfac-every"))}
    return {"configs": configs, "ratios": ratios, "complete": complete, "rounds": len(times["sgd"])}


def probe(r: Runner, dry: bool) -> dict:
    """Host syncs and memory over one inverse period of steps at the defaults, two steps otherwise (an async
    inversion launched by a step runs into the next one), one in the dry mode; then the ``kfac/*`` phases of one
    profiled step (at the defaults an inverse step: the window ends on a period)."""
    cuda = r.device.type == "cuda"
    steps = 1 if dry else max(r.period, 2)
    if not dry:
        while r.i % r.period:  # start on a period: the window holds exactly one inverse step
            r.step()
    r.sync()
    before = None
    if cuda:
        torch.cuda.reset_peak_memory_stats(r.device)
        before = _memory(r.device)
    counter = SyncCounter()
    r.on_part = counter.set_part
    try:
        with counter.capture(debug_mode=cuda):
            for _ in range(steps):
                r.step()
    finally:
        r.on_part = None
    r.sync()  # (outside the window: a synchronize is itself a sync)
    out: dict[str, Any] = {}
    if cuda:
        after = _memory(r.device)
        out["syncs"] = counter.summary(steps)
        out["memory"] = {"status": "measured", "steps": steps,
                         "peak_gib": torch.cuda.max_memory_allocated(r.device) / 2**30,
                         "peak_above_resident_mib": (torch.cuda.max_memory_allocated(r.device)
                                                     - before["allocated"]) / 2**20,
                         "reserved_gib": after["reserved"] / 2**30,
                         "retries_in_window": after["retries"] - before["retries"], "retries_total": after["retries"]}
    else:
        out["syncs"] = {"status": f"{NOT_ON_CPU} (torch.cuda.set_sync_debug_mode needs CUDA)", "steps": steps,
                        "counted": sum(counter.python.values()) + counter.cxx}
        out["memory"] = {"status": f"{NOT_ON_CPU} (torch.cuda allocator statistics)"}
    if r.pre is not None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        inverse_step = r.pre.steps % r.pre.inv_update_steps == 0
        with profile(activities=activities) as prof:
            r.step()
            r.sync()
        out["phases"] = {"status": "measured" if cuda else "CPU profile (dry: no CUDA time)",
                         "inverse_step": inverse_step, "ranges": kfac_phase_times(prof.events())}
    return out


def bench_workload(name: str, args: argparse.Namespace, deadline: float,
                   write: Callable[[dict], None] | None = None) -> dict:
    """Build, time (until ``--rounds`` rounds or the deadline less the probes' reserve), then probe every
    configuration (each skipped once the deadline passed). ``write`` gets the result after the timings and again
    after the probes, so that a child killed while probing still leaves its timings."""
    device = torch.device("cpu" if args.dry else "cuda")
    w = workload(name, args.dry)
    runners, memory, build_s = build(w, device, args.dry)
    reserve = PROBE_RESERVE.get(name, 0) * args.budget / DEFAULT_BUDGET
    result = {"model": name, "base_optimizer": w.base, "build_s": build_s,
              **time_rounds(runners, args.rounds, args.block_steps, deadline - reserve, args.dry),
              "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
              "notes": [HEAD_NOTE] if w.name == "transformer" else []}
    if write is not None:
        write(result)
    probes = {}
    for c, r in runners.items():
        if time.monotonic() > deadline:
            probes[c] = {"status": "skipped: out of time"}
        elif args.dry and c not in DRY_PROBES:
            probes[c] = {"status": f"dry: only {' and '.join(DRY_PROBES)} are probed", "built": memory[c]}
        else:
            try:
                probes[c] = {"built": memory[c], **probe(r, args.dry)}
            except Exception:  # (one configuration's probe, not the others')
                probes[c] = {"status": "failed", "built": memory[c], "error": traceback.format_exc()[-3000:]}
    result["probes"] = probes
    result["probes_complete"] = all("syncs" in p or p["status"].startswith("dry") for p in probes.values())
    for r in runners.values():
        if r.pre is not None:
            r.pre.remove_hooks()
    if write is not None:
        write(result)
    return result


# ------------------------------------------------------------------------------ sections
def _tail(text: str | bytes | None, n: int = 4000) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return text[-n:]


def _pythonpath(args: argparse.Namespace) -> str:
    parts = [REPO] + ([args.wheel_dir] if args.wheel_dir else []) + (
        [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    return os.pathsep.join(parts)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nothing left in the group
        pass


def _run_child(cmd: list[str], timeout: float, args: argparse.Namespace) -> subprocess.CompletedProcess:
    """``cmd`` in REPO, in a process group of its own, killed at ``timeout`` (TimeoutExpired); whatever it leaves
    behind in its group (the ranks a test spawned, a forkserver) is killed when it ends, so no section holds the
    GPU for the next one. Its output goes through files: a process left behind holding a pipe cannot stall this."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, text=True, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": _pythonpath(args)})
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc.pid)
            proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def missing(section: str) -> list[str]:
    return [m for m in NEEDS.get(section, ()) if importlib.util.find_spec(m) is None]


def _skips(suite: ET.Element) -> list[dict]:
    """Each skipped test of a junit suite, with pytest's reason."""
    rows = []
    for case in suite.iter("testcase"):
        skipped = case.find("skipped")
        if skipped is not None:
            rows.append({"test": case.get("name"), "reason": (skipped.get("message") or "")[:300]})
    return rows


def section_tests(args: argparse.Namespace, out: str, budget: float) -> dict:
    xml = os.path.join(out, "cuda-tests.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "cuda", "tests/test_cuda.py", "-p", "no:cacheprovider"]
    if args.dry:
        cmd.append("--collect-only")  # they need the GPU: collected (the module imports), not run
    else:
        cmd.append(f"--junitxml={xml}")
        if importlib.util.find_spec("pytest_timeout") is not None:
            cmd.append(f"--timeout={int(budget)}")
    proc = _run_child(cmd, budget, args)
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
        result.update(counts, skips=_skips(suite))
        ok = proc.returncode == 0 and counts["tests"] > 0 and counts["skipped"] < counts["tests"]
    result["status"] = "passed" if ok else "failed"
    return result


def overhead_opts(dry: bool) -> list[str]:
    if dry:
        return ["--device", "cpu", "--models", "mlp", "--blocks", "1", "--warmup", "0", "--inv-update-steps", "1",
                "--batch", "8", "--n-batches", "1", "--breakdown-blocks", "0"]
    return ["--device", "cuda", "--blocks", "6", "--warmup", "20", "--breakdown-blocks", "0"]


def run_overhead(path: str, dry: bool, tf32: str) -> tuple[int, str, dict]:
    """benchmarks/overhead.py's main in this process under the TF32 setting; (exit code, its table, the setting)."""
    import overhead

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), warnings.catch_warnings(), tf32_mode(tf32) as tf32_used:
        warnings.simplefilter("ignore")
        code = overhead.main([*overhead_opts(dry), "--json", path])
    return code, buf.getvalue(), tf32_used


def section_overhead(args: argparse.Namespace, out: str, budget: float) -> dict:
    path = os.path.join(out, "overhead.json")
    cmd = [sys.executable, os.path.join(HERE, "overhead.py"), *overhead_opts(args.dry), "--json", path]
    if args.dry:  # in this process: no start-up to pay, and nothing on the CPU can hang
        code, table, tf32_used = run_overhead(path, True, args.tf32)
        proc = subprocess.CompletedProcess(cmd, code, table, "")
    else:  # in a child (gpu_check.py --child overhead), which sets TF32 first
        child_cmd = [sys.executable, os.path.abspath(__file__), "--child", "overhead", "--out", out,
                     "--tf32", args.tf32]
        proc = _run_child(child_cmd, budget, args)
        tf32_used = None
        if proc.returncode == 0 and os.path.exists(path):
            with open(path) as f:
                tf32_used = json.load(f).get("tf32")
    result: dict = {"command": " ".join(cmd[1:]), "returncode": proc.returncode, "table": _tail(proc.stdout, 6000),
                    "tf32": tf32_used}
    if proc.returncode != 0:
        result.update(status="failed", stderr_tail=_tail(proc.stderr))
        return result
    with open(path) as f:
        rows = json.load(f)["results"]
    result["results"] = [{k: r[k] for k in ("model", "sgd_ms", "kfac_ms", "measured_ratio", "floor_ratio", "efficiency")}
                         for r in rows]
    result["status"] = "passed"
    return result


def _bench_status(result: dict) -> str:
    failed = [c for c, p in result.get("probes", {}).items() if p.get("status") == "failed"]
    if failed:
        return f"failed: the probes of {', '.join(failed)} raised"
    if not result.get("complete", False):
        return "incomplete (out of time: fewer timing rounds)"
    if not result.get("probes_complete", False):
        return "incomplete (out of time: probes missing)"
    return "passed"


def section_bench(name: str, args: argparse.Namespace, out: str, budget: float) -> dict:
    """The benchmark of ``name`` in a child process (a hang or a crash there cannot take the report with it);
    in this process in the dry mode (tiny, on the CPU)."""
    path = os.path.join(out, f"{name}.json")
    if args.dry:
        with warnings.catch_warnings(), tf32_mode(args.tf32) as tf32_used:
            warnings.simplefilter("ignore")
            result = bench_workload(name, args, time.monotonic() + budget)
        result["tf32"] = tf32_used
        write_json(path, result)
        result["status"] = _bench_status(result)
        return result
    # The child stops GRACE_S before the budget (its timing rounds earlier still: its probes have a reserve); it is
    # killed at the budget. What it wrote by then (the timings first, the probes after) is kept.
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--out", out, "--deadline",
           str(time.time() + budget - GRACE_S), "--rounds", str(args.rounds), "--block-steps", str(args.block_steps),
           "--tf32", args.tf32, "--budget", str(args.budget)]
    try:
        proc = _run_child(cmd, budget, args)
        code, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        code, stderr = f"killed at its budget of {budget:.0f} s", _tail(e.stderr)
    if not os.path.exists(path):
        return {"status": "failed", "returncode": code, "stderr_tail": _tail(stderr)}
    with open(path) as f:
        result = json.load(f)
    result["status"] = _bench_status(result)
    if code != 0:
        result.update(status=f"failed after its timings ({code})", returncode=code, stderr_tail=_tail(stderr))
    return result


def child(args: argparse.Namespace) -> int:
    """``--child NAME``: one section in a fresh process, under the TF32 setting, written to OUT/NAME.json."""
    warnings.filterwarnings("ignore")
    path = os.path.join(args.out, f"{args.child}.json")
    if args.child == "overhead":
        code, table, tf32_used = run_overhead(path, args.dry, args.tf32)
        print(table)
        if code == 0:
            with open(path) as f:
                payload = json.load(f)
            write_json(path, {**payload, "tf32": tf32_used})
        return code
    deadline_mono = time.monotonic() + (args.deadline - time.time())
    with tf32_mode(args.tf32) as tf32_used:
        bench_workload(args.child, args, deadline_mono, lambda result: write_json(path, {**result, "tf32": tf32_used}))
    return 0


# ------------------------------------------------------------------------------ report
def targets(report: dict) -> list[dict]:
    rows = []
    for model, ratio, limit, what in TARGETS:
        sec = report["sections"].get(model, {})
        ran = sec.get("status", "").startswith(("passed", "incomplete", "failed after its timings",
                                                 "failed: the probes"))
        value = sec.get("ratios", {}).get(ratio) if ran else None
        verdict = "-" if value is None else ("PASS" if value <= limit else "MISS")
        if report["dry"] and value is not None:
            verdict = "dry (not a measurement)"
        rows.append({"what": what, "ratio": ratio, "limit": limit, "value": value, "verdict": verdict})
    return rows


def _kv(d: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items())


def _fence(text: str) -> list[str]:
    return ["```", text.rstrip(), "```", ""]


def probe_tables(sec: dict) -> list[str]:
    """Markdown of a benchmark section's probes: syncs, memory, phases, per configuration."""
    probes = sec.get("probes", {})
    if not probes:
        return []
    lines = ["Host syncs (sync debug mode `warn`; per configuration, over its window of steps):", ""]
    rows, where = [], []
    for c, p in probes.items():
        s = p.get("syncs", {"status": p.get("status", "?")})
        rows.append({"config": c, "status": s["status"], "steps": s.get("steps", 0), "total": s.get("total"),
                     "per_step": s.get("per_step"), "fwd_bwd": s.get("in_forward_backward"),
                     "package": s.get("from_package"), "cxx": s.get("cxx_without_python_frame")})
        where += [f"- {c}: {ln['count']} x {ln['line']}" + (" (lightning_spdkfac)" if ln["in_package"] else "")
                  + (f" via {ln['package_line']}" if ln["package_line"] and not ln["in_package"] else "")
                  + f", {ln['part']}, thread {ln['thread']}" for ln in s.get("lines", [])[:12]]
    lines += _fence(format_table(rows, [
        ("config", "config", "s"), ("status", "status", "s"), ("steps", "steps", "d"), ("total", "syncs", "d"),
        ("per_step", "per step", ".2f"), ("fwd_bwd", "in forward/backward", "d"),
        ("package", "from lightning_spdkfac", "d"), ("cxx", "C++ only", "d")]))
    if where:
        lines += ["Where (source line, innermost lightning_spdkfac line, part of the step, thread):", "", *where, ""]
    rows = []
    for c, p in probes.items():
        built, m = p.get("built", {}), p.get("memory", {"status": p.get("status", "?")})
        rows.append({"config": c, "status": m["status"], "delta": built.get("allocated_delta_mib"),
                     "peak": m.get("peak_gib"), "above": m.get("peak_above_resident_mib"),
                     "reserved": m.get("reserved_gib"), "retries": m.get("retries_in_window"),
                     "retries_built": built.get("retries_while_built")})
    lines += ["Memory (allocated delta: what the configuration added, warm-up included; peak and reserved: the whole "
              "process, every configuration's copy resident; retries: allocator cache flushes):", ""]
    lines += _fence(format_table(rows, [
        ("config", "config", "s"), ("status", "status", "s"), ("delta", "allocated delta MiB", ".1f"),
        ("peak", "peak GiB", ".2f"), ("above", "peak above resident MiB", ".1f"),
        ("reserved", "reserved GiB", ".2f"), ("retries", "retries (window)", "d"),
        ("retries_built", "retries (build)", "d")]))
    for c, p in probes.items():
        if p.get("error"):
            lines += [f"The probes of {c} raised:", "", *_fence(p["error"][-1500:])]
    rows = [{"config": c, "range": name, "inverse_step": str(p["phases"]["inverse_step"]), **t}
            for c, p in probes.items() if "phases" in p for name, t in p["phases"]["ranges"].items()]
    if rows:
        status = next(p["phases"]["status"] for p in probes.values() if "phases" in p)
        lines += [f"K-FAC phases, one profiled step ({status}; CUDA ms: kernels launched inside the range, nested "
                  "ranges included):", ""]
        lines += _fence(format_table(rows, [
            ("config", "config", "s"), ("range", "range", "s"), ("inverse_step", "inverse step", "s"),
            ("calls", "calls", "d"), ("cuda_ms", "CUDA ms", ".3f"), ("cpu_ms", "host ms", ".3f")]))
    return lines


def markdown(report: dict) -> str:
    lines = [f"# GPU check{' (dry run: CPU, tiny models, nothing timed means anything)' if report['dry'] else ''}",
             "", f"- device: {report['device']}", f"- torch {report['env']['torch']}, CUDA {report['cuda']}",
             f"- TF32 for the timings: {report['tf32']}",
             f"- started {report['started']}, {report['wall_s']:.0f} s in all (budget {report['budget_s']:.0f} s)",
             "", NCCL_LINE, "", f"(this check uses one GPU; {report['gpus']} visible)", ""]
    lines += ["## Targets", "", *_fence(format_table(report["targets"], [
        ("what", "target", "s"), ("ratio", "ratio", "s"), ("limit", "limit", ".2f"), ("value", "measured", ".3f"),
        ("verdict", "verdict", "s")]))]
    for name, sec in report["sections"].items():
        lines += [f"## {name}: {sec.get('status', '?')} ({sec.get('seconds', 0):.0f} s)", ""]
        if "lines" in sec:
            lines += _fence("\n".join(sec["lines"]))
        if "configs" in sec:
            rows = [{"config": c, **v} for c, v in sec["configs"].items()]
            lines += _fence(format_table(rows, [
                ("config", "config", "s"), ("median_ms", "median ms/step", ".2f"), ("q1_ms", "q1", ".2f"),
                ("q3_ms", "q3", ".2f"), ("blocks", "blocks", "d"), ("steps_per_block", "steps/block", "d"),
                ("final_loss", "final loss", ".3f")]))
            lines += [f"- {k}: {v:.3f}" for k, v in sec["ratios"].items()]
            lines += [f"- TF32: {_kv(sec['tf32'])}"] if sec.get("tf32") else []
            lines += [f"- note: {n}" for n in sec.get("notes", [])] + [""]
            lines += probe_tables(sec)
        if "table" in sec:
            lines += _fence(sec["table"])
        if "tests" in sec or "collected" in sec:
            lines += _fence(sec.get("output_tail", "")[-3000:])
            lines += [f"- skipped {s['test']}: {s['reason']}" for s in sec.get("skips", [])]
        if "error" in sec or "stderr_tail" in sec:
            lines += _fence((sec.get("error") or sec.get("stderr_tail", ""))[-3000:])
    return "\n".join(lines) + "\n"


def write_report(report: dict, out: str) -> None:
    report["targets"] = targets(report)
    write_json(os.path.join(out, "report.json"), report)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(markdown(report))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bench_parser(__doc__, quick=None, out="report folder (default: a fresh benchmarks/results/run-*-gpu_check/)")
    p.add_argument("--dry", action="store_true", help="tiny models on the CPU, tests collected only, the probes that "
                   "need CUDA reported as not available (what CI runs)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help="seconds for the whole run (default "
                   f"{DEFAULT_BUDGET:.0f}: the sections' budgets are scaled by budget/{DEFAULT_BUDGET:.0f})")
    sections = [s for s in BUDGETS if s != "smoke"]
    p.add_argument("--sections", default=",".join(sections), help="comma-separated subset of " + ",".join(sections)
                   + " (smoke always runs first)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per benchmark (fewer if out of time)")
    p.add_argument("--block-steps", type=int, default=10, help="steps per block (the defaults' blocks: 50)")
    p.add_argument("--tf32", choices=("off", "on"), default="off", help="TF32 for cuBLAS and cuDNN in the timed "
                   "sections (default off: float32 is float32)")
    p.add_argument("--wheels", default=None, metavar="DIR", help="install DIR/*.whl for this run only (pip "
                   "--no-index --no-deps --target a temporary folder put on the path)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip() and s.strip() != "smoke"]
    if any(s not in sections for s in args.sections):
        p.error(f"--sections: choose from {', '.join(sections)}")
    if args.wheels is not None and not os.path.isdir(args.wheels):
        p.error(f"--wheels {args.wheels}: not a folder")
    args.wheel_dir, args.wheel_rows = None, []
    return args


def section_budget(name: str, later: list[str], left: float, scale: float) -> float:
    """A section's time: its own share, plus the time earlier sections left unspent in proportion to its share
    against the sections after it (the tests often finish in half their budget; the benchmarks then get more
    timing rounds), never eating into the later sections' own shares. The whole run stays within --budget."""
    own = BUDGETS[name] * scale
    reserved = sum(BUDGETS[n] for n in later) * scale
    spare = max(0.0, left - 5 - own - reserved)
    return min(own + spare * own / (own + reserved), left - 5)


def run_section(name: str, args: argparse.Namespace, out: str, budget: float) -> dict:
    gone = missing(name)
    if gone:
        return {"status": f"skipped: needs {', '.join(gone)}, not installed here (add its wheel: --wheels DIR)"}
    if name == "smoke":
        return section_smoke(args, out, budget)
    if name == "tests":
        return section_tests(args, out, budget)
    if name == "overhead":
        return section_overhead(args, out, budget)
    return section_bench(name, args, out, budget)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child(args)
    try:
        if args.wheels is not None:
            args.wheel_dir, args.wheel_rows = install_wheels(args.wheels)
            sys.path.insert(2, args.wheel_dir)
            importlib.invalidate_caches()
        return run_all(args)
    finally:
        if args.wheel_dir is not None:
            shutil.rmtree(args.wheel_dir, ignore_errors=True)


def run_all(args: argparse.Namespace) -> int:
    cuda = torch.cuda.is_available()
    out = os.path.abspath(out_dir(args, "gpu_check" + ("_dry" if args.dry else "")))  # children run in REPO
    t_start = time.monotonic()
    report: dict = {
        "dry": args.dry, "device": (torch.cuda.get_device_name() if cuda and not args.dry
                                    else "cpu (dry run)" if args.dry else "none: no CUDA device"),
        "gpus": torch.cuda.device_count() if cuda else 0, "nccl_several_ranks": "not measured",
        "cuda": torch.version.cuda, "env": env_info(), "budget_s": args.budget, "tf32": args.tf32,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "sections": {}, "wall_s": 0.0,
    }
    scale = args.budget / DEFAULT_BUDGET
    order = ["smoke", *args.sections]
    try:
        for i, name in enumerate(order):
            left = args.budget - (time.monotonic() - t_start)
            budget = section_budget(name, order[i + 1:], left, scale)
            print(f"== {name} (budget {budget:.0f} s)", flush=True)
            if budget < 10 and name != "smoke":
                report["sections"][name] = {"status": "skipped: out of time", "seconds": 0.0}
                continue
            t0 = time.monotonic()
            try:
                sec = run_section(name, args, out, budget)
            except subprocess.TimeoutExpired as e:
                sec = {"status": f"failed: out of time after {e.timeout:.0f} s", "stderr_tail": _tail(e.stderr)}
            except Exception:
                sec = {"status": "failed", "error": traceback.format_exc()}
            sec["seconds"] = time.monotonic() - t0
            report["sections"][name] = sec
            print(f"   {sec['status']} in {sec['seconds']:.0f} s", flush=True)
            report["wall_s"] = time.monotonic() - t_start
            write_report(report, out)
            if name == "smoke" and not sec["status"].startswith("passed"):
                break  # no CUDA where it was needed, or the package does not import: nothing else can run
    finally:
        report["wall_s"] = time.monotonic() - t_start
        write_report(report, out)
    print(markdown(report))
    print(f"wrote {os.path.join(out, 'report.md')} and report.json")
    smoke = report["sections"]["smoke"]["status"]
    if not cuda and not args.dry:
        print(f"gpu-check: {smoke}", file=sys.stderr)
        return 2
    ok = all(s["status"] == "passed" or s["status"].startswith("skipped: needs")
             for s in report["sections"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
