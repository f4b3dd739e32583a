"""Function capture: a layer's factors from the linear maps its weight takes part in outside a module call.

Module hooks see a layer only when the module is called. Models also hand a layer's weight to a function:
torchvision's Swin (``F.linear(x, self.qkv.weight, bias)`` in the shifted-window attention), timm's EVA
(``F.linear(x, weight=self.qkv.weight, ...)``), Mamba (``self.dt_proj.weight @ x``), a tied head
(``F.linear(h, self.embed.weight)``), and every ``transformers`` 5 mixture-of-experts block
(``F.linear(tokens, self.gate_up_proj[e])``, or one ``F.grouped_mm`` over all experts). :class:`FunctionCapture`
follows those calls with PyTorch's own mechanism, a :class:`torch.overrides.TorchFunctionMode`:

* it is active only while the forward of a module that may use a watched weight runs (the owner of the weight and
  its ancestors: a function is given the weight by code that reaches it through the module tree; code outside every
  forward, such as a LightningModule's ``training_step``, under :meth:`FunctionCapture.scope`, which the ``KFAC``
  callback opens there: lightning/step_scope.py), and only for the
  layers that need it: those found on a factor step with a gradient but no forward-hook call (``capture="auto"``,
  the default), every layer (``capture=True``), and always for blocks that exist only as functions (expert
  stacks, routers holding a bare ``weight``: kfac/experts.py);
* it looks only at ``F.linear``, ``matmul`` / ``@`` / ``mm``, ``F.conv1d/2d/3d``, ``F.embedding`` and
  ``grouped_mm``, and only at an argument that is the weight, its transpose, one expert of a 3-D stack or a dtype
  copy of these (found through the argument's autograd graph: ``TBackward``, ``TransposeBackward``,
  ``PermuteBackward``, ``SelectBackward``, ``ToCopyBackward`` down to the weight's ``AccumulateGrad``);
* a call it can map onto the layer's ``out x in`` matrix is collected exactly as a module call of the layer
  would be (the same rows, the same expand/reduce convention for several calls); one it cannot (the weight used
  transposed with respect to the layer, a convolution with other strides than the module's) is recorded with the
  reason, which the coverage check names if the layer then produced no factors.

Module hooks stay the fast path: a model that needs no capture runs without the mode (no cost). While a layer's own
module call runs, its weight's use inside that call (``nn.Linear.forward``'s ``F.linear``) is the module call's and
is not counted again.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .conv import ConvHelper
from .experts import ExpertsHelper
from .hook_tools import eager, holds_compiled
from .layers import EmbeddingHelper

if TYPE_CHECKING:
    from .layer_base import LayerHelper
    from .layer_state import KFACLayer

# The functions followed, by kind.
_LINEAR, _MATMUL, _CONV, _EMBEDDING, _GROUPED = "linear", "matmul", "conv", "embedding", "grouped_mm"
_FUNCS: dict[Any, str] = {
    torch._C._nn.linear: _LINEAR,
    F.linear: _LINEAR,
    torch.matmul: _MATMUL,
    torch.Tensor.matmul: _MATMUL,
    torch.Tensor.__matmul__: _MATMUL,
    torch.mm: _MATMUL,
    torch.Tensor.mm: _MATMUL,
    torch.conv1d: _CONV,
    torch.conv2d: _CONV,
    torch.conv3d: _CONV,
    F.embedding: _EMBEDDING,
}
for _f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)):
    if _f is not None:
        _FUNCS[_f] = _GROUPED

# Autograd nodes between a function's argument and the weight that keep it the weight's values (a dtype or device
# copy, an alias), transpose its last two dims, or select one expert of a stack.
_SAME = {"ToCopyBackward0", "AliasBackward0", "CloneBackward0"}
_DEPTH = 6

Source = tuple["KFACLayer", "int | None", bool]  # (layer, expert index or None, transposed)

TRANSPOSED_USE = ("its weight was used transposed with respect to the layer's own map (e.g. x @ linear.weight, "
                  "which is not linear(x)): K-FAC cannot follow that use")


class FunctionCapture:
    """The capture of one preconditioner: which weights are watched, the modules whose forward activates it, and
    what it could not follow (``refused``: layer name -> reason)."""

    def __init__(self, model: nn.Module,
                 on_call: Callable[[KFACLayer, LayerHelper, bool, torch.Tensor, torch.Tensor,
                                    Callable[[torch.Tensor], torch.Tensor] | None], None]) -> None:
        self.model = model
        self.on_call = on_call  # the preconditioner's collection of one call (the forward hook's)
        self.watched: dict[int, KFACLayer] = {}  # id(weight) -> layer
        self.layers: dict[str, KFACLayer] = {}  # the captured layers, by name
        self.busy: dict[int, int] = {}  # id(layer) -> its module calls running now (their own uses not counted)
        self.refused: dict[str, str] = {}
        self._depth = 0
        self._open_scopes = 0  # open_scope() calls not closed yet (each holds one level of _depth)
        self.suspended = False  # K-FAC's own computations inside a forward hook: not looked at
        self._mode: _Mode | None = None
        self._scoped: set[int] = set()  # ids of modules whose forward activates the capture
        self._handles: list[Any] = []  # the scopes' hooks
        self._busy_handles: dict[str, list[Any]] = {}  # layer name -> the hooks that mark its module calls running
        self.probing: set[str] = set()  # layers followed for the first factor step only unless a function uses them
        self.function_calls: dict[str, int] = {}  # layer name -> calls collected from functions
        self.blocked_by_compile = False  # a scope's forward ran inside a torch.compile'd region (not followed)
        # A model holding torch.compile'd modules: a mode active around them would be traced into their graphs (dynamo
        # cannot), so capture never runs on such a model; the layers that need it are named.
        self._holds_compiled = holds_compiled(model)
        self._parents: dict[int, nn.Module] | None = None

    @property
    def calls(self) -> int:
        """Calls collected from functions, over every layer."""
        return sum(self.function_calls.values())

    @property
    def active(self) -> bool:
        """Whether the mode is on now (a scope's forward is running outside torch.compile)."""
        return self._mode is not None

    # -- which layers, and where -----------------------------------------------------------------------------
    def watch(self, layer: KFACLayer, hooked: list[nn.Module]) -> None:
        """Follow ``layer``'s weight from now on. ``hooked``: the layer's modules whose forward hooks collect their
        module calls (the capture skips the weight's use inside those calls); none for a block of functions only."""
        if layer.name in self.layers:
            return
        self.layers[layer.name] = layer
        self.watched[id(layer.helper.params()[0])] = layer
        self._busy_handles[layer.name] = [
            h for module in hooked
            for h in (module.register_forward_pre_hook(eager(self._busy(layer, 1))),
                      module.register_forward_hook(eager(self._busy(layer, -1)), always_call=True))]
        self._scope(layer)

    def _scope(self, layer: KFACLayer) -> None:
        """Activate the capture around the forward of the modules that may use ``layer``'s weight. A block of
        functions only is used inside its own module's forward; a layer found used through a function may be given
        its weight anywhere above its module."""
        owner = layer.helper.owner()
        for module in [owner] if layer.helper.capture_only else self._chain(owner):
            if id(module) not in self._scoped:
                self._scoped.add(id(module))
                self._handles.append(module.register_forward_pre_hook(eager(self._enter)))
                self._handles.append(module.register_forward_hook(eager(self._exit), always_call=True))

    def probe(self, layers: list[KFACLayer], hooked: dict[str, list[nn.Module]]) -> None:
        """``capture="auto"``: follow every layer during the first factor step, to find the weights also used through
        a function (a weight shared between a module call and ``F.linear``); :meth:`end_probe` keeps only those."""
        self.probing = {ly.name for ly in layers if ly.name not in self.layers}
        for ly in layers:
            self.watch(ly, hooked.get(ly.name, []))

    def end_probe(self) -> None:
        """Stop following the probed layers whose weight no function used (called between forwards)."""
        if not self.probing:
            return
        for name in [n for n in self.probing if not self.function_calls.get(n)]:
            layer = self.layers.pop(name)
            self.watched.pop(id(layer.helper.params()[0]), None)
            for h in self._busy_handles.pop(name, []):
                h.remove()
        self.probing = set()
        for h in self._handles:  # the scopes of the layers still followed only
            h.remove()
        self._handles.clear()
        self._scoped.clear()
        for layer in self.layers.values():
            self._scope(layer)

    def _chain(self, module: nn.Module) -> list[nn.Module]:
        """``module`` and its ancestors in the model (a module used through a function is given its weight by code
        that reaches it through the module tree)."""
        if self._parents is None:
            self._parents = {}
            for parent in self.model.modules():
                for child in parent.children():
                    self._parents.setdefault(id(child), parent)
        chain, m = [module], module
        while id(m) in self._parents:
            m = self._parents[id(m)]
            chain.append(m)
        return chain

    def _busy(self, layer: KFACLayer, delta: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self.busy[id(layer)] = self.busy.get(id(layer), 0) + delta

        return hook

    def _enter(self, *_: Any) -> None:
        if self._depth == 0:
            if self._holds_compiled or _under_compile():
                # A forward inside a torch.compile'd region: a torch-function mode pushed from a graph break would be
                # traced into the resumed graph (dynamo cannot). Not followed there; the layers are named.
                self.blocked_by_compile = True
            else:
                self._mode = _Mode(self)
                self._mode.__enter__()  # type: ignore[no-untyped-call]
        self._depth += 1

    def _exit(self, *_: Any) -> None:
        self._depth -= 1
        if self._depth == 0 and self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    @property
    def needs_scope(self) -> bool:
        """Whether code outside every module's forward should run under :meth:`scope` (a layer other than a block of
        functions only is followed, or ``capture="auto"`` is probing): such a layer's weight may be given to a function
        anywhere, e.g. ``F.linear(h, self.proj.weight)`` in a LightningModule's ``training_step``."""
        return bool(self.probing) or any(not ly.helper.capture_only for ly in self.layers.values())

    def open_scope(self) -> bool:
        """Activate the capture outside any module's forward (a training step's own code, until its backward is
        launched), as the forward of a scope would; nests with them and with itself. Not under torch.compile (the
        model holds a compiled module, or this is called from a compiled region: a mode pushed there would be traced
        into the graph). Returns whether it opened: only then call :meth:`close_scope`."""
        if self._holds_compiled or _under_compile():
            return False
        self._open_scopes += 1
        self._enter()
        return True

    def close_scope(self) -> None:
        """Close the innermost :meth:`open_scope` still open (nothing when none is: safe on every exit path)."""
        if self._open_scopes > 0:
            self._open_scopes -= 1
            self._exit()

    @contextmanager
    def scope(self) -> Iterator[None]:
        """``with pre.capture.scope(): loss = loss_fn(F.linear(h, model.proj.weight), y)``: the weights used through
        functions outside any module's forward (a plain training loop's own code) are followed there too. Opened only
        where :attr:`needs_scope` (nothing to pay otherwise)."""
        opened = self.needs_scope and self.open_scope()
        try:
            yield
        finally:
            if opened:
                self.close_scope()

    def remove(self) -> None:
        for h in [*self._handles, *(h for hs in self._busy_handles.values() for h in hs)]:
            h.remove()
        self._handles.clear()
        self._busy_handles.clear()
        self._open_scopes = 0
        while self._depth > 0:
            self._exit()

    # -- one call ---------------------------------------------------------------------------------------------
    def source(self, t: Any) -> Source | None:
        """The watched layer ``t`` carries the weight of, with the expert it selects and whether it is transposed
        (None: not a watched weight, or reached through an operation that changes its values or layout)."""
        if not isinstance(t, torch.Tensor):
            return None
        layer = self.watched.get(id(t))
        if layer is not None:
            return layer, None, False
        ops: list[Any] = []
        fn = t.grad_fn
        for _ in range(_DEPTH):
            if fn is None:
                return None
            name = type(fn).__name__
            if name == "AccumulateGrad":
                leaf: torch.Tensor = cast(Any, fn).variable  # (AccumulateGrad.variable: not in torch's stubs)
                layer = self.watched.get(id(leaf))
                return None if layer is None else _resolve(layer, leaf.dim(), ops)
            ops.append(fn)
            nxt = fn.next_functions
            if not nxt:
                return None
            fn = nxt[0][0]
        return None

    def handle(self, kind: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``func`` and collect the call where it uses a watched weight the layer's way."""
        found = self._find(kind, args, kwargs)
        out = func(*args, **kwargs)
        if found is None or not isinstance(out, torch.Tensor) or not out.requires_grad:
            return out
        layer, helper, x, g_transform = found
        if self.busy.get(id(layer), 0) > 0 and helper is layer.helper:
            return out  # the layer's own module call: its forward hook collects it
        self.function_calls[layer.name] = self.function_calls.get(layer.name, 0) + 1
        self.on_call(layer, helper, layer.helper.owner().training, x, out, g_transform)
        return out

    def _find(self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``(layer, helper of the call, its input rows' tensor, output-gradient transform)`` of a call that uses a
        watched weight the layer's way; None otherwise (recording why, where the weight was used another way)."""
        if kind in (_CONV, _EMBEDDING):
            return self._find_module_map(kind, args, kwargs)
        found = self._operands(kind, args, kwargs)
        if found is None:
            return None
        x, src, call_t, left = found
        if src is None or not isinstance(x, torch.Tensor) or self.source(x) is not None:
            return None  # (the weight times a watched weight, e.g. a W @ W.T regularizer: no layer's map of data)
        layer, e, t = src
        if isinstance(layer.helper, ExpertsHelper):
            return self._expert_call(kind, layer, layer.helper, e, t != call_t, left, x, args, kwargs)
        helper = layer.helper
        if e is not None or (t != call_t) != helper.capture_transposed:
            return self._refuse(layer, TRANSPOSED_USE)
        if getattr(helper, "groups", 1) != 1 or helper.a_diagonal:
            return self._refuse(layer, f"a matrix product with the weight of a {type(helper.module).__name__} "
                                       "(only linear layers are followed through matmul / F.linear)")
        if left:  # y = W x: the inputs are x's columns, the output gradients y's
            return layer, helper, x.transpose(-1, -2), _transpose_last
        return layer, helper, x, None

    def _operands(self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, bool, bool] | None:
        """``(input, source of the weight, whether the call's matrix is the argument transposed, whether the weight is
        the left operand)`` of a linear map (F.linear, matmul, grouped_mm)."""
        if kind == _LINEAR:
            return _arg(args, kwargs, 0, "input"), self.source(_arg(args, kwargs, 1, "weight")), False, False
        if kind == _GROUPED:
            return _arg(args, kwargs, 0, "mat_a"), self.source(_arg(args, kwargs, 1, "mat_b")), True, False
        a = _arg(args, kwargs, 0, "input")
        b = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2"))
        src = self.source(b)
        if src is not None:  # y = a @ w: the call's matrix is w^T
            return a, src, True, False
        src = self.source(a)
        return None if src is None else (b, src, False, True)  # y = w @ b: the columns of b are the inputs

    def _expert_call(self, kind: str, layer: KFACLayer, helper: ExpertsHelper, e: int | None, flipped: bool,
                     left: bool, x: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call on an expert stack: one expert's slice (F.linear / matmul) or every expert (grouped_mm)."""
        if kind == _GROUPED:
            if e is not None or flipped != helper.transposed:
                return self._refuse(layer, TRANSPOSED_USE)
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            if offs is None:
                return self._refuse(layer, "grouped_mm without offs (one group per expert) is not followed")
            return layer, helper.grouped_call(offs), x, None
        if e is None or flipped != helper.transposed or left:
            return self._refuse(layer, TRANSPOSED_USE if e is not None else
                                "the whole expert stack was used at once by a function other than grouped_mm")
        return layer, helper.expert_call(e), x, None

    def _find_module_map(self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A functional convolution or embedding with a watched weight: the module's own map, or refused."""
        src = self.source(_arg(args, kwargs, 1, "weight"))
        if src is None:
            return None
        layer, e, t = src
        if e is not None or t:
            return self._refuse(layer, TRANSPOSED_USE)
        helper = layer.helper
        if not isinstance(helper, ConvHelper if kind == _CONV else EmbeddingHelper):
            return None  # (a tied table looked up by a linear head's weight: the head's block covers it)
        if kind == _CONV:
            why = _conv_mismatch(helper.module, args, kwargs)
            if why is not None:
                return self._refuse(layer, why)
        return layer, helper, _arg(args, kwargs, 0, "input"), None

    def _refuse(self, layer: KFACLayer, why: str) -> None:
        self.refused.setdefault(layer.name, why)
        return None


def _under_compile() -> bool:
    """Whether the running forward was called from a torch.compile'd module or function (its wrapper is on the Python
    stack: the hook itself runs eagerly, at a graph break). One walk of the stack per outermost scope entry."""
    f = sys._getframe(1)
    while f is not None:
        code = f.f_code
        if "_dynamo" in code.co_filename and code.co_name in ("compile_wrapper", "__call__") and (
                "compile_wrapper" in getattr(code, "co_qualname", code.co_name)
                or "OptimizedModule" in getattr(code, "co_qualname", "")):
            return True
        f = f.f_back  # type: ignore[assignment]
    return False


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


def _transpose_last(g: torch.Tensor) -> torch.Tensor:
    return g.transpose(-1, -2)


def _resolve(layer: KFACLayer, dim: int, ops: list[Any]) -> Source | None:
    """Apply the recorded view ops (outermost first) from the weight out: the expert selected, transposed or not."""
    expert, transposed = None, False
    for fn in reversed(ops):
        name = type(fn).__name__
        if name in _SAME:
            continue
        if name == "SelectBackward0":
            d = _signed(fn._saved_dim)
            if dim != 3 or d % dim != 0 or expert is not None or transposed:
                return None
            expert = _signed(fn._saved_index) % int(fn._saved_self_sym_sizes[0])
            dim = 2
        elif name == "TBackward0":
            transposed = not transposed
        elif name == "TransposeBackward0":
            pair = {_signed(fn._saved_dim0) % dim, _signed(fn._saved_dim1) % dim}
            if pair != {dim - 2, dim - 1}:
                return None
            transposed = not transposed
        elif name == "PermuteBackward0":
            dims = [_signed(d) % dim for d in fn._saved_dims]
            if dims != [*range(dim - 2), dim - 1, dim - 2]:
                return None
            transposed = not transposed
        else:
            return None
    return layer, expert, transposed


def _signed(v: Any) -> int:
    """An autograd node's saved dim or index (a negative one is saved as an unsigned 64-bit integer)."""
    n = int(v)
    return n - (1 << 64) if n >= (1 << 63) else n


def _conv_mismatch(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why a functional convolution with the module's weight is not the module's map (None: it is)."""
    names = ("stride", "padding", "dilation", "groups")
    defaults: tuple[Any, ...] = (1, 0, 1, 1)
    got = [args[3 + i] if len(args) > 3 + i else kwargs.get(n, defaults[i]) for i, n in enumerate(names)]
    if getattr(module, "padding_mode", "zeros") != "zeros":
        return "a functional convolution with the weight of a module whose padding_mode is not 'zeros'"
    mine = [module.stride, module.padding, module.dilation, module.groups]
    for n, g, m in zip(names, got, mine, strict=True):
        if isinstance(m, tuple) and not isinstance(g, (tuple, list, str)):
            g = (g,) * len(m)
        if isinstance(g, list):
            g = tuple(g)
        if g != m:
            return (f"a functional convolution with the weight but {n}={g!r} where the module has {n}={m!r}: K-FAC "
                    "reads a convolution's rows with the module's geometry")
    return None


class _Mode(TorchFunctionMode):
    """The torch-function mode of one active capture: a dictionary lookup per torch call, the rest only for the
    followed functions with grad enabled."""

    def __init__(self, capture: FunctionCapture) -> None:
        super().__init__()
        self.capture = capture

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        kind = _FUNCS.get(func)
        if kind is None or self.capture.suspended or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        return self.capture.handle(kind, func, args, kwargs)
