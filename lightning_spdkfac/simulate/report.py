"""The report of ``spdkfac plan``: the text tables of one :func:`~.plan.plan` result, and its JSON file.

:func:`render` prints four sections: the cluster and workload, every compared schedule's simulated
breakdown (:data:`~.timeline.CATEGORIES`, fastest first, the recommendation marked) beside its
critical-path lower bound (:attr:`~.timeline.Timeline.lower_bound`), the recommended
schedule's fusion groups and inversion placement, and the ``SPDKFACStrategy`` arguments that run it as a
LightningCLI YAML snippet. :func:`write_json` writes the result itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from .timeline_core import CATEGORIES

__all__ = ["render", "write_json"]

_SHOW_RANKS = 8  # ranks listed one by one when P is larger than twice this
_SHOW_GROUPS = 24  # fusion groups listed one by one


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    widths = [max(len(h), *(len(r[j]) for r in rows)) if rows else len(h) for j, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if rj else c.ljust(w) for c, w, rj in zip(cells, widths, right)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _x(speedup: float | None) -> str:
    return "-" if speedup is None else f"{speedup:.2f}x"


def _count(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n >= 100_000 else f"{n:,}"


def _yaml_flow(d: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(d, sort_keys=False, default_flow_style=True, width=1000).strip()


def _few(names: Sequence[str], width: int = 64) -> str:
    """Comma-separated names, cut to about ``width`` characters with a count of the rest."""
    text = ", ".join(names)
    if len(text) <= width:
        return text
    shown: list[str] = []
    for n in names:
        if len(", ".join([*shown, n])) > width - 24 and shown:
            break
        shown.append(n)
    return ", ".join(shown) + f", +{len(names) - len(shown)} more ({len(names)} factors)"


def _fmt_ab(ab: dict[str, float]) -> str:
    bw = f"{1e-9 / ab['beta']:.2f} GB/s" if ab["beta"] > 0 else "inf GB/s"
    return f"alpha {ab['alpha'] * 1e6:.1f} us, beta {ab['beta']:.4g} s/B ({bw})"


def _yaml(strategy: dict[str, Any]) -> str:
    import yaml

    body = yaml.safe_dump({"trainer": {"strategy": strategy}},
                          sort_keys=False, default_flow_style=False)
    return body.rstrip()


# milliseconds of a number of seconds, at the report's precision
_Ms = Callable[[float], str]


def _summary(result: dict[str, Any], ms: _Ms) -> list[str]:
    c, w = result["cluster"], result["workload"]
    out = ["== Cluster and workload =="]
    per_node = f" ({c['gpus_per_node']} per node)" if c["gpus_per_node"] > 1 else ""
    out.append(f"cluster     {c['world_size']} GPU{'s' if c['world_size'] != 1 else ''}{per_node}, {c['source']}")
    out.append(f"all-reduce  {_fmt_ab(c['allreduce'])}")
    out.append(f"broadcast   {_fmt_ab(c['broadcast'])}")
    inv = c["inverse"]
    out.append(f"inverse     {inv['c0']:.3g} + {inv['c2']:.3g} n^2 + {inv['c3']:.3g} n^3 s"
               + (f" + {inv['c1']:.3g} n" if inv["c1"] else ""))
    shape = "x".join(str(d) for d in w["input_shape"]) if w["input_shape"] else "-"
    if w["input_dtype"] != "float32":
        shape += f" ({w['input_dtype']})"
    out.append(f"model       {w['name']} ({w['source']}), input {shape}")
    out.append(f"            {w['layers']} K-FAC layers, {w['factors']} factors (largest {w['largest_factor']}"
               f"{_layouts(w)}), {_count(w['params'])} params ({_count(w['other_params'])} outside K-FAC layers)")
    out.append(f"            per-GPU batch {w['batch_size']}: FF&BP {ms(w['ff_bp_s'])} ms, "
               f"FactorComp {ms(w['factor_comp_s'])} ms")
    m = result.get("measured")
    if m:
        out.append(f"measured    on {m['group_world_size']} ranks ({m['backend']}, {m['device']}): "
                   f"{len(m['sizes_bytes'])} sizes {m['sizes_bytes'][0]}..{m['sizes_bytes'][-1]} B; "
                   f"inversions n = {', '.join(str(n) for n in m['inverse_ns'])}")
    return out


def _schedules(result: dict[str, Any], ms: _Ms) -> list[str]:
    out = ["== Simulated iteration, ms (fastest first) =="]
    headers = ["", "schedule", "GiB/GPU", *CATEGORIES, "total", "bound", "speedup"]
    rows = []
    for r in result["schedules"]:
        mark = "*" if r["name"] == result["recommended"] else ""
        rows.append([mark, r["name"], _gib(r), *(ms(r["breakdown_s"][k]) for k in CATEGORIES), ms(r["total_s"]),
                     ms(r["lower_bound_s"]), _x(r["speedup_vs_dkfac"])])
    out.append(_table(headers, rows, [False, False] + [True] * (len(CATEGORIES) + 4)))
    best = _best(result)
    out.extend(f"{r['name']}: {r['description']}" for r in result["schedules"] if r["name"] == "config")
    out.append("bound: the schedule's critical-path lower bound (FF&BP + FactorComp + exposed GradComm + the "
               "largest inversion, less what overlaps the gradient all-reduce; see simulate.schedules.spd; dpkfac: "
               "simulate.schedules.dpkfac)")
    out.extend(_memory(result))
    out.append(f"speedup: over dkfac. * recommended: {best['name']} ({ms(best['total_s'])} ms per iteration, "
               f"{_x(best['speedup_vs_dkfac'])}) - {best['description']}")
    if best["bytes_per_element"] != 4 and result["fastest_fp32"]:
        f = next(r for r in result["schedules"] if r["name"] == result["fastest_fp32"])
        out.append(f"note: {best['name']} sends factors and inverses in bf16, which changes the numerics; the "
                   f"fastest fp32 schedule is {f['name']} ({ms(f['total_s'])} ms, {_x(f['speedup_vs_dkfac'])})")
    if best.get("stale_or_local_factors"):
        out.append(f"note: {best['name']} changes the factors (one step old with DeAR, the owner's data only with "
                   "local factors): the other schedules keep the runtime's numerics")
    if best.get("async_inverses"):
        sync = next((r for r in result["schedules"] if not r.get("async_inverses")), None)
        out.append(f"note: {best['name']} preconditions with inverses one step old (async_inverses: true), which "
                   "changes the numerics" + (f"; the fastest synchronous schedule is {sync['name']} "
                                             f"({ms(sync['total_s'])} ms, {_x(sync['speedup_vs_dkfac'])})"
                                             if sync else ""))
    return out


def _best(result: dict[str, Any]) -> dict[str, Any]:
    """The recommended schedule's row (the fastest, or the fastest that fits in --gpu-memory)."""
    return next(r for r in result["schedules"] if r["name"] == result["recommended"])


def _gib(row: dict[str, Any]) -> str:
    mem = row.get("memory_bytes")
    if not mem:
        return "-"
    return f"{mem['total'] / 2**30:.2f}" + (" (over)" if row.get("fits") is False else "")


def _memory(result: dict[str, Any]) -> list[str]:
    mem = result.get("memory")
    if not mem:
        return []
    limit = mem["limit_bytes"]
    out = [f"GiB/GPU: modelled memory per GPU on its fullest rank ({mem['assumptions']})"]
    if limit is not None:
        fit = [r["name"] for r in result["schedules"] if r.get("fits")]
        out.append(f"--gpu-memory {limit / 2**30:.2f} GiB: {len(fit)} of {len(result['schedules'])} schedules fit"
                   + (f"; recommended: the fastest of them, {result['recommended']}" if fit else ""))
    return out


def _fusion_groups(result: dict[str, Any], best: str) -> list[str]:
    groups = result["fusion_groups"]
    out = [f"== Fusion groups of {best}: {len(groups)} factor reduction{'s' if len(groups) != 1 else ''}, "
           f"{sum(g['bytes'] for g in groups) / 1e6:.1f} MB =="]
    if not groups:
        return [*out, "(one GPU: nothing is reduced)"]
    shown = groups if len(groups) <= _SHOW_GROUPS else groups[: _SHOW_GROUPS - 4] + groups[-4:]
    rows = []
    for k, g in enumerate(shown):
        if len(groups) > _SHOW_GROUPS and k == _SHOW_GROUPS - 4:
            rest = groups[_SHOW_GROUPS - 4: -4]
            rows.append(["...", f"{len(rest)} more groups", f"{sum(x['bytes'] for x in rest) / 1e6:.2f}"])
        rows.append([str(g["index"]), _few(g["factors"]), f"{g['bytes'] / 1e6:.2f}"])
    out.append(_table(["group", "factors", "MB"], rows, [True, False, True]))
    return out


def _placement(result: dict[str, Any], best: str, ms: _Ms) -> list[str]:
    p = result["placement"]
    ranks = p["ranks"]
    out = [f"== Inversion placement of {best} ({p['policy']}) =="]
    if p["replicated"]:
        out.append(f"replicated (every rank inverts them, nothing sent): {len(p['replicated'])} factors, "
                   f"{ms(p['replicated_inverse_s'])} ms: {_few(p['replicated'], 90)}")
    if not any(r["factors"] for r in ranks):
        return out
    many = len(ranks) > 2 * _SHOW_RANKS
    shown = ranks[:_SHOW_RANKS] if many else ranks
    rows = [[str(r["rank"]), str(len(r["factors"])), ms(r["inverse_s"]), ms(r["broadcast_s"]),
             _few(r["factors"])] for r in shown]
    out.append(_table(["rank", "owned", "invert ms", "bcast ms", "owned factors"], rows,
                      [True, True, True, True, False]))
    if many:
        rest = ranks[_SHOW_RANKS:]
        load = [r["inverse_s"] + r["broadcast_s"] for r in rest]
        top = max(range(len(rest)), key=load.__getitem__)
        out.append(f"... ranks {_SHOW_RANKS}-{len(ranks) - 1}: {sum(len(r['factors']) for r in rest)} owned "
                   f"factors ({min(len(r['factors']) for r in rest)}-{max(len(r['factors']) for r in rest)} "
                   f"per rank), invert+bcast {ms(min(load))}-{ms(max(load))} ms "
                   f"(most: rank {rest[top]['rank']}); see --json for all ranks")
    if p["policy"].startswith("layers"):
        out.append("invert ms: the rank's owned layers' inversions; bcast ms: their preconditioned gradients' "
                   "broadcasts (all ranks share one channel)")
    else:
        out.append("invert ms: the rank's owned and the replicated inversions; bcast ms: its owned inverses' "
                   "broadcasts (all ranks share one channel)")
    return out


def _runtime(result: dict[str, Any], best: dict[str, Any]) -> list[str]:
    rt = result["runtime"]
    out = [f"== Runtime configuration for {best['name']} (LightningCLI config) ==", _yaml(rt["strategy"])]
    if rt["notes"]:
        out.append(f"not an exact equivalent: the simulated {best['name']} differs from what the runtime runs:")
        out.extend(f"  - {n}" for n in rt["notes"])
    if rt.get("fastest_fp32_init_args") and best["bytes_per_element"] != 4:
        args = _yaml_flow(rt["fastest_fp32_init_args"])
        out.append(f"fp32 alternative ({result['fastest_fp32']}): init_args: {args}")
    out.append("The runtime measures its own alpha-beta models and factor ready times at start-up and plans "
               "from them; the groups and placement above are the simulator's.")
    return out


def _layouts(w: dict[str, Any]) -> str:
    """The factors that are not dense, for the workload line (empty when every factor is)."""
    parts = []
    if w.get("diagonal_factors"):
        parts.append(f"{w['diagonal_factors']} diagonal up to {w['largest_diagonal']}")
    if w.get("grouped_factors"):
        parts.append(f"{w['grouped_factors']} grouped")
    if parts and w.get("max_factor_side") is not None:
        parts.append(f"max_factor_side {w['max_factor_side']}")
    return "; " + ", ".join(parts) if parts else ""


def render(result: dict[str, Any]) -> str:
    """The text tables of one :func:`~.plan.plan` result."""
    digits = 1 if min(r["total_s"] for r in result["schedules"]) >= 0.01 else 3

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.{digits}f}"

    best = _best(result)
    out = [*_summary(result, ms), "", *_schedules(result, ms), "", *_fusion_groups(result, best["name"]), "",
           *_placement(result, best["name"], ms), "", *_runtime(result, best)]
    if result["notes"]:
        out.append("")
        out.extend(f"note: {n}" for n in result["notes"])
    return "\n".join(out)


def write_json(result: dict[str, Any], path: str) -> None:
    """``result`` as indented JSON at ``path`` (OSError when it cannot be written)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
