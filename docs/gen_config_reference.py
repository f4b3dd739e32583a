"""Generate the configuration reference (docs/reference/configuration.md) from the code.

Every row comes from the objects themselves, read when the site is built: the fields of the ``KFACOptions``
and ``SPDOptions`` dataclasses and the constructor parameters of the ``KFAC`` callback,
``SPDKFACStrategy`` and ``SPDKFACDeepSpeedStrategy`` (name, type, default), with the first sentence of each
one's entry in the ``Args:`` section of its docstring. An option added to the code appears in the next build;
nothing here lists them by hand. The MkDocs hook docs/hooks/config_reference.py inserts the result into the
page; ``python docs/gen_config_reference.py`` prints it.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import re
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any

NO_DOC = "*(no docstring entry)*"


@dataclass(frozen=True)
class Row:
    name: str
    type: str
    default: str
    doc: str


@dataclass(frozen=True)
class Section:
    title: str
    qualname: str  # the public name users import
    intro: str
    rows: tuple[Row, ...]


# ----------------------------------------------------------------------------- docstrings
_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Yields|Raises|Attributes|Examples?|Notes?|Warnings?|See Also|"
                      r"Other Parameters|Keyword Args|Keyword Arguments)\s*:\s*$")
_ENTRY = re.compile(r"^(\*{0,2}[A-Za-z_]\w*)(\s*\([^)]*\))?\s*:\s*(.*)$")


def args_section(doc: str | None) -> dict[str, str]:
    """Google-style ``Args:`` of ``doc``: name -> its whole description (continuation lines joined)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    out: dict[str, str] = {}
    i = 0
    while i < len(lines) and not re.match(r"^(Args|Arguments|Parameters)\s*:\s*$", lines[i].strip()):
        i += 1
    if i == len(lines):
        return out
    base = len(lines[i]) - len(lines[i].lstrip())
    entry_indent: int | None = None
    current: str | None = None
    for line in lines[i + 1:]:
        if not line.strip():
            current = None if entry_indent is None else current
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= base:  # the section ended (another section, or text at the docstring's own indent)
            break
        if entry_indent is None:
            entry_indent = indent
        m = _ENTRY.match(line.strip())
        if indent == entry_indent and m:
            current = m.group(1).lstrip("*")
            out[current] = m.group(3).strip()
        elif indent > entry_indent and current is not None:
            out[current] = f"{out[current]} {line.strip()}".strip()
        elif indent < entry_indent:
            break
    return out


def first_sentence(text: str) -> str:
    """The first sentence of ``text`` (up to a period followed by a space and a capital or a backtick)."""
    text = " ".join(text.split())
    m = re.search(r"(?<!e\.g)(?<!i\.e)(?<!etc)\.(?=\s+[A-Z`(])", text)
    return text[: m.start() + 1] if m else text


# ----------------------------------------------------------------------------- types and defaults
def _resolve(token: str, namespace: dict[str, Any]) -> Any:
    head, *rest = token.split(".")
    if head not in namespace:
        return None
    obj = namespace[head]
    for part in rest:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _render_alias(obj: Any) -> str | None:
    """``Literal["a", "b"]`` -> ``"a" | "b"``; a union alias -> its members; a class -> None (keep its name)."""
    if isinstance(obj, type):
        return None
    origin = typing.get_origin(obj)
    if origin is typing.Literal:
        return " | ".join(repr(a).replace("'", '"') for a in typing.get_args(obj))
    if origin in (typing.Union, types.UnionType):
        parts = []
        for a in typing.get_args(obj):
            parts.append("None" if a is type(None) else (_render_alias(a) or _type_name(a)))
        return " | ".join(parts)
    if origin is not None:
        return _type_name(obj)
    return None


def _type_name(obj: Any) -> str:
    if isinstance(obj, type):
        return obj.__name__ if obj.__module__ == "builtins" else f"{obj.__module__.split('.')[0]}.{obj.__qualname__}"
    return str(obj).replace("typing.", "").replace("collections.abc.", "")


def render_type(annotation: Any, namespace: dict[str, Any]) -> str:
    """A readable type: a string annotation with its aliases expanded (``ScheduleChoice`` -> ``"spd" | ...``)."""
    if annotation is inspect.Parameter.empty:
        return ""
    if isinstance(annotation, str):
        try:  # the whole annotation, evaluated where it was written
            annotation = eval(annotation, dict(namespace))  # noqa: S307 - the package's own annotations
        except Exception:  # a name only the type checker knows: expand what can be resolved, token by token
            pass
    if not isinstance(annotation, str):
        return _render_alias(annotation) or _type_name(annotation)

    def expand(m: re.Match[str]) -> str:
        obj = _resolve(m.group(0), namespace)
        rendered = _render_alias(obj) if obj is not None else None
        return rendered if rendered is not None else m.group(0).split(".")[-1] if m.group(0).startswith("val.") else m.group(0)

    return re.sub(r"(?<![\"'\w])[A-Za-z_][\w.]*", expand, annotation)


def render_default(value: Any) -> str:
    if value is inspect.Parameter.empty or value is dataclasses.MISSING:
        return "required"
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value)
    if isinstance(value, str):
        return '"' + value + '"'
    return repr(value)


def _cell(text: str) -> str:
    # Sphinx roles (:class:`~pkg.mod.Name`) read as code in Markdown; a bar would end the table cell.
    text = re.sub(r":[a-z]+:`~?([\w.]+)`", lambda m: f"`{m.group(1).split('.')[-1]}`", text)
    return text.replace("|", "\\|").replace("\n", " ")


# ----------------------------------------------------------------------------- the sections
def _dataclass_rows(cls: type, docs: dict[str, str]) -> tuple[Row, ...]:
    namespace = vars(sys.modules[cls.__module__])
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        doc = docs.get(f.name)
        rows.append(Row(f.name, render_type(f.type, namespace), render_default(default),
                        first_sentence(doc) if doc else NO_DOC))
    return tuple(rows)


def _field_comments(cls: type) -> dict[str, str]:
    """``name: type = value  # comment`` (and comment lines just above a field) in the class body."""
    out: dict[str, str] = {}
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return out
    above: list[str] = []
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# ").strip())
            continue
        m = re.match(r"^([A-Za-z_]\w*)\s*:[^#=]*(?:=[^#]*)?(?:#\s*(.*))?$", stripped)
        if m and not stripped.startswith(("def ", "class ", "return")):
            text = " ".join([*above, m.group(2) or ""]).strip()
            if text:
                out[m.group(1)] = text
        above = []
    return out


def _signature_rows(cls: type, docs: dict[str, str]) -> tuple[Row, ...]:
    namespace = {}
    for klass in cls.__mro__:  # the annotations' names live in the module of the __init__ that has them
        namespace = {**vars(sys.modules[klass.__module__]), **namespace}
    rows = []
    for p in inspect.signature(cls.__init__).parameters.values():
        if p.name == "self":
            continue
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            doc = docs.get(p.name) or docs.get(f"**{p.name}")
            rows.append(Row(f"**{p.name}", "", "", first_sentence(doc) if doc else NO_DOC))
            continue
        doc = docs.get(p.name)
        rows.append(Row(p.name, render_type(p.annotation, namespace), render_default(p.default),
                        first_sentence(doc) if doc else NO_DOC))
    return tuple(rows)


def sections() -> list[Section]:
    """Every table of the reference, read from the code now."""
    from lightning_spdkfac import KFAC, KFACOptions, SPDKFACDeepSpeedStrategy, SPDKFACStrategy, SPDOptions

    strategy_docs = args_section(inspect.getdoc(SPDKFACStrategy))
    spd_docs = {**_field_comments(SPDOptions), **strategy_docs}
    return [
        Section("`KFACOptions`: the K-FAC hyperparameters", "lightning_spdkfac.KFACOptions",
                "The fields of `KFACOptions`: what `KFACPreconditioner(model, options)` (or its keyword arguments) and "
                "the `KFAC` callback take. Defaults are defined here once.",
                _dataclass_rows(KFACOptions, args_section(inspect.getdoc(KFACOptions)))),
        Section("`KFAC`: the Lightning callback", "lightning_spdkfac.KFAC",
                "The callback's arguments: the K-FAC hyperparameters above plus the callback's own; in YAML, the "
                "`kfac:` group of `spdkfac` (`--kfac.<name>=...`).",
                _signature_rows(KFAC, args_section(inspect.getdoc(KFAC)))),
        Section("`SPDOptions`: the schedule's options", "lightning_spdkfac.SPDOptions",
                "The fields of `SPDOptions`, what `SPDDistributor` takes in plain PyTorch "
                "(`SPDOptions.from_schedule(\"spd\", ...)`); the strategies build it from their arguments.",
                _dataclass_rows(SPDOptions, spd_docs)),
        Section("`SPDKFACStrategy`: DDP", "lightning_spdkfac.SPDKFACStrategy",
                "In YAML: `trainer.strategy` with `class_path: lightning_spdkfac.SPDKFACStrategy` "
                "(`--trainer.strategy.<name>=...`).",
                _signature_rows(SPDKFACStrategy, strategy_docs)),
        Section("`SPDKFACDeepSpeedStrategy`: DeepSpeed ZeRO 0/1/2/3", "lightning_spdkfac.SPDKFACDeepSpeedStrategy",
                "In YAML: `trainer.strategy` with `class_path: lightning_spdkfac.SPDKFACDeepSpeedStrategy`.",
                _signature_rows(SPDKFACDeepSpeedStrategy, args_section(inspect.getdoc(SPDKFACDeepSpeedStrategy)))),
    ]


def reference_markdown() -> str:
    out: list[str] = []
    for s in sections():
        out += [f"## {s.title}", "", s.intro, "", "| argument | type | default | description |", "|---|---|---|---|"]
        for r in s.rows:
            out.append(f"| `{r.name}` | {('`' + _cell(r.type) + '`') if r.type else ''} | "
                       f"{('`' + _cell(r.default) + '`') if r.default else ''} | {_cell(r.doc)} |")
        out += ["", f"Full documentation: [`{s.qualname.split('.')[-1]}`](api.md#{s.qualname}).", ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(reference_markdown())
