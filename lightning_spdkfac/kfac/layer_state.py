"""Per-layer K-FAC state: one step's accumulators, the running factors and their inverses."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.hooks import RemovableHandle

from ..factor_shapes import FactorShape
from . import factors
from .experts import fill_empty_groups
from .layer_base import LayerHelper


@dataclass(eq=False)
class KFACLayer:
    """State of one registered layer: this step's accumulators, running factors, inverses."""

    name: str
    helper: LayerHelper
    index: int = 0  # registration order: the order every rank uses for collectives
    reduce: bool = False  # K-FAC-reduce rows for this layer (factor_approx, resolved per layer type)
    # The layouts of A and G (factor_shapes: dense, diagonal or grouped), fixed at registration.
    a_shape: FactorShape = ()
    g_shape: FactorShape = ()
    # Accumulators of the current optimizer step (sums over micro-batches and calls).
    # Rows are positions (factor_approx="expand") or examples, their positions aggregated ("reduce").
    xx: torch.Tensor | None = None  # sum_r x_r x_r^T (without the bias column), in A's layout
    # sum_r x_r: the bias row/column of A (per group for a grouped A); None without a bias, and for a diagonal A,
    # which keeps no off-diagonal entry (see keeps_x_sum)
    x_sum: torch.Tensor | None = None
    rows: int = 0  # R, rows seen by A
    # Per block, the rows seen by A, where blocks see different rows (an expert stack: kfac/experts.py), on the
    # factors' device (grouped_mm's per-expert counts are never read to the host); None for any other layer.
    group_rows: torch.Tensor | None = None
    dd: torch.Tensor | None = None  # sum_r d_r d_r^T, in G's layout
    examples: int = 0  # N, examples seen (counted once per micro-batch, not per call)
    a_calls: int = 0
    g_calls: int = 0
    last_micro_batch: int = -1
    # Pipelining: calls in the current micro-batch, the count that makes a factor final
    # (learned from the previous step), and what was handed to the distributor.
    mb_a_calls: int = 0
    mb_g_calls: int = 0
    calls_per_micro_batch: int = 0
    submitted: dict[str, int] = field(default_factory=dict)  # "A"/"G" -> calls counted at submission
    # Running averages and inverses.
    A: torch.Tensor | None = None
    G: torch.Tensor | None = None
    # inverse_method="cholesky": the damped inverses (n x n); "eigen": each factor's eigen payload
    # ((n+1) x n: eigenvectors as columns, then the eigenvalues; see kfac/inverse.py).
    A_inv: torch.Tensor | None = None
    G_inv: torch.Tensor | None = None
    # "eigen": the damping resolved at the step that computed A_inv and G_inv (used until the next one).
    inv_damping: float | None = None
    # Counts the times A_inv / G_inv were replaced (an inverse step, a swap of async inverses, a load): the eigenbasis
    # mode carries its moments into a new basis when this changed (kfac/eigenbasis.py).
    inv_version: int = 0
    handles: list[RemovableHandle] = field(default_factory=list)
    # Whether autograd accumulated a gradient into the weight since the last step (a post-accumulate hook: a
    # gradient left over or set by hand does not count); the coverage check reads it (kfac/coverage.py).
    grad_seen: bool = False
    grad_watched: bool = False  # whether that hook is in place (on a weight that requires grad only)
    # Why the layer is refused after setup (its forward is not what its helper describes: kfac/forward_check.py): no
    # longer collected, left to the optimizer and named; None: collected.
    refused: str | None = None

    def reset_accumulators(self) -> None:
        self.rows = self.examples = self.a_calls = self.g_calls = 0
        self.mb_a_calls = self.mb_g_calls = 0
        self.grad_seen = False
        self.group_rows = None
        self.last_micro_batch = -1
        self.submitted.clear()

    def trainable(self) -> bool:
        """Whether all the layer's parameters require grad now (a frozen layer is left alone)."""
        return all(p.requires_grad for p in self.helper.params())

    @property
    def keeps_x_sum(self) -> bool:
        """Whether A has a bias row and column off its diagonal to accumulate (a bias, and A not diagonal)."""
        return self.helper.has_bias and len(self.a_shape) != 1

    def xx_shape(self) -> tuple[int, ...]:
        """The shape of the A accumulator: A's layout without the bias row and column."""
        n = self.helper.in_features
        if len(self.a_shape) == 1:
            return (self.a_shape[0] - int(self.helper.has_bias),)
        return (*self.a_shape[:-2], n, n)

    def step_a(self) -> torch.Tensor:
        """This step's A_new as a new tensor in A's layout (the distributed path sends it).

        Called once this step's A was accumulated (``a_calls > 0``), so ``xx`` (and ``x_sum`` where
        :attr:`keeps_x_sum`) hold this step's sums.
        """
        xx = self.xx
        assert xx is not None
        if self.group_rows is not None:  # an expert stack: each block's mean over its own rows, empty blocks kept
            A_new = xx / self.group_rows.clamp(min=1).view(-1, 1, 1).to(xx.dtype)
            fill_empty_groups(A_new, self.A, self.group_rows)
            return A_new
        if not self.helper.has_bias:
            return xx / self.rows
        A = torch.empty(self.a_shape, dtype=xx.dtype, device=xx.device)
        self._fill_a(A, xx.div(self.rows), None if self.x_sum is None else self.x_sum / self.rows, 1.0)
        return A

    def _fill_a(self, A: torch.Tensor, xx: torch.Tensor, x_mean: torch.Tensor | None, weight: float) -> None:
        """A <- A + weight (A_new - A) (weight 1: A_new) for A_new = [[xx, x_mean], [x_mean^T, 1]] in A's layout (a
        diagonal A keeps the diagonal: xx's and the bias entry 1)."""
        n = xx.shape[-1]
        parts: tuple[tuple[torch.Tensor, torch.Tensor], ...]
        if A.dim() == 1:
            parts = ((A[:n], xx),)
            A[n].fill_(1.0)  # (a fill, not `A[n] = 1.0`: a Python scalar set into a CUDA tensor is a host copy)
        else:
            assert x_mean is not None  # kept for every A with a bias that is not diagonal (keeps_x_sum)
            parts = ((A[..., :n, :n], xx), (A[..., :n, n], x_mean), (A[..., n, :n], x_mean))
            A[..., n, n].fill_(1.0)  # the mean of the constant 1s, in every step's factor (a kernel, no host copy)
        for running, new in parts:
            if weight == 1.0:
                running.copy_(new)
            else:
                running.lerp_(new, weight)  # decay*F + (1-decay)*F_new in one pass

    def step_g(self, g_scale: float | torch.Tensor) -> torch.Tensor:
        """This step's G_new as a new matrix (once this step's G was accumulated: ``g_calls > 0``)."""
        assert self.dd is not None
        G_new = self.dd * (self.examples * g_scale)
        if self.group_rows is not None:
            fill_empty_groups(G_new, self.G, self.group_rows)
        return G_new

    def fold(self, A_new: torch.Tensor, G_new: torch.Tensor, decay: float) -> None:
        """Running averages from explicit step factors (the distributed path)."""
        # A and G are set together: both None before the first fold or update.
        if (self.A is None or self.G is None or self.A.shape != A_new.shape or self.G.shape != G_new.shape
                or decay == 0.0):
            self.A, self.G = A_new.clone(), G_new.clone()
        else:
            self.A.lerp_(A_new, 1.0 - decay)
            self.G.lerp_(G_new, 1.0 - decay)
        self.flush_subnormals()

    def flush_subnormals(self) -> None:
        """Set running-factor entries below the dtype's smallest normal number to zero.

        An entry that stops receiving contributions (a unit that no longer fires) decays by
        ``factor_decay`` every step and after ~1700 steps at 0.95 becomes a subnormal float, which CPUs
        process one to two orders of magnitude slower; the inverses inherit them. Measured by
        benchmarks/soak.py: the K-FAC step grew from 4 ms to 44 ms over 6000 steps without this. Such an
        entry is below 1.2e-38 (fp32), so zero is exact to the factor's precision. One elementwise pass.
        """
        for t in (self.A, self.G):
            assert t is not None  # called right after A and G were set
            t.masked_fill_(t.abs() < torch.finfo(t.dtype).tiny, 0.0)

    def gram_diagonals(self) -> list[torch.Tensor]:
        """Sums of the diagonals of this step's Gram sums.

        Enough to detect any non-finite value: a NaN or inf in the rows lands on the diagonal,
        and by Cauchy-Schwarz a finite diagonal bounds every off-diagonal entry and the bias sum.
        """
        assert self.xx is not None and self.dd is not None  # a collected layer: a_calls == g_calls > 0
        return [factors.trace_sum(self.xx), factors.trace_sum(self.dd)]

    def update_factors(self, decay: float, g_scale: float | torch.Tensor) -> None:
        """Fold this step's factors into the running averages, in place (see docs/math.md).

        A_new = [[xx, x_sum], [x_sum^T, R]] / R and G_new = N * g_scale * dd. The accumulators
        are scaled in place (they are refilled next step), so no factor-sized temporary is made.
        """
        # A collected layer (a_calls == g_calls > 0): this step's sums are there.
        assert self.xx is not None and self.dd is not None
        A, G = self.A, self.G  # set together: both None before the first update
        if A is None or G is None or A.shape != self.a_shape or G.shape != self.dd.shape:
            first = True
            A = self.A = torch.empty(self.a_shape, dtype=self.xx.dtype, device=self.xx.device)
            G = self.G = torch.empty_like(self.dd)
        else:
            first = False
        weight = 1.0 if first else 1.0 - decay
        if self.group_rows is not None:  # an expert stack: per-block means; a block with no rows keeps its factors
            xx = self.xx.div_(self.group_rows.clamp(min=1).view(-1, 1, 1).to(self.xx.dtype))
            dd = self.dd.mul_(self.examples * g_scale)
            fill_empty_groups(xx, None if first else A, self.group_rows)
            fill_empty_groups(dd, None if first else G, self.group_rows)
        else:
            xx = self.xx.mul_(1.0 / self.rows)
            dd = self.dd.mul_(self.examples * g_scale)
        if self.helper.has_bias:
            self._fill_a(A, xx, None if self.x_sum is None else self.x_sum.mul_(1.0 / self.rows), weight)
        elif weight == 1.0:
            A.copy_(xx)
        else:
            A.lerp_(xx, weight)
        if weight == 1.0:
            G.copy_(dd)
        else:
            G.lerp_(dd, weight)
        self.flush_subnormals()


def _sum32(t: torch.Tensor) -> torch.Tensor:
    """Sum of a tensor, accumulated and returned in at least float32 (an fp16 sum can overflow)."""
    return t.sum() if t.dtype == torch.float64 else t.sum(dtype=torch.float32)
