"""Comparing what rank processes returned."""

from __future__ import annotations

import torch


def assert_same(a, b) -> None:
    """Equal structures (dicts, lists, tuples) of tensors (bitwise) and plain values."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b
