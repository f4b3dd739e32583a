"""The seam between the K-FAC math and whatever runs it across processes.

:class:`KFACPreconditioner` does the math; a *distributor* decides where the cross-rank parts
happen: averaging the step's factors over ranks, and which rank inverts which factor. This
module holds the interface and the one-process implementation; the torch.distributed
implementations (D-KFAC, MPD-KFAC, SPD-KFAC) live in ``lightning_spdkfac.comm`` so that this
package never touches torch.distributed.

Contract, per optimizer step (every rank calls the same methods in the same order):

1. ``begin_step()`` before the first forward of the step (called by the preconditioner).
2. With ``pipelined`` true, the preconditioner calls ``factor_final(index, which, matrix)``
   from its hooks as soon as a layer's A (forward) or G (backward) of this step is final,
   on the micro-batch that ends the step (None: this rank has no data for it, e.g. an empty input).
   The distributor may launch communication at once.
3. ``reduce_factors(local)`` in ``step()``: ``local`` maps ``(layer index, "A" or "G")`` to
   this rank's step factor for every factor not already given to ``factor_final`` (None where
   this rank has no data for it). Returns a value for every factor of every layer: the factor
   averaged over the ranks that had data, or None where no rank had; identical on every rank.
4. ``invert(tasks, invert_fn, on_ready)`` on inverse steps: ``tasks`` lists ``(index, which,
   factor)`` in the same order on every rank; ``invert_fn(sub_list_of_tasks) -> inverses`` does
   the math; ``on_ready(index, which, inverse)`` must be called for every task on every rank,
   in any order, as soon as that inverse is available there. An inverse is what ``invert_fn``
   returned: with ``inverse_method == "eigen"`` an (n+1) x n eigen payload, else an n x n matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from ..telemetry import StepTimer
from ..vocabulary import InverseMethodName

FactorKey = tuple[int, str]  # (layer index, "A" or "G")
Task = tuple[int, str, torch.Tensor]


class Distributor:
    """One process: factors are used as they are, every inverse is computed here."""

    # True: factors are used in place and nothing crosses processes (the preconditioner's fast path).
    # A subclass is taken to move data unless it declares is_local = True itself.
    is_local: ClassVar[bool] = True
    world_size: int = 1
    rank: int = 0
    pipelined: bool = False
    inv_dtype: torch.dtype = torch.float32  # set by the preconditioner before setup()
    # Set by the preconditioner before setup(): "cholesky" inverses are n x n symmetric matrices, "eigen"
    # ones (n+1) x n eigen payloads (kfac/inverse.py); a distributor that moves them needs to know which.
    inverse_method: InverseMethodName = "cholesky"
    # The preconditioner's K-FAC settings as text (``KFACPreconditioner.settings_text``), set before setup():
    # distributors that check the plan across ranks check these too.
    kfac_settings: str = ""
    timer: StepTimer | None = None  # the preconditioner's phase timer, set before setup()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "is_local" not in cls.__dict__:
            cls.is_local = False

    def setup(self, sides: Sequence[tuple[int, int]]) -> None:
        """Called once with the (A side, G side) of every layer, in layer-index order."""

    def begin_step(self) -> None:
        """A new optimizer step starts (before its first forward)."""

    def factor_final(self, index: int, which: str, matrix: torch.Tensor | None) -> None:
        raise RuntimeError("factor_final is only called on pipelined distributors")

    def reduce_factors(self, local: dict[FactorKey, torch.Tensor | None]) -> dict[FactorKey, torch.Tensor | None]:
        return local

    def invert(
        self,
        tasks: Sequence[Task],
        invert_fn: Callable[[list[Task]], list[torch.Tensor]],
        on_ready: Callable[[int, str, torch.Tensor], None],
    ) -> None:
        for (index, which, _), inv in zip(tasks, invert_fn(list(tasks))):
            on_ready(index, which, inv)
