"""What a preconditioner actually holds: the bytes of every tensor of its layers' state, counted from the tensors
themselves (the independent side of the K-FAC summary's estimate)."""

from __future__ import annotations


def held_bytes(pre) -> int:
    """Bytes of the running factors, inverses and step accumulators held now."""
    return sum(t.numel() * t.element_size() for ly in pre.layers.values()
               for t in (ly.A, ly.G, ly.A_inv, ly.G_inv, ly.xx, ly.dd, ly.x_sum) if t is not None)
