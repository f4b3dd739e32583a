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

from ..vocabulary import FACTOR_APPROXES, INVERSE_METHODS
from .distributor import Distributor
from .grafting import AdamGraftState
from .layer_state import KFACLayer
from .options import KFACOptions

STATE_VERSION = 2  # 2: adds 'layer_dims' (every registered layer and its factor sides)
# Counters saved with the state (each optional when loading: older states lack some).
COUNTERS = ("skipped_factor_steps", "skipped_precondition_steps", "consecutive_bad_steps", "inverse_fallbacks")


class CheckpointState:
    """``state_dict`` / ``load_state_dict`` of the preconditioner (a mixin: the attributes are its)."""

    layers: dict[str, KFACLayer]
    skipped: dict[str, str]
    steps: int
    skipped_factor_steps: int
    skipped_precondition_steps: int
    consecutive_bad_steps: int
    inverse_fallbacks: int
    factor_dtype: torch.dtype
    inv_dtype: torch.dtype
    options: KFACOptions
    distributor: Distributor
    _graft_states: dict[int, AdamGraftState]

    def _drop_collected(self) -> None:
        """Forget the statistics collected since the last step (the preconditioner's)."""
        raise NotImplementedError

    def _settle_inverses(self, keep: bool = True) -> None:
        """Swap in (``keep``) or drop the asynchronous inversions in flight (the preconditioner's)."""
        raise NotImplementedError

    def _layer_states(self) -> dict[int, tuple[Any, ...]]:
        """Every layer's (A, G, A_inv, G_inv, inverse damping) by index. Under distributed preconditioning
        (``schedule="dpkfac"``) each rank holds its own layers only: the others are gathered from their owners
        (a collective: every rank calls :meth:`state_dict` at the same point; received tensors are on the host),
        so the state is complete on every rank and independent of the world size."""
        own = {ly.index: (ly.A, ly.G, ly.A_inv, ly.G_inv, ly.inv_damping) for ly in self.layers.values()}
        if self.distributor.layer_owners is None:
            return own
        rank = self.distributor.rank
        held = {i: v for i, v in own.items() if self.distributor.layer_owners[i] == rank}
        shapes = []
        for ly in sorted(self.layers.values(), key=lambda ly: ly.index):
            a, g = ly.helper.a_dim, ly.helper.g_dim
            shapes.append(((a, a), (g, g), _inverse_shape(a, self.options.inverse_method),
                           _inverse_shape(g, self.options.inverse_method)))
        states = self.distributor.gather_layers(held, shapes,  # type: ignore[attr-defined]
                                                (self.factor_dtype, self.inv_dtype))
        return {i: states.get(i, (None, None, None, None, None)) for i in own}

    def state_dict(self) -> dict[str, Any]:
        """Everything the next step needs: counters, running factors and current inverses.

        ``inverse_method`` says what the inverses are (n x n damped inverses, or (n+1) x n eigen payloads);
        with ``"eigen"``, ``inverse_damping`` holds each layer's damping of its payloads (that of the step
        that computed them, which a damping schedule may have changed since).

        ``layer_dims`` names every registered layer with its factor sides ``[A, G]``, layers without
        factors yet included, so that :meth:`load_state_dict` recognizes a state of another model.

        With ``async_inverses``, inversions still in flight are waited for and swapped in first, as the next
        :meth:`step` would do before using them: the state is that of a step boundary, and a run resumed
        from it continues exactly (its next step finds nothing in flight and uses the same inverses).
        """
        self._settle_inverses()
        held = self._layer_states()
        layers: dict[str, dict[str, torch.Tensor | None]] = {}
        for name, ly in self.layers.items():
            A, G, A_inv, G_inv, _ = held[ly.index]
            if A is None:
                continue
            layers[name] = {"A": A, "G": G, "A_inv": A_inv, "G_inv": G_inv}
        extra: dict[str, Any] = {}
        by_index = {ly.index: name for name, ly in self.layers.items()}
        moments = {by_index[i]: {"v": st.v, "t": st.t} for i, st in self._graft_states.items() if st.v is not None}
        if moments:  # grafting="adam" (kfac/grafting.py)
            extra["grafting_moments"] = moments
        if self.options.inverse_method != "cholesky":  # a cholesky state is what it was before the option
            extra["inverse_method"] = self.options.inverse_method
            extra["inverse_damping"] = {name: held[ly.index][4] for name, ly in self.layers.items()
                                        if held[ly.index][2] is not None and held[ly.index][4] is not None}
        return {
            "version": STATE_VERSION,
            "steps": self.steps,
            "skipped_factor_steps": self.skipped_factor_steps,
            # optional counters (older states lack them): a resumed run continues the same counts, and
            # max_bad_steps sees a bad streak that spans the checkpoint
            "skipped_precondition_steps": self.skipped_precondition_steps,
            "consecutive_bad_steps": self.consecutive_bad_steps,
            "inverse_fallbacks": self.inverse_fallbacks,
            # optional too: factors of the two approximations have the same shapes but not the same meaning
            "factor_approx": self.options.factor_approx,
            "layer_dims": {name: [ly.helper.a_dim, ly.helper.g_dim] for name, ly in self.layers.items()},
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
        factors = self._verify_state(state)
        self._settle_inverses(keep=False)  # inversions of the replaced state's factors: never swapped in
        loaded = {}  # converted first: nothing is assigned unless every tensor converted
        for name, (A, G, A_inv, G_inv) in factors.items():
            dev = self.layers[name].helper.module.weight.device
            loaded[name] = (
                A.to(device=dev, dtype=self.factor_dtype).clone(),
                G.to(device=dev, dtype=self.factor_dtype).clone(),
                None if A_inv is None else A_inv.to(device=dev, dtype=self.inv_dtype).clone(),
                None if G_inv is None else G_inv.to(device=dev, dtype=self.inv_dtype).clone(),
            )
        saved_method, method = state.get("inverse_method", "cholesky"), self.options.inverse_method
        dampings = state.get("inverse_damping") or {}
        owners = self.distributor.layer_owners
        for name, layer in self.layers.items():
            layer.A, layer.G, layer.A_inv, layer.G_inv = loaded.get(name, (None, None, None, None))
            layer.inv_damping = float(dampings[name]) if name in dampings else None
            if owners is not None and owners[layer.index] != self.distributor.rank:  # another rank's layer
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
        self._drop_collected()
        self._graft_states.clear()
        for name, entry in (state.get("grafting_moments") or {}).items():
            st = self._graft_states[self.layers[name].index] = AdamGraftState()
            st.v = entry["v"].to(device=self.layers[name].helper.module.weight.device, dtype=torch.float64).clone()
            st.t = int(entry["t"])
        self.steps = int(state["steps"])
        for key in COUNTERS:
            setattr(self, key, int(state.get(key, 0)))
        saved, ours = state.get("factor_approx"), self.options.factor_approx
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
        if "factor_approx" in state and state["factor_approx"] not in FACTOR_APPROXES:
            corrupt.append(f"'factor_approx' must be one of {FACTOR_APPROXES}, got {state['factor_approx']!r}")
        method = state.get("inverse_method", "cholesky")
        if method not in INVERSE_METHODS:
            corrupt.append(f"'inverse_method' must be one of {INVERSE_METHODS}, got {method!r}")
            method = "cholesky"
        # Which layers the state was saved for: 'layer_dims' (version 2), else the layers with factors.
        dims = None
        if "layer_dims" in state:
            dims = _layer_dims(state["layer_dims"], corrupt)
        elif _is_count(version) and int(version) >= 2:
            corrupt.append("missing 'layer_dims' (every version-2 state has it)")
        layers = state["layers"]
        if not isinstance(layers, Mapping):
            corrupt.append(f"'layers' must be a dict of layer name -> factors, got a {type(layers).__name__}")
            layers = {}
        self._check_layer_names(dims, layers, mismatch)
        factors = self._check_factors(dims, layers, corrupt, mismatch, method)
        if method == "eigen":
            _check_inverse_damping(state.get("inverse_damping"), factors, corrupt)
        if dims is not None:
            self._check_sides_without_factors(dims, layers, mismatch)
        self._check_graft_moments(state.get("grafting_moments"), corrupt)
        if mismatch or corrupt:
            what = " and ".join(w for w, p in (("does not match this model", mismatch), ("is corrupt", corrupt)) if p)
            lines = mismatch + corrupt
            raise ValueError(
                f"K-FAC state {what} ({len(lines)} problem{'s' if len(lines) > 1 else ''}); nothing was "
                "loaded:\n  " + "\n  ".join(lines) + "\n" + _SKIP_HINT
            )
        return factors

    def _check_graft_moments(self, moments: Any, corrupt: list[str]) -> None:
        """``grafting_moments`` (optional): layer name -> {"v": finite non-negative out x a_dim tensor, "t": count}."""
        if moments is None:
            return
        if not isinstance(moments, Mapping):
            corrupt.append(f"'grafting_moments' must be a dict of layer name -> moments, got a {type(moments).__name__}")
            return
        for name, entry in moments.items():
            layer = self.layers.get(name) if isinstance(name, str) else None
            if layer is None:
                corrupt.append(f"'grafting_moments' names {name!r}, not a K-FAC layer of this model")
                continue
            v, t = (entry.get("v"), entry.get("t")) if isinstance(entry, Mapping) else (None, None)
            want = (layer.helper.g_dim, layer.helper.a_dim)
            if (not isinstance(v, torch.Tensor) or tuple(v.shape) != want or not _is_count(t)
                    or not bool(torch.isfinite(v).all()) or bool((v < 0).any())):
                corrupt.append(f"layer {name!r}: its grafting moments must be {{'v': a finite non-negative {want[0]} x "
                               f"{want[1]} tensor, 't': a count}}, got {entry!r:.120}")

    def _check_layer_names(self, dims: dict[str, tuple[int, int]] | None, layers: Mapping[Any, Any],
                           mismatch: list[str]) -> None:
        """Layers in the state that this model lacks, and (with 'layer_dims') the other way round."""
        saved_names = list(dims) if dims is not None else [n for n in layers if isinstance(n, str)]
        for name in saved_names:
            if name not in self.layers:
                why = f" (skipped here: {self.skipped[name]})" if name in self.skipped else ""
                mismatch.append(f"unexpected layer {name!r}: in the state, not a K-FAC layer of this model{why}")
        if dims is not None:
            for name in self.layers:
                if name not in dims:
                    mismatch.append(f"missing layer {name!r}: a K-FAC layer of this model, absent from the state")

    def _check_factors(self, dims: dict[str, tuple[int, int]] | None, layers: Mapping[Any, Any],
                       corrupt: list[str], mismatch: list[str], method: str) -> dict[str, tuple[Any, ...]]:
        """Each saved layer's factors, checked alone, against 'layer_dims' and against this model."""
        factors: dict[str, tuple[Any, ...]] = {}
        for name, entry in layers.items():
            sides = _layer_factors(name, entry, corrupt, method)
            if sides is None or not isinstance(name, str):
                continue  # reported by _layer_factors
            if dims is not None and name not in dims:
                corrupt.append(f"layer {name!r} has factors but is not listed in 'layer_dims'")
            elif dims is not None and dims[name] != sides[0]:
                corrupt.append(f"layer {name!r}: factor sides {sides[0]} disagree with 'layer_dims' {dims[name]}")
            elif name in self.layers:  # else: listed as unexpected
                layer = self.layers[name]
                want = (layer.helper.a_dim, layer.helper.g_dim)
                if sides[0] == want:
                    factors[name] = sides[1]
                else:
                    mismatch.append(_shape_mismatch(name, sides[0], want))
        return factors

    def _check_sides_without_factors(self, dims: dict[str, tuple[int, int]], layers: Mapping[Any, Any],
                                     mismatch: list[str]) -> None:
        """Layers saved before they had factors: their sides must match this model's too."""
        for name, sides in dims.items():
            layer = self.layers.get(name)
            if layer is None or name in layers:
                continue
            want = (layer.helper.a_dim, layer.helper.g_dim)
            if sides != want:
                mismatch.append(_shape_mismatch(name, sides, want, " (no factors yet)"))


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


def _shape_mismatch(name: str, sides: tuple[int, int], want: tuple[int, int], note: str = "") -> str:
    (a, g), (wa, wg) = sides, want
    return f"{name!r}: factor shapes ({a}, {a}), ({g}, {g}){note}; this model needs ({wa}, {wa}), ({wg}, {wg})"


_SKIP_HINT = (
    "To start K-FAC fresh instead (the rest of a Lightning checkpoint still loads), pass "
    "KFAC(load_state=\"skip\") to the Lightning callback, or do not call load_state_dict in plain PyTorch."
)


def _is_count(value: object) -> TypeGuard[numbers.Integral]:
    """A non-negative integer (not a bool): an ``int`` or another ``numbers.Integral`` such as numpy's."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0


def _layer_dims(dims: object, corrupt: list[str]) -> dict[str, tuple[int, int]] | None:
    """``layer_dims`` as {name: (A side, G side)}; None (and a problem noted) if malformed."""
    if not isinstance(dims, Mapping):
        corrupt.append(f"'layer_dims' must be a dict of layer name -> [A side, G side], got a {type(dims).__name__}")
        return None
    out: dict[str, tuple[int, int]] = {}
    for name, d in dims.items():
        if (
            not isinstance(name, str) or not isinstance(d, (list, tuple)) or len(d) != 2
            or not all(_is_count(v) and int(v) > 0 for v in d)
        ):
            corrupt.append(f"'layer_dims' entry {name!r}: expected [A side, G side] (positive integers), got {d!r}")
            return None
        out[name] = (int(d[0]), int(d[1]))
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


def _inverse_shape(side: int, method: str) -> tuple[int, int]:
    """The shape of a stored inverse of a factor of side ``side``: (n, n), or (n+1, n) for an eigen payload."""
    return (side + 1, side) if method == "eigen" else (side, side)


def _layer_factors(name: object, entry: object, corrupt: list[str],
                   method: str = "cholesky") -> tuple[tuple[int, int], tuple[Any, ...]] | None:
    """((A side, G side), (A, G, A_inv, G_inv)) of one saved layer, or None with the problems noted.

    ``method``: the state's inverse_method, which says the shape of the inverses."""
    if not isinstance(name, str):
        corrupt.append(f"layer names must be strings, got {name!r}")
        return None
    keys = ("A", "G", "A_inv", "G_inv")
    if not isinstance(entry, Mapping) or set(entry) != set(keys):
        got = sorted(map(str, entry)) if isinstance(entry, Mapping) else type(entry).__name__
        corrupt.append(f"layer {name!r}: expected a dict with keys {list(keys)}, got {got}")
        return None
    ok = True
    for key in keys:
        t = entry[key]
        if t is None and key.endswith("_inv"):
            continue
        if not isinstance(t, torch.Tensor):
            corrupt.append(f"layer {name!r}: {key} must be a tensor, got a {type(t).__name__}")
            ok = False
        elif not t.is_floating_point():
            corrupt.append(f"layer {name!r}: {key} must be a floating-point tensor, got dtype {t.dtype}")
            ok = False
        elif t.dim() != 2 or t.shape[1] == 0 or (t.shape[0] != t.shape[1] and not (key.endswith("_inv")
                                                                                     and method == "eigen")):
            corrupt.append(f"layer {name!r}: {key} must be a square matrix, got shape {tuple(t.shape)}")
            ok = False
        elif not bool(torch.isfinite(t).all()):
            corrupt.append(f"layer {name!r}: {key} has non-finite values (inf or NaN)")
            ok = False
    if not ok:
        return None
    A, G, A_inv, G_inv = (entry[k] for k in keys)
    if (A_inv is None) != (G_inv is None):
        corrupt.append(f"layer {name!r}: A_inv and G_inv must both be tensors or both None")
        return None
    want = (_inverse_shape(A.shape[0], method), _inverse_shape(G.shape[0], method))
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
    return (A.shape[0], G.shape[0]), (A, G, A_inv, G_inv)


# Relative tolerances of the value checks: stored factors and inverses may have passed through bf16 messages
# (comm_dtype) or bf16/fp16 factors, which round each entry by up to 2^-8 of itself; a tampered or corrupted
# tensor is off by far more.
SYMMETRY_RTOL = 1e-2
ORTHONORMAL_TOL = 5e-2


def _value_problems(key: str, t: torch.Tensor, inverse: bool, method: str) -> list[str]:
    """What makes ``t`` impossible as a stored factor (symmetric, diagonal >= 0: an average of Gram matrices)
    or inverse (symmetric with a positive diagonal, or an eigen payload: orthonormal eigenvectors, eigenvalues
    >= 0), up to float rounding; each with the fix's reason. ``t`` is finite and of the right shape here."""
    x = t.detach().to(torch.float64 if t.dtype == torch.float64 else torch.float32)
    if inverse and method == "eigen":
        return _eigen_payload_problems(key, x)
    scale = float(x.abs().max())
    asym = float((x - x.T).abs().max())
    problems = []
    if asym > SYMMETRY_RTOL * scale:
        problems.append(f"{key} is not symmetric (max |{key} - {key}^T| = {asym:.3g}, max |{key}| = {scale:.3g}): "
                        "K-FAC factors and their inverses are symmetric matrices")
    diagonal = x.diagonal()
    low = int(diagonal.argmin())
    if inverse and float(diagonal[low]) <= 0.0:
        problems.append(f"{key} has a diagonal entry <= 0 ({float(diagonal[low]):.3g} at {low}): the inverse of a "
                        "damped factor is positive definite")
    elif not inverse and float(diagonal[low]) < 0.0:
        problems.append(f"{key} has a negative diagonal entry ({float(diagonal[low]):.3g} at {low}): a factor is "
                        "an average of Gram matrices, whose diagonal is >= 0")
    return problems


def _eigen_payload_problems(key: str, x: torch.Tensor) -> list[str]:
    """An eigen payload: rows 0..n-1 the eigenvectors (columns, orthonormal), row n the eigenvalues (>= 0)."""
    q, evals = x[:-1], x[-1]
    problems = []
    low = int(evals.argmin())
    if float(evals[low]) < 0.0:
        problems.append(f"{key} (an eigen payload) has a negative eigenvalue ({float(evals[low]):.3g} at {low}) "
                        "in its last row: the eigenvalues of a factor are >= 0")
    norms = q.square().sum(0).sqrt()
    # Q^T Q = I, checked on a few fixed probe vectors (n^2 work, not n^3): ||Q^T Q v - v|| <= tol ||v||.
    probe = torch.randn(q.shape[1], 4, generator=torch.Generator().manual_seed(0), dtype=x.dtype).to(x.device)
    error = float(((q.T @ (q @ probe) - probe).norm(dim=0) / probe.norm(dim=0)).max())
    off = float((norms - 1.0).abs().max())
    if off > ORTHONORMAL_TOL or error > 10 * ORTHONORMAL_TOL:
        problems.append(f"{key} (an eigen payload) does not hold orthonormal eigenvectors in rows 0..n-1 "
                        f"(column norms off 1 by up to {off:.3g}, |Q^T Q v - v| / |v| up to {error:.3g})")
    return problems
