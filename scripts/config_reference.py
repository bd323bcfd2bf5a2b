"""Writes the configuration reference (``docs/guide/config-reference*.md``) and the key table
(``opd/config_keys.json``) from opd's pydantic models.

Every section and key of the configs of ``opd train``, ``opd sft`` and ``opd generate``,
nested, with its type (and range), its default and its description. A key's description is
its ``Field(description=...)``; where a field has none, its attribute docstring or the
comment above it in the class, else the comment above the key in the command's config
template (``examples/configs/*.yaml``). A section already documented is linked, not repeated.

The key table is what :mod:`opd.utils.config_keys` checks a config's keys against before
the command imports the models (which import torch): each section's keys, and which of them
open a section, a list of sections or a choice of sections by ``type``.

    python scripts/config_reference.py           # regenerate the pages and the key table
    python scripts/config_reference.py --check   # exit 1 when the committed ones differ

``tests/unit/test_config_reference.py`` runs the check, so neither can drift from the models.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import re
import sys
import textwrap
import types
import typing
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import annotated_types
from pydantic import BaseModel, Discriminator, Tag
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

# The documented roots, one import each: change a line here when a config class moves.
from opd.distillation.config import MasterConfig as DistillationRoot
from opd.generate import GenerateMasterConfig as GenerateRoot
from opd.sft import SFTMasterConfig as SFTRoot
from opd.utils.config import StrictConfig

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "guide"
INDEX = "config-reference.md"
PAGE_LINES = 600  # a page of the guide stays below this (tests/unit/test_docs_pages.py)
COMMAND = "python scripts/config_reference.py"
KEY_TABLE = REPO / "opd" / "config_keys.json"


@dataclass(frozen=True)
class Root:
    """One command's config: its pydantic root, its template, and the prefix of its pages."""

    command: str
    model: type[BaseModel]
    template: str
    slug: str


ROOTS = (
    Root("opd train", DistillationRoot, "examples/configs/distillation.yaml", "train"),
    Root("opd sft", SFTRoot, "examples/configs/sft.yaml", "sft"),
    Root("opd generate", GenerateRoot, "examples/configs/generate_math.yaml", "generate"),
)


# ---------------------------------------------------------------------------------------------
# Reading the models


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The config sections (pydantic models) a field's annotation can hold, in order."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for argument in typing.get_args(annotation):
        for model in _models_in(argument):
            if model not in found:
                found.append(model)
    return found


def _is_list(annotation: Any) -> bool:
    """Whether the annotation (through ``X | None`` and ``Annotated``) is a list of sections."""
    origin = typing.get_origin(annotation)
    if origin in (list, tuple, Sequence):
        return bool(_models_in(annotation))
    if origin in (Union, types.UnionType, typing.Annotated):
        return any(_is_list(argument) for argument in typing.get_args(annotation))
    return False


def _variant_tag(model: type[BaseModel]) -> str | None:
    """The ``type`` value that selects this variant of a choice of sections, if it is one."""
    type_field = model.model_fields.get("type")
    if type_field is None or typing.get_origin(type_field.annotation) is not Literal:
        return None
    values = typing.get_args(type_field.annotation)
    return str(values[0]) if len(values) == 1 else None


def _first_paragraph(text: str | None) -> str:
    if not text:
        return ""
    paragraph = inspect.cleandoc(text).split("\n\n")[0]
    return " ".join(line.strip() for line in paragraph.splitlines())


def _class_docstring(model: type[BaseModel]) -> str:
    """The model's own docstring (not pydantic's or a base class's)."""
    return _first_paragraph(model.__dict__.get("__doc__"))


_SOURCE_NOTES: dict[type, dict[str, str]] = {}


def _source_notes(klass: type) -> dict[str, str]:
    """Attribute docstrings, else the comment lines right above each annotated attribute, of one class."""
    if klass in _SOURCE_NOTES:
        return _SOURCE_NOTES[klass]
    notes: dict[str, str] = {}
    try:
        lines, _ = inspect.getsourcelines(klass)
    except (OSError, TypeError):
        _SOURCE_NOTES[klass] = notes
        return notes
    source = textwrap.dedent("".join(lines))
    source_lines = source.splitlines()
    body = ast.parse(source).body[0]
    statements = body.body if isinstance(body, ast.ClassDef) else []
    for index, statement in enumerate(statements):
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        name = statement.target.id
        following = statements[index + 1] if index + 1 < len(statements) else None
        if (
            isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            notes[name] = _first_paragraph(following.value.value)
            continue
        comments = []
        line = statement.lineno - 2  # the line above, 0-based
        while line >= 0 and source_lines[line].strip().startswith("#"):
            comments.insert(0, source_lines[line].strip().lstrip("#").strip())
            line -= 1
        if comments:
            notes[name] = " ".join(comments)
    _SOURCE_NOTES[klass] = notes
    return notes


def _attribute_note(model: type[BaseModel], name: str) -> str:
    """The attribute docstring or comment of field ``name``, from the class that declares it."""
    for klass in model.__mro__:
        if name in inspect.get_annotations(klass):
            return _source_notes(klass).get(name, "")
    return ""


def _template_comments(path: Path) -> tuple[dict[str, str], dict[str, int]]:
    """``dotted key -> the comment block right above it`` and ``dotted key -> line`` of a YAML template."""
    comments: dict[str, str] = {}
    order: dict[str, int] = {}
    if not path.is_file():
        return comments, order
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        stripped = line.strip()
        if not stripped:
            pending = []
            continue
        indent = len(line) - len(line.lstrip())
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        match = re.match(r"^([A-Za-z_][\w-]*):(\s|$)", stripped)
        if match is None:  # a list item or a continuation: not a key of its own
            pending = []
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = ".".join([*(name for _, name in stack), match.group(1)])
        stack.append((indent, match.group(1)))
        order.setdefault(key, number)
        if pending and key not in comments:
            comments[key] = " ".join(pending)
        pending = []
    return comments, order


# ---------------------------------------------------------------------------------------------
# Writing a key's type, range and default


def _constraints(metadata: Sequence[Any]) -> list[str]:
    words = []
    for item in metadata:
        if isinstance(item, annotated_types.Ge):
            words.append(f"≥ {item.ge}")
        elif isinstance(item, annotated_types.Gt):
            words.append(f"> {item.gt}")
        elif isinstance(item, annotated_types.Le):
            words.append(f"≤ {item.le}")
        elif isinstance(item, annotated_types.Lt):
            words.append(f"< {item.lt}")
        elif isinstance(item, annotated_types.MinLen):
            words.append(f"at least {item.min_length} item{'s' if item.min_length != 1 else ''}")
        elif isinstance(item, annotated_types.MaxLen):
            words.append(f"at most {item.max_length} items")
        elif getattr(item, "pattern", None):
            words.append(f"matching `{item.pattern}`")
        elif isinstance(item, FieldInfo):
            words.extend(_constraints(item.metadata))
    return words


def _without_tag(annotation: Any) -> Any:
    """A section inside ``Annotated[Section, Tag(...)]`` (a choice's variant), else the annotation."""
    if typing.get_origin(annotation) is typing.Annotated:
        inner = typing.get_args(annotation)[0]
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    return annotation


_SCALARS = {bool: "boolean", int: "integer", float: "number", str: "string", Path: "path", typing.Any: "any"}


def _type_text(annotation: Any, link: Callable[[type[BaseModel]], str]) -> str:
    """How a key's annotation reads: ``integer ≥ 1 or null``, ``one of `a`, `b```, ``section (link)``."""
    origin = typing.get_origin(annotation)
    arguments = typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Annotated:
        text = _type_text(arguments[0], link)
        words = _constraints(arguments[1:])
        return f"{text} ({', '.join(words)})" if words else text
    if origin in (Union, types.UnionType):
        arguments = tuple(_without_tag(argument) for argument in arguments)
        models = [argument for argument in arguments if isinstance(argument, type) and issubclass(argument, BaseModel)]
        others = [argument for argument in arguments if argument not in models]
        parts = []
        literal_values: list[Any] = []
        for argument in others:
            if typing.get_origin(argument) is Literal:
                literal_values.extend(typing.get_args(argument))
            elif argument is not type(None):
                parts.append(_type_text(argument, link))
        if literal_values:
            parts.insert(0, "one of " + ", ".join(f"`{_value_text(value)}`" for value in literal_values))
        if len(models) > 1 and all(_variant_tag(model) for model in models):
            parts.append("a section, by `type`: " + ", ".join(link(model) for model in models))
        else:
            parts.extend(link(model) for model in models)
        if type(None) in arguments:
            parts.append("null")
        return " or ".join(parts)
    if origin is Literal:
        if len(arguments) == 1:
            return f"`{_value_text(arguments[0])}`"
        return "one of " + ", ".join(f"`{_value_text(value)}`" for value in arguments)
    if origin in (list, tuple, dict, Sequence):
        if origin is dict:
            return f"mapping of {_type_text(arguments[0], link)} to {_type_text(arguments[1], link)}"
        if origin is tuple and arguments and arguments[-1] is not Ellipsis:
            inner = {_type_text(argument, link) for argument in arguments}
            if len(inner) == 1:
                return f"list of {len(arguments)} {inner.pop()}s"
            return "list of " + ", ".join(_type_text(argument, link) for argument in arguments)
        return f"list of {_type_text(arguments[0], link)}" if arguments else "list"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return link(annotation)
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    return getattr(annotation, "__name__", str(annotation))


def _value_text(value: Any) -> str:
    """A value as YAML writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value) if (not value or value != value.strip() or "\n" in value) else value
    if isinstance(value, BaseModel):
        tag = _variant_tag(type(value))
        return f"(`type: {tag}`, with its defaults)" if tag else "(the section's defaults)"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_value_text(item)}" for key, item in value.items()) + "}"
    return repr(value)


def _default_text(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    text = _value_text(value)
    return text if text.startswith("(") else f"`{text}`"


def _cell(text: str) -> str:
    """Table-safe: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading (as tests/unit/test_docs_pages.py computes it)."""
    kept = []
    for char in heading.strip().lower():
        if char == " ":
            kept.append("-")
        elif char in "-_" or unicodedata.category(char)[0] in "LMN":
            kept.append(char)
    return "".join(kept)


# ---------------------------------------------------------------------------------------------
# The pages


@dataclass
class Section:
    """One heading and its table: a config section at a dotted path of one command's config."""

    number: int
    root: Root
    top: str  # the top-level key it belongs to
    path: str  # as the heading writes it, e.g. teachers.members[i]
    title: str  # the heading's text
    lines: list[str] = field(default_factory=list)
    page: str = INDEX

    @property
    def anchor(self) -> str:
        return _anchor(self.title)


class Reference:
    """Walks the roots and writes one section per config class, each documented once."""

    def __init__(self) -> None:
        self.sections: list[Section] = []
        self.documented: dict[type[BaseModel], Section] = {}
        self.root_tables: dict[str, list[str]] = {}
        self.comments: dict[str, str] = {}
        self.order: dict[str, int] = {}

    def build(self) -> None:
        main_comments, main_order = _template_comments(REPO / ROOTS[0].template)
        for root in ROOTS:
            comments, order = _template_comments(REPO / root.template)
            self.comments = {**main_comments, **comments}
            # the command's own template first, then the main template's order for the keys it inherits
            self.order = {**{key: 10**6 + line for key, line in main_order.items()}, **order}
            self._document_root(root)

    def link(self, model: type[BaseModel]) -> str:
        """A link to the section documenting ``model`` (its page is filled in by :func:`render`)."""
        section = self.documented[model]
        tag = _variant_tag(model)
        label = f"`{tag}`" if tag else f"section [`{section.path}`]"
        if tag:
            return f"[{label}]({{{{section:{section.number}}}}}#{section.anchor})"
        return f"{label}({{{{section:{section.number}}}}}#{section.anchor})"

    def _ordered(self, model: type[BaseModel], prefix: str) -> list[tuple[str, FieldInfo]]:
        """The model's fields in the template's order (fields the template lacks last, as declared)."""
        items = list(model.model_fields.items())

        def position(item: tuple[int, tuple[str, FieldInfo]]) -> tuple[int, int]:
            index, (name, info) = item
            return (self.order.get(prefix + (info.alias or name), 10**9), index)

        return [item for _, item in sorted(enumerate(items), key=position)]

    def _row(self, model: type[BaseModel], name: str, info: FieldInfo, dotted: str) -> str:
        models = _models_in(info.annotation)
        type_text = _type_text(info.annotation, self.link)
        words = _constraints(info.metadata)
        if words:
            type_text += f" ({', '.join(words)})"
        description = info.description or _attribute_note(model, name)
        if not description and len(models) > 1 and all(_variant_tag(choice) for choice in models):
            description = "a choice of sections by its `type` key; each choice takes only its own keys"
        if not description and len(models) == 1:
            description = _class_docstring(models[0])
        if not description and name == "type" and typing.get_origin(info.annotation) is Literal:
            description = "selects this choice"
        if not description:
            description = self.comments.get(dotted, "")
        description = description.replace("``", "`")
        key = info.alias or name
        return f"| `{key}` | {_cell(type_text)} | {_cell(_default_text(info))} | {_cell(description)} |"

    def _fields(
        self, root: Root, model: type[BaseModel], top: str | None, path: str, dotted: str
    ) -> tuple[list[str], list[tuple[type[BaseModel], str, str, str]]]:
        """The table of ``model``'s keys, and the sections it opens that are not documented yet."""
        rows = ["| key | type | default | description |", "|---|---|---|---|"]
        opened: list[tuple[type[BaseModel], str, str, str]] = []
        for name, info in self._ordered(model, f"{dotted}." if dotted else ""):
            key = info.alias or name
            child_dotted = f"{dotted}.{key}" if dotted else key
            child_path = (f"{path}.{key}" if path else key) + ("[i]" if _is_list(info.annotation) else "")
            for child in _models_in(info.annotation):
                if child not in self.documented:
                    self._reserve(root, child, top or key, child_path)
                    opened.append((child, top or key, child_path, child_dotted))
            rows.append(self._row(model, name, info, child_dotted))
        return rows, opened

    def _reserve(self, root: Root, model: type[BaseModel], top: str, path: str) -> None:
        tag = _variant_tag(model)
        title = f"`{path}`" + (f" with `type: {tag}`" if tag else "")
        if root is not ROOTS[0]:
            title += f" of `{root.command}`"
        section = Section(len(self.sections), root, top, path, title)
        self.documented[model] = section
        self.sections.append(section)

    def _document_root(self, root: Root) -> None:
        rows, opened = self._fields(root, root.model, None, "", "")
        self.root_tables[root.slug] = rows
        self._open(root, opened)

    def _open(self, root: Root, opened: list[tuple[type[BaseModel], str, str, str]]) -> None:
        for model, top, path, dotted in opened:
            section = self.documented[model]
            lines = [f"### {section.title}", ""]
            docstring = _class_docstring(model).replace("``", "`")
            if docstring:
                lines += [docstring, ""]
            rows, children = self._fields(root, model, top, path, dotted)
            section.lines = lines + rows + [""]
            self._open(root, children)


def _header(title: str) -> list[str]:
    return [
        f"# {title}",
        "",
        f"Generated from opd's pydantic config models by `{COMMAND}`; do not edit it by hand",
        "(`tests/unit/test_config_reference.py` fails when the pages and the models differ).",
        "A key's default is what a config that leaves the key out gets; `required` keys must be given.",
        "",
    ]


def render() -> dict[str, str]:
    """``file name -> text`` of every page of the reference (in ``docs/guide/``)."""
    reference = Reference()
    reference.build()
    by_root = {root.slug: [section for section in reference.sections if section.root is root] for root in ROOTS}
    intro = [
        *_header("Configuration reference"),
        "Every key of the YAML configs of `opd train`, `opd sft` and `opd generate`, nested, in",
        "the order of each command's commented template. Any key can also be given on the command",
        "line as `section.key=value`; [section 5](05-configuration-and-throughput.md#5-configuration)",
        "explains how a config is read and checked.",
        "",
    ]

    def root_block(root: Root, split: bool) -> list[str]:
        block = [
            f"## `{root.command}`",
            "",
            f"`{root.command} --config FILE [key=value ...]`; template: `{root.template}`.",
            "",
        ]
        block += reference.root_tables[root.slug] + [""]
        if split:
            tops = list(dict.fromkeys(section.top for section in by_root[root.slug]))
            pages = {section.top: section.page for section in by_root[root.slug]}
            if tops:
                block += ["Sections, one page each: " + ", ".join(f"[`{top}`]({pages[top]})" for top in tops) + ".", ""]
        else:
            for section in by_root[root.slug]:
                block += section.lines
        return block

    single = intro + [line for root in ROOTS for line in root_block(root, split=False)]
    pages: dict[str, list[str]] = {}
    if len(single) < PAGE_LINES - 10:
        pages[INDEX] = single
    else:  # one page per command's top-level section
        for section in reference.sections:
            section.page = f"config-reference-{section.root.slug}-{section.top.replace('_', '-')}.md"
        pages[INDEX] = intro + [line for root in ROOTS for line in root_block(root, split=True)]
        for section in reference.sections:
            page = pages.setdefault(
                section.page,
                [
                    *_header(f"Configuration reference: `{section.top}` of `{section.root.command}`"),
                    f"Part of the [configuration reference]({INDEX}#{_anchor(f'`{section.root.command}`')}).",
                    "",
                ],
            )
            page += section.lines
    texts = {}
    for name, lines in pages.items():
        text = "\n".join(lines).rstrip() + "\n"

        def target(match: re.Match[str], here: str = name) -> str:
            page = reference.sections[int(match.group(1))].page
            return "" if page == here else page

        texts[name] = re.sub(r"\{\{section:(\d+)\}\}", target, text)
    return texts


# ---------------------------------------------------------------------------------------------
# The key table (opd/config_keys.json)
#
# Its shape of a key: null (not checked: a value, a free-form mapping, or a shape the fast
# check does not follow), "Section", ["Section"] (a list of them) or {"variants": {tag:
# "Section"}, "default": tag or null} (a choice by `type`). Whatever this walk does not
# recognise is null: the fast check must never refuse a key that the models accept.


def _rewrites_its_input(model: type[BaseModel]) -> bool:
    """Whether a validator sees the section's raw mapping first (and may rename or drop keys)."""
    return any(
        decorator.info.mode in ("before", "wrap")
        for decorator in model.__pydantic_decorators__.model_validators.values()
    )


_EVERY_FIELD_NUMBER_CHECK = StrictConfig.__pydantic_decorators__.field_validators["_numbers_are_not_coerced"].func


def _field_rewritten(model: type[BaseModel], name: str) -> bool:
    """Whether a field validator sees this field's raw value first (StrictConfig's number check only reads scalars)."""
    for decorator in model.__pydantic_decorators__.field_validators.values():
        if decorator.info.mode not in ("before", "wrap"):
            continue
        if getattr(decorator.func, "__func__", None) is getattr(_EVERY_FIELD_NUMBER_CHECK, "__func__", object()):
            continue
        if "*" in decorator.info.fields or name in decorator.info.fields:
            return True
    return False


def _tagged_variants(
    members: Sequence[Any], discriminator: Any
) -> tuple[dict[str, type[BaseModel]], str | None] | None:
    """A discriminated union's variants by tag and the tag of a section without ``type``, if the table can follow it."""
    variants: dict[str, type[BaseModel]] = {}
    for member in members:
        tag = None
        if typing.get_origin(member) is typing.Annotated:
            member, *metadata = typing.get_args(member)
            tag = next((item.tag for item in metadata if isinstance(item, Tag)), None)
        if not (isinstance(member, type) and issubclass(member, BaseModel)):
            return None
        tag = tag if tag is not None else _variant_tag(member)
        if tag is None:
            return None
        variants[tag] = member
    if isinstance(discriminator, str):  # Field(discriminator="type"): a section without it is refused
        return (variants, None) if discriminator == "type" else None
    choose = discriminator.discriminator if isinstance(discriminator, Discriminator) else None
    if isinstance(choose, str):
        return (variants, None) if choose == "type" else None
    if not callable(choose) or any(choose({"type": tag}) != tag for tag in variants):
        return None  # the fast check reads `type`; a discriminator that reads anything else is not followed
    default = choose({})
    return variants, (default if default in variants else None)


def _key_shape(annotation: Any, info: FieldInfo | None, sections: list[type[BaseModel]]) -> Any:
    """How the table writes a key of this annotation; the sections it names are added to ``sections``."""

    def section(model: type[BaseModel]) -> str | None:
        if _rewrites_its_input(model):
            return None
        sections.append(model)
        return model.__name__

    origin = typing.get_origin(annotation)
    arguments = typing.get_args(annotation)
    discriminator = info.discriminator if info is not None else None
    if info is not None:  # pydantic moves a field's outer Annotated[...] metadata onto the field
        discriminator = next((item for item in info.metadata if isinstance(item, Discriminator)), discriminator)
    if origin is typing.Annotated:
        inner, *metadata = arguments
        discriminator = next((item for item in metadata if isinstance(item, Discriminator)), discriminator)
        if discriminator is None:
            return _key_shape(inner, None, sections)
        annotation, origin, arguments = inner, typing.get_origin(inner), typing.get_args(inner)
    if origin in (Union, types.UnionType):
        present = [argument for argument in arguments if argument is not type(None)]
        if discriminator is not None:
            choice = _tagged_variants(present, discriminator)
            if choice is None or any(_rewrites_its_input(model) for model in choice[0].values()):
                return None
            sections.extend(choice[0].values())
            return {"variants": {tag: model.__name__ for tag, model in choice[0].items()}, "default": choice[1]}
        if len(present) == 1:
            return _key_shape(present[0], None, sections)
        # A value or a section (distillation.lambda), or sections without a tag: pydantic reports
        # every branch's problems, which only the full validation can word.
        return None
    if origin in (list, tuple, Sequence) and len(arguments) in (1, 2) and arguments[-1] in (arguments[0], Ellipsis):
        item = arguments[0]
        if isinstance(item, type) and issubclass(item, BaseModel):
            named = section(item)
            return [named] if named is not None else None
        return None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return section(annotation)
    return None


def _key_table() -> dict[str, Any]:
    """``{"roots": {slug: {"section", "moved_keys"}}, "sections": {class name: {"keys", "names"?, "open"?}}}``."""
    tables: dict[type[BaseModel], dict[str, Any]] = {}
    pending: list[type[BaseModel]] = [root.model for root in ROOTS]
    while pending:
        model = pending.pop(0)
        if model in tables:
            continue
        keys: dict[str, Any] = {}
        by_name: dict[str, str] = {}
        for name, info in model.model_fields.items():
            key = info.alias or name
            keys[key] = None if _field_rewritten(model, name) else _key_shape(info.annotation, info, pending)
            if key != name and model.model_config.get("populate_by_name"):
                by_name[name] = key
        table: dict[str, Any] = {"keys": keys}
        if by_name:
            table["names"] = by_name
        if model.model_config.get("extra") != "forbid":
            table["open"] = True  # it takes keys it does not name
        tables[model] = table
    by_name_of_class: dict[str, type[BaseModel]] = {}
    for model in tables:
        other = by_name_of_class.setdefault(model.__name__, model)
        if other is not model:
            raise SystemExit(
                f"{other.__module__}.{other.__qualname__} and {model.__module__}.{model.__qualname__} share a "
                "class name, by which opd/config_keys.json names sections: rename one"
            )
    roots = {
        root.slug: {"section": root.model.__name__, "moved_keys": dict(getattr(root.model, "moved_keys", {}))}
        for root in ROOTS
    }
    return {"roots": roots, "sections": {model.__name__: table for model, table in tables.items()}}


def key_table_text() -> str:
    """The key table as committed: one line per section, in the order they are reached from the roots."""
    table = _key_table()
    lines = [
        "{",
        '"about": '
        + json.dumps(f"Generated by `{COMMAND}` from the config models; read by opd/utils/config_keys.py.")
        + ",",
        f'"roots": {json.dumps(table["roots"], ensure_ascii=False)},',
        '"sections": {',
    ]
    sections = list(table["sections"].items())
    for index, (name, section) in enumerate(sections):
        comma = "," if index < len(sections) - 1 else ""
        lines.append(f"{json.dumps(name)}: {json.dumps(section, ensure_ascii=False)}{comma}")
    lines += ["}", "}"]
    return "\n".join(lines) + "\n"


def stale_key_table(text: str) -> bool:
    """Whether the committed key table differs from ``text``."""
    return not KEY_TABLE.is_file() or KEY_TABLE.read_text(encoding="utf-8") != text


def _existing() -> dict[str, str]:
    return {path.name: path.read_text(encoding="utf-8") for path in sorted(GUIDE.glob("config-reference*.md"))}


def stale_pages(pages: dict[str, str]) -> list[str]:
    """The pages that differ from ``pages`` (or exist without being one of them, or are missing)."""
    existing = _existing()
    return sorted(name for name in set(existing) | set(pages) if existing.get(name) != pages.get(name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed pages or key table differ")
    arguments = parser.parse_args(argv)
    pages = render()
    keys = key_table_text()
    if arguments.check:
        stale = stale_pages(pages) + (["opd/config_keys.json"] if stale_key_table(keys) else [])
        if stale:
            print(f"config reference out of date ({', '.join(stale)}): run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    for old in set(_existing()) - set(pages):
        (GUIDE / old).unlink()
    for name, text in pages.items():
        (GUIDE / name).write_text(text, encoding="utf-8")
    KEY_TABLE.write_text(keys, encoding="utf-8")
    written = [f"docs/guide/{name} ({len(text.splitlines())} lines)" for name, text in pages.items()]
    print("wrote " + ", ".join([*written, f"opd/config_keys.json ({len(keys.splitlines())} lines)"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
