"""The reduced gradients of a DeepSpeed engine at ZeRO stage 0, 1 or 2, for K-FAC: :class:`DeepSpeedGradAccess`
(the :class:`~lightning_spdkfac.kfac.gradients.GradAccess` of ``SPDKFACDeepSpeedStrategy``).

Where the reduced gradients live:

- ZeRO 0 (fp32): ``param.grad``, averaged by the engine, rewritten in place.
- ZeRO 1/2 and DeepSpeed's bf16 optimizer: ``param.grad`` is None; each rank holds the averaged
  gradient of its partition as fragments of a flat fp32 buffer, which the optimizer reads.
  :class:`DeepSpeedGradAccess` assembles the full gradients of the K-FAC layers with **one**
  all-gather of the partitions (on gloo, one broadcast per rank): each rank sends the elements it
  owns once, half the bytes of an all-reduce. (The public ``deepspeed.utils.safe_get_full_grad``
  all-reduces a zero-padded full gradient once per parameter, i.e. two collectives per layer; the
  result is bitwise the same.) It writes the preconditioned gradient back with ``set_full_hp_grad``,
  which copies only this rank's fragment (no communication).
  Where the engine's internals differ from what that fused path expects, it falls back to
  ``safe_get_full_grad`` / ``safe_set_full_grad`` parameter by parameter.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeGuard

import torch
import torch.distributed as dist

from ..kfac.gradients import GradAccess

if TYPE_CHECKING:
    import deepspeed

    class _ZeroParameter(torch.nn.Parameter):
        """A parameter as DeepSpeed's ZeRO 1/2 and bf16 optimizers leave it: what they attach to it."""

        _hp_mapping: Any  # its deepspeed.utils.tensor_fragment; None outside this rank's partition
        _index_in_param_group: int
        _dp_group: dist.ProcessGroup

        def set_full_hp_grad(self, value: torch.Tensor) -> None: ...


__all__ = ["DeepSpeedGradAccess"]


class DeepSpeedGradAccess(GradAccess):
    """Reduced gradients of a DeepSpeed engine at ZeRO stage 0, 1 or 2 (see the module docstring).

    ``open`` is collective: every rank calls it with the same parameters in the same order,
    between the engine's backward and its step.
    """

    def __init__(self, engine_fn: Callable[[], deepspeed.DeepSpeedEngine], fused: bool = True) -> None:
        self._engine_fn = engine_fn  # the engine exists only after the strategy's setup
        self.fused = fused
        self._fragments: list[_ZeroParameter] = []
        self._fused_path = False  # which path open() took, so close() writes back the same way
        # (the engine's optimizer, the parameters, their partition layout) of the last fused gather
        self._plan_cache: tuple[weakref.ref, tuple[weakref.ref, ...], _GatherPlan | None] | None = None

    @property
    def engine(self) -> deepspeed.DeepSpeedEngine:
        return self._engine_fn()

    def loss_scale(self) -> float:
        engine = self.engine
        if not engine.fp16_enabled():
            return 1.0
        opt = engine.optimizer
        scale: Any = getattr(opt, "cur_scale", None)
        if scale is None:
            scale = getattr(opt, "loss_scale", 1.0)
        return float(scale)

    @staticmethod
    def _partitioned(p: torch.nn.Parameter) -> TypeGuard[_ZeroParameter]:
        """Does the optimizer read this parameter's gradient from its fp32 fragments?"""
        if hasattr(p, "ds_id"):
            raise RuntimeError("a ZeRO stage 3 (partitioned) parameter: its gradients are read by DeepSpeedZero3GradAccess, "
                               "which SPDKFACDeepSpeedStrategy(stage=3) uses")
        return getattr(p, "_hp_grad", None) is not None or (p.grad is None and hasattr(p, "_hp_mapping"))

    def open(self, params: Sequence[torch.nn.Parameter]) -> dict[torch.nn.Parameter, torch.Tensor | None]:
        frag = [p for p in params if self._partitioned(p)]
        frag_ids = {id(p) for p in frag}
        grads = {p: None if id(p) in frag_ids else p.grad for p in params}
        fused = self._gather_fused(frag) if frag and self.fused and _fusable(frag) else None
        self._fused_path = fused is not None
        if frag:
            grads.update(fused if fused is not None else self._gather_each(frag))
        self._fragments = frag
        return grads

    @staticmethod
    def _gather_each(params: list[_ZeroParameter]) -> dict[torch.nn.Parameter, torch.Tensor | None]:
        from deepspeed.utils import safe_get_full_grad

        return {p: safe_get_full_grad(p) for p in params}

    def _gather_fused(
        self, params: list[_ZeroParameter], plan: _GatherPlan | None = None
    ) -> dict[torch.nn.Parameter, torch.Tensor | None] | None:
        """Full fp32 gradients of ``params`` with one all-gather of the partitions (see :func:`_gather_partitions`);
        None (on every rank) where the partitions do not tile the parameters. Collective.

        The layout of the partitions is exchanged once per engine and list of parameters, then reused.
        """
        if plan is None:
            plan = self._cached_plan(params)
        return _gather_partitions(params, plan)

    def _cached_plan(self, params: list[_ZeroParameter]) -> _GatherPlan | None:
        # Keyed by identity (weak references, so that an id cannot be reused by another object): every rank
        # calls open() with the same parameters of the same engine, so every rank hits or misses alike, and a
        # new engine (a new fit, a restored checkpoint's relinked optimizer) exchanges its layout again.
        optimizer = getattr(self.engine, "optimizer", None)
        cached = self._plan_cache
        if (cached is not None and cached[0]() is optimizer and len(cached[1]) == len(params)
                and all(ref() is p for ref, p in zip(cached[1], params))):
            return cached[2]
        plan = _exchange_plan(params)
        try:
            self._plan_cache = (weakref.ref(optimizer), tuple(weakref.ref(p) for p in params), plan)
        except TypeError:  # an optimizer without weak references: exchange the layout on every call
            self._plan_cache = None
        return plan

    def close(self, grads: dict[torch.nn.Parameter, torch.Tensor | None]) -> None:
        frag, self._fragments = self._fragments, []
        if not frag:
            return
        if self._fused_path:
            self._scatter(frag, grads)
            return
        from deepspeed.utils import safe_set_full_grad

        for p in frag:
            value = grads.get(p)
            if value is None:
                continue
            if getattr(p, "_hp_grad", None) is not None:
                # safe_set_full_grad would write the bf16 optimizer's low-precision staging gradient,
                # which its step no longer reads, and set_full_hp_grad rejects its full-size fp32
                # buffer when the parameter straddles two partitions: write what the step reads.
                if _fusable([p]):
                    self._scatter([p], grads)
                else:
                    p.set_full_hp_grad(value)
            else:
                safe_set_full_grad(p, value)

    @staticmethod
    def _scatter(params: list[_ZeroParameter], grads: dict[torch.nn.Parameter, torch.Tensor | None]) -> None:
        """Copy this rank's fragment of each full gradient back (local; the inverse of the fused gather).

        ``set_full_hp_grad`` does this too, but fails where the fragment is a full-size buffer
        (the bf16 optimizer's fp32 accumulation buffer, when a parameter straddles two partitions).
        """
        for p in params:
            mapping, value = p._hp_mapping, grads.get(p)
            if mapping is None or value is None:
                continue
            fragment = mapping.get_lp_grad_fragment(p._index_in_param_group)
            flat = value.reshape(-1)
            if fragment.numel() != p.numel():
                address = mapping.lp_fragment_address
                flat = flat.narrow(0, address.start, address.numel)
            fragment.data.copy_(flat.view_as(fragment))
            if hasattr(p, "_zero_optimizer"):  # CPU offload tracks overflow of what is written
                p._zero_optimizer.update_offload_overflow_tracker(value)


class _GatherPlan(NamedTuple):
    """How the fused gather moves the partitions of a list of parameters (the same on every rank but ``owned``)."""

    owned: tuple[tuple[int, int], ...]  # this rank's (start, numel) in each parameter; (0, 0) where it owns none
    chunk: int  # elements each rank sends: the largest share, the smaller ones zero-padded to it
    runs: tuple[tuple[int, int], ...]  # (offset, length) in the gathered buffer; concatenated: the full gradients


def _owned(params: Sequence[_ZeroParameter]) -> tuple[tuple[int, int], ...]:
    """This rank's (start, numel) in each parameter (the ``lp_fragment_address`` of its mapping); (0, 0): none."""
    owned = []
    for p in params:
        mapping = p._hp_mapping
        address = None if mapping is None else mapping.lp_fragment_address
        owned.append((0, 0) if address is None or address.numel == 0 else (int(address.start), int(address.numel)))
    return tuple(owned)


def _plan_layout(table: Sequence[Sequence[Sequence[int]]], numels: Sequence[int], rank: int) -> _GatherPlan | None:
    """The gather plan from every rank's (start, numel) in each parameter (``table[rank][param]``); None unless
    the pieces tile every parameter exactly once (then the fused gather cannot assemble it; nor is it ZeRO 1/2).

    Each rank sends its pieces in parameter order, padded to ``chunk``; a parameter's pieces, in the order
    of their starts, are its full gradient. Adjacent runs merge: where the partitions follow the parameters'
    order (DeepSpeed's flat buffer), the full gradients are one run, a view of the gathered buffer.
    """
    world = len(table)
    chunk = max((sum(n for _, n in row) for row in table), default=0)
    cursor = [r * chunk for r in range(world)]  # where each rank's next piece lands in the gathered buffer
    runs: list[list[int]] = []
    for i, numel in enumerate(numels):
        pieces = sorted((int(table[r][i][0]), int(table[r][i][1]), r) for r in range(world) if table[r][i][1] > 0)
        covered = 0
        for start, n, r in pieces:
            if start != covered:  # a gap or an overlap
                return None
            covered += n
            if runs and runs[-1][0] + runs[-1][1] == cursor[r]:
                runs[-1][1] += n
            else:
                runs.append([cursor[r], n])
            cursor[r] += n
        if covered != numel:
            return None
    owned = tuple((int(s), int(n)) if n > 0 else (0, 0) for s, n in table[rank])
    return _GatherPlan(owned, chunk, tuple((s, n) for s, n in runs))


def _all_gather(output: torch.Tensor, group: dist.ProcessGroup) -> None:
    """All-gather in place: rank r's input is ``output``'s r-th of ``world`` equal chunks, already filled.

    Gloo's all-gather moves its bytes several times slower than its all-reduce (on 2 CPU ranks, 19 MB
    each took 67 ms against 28 ms for an all-reduce of 38 MB); one broadcast per rank sends the same
    bytes in 17 ms. Other backends (NCCL) get their all-gather.
    """
    if dist.get_backend(group) == "gloo":
        chunks = output.chunk(dist.get_world_size(group))
        works = [dist.broadcast(chunk, src=dist.get_global_rank(group, r), group=group, async_op=True)
                 for r, chunk in enumerate(chunks)]
        for work in works:
            assert work is not None
            work.wait()
        return
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (renamed in torch 2.12)
    rank, size = dist.get_rank(group), output.numel() // dist.get_world_size(group)
    gather(output, output.narrow(0, rank * size, size), group=group)


def _exchange_plan(params: Sequence[_ZeroParameter]) -> _GatherPlan | None:
    """Every rank's (start, numel) in each parameter, all-gathered, as a :class:`_GatherPlan`. Collective."""
    group = params[0]._dp_group
    mine = torch.tensor(_owned(params), dtype=torch.int64, device=params[0].device).reshape(-1)
    every = mine.new_empty(dist.get_world_size(group) * mine.numel())
    every.view(-1, mine.numel())[dist.get_rank(group)].copy_(mine)
    _all_gather(every, group)
    table = every.view(-1, len(params), 2).tolist()
    return _plan_layout(table, [p.numel() for p in params], dist.get_rank(group))


def _gather_partitions(
    params: Sequence[_ZeroParameter], plan: _GatherPlan | None
) -> dict[torch.nn.Parameter, torch.Tensor | None] | None:
    """Full fp32 gradients of ``params``: each rank sends the pieces it owns once (an all-gather of
    ``plan.chunk`` elements per rank, see :func:`_all_gather`), every rank copies them into place. Collective; None where ``plan`` is.

    Bitwise what ``safe_get_full_grad`` returns: its all-reduce of zeros and one owner's value leaves the
    value, except that -0.0 + 0.0 is +0.0, which adding 0.0 to each piece as it is packed reproduces.
    """
    if plan is None:
        return None
    if _owned(params) != plan.owned:
        raise RuntimeError("the ZeRO partitions of the K-FAC layers' parameters changed without a new optimizer")
    group, device = params[0]._dp_group, params[0].device
    gathered = torch.empty(dist.get_world_size(group) * plan.chunk, dtype=torch.float32, device=device)
    send = gathered.narrow(0, dist.get_rank(group) * plan.chunk, plan.chunk)  # this rank's chunk, in place
    offset = 0
    for p, (start, numel) in zip(params, plan.owned):
        if numel == 0:
            continue
        fragment = p._hp_mapping.get_lp_grad_fragment(p._index_in_param_group).reshape(-1)
        if fragment.numel() == p.numel() and numel != p.numel():
            # The bf16 optimizer keeps a full accumulation buffer: send this rank's share of it only.
            fragment = fragment.narrow(0, start, numel)
        # + 0.0 in the copy: see the docstring (and it converts a bf16 fragment exactly)
        torch.add(fragment, 0.0, out=send.narrow(0, offset, numel))
        offset += numel
    send.narrow(0, offset, plan.chunk - offset).zero_()
    _all_gather(gathered, group)
    if len(plan.runs) == 1:
        full = gathered.narrow(0, *plan.runs[0])
    else:
        full = torch.cat([gathered.narrow(0, s, n) for s, n in plan.runs]) if plan.runs else gathered[:0]
    return {p: view.view(p.shape) for p, view in zip(params, full.split([p.numel() for p in params]))}


def _fusable(params: Sequence[torch.nn.Parameter]) -> bool:
    """Do the engine's internals look like the ones the fused gather is written against?

    Decided only from what is the same on every rank (a parameter outside this rank's partition
    has no mapping here but one elsewhere), so that all ranks take the same path.
    """
    import importlib

    # (``deepspeed.utils.tensor_fragment`` as an attribute is the class, not the module)
    module = importlib.import_module("deepspeed.utils.tensor_fragment")
    fragment_cls = getattr(module, "tensor_fragment", None)
    fields = getattr(fragment_cls, "__dataclass_fields__", {})
    if not (hasattr(fragment_cls, "get_lp_grad_fragment") and "lp_fragment_address" in fields):
        return False
    group = getattr(params[0], "_dp_group", None)
    return group is not None and all(
        getattr(p, "_dp_group", None) is group and hasattr(p, "_hp_mapping") for p in params
    )
