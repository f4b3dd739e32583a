"""docs/guide/summary-memory.md's example (issue 38): the summaries and the memory_limit error are printed by the
package when the site is built (docs/hooks/summary_example.py); here the hook's output is checked against the
summary computed independently from the model's shapes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOOK = REPO / "docs" / "hooks" / "summary_example.py"


def _hook():
    spec = importlib.util.spec_from_file_location("summary_example_hook", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_gets_the_printed_summaries_and_the_refusal():
    hook = _hook()
    page = (REPO / "docs" / "guide" / "summary-memory.md").read_text()
    assert hook.MARKER in page and "docs/hooks/summary_example.py" in (REPO / "mkdocs.yml").read_text()
    text = hook.example_markdown()
    # the ByteLM's blocks, by hand: conv 64->64 in 4 groups of 16, kernel 3, bias: A 4 x (16*3+1), G 4 x 16;
    # up 64->256 with bias: A 65, G 256; down 256->64: A 257, G 64; head tied to the embedding, no bias: A 64, G 256
    for row in ("0  conv  Conv1d  4 x 49x49  4 x 16x16", "1  up    Linear  65x65      256x256",
                "2  down  Linear  257x257    64x64", "3  head  Linear  64x64      256x256"):
        assert row in text, row
    # up's bytes in float32: A, G and the accumulators (x x^T 64x64, g g^T 256x256, the input sum 64); inverses A, G
    factors = 4 * (65 * 65 + 256 * 256 + 64 * 64 + 256 * 256 + 64)
    inverses = 4 * (65 * 65 + 256 * 256)
    assert f"{factors / 1024:.1f} KiB  {inverses / 1024:.1f} KiB" in text
    assert "diag 256" in text and "Async" in text  # the max_factor_side=128, async_inverses=True variant
    assert ("MemoryError: K-FAC would need 3.0 MiB on this rank at the peak of an inverse step (2.5 MiB held "
            "between steps, plus 517.0 KiB of workspace" in text and "above memory_limit=1.0 MiB" in text)
    assert "K-FAC memory: 2.5 MiB held between steps, 3.0 MiB at the peak of an inverse step" in text
    assert "pos [2,048]" in text and "norm.weight, norm.bias [128]" in text
