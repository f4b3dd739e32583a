"""MkDocs hook: the real K-FAC summaries and the ``memory_limit`` error of docs/guide/summary-memory.md, printed
by the package at build time from the example model below (so the page shows what this version prints).

``python docs/hooks/summary_example.py`` prints the markdown it inserts.
"""

from __future__ import annotations

import warnings

MARKER = "<!-- summary-example: generated here at build time -->"

# The example of the page, shown as it is and run as it is.
EXAMPLE = '''\
import torch
from torch import nn
from lightning_spdkfac import KFACPreconditioner


class ByteLM(nn.Module):
    """A small byte-level language model: a tied head, a grouped convolution, a norm, a position table."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(256, 64)
        self.pos = nn.Parameter(torch.zeros(32, 64))
        self.conv = nn.Conv1d(64, 64, kernel_size=3, padding=1, groups=4)
        self.norm = nn.LayerNorm(64)
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)
        self.head = nn.Linear(64, 256, bias=False)
        self.head.weight = self.tok.weight  # tied to the embedding

    def forward(self, x):  # x: (batch, 32) byte ids
        h = self.tok(x) + self.pos
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.head(self.down(torch.relu(self.up(self.norm(h)))))


print(KFACPreconditioner(ByteLM()).summary())  # KFAC() prints the same on rank 0 when the fit starts
'''

ASYNC_DIAGONAL = 'print(KFACPreconditioner(ByteLM(), async_inverses=True, max_factor_side=128).summary())\n'
LIMIT = 'KFACPreconditioner(ByteLM(), memory_limit="1MiB")  # KFAC(memory_limit="1MiB") stops the same way\n'


def _run(code: str, namespace: dict) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the tied embedding's warning: the summary names it too)
        exec(compile(code, "<summary example>", "exec"), namespace)
    return out.getvalue().rstrip("\n")


def example_markdown() -> str:
    namespace: dict = {"__name__": "summary_example"}
    summary = _run(EXAMPLE, namespace)
    variant = _run(ASYNC_DIAGONAL, namespace)
    try:
        _run(LIMIT, namespace)
    except MemoryError as e:
        refused = f"MemoryError: {e}"
    else:  # pragma: no cover - the example model is above the limit by construction
        raise RuntimeError("the memory_limit example did not stop: its model no longer exceeds 1 MiB")
    return "\n".join([
        "```python", EXAMPLE.rstrip("\n"), "```", "", "prints", "", "```text", summary, "```", "",
        "With `async_inverses=True` and `max_factor_side=128` (sides above 128 kept diagonal) the same model gives",
        "", "```python", ASYNC_DIAGONAL.rstrip("\n"), "```", "", "```text", variant, "```", "",
        "and a limit below its K-FAC memory stops at setup, before anything is allocated:", "",
        "```python", LIMIT.rstrip("\n"), "```", "", "```text", refused, "```",
    ])


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != "guide/summary-memory.md":
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"docs/guide/summary-memory.md has lost its marker line {MARKER!r}")
    return markdown.replace(MARKER, example_markdown())


if __name__ == "__main__":
    print(example_markdown())
