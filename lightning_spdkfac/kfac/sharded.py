"""K-FAC on models sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``): exact preconditioning of DTensor
gradients.

What FSDP2 changes for K-FAC (measured on 2 gloo ranks): each rank's forward hook sees the full-width input of its
local batch and the backward hook the full output gradient, so factor capture is unchanged; only the gradients
are DTensors sharded on dim 0 of each parameter (``Shard(0)`` on a 1-D mesh, rows split as ``torch.chunk`` splits
them: 4 and 3 rows of a 7-row layer), averaged over the mesh like DDP's.

The scheme (exact, lossless) is owner-based: the inverses are placed by the ``dpkfac`` schedule (factors reduced to
a layer's owner, inverted and applied there), so K-FAC state per rank is about 1/P. :class:`OwnerShardedAccess`
gathers each layer's row shards (weight rows and bias entries) to its owner only, the owner computes
``P = L^-1 g R^-1`` of the whole matrix whichever side (G of a Linear/conv, A of a transposed Conv1D or an embedding)
lies on dim 0, one all-reduce gives every rank each layer's ``<P, g>`` (the KL clip sums every layer once, in DDP's
order), and the clipped P's rows are scattered back into each rank's local shard (:func:`precondition_owned`).
Where every rank needs every P (grafting, a step-size rule) or a weight is shared by layers of different owners,
:class:`FSDP2GradAccess` assembles every full gradient on every rank instead (one all-gather), P travels as under
``dpkfac``, and each rank writes back its own rows: equally exact, more memory and traffic.

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

__all__ = ["FSDP2GradAccess", "OwnerShardedAccess", "free_foreign_accumulators", "frees_accumulators", "fsdp2_setup",
           "grad_sums", "is_dtensor", "lean_access", "precondition_owned", "refuse_late_sharding"]

SETUP_MESSAGE = "FSDP2: exact sharded preconditioning, owner-based"
FIX = ("build the model with FSDP2 (torch.distributed.fsdp.fully_shard, or Lightning's ModelParallelStrategy with "
       "tensor_parallel_size=1) on a 1-D data-parallel mesh, then build KFACPreconditioner after fully_shard; or use "
       "DDP (SPDKFACStrategy)")



def _dt(t: Any) -> Any:
    """A DTensor, untyped: torch's stubs type gradients and parameters as Tensor, which has no ``device_mesh``,
    ``placements`` or ``to_local`` (the contract test forbids ``type: ignore[attr-defined]`` in kfac/)."""
    return t

def summary_line(grad_access: GradAccess, format_bytes: Callable[[int], str]) -> str | None:
    """The summary's line on sharding (None: the model is not FSDP2-sharded)."""
    if not isinstance(grad_access, FSDP2GradAccess):
        return None
    held = grad_access.gathered_bytes
    if isinstance(grad_access, OwnerShardedAccess):
        how = ("factors, inverses and full gradients of each layer on its owner only: rows gathered to it, "
               "P's rows scattered back")
    else:
        how = ("factors and inverses on each layer's owner; every rank assembles every K-FAC layer's full gradient "
               "(grafting, a step-size rule or a weight shared across owners need it)")
    return f"{SETUP_MESSAGE} ({how}; full gradients held in a step: " + (
        f"{format_bytes(held)} at the last step)" if held else "none yet)")


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
        m = _dt(p).device_mesh
        if m.ndim != 1:
            raise ValueError(
                f"K-FAC: parameter {name!r} is a DTensor on a {m.ndim}-D device mesh {tuple(m.shape)} (tensor or "
                f"hybrid parallel): K-FAC's FSDP2 support reads a 1-D data-parallel mesh only; {FIX}")
        placements = tuple(_dt(p).placements)
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
            mesh = _dt(shard).device_mesh
            local = _dt(shard).to_local()
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
    mesh = _dt(shards[0]).device_mesh
    world = mesh.size()
    shapes = [tuple(g.shape) for g in shards]  # global shapes
    row = [numel_of(s[1:]) for s in shapes]
    pad = [-(-s[0] // world) * r for s, r in zip(shapes, row)]  # the largest shard of each, in elements
    buf = torch.zeros(sum(pad), dtype=shards[0].dtype, device=_dt(shards[0]).to_local().device)
    offset = 0
    for g, size in zip(shards, pad):
        local = _dt(g).to_local().reshape(-1)
        buf[offset:offset + local.numel()].copy_(local)
        offset += size
    parts = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(parts, buf, group=mesh.get_group())
    out: dict[nn.Parameter, torch.Tensor | None] = dict(_unpack(parts, params, world))
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
        local = torch.stack([sum32(_dt(grads[i]).to_local()).float() for i in where])
        dist.all_reduce(local, group=_dt(grads[where[0]]).device_mesh.get_group())
        for i, s in zip(where, local.unbind()):
            out[i] = s
    return out  # type: ignore[return-value]


# ----------------------------------------------------------------------------- the owner-based gradient path
class OwnerShardedAccess(FSDP2GradAccess):
    """The lean FSDP2 path: each K-FAC layer's row shards are gathered to its owner only (one ``dist.gather`` per
    owner and dtype), the owner preconditions the full gradient, and the rows of the clipped P go back to each rank's
    shard (one ``dist.scatter`` per owner and dtype, :func:`precondition_owned`). A rank holds the full gradients of
    its own layers only; the KL clip sums the owners' ``<P, g>`` with one all-reduce. The other layers' entries of
    ``open``'s result are the DTensor gradients themselves (read by nothing but the coverage check)."""

    def __init__(self, owner_of: dict[nn.Parameter, int], group: dist.ProcessGroup) -> None:
        super().__init__()
        self.owner_of = owner_of
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def open(self, params: Sequence[torch.nn.Parameter]) -> dict[torch.nn.Parameter, torch.Tensor | None]:
        out: dict[torch.nn.Parameter, torch.Tensor | None] = {p: p.grad for p in params}
        self._shards = {p: p.grad for p in params if is_dtensor(p.grad)}  # type: ignore[misc]
        for ps in _by_owner_and_dtype(list(self._shards), self._shards, self.owner_of):
            owner = self.owner_of[ps[0]]
            buf = _pack([_dt(self._shards[p]).to_local() for p in ps], ps, self.world, None)
            parts = [torch.empty_like(buf) for _ in range(self.world)] if owner == self.rank else None
            dist.gather(buf, parts, dst=dist.get_global_rank(self.group, owner), group=self.group)
            if parts is not None:
                out.update(_unpack(parts, ps, self.world))
        self.gathered_bytes = sum(t.numel() * t.element_size() for p, t in out.items()
                                  if t is not None and not is_dtensor(t) and p in self._shards)
        return out

    def close(self, grads: dict[torch.nn.Parameter, torch.Tensor | None]) -> None:
        """Nothing to write: precondition_owned wrote the preconditioned rows into the shards, and a layer left
        unpreconditioned keeps its shard as it was."""
        self._shards = {}


def _by_owner_and_dtype(params: list[nn.Parameter], grads: Any, owner_of: dict[nn.Parameter, int]
                        ) -> list[list[nn.Parameter]]:
    groups: dict[tuple[int, torch.dtype], list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault((owner_of[p], grads[p].dtype), []).append(p)
    return [groups[key] for key in sorted(groups, key=lambda kv: (kv[0], str(kv[1])))]


def _pack(locals_: list[torch.Tensor], params: list[nn.Parameter], world: int, _: None) -> torch.Tensor:
    """Local row shards, each padded to ceil(n/P) rows, in one flat buffer."""
    sizes = [-(-p.shape[0] // world) * numel_of(p.shape[1:]) for p in params]
    buf = torch.zeros(sum(sizes), dtype=locals_[0].dtype, device=locals_[0].device)
    offset = 0
    for t, size in zip(locals_, sizes):
        flat = t.reshape(-1)
        buf[offset:offset + flat.numel()].copy_(flat)
        offset += size
    return buf


def _unpack(parts: list[torch.Tensor], params: list[nn.Parameter], world: int) -> dict[nn.Parameter, torch.Tensor]:
    """The full tensors from every rank's packed shards."""
    out = {}
    offset = 0
    for p in params:
        shape, row = tuple(p.shape), numel_of(p.shape[1:])
        size = -(-shape[0] // world) * row
        pieces = []
        for k in range(world):
            start, stop = _rows(shape[0], world, k)
            pieces.append(parts[k][offset:offset + (stop - start) * row])
        out[p] = torch.cat(pieces).reshape(shape)
        offset += size
    return out


def lean_access(layers: Sequence[Any], owners: tuple[int, ...] | None, grad_access: GradAccess,
                options: Any, distributor: Any) -> GradAccess:
    """The owner-based gradient path where it applies (several ranks, owners known, no grafting or step-size rule,
    no parameter shared by layers of different owners); else ``grad_access`` as it is (every rank assembling every
    gradient, equally exact)."""
    if (type(grad_access) is not FSDP2GradAccess or owners is None or options.grafting is not None
            or options.step_size is not None or options.adapt_damping):
        return grad_access
    owner_of: dict[nn.Parameter, int] = {}
    for layer in layers:
        for p in layer.helper.params():
            if owner_of.setdefault(p, owners[layer.index]) != owners[layer.index]:
                return grad_access  # a tied weight owned twice
    group = getattr(distributor, "process_group", None)
    if group is None:  # the default group
        group = dist.group.WORLD
    if group is None or (owners and max(owners) >= dist.get_world_size(group)):
        return grad_access  # (owners that are not ranks of the group: every rank assembles every gradient)
    return OwnerShardedAccess(owner_of, group)


def frees_accumulators(grad_access: GradAccess) -> bool:
    """Whether the step drops the other ranks' layers' accumulators after their factors were reduced (the summary
    then counts them in the factor update's workspace, not between steps)."""
    return isinstance(grad_access, OwnerShardedAccess)


def free_foreign_accumulators(layers: Iterable[Any], access: OwnerShardedAccess) -> None:
    """Drop the step's sums (xx, dd, x_sum) of the layers another rank owns: their factors were reduced to the owner
    before the step preconditions, and the step forgets what was collected at its end; the next factor step's first
    call allocates them again and overwrites them (so the factors are bitwise those of keeping them). Between steps
    a rank then holds its own layers' K-FAC state only."""
    for layer in layers:
        params = layer.helper.params()
        if params and access.owner_of.get(params[0], access.rank) != access.rank:
            layer.xx = layer.dd = layer.x_sum = None


def guard_grad(access: GradAccess, grads: Any, p: nn.Parameter) -> torch.Tensor | None:
    """The gradient the non-finite guard checks for ``p``: under the owner-based path the DTensor shard on every rank
    (so every rank checks alike, summed over the mesh), else the tensor the step reads."""
    return p.grad if isinstance(access, OwnerShardedAccess) else grads.get(p)


def precondition_owned(part: Any, k: int) -> None:
    """The step's preconditioning under :class:`OwnerShardedAccess` (in place of ``Preconditioning.precondition``;
    ``part`` is that part): each owner computes P = L^-1 g R^-1 of its layers from their full gradients, one
    all-reduce gives every rank each layer's ``<P, g>`` and whether it was preconditioned, the KL scale is computed
    alike everywhere (the layer order and values of DDP's sum), and the scaled rows are scattered back into each
    rank's shards."""
    pre = part.core
    access: OwnerShardedAccess = pre.grad_access
    free_foreign_accumulators(pre.layers.values(), access)
    if not pre.grads_finite:  # (the guard's verdict is every rank's: it sums the shards over the mesh)
        return
    todo = [layer for layer in pre.layers.values()  # decided on what every rank sees alike
            if (part.stepping is None or layer.index in part.stepping) and layer.trainable()
            and all(p.grad is not None for p in layer.helper.params())]
    if not todo:
        return
    vec, precs = _precondition_mine(part, access, todo)
    dist.all_reduce(vec, group=access.group)
    n = len(todo)
    flags = (vec[n:] > 0.5).tolist()  # (one host read: which layers' rows are scattered decides the collectives)
    done = [layer for layer, flag in zip(todo, flags) if flag]
    if not done:
        return
    scale = None
    if pre.kl_clip is not None:  # the owners' p.g, in inv_dtype as DDP's sum takes them
        dots = [vec[i].to(pre.inv_dtype) for i, flag in enumerate(flags) if flag]
        scale = part.kl_scale(k, tuple(done), dots)
    for layer in done:  # the owner writes scale * P into the full gradients it gathered
        if layer.index in precs:
            layer.helper.write_grad(precs[layer.index], scale, pre.grads)
    _scatter_rows(pre, access, done)


def _precondition_mine(part: Any, access: OwnerShardedAccess,
                       todo: list[Any]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """P of the layers this rank owns (and has inverses for), and the ``[<P, g>..., preconditioned?...]`` vector of
    every layer of ``todo`` with this rank's entries filled (on the gradients' device: NCCL reduces device tensors)."""
    from .gradients import check_grad_shape

    pre = part.core
    first = todo[0].helper.params()[0].grad
    assert first is not None
    n = len(todo)
    vec = torch.zeros(2 * n, dtype=torch.float64, device=first.device)
    precs: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(todo):
        if access.owner_of[layer.helper.params()[0]] != access.rank or layer.A_inv is None:
            continue
        g = layer.helper.grad_matrix(pre.grads)
        check_grad_shape(layer, "gradient matrix", tuple(g.shape[-2:]), (layer.G_inv.shape[-1], layer.A_inv.shape[-1]))
        gi = g.to(pre.inv_dtype)
        p = part.direction(layer, gi)
        precs[layer.index] = p
        if pre.kl_clip is not None:
            vec[i] = torch.vdot(p.flatten(), gi.flatten()).double()
        vec[n + i].fill_(1.0)  # (a fill: setting a Python scalar into a CUDA tensor copies from the host)
    return vec, precs


def _scatter_rows(pre: Any, access: OwnerShardedAccess, done: list[Any]) -> None:
    """Each owner's rows of the scaled P back into every rank's gradient shards (one scatter per owner and dtype)."""
    params = list(dict.fromkeys(p for layer in done for p in layer.helper.params()))
    for ps in _by_owner_and_dtype(params, {p: p.grad for p in params}, access.owner_of):
        owner = access.owner_of[ps[0]]
        locals_ = [_dt(p.grad).to_local() for p in ps]
        recv = _pack(locals_, ps, access.world, None)
        sends = None
        if owner == access.rank:
            sends = []
            for r in range(access.world):
                rows = []
                for p in ps:
                    start, stop = _rows(p.shape[0], access.world, r)
                    rows.append(pre.grads[p][start:stop])
                sends.append(_pack(rows, ps, access.world, None))
        dist.scatter(recv, sends, src=dist.get_global_rank(access.group, owner), group=access.group)
        offset = 0
        for p, local in zip(ps, locals_):
            local.copy_(recv[offset:offset + local.numel()].reshape(local.shape))
            offset += -(-p.shape[0] // access.world) * numel_of(p.shape[1:])
