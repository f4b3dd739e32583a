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


# What each field case must give with function capture and MoE blocks (issue 35's targets): nothing silent, and the
# layers K-FAC cannot follow named with their reason (a share of the model: the minimum factored share below).
FIELD = {
    # (tiny models: norms, bias tables, tokens and biases held outside a layer are a few % here, named)
    "swin_like": 0.95, "eva_like": 0.95, "shared_weight": 1.0, "tf_same": 0.99,
    "mamba_like": 0.85,  # the conv weight handed to a fused kernel is named (CAPTURE_MISSED), A_log and D too
    "wav2vec2_like": 0.70,  # the projection whose output is written in place is named
    "whisper_like": 0.50,  # the position table is refused by name (its forward is not an embedding lookup)
    "mixtral_eager": 0.95, "mixtral_grouped_mm": 0.95, "qwen2_moe_grouped_mm": 0.95, "olmoe_grouped_mm": 0.95,
    "lora_llama": 1.0,
}


@pytest.mark.parametrize("name", sorted(FIELD))
def test_field_cases_are_followed_or_named(hf, name):
    from tests.helpers import lookalikes

    row = hf.measure(name, lookalikes.ZOO[name])
    _check_shares(row)
    assert row["silent"] == 0.0 and not row["silent_params"], row["silent_params"]
    assert row["factored"] >= FIELD[name], (row["factored"], row["named_reasons"])
    assert not row["partial_layers"], row["partial_layers"]  # every functional use of a factored weight followed


def test_a_peft_lora_model_counts_its_adapters_only_and_fits_a_small_memory_limit():
    from lightning_spdkfac.kfac.preconditioner import KFACPreconditioner
    from tests.helpers import lookalikes

    why = lookalikes.peft_available()
    if why is not None:
        pytest.skip(why)
    model = lookalikes.lora_llama()[0]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    pre = KFACPreconditioner(model, memory_limit="2MB")  # the frozen base is neither registered nor counted
    s = pre.summary()
    assert s.trainable == trainable and s.preconditioned == trainable and not s.left_out
    assert all("lora_" in r.name for r in s.rows) and s.total_bytes < 2 * 2**20
    with pytest.raises(MemoryError, match="memory_limit"):
        KFACPreconditioner(model, memory_limit=s.total_bytes // 2)
