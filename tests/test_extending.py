"""The snippets of docs/extending.md run as written, and the registered channels-first map gets the same K-FAC
update as the same map written as an nn.Linear."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def _snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_snippets_run_and_match_a_linear_reference() -> None:
    blocks = _snippets()
    assert len(blocks) == 3  # the signature line, and the two examples
    ns: dict = {}
    exec(compile(blocks[1] + "\n" + blocks[2], str(DOC), "exec"), ns)  # noqa: S102 - our own documentation
    pre = ns["pre"]
    assert list(pre.layers) == [""]
    # The same map as an nn.Linear on B x T x in: the same preconditioned gradient.
    KFACPreconditioner = ns["KFACPreconditioner"]
    torch.manual_seed(0)
    custom = ns["ChannelsFirstLinear"](4, 3)
    linear = nn.Linear(4, 3, bias=False)
    linear.weight.data.copy_(custom.weight.data)
    x = torch.randn(2, 4, 5)
    grads = []
    for module, inp in ((custom, x), (linear, x.transpose(1, 2))):
        p = KFACPreconditioner(module, factor_update_steps=1, inv_update_steps=1, kl_clip=None)
        module(inp).square().sum().backward()
        p.step()
        grads.append(module.weight.grad.clone())
        p.remove_hooks()
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_registry_rejects_bad_input_by_name() -> None:
    import pytest

    from lightning_spdkfac import register_layer_type
    from lightning_spdkfac.kfac.layers import LinearHelper

    with pytest.raises(ValueError, match="module_type"):
        register_layer_type("Conv1D", LinearHelper)
    with pytest.raises(TypeError, match="module_type"):
        register_layer_type(int, LinearHelper)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="helper"):
        register_layer_type(nn.Linear, None)  # type: ignore[arg-type]
