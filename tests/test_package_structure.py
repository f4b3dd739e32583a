"""The shape of the package (issue 28, "the house"): no import cycle between its modules, no module above
MAX_LINES lines but the listed exceptions, and the old import paths of moved names still serving them.

Read from the source with ``ast``, nothing imported: fast, and it sees every module whether or not an
optional dependency (DeepSpeed, the unified ``lightning``) is installed.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "lightning_spdkfac"
PACKAGE = ROOT.name
MAX_LINES = 600
# The modules (relative to lightning_spdkfac/) that may be longer than MAX_LINES for now, each with its reason.
LONG_MODULES: tuple[str, ...] = ()  # none: every module of the package is at most MAX_LINES (issue 28)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING`` (or ``t.TYPE_CHECKING``)."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at module level or inside a function or class, except in the body of an
    ``if TYPE_CHECKING:`` (its ``else`` counts: it runs)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    """The modules of the package that ``node`` (in ``module``) imports. ``from X import name`` imports the
    module ``X.name`` where there is one, else ``X``. The parent packages that Python initializes on the way
    are not edges (every module would then import the package root); they are modules of their own here, with
    their own imports."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source != PACKAGE and not source.startswith(PACKAGE + "."):
        return []
    subs = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in known]
    plain = [a for a in node.names if f"{source}.{a.name}" not in known]
    return subs + ([source] if plain and source in known else [])


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module of the package: line of the first such import}."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for node in _imports(ast.parse(path.read_text(), str(path))):
            for target in _targets(name, path.name == "__init__.py", node, known):
                if target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[m0, m1, ..., m0]``, or None (depth-first, in sorted order: deterministic)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, {})):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (cycle := visit(t)) is not None:
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)) is not None:
            return cycle
    return None


def _show(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    modules = _modules()
    return "\n".join(f"  {a} -> {b}  ({modules[a].relative_to(ROOT.parent)}:{graph[a][b]})"
                     for a, b in zip(cycle, cycle[1:]))


def test_the_graph_sees_relative_function_level_and_type_checking_imports():
    """The reader itself, on imports whose edges are known: a relative import two levels up, one inside a
    function, and one under ``if TYPE_CHECKING:`` (not an edge)."""
    graph = import_graph()
    assert "lightning_spdkfac.schedule" in graph["lightning_spdkfac.simulate.schedules.spd"]  # from ...schedule
    assert "lightning_spdkfac.validation" in graph["lightning_spdkfac.simulate.timeline"]  # from .. import validation
    assert "lightning_spdkfac.comm.scheduler" in graph["lightning_spdkfac.simulate.plan"]  # inside a function
    # lightning_spdkfac/__init__.py names these only under TYPE_CHECKING (the root is lazy)
    assert "lightning_spdkfac.kfac.preconditioner" not in graph["lightning_spdkfac"]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\nelse:\n"
                     "    from .b import y\ndef f():\n    from .c import z\n")
    found = {t for n in _imports(tree)
             for t in _targets("lightning_spdkfac.m", False, n, {"lightning_spdkfac.a", "lightning_spdkfac.b",
                                                                   "lightning_spdkfac.c"})}
    assert found == {"lightning_spdkfac.b", "lightning_spdkfac.c"}
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1, "b": 2}}) is None


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50  # every module was read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in the package (module-level and function-level imports):\n" + _show(cycle, graph)


def test_no_module_above_the_line_limit():
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    too_long = {m: n for m, n in sorted(lines.items()) if n > MAX_LINES and m not in LONG_MODULES}
    assert not too_long, (f"modules above {MAX_LINES} lines (split them along a real seam): "
                          + ", ".join(f"{m}: {n}" for m, n in too_long.items()))
    stale = [m for m in LONG_MODULES if lines.get(m, 0) <= MAX_LINES]
    assert not stale, f"no longer above {MAX_LINES} lines (or gone): remove them from LONG_MODULES: {stale}"


# old path -> (new home, names): modules were split, and these paths stay importable for the code that used them
# (benchmarks/paper_table.py, benchmarks/schedules_64.py, benchmarks/zero_gather.py, benchmarks/iteration_time.py,
# the docs)
MOVED = {
    "lightning_spdkfac.simulate.timeline": [
        ("lightning_spdkfac.simulate.sim_schedule", ["SIM_SCHEDULES", "SimSchedule", "as_sim_schedule",
                                                     "with_schedule"]),
        ("lightning_spdkfac.simulate.timeline_core", ["CATEGORIES", "Event", "Timeline"]),
    ],
    "lightning_spdkfac.simulate.dpkfac": [
        ("lightning_spdkfac.simulate.schedules.dpkfac", ["gradient_bytes", "layer_placement", "simulate_dpkfac"]),
        ("lightning_spdkfac.simulate.memory", ["MEMORY_ASSUMPTIONS", "memory_per_gpu"]),
        ("lightning_spdkfac.simulate.cluster", ["half_allreduce"]),
    ],
    "lightning_spdkfac.lightning.deepspeed": [
        ("lightning_spdkfac.lightning.deepspeed_grads", ["DeepSpeedGradAccess"]),
    ],
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_moved_names_are_importable_from_their_old_paths(old):
    if old.startswith("lightning_spdkfac.lightning."):
        pytest.importorskip("pytorch_lightning")
    module = importlib.import_module(old)
    for new, names in MOVED[old]:
        home = importlib.import_module(new)
        for name in names:
            assert getattr(module, name) is getattr(home, name), f"{old}.{name}"
    if old == "lightning_spdkfac.simulate.timeline":  # benchmarks/paper_table.py's name for it
        assert module._grad_comm is importlib.import_module("lightning_spdkfac.simulate.timeline_core").grad_comm_seconds
