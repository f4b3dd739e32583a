"""The distributor contract (kfac/distributor.py), checked on the source: nothing configures a distributor by assigning
its attributes from outside it (setup's DistributorContext and the per-step arguments do), no call goes around the
type checker with ``type: ignore[attr-defined]`` in kfac/ or comm/, and every distributor implements the capability
protocols it claims. Each check is also shown failing on a synthetic snippet, so that a green run means something.

The source checks read the files with ``ast`` and ``tokenize`` (not through the code under test); the protocol check
imports the distributors, since what a class claims and implements is its runtime MRO.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import pkgutil
import re
import tokenize
from pathlib import Path

import pytest

import lightning_spdkfac
from lightning_spdkfac.kfac.distributor import Distributor, OwnerHeld

PACKAGE = Path(lightning_spdkfac.__file__).parent
# A variable holding a distributor, by its name (what the code of this package calls them).
DISTRIBUTOR_NAME = re.compile(r"^(distributor|\w+_distributor|distributor_\w+|dist_\w+|candidate|lead)$")
# Collections of distributors: a loop variable over one of these holds a distributor.
DISTRIBUTOR_COLLECTION = re.compile(r"(candidates|distributors)$")


def _names_distributor(node: ast.expr, loop_vars: set[str]) -> bool:
    """Whether ``node`` (the object of an attribute assignment) is a distributor, by how it is reached."""
    if isinstance(node, ast.Attribute):
        return node.attr == "distributor" or bool(DISTRIBUTOR_NAME.match(node.attr))
    if isinstance(node, ast.Name):
        return node.id in loop_vars or bool(DISTRIBUTOR_NAME.match(node.id))
    if isinstance(node, ast.Subscript):  # self.candidates[i].x = ...
        inner = node.value
        name = inner.attr if isinstance(inner, ast.Attribute) else inner.id if isinstance(inner, ast.Name) else ""
        return bool(DISTRIBUTOR_COLLECTION.search(name))
    return False


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out: list[ast.expr] = []
        for t in node.targets:
            out += list(t.elts) if isinstance(t, (ast.Tuple, ast.List)) else [t]
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def assignments_on_distributors(source: str, filename: str = "<snippet>") -> list[str]:
    """``file:line: target`` of every attribute assigned on a distributor object, or set with ``setattr``, in
    ``source``."""
    tree = ast.parse(source, filename)
    loop_vars: set[str] = set()
    for node in ast.walk(tree):  # for c in self.candidates: ... -> c is a distributor
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
            it = node.iter
            name = it.attr if isinstance(it, ast.Attribute) else it.id if isinstance(it, ast.Name) else ""
            if DISTRIBUTOR_COLLECTION.search(name):
                loop_vars.add(node.target.id)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        for t in _targets(node):
            if isinstance(t, ast.Attribute) and _names_distributor(t.value, loop_vars):
                found.append((node.lineno, ast.unparse(t)))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and node.args and _names_distributor(node.args[0], loop_vars)):
            found.append((node.lineno, ast.unparse(node)))
    return [f"{filename}:{line}: {what}" for line, what in sorted(found)]


def attr_defined_ignores(source: str, filename: str = "<snippet>") -> list[str]:
    """``file:line`` of every ``type: ignore[...attr-defined...]`` comment in ``source``."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and re.search(r"type:\s*ignore\[[^\]]*attr-defined", tok.string):
            found.append(f"{filename}:{tok.start[0]}")
    return found


def private_reach(source: str, filename: str = "<snippet>") -> list[str]:
    """``file:line: expr`` of every underscore attribute read or written on anything but ``self`` in ``source``."""
    found = [(node.lineno, ast.unparse(node)) for node in ast.walk(ast.parse(source, filename))
             if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
             and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]
    return [f"{filename}:{line}: {what}" for line, what in sorted(found)]


def _protocol_members(proto: type) -> dict[str, object]:
    """A protocol's own members: its methods (by function) and its annotated data members (None)."""
    members: dict[str, object] = {k: None for k in proto.__dict__.get("__annotations__", {})}
    for name, value in proto.__dict__.items():
        if inspect.isfunction(value) and not (name.startswith("__") and name.endswith("__")):
            members[name] = value
    return members


def unimplemented_claims(cls: type) -> list[str]:
    """``Class.member (Protocol)`` for every member of a protocol among ``cls``'s bases that ``cls`` leaves to the
    protocol's stub, or implements with other parameters."""
    out = []
    for proto in cls.__mro__[1:]:
        if not getattr(proto, "_is_protocol", False) or proto.__module__ == "typing":
            continue
        for name, stub in _protocol_members(proto).items():
            owner = next((k for k in cls.__mro__ if name in vars(k)), None)  # a protocol's data member: annotated
            if owner is None or getattr(owner, "_is_protocol", False):
                out.append(f"{cls.__name__}.{name} ({proto.__name__})")
            elif stub is not None:
                impl = getattr(cls, name)
                want = list(inspect.signature(stub).parameters)
                if not callable(impl) or list(inspect.signature(impl).parameters) != want:
                    out.append(f"{cls.__name__}.{name} ({proto.__name__}): parameters differ from {want}")
    return out


def _all_distributors() -> list[type]:
    for sub in ("kfac", "comm", "lightning"):
        pkg = importlib.import_module(f"lightning_spdkfac.{sub}")
        for info in pkgutil.iter_modules(pkg.__path__):
            try:
                importlib.import_module(f"lightning_spdkfac.{sub}.{info.name}")
            except ImportError:  # an optional dependency (deepspeed): its module has no distributor of its own
                pass
    seen, todo = [], [Distributor]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo += [s for s in cls.__subclasses__() if s.__module__.startswith("lightning_spdkfac.")]
    return seen


def _sources(*subdirs: str) -> list[Path]:
    roots = [PACKAGE / d for d in subdirs] if subdirs else [PACKAGE]
    return sorted(p for r in roots for p in r.rglob("*.py"))


# ------------------------------------------------------------------------------ the package
def test_nothing_assigns_attributes_on_a_distributor_from_outside() -> None:
    found = [hit for p in _sources() for hit in assignments_on_distributors(p.read_text(), str(p.relative_to(PACKAGE)))]
    assert not found, "configure a distributor through setup(sides, DistributorContext) and the per-step " \
                      f"arguments, not by assignment: {found}"


def test_no_attr_defined_ignores_in_kfac_and_comm() -> None:
    found = [hit for p in _sources("kfac", "comm") for hit in attr_defined_ignores(p.read_text(),
                                                                                   str(p.relative_to(PACKAGE)))]
    assert not found, f"declare the capability (a Protocol or a base method) instead: {found}"


def test_auto_drives_its_candidates_through_the_contract() -> None:
    found = private_reach((PACKAGE / "comm" / "auto.py").read_text(), "comm/auto.py")
    assert not found, f"AutoDistributor reaches into a candidate's private state: {found}"


def test_every_distributor_implements_what_it_claims() -> None:
    classes = _all_distributors()
    names = {c.__name__ for c in classes}
    # Every class of the package that subclasses a distributor by name is among those checked.
    declared = {node.name for p in _sources() for node in ast.walk(ast.parse(p.read_text()))
                if isinstance(node, ast.ClassDef)
                and any(ast.unparse(b).split(".")[-1].endswith("Distributor") for b in node.bases)}
    assert declared <= names, declared - names
    assert {"SPDDistributor", "DPKFACDistributor", "AutoDistributor"} <= names
    assert [c.__name__ for c in classes if OwnerHeld in c.__mro__] == ["DPKFACDistributor"]  # the claims
    problems = [p for c in classes for p in unimplemented_claims(c)]
    assert not problems, problems
    # ... and takes the contract's calls as the preconditioner makes them.
    for c in classes:
        inspect.signature(c.setup).bind(None, [], None)
        inspect.signature(c.begin_step).bind(None, 0)


# ------------------------------------------------------------------------------ the checks can fail
SNIPPET = """
class Pre:
    def __init__(self, distributor, auto):
        self.distributor = distributor          # holding one is fine
        self.distributor.inv_dtype = 1          # configuring it is not
        self.distributor.timer += 1
        distributor.kfac_step = 3
        a, pre.distributor.async_inverses = 1, True
        setattr(self.distributor, "kfac_settings", "")
        for c in auto.candidates:
            c.models = None
        auto.candidates[0].timer = None
        self.distributor.offer(0, None)  # type: ignore[attr-defined]
"""


def test_the_checks_find_what_they_look_for() -> None:
    hits = assignments_on_distributors(SNIPPET)
    assert [h.split(": ", 1)[1] for h in hits] == [
        "self.distributor.inv_dtype", "self.distributor.timer", "distributor.kfac_step",
        "pre.distributor.async_inverses", "setattr(self.distributor, 'kfac_settings', '')", "c.models",
        "auto.candidates[0].timer"], hits
    assert attr_defined_ignores(SNIPPET) == ["<snippet>:13"]
    assert private_reach("self._slot = lead._measuring\nc._async_group = self._x.y\n") == [
        "<snippet>:1: lead._measuring", "<snippet>:2: c._async_group"]
    assert attr_defined_ignores("x = 1  # type: ignore[no-untyped-call]\n") == []


def test_a_broken_claim_is_found() -> None:
    class Claims(Distributor, OwnerHeld):  # claims OwnerHeld, implements half of it, one with other parameters
        def agree_tensor(self, ok):  # type: ignore[no-untyped-def]
            return ok

        def offer(self, index):  # type: ignore[no-untyped-def, override]
            pass

    found = unimplemented_claims(Claims)
    assert "Claims.begin_share (OwnerHeld)" in found and "Claims.gather_layers (OwnerHeld)" in found
    assert any(f.startswith("Claims.offer (OwnerHeld): parameters differ") for f in found)
    assert not any(f.startswith("Claims.agree_tensor") or f.startswith("Claims.layer_owners") for f in found)


@pytest.mark.parametrize("old", ["def setup(self, sides): pass", "def begin_step(self): pass"])
def test_an_old_style_override_is_found(old: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"class Old(Distributor):\n    {old}\n", {"Distributor": Distributor}, namespace)
    old_cls = namespace["Old"]
    assert isinstance(old_cls, type)
    with pytest.raises(TypeError):
        inspect.signature(old_cls.setup).bind(None, [], None)
        inspect.signature(old_cls.begin_step).bind(None, 0)
