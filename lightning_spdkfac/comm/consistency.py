"""Cross-rank check that every rank holds the same K-FAC plan (fusion groups, placement, broadcast order) and settings.

Collectives are matched by issue order, so ranks with different fusion groups or inverse owners would
pair the wrong tensors or hang. The planners are deterministic and fed identical inputs, so this should
never happen; when it does (a different model or option on one rank, a different package version, a bug),
it must fail loudly at the re-plan, not as a hang or silently wrong factors later. The K-FAC settings
(damping, decay, KL clip, intervals, dtypes, methods, the registered layers) are part of the plan: ranks
that pair their collectives correctly but damp or clip differently would drift apart without a word.

:func:`check_plan_consistency` runs once per (re-)plan, on every rank at the same point: it hashes each
part of the plan (factor order, fusion groups, placement owners, factor shapes, K-FAC settings, inverse
broadcast order) to 63 bits and all-gathers the six numbers (one collective of 48 bytes per rank, bounded
by the K-FAC timeout). Only when some rank
differs does it gather the plans themselves (every rank sees the same fingerprints, so every rank takes
that path together) to raise :class:`PlanMismatchError` with the differing values of rank 0 and of each
offending rank, on every rank.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..factor_shapes import ShapeLike, check_shapes
from ._common import default_device, distributed_ready
from .faults import PLAN_CHECK, Work, stream_ordered, wait_work

__all__ = ["PLAN_PARTS", "PlanMismatchError", "check_plan_consistency", "plan_fingerprint"]

PLAN_PARTS = ("order", "groups", "owners", "sides", "settings", "broadcast")
_LABELS = {"order": "factor order", "groups": "fusion groups", "owners": "placement owners",
           "sides": "factor shapes", "settings": "K-FAC settings", "broadcast": "inverse broadcast order"}
_SHOW = 400  # characters of a plan part shown in the error message


class PlanMismatchError(RuntimeError):
    """Ranks hold different K-FAC plans. ``parts``: the differing parts (of :data:`PLAN_PARTS`);
    ``ranks``: the ranks whose plan differs from rank 0's."""

    def __init__(self, message: str, parts: tuple[str, ...], ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.parts = parts
        self.ranks = ranks


def _key(k: object) -> object:
    return tuple(k) if isinstance(k, (tuple, list)) else k


def _plan_parts(order: Sequence[object], groups: Sequence[Sequence[int]], owners: Sequence[int],
                sides: Sequence[ShapeLike], settings: str = "", broadcast: Sequence[object] = ()) -> dict[str, Any]:
    return {
        "order": [_key(k) for k in order],
        "groups": [[int(i) for i in g] for g in groups],
        "owners": [int(o) for o in owners],
        # Shapes, not sides: a diagonal (n,) and a dense (n, n) factor of one side are different plans; an int n
        # is (n, n), so a plan given by sides fingerprints as the same plan given by shapes.
        "sides": [list(s) for s in check_shapes("sides", sides, low=0)],
        "settings": str(settings),
        "broadcast": [_key(k) for k in broadcast],
    }


def plan_fingerprint(order: Sequence[object], groups: Sequence[Sequence[int]], owners: Sequence[int],
                     sides: Sequence[ShapeLike], settings: str = "", broadcast: Sequence[object] = ()) -> dict[str, int]:
    """A 63-bit hash of each plan part (a non-negative int64), identical for equal plans on any rank,
    Python process or platform (the hash of the part's ``repr``, not Python's salted ``hash``).
    ``settings``: the preconditioner's description of its K-FAC settings (``settings_text``);
    ``broadcast``: the owned factors' keys in the order their inverses are broadcast."""
    parts = _plan_parts(order, groups, owners, sides, settings, broadcast)
    return {name: int.from_bytes(hashlib.blake2b(repr(parts[name]).encode(), digest_size=8).digest(), "little")
            >> 1 for name in PLAN_PARTS}


def _gather_objects(obj: object, process_group: dist.ProcessGroup | None, device: torch.device,
                    world_size: int, rank: int, timeout_s: float) -> list[Any]:
    """Every rank's ``obj`` (picklable), with bounded waits (only used on the mismatch path)."""

    def wait(work: Work, what: str) -> None:
        wait_work(work, timeout_s, collective="all_gather", phase=PLAN_CHECK, what=what, rank=rank,
                  world_size=world_size, stream_only=stream_ordered(process_group))

    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world_size)]
    wait(dist.all_gather(sizes, size, group=process_group, async_op=True), "the sizes of the plans")
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    out = [torch.empty_like(padded) for _ in range(world_size)]
    wait(dist.all_gather(out, padded, group=process_group, async_op=True), "the plans")
    return [pickle.loads(o[:int(s.item())].cpu().numpy().tobytes()) for o, s in zip(out, sizes)]


def _differing_items(a: str, b: str) -> tuple[str, str]:
    """The items of two settings texts (``k=v, ...; layers: ...``) that differ, each side's."""

    def items(text: str) -> list[str]:
        head, _, layers = text.partition("; layers: ")
        return head.split(", ") + [f"layers: {layers}"]

    ia, ib = items(a), items(b)
    return ", ".join(x for x in ia if x not in ib), ", ".join(x for x in ib if x not in ia)


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOW else text[:_SHOW] + f"... ({len(text)} characters)"


def check_plan_consistency(
    order: Sequence[object],
    groups: Sequence[Sequence[int]],
    owners: Sequence[int],
    sides: Sequence[ShapeLike],
    process_group: dist.ProcessGroup | None = None,
    timeout_s: float = 600.0,
    settings: str = "",
    broadcast: Sequence[object] = (),
) -> None:
    """Raise :class:`PlanMismatchError` on every rank unless all ranks of ``process_group`` hold this plan.

    Collective: call on every rank at the same point (once per plan). No-op in one process. ``order``:
    the factor keys in plan order; ``groups``: fusion groups (positions in ``order``); ``owners``: the
    placement's owner rank per factor (-1: replicated); ``sides``: each factor's shape (an int n: n x n, or a
    FactorShape: diagonal, dense, grouped), in plan order;
    ``settings``: the K-FAC settings, as text; ``broadcast``: the owned factors' keys in the order every
    rank issues their inverse broadcasts (derived from the owners, the sides and rank 0's inversion model).
    A rank that does not join within ``timeout_s`` makes the others raise KFACCommError (phase
    "K-FAC plan check").
    """
    if not distributed_ready(process_group):
        return
    world_size = dist.get_world_size(process_group)
    if world_size == 1:
        return
    rank = dist.get_rank(process_group)
    device = default_device(process_group)
    fingerprint = plan_fingerprint(order, groups, owners, sides, settings, broadcast)
    local = torch.tensor([fingerprint[p] for p in PLAN_PARTS], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    work = dist.all_gather(gathered, local, group=process_group, async_op=True)
    wait_work(work, timeout_s, collective="all_gather", phase=PLAN_CHECK,
              what="the plan fingerprints (factor order, fusion groups, placement owners, shapes, K-FAC settings, "
                   "inverse broadcast order)",
              rank=rank, world_size=world_size, stream_only=stream_ordered(process_group))
    table = torch.stack(gathered).cpu()
    differs = table != table[0]
    if not bool(differs.any()):
        return
    bad_ranks = tuple(int(r) for r in differs.any(dim=1).nonzero().flatten())
    parts = tuple(p for k, p in enumerate(PLAN_PARTS) if bool(differs[:, k].any()))
    plans = _gather_objects(_plan_parts(order, groups, owners, sides, settings, broadcast), process_group, device, world_size, rank,
                            timeout_s)
    lines = []
    for r in bad_ranks:
        for k, p in enumerate(PLAN_PARTS):
            if bool(differs[r, k]) and p == "settings":
                ours, theirs = _differing_items(plans[0][p], plans[r][p])
                lines.append(f"  {_LABELS[p]}: rank 0 has {_show(ours)}, rank {r} has {_show(theirs)}")
            elif bool(differs[r, k]):
                lines.append(f"  {_LABELS[p]}: rank 0 has {_show(plans[0][p])} (fingerprint "
                             f"{int(table[0, k]):#018x}), rank {r} has {_show(plans[r][p])} (fingerprint "
                             f"{int(table[r, k]):#018x})")
    raise PlanMismatchError(
        f"K-FAC plan mismatch (seen on rank {rank} of {world_size}): rank(s) {list(bad_ranks)} differ from "
        f"rank 0 in: {', '.join(_LABELS[p] for p in parts)}\n" + "\n".join(lines) + "\n"
        "Every rank must derive the identical fusion and placement plan, or collectives pair the wrong "
        "tensors. Check that all ranks run the same model (the same K-FAC layers, in the same order), the "
        "same K-FAC / strategy options (a rank with another damping, KL clip or interval would update its replica "
        "differently) and the same package and torch versions.",
        parts, bad_ranks,
    )
