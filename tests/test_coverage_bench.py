"""benchmarks/hf_models.py's coverage accounting on zoo models (tests/helpers/lookalikes.py): the factored, named and
silent shares are disjoint parts of the trainable parameters, a parameter that got a gradient is silent only if it is
in neither of the others, a weight also used through a function is reported as partial, and failures are rows.
Only invariants are checked (not today's shares): they hold before and after K-FAC learns to follow functions."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # hf_models imports it lazily, but its MODELS table names its classes

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hf():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(REPO / "benchmarks"))
        yield importlib.import_module("hf_models")


def _check_shares(row: dict) -> None:
    assert row["error"] is None, row["error"]
    for k in ("factored", "named", "silent", "partial"):
        assert 0.0 <= row[k] <= 1.0 + 1e-9
    assert row["factored"] + row["named"] <= 1.0 + 1e-9  # disjoint
    assert row["accounted"] == pytest.approx(row["factored"] + row["named"])
    assert row["partial"] <= row["factored"] + 1e-9  # a partial block is one that produced factors


def test_shared_weight_accounting(hf):
    from tests.helpers import lookalikes

    row = hf.measure("shared_weight", lookalikes.shared_weight)
    _check_shares(row)
    assert row["silent"] == 0.0 and not row["silent_params"]
    assert row["accounted"] == pytest.approx(1.0)  # every parameter here gets a gradient
    assert set(row["partial_layers"]) <= {"enc"}  # enc's second use is F.linear; lin is never called
    named = {n for names in row["named_reasons"].values() for n in names}
    if "lin.weight" in named:  # K-FAC does not follow the functional use: then it must say so
        assert any("lin.weight" in names for why, names in row["named_reasons"].items() if "function" in why)


def test_swin_like_accounting(hf):
    from tests.helpers import lookalikes

    row = hf.measure("swin_like", lookalikes.swin_like)
    _check_shares(row)
    assert row["silent"] == 0.0


def test_failures_are_rows(hf):
    def broken():
        raise ValueError("no such config")

    row = hf.measure("broken", broken)
    assert row["stage"] == "build" and "no such config" in row["error"]


def test_kfac_kw_parsing(hf):
    assert hf.parse_kfac_kw(["capture=True", "damping=0.003", "inverse_method=eigen"]) == dict(
        capture=True, damping=0.003, inverse_method="eigen")
    with pytest.raises(SystemExit):
        hf.parse_kfac_kw(["capture"])
    with pytest.raises(SystemExit, match="not_an_option"):
        hf.check_kfac_kw(dict(not_an_option=1))
