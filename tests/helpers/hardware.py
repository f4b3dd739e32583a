"""What the machine under the tests can do, and how to make it answer like a machine that cannot.

The suite must pass on any x86-64 Linux machine with 2+ cores. The one capability found to differ
between such machines is DeepSpeed's fp16 on CPU: its CPU accelerator accepts fp16 only where oneDNN
has fp16 kernels (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: CPUs with AVX512-FP16 or
AMX-FP16, e.g. recent Intel Xeons, not AMD EPYC). Tests that need it skip with :data:`NO_FP16_REASON`.

``--cpu-fp16=off`` (or ``SPDKFAC_TEST_CPU_FP16=off``) makes a machine that has it answer as one that
does not, in the pytest process and in every rank a test starts (ranks call :func:`apply_overrides`),
so both halves of the suite can be run on one machine::

    make test PYTEST_ARGS="--cpu-fp16=off"
"""

from __future__ import annotations

import importlib.util
import os

ENV = "SPDKFAC_TEST_CPU_FP16"
MODES = ("auto", "off")


def mode() -> str:
    value = os.environ.get(ENV, "auto")
    if value not in MODES:
        raise ValueError(f"${ENV} must be one of {MODES}, got {value!r}")
    return value


def apply_overrides() -> None:
    """Make DeepSpeed's CPU accelerator report no fp16 when the run asks for it (idempotent)."""
    if mode() != "off" or importlib.util.find_spec("deepspeed") is None:
        return
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    CPU_Accelerator.is_fp16_supported = lambda self: False


def deepspeed_cpu_fp16() -> bool:
    """Does DeepSpeed's accelerator (the CPU one here) run fp16 on this machine, overrides applied?"""
    apply_overrides()
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def no_fp16_reason() -> str:
    """Why an engine-level fp16 test is skipped here."""
    why = (f"forced off by --cpu-fp16=off / ${ENV}" if mode() == "off" else
           "torch.ops.mkldnn._is_mkldnn_fp16_supported() is False: the CPU lacks AVX512-FP16/AMX-FP16")
    return (
        f"DeepSpeed's CPU accelerator has no fp16 on this machine ({why}), so deepspeed.initialize refuses "
        "fp16; the same behaviour is tested through the core in test_preconditioner.py::"
        "test_loss_scale_still_in_the_gradients_is_taken_out_of_g_and_the_kl_clip_and_overflow_skips"
    )
