"""The K-FAC summary: its bytes are what the preconditioner allocates, the memory bound stops a model at setup
before anything is allocated, and every trainable parameter is either in a block or named with its reason."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_spdkfac.kfac.options import parse_bytes
from lightning_spdkfac.kfac.preconditioner import KFACPreconditioner
from tests.helpers.memory import held_bytes


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(300, 16)
        self.conv = nn.Conv1d(16, 16, 3, padding=1, groups=4)
        self.norm = nn.LayerNorm(16)
        self.scale = nn.Parameter(torch.ones(16))  # a loose parameter of the root
        self.head = nn.Linear(16, 300)
        self.rnn = nn.GRU(16, 16)  # a type K-FAC does not handle
        self.proj = nn.Linear(300, 8)  # a diagonal A (301 > max_factor_side) with a bias

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids).transpose(1, 2)
        h = self.conv(h).transpose(1, 2)
        h, _ = self.rnn(self.norm(h) * self.scale)
        return self.proj(self.head(h))


@pytest.mark.parametrize("method", ["cholesky", "eigen"])
@pytest.mark.parametrize("inv_dtype", ["float32", "float64"])
def test_summary_bytes_are_what_is_allocated(method: str, inv_dtype: str) -> None:
    torch.manual_seed(0)
    model = Mixed()
    with pytest.warns(UserWarning, match="recurrent"):
        pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, kl_clip=None, max_factor_side=200,
                                 inverse_method=method, inv_dtype=inv_dtype)
    s = pre.summary()
    shapes = {r.name: (r.a_shape, r.g_shape) for r in s.rows}
    assert shapes == {"emb": ((300,), (16, 16)), "conv": ((4, 13, 13), (4, 4, 4)), "head": ((17, 17), (300,)),
                      "proj": ((301,), (8, 8))}
    for _ in range(2):
        model.zero_grad()
        model(torch.randint(0, 300, (3, 5))).logsumexp(-1).sum().backward()
        pre.step()
    held = held_bytes(pre)
    assert held > 0 and abs(s.total_bytes - held) <= 0.05 * held, (s.total_bytes, held)
    text = str(s)
    for needle in ("emb", "diag 300", "4 x 13x13", "diag 300", "norm.weight", "scale", "rnn.weight_ih_l0",
                   "recurrent"):
        assert needle in text, needle


def test_every_trainable_parameter_is_in_a_block_or_named() -> None:
    model = Mixed()
    with pytest.warns(UserWarning):
        pre = KFACPreconditioner(model)
    s = pre.summary()
    named = {x.name for x in s.left_out}
    in_blocks = {id(p) for ly in pre.layers.values() for p in ly.helper.params()}
    for name, p in model.named_parameters():
        assert (id(p) in in_blocks) != (name in named), name
    assert s.preconditioned + sum(x.params for x in s.left_out) == s.trainable
    assert {x.name: x.reason for x in s.left_out}["norm.weight"].startswith("a normalization layer")


def test_memory_limit_stops_at_setup_with_the_summary() -> None:
    """A 50257 x 768 head kept dense (max_factor_side raised) would need 2 x 50257^2 floats: the bound stops it
    at setup, naming the option, before a byte of it is allocated."""
    head = nn.Linear(768, 50257)
    with pytest.raises(MemoryError, match=r"memory_limit=.*nothing was allocated.*max_factor_side") as e:
        KFACPreconditioner(head, max_factor_side=100_000, memory_limit="4GB")
    assert "50257x50257" in str(e.value)
    ok = KFACPreconditioner(head, memory_limit="4GB")  # the default policy: a diagonal G, a few MiB
    assert ok.summary().total_bytes < 2**24


@pytest.mark.parametrize("text,want", [("2GB", 2 * 10**9), ("512 MiB", 512 * 2**20), ("1.5e3", 1500), (10, 10)])
def test_parse_bytes(text, want) -> None:
    assert parse_bytes("memory_limit", text) == want


@pytest.mark.parametrize("bad", ["2 parsecs", "-1GB", 0, True, "GB"])
def test_parse_bytes_refuses_by_name(bad) -> None:
    with pytest.raises((ValueError, TypeError), match="memory_limit"):
        parse_bytes("memory_limit", bad)
