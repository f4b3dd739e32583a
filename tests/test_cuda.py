"""The CUDA paths, checked on a GPU: marker ``cuda`` (``pytest -m cuda``; ``make gpu-check`` runs them first).
Without CUDA every test here skips, saying so.

* asynchronous inverses on the side stream (``PendingInverses``) equal the one-step-stale dense reference,
  with a deliberately slow inversion (a matmul chain queued on the side stream before the inverses) and a
  slow training stream (a chain queued before ``step()``): a missing wait in either direction reads unfinished
  tensors;
* factor reductions and preconditioning with CUDA tensors under the D-KFAC / MPD-KFAC / SPD-KFAC (and
  DP-KFAC) schedules on a one-process NCCL group, and on two processes sharing the GPU over gloo (NCCL refuses
  two ranks on one device), against one process on the joint batch;
* DeepSpeed ZeRO-1/2 on one GPU with K-FAC equal to DDP with K-FAC;
* bf16 and fp16 autocast with float32 factors against float64 references of the captured 16-bit activations (their Gram
  sums on the tensor cores, float32 accumulation: factors.half_rows);
* ``KFACPreconditioner.state_bytes()`` against ``torch.cuda`` allocator deltas;
* no host synchronization in the forward/backward hooks: K-FAC steps at the defaults and every step with
  asynchronous inverses, their forward and backward under ``torch.cuda.set_sync_debug_mode("error")``.

References are built here, not by the library under test: dense float64 factors and inverses on the host
(tests/helpers/dense_reference.py) from the activations and output gradients captured by the tests' own hooks,
or a one-process run on the joint batch for the distributed ones. TF32 is turned off for these tests (cuDNN
allows it for convolutions by default), so float32 on the GPU is float32.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.dense_reference import (
    F64,
    Recorder,
    a_rows,
    assert_close,
    d_rows,
    damped_invs,
    grad_matrix,
    ref_precondition,
)
from helpers.training import sgd_kfac_steps
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.comm.dpkfac import DPKFACDistributor
from lightning_spdkfac.comm.scheduler import SPDDistributor, SPDOptions
from lightning_spdkfac.kfac.distributor import Distributor
from lightning_spdkfac.multiprocess import free_port, run_distributed

NO_CUDA = "torch.cuda.is_available() is False: no CUDA device here (make gpu-check runs these where there is one)"
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]

# The slow work that exposes a missing stream wait: CHAIN_LINKS matmuls of CHAIN_SIDE^2 float32 matrices
# (~2 TFLOP: tens of milliseconds on an H100, while the tiny models' own kernels take microseconds).
CHAIN_SIDE, CHAIN_LINKS = 4096, 16


@pytest.fixture
def cuda(monkeypatch):
    """The GPU, with TF32 off (restored afterwards) and the allocator's caches emptied before and after."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    gc.collect()
    torch.cuda.empty_cache()
    yield torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()


def matmul_chain(device: torch.device) -> torch.Tensor:
    """A 0-dim zero queued on the current stream behind CHAIN_LINKS large matmuls: adding it to a tensor makes
    that tensor complete only once the chain is."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(CHAIN_SIDE, CHAIN_SIDE, device=device, generator=g) / CHAIN_SIDE**0.5
    y = x
    for _ in range(CHAIN_LINKS):
        y = torch.tanh(y @ x)  # bounded: the sum below is finite, so times 0 it is 0
    return y.sum() * 0


class HostRecorder(Recorder):
    """The dense reference's recorder for a model on the GPU: captures are copied to the host, and ``modules``
    are host copies of the layers (the tests that use it never change the weights)."""

    def __init__(self, model: nn.Module, names: list[str]):
        super().__init__(model, names)
        self.modules = {n: copy.deepcopy(m).cpu() for n, m in self.modules.items()}

    def _hook(self, name):
        def hook(module, inputs, output):
            self.inputs[name].append(inputs[0].detach().cpu())
            self.outputs[name].append(output.detach().cpu())
            output.register_hook(lambda g: self.gouts[name].append(g.detach().cpu()))

        return hook


def host_factors(rec: HostRecorder, name: str, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A and G (float64, host) of the step's one call of layer ``name`` (the spec of tests/test_reference.py)."""
    m = rec.modules[name]
    (x,), (out,), (g,) = rec.inputs[name], rec.outputs[name], rec.gouts[name]
    a = a_rows(m, x, out if check else None)
    d = d_rows(m, g)
    return a.T @ a / a.shape[0], x.shape[0] * (d.T @ d)


def small_net(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(),  # 2x6x6 -> 3x3x3
        nn.Linear(27, 6), nn.ReLU(), nn.Linear(6, 4),
    ).to(dtype)


LAYERS = ["0", "3", "5"]


def sq_loss(out: torch.Tensor) -> torch.Tensor:
    return (0.5 * out.pow(2) + 0.1 * out).sum(dim=-1).mean()


# ----------------------------------------------------------------------------- 1. async inverses, side stream


class SlowSideStream(Distributor):
    """One process; each asynchronous inversion queues a matmul chain on the stream it runs on before its
    inverses, and the inverses returned are only complete once that chain is. Records the streams used."""

    is_local = True

    def __init__(self) -> None:
        self.streams: list[torch.cuda.Stream] = []

    def invert_async(self, tasks, invert_fn):
        def slow(ts):
            self.streams.append(torch.cuda.current_stream())
            late = matmul_chain(ts[0][2].device)
            return [inv + late for inv in invert_fn(ts)]

        return super().invert_async(tasks, slow)


def _damping_at(k):
    return 0.02 * (k + 1)


@pytest.mark.parametrize("inv_update_steps", [1, 3])
def test_async_inverses_on_the_side_stream_equal_the_one_step_stale_reference(cuda, inv_update_steps):
    tol = 1e-8
    torch.manual_seed(4)
    model = small_net(F64).to(cuda)
    slow = SlowSideStream()
    kl_clip, lr = 1e-4, 0.1
    pre = KFACPreconditioner(model, distributor=slow, damping=_damping_at, factor_decay=0.5, kl_clip=kl_clip,
                             lr=lr, factor_update_steps=1, inv_update_steps=inv_update_steps,
                             factor_approx="expand", factor_dtype=F64, inv_dtype=F64, async_inverses=True)
    rec = HostRecorder(model, LAYERS)
    cuda_modules = dict(model.named_modules())
    running: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    in_use = launched = None
    launches = 0
    for k in range(6):
        x = (torch.randn(4 + k, 2, 6, 6, dtype=F64) * (1 + k)).to(cuda)
        model.zero_grad(set_to_none=True)
        rec.clear()
        sq_loss(model(x)).backward()
        grads = {n: grad_matrix(cuda_modules[n]).cpu() for n in LAYERS}
        matmul_chain(cuda)  # the training stream is busy: step()'s factor updates queue behind this
        pre.step()
        for n in LAYERS:
            A_new, G_new = host_factors(rec, n)
            running[n] = (A_new, G_new) if k == 0 else (0.5 * running[n][0] + 0.5 * A_new,
                                                        0.5 * running[n][1] + 0.5 * G_new)
        if launched is not None:  # swapped in at the start of this step
            in_use, launched = launched, None
        snapshot = ({n: running[n] for n in LAYERS}, _damping_at(k))
        if k == 0:
            in_use = snapshot  # a layer's first inverses: computed at once, on the training stream
        elif k % inv_update_steps == 0:
            launched = snapshot  # inverted on the side stream; this step still uses the previous ones
            launches += 1
        src, damping = in_use
        A_invs, G_invs = zip(*(damped_invs(*src[n], damping) for n in LAYERS))
        P, _ = ref_precondition([grads[n] for n in LAYERS], A_invs, G_invs, kl_clip, lr)
        for n, p in zip(LAYERS, P, strict=True):
            assert_close(grad_matrix(cuda_modules[n]).cpu(), p, tol)
    pre.step()  # one more (no backward: nothing collected) swaps in the last launch
    src, damping = launched if launched is not None else in_use
    for n in LAYERS:
        A_inv, G_inv = damped_invs(*src[n], damping)
        assert pre.layers[n].A_inv.device == cuda
        assert_close(pre.layers[n].A_inv.cpu(), A_inv, tol)
        assert_close(pre.layers[n].G_inv.cpu(), G_inv, tol)
    default = torch.cuda.default_stream(cuda)
    # (step 6, the extra one, is an inverse step too: it launched one more round, dropped by remove_hooks)
    assert len(slow.streams) == launches + 1 and launches > 0
    assert all(s != default for s in slow.streams), "the asynchronous inversions ran on the training stream"
    pre.remove_hooks()
    rec.remove()


# ----------------------------------------------------------------------------- 2. schedules with CUDA tensors

STEPS, BATCH = 5, 8  # per-rank batch
KFAC_KW = dict(damping=0.05, kl_clip=1e-2, lr=0.1, factor_update_steps=1, inv_update_steps=2)
SCHEDULES = {
    "dkfac": dict(schedule="dkfac"),
    "mpd": dict(schedule="mpd"),
    "spd": dict(schedule="spd", profile_steps=(1, 3)),
    "spd_async": dict(schedule="spd", profile_steps=(1, 3), async_inverses=True),
    "dpkfac": dict(schedule="dpkfac", profile_steps=(1, 3)),
}
# gloo runs all-reduces and broadcasts of CUDA tensors, not dist.reduce (which DP-KFAC's factors use).
GLOO_SCHEDULES = ("dkfac", "mpd", "spd", "spd_async")


def dist_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 24), nn.Tanh(), nn.Linear(24, 5),
    )


def cuda_data(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH * world, 2, 8, 8, generator=g)
    y = torch.randint(0, 5, (BATCH * world,), generator=g)
    return x.cuda(), y.cuda()


def train_schedule(rank: int, world: int, name: str) -> tuple[list[torch.Tensor], dict]:
    """One schedule's training on this rank (a DDP module on the GPU); parameters (host) and facts."""
    model = dist_net().cuda()
    device = next(model.parameters()).device
    options = SPDOptions.from_schedule(**SCHEDULES[name])
    kind = DPKFACDistributor if name == "dpkfac" else SPDDistributor
    distributor = kind(options, process_group=dist.new_group(), device=device)
    pre = KFACPreconditioner(model, distributor=distributor, **KFAC_KW)
    sgd_kfac_steps(DDP(model, device_ids=[device.index]), pre, cuda_data, STEPS, world, rank, BATCH)
    held = [t for ly in pre.layers.values() for t in (ly.A, ly.A_inv) if t is not None]
    facts = {"backend": dist.get_backend(), "state_on_cuda": bool(held) and all(t.is_cuda for t in held),
             "skipped": pre.skipped_factor_steps + pre.skipped_precondition_steps}
    pre.remove_hooks()
    return [p.detach().cpu() for p in model.parameters()], facts


def _no_tf32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def train_all_on_rank(rank: int, world: int, names: list[str]) -> dict:
    """A rank of the two-process job: every schedule in turn, on the one GPU both ranks share."""
    warnings.filterwarnings("ignore")
    torch.cuda.set_device(0)
    _no_tf32()
    return {name: train_schedule(rank, world, name) for name in names}


def one_process_reference(world: int, name: str) -> list[torch.Tensor]:
    """The schedule's run on one process: the same preconditioning, with the one-step-stale inverses of an
    asynchronous schedule where ``name`` has ``async_inverses`` (on CUDA they run on a side stream and are
    swapped in at the next step, on one process as on several)."""
    model = dist_net().cuda()
    async_inverses = SCHEDULES[name].get("async_inverses", False)
    sgd_kfac_steps(model, KFACPreconditioner(model, async_inverses=async_inverses, **KFAC_KW), cuda_data, STEPS,
                   world)
    return [p.detach().cpu() for p in model.parameters()]


def _close(got, ref, what):
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=what)


@pytest.fixture
def nccl_group(cuda):
    """A one-process NCCL default group (destroyed after the test by conftest's fixture)."""
    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    torch.cuda.set_device(cuda)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_on_a_one_process_nccl_group_equals_the_local_run(nccl_group, name):
    params, facts = train_schedule(0, 1, name)
    assert facts == {"backend": "nccl", "state_on_cuda": True, "skipped": 0}
    dist.destroy_process_group()  # the reference runs without any process group
    _close(params, one_process_reference(1, name), f"{name} on NCCL vs one process")


def test_schedules_on_two_processes_sharing_the_gpu_equal_one_process(cuda):
    """gloo with CUDA tensors: NCCL refuses two ranks on one device ("Duplicate GPU detected")."""
    names = list(GLOO_SCHEDULES)
    results = run_distributed(train_all_on_rank, 2, names, timeout=300, start_method="spawn")
    for name in names:
        (p0, f0), (p1, f1) = results[0][name], results[1][name]
        assert f0 == f1 == {"backend": "gloo", "state_on_cuda": True, "skipped": 0}, name
        for a, b in zip(p0, p1, strict=True):
            assert torch.equal(a, b), f"{name}: the replicas differ"
        _close(p0, one_process_reference(2, name), f"{name} on 2 processes vs one process")


# ----------------------------------------------------------------------------- 3. DeepSpeed ZeRO on one GPU

DS_STEPS = 6


def lightning_fit(rank: int, world: int, stage: int | None) -> dict:
    """One process, one GPU: a Trainer fit with K-FAC under SPDKFACStrategy (stage None: DDP) or
    SPDKFACDeepSpeedStrategy (ZeRO ``stage``)."""
    from helpers.lightning_models import KW, TinyInterleaved, trainer

    from lightning_spdkfac import KFAC, SPDKFACDeepSpeedStrategy, SPDKFACStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    warnings.filterwarnings("ignore")
    torch.cuda.set_device(0)
    _no_tf32()
    model = TinyInterleaved(batch_size=4)
    if stage is None:
        strategy = SPDKFACStrategy(schedule="spd", profile_steps=(1, 3))
    else:
        strategy = SPDKFACDeepSpeedStrategy(stage=stage, profile_steps=(1, 3), logging_batch_size_per_gpu=4)
    cb = KFAC(**KW)
    t = trainer(accelerator="gpu", max_steps=DS_STEPS, devices=world, strategy=strategy, callbacks=[cb],
                use_distributed_sampler=False)
    t.fit(model)
    state = cb.state_dict()  # (the preconditioner itself is released when the fit ends; its state is kept)
    engine = getattr(t.strategy, "deepspeed_engine", None)
    return dict(
        params=[p.detach().float().cpu() for p in model.net.parameters()],
        kfac_steps=state["steps"],
        factors_on_cuda=bool(state["layers"]) and all(ly["A"].is_cuda for ly in state["layers"].values()),
        optimizer=type(engine.optimizer).__name__ if engine is not None else None,
    )


@pytest.fixture(scope="module")
def ddp_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    pytest.importorskip("deepspeed")  # (before the DDP reference, which only the DeepSpeed tests use)
    pytest.importorskip("pytorch_lightning")
    return run_distributed(lightning_fit, 1, None, timeout=300, backend="nccl", start_method="spawn")[0]


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_zero_on_one_gpu_equals_ddp(cuda, stage, ddp_on_gpu):
    pytest.importorskip("deepspeed")
    got = run_distributed(lightning_fit, 1, stage, timeout=300, backend="nccl", start_method="spawn")[0]
    assert got["optimizer"] == "DeepSpeedZeroOptimizer"
    assert got["kfac_steps"] == ddp_on_gpu["kfac_steps"] == DS_STEPS
    assert got["factors_on_cuda"] and ddp_on_gpu["factors_on_cuda"]
    for a, b in zip(got["params"], ddp_on_gpu["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- 4. bf16 autocast


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_rows_go_into_float32_grams_on_the_tensor_cores(cuda, dtype):
    """factors.gram with 16-bit rows into float32 (the path autocast takes) against the float64 Gram of the same
    numbers. The products are exact in float32 and the sums float32, but the tensor cores add in their own order and
    blocks: on an H200 the largest error was 3.2e-6 (bf16) and 6.6e-6 (fp16) of the largest entry for one Gram
    (torch.mm), 2.3e-5 for fp16 groups (torch.bmm), against 5e-7 and 3e-6 for float32 GEMMs of the rows cast first;
    the bound is 1e-4 (the statistical noise in a factor, and its damping, are orders of magnitude larger)."""
    from lightning_spdkfac.kfac import factors

    if not factors.mixed_gemm("cuda"):
        pytest.skip(f"torch {torch.__version__} has no torch.mm(..., out_dtype=float32) for 16-bit CUDA matrices")
    torch.manual_seed(0)
    rows = (torch.randn(4096, 384, device=cuda) * torch.linspace(0.1, 3, 384, device=cuda)).to(dtype)
    ref = rows.double().T @ rows.double()
    for shape in [(384, 384), (3, 128, 128)]:
        acc = torch.empty(shape, device=cuda)
        fp32 = torch.empty(shape, device=cuda)
        for first in (True, False):  # a first call, then one more added
            factors.gram(acc, rows, shape, first)
            factors.gram(fp32, rows.float(), shape, first)
        want = 2 * (ref if len(shape) == 2 else torch.stack([ref[i * 128:(i + 1) * 128, i * 128:(i + 1) * 128]
                                                            for i in range(3)]))
        assert acc.dtype == torch.float32
        err, err32 = (acc.double() - want).abs().max().item(), (fp32.double() - want).abs().max().item()
        assert err <= 1e-4 * want.abs().max().item(), (shape, err, err32, want.abs().max().item())
    sums = factors.column_sums(rows, (384, 384))
    assert sums.dtype == torch.float32
    torch.testing.assert_close(sums.double(), rows.double().sum(0), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_autocast_keeps_float32_factors_equal_to_the_reference(cuda, dtype):
    torch.manual_seed(5)
    model = small_net(torch.float32).to(cuda)
    damping = 0.1
    pre = KFACPreconditioner(model, damping=damping, kl_clip=None, factor_update_steps=1, inv_update_steps=1,
                             factor_approx="expand")
    rec = HostRecorder(model, LAYERS)
    cuda_modules = dict(model.named_modules())
    x = torch.randn(16, 2, 6, 6).to(cuda)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=dtype):
        loss = sq_loss(model(x))
    loss.float().backward()
    grads = {n: grad_matrix(cuda_modules[n]).cpu() for n in LAYERS}
    pre.step()
    # The path is the mixed-precision one: the layers ran in bf16, their gradients (fp32 weights) are fp32.
    assert all(rec.outputs[n][0].dtype == dtype for n in LAYERS)
    assert all(rec.gouts[n][0].dtype == dtype for n in LAYERS)
    for n in LAYERS:
        A, G = host_factors(rec, n, check=False)  # (from the bf16 activations and output gradients themselves)
        ly = pre.layers[n]
        assert ly.A.dtype == ly.G.dtype == ly.A_inv.dtype == torch.float32 and ly.A.is_cuda
        assert_close(ly.A.cpu(), A, 1e-4)
        assert_close(ly.G.cpu(), G, 1e-4)
        A_inv, G_inv = damped_invs(A, G, damping)
        assert_close(ly.A_inv.cpu(), A_inv, 1e-3)
        assert_close(ly.G_inv.cpu(), G_inv, 1e-3)
        P, _ = ref_precondition([grads[n]], [A_inv], [G_inv], None, None)
        assert_close(grad_matrix(cuda_modules[n]).cpu(), P[0], 2e-3)
        assert cuda_modules[n].weight.grad.dtype == torch.float32
    pre.remove_hooks()
    rec.remove()


# ----------------------------------------------------------------------------- 5. memory

MEM_WIDTH, MEM_BATCH = 1024, 32


def mem_net() -> nn.Sequential:
    torch.manual_seed(0)
    w = MEM_WIDTH
    return nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10))


def _train_and_measure(device: torch.device, kfac: bool) -> tuple[int, int, KFACPreconditioner | None]:
    """(resident bytes after 3 steps, peak bytes during them) above what was allocated before, and the
    preconditioner (kept alive, so that its state is resident when measured)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    model = mem_net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1) if kfac else None
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(MEM_BATCH, MEM_WIDTH, generator=g).to(device)
        y = torch.randint(0, 10, (MEM_BATCH,), generator=g).to(device)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        if pre is not None:
            pre.step(opt)
        opt.step()
    del x, y
    torch.cuda.synchronize(device)
    resident = torch.cuda.memory_allocated(device) - base
    peak = torch.cuda.max_memory_allocated(device) - base
    return resident, peak, pre


def test_state_bytes_is_what_the_gpu_allocator_holds_for_kfac(cuda):
    w, out = MEM_WIDTH, 10
    sides = [(w + 1, w), (w + 1, w), (w + 1, out)]  # (A, G) of each Linear, the bias row in A
    factors = sum(a * a + g * g for a, g in sides) * 4  # float32
    accumulators = sum((a - 1) * (a - 1) + (a - 1) + g * g for a, g in sides) * 4  # x x^T, x sum, d d^T
    _train_and_measure(cuda, kfac=True)  # unmeasured: the cuBLAS / cuSOLVER handles and workspaces are made now
    sgd_resident, sgd_peak, _ = _train_and_measure(cuda, kfac=False)
    kfac_resident, kfac_peak, pre = _train_and_measure(cuda, kfac=True)
    assert pre is not None
    state = pre.state_bytes()
    assert state == 2 * factors  # the running factors and their inverses, by the layers' shapes
    slack = 1 << 20  # allocator rounding (512-byte blocks) and K-FAC's few scalars
    # Resident after the steps: the state, plus the per-step accumulators the hooks reuse, and nothing else.
    assert state <= kfac_resident - sgd_resident <= state + accumulators + slack
    # At the peak the state is held on top of everything SGD needs; what K-FAC adds beyond the state and the
    # accumulators is transient: the new inverses of an inverse step (computed before the old ones are
    # replaced: one more set of factors) and one factor's damped copy, Cholesky factor and masks at a time.
    largest = max(max(a, g) ** 2 for a, g in sides) * 4
    assert state <= kfac_peak - sgd_peak <= state + accumulators + factors + 4 * largest + slack
    pre.remove_hooks()


# ----------------------------------------------------------------------------- 6. no host sync in the hooks


@contextlib.contextmanager
def sync_debug(mode: str):
    """``torch.cuda.set_sync_debug_mode(mode)`` for the block (process-wide: every thread), then as before."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


HOOK_CONFIGS = {
    "defaults": {},  # factors every 5 steps, inverses every 50, the lr read from the optimizer (KL clip)
    "every_step_async": dict(factor_update_steps=1, inv_update_steps=1, async_inverses=True),
}


@pytest.mark.parametrize("config", list(HOOK_CONFIGS))
def test_no_host_sync_in_the_forward_and_backward_hooks(cuda, config):
    """Every step after the first (which sets up: first inverses, cuBLAS handles) runs its forward and backward,
    where K-FAC's hooks collect the factor statistics, under ``set_sync_debug_mode("error")``: a device-to-host
    read or a blocking host-to-device copy there raises. At the defaults the window holds a factor step (step 5)
    and steps whose hooks collect nothing; every step with async inverses, each window is a factor step with the
    previous step's inversions in flight on the side stream (the mode is process-wide: the inverse worker must not
    read the host either, it only computes). ``step()`` and ``optimizer.step()`` run outside the window."""
    torch.manual_seed(0)
    model = dist_net().to(cuda)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    pre = KFACPreconditioner(model, **HOOK_CONFIGS[config])
    g = torch.Generator().manual_seed(3)
    steps = 7
    batches = [(torch.randn(BATCH, 2, 8, 8, generator=g).to(cuda), torch.randint(0, 5, (BATCH,), generator=g).to(cuda))
               for _ in range(steps)]  # copied to the GPU before any window
    torch.cuda.synchronize()
    for k, (x, y) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        with sync_debug("error") if k > 0 else contextlib.nullcontext():
            F.cross_entropy(model(x), y).backward()
        pre.step(opt)
        opt.step()
    torch.cuda.synchronize()
    assert pre.steps == steps and pre.skipped_factor_steps == 0
    assert all(ly.A is not None and ly.A.is_cuda for ly in pre.layers.values())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    pre.remove_hooks()
