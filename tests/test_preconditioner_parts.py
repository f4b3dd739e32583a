"""The preconditioner is composed of parts (issue 36, "the contract"): ``KFACPreconditioner`` inherits from nothing but
``object``, each part is a plain class of its own, and a part's methods read only what it owns (attributes it assigns,
its methods and class attributes) or is given (``self.core`` and the other constructor arguments it keeps). The last
is the mixin smell: a method reading ``self.x`` that only another class in the MRO sets. Each source check is also
shown failing on a synthetic snippet, so that a green run means something.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch
from torch import nn

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.kfac.checkpoint import CheckpointState
from lightning_spdkfac.kfac.core import Core
from lightning_spdkfac.kfac.coverage import Coverage
from lightning_spdkfac.kfac.factor_updates import FactorStatistics
from lightning_spdkfac.kfac.guard import NonFiniteGuard
from lightning_spdkfac.kfac.inverse_steps import Inverter
from lightning_spdkfac.kfac.preconditioning import Preconditioning
from lightning_spdkfac.kfac.registration import LayerRegistry

PARTS = {"registry": LayerRegistry, "statistics": FactorStatistics, "inverter": Inverter,
         "preconditioning": Preconditioning, "coverage": Coverage, "guard": NonFiniteGuard,
         "checkpoint": CheckpointState}


def foreign_reads(source: str) -> list[str]:
    """``Class.method: self.attr`` for every ``self.attr`` a method of a class in ``source`` reads that the class
    neither assigns (``self.attr = ...`` anywhere in it) nor defines (a method, property or class attribute)."""
    found = []
    for cls in [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)]:
        own = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        own |= {t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        own |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                and n.value is not None}
        for node in ast.walk(cls):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                        own.add(el.attr)
        for node in ast.walk(cls):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                    and isinstance(node.ctx, ast.Load) and node.attr not in own and not node.attr.startswith("__")):
                found.append(f"{cls.name}: self.{node.attr}")
    return sorted(set(found))


def test_the_foreign_read_check_fails_on_a_mixin():
    mixin = textwrap.dedent('''
        class Steps:
            layers: dict

            def update(self, k):
                return [ly for ly in self.layers.values() if k % self.inv_update_steps == 0]
    ''')
    part = textwrap.dedent('''
        class Steps:
            def __init__(self, core):
                self.core = core
                self.count = 0

            def update(self, k):
                self.count += 1
                return [ly for ly in self.core.layers.values() if k % self.core.inv_update_steps == 0]
    ''')
    assert foreign_reads(mixin) == ["Steps: self.inv_update_steps", "Steps: self.layers"]
    assert foreign_reads(part) == []


@pytest.mark.parametrize("name", sorted(PARTS))
def test_each_part_reads_only_what_it_owns_or_is_given(name):
    cls = PARTS[name]
    assert cls.__mro__ == (cls, object), f"{cls.__name__} inherits from {cls.__mro__[1:-1]}: a part stands alone"
    assert foreign_reads(textwrap.dedent(inspect.getsource(cls))) == []


def test_the_preconditioner_has_no_mixin_and_holds_its_parts():
    assert KFACPreconditioner.__mro__ == (KFACPreconditioner, object)
    assert Core.__mro__ == (Core, object)
    pre = KFACPreconditioner(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), lr=0.1)
    for name, cls in PARTS.items():
        assert type(getattr(pre, name)) is cls
        if name != "guard":  # (the guard is given what it checks as arguments, not the core)
            assert getattr(pre, name).core is pre.core
    # The public attributes are the parts' own: written through the preconditioner, read in the part, and back.
    pre.damping = 0.5
    assert pre.core.damping == 0.5
    pre.inverse_fallbacks = 3
    assert pre.inverter.inverse_fallbacks == 3
    pre.skipped_precondition_steps = 2
    assert pre.preconditioning.skipped_precondition_steps == 2
    pre.final_micro_batch = False
    assert pre.statistics.final_micro_batch is False
    assert pre.layers is pre.core.layers and pre.skipped is pre.registry.skipped


def test_the_counters_round_trip_through_the_parts_that_own_them():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    pre = KFACPreconditioner(net, lr=0.1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        net(torch.randn(5, 3)).square().sum().backward()
        pre.step(opt)
        opt.step()
    pre.inverse_fallbacks, pre.skipped_precondition_steps, pre.skipped_factor_steps = 4, 5, 6
    state = pre.state_dict()
    other = KFACPreconditioner(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), lr=0.1)
    other.load_state_dict(state)
    assert (other.steps, other.inverter.inverse_fallbacks, other.preconditioning.skipped_precondition_steps,
            other.guard.skipped_factor_steps) == (2, 4, 5, 6)
    for name in pre.layers:
        torch.testing.assert_close(other.layers[name].A, pre.layers[name].A, rtol=0, atol=0)


# The non-finite guard, the first part (its counters on ``pre.guard``; public names and checkpoint keys unchanged).
def _pre(**kw: object) -> KFACPreconditioner:
    torch.manual_seed(0)
    return KFACPreconditioner(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)), lr=0.1, **kw)  # type: ignore[arg-type]


def test_the_guard_is_a_part_not_a_base() -> None:
    pre = _pre(max_bad_steps=7)
    assert NonFiniteGuard not in type(pre).__mro__ and isinstance(pre.guard, NonFiniteGuard)
    assert pre.max_bad_steps == pre.guard.max_bad_steps == 7
    pre.skipped_factor_steps = 3  # the preconditioner's attribute is the guard's
    assert pre.guard.skipped_factor_steps == 3 and not hasattr(pre.guard, "steps")
    assert "skipped_factor_steps" not in vars(pre)


def test_a_bad_step_is_counted_by_the_guard_and_checkpointed_as_before() -> None:
    pre = _pre(factor_update_steps=1, inv_update_steps=1)
    model = pre.model
    x = torch.randn(5, 4)
    x[0, 0] = float("nan")
    model(x).sum().backward()
    pre.step()
    assert pre.skipped_factor_steps == pre.guard.skipped_factor_steps == 1
    assert pre.consecutive_bad_steps == 1 and pre.last_bad_step is not None and pre.last_bad_step["step"] == 0
    state = pre.state_dict()
    assert state["skipped_factor_steps"] == 1 and state["consecutive_bad_steps"] == 1
    other = _pre(factor_update_steps=1, inv_update_steps=1)
    other.load_state_dict(state)
    assert other.guard.skipped_factor_steps == 1 and other.guard.consecutive_bad_steps == 1
