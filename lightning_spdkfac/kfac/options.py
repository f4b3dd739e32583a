"""``KFACOptions``: the K-FAC hyperparameters, validated once.

The preconditioner takes them (``KFACPreconditioner(model, options)`` or the same fields as keyword
arguments), and the ``KFAC`` callback builds them in its constructor, so a bad value fails when it is
given, under the package's one rule (:mod:`lightning_spdkfac.validation`): a wrong type raises
``TypeError``, a value that is not accepted ``ValueError``, and the message names the argument, the
value and what is accepted. The defaults here are the only ones: the callback's and the
preconditioner's signatures read them.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .. import validation as val
from ..vocabulary import (
    FACTOR_APPROXES,
    GRAFTINGS,
    INVERSE_METHODS,
    STEP_SIZES,
    UPDATES,
    FactorApproxName,
    GraftingName,
    InverseMethodName,
    StepSizeName,
    UpdateName,
)

FACTOR_DTYPES = ("float32", "float64", "bfloat16", "float16")
INV_DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class KFACOptions:
    """K-FAC hyperparameters.

    Args:
        damping: Tikhonov damping of each layer's Kronecker-factored curvature block A (x) G (>= 0),
            split between the factors by pi-balancing: A + pi sqrt(damping) I and
            G + sqrt(damping)/pi I, so that every direction of the block is damped by at least
            ``damping`` (not ``damping**2``); see docs/math.md. A number or a schedule (a callable of
            the optimizer step: called once with step 0 here, so that one that fails fails at construction, and
            checked again at every step; so are ``factor_decay``, ``kl_clip`` and ``lr``), or ``"auto"`` (the
            default): 1e-3 under an Adam-type optimizer, 3e-2 under any other and in the eigenbasis mode, chosen by
            the first optimizer that steps (:mod:`lightning_spdkfac.kfac.auto_damping` has the rule and the
            measurements behind it).
        factor_decay: running-average decay of the factors, in [0, 1); 0 uses the current batch alone.
        kl_clip: KL-clip bound (> 0), or None to turn clipping off.
        lr: the learning rate the KL clip assumes: a number or a callable of the step, or None (the
            default): the learning rate of each layer's param group in the optimizer passed to
            ``KFACPreconditioner.step(optimizer)``, read at every step.
        factor_update_steps: factors are updated every this many steps.
        inv_update_steps: inverses are recomputed every this many steps.
        skip_layers: regular expressions (one string or several); a module whose name or class
            name matches one is left alone. Stored as a tuple of strings.
        factor_dtype: dtype of the stored factors: one of :data:`FACTOR_DTYPES`, as a name
            ("float64", also "torch.float64" and torch's aliases) or a ``torch.dtype``.
        inv_dtype: dtype of the inversion and of the preconditioning matmuls (float32 or float64).
        max_bad_steps: consecutive factor steps with non-finite values after which ``step()``
            raises (None: never); see :class:`~lightning_spdkfac.kfac.KFACPreconditioner`.
        factor_approx: how layers with weight sharing (Conv2d; Linear on inputs with more than two
            dims) form their factors: ``"expand"`` (one row per position, KFC) or ``"reduce"`` (one row
            per example, aggregated over its positions: ~positions times fewer factor flops), or
            ``"auto"`` (the default: reduce for Conv2d, expand for Linear, each type's measured winner).
            All are identical for 2-D Linear inputs. See docs/math.md.
        inverse_method: how each layer's damped block (A (x) G + damping I) is inverted: ``"cholesky"``
            (each factor by Cholesky, the damping split between them by pi-balancing: at least
            ``damping`` in every direction) or ``"eigen"`` (eigendecompositions of A and G, the block
            damped by exactly ``damping``: costlier per inversion, exact). See docs/math.md.
        async_inverses: on an inverse step, precondition with the inverses already held and compute the
            new ones (and, distributed, broadcast them) on a worker thread (a side stream on CUDA) during
            the optimizer step and the next forward/backward; the next ``step()`` swaps them in, waiting
            only for what is not done yet. The inverses used are then exactly one step staler: step k
            uses those of the last inverse step before k (a layer's first inverses are computed at once).
            See docs/math.md, "Asynchronous inverses". A distributed strategy's own ``async_inverses``,
            when set, decides instead.
        grafting: None (default), or rescale each layer's preconditioned gradient to the norm of the
            direction another optimizer would take: ``"sgd"`` (the gradient's norm: an lr tuned for SGD
            carries over) or ``"adam"`` (Adam's direction without momentum, from a second moment kept
            here; for an SGD-type base optimizer at an lr tuned for Adam). See
            :mod:`lightning_spdkfac.kfac.grafting`.
        max_factor_side: the largest factor side kept as a dense matrix; a side above it (an LM head's
            vocabulary, a very wide MLP) is kept diagonal: ``n`` entries instead of ``n x n``, inverted
            elementwise. The default, 4608, is the measured limit (benchmarks/hf_models.py --only max-side;
            docs/results/models.md): a side holds at most 243 MiB (factor, Gram sum and inverse in float32) and
            inverts in 1.9 s on one CPU thread (8192: 768 MiB and 9.5 s). It keeps every 3x3 convolution of up to
            512 channels (ResNet, VGG), BERT-large's and GPT-2 medium's 4096 dense, while GPT-2 large's 5120,
            Llama-7B's 11008 and every vocabulary are diagonal (docs/math.md, "Diagonal and grouped factors").
        memory_limit: None, or the most bytes K-FAC may hold at once (per rank under dpkfac), as an int or a
            string with a unit ("2GB", "512MiB"). It bounds the peak of an inverse step, not only what is held
            between steps: the factors, accumulators, inverses and async copy (the summary's steady state) plus
            the step's workspace (the inversions' stacks and eigendecomposition work arrays, the preconditioned
            gradients); both are in the K-FAC summary, computed from the layouts. A model whose peak is above it
            stops at setup with both numbers, the summary and the fixes named, before anything is allocated.
        step_size: None (the default: the KL clip alone bounds the step), or rescale the optimizer's whole update
            after each ``optimizer.step()`` by the minimizer of the exact damped quadratic model of the loss along
            it (Martens & Grosse 2015): ``"quadratic"`` (``alpha u``) or ``"quadratic_momentum"`` (``alpha u + mu
            delta``, delta the previous update; meant for SGD without momentum). It needs the loss as a function of
            the model's outputs: the LightningModule's ``kfac_loss_parts(batch)`` (plain PyTorch:
            ``step(optimizer, loss_parts=...)``). See :mod:`lightning_spdkfac.kfac.step_size` and docs/math.md.
        step_size_every: the quadratic model is measured every this many steps (one forward-mode pass of the model
            on the batch and one all-reduce of three scalars); its alpha is reused in between.
        step_size_clip: ``(low, high)``, the range alpha is clipped to (0 < low <= 1 <= high).
        step_size_damping: the quadratic model's damping lambda (>= 0); None: K-FAC's ``damping`` at that step.
        adapt_damping: Levenberg-Marquardt adaptation of ``damping`` (Martens & Grosse 2015, section 6.5): at each
            measurement of the quadratic model (every ``step_size_every`` steps; with or without ``step_size``), one
            more forward gives the loss's actual change on the batch, and the damping shrinks when the model
            predicted it well (ratio above 3/4) and grows when it did not (below 1/4), by 0.95**step_size_every,
            within [1e-6, 10], starting from ``damping`` (which must then be a number). Needs ``kfac_loss_parts``
            like ``step_size``.
        capture: how layers whose weight is used through a function (``F.linear(x, self.qkv.weight)``,
            ``w @ x``, ``F.conv2d(x, self.conv.weight, ...)``, ``F.embedding``) get their factors
            (kfac/capture.py): ``"auto"`` (the default) follows, from the next factor step on, every layer found
            on a factor step with a gradient but no module call, at the cost of a torch-function mode active only
            during the forward of the modules that hold such weights (nothing for a model that needs none);
            ``True`` follows every layer from the first step; ``False`` never (such layers are named in a warning
            and in the summary). Expert stacks and routers holding a bare weight (kfac/experts.py) are always
            followed.
        update: K-FAC's direction: ``"kfac"`` (the default) applies the damped inverse of each block to the
            gradient; ``"eigen_adam"`` rotates the gradient into the Kronecker eigenbasis of the factors, divides each
            entry by the root of its running second moment there (EKFAC/SOAP-style) and rotates back
            (kfac/eigenbasis.py, docs/math.md "The eigenbasis mode"). It needs the factors' eigendecompositions:
            ``inverse_method`` is ``"eigen"`` under it. Its direction has Adam's per-entry scale, so the base optimizer
            is run at an Adam-like learning rate (SGD with momentum, or Muon).
        eigen_beta2: ``update="eigen_adam"``: the decay of the running second moment, in [0, 1).
        eigen_eps: ``update="eigen_adam"``: added to the root of the second moment (> 0).
    """

    # The defaults are the winners of benchmarks/time_to_accuracy.py (docs/results/time-to-accuracy.md): the
    # damping by the optimizer (kfac/auto_damping.py); factors every 5 steps and inverses
    # every 50 reached the targets sooner in seconds than every 1/10 (same epochs, a cheaper step). The
    # paper's every-step timing setting is a configuration of the schedule benchmarks, not a default.
    damping: val.HParam | Literal["auto"] = "auto"
    factor_decay: val.HParam = 0.95
    kl_clip: val.HParam | None = 1e-3
    lr: val.HParam | None = None
    factor_update_steps: int = 5
    inv_update_steps: int = 50
    skip_layers: str | Iterable[str] = ()
    factor_dtype: str | torch.dtype = torch.float32
    inv_dtype: str | torch.dtype = torch.float32
    max_bad_steps: int | None = 100
    factor_approx: FactorApproxName = "auto"
    inverse_method: InverseMethodName = "cholesky"
    async_inverses: bool = False
    grafting: GraftingName | None = None
    max_factor_side: int = 4608
    memory_limit: int | str | None = None
    step_size: StepSizeName | None = None
    step_size_every: int = 5
    step_size_clip: tuple[float, float] = (0.1, 10.0)
    step_size_damping: float | None = None
    adapt_damping: bool = False
    capture: bool | str = "auto"
    update: UpdateName = "kfac"
    eigen_beta2: float = 0.95
    eigen_eps: float = 1e-8

    def __post_init__(self) -> None:
        # A schedule is called once with step 0 here (probe): one that cannot be called with the step, raises or
        # returns something out of range fails at construction (a YAML config's, a plain loop's), not at a step.
        if self.damping != "auto":  # (resolved by the optimizer that steps: kfac/auto_damping.py)
            val.check_schedule("damping", self.damping, val.NONNEGATIVE, " (or 'auto', the default: 1e-3 under an "
                               "Adam-type optimizer, else 3e-2)", probe=True)
        val.check_schedule("factor_decay", self.factor_decay, val.DECAY, probe=True)
        val.check_schedule("kl_clip", self.kl_clip, val.POSITIVE, " (use kl_clip=None to turn clipping off)",
                           probe=True, optional=True)
        val.check_schedule("lr", self.lr, val.NONNEGATIVE, " (None: the optimizer's own, per param group)",
                           probe=True, optional=True)
        val.check_positive_int("factor_update_steps", self.factor_update_steps)
        val.check_positive_int("inv_update_steps", self.inv_update_steps)
        if self.max_bad_steps is not None:  # None: never raise
            val.check_int("max_bad_steps", self.max_bad_steps, low=1, accepted=(
                "None (never raise) or a positive integer (consecutive factor steps with non-finite values "
                "before K-FAC raises)"))
        val.check_choice("factor_approx", self.factor_approx, FACTOR_APPROXES)
        val.check_choice("inverse_method", self.inverse_method, INVERSE_METHODS)
        val.check_bool("async_inverses", self.async_inverses)
        val.check_choice("grafting", self.grafting, GRAFTINGS, optional=True)
        val.check_positive_int("max_factor_side", self.max_factor_side)
        val.check_choice("step_size", self.step_size, STEP_SIZES, optional=True)
        val.check_positive_int("step_size_every", self.step_size_every)
        object.__setattr__(self, "step_size_clip", step_size_clip(self.step_size_clip))
        val.check_real("step_size_damping", self.step_size_damping, val.NONNEGATIVE, optional=True)
        val.check_bool("adapt_damping", self.adapt_damping)
        if self.capture not in (True, False, "auto"):
            raise ValueError(f"capture must be 'auto' (follow the layers found used through functions), True (every "
                             f"layer from the start) or False (never; such layers are named), got {val.show(self.capture)}")
        if self.adapt_damping and callable(self.damping):
            raise ValueError("adapt_damping=True adapts the damping from its starting value: damping must be a number, "
                             "not a schedule (pass a number, or adapt_damping=False to keep the schedule)")
        val.check_choice("update", self.update, UPDATES)
        val.check_real("eigen_beta2", self.eigen_beta2, val.DECAY)
        val.check_real("eigen_eps", self.eigen_eps, val.POSITIVE)
        if self.update == "eigen_adam":  # its basis is the factors' eigendecompositions, computed as eigen payloads
            object.__setattr__(self, "inverse_method", "eigen")
        if self.memory_limit is not None:
            object.__setattr__(self, "memory_limit", parse_bytes("memory_limit", self.memory_limit))
        object.__setattr__(self, "skip_layers", patterns("skip_layers", self.skip_layers))
        object.__setattr__(self, "factor_dtype", dtype("factor_dtype", self.factor_dtype, FACTOR_DTYPES))
        object.__setattr__(self, "inv_dtype", dtype("inv_dtype", self.inv_dtype, INV_DTYPES))
        if self.inv_update_steps % self.factor_update_steps != 0:
            warnings.warn(
                f"inv_update_steps={self.inv_update_steps} is not a multiple of factor_update_steps="
                f"{self.factor_update_steps}: some inverses will be computed from factors a few steps old",
                stacklevel=4,
            )

    @classmethod
    def build(cls, options: KFACOptions | None = None, **overrides: Any) -> KFACOptions:
        """``options`` (or the defaults) with ``overrides`` applied; an unknown name is a TypeError."""
        if options is not None and not isinstance(options, KFACOptions):
            raise TypeError(f"options must be None or a KFACOptions, got {val.show(options)}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise TypeError(f"{unknown[0]!r} is not a K-FAC option; the options are {', '.join(names)}")
        if options is None:
            return cls(**overrides)
        return dataclasses.replace(options, **overrides) if overrides else options


def dtype(name: str, value: object, accepted: tuple[str, ...]) -> torch.dtype:
    """A floating torch dtype given as a dtype or a name ("float64", "torch.float64", "double") in ``accepted``."""
    names = ", ".join(repr(a) for a in accepted)
    what = f"a torch dtype name such as 'float32' or 'float64' (one of {names}) or that torch.dtype"
    if isinstance(value, torch.dtype):
        dt: object = value
    elif isinstance(value, str):
        dt = getattr(torch, value.removeprefix("torch."), None)  # torch's aliases too ("double", "half")
    else:
        raise TypeError(f"{name} must be {what}, got {val.show(value)}")
    if not isinstance(dt, torch.dtype) or str(dt).removeprefix("torch.") not in accepted:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return dt


def patterns(name: str, value: object) -> tuple[str, ...]:
    """Regular expressions as a tuple of strings (a single string is one pattern)."""
    what = "a regular expression or a list of them (strings)"
    if isinstance(value, str):
        value = (value,)
    elif isinstance(value, (bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be {what}, got {val.show(value)}")
    found = tuple(value)  # once: a generator would be empty the second time it is read
    for i, p in enumerate(found):
        if not isinstance(p, str):
            raise TypeError(f"{name} must be {what}, got {val.show(p)} at index {i} of {val.show(value)}")
        try:
            re.compile(p)
        except re.error as e:
            raise ValueError(f"{name} must be {what}, got {p!r}, which is not a valid regular expression: {e}") \
                from None
    return found


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(name: str, value: object) -> int:
    """A byte count from an int or a string such as ``"2GB"``, ``"512 MiB"`` or ``"1.5e9"``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number of bytes or a string like '2GB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
        return value
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(digits):]
        try:
            number = float(digits)
        except ValueError:
            number = -1.0
        if unit in _UNITS and number > 0:
            return int(number * _UNITS[unit])
    raise ValueError(f"{name} must be a positive number of bytes or a string like '2GB' or '512MiB' (units: "
                     f"{', '.join(u for u in _UNITS if u)}), got {value!r}")


def step_size_clip(value: object) -> tuple[float, float]:
    """``step_size_clip`` as a (low, high) tuple of floats with 0 < low <= 1 <= high, or a ValueError naming it."""
    pair = val.check_reals("step_size_clip", value, val.POSITIVE)
    if len(pair) != 2 or not pair[0] <= 1.0 <= pair[1] or not all(map(math.isfinite, pair)):
        raise ValueError(f"step_size_clip must be (low, high) with 0 < low <= 1 <= high, both finite (alpha's range), "
                         f"got {val.show(value)}")
    return (float(pair[0]), float(pair[1]))
