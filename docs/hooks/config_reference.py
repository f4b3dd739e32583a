"""MkDocs hook: fills the configuration reference (docs/reference/configuration.md) at build time.

The tables come from the code itself (docs/gen_config_reference.py reads the ``KFACOptions`` and
``SPDOptions`` dataclasses and the signatures and docstrings of ``KFAC``, ``SPDKFACStrategy`` and
``SPDKFACDeepSpeedStrategy``), so the page shows whatever options exist when the site is built.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

MARKER = "<!-- config-reference: the tables are generated here at build time -->"


def _generator():
    path = Path(__file__).resolve().parents[1] / "gen_config_reference.py"
    spec = importlib.util.spec_from_file_location("gen_config_reference", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != "reference/configuration.md":
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"docs/reference/configuration.md has lost its marker line {MARKER!r}")
    return markdown.replace(MARKER, _generator().reference_markdown())
