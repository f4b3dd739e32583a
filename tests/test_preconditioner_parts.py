"""KFACPreconditioner is being composed of parts that own their state (issue 36) instead of mixins over one
namespace. The non-finite guard is the first: its counters live on ``pre.guard``, and the preconditioner's attributes
of the same names (public API and checkpoint keys unchanged) read and write them there."""

from __future__ import annotations

import torch
from torch import nn

from lightning_spdkfac import KFACPreconditioner
from lightning_spdkfac.kfac.guard import NonFiniteGuard


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
