"""K-FAC on models sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``): exact preconditioning of DTensor
gradients.

What FSDP2 changes for K-FAC (measured on 2 gloo ranks): each rank's forward hook sees the full-width input of its
local batch and the backward hook the full output gradient, so factor capture is unchanged; only the gradients
are DTensors sharded on dim 0 of each parameter (``Shard(0)`` on a 1-D mesh, rows split as ``torch.chunk`` splits
them: 4 and 3 rows of a 7-row layer), averaged over the mesh like DDP's.

The scheme (exact, lossless): :class:`FSDP2GradAccess` is the preconditioner's
:class:`~lightning_spdkfac.kfac.gradients.GradAccess` for such a model. ``open`` assembles each K-FAC layer's full
averaged gradient (weight rows and bias entries) from the shards, so the update is ``L^-1 grad R^-1`` of the whole
matrix whichever side (G of a Linear/conv, A of a transposed Conv1D or an embedding) lies on dim 0; ``close``
writes each rank's own rows of the preconditioned gradient back into its local shard (no communication). The
inverses are placed by the owner-based ``dpkfac`` schedule (factors reduced to a layer's owner, its inverses held
and applied there, P sent to the other ranks), so K-FAC state per rank is about 1/P. Every rank then holds every
layer's P and gradient, and the KL clip sums ``<P, g>`` over all layers, each once, as under DDP.

:func:`fsdp2_setup` turns it on at construction when the model holds DTensor parameters, and refuses with the fix
what K-FAC cannot read: FSDP1 (``FullyShardedDataParallel`` / ``FlatParameter``), a placement other than
``Shard(0)``, a mesh of more than one dimension (tensor parallel). :func:`refuse_late_sharding` refuses a model sharded
after the preconditioner was built.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .gradients import GradAccess

if TYPE_CHECKING:
    from .distributor import Distributor

log = logging.getLogger(__name__)

__all__ = ["FSDP2GradAccess", "refuse_late_sharding", "fsdp2_setup", "grad_sums", "is_dtensor"]

SETUP_MESSAGE = "FSDP2: exact sharded preconditioning, owner-based"
FIX = ("build the model with FSDP2 (torch.distributed.fsdp.fully_shard, or Lightning's ModelParallelStrategy with "
       "tensor_parallel_size=1) on a 1-D data-parallel mesh, then build KFACPreconditioner after fully_shard; or use "
       "DDP (SPDKFACStrategy)")


def summary_line(grad_access: GradAccess, format_bytes: Callable[[int], str]) -> str | None:
    """The summary's line on sharding (None: the model is not FSDP2-sharded)."""
    if not isinstance(grad_access, FSDP2GradAccess):
        return None
    held = grad_access.gathered_bytes
    return (f"{SETUP_MESSAGE} (factors and inverses on each layer's owner; each step assembles the K-FAC layers' "
            "full gradients from their dim-0 shards on every rank, "
            + (f"{format_bytes(held)} at the last step, " if held else "") + "and writes back each rank's rows)")


def is_dtensor(t: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(t, DTensor)


def _fsdp1_names(model: nn.Module) -> list[str]:
    """Modules wrapped by FSDP1 or holding its flat parameters."""
    found = []
    fsdp1: Any = None
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as fsdp1
    except ImportError:  # pragma: no cover
        pass
    for name, module in model.named_modules():
        if fsdp1 is not None and isinstance(module, fsdp1):
            found.append(name or "<model>")
    for name, p in model.named_parameters():
        if type(p).__name__ == "FlatParameter" or getattr(p, "_is_flat_param", False):
            found.append(name)
    return found


def fsdp2_setup(model: nn.Module, distributor: Distributor | None,
                grad_access: GradAccess | None) -> tuple[Distributor | None, GradAccess | None]:
    """The distributor and gradient access of a preconditioner over ``model``: unchanged for a model without DTensor
    parameters; for an FSDP2 model, :class:`FSDP2GradAccess` and (distributor None) the owner-based ``dpkfac``
    schedule over the mesh's process group. Raises, naming FSDP and the fix, for a sharding K-FAC cannot read."""
    fsdp1 = _fsdp1_names(model)
    if fsdp1:
        raise ValueError(
            f"K-FAC: the model is sharded with FSDP1 (FullyShardedDataParallel / FlatParameter: {', '.join(fsdp1[:3])}), "
            f"whose flattened gradients K-FAC cannot read as layer matrices; {FIX}")
    sharded = [(n, p) for n, p in model.named_parameters() if is_dtensor(p)]
    if not sharded:
        return distributor, grad_access
    from torch.distributed.tensor import Shard

    mesh = None
    for name, p in sharded:
        m = p.device_mesh  # type: ignore[attr-defined]
        if m.ndim != 1:
            raise ValueError(
                f"K-FAC: parameter {name!r} is a DTensor on a {m.ndim}-D device mesh {tuple(m.shape)} (tensor or "
                f"hybrid parallel): K-FAC's FSDP2 support reads a 1-D data-parallel mesh only; {FIX}")
        placements = tuple(p.placements)  # type: ignore[attr-defined]
        if placements != (Shard(0),):
            raise ValueError(
                f"K-FAC: parameter {name!r} is a DTensor with placements {placements}; K-FAC's FSDP2 support needs "
                f"parameters sharded on dim 0 (Shard(0), fully_shard's default; not a custom shard_placement_fn); {FIX}")
        if mesh is None:
            mesh = m
        elif m != mesh:
            raise ValueError(f"K-FAC: parameter {name!r} lives on another device mesh than the others; {FIX}")
    assert mesh is not None
    if grad_access is None:
        grad_access = FSDP2GradAccess()
    elif not isinstance(grad_access, FSDP2GradAccess):
        raise ValueError(f"K-FAC: the model is sharded with FSDP2 but grad_access is {type(grad_access).__name__}; "
                         "leave grad_access=None (FSDP2GradAccess is chosen)")
    group = mesh.get_group()
    if distributor is None and dist.get_world_size(group) > 1:
        from ..comm.dpkfac import DPKFACDistributor
        from ..comm.spd_options import SPDOptions

        # K-FAC's traffic in a group of its own (every rank creates it, in the same order: the preconditioner is built
        # on every rank), so that it does not queue with FSDP's all-gathers and reduce-scatters.
        kfac_group = dist.new_group(ranks=dist.get_process_group_ranks(group))
        distributor = DPKFACDistributor(SPDOptions.from_schedule("dpkfac"), process_group=kfac_group)
    log.info("%s (%d DTensor parameters on a %d-rank mesh)", SETUP_MESSAGE, len(sharded), mesh.size())
    return distributor, grad_access


def refuse_late_sharding(tensors: Iterable[torch.Tensor | None]) -> None:
    """Refuse DTensor gradients (or parameters) met by the plain gradient access: the model was sharded with
    fully_shard after the preconditioner was built (which chose the plain access)."""
    if any(is_dtensor(t) for t in tensors):
        raise RuntimeError("K-FAC: the model holds FSDP2 DTensor shards but the preconditioner was built for "
                           f"unsharded gradients: the model was sharded (fully_shard) after KFACPreconditioner was built; {FIX}")


class FSDP2GradAccess(GradAccess):
    """Full gradients of FSDP2 layers, assembled from their dim-0 shards; each rank's rows written back on close.

    ``open`` is collective (one all-gather per gradient dtype over the mesh, every shard padded to the largest
    one): every rank calls it with the same parameters in the same order. Between ``open`` and ``close`` every rank
    holds the full gradients of the K-FAC layers (``gathered_bytes``, shown by the summary).
    """

    def __init__(self) -> None:
        self._shards: dict[nn.Parameter, torch.Tensor] = {}
        self.gathered_bytes = 0  # the full gradients held during the last step

    def open(self, params: Sequence[torch.nn.Parameter]) -> dict[torch.nn.Parameter, torch.Tensor | None]:
        out: dict[torch.nn.Parameter, torch.Tensor | None] = {}
        self._shards = {}
        for p in params:
            g = p.grad
            if is_dtensor(g):
                self._shards[p] = g  # type: ignore[assignment]
                out[p] = None  # filled below
            elif g is not None and is_dtensor(p):
                raise RuntimeError("K-FAC: a DTensor parameter with a plain gradient; " + FIX)
            else:
                out[p] = g
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p, g in self._shards.items():
            by_dtype.setdefault(g.dtype, []).append(p)
        for ps in by_dtype.values():
            out.update(_gather_rows([self._shards[p] for p in ps], ps))
        self.gathered_bytes = sum(t.numel() * t.element_size() for p, t in out.items()
                                  if t is not None and p in self._shards)
        return out

    def close(self, grads: dict[torch.nn.Parameter, torch.Tensor | None]) -> None:
        for p, shard in self._shards.items():
            full = grads[p]
            assert full is not None
            mesh = shard.device_mesh  # type: ignore[attr-defined]
            local = shard.to_local()  # type: ignore[attr-defined]
            start, stop = _rows(full.shape[0], mesh.size(), mesh.get_local_rank())
            mine = full[start:stop]
            if mine.shape != local.shape:
                raise RuntimeError(f"K-FAC: a gradient shard of shape {tuple(local.shape)} is not the torch.chunk rows "
                                   f"{tuple(mine.shape)} of its {tuple(full.shape)} gradient; {FIX}")
            local.copy_(mine)
        self._shards = {}


def _rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """The rows [start, stop) of an n-row tensor that ``rank`` holds under Shard(0) (torch.chunk's split: ceil(n/P)
    rows each, the last ranks fewer or none)."""
    c = -(-n // world)
    return min(n, rank * c), min(n, (rank + 1) * c)


def _gather_rows(shards: list[torch.Tensor], params: list[nn.Parameter]) -> dict[nn.Parameter, torch.Tensor | None]:
    """The full tensors of Shard(0) DTensors of one dtype on one mesh, with one all-gather of padded shards."""
    mesh = shards[0].device_mesh  # type: ignore[attr-defined]
    world = mesh.size()
    shapes = [tuple(g.shape) for g in shards]  # global shapes
    row = [numel_of(s[1:]) for s in shapes]
    pad = [-(-s[0] // world) * r for s, r in zip(shapes, row)]  # the largest shard of each, in elements
    buf = torch.zeros(sum(pad), dtype=shards[0].dtype, device=shards[0].to_local().device)  # type: ignore[attr-defined]
    offset = 0
    for g, size in zip(shards, pad):
        local = g.to_local().reshape(-1)  # type: ignore[attr-defined]
        buf[offset:offset + local.numel()].copy_(local)
        offset += size
    parts = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(parts, buf, group=mesh.get_group())
    out: dict[nn.Parameter, torch.Tensor | None] = {}
    offset = 0
    for p, shape, size, r in zip(params, shapes, pad, row):
        pieces = []
        for k in range(world):
            start, stop = _rows(shape[0], world, k)
            pieces.append(parts[k][offset:offset + (stop - start) * r])
        out[p] = torch.cat(pieces).reshape(shape)
        offset += size
    return out


def numel_of(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def grad_sums(grads: Sequence[torch.Tensor], sum32: Any) -> list[torch.Tensor]:
    """One scalar per gradient, in order, non-finite exactly where it holds an inf or NaN on any rank: ``sum32`` of a
    plain gradient; the local sums of DTensor gradients all-reduced over their mesh in one collective (every rank
    calls this alike)."""
    out = [None if is_dtensor(g) else sum32(g) for g in grads]
    where = [i for i, g in enumerate(grads) if is_dtensor(g)]
    if where:
        local = torch.stack([sum32(grads[i].to_local()).float() for i in where])  # type: ignore[attr-defined]
        dist.all_reduce(local, group=grads[where[0]].device_mesh.get_group())  # type: ignore[attr-defined]
        for i, s in zip(where, local.unbind()):
            out[i] = s
    return out  # type: ignore[return-value]
