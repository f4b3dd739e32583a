"""The forward check of a subclass: does the module compute what its helper assumes?

A helper's rows describe one map: ``nn.Linear``'s ``F.linear(x, W, b)``, ``nn.Embedding``'s table lookup of
token ids, ``transformers``' ``Conv1D``'s ``x @ W + b``, a convolution of the input's patches. A subclass of a
registered type that overrides ``forward`` (or the method its forward calls) may compute something else with the
same parameters: ``transformers``' ``WhisperPositionalEmbedding`` is an ``nn.Embedding`` that takes token ids
and returns the first rows of its table (positions), so reading its input as the table rows used builds wrong
factors, or indexes past the table. Such a layer is checked once, on its first collected call: the helper
recomputes the output from the captured input and the module's parameters (:meth:`LayerHelper.expected_output`)
and it must be the module's output (relative error 1e-2, as for convolutions); where it is not, or where the input
is not what the helper takes (floats given to an embedding, ids outside its table, a last dimension that is not
``in_features``), the run stops with an error naming the layer and the fix. One host read per checked layer, on
its first collected call (the first factor step): never on a later step.

A type registered with :func:`~lightning_spdkfac.kfac.layers.register_layer_type` is not checked against its
own forward (registering it says its helper describes it): registering the subclass is one of the two fixes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .hook_tools import autocast_off

if TYPE_CHECKING:
    from .layer_base import LayerHelper

# The methods a registered type's forward may delegate to (nn.ConvNd's ``_conv_forward``): a subclass that
# overrides any of them computes its own output.
FORWARD_METHODS = ("forward", "_conv_forward")


def overrides_forward(cls: type, base: type) -> bool:
    """Whether ``cls`` (a subclass of ``base``) replaces ``base``'s forward or a method it calls."""
    return any(getattr(cls, m, None) is not getattr(base, m, None) for m in FORWARD_METHODS)


class ForwardMismatch(RuntimeError):
    """A layer whose forward its helper does not describe: the preconditioner refuses that layer (it is left to the
    optimizer, named in a warning and in the summary) and the run goes on."""


# What the refusal says K-FAC does and how to change it (every forward-check refusal ends so).
REFUSED = ("K-FAC leaves it to the optimizer unpreconditioned from now on (named in the summary). skip_layers=[{name!r}] "
           "(or [{cls!r}] for every layer of the type) does so from the start without this warning; "
           "lightning_spdkfac.register_layer_type({cls}, ...) with a helper that describes it preconditions it")


def refusal(name: str, helper: LayerHelper, why: str) -> ForwardMismatch:
    """The refusal of a layer whose forward its helper does not describe."""
    cls = type(helper.module).__name__
    return ForwardMismatch(
        f"K-FAC layer {name!r} ({cls}): its class overrides forward, and {why}, so K-FAC's "
        f"{type(helper).__name__} does not describe what it computes and would build wrong factors. "
        + REFUSED.format(name=name, cls=cls))


def _describe(x: torch.Tensor) -> str:
    return f"{x.dtype} of shape {tuple(x.shape)}"


def verify_output(helper: LayerHelper, name: str, x: Any, output: torch.Tensor) -> None:
    """Raise :func:`refusal` unless the helper reproduces the module's ``output`` from its input ``x``.

    The check clears ``helper.verify_output`` once it has run; an empty input is checked at the next call.
    """
    if not isinstance(x, torch.Tensor):
        helper.verify_output = False
        raise refusal(name, helper, f"its first input is not a tensor ({type(x).__name__})")
    if x.numel() == 0:
        return
    helper.verify_output = False
    with torch.no_grad(), autocast_off(x.device.type):
        try:
            expected = helper.expected_output(x)
        except (RuntimeError, IndexError, TypeError, ValueError) as e:
            raise refusal(name, helper, f"its input ({_describe(x)}) is not what K-FAC takes: {e}") from e
        if isinstance(expected, str):
            raise refusal(name, helper, f"its input ({_describe(x)}) is not what K-FAC takes: {expected}")
        got, valid = expected
        want = output.detach().float()
        if got.shape != want.shape:
            raise refusal(name, helper, f"from its input ({_describe(x)}) K-FAC's map gives shape "
                                        f"{tuple(got.shape)}, its output has {tuple(want.shape)}")
        close = (got - want).norm() <= 1e-2 * want.norm() + 1e-6
        flags = torch.stack([close, valid if valid is not None else torch.ones_like(close)])
        ok, in_range = flags.tolist()  # the one host read of the check
    if not in_range:
        raise refusal(name, helper, f"its input ({_describe(x)}) is not what K-FAC takes: "
                                    f"{helper.input_requirement()}")
    if not ok:
        raise refusal(name, helper, "its output is not the one K-FAC's map gives from its input and parameters "
                                    f"({helper.reference_map})")
