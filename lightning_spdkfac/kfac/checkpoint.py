"""Checkpoint state of the preconditioner: what it saves, and the verification of what it loads.

:class:`CheckpointState` is a part of :class:`~lightning_spdkfac.kfac.KFACPreconditioner`. Loading
verifies everything before it assigns anything: a state of another model or a corrupt one raises one
ValueError listing every problem found, and leaves the preconditioner exactly as it was.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Mapping
from typing import Any, TypeGuard

import torch

from ..factor_shapes import FactorShape, inverse_shape, preconditioned_shape
from ..vocabulary import FACTOR_APPROXES, INVERSE_METHODS
from .core import Core
from .factor_updates import FactorStatistics
from .grafting import AdamGraftState
from .guard import NonFiniteGuard
from .inverse_steps import Inverter
from .layer_state import KFACLayer
from .preconditioning import Preconditioning
from .registration import LayerRegistry
from .step_size import QuadraticStepSize, check_step_size_state

# 2: adds 'layer_dims' (every registered layer and its factor sides); 3: 'layer_dims' holds each factor's shape, an
# int n for a dense n x n factor (all a version-2 state has), a list for a diagonal [n] or grouped [b, n, n] one.
STATE_VERSION = 3
# Counters saved with the state (each optional when loading: older states lack some).
COUNTERS = ("skipped_factor_steps", "skipped_precondition_steps", "consecutive_bad_steps", "inverse_fallbacks")


FactorPair = tuple[FactorShape, FactorShape]


def layer_shapes(ly: KFACLayer) -> FactorPair:
    """The shapes of a layer's A and G (``ly.a_shape`` / ``ly.g_shape``; dense ``a_dim x a_dim`` and
    ``g_dim x g_dim`` for a layer that does not say)."""
    a = tuple(getattr(ly, "a_shape", ()) or (ly.helper.a_dim, ly.helper.a_dim))
    g = tuple(getattr(ly, "g_shape", ()) or (ly.helper.g_dim, ly.helper.g_dim))
    return a, g


def _saved_shape(shape: FactorShape) -> int | list[int]:
    """How 'layer_dims' stores a shape: n for (n, n) (what every version-2 state holds), else the list."""
    return shape[0] if len(shape) == 2 else list(shape)


def _show(shape: FactorShape) -> str:
    return str(shape[0]) if len(shape) == 2 else str(shape)


def _show_pair(pair: FactorPair) -> str:
    return f"({_show(pair[0])}, {_show(pair[1])})"


class CheckpointState:
    """A part of the preconditioner that saves and loads its state: it owns no state of its own but reads and
    restores the other parts' (the running factors and inverses of ``core.layers``, the counters of each part, the
    grafting moments, the step size rule's state)."""

    def __init__(self, core: Core, registry: LayerRegistry, statistics: FactorStatistics, inverter: Inverter,
                 preconditioning: Preconditioning, guard: NonFiniteGuard, step_size: QuadraticStepSize | None) -> None:
        self.core = core
        self.registry = registry
        self.statistics = statistics
        self.inverter = inverter
        self.preconditioning = preconditioning
        self.guard = guard
        self.step_size = step_size

    def _counters(self) -> dict[str, tuple[object, str]]:
        """Each saved counter (``COUNTERS``) and the part that owns it."""
        return {"skipped_factor_steps": (self.guard, "skipped_factor_steps"),
                "consecutive_bad_steps": (self.guard, "consecutive_bad_steps"),
                "skipped_precondition_steps": (self.preconditioning, "skipped_precondition_steps"),
                "inverse_fallbacks": (self.inverter, "inverse_fallbacks")}

    def _layer_states(self) -> dict[int, tuple[Any, ...]]:
        """Every layer's (A, G, A_inv, G_inv, inverse damping) by index. Under distributed preconditioning
        (``schedule="dpkfac"``) each rank holds its own layers only: the others are gathered from their owners
        (a collective: every rank calls :meth:`state_dict` at the same point; received tensors are on the host),
        so the state is complete on every rank and independent of the world size."""
        core = self.core
        own = {ly.index: (ly.A, ly.G, ly.A_inv, ly.G_inv, ly.inv_damping) for ly in core.layers.values()}
        owners = core.distributor.layer_owners
        if owners is None:
            return own
        sharing = core.sharing()
        rank = core.distributor.rank
        held = {i: v for i, v in own.items() if owners[i] == rank}
        shapes = []
        method = core.options.inverse_method
        for ly in sorted(core.layers.values(), key=lambda ly: ly.index):
            a, g = layer_shapes(ly)
            shapes.append((a, g, inverse_shape(a, method), inverse_shape(g, method)))
        states = sharing.gather_layers(held, shapes, (core.factor_dtype, core.inv_dtype))
        return {i: states.get(i, (None, None, None, None, None)) for i in own}

    def state_dict(self) -> dict[str, Any]:
        """Everything the next step needs: counters, running factors and current inverses.

        ``inverse_method`` says what the inverses are (n x n damped inverses, or (n+1) x n eigen payloads);
        with ``"eigen"``, ``inverse_damping`` holds each layer's damping of its payloads (that of the step
        that computed them, which a damping schedule may have changed since).

        ``layer_dims`` names every registered layer with its factor shapes ``[A, G]`` (each an int n for a dense
        n x n factor, else the list: ``[n]`` diagonal, ``[b, n, n]`` grouped), layers without factors yet
        included, so that :meth:`load_state_dict` recognizes a state of another model.

        With ``async_inverses``, inversions still in flight are waited for and swapped in first, as the next
        :meth:`step` would do before using them: the state is that of a step boundary, and a run resumed
        from it continues exactly (its next step finds nothing in flight and uses the same inverses).
        """
        core = self.core
        self.inverter.settle()
        held = self._layer_states()
        layers: dict[str, dict[str, torch.Tensor | None]] = {}
        for name, ly in core.layers.items():
            A, G, A_inv, G_inv, _ = held[ly.index]
            if A is None:
                continue
            layers[name] = {"A": A, "G": G, "A_inv": A_inv, "G_inv": G_inv}
        extra: dict[str, Any] = {}
        by_index = {ly.index: name for name, ly in core.layers.items()}
        moments = {by_index[i]: {"v": st.v, "t": st.t} for i, st in self.preconditioning.graft_states.items() if st.v is not None}
        if moments:  # grafting="adam" (kfac/grafting.py)
            extra["grafting_moments"] = moments
        if self.step_size is not None:  # step_size="quadratic..." (kfac/step_size.py): alpha, mu, the last update
            extra["step_size"] = self.step_size.state_dict()
        eigen = self.preconditioning.eigen_moments
        if eigen is not None:  # update="eigen_adam" (kfac/eigenbasis.py): the moments in the saved inverses' basis
            extra["eigen_moments"] = eigen.saved(core.layers, None if core.owners is None else
                                                 core.sharing().gather_layers, core.inv_dtype)
        if core.options.inverse_method != "cholesky":  # a cholesky state is what it was before the option
            extra["inverse_method"] = core.options.inverse_method
            extra["inverse_damping"] = {name: held[ly.index][4] for name, ly in core.layers.items()
                                        if held[ly.index][2] is not None and held[ly.index][4] is not None}
        return {
            "version": STATE_VERSION,
            "steps": core.steps,
            "skipped_factor_steps": self.guard.skipped_factor_steps,
            # optional counters (older states lack them): a resumed run continues the same counts, and
            # max_bad_steps sees a bad streak that spans the checkpoint
            "skipped_precondition_steps": self.preconditioning.skipped_precondition_steps,
            "consecutive_bad_steps": self.guard.consecutive_bad_steps,
            "inverse_fallbacks": self.inverter.inverse_fallbacks,
            # optional too: factors of the two approximations have the same shapes but not the same meaning
            "factor_approx": core.options.factor_approx,
            "layer_dims": {name: [_saved_shape(s) for s in layer_shapes(ly)] for name, ly in core.layers.items()},
            "layers": layers,
            **extra,
        }

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Raise the ValueError :meth:`load_state_dict` would raise for ``state``; change nothing."""
        self._verify_state(state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Everything is verified before anything changes: a state of another model (layers missing or
        unexpected, other factor shapes) or a corrupt one (missing keys, wrong types, non-tensor
        entries, tensors of the wrong shape or dtype, non-finite values, a version from a newer
        release) raises one ValueError listing every problem, and the preconditioner is left exactly
        as it was. Registered layers without factors in the state start without factors, and factor
        statistics collected since the last :meth:`step` are dropped.
        """
        core = self.core
        factors = self._verify_state(state)
        self.inverter.settle(keep=False)  # inversions of the replaced state's factors: never swapped in
        loaded = {}  # converted first: nothing is assigned unless every tensor converted
        for name, (A, G, A_inv, G_inv) in factors.items():
            dev = core.layers[name].helper.params()[0].device
            loaded[name] = (
                A.to(device=dev, dtype=core.factor_dtype).clone(),
                G.to(device=dev, dtype=core.factor_dtype).clone(),
                None if A_inv is None else A_inv.to(device=dev, dtype=core.inv_dtype).clone(),
                None if G_inv is None else G_inv.to(device=dev, dtype=core.inv_dtype).clone(),
            )
        saved_method, method = state.get("inverse_method", "cholesky"), core.options.inverse_method
        dampings = state.get("inverse_damping") or {}
        owners = core.distributor.layer_owners
        for name, layer in core.layers.items():
            layer.A, layer.G, layer.A_inv, layer.G_inv = loaded.get(name, (None, None, None, None))
            layer.inv_version += 1
            layer.inv_damping = float(dampings[name]) if name in dampings else None
            if owners is not None and owners[layer.index] != core.distributor.rank:  # another rank's layer
                layer.A = layer.G = layer.A_inv = layer.G_inv = layer.inv_damping = None
            if saved_method != method:  # never use an inverse of the other kind: recomputed at the next step
                layer.A_inv = layer.G_inv = layer.inv_damping = None
        if saved_method != method:
            warnings.warn(
                f"the K-FAC state was saved with inverse_method={saved_method!r} and this run uses {method!r}: "
                "the stored inverses are dropped and recomputed from the loaded factors at the next step "
                f"(resume with inverse_method={saved_method!r} to continue exactly)",
                stacklevel=2,
            )
        # A state is the start of step ``steps``: statistics the hooks collected since the last step() belong
        # to another trajectory (Lightning's lr finder and batch-size finder run throwaway steps without
        # this callback, then restore their checkpoint, and the same fit trains on) and are dropped.
        self.statistics.drop_collected()
        moments = self.preconditioning.graft_states
        moments.clear()
        for name, entry in (state.get("grafting_moments") or {}).items():
            st = moments[core.layers[name].index] = AdamGraftState()
            st.v = entry["v"].to(device=core.layers[name].helper.params()[0].device, dtype=torch.float64).clone()
            st.t = int(entry["t"])
        if self.preconditioning.eigen_moments is not None:
            self.preconditioning.eigen_moments.load(
                state.get("eigen_moments") or {}, core.layers,
                lambda ly: owners is None or owners[ly.index] == core.distributor.rank, core.inv_dtype)
        if self.step_size is not None and "step_size" in state:
            self.step_size.load_state_dict(state["step_size"], dict(core.model.named_parameters()))
        core.steps = int(state["steps"])
        for key, (part, attr) in self._counters().items():
            setattr(part, attr, int(state.get(key, 0)))
        saved, ours = state.get("factor_approx"), core.options.factor_approx
        if saved is not None and saved != ours:
            warnings.warn(
                f"the K-FAC state was saved with factor_approx={saved!r} and this run uses {ours!r}: the "
                f"loaded running factors are {saved!r} factors (same shapes, another approximation of the "
                f"curvature) until the running average replaces them; resume with factor_approx={saved!r} "
                "to continue exactly, or load_state='skip' to start K-FAC fresh",
                stacklevel=2,
            )

    def _verify_state(self, state: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
        """The factors of ``state`` by layer name, or a ValueError listing every problem found."""
        version = _check_header(state)
        corrupt: list[str] = []
        mismatch: list[str] = []
        _check_counters(state, version, corrupt)
        if "step_size" in state:
            corrupt.extend(check_step_size_state(state["step_size"]))
        if "factor_approx" in state and state["factor_approx"] not in FACTOR_APPROXES:
            corrupt.append(f"'factor_approx' must be one of {FACTOR_APPROXES}, got {state['factor_approx']!r}")
        method = state.get("inverse_method", "cholesky")
        if method not in INVERSE_METHODS:
            corrupt.append(f"'inverse_method' must be one of {INVERSE_METHODS}, got {method!r}")
            method = "cholesky"
        # Which layers the state was saved for: 'layer_dims' (version 2: ints; 3: shapes), else the layers with factors.
        dims = None
        if "layer_dims" in state:
            dims = _layer_dims(state["layer_dims"], corrupt)
        elif _is_count(version) and int(version) >= 2:
            corrupt.append("missing 'layer_dims' (every state of version 2 or later has it)")
        layers = state["layers"]
        if not isinstance(layers, Mapping):
            corrupt.append(f"'layers' must be a dict of layer name -> factors, got a {type(layers).__name__}")
            layers = {}
        # A layer held aside as frozen at setup that the state has factors or dims for (saved once it trained, as
        # on resuming a fine-tuning run): registered now, as it would be once it trains.
        self.registry.register_frozen({n for n in (dims if dims is not None else layers) if isinstance(n, str)})
        self._check_layer_names(dims, layers, mismatch)
        factors = self._check_factors(dims, layers, corrupt, mismatch, method)
        if method == "eigen":
            _check_inverse_damping(state.get("inverse_damping"), factors, corrupt)
        if dims is not None:
            self._check_sides_without_factors(dims, layers, mismatch)
        self._check_graft_moments(state.get("grafting_moments"), corrupt)
        self._check_graft_moments(state.get("eigen_moments"), corrupt, "eigen_moments")
        if mismatch or corrupt:
            what = " and ".join(w for w, p in (("does not match this model", mismatch), ("is corrupt", corrupt)) if p)
            lines = mismatch + corrupt
            raise ValueError(
                f"K-FAC state {what} ({len(lines)} problem{'s' if len(lines) > 1 else ''}); nothing was "
                "loaded:\n  " + "\n  ".join(lines) + "\n" + _SKIP_HINT
            )
        return factors

    def _check_graft_moments(self, moments: Any, corrupt: list[str], key: str = "grafting_moments") -> None:
        """``grafting_moments`` or ``eigen_moments`` (optional): layer name -> {"v": a finite non-negative tensor of
        the gradient matrix's shape, "t": count}."""
        if moments is None:
            return
        if not isinstance(moments, Mapping):
            corrupt.append(f"{key!r} must be a dict of layer name -> moments, got a {type(moments).__name__}")
            return
        for name, entry in moments.items():
            layer = self.core.layers.get(name) if isinstance(name, str) else None
            if layer is None:
                corrupt.append(f"{key!r} names {name!r}, not a K-FAC layer of this model")
                continue
            v, t = (entry.get("v"), entry.get("t")) if isinstance(entry, Mapping) else (None, None)
            want = preconditioned_shape(*layer_shapes(layer))  # the gradient matrix's shape
            if (not isinstance(v, torch.Tensor) or tuple(v.shape) != want or not _is_count(t)
                    or not bool(torch.isfinite(v).all()) or bool((v < 0).any())):
                corrupt.append(f"layer {name!r}: its {key.replace('_', ' ')} must be {{'v': a finite non-negative "
                               f"{' x '.join(map(str, want))} tensor, 't': a count}}, got {entry!r:.120}")

    def _check_layer_names(self, dims: dict[str, FactorPair] | None, layers: Mapping[Any, Any],
                           mismatch: list[str]) -> None:
        """Layers in the state that this model lacks, and (with 'layer_dims') the other way round."""
        saved_names = list(dims) if dims is not None else [n for n in layers if isinstance(n, str)]
        for name in saved_names:
            if name not in self.core.layers:
                why = f" (skipped here: {self.registry.skipped[name]})" if name in self.registry.skipped else ""
                mismatch.append(f"unexpected layer {name!r}: in the state, not a K-FAC layer of this model{why}")
        if dims is not None:
            for name in self.core.layers:
                if name not in dims:
                    mismatch.append(f"missing layer {name!r}: a K-FAC layer of this model, absent from the state")

    def _check_factors(self, dims: dict[str, FactorPair] | None, layers: Mapping[Any, Any],
                       corrupt: list[str], mismatch: list[str], method: str) -> dict[str, tuple[Any, ...]]:
        """Each saved layer's factors, checked alone, against 'layer_dims' and against this model."""
        factors: dict[str, tuple[Any, ...]] = {}
        for name, entry in layers.items():
            layer = self.core.layers.get(name) if isinstance(name, str) else None
            # the layouts the tensors should have: the state's own word, else this model's
            expect = dims.get(name) if dims is not None else None
            if expect is None and layer is not None:
                expect = layer_shapes(layer)
            shapes = _layer_factors(name, entry, corrupt, method, expect)
            if shapes is None or not isinstance(name, str):
                continue  # reported by _layer_factors
            if dims is not None and name not in dims:
                corrupt.append(f"layer {name!r} has factors but is not listed in 'layer_dims'")
            elif dims is not None and dims[name] != shapes[0]:
                corrupt.append(f"layer {name!r}: factor sides {_show_pair(shapes[0])} disagree with 'layer_dims' "
                               f"{_show_pair(dims[name])}")
            elif layer is not None:  # else: listed as unexpected
                want = layer_shapes(layer)
                if shapes[0] == want:
                    factors[name] = shapes[1]
                else:
                    mismatch.append(_shape_mismatch(name, shapes[0], want))
        return factors

    def _check_sides_without_factors(self, dims: dict[str, FactorPair], layers: Mapping[Any, Any],
                                     mismatch: list[str]) -> None:
        """Layers saved before they had factors: their shapes must match this model's too."""
        for name, shapes in dims.items():
            layer = self.core.layers.get(name)
            if layer is None or name in layers:
                continue
            want = layer_shapes(layer)
            if shapes != want:
                mismatch.append(_shape_mismatch(name, shapes, want, " (no factors yet)"))


def _check_header(state: object) -> object:
    """The state's version, after refusing what is not a state dict at all or is from a newer release."""
    if not isinstance(state, Mapping):
        raise ValueError(f"not a KFACPreconditioner state dict: got a {type(state).__name__}. " + _SKIP_HINT)
    missing_keys = [k for k in ("version", "steps", "layers") if k not in state]
    if missing_keys:
        raise ValueError(
            f"not a KFACPreconditioner state dict (missing {', '.join(map(repr, missing_keys))}; "
            f"keys found: {', '.join(map(repr, list(state)[:10])) or 'none'}). " + _SKIP_HINT
        )
    version = state["version"]
    if _is_count(version) and int(version) > STATE_VERSION:
        raise ValueError(
            f"K-FAC state version {version} was written by a newer lightning-spdkfac; this one reads "
            f"versions up to {STATE_VERSION}: upgrade lightning-spdkfac. " + _SKIP_HINT
        )
    return version


def _check_counters(state: Mapping[str, Any], version: object, corrupt: list[str]) -> None:
    if not _is_count(version) or int(version) < 1:
        corrupt.append(f"'version' must be a positive integer, got {version!r}")
    for key in ("steps",) + COUNTERS:
        if key in state and not _is_count(state[key]):
            corrupt.append(f"{key!r} must be a non-negative integer, got {state[key]!r}")


def _shape_mismatch(name: str, shapes: FactorPair, want: FactorPair, note: str = "") -> str:
    (a, g), (wa, wg) = shapes, want
    return f"{name!r}: factor shapes {a}, {g}{note}; this model needs {wa}, {wg}"


_SKIP_HINT = (
    "To start K-FAC fresh instead (the rest of a Lightning checkpoint still loads), pass "
    "KFAC(load_state=\"skip\") to the Lightning callback, or do not call load_state_dict in plain PyTorch."
)


def _is_count(value: object) -> TypeGuard[numbers.Integral]:
    """A non-negative integer (not a bool): an ``int`` or another ``numbers.Integral`` such as numpy's."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0


def _dims_shape(d: object) -> FactorShape | None:
    """A 'layer_dims' shape: an int n > 0 ((n, n)), or a list/tuple [n] or [b, n, n] of ints > 0; else None."""
    if _is_count(d):
        return (int(d), int(d)) if int(d) > 0 else None
    if not isinstance(d, (list, tuple)) or not all(_is_count(v) and int(v) > 0 for v in d):
        return None
    dims = tuple(int(v) for v in d)
    if len(dims) == 1 or (len(dims) in (2, 3) and dims[-1] == dims[-2]):
        return dims
    return None


def _layer_dims(dims: object, corrupt: list[str]) -> dict[str, FactorPair] | None:
    """``layer_dims`` as {name: (A shape, G shape)}; None (and a problem noted) if malformed."""
    if not isinstance(dims, Mapping):
        corrupt.append(f"'layer_dims' must be a dict of layer name -> [A side, G side], got a {type(dims).__name__}")
        return None
    out: dict[str, FactorPair] = {}
    for name, d in dims.items():
        pair = [_dims_shape(v) for v in d] if isinstance(d, (list, tuple)) and len(d) == 2 else None
        if not isinstance(name, str) or pair is None or pair[0] is None or pair[1] is None:
            corrupt.append(f"'layer_dims' entry {name!r}: expected [A side, G side], each a positive integer n (an "
                           f"n x n factor) or a shape [n] (diagonal) or [b, n, n] (grouped), got {d!r}")
            return None
        out[name] = (pair[0], pair[1])
    return out


def _check_inverse_damping(dampings: object, factors: Mapping[str, tuple[Any, ...]], corrupt: list[str]) -> None:
    """An eigen state: 'inverse_damping' holds a finite damping >= 0 for every layer with inverses."""
    if not isinstance(dampings, Mapping):
        dampings = {}
    for name, (_, _, A_inv, _) in factors.items():
        d = dampings.get(name)
        ok = isinstance(d, numbers.Real) and not isinstance(d, bool) and 0.0 <= float(d) < float("inf")
        if A_inv is not None and not ok:
            corrupt.append(f"layer {name!r}: an eigen state needs 'inverse_damping'[{name!r}], the damping of its "
                           f"eigen inverses (a finite number >= 0), got {d!r}")


_LAYOUTS = {1: "a vector (a diagonal factor)", 2: "a square matrix", 3: "a (b, n, n) stack of square blocks"}


def _layout_problem(key: str, t: torch.Tensor, expect: FactorShape | None) -> str | None:
    """Why factor tensor ``t`` does not have the layout of ``expect`` (any valid layout when None)."""
    shape = tuple(t.shape)
    valid = len(shape) in _LAYOUTS and shape[-1] > 0 and (len(shape) == 1 or shape[-1] == shape[-2])
    if expect is None and not valid:
        return (f"{key} must be a factor, (n,) diagonal, (n, n) dense or (b, n, n) grouped, got shape {shape}")
    if expect is not None and (len(shape) != len(expect) or not valid):
        return f"{key} must be {_LAYOUTS[len(expect)]}, got shape {shape}"
    return None


def _tensor_problem(key: str, t: object, expect: FactorShape | None) -> str | None:
    """Why ``t`` cannot be a stored factor or inverse at all (None: it can, as far as its shape goes)."""
    if not isinstance(t, torch.Tensor):
        return f"{key} must be a tensor, got a {type(t).__name__}"
    if not t.is_floating_point():
        return f"{key} must be a floating-point tensor, got dtype {t.dtype}"
    if key.endswith("_inv"):
        if t.dim() not in _LAYOUTS or t.numel() == 0:
            return f"{key} must be a 1-, 2- or 3-dimensional tensor, got shape {tuple(t.shape)}"
    elif (problem := _layout_problem(key, t, expect)) is not None:
        return problem
    if not bool(torch.isfinite(t).all()):
        return f"{key} has non-finite values (inf or NaN)"
    return None


def _layer_factors(name: object, entry: object, corrupt: list[str], method: str = "cholesky",
                   expect: FactorPair | None = None) -> tuple[FactorPair, tuple[Any, ...]] | None:
    """((A shape, G shape), (A, G, A_inv, G_inv)) of one saved layer, or None with the problems noted.

    ``method``: the state's inverse_method, which says the shape of the inverses. ``expect``: the layouts
    the factors should have ('layer_dims', else this model's), for the message when they have another."""
    if not isinstance(name, str):
        corrupt.append(f"layer names must be strings, got {name!r}")
        return None
    keys = ("A", "G", "A_inv", "G_inv")
    if not isinstance(entry, Mapping) or set(entry) != set(keys):
        got = sorted(map(str, entry)) if isinstance(entry, Mapping) else type(entry).__name__
        corrupt.append(f"layer {name!r}: expected a dict with keys {list(keys)}, got {got}")
        return None
    ok = True
    for k, key in enumerate(keys):
        t = entry[key]
        if t is None and key.endswith("_inv"):
            continue
        problem = _tensor_problem(key, t, None if expect is None else expect[k % 2])
        if problem is not None:
            corrupt.append(f"layer {name!r}: {problem}")
            ok = False
    if not ok:
        return None
    A, G, A_inv, G_inv = (entry[k] for k in keys)
    if (A_inv is None) != (G_inv is None):
        corrupt.append(f"layer {name!r}: A_inv and G_inv must both be tensors or both None")
        return None
    shapes = (tuple(A.shape), tuple(G.shape))
    want = (inverse_shape(shapes[0], method), inverse_shape(shapes[1], method))
    if A_inv is not None and (tuple(A_inv.shape), tuple(G_inv.shape)) != want:
        note = f" (eigen payloads: they must be {want[0]}, {want[1]})" if method == "eigen" else ""
        corrupt.append(f"layer {name!r}: inverse shapes {tuple(A_inv.shape)}, {tuple(G_inv.shape)} differ from "
                       f"factor shapes {tuple(A.shape)}, {tuple(G.shape)}{note}")
        return None
    problems = [p for key in keys if entry[key] is not None
                for p in _value_problems(key, entry[key], key.endswith("_inv"), method)]
    if problems:
        corrupt.extend(f"layer {name!r}: {p}" for p in problems)
        return None
    return shapes, (A, G, A_inv, G_inv)


# Relative tolerances of the value checks: stored factors and inverses may have passed through bf16 messages
# (comm_dtype) or bf16/fp16 factors, which round each entry by up to 2^-8 of itself; a tampered or corrupted
# tensor is off by far more.
SYMMETRY_RTOL = 1e-2
ORTHONORMAL_TOL = 5e-2


def _value_problems(key: str, t: torch.Tensor, inverse: bool, method: str) -> list[str]:
    """What makes ``t`` impossible as a stored factor (symmetric blocks, diagonal >= 0: an average of Gram
    matrices) or inverse (symmetric blocks with a positive diagonal, or an eigen payload: orthonormal
    eigenvectors, eigenvalues >= 0), up to float rounding; each with the fix's reason. ``t`` is finite and of
    the right shape here; a diagonal factor (a vector) is its own diagonal, and its eigen payload its eigenvalues."""
    x = t.detach().to(torch.float64 if t.dtype == torch.float64 else torch.float32)
    if inverse and method == "eigen":
        return _eigen_payload_problems(key, x)
    problems = []
    if x.dim() > 1:
        scale = float(x.abs().max())
        asym = float((x - x.transpose(-1, -2)).abs().max())
        if asym > SYMMETRY_RTOL * scale:
            blocks = " (per block)" if x.dim() == 3 else ""
            problems.append(f"{key} is not symmetric{blocks} (max |{key} - {key}^T| = {asym:.3g}, max |{key}| = "
                            f"{scale:.3g}): K-FAC factors and their inverses are symmetric matrices")
    diagonal = (x if x.dim() == 1 else x.diagonal(dim1=-2, dim2=-1)).reshape(-1)
    low = int(diagonal.argmin())
    where = _position(x, low)
    if inverse and float(diagonal[low]) <= 0.0:
        problems.append(f"{key} has a diagonal entry <= 0 ({float(diagonal[low]):.3g} at {where}): the inverse of a "
                        "damped factor is positive definite")
    elif not inverse and float(diagonal[low]) < 0.0:
        problems.append(f"{key} has a negative diagonal entry ({float(diagonal[low]):.3g} at {where}): a factor is "
                        "an average of Gram matrices, whose diagonal is >= 0")
    return problems


def _position(x: torch.Tensor, flat: int) -> str:
    """Position ``flat`` of the flattened diagonal(s) of ``x``: ``i``, or ``block k, i`` for a grouped tensor."""
    if x.dim() == 3:
        return f"block {flat // x.shape[-1]}, {flat % x.shape[-1]}"
    return str(flat)


def _eigen_payload_problems(key: str, x: torch.Tensor) -> list[str]:
    """An eigen payload: rows 0..n-1 the eigenvectors (columns, orthonormal), row n the eigenvalues (>= 0); per
    block for a grouped factor; a diagonal factor's payload is its eigenvalues alone."""
    if x.dim() == 1:
        q, evals = None, x
    else:
        q, evals = x[..., :-1, :], x[..., -1, :]
    problems = []
    flat = evals.reshape(-1)
    low = int(flat.argmin())
    if float(flat[low]) < 0.0:
        problems.append(f"{key} (an eigen payload) has a negative eigenvalue ({float(flat[low]):.3g} at "
                        f"{_position(x, low) if x.dim() == 3 else low}) in its last row: the eigenvalues of a "
                        "factor are >= 0")
    if q is None:
        return problems
    norms = q.square().sum(-2).sqrt()
    # Q^T Q = I, checked on a few fixed probe vectors (n^2 work, not n^3): ||Q^T Q v - v|| <= tol ||v||.
    probe = torch.randn(q.shape[-1], 4, generator=torch.Generator().manual_seed(0), dtype=x.dtype).to(x.device)
    error = float(((q.transpose(-1, -2) @ (q @ probe) - probe).norm(dim=-2) / probe.norm(dim=0)).max())
    off = float((norms - 1.0).abs().max())
    if off > ORTHONORMAL_TOL or error > 10 * ORTHONORMAL_TOL:
        problems.append(f"{key} (an eigen payload) does not hold orthonormal eigenvectors in rows 0..n-1 "
                        f"(column norms off 1 by up to {off:.3g}, |Q^T Q v - v| / |v| up to {error:.3g})")
    return problems
