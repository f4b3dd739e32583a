"""The configuration reference (docs/reference/configuration.md) is generated from the code and lists every
option: each field of KFACOptions and SPDOptions and each parameter of the KFAC callback and of both strategies,
with a type, a default and a description read from the docstrings (issue 28)."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "reference" / "configuration.md"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gen = _load("gen_config_reference", REPO / "docs" / "gen_config_reference.py")
hook = _load("config_reference_hook", REPO / "docs" / "hooks" / "config_reference.py")


@pytest.fixture(scope="module")
def markdown() -> str:
    return gen.reference_markdown()


def _section(markdown: str, qualname: str) -> str:
    """The table of the section whose full-documentation link names ``qualname``."""
    parts = re.split(r"(?m)^## ", markdown)
    found = [p for p in parts if f"(api.md#{qualname})" in p]
    assert len(found) == 1, f"one section for {qualname}"
    return found[0]


def _rows(section: str) -> dict[str, list[str]]:
    rows = {}
    for line in section.splitlines():
        m = re.match(r"^\| `([^`]+)` \|(.*)\|$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in re.split(r"(?<!\\)\|", m.group(2))]
    return rows


def _expected():
    from lightning_spdkfac import KFAC, KFACOptions, SPDKFACDeepSpeedStrategy, SPDKFACStrategy, SPDOptions

    def params(cls):
        return [("**" if p.kind is p.VAR_KEYWORD else "") + p.name
                for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]

    return {
        "lightning_spdkfac.KFACOptions": [f.name for f in dataclasses.fields(KFACOptions)],
        "lightning_spdkfac.SPDOptions": [f.name for f in dataclasses.fields(SPDOptions)],
        "lightning_spdkfac.KFAC": params(KFAC),
        "lightning_spdkfac.SPDKFACStrategy": params(SPDKFACStrategy),
        "lightning_spdkfac.SPDKFACDeepSpeedStrategy": params(SPDKFACDeepSpeedStrategy),
    }


@pytest.mark.parametrize("qualname", list(_expected()))
def test_every_option_is_in_the_generated_page(markdown, qualname):
    rows = _rows(_section(markdown, qualname))
    expected = _expected()[qualname]
    missing = [name for name in expected if name not in rows]
    assert not missing, f"{qualname}: options missing from the configuration reference: {missing}"
    assert list(rows) == expected, "one row per option, in the code's order, nothing else"


@pytest.mark.parametrize("qualname", list(_expected()))
def test_every_option_has_a_type_default_and_description(markdown, qualname):
    from lightning_spdkfac import KFACOptions, SPDOptions

    for name, (type_, default, doc) in _rows(_section(markdown, qualname)).items():
        assert doc and gen.NO_DOC not in doc, (
            f"{qualname}.{name} has no entry in the Args: section of its docstring; add one (the configuration "
            "reference shows its first sentence)")
        if not name.startswith("**"):
            assert type_ and default, f"{qualname}.{name}: type {type_!r}, default {default!r}"
    # The defaults shown are the code's.
    rows = _rows(_section(markdown, "lightning_spdkfac.KFACOptions"))
    assert KFACOptions().damping == "auto" and rows["damping"][1] == '`"auto"`'
    assert rows["factor_approx"][1] == '`"auto"`' and rows["factor_dtype"][1] == "`torch.float32`"
    spd = _rows(_section(markdown, "lightning_spdkfac.SPDOptions"))
    assert spd["profile_steps"][1] == f"`{SPDOptions().profile_steps!r}`"
    assert spd["schedule"][0] == '`"spd" \\| "mpd" \\| "dkfac" \\| "dpkfac" \\| "auto"`'


def test_a_new_field_appears_without_any_list_to_update():
    @dataclasses.dataclass(frozen=True)
    class Options:
        """Options.

        Args:
            step_rule: how the step size is chosen. A second sentence that the table leaves out.
            width: a width,
                over two lines.
        """

        step_rule: str = "kl_clip"
        width: int | None = None

    rows = {r.name: r for r in gen._dataclass_rows(Options, gen.args_section(Options.__doc__))}
    assert rows["step_rule"] == gen.Row("step_rule", "str", '"kl_clip"', "how the step size is chosen.")
    assert rows["width"] == gen.Row("width", "int | None", "None", "a width, over two lines.")


def test_the_page_is_filled_at_build_time_and_the_readme_links_to_it(markdown):
    text = PAGE.read_text()
    assert text.count(hook.MARKER) == 1, "the hook fills the page at its marker"
    assert "| argument |" not in text, "the committed page holds no hand-kept table"

    class Page:
        class file:
            src_uri = "reference/configuration.md"

    assert hook.on_page_markdown(text, Page, None, None) == text.replace(hook.MARKER, markdown)
    readme = (REPO / "README.md").read_text()
    assert "docs/reference/configuration.md" in readme
    assert "## Configuration reference" not in readme
