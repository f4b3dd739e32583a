"""Every Python and YAML snippet of README.md and docs/**/*.md runs or is validated, so none can rot (issue 28).

- ``python`` blocks are executed, in order, in one subprocess (the snippets train, start process groups and
  register layer types: none of that may leak into the rest of the suite). Each runs in a fresh namespace
  holding the fixtures below; a block marked ``<!-- snippet: continue (...) -->`` runs in the namespace of
  the block before it in the same file. Every ``pytorch_lightning`` and ``lightning.pytorch`` ``Trainer`` a
  snippet builds is capped to a few steps on one CPU process (:data:`CAPS`): a snippet written for 8 GPUs
  runs here on a tiny model, its other arguments (strategy, callbacks, precision) as written.
- ``yaml`` blocks go through the ``spdkfac`` LightningCLI parser on top of configs/digits.yaml
  (``lightning_cli(..., run=False)``: parsed, validated and instantiated, not fitted).
- ``bash``, ``text`` and other blocks are not executed; the config files, example and benchmark scripts that
  bash blocks name must exist.
- A block that cannot run here (a signature, a multi-node launch) is marked ``<!-- snippet: skip (reason) -->``
  on the line before its fence; it is reported as skipped with its reason. A block marked
  ``<!-- snippet: process-group (...) -->`` runs inside a 1-rank gloo process group that the runner creates.

Fixtures of every Python snippet: ``model`` (a tiny LightningModule: 8 -> 16 -> 3 MLP, SGD), ``datamodule``
(random 8-feature, 3-class data, batches of 8), ``loader`` (a few such batches), ``opt`` (SGD on ``model``),
``loss_fn`` (cross-entropy), ``pl``, ``torch``, ``nn``; the working directory is a fresh folder holding
``ds_config.json`` (a ZeRO-2 DeepSpeed config).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!--\s*snippet:\s*([\w-]+)\s*(?:\((.*)\))?\s*-->$")
MARKERS = ("skip", "continue", "process-group")
FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)\s*$")
RUN = ("python",)
VALIDATE = ("yaml", "yml")
NOT_RUN = ("bash", "sh", "console", "text", "bibtex", "")
# Every Trainer a snippet builds gets these: one CPU process, a few steps, nothing written but what it must.
CAPS = {"accelerator": "cpu", "devices": 1, "num_nodes": 1, "max_epochs": 1, "limit_train_batches": 6,
        "limit_val_batches": 2, "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
        "enable_model_summary": False}
DS_CONFIG = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 8}


@dataclass(frozen=True)
class Snippet:
    path: str  # relative to the repository
    line: int  # of the opening fence
    lang: str
    code: str
    marker: str | None = None
    reason: str | None = None

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def collect(paths: list[Path] | None = None) -> list[Snippet]:
    """Every fenced block of ``paths`` (default: README.md and docs/), with the marker on the line before it."""
    out = []
    for path in paths or markdown_files():
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            indent, lang = m.group(1), m.group(2).lower()
            j = i + 1
            while j < len(lines) and not (lines[j].startswith(indent + "```") and lines[j].strip() == "```"):
                j += 1
            code = textwrap.dedent("\n".join(lines[i + 1:j])) + "\n"
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            marker = MARKER.match(lines[k].strip()) if k >= 0 else None
            out.append(Snippet(str(path.relative_to(REPO)), i + 1, lang, code,
                               marker.group(1) if marker else None, marker.group(2) if marker else None))
            i = j + 1
    return out


SNIPPETS = collect()
CHECKED = [s for s in SNIPPETS if s.lang in RUN + VALIDATE]


# ----------------------------------------------------------------------------- the runner (a subprocess)
def _fixtures() -> dict:
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))

    class TinyModel(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return self.net(inputs)

        def training_step(self, batch, batch_idx):
            loss = F.cross_entropy(self(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    class TinyData(pl.LightningDataModule):
        def train_dataloader(self):
            return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)

        def val_dataloader(self):
            return DataLoader(TensorDataset(x, y), batch_size=8)

    model = TinyModel()
    return {"model": model, "datamodule": TinyData(), "loader": [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)],
            "opt": torch.optim.SGD(model.parameters(), lr=0.1), "loss_fn": F.cross_entropy, "pl": pl,
            "torch": torch, "nn": nn}


def _cap_trainers() -> None:
    import importlib
    import inspect

    import lightning_spdkfac.cli  # noqa: F401 - its LightningCLI (the YAML check) keeps the real Trainer
    for name in ("pytorch_lightning", "lightning.pytorch"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        base = module.Trainer

        class Capped(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **{**kwargs, **CAPS})

        Capped.__name__ = Capped.__qualname__ = "Trainer"
        Capped.__init__.__signature__ = inspect.signature(base.__init__)  # type: ignore[attr-defined]
        module.Trainer = Capped


def _run_python(snippet: Snippet, namespace: dict) -> None:
    import torch.distributed as dist

    if snippet.marker == "process-group" and not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        exec(compile(snippet.code, snippet.id, "exec"), namespace)  # noqa: S102 - our own documentation
    finally:
        if dist.is_initialized():  # a Trainer's or our group: the next snippet starts without one
            dist.destroy_process_group()


def _run_yaml(snippet: Snippet, index: int) -> None:
    import contextlib
    import io

    from lightning_spdkfac.cli import lightning_cli

    path = Path(f"snippet_{index}.yaml")
    path.write_text(snippet.code)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            lightning_cli(["--config", str(REPO / "configs" / "digits.yaml"), "--config", str(path),
                           "--trainer.max_epochs=1"], run=False)
    except SystemExit as exit_:  # the parser's verdict is on stderr
        raise RuntimeError(f"spdkfac CLI exited {exit_.code}: {err.getvalue()[-2000:]}") from None


def run_all(snippets: list[Snippet]) -> dict[str, dict]:
    """Run (python) or validate (yaml) each snippet in order; id -> {"ok", "error", "seconds"}."""
    import time
    import traceback

    import torch

    torch.set_num_threads(1)
    _cap_trainers()
    Path("ds_config.json").write_text(json.dumps(DS_CONFIG))
    results: dict[str, dict] = {}
    namespace: dict = {}
    previous_path = None
    for index, snippet in enumerate(snippets):
        start = time.perf_counter()
        try:
            if snippet.lang in RUN:
                if snippet.marker != "continue" or previous_path != snippet.path:
                    namespace = _fixtures()
                previous_path = snippet.path
                _run_python(snippet, namespace)
            else:
                _run_yaml(snippet, index)
            results[snippet.id] = {"ok": True, "error": None}
        except BaseException:  # noqa: BLE001 - reported per snippet (SystemExit from the CLI included)
            results[snippet.id] = {"ok": False, "error": traceback.format_exc()}
        results[snippet.id]["seconds"] = round(time.perf_counter() - start, 2)
    return results


# ----------------------------------------------------------------------------- the tests
def _to_run() -> list[Snippet]:
    return [s for s in CHECKED if s.marker != "skip"]


_RESULTS: dict[str, dict] | None = None


def _results(tmp_path_factory) -> dict[str, dict]:
    global _RESULTS
    if _RESULTS is None:
        work = tmp_path_factory.mktemp("snippets")
        (work / "in.json").write_text(json.dumps([asdict(s) for s in _to_run()]))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run([sys.executable, __file__, str(work / "in.json"), str(work / "out.json")], cwd=work,
                              env=env, capture_output=True, text=True, timeout=280)
        assert proc.returncode == 0, f"the snippet runner failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        _RESULTS = json.loads((work / "out.json").read_text())
    return _RESULTS


@pytest.mark.parametrize("snippet", [pytest.param(s, id=s.id) for s in CHECKED])
def test_snippet(snippet: Snippet, tmp_path_factory) -> None:
    if snippet.marker == "skip":
        pytest.skip(f"{snippet.id}: {snippet.reason}")
    result = _results(tmp_path_factory)[snippet.id]
    if not result["ok"]:
        what = "ran" if snippet.lang in RUN else "was validated by the spdkfac CLI"
        pytest.fail(f"{snippet.id} ({snippet.lang}) failed as it {what}:\n{result['error']}", pytrace=False)


def test_markers_are_known_and_skips_say_why() -> None:
    for path in markdown_files():
        lines = path.read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines, 1):
            m = MARKER.match(line.strip())
            if line.strip().startswith("<!-- snippet") and not m:
                raise AssertionError(f"{path.relative_to(REPO)}:{n}: unreadable snippet marker {line.strip()!r}")
            if not m:
                continue
            assert m.group(1) in MARKERS, f"{path.relative_to(REPO)}:{n}: unknown marker {m.group(1)!r}"
            if m.group(1) == "skip":
                assert (m.group(2) or "").strip(), f"{path.relative_to(REPO)}:{n}: a skip must say why"
            following = next((x for x in lines[n:] if x.strip()), "")
            assert FENCE.match(following), f"{path.relative_to(REPO)}:{n}: a marker must stand right above a fence"
    for s in SNIPPETS:
        assert s.lang in RUN + VALIDATE + NOT_RUN, f"{s.id}: unknown block language {s.lang!r}"
        if s.marker == "continue":
            before = [t for t in SNIPPETS if t.path == s.path and t.line < s.line and t.lang in RUN]
            assert before and before[-1].marker != "skip", f"{s.id}: 'continue' needs a run snippet before it"


def test_inventory(capsys) -> None:
    """How many snippets are run, validated, skipped (with why) and not code; printed with -s."""
    run = [s for s in CHECKED if s.lang in RUN and s.marker != "skip"]
    validated = [s for s in CHECKED if s.lang in VALIDATE and s.marker != "skip"]
    skipped = [s for s in CHECKED if s.marker == "skip"]
    other = [s for s in SNIPPETS if s.lang in NOT_RUN]
    assert run and validated
    with capsys.disabled():
        print(f"\ndocs snippets: {len(run)} python run, {len(validated)} yaml validated, {len(skipped)} skipped, "
              f"{len(other)} bash/text not executed")
        for s in skipped:
            print(f"  skipped {s.id}: {s.reason}")


PATH_IN_SHELL = re.compile(r"(?<![\w/.-])((?:configs|examples|benchmarks)/[\w./-]+\.(?:yaml|py|sbatch))\b")


def test_files_named_in_shell_blocks_exist() -> None:
    """The configs and scripts the shell blocks run are where the docs say (a rename shows here)."""
    missing = []
    for s in SNIPPETS:
        if s.lang not in ("bash", "sh", "console"):
            continue
        for name in PATH_IN_SHELL.findall(s.code):
            if not (REPO / name).exists():
                missing.append(f"{s.id}: {name}")
    assert not missing, "files named in shell snippets that do not exist:\n" + "\n".join(missing)


if __name__ == "__main__":  # the runner: python tests/test_docs_snippets.py IN.json OUT.json
    snippets_in = [Snippet(**d) for d in json.loads(Path(sys.argv[1]).read_text())]
    Path(sys.argv[2]).write_text(json.dumps(run_all(snippets_in), indent=1))
