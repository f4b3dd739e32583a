"""What ``SPDKFACDeepSpeedStrategy`` checks before DeepSpeed runs, so that a wrong argument or an unsupported
machine is refused with a message that names it: the DeepSpeed config (a dict or a JSON file, its ZeRO stage:
0 to 3, no offload at stage 3), whether the accelerator runs fp16, the one-line notice before DeepSpeed JIT-builds an op, and a
stale build lock (a killed build's ``lock`` file, which torch's extension loader would wait on forever)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping

from pytorch_lightning.strategies import DeepSpeedStrategy

from .. import validation as val

_ZERO_STAGES = (0, 1, 2, 3)
_FP16_PRECISIONS = ("16-mixed", "16-true")


def _announce_op_build(builder_name: str) -> bool:
    """One line before DeepSpeed JIT-builds the op ``builder_name`` on a first run (about a minute, which
    it spends silently): only when the op is compatible, not installed prebuilt and not in torch's
    extension cache. Returns whether it announced; a DeepSpeed or torch without these internals: silent."""
    try:
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import installed_ops
        from pytorch_lightning.utilities.rank_zero import rank_zero_info
        from torch.utils.cpp_extension import _get_build_directory

        builder = get_accelerator().create_op_builder(builder_name)
        if builder is None or installed_ops.get(builder.NAME, False):
            return False
        if not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            return False
        folder = _get_build_directory(builder.name, verbose=False)
    except Exception:
        return False
    if os.path.exists(os.path.join(folder, f"{builder.name}.so")):
        return False
    rank_zero_info(
        f"DeepSpeed is building its {builder.name} op once (about a minute, in {folder}); later runs reuse it"
    )
    return True


# A build lock with no process building in its folder and nothing written there for this long is stale. A live
# build always has a process there (torch runs ninja, and ninja the compiler, in the build folder); the wait covers
# the moment between a builder taking the lock and starting ninja.
STALE_LOCK_SECONDS = 30.0


def _builders_in(folder: str) -> list[int]:
    """The processes whose working directory is ``folder`` (a build under way: ninja and the compiler run there);
    Linux's /proc, the processes this user may inspect; [] elsewhere."""
    found: list[int] = []
    real = os.path.realpath(folder)
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            if os.path.realpath(os.readlink(f"/proc/{pid}/cwd")) == real:
                found.append(int(pid))
        except OSError:  # gone, or another user's
            continue
    return found


def _last_write(folder: str) -> float:
    """The newest modification time of ``folder`` and its entries (the lock included)."""
    newest = os.stat(folder).st_mtime
    with os.scandir(folder) as entries:
        for entry in entries:
            try:
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
            except OSError:
                continue
    return newest


def check_build_lock(folder: str, *, stale_after: float = STALE_LOCK_SECONDS, poll: float = 0.5,
                     clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> None:
    """Return when torch's extension loader will not wait forever on ``folder``'s ``lock``: there is none, or a
    build is under way there (a process works in the folder); raise a RuntimeError naming the folder and the fix
    when the lock is stale: no process builds there and nothing in the folder was written for ``stale_after``
    seconds (a killed build left it, and every later run would wait on it without a word). A young lock with no
    builder yet is watched, every ``poll`` seconds, until one of those holds: at most ``stale_after`` seconds."""
    lock = os.path.join(folder, "lock")
    while True:
        try:
            created = os.stat(lock).st_mtime
            idle = clock() - _last_write(folder)
        except FileNotFoundError:
            return  # no lock (or its build just finished)
        if _builders_in(folder):
            return  # a build is under way: waiting for it is right
        if idle >= stale_after:
            age = clock() - created
            raise RuntimeError(
                f"DeepSpeed's op build folder {folder} holds a stale lock file ({lock}, {age:.0f} s old; no process is "
                f"building there and nothing was written there for {idle:.0f} s): a build that was interrupted "
                "(a killed first run) left it, and torch's extension loader would wait on it forever. Fix: delete it "
                f"(rm {lock}; or rm -r {folder} to rebuild the op from scratch), or point TORCH_EXTENSIONS_DIR at a "
                "fresh folder. (If a build on another machine shares this folder, wait for it to finish instead.)"
            )
        sleep(min(poll, stale_after - idle))


def _refuse_stale_op_lock(builder_name: str) -> None:
    """:func:`check_build_lock` on the folder DeepSpeed JIT-builds the op ``builder_name`` in, when it would build
    it (not installed prebuilt, compatible); a DeepSpeed or torch without these internals: nothing checked."""
    try:
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import installed_ops
        from torch.utils.cpp_extension import _get_build_directory

        builder = get_accelerator().create_op_builder(builder_name)
        if builder is None or installed_ops.get(builder.NAME, False):
            return
        if not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            return
        folder = _get_build_directory(builder.name, verbose=False)
    except Exception:
        return
    if os.path.isdir(folder):
        check_build_lock(folder)


def _fp16_requested(config: Mapping | None, precision: str | None) -> bool:
    """Will the engine run in fp16? An ``fp16`` section in the DeepSpeed config decides (Lightning adds
    one from the precision only where the config has none), else the Trainer's precision."""
    section = (config or {}).get("fp16")
    if isinstance(section, Mapping):
        return bool(section.get("enabled", False))  # DeepSpeed's default for a section without "enabled"
    return precision in _FP16_PRECISIONS


def _deepspeed_fp16_support() -> tuple[bool, str]:
    """DeepSpeed's own answer (the one its engine checks in ``deepspeed.initialize``) and its device name."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    return bool(accelerator.is_fp16_supported()), str(accelerator.device_name())
# What K-FAC under ZeRO-3 has not been checked with (DeepSpeedZero3GradAccess reads the optimizer's fp32 gradient
# slices in memory; offloaded ones live on another device or on NVMe, swapped in and out).
_STAGE_3_OFFLOADS = ("offload_optimizer", "offload_param")


def _load_config(config: object) -> tuple[dict | None, str]:
    """``config`` (or the file named by PL_DEEPSPEED_CONFIG_PATH when it is None) as a dict, and where it
    came from for messages; checked here instead of in Lightning's ``DeepSpeedStrategy``, whose errors
    do not say which argument is wrong."""
    what = "None, a DeepSpeed config dict or the path of a JSON file holding one"
    source = "config"
    if config is None:
        env = os.environ.get(DeepSpeedStrategy.DEEPSPEED_ENV_VAR)
        if not env:
            return None, ""
        config, source = env, f"config (None, so the file named by ${DeepSpeedStrategy.DEEPSPEED_ENV_VAR})"
    if isinstance(config, Mapping):
        if not all(isinstance(k, str) for k in config):
            raise TypeError(f"{source} must be {what}; its keys must be strings, got {val.show(config)}")
        return dict(config), ""
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"{source} must be {what}, got {val.show(config)}")
    path = os.fspath(config)
    if not isinstance(path, str) or not path or "\x00" in path or not os.path.isfile(path):
        raise ValueError(f"{source} must be {what}, got {config!r}, which is not a file")
    try:
        with open(path) as f:
            loaded = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{source} must be {what}, got {config!r}, which cannot be read as JSON: {e}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{source} must be {what}, got {config!r}, which holds {val.show(loaded)}, not an object")
    return loaded, f" (in config={config!r})"


def _check_zero_stage(config: dict | None, origin: str = "") -> None:
    """ZeRO stage 0 to 3 (stage 3 without offload) in a DeepSpeed config; ``origin`` names the file it was read from."""
    zero = (config or {}).get("zero_optimization")
    if zero is None:
        return
    if not isinstance(zero, Mapping):
        raise TypeError(
            f"config['zero_optimization'] must be a dict such as {{'stage': 2}}, got {val.show(zero)}{origin}"
        )
    stage = zero.get("stage", 0)
    if not val.is_int(stage):
        raise TypeError(
            f"config['zero_optimization']['stage'] must be the ZeRO stage 0, 1, 2 or 3, got {val.show(stage)}{origin}"
        )
    if stage not in _ZERO_STAGES:
        raise ValueError(
            f"config['zero_optimization']['stage'] must be 0, 1, 2 or 3: SPDKFACDeepSpeedStrategy supports ZeRO stages "
            f"0 to 3, but the DeepSpeed config asks for stage {stage!r}{origin}"
        )
    if stage == 3:
        _refuse_stage_3_offload(zero, origin)


def _refuse_stage_3_offload(zero: Mapping, origin: str) -> None:
    """ZeRO-3 with its optimizer states or parameters offloaded: K-FAC's gradient access is not checked there."""
    for key in _STAGE_3_OFFLOADS:
        section = zero.get(key)
        device = section.get("device", "none") if isinstance(section, Mapping) else section
        if device in (None, "none", False):
            continue
        argument = {"offload_optimizer": "offload_optimizer=True", "offload_param": "offload_parameters=True"}[key]
        raise ValueError(
            f"config['zero_optimization']['{key}'] must be absent or {{'device': 'none'}} at ZeRO stage 3 under K-FAC, "
            f"got device {device!r} (Lightning's {argument} sets it){origin}: K-FAC reads and writes the stage-3 "
            f"optimizer's fp32 gradient slices in place, and offloaded ones are swapped between devices, a path not "
            f"checked here. Fix: remove '{key}' from the config (or pass {argument.split('=')[0]}=False), or use stage=2"
        )
