"""MkDocs hook: the reference pages written from the code, so that they cannot drift from it.

* ``<!-- generated: configuration -->`` becomes one table per section of ``params.yaml``, read from the section
  models the pipeline validates with (:func:`dpml.config.config_model`): every key, its type, its default and the
  rule a value must meet; ``train`` has one table per registered trainer (``train.algorithm`` picks it).
* ``<!-- generated: cli -->`` becomes each command's ``--help``, from the parser ``dpml`` runs
  (:func:`dpml.cli.build_parser`).
"""

from __future__ import annotations

import argparse
import re
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

CONFIGURATION = "<!-- generated: configuration -->"
CLI = "<!-- generated: cli -->"
RULES = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤", "min_length": "length ≥", "max_length": "length ≤"}


def _type(annotation: Any) -> str:
    """A reader's spelling of a field's type: ``str`` for a choice of words (the allowed column lists them),
    class names without their modules, no validation metadata."""
    if typing.get_origin(annotation) is typing.Literal:
        return type(typing.get_args(annotation)[0]).__name__
    text = annotation.__name__ if isinstance(annotation, type) else repr(annotation)
    text = re.sub(r"Annotated\[(.*?), FieldInfo\(.*?\)\]", r"\1", text.replace("typing.", ""))
    text = re.sub(r"Union\[(.*?)\]", lambda m: " | ".join(m.group(1).split(", ")), text)
    text = re.sub(r"\b(?:[a-z_]+\.)+([A-Z]\w*)", r"\1", text)
    return text.replace("|", "\\|")


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        return "(its own defaults)" if isinstance(value, BaseModel) else f"`{value!r}`"
    if field.is_required():
        return "required"
    return f"`{field.default!r}`"


def _rule(field: FieldInfo) -> str:
    found = []
    for item in field.metadata:
        for attribute, symbol in RULES.items():
            value = getattr(item, attribute, None)
            if value is not None:
                found.append(f"{symbol} {value}")
    literal = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else ()
    if literal:
        found.append("one of " + ", ".join(f"`{v}`" for v in literal))
    return "; ".join(found)


def section_table(name: str, model: type[BaseModel], title: str | None = None) -> list[str]:
    """The table of one section: key, type, default, allowed values; the model's docstring above it."""
    lines = [f"### {title or f'`{name}`'}", ""]
    doc = (model.__doc__ or "").strip()
    if doc:
        lines += [re.sub(r":(?:mod|func|class|data|meth):", "", " ".join(doc.split("\n\n")[0].split())), ""]
    lines += ["| key | type | default | allowed |", "|---|---|---|---|"]
    for key, field in model.model_fields.items():
        lines.append(
            f"| `{name}.{key}` | {_type(field.annotation)} | {_default(field).replace('|', chr(92) + '|')} "
            f"| {_rule(field)} |"
        )
    return lines + [""]


def configuration_reference() -> str:
    from dpml.config import config_model
    from dpml.train.registry import TRAINERS

    lines: list[str] = []
    for name, field in config_model().model_fields.items():
        if name == "train":
            for trainer in TRAINERS.values():
                lines += section_table("train", trainer.settings, f"`train` with `algorithm: {trainer.name}`")
            continue
        model = field.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            lines += section_table(name, model)
        else:
            lines += [f"### `{name}`", "", f"Type {_type(model)}, default {_default(field)}.", ""]
    return "\n".join(lines)


def cli_reference() -> str:
    from dpml.cli import build_parser

    parser = build_parser()
    lines = ["## `dpml`", "", "```text", parser.format_help().rstrip(), "```", ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                lines += [f"## `dpml {name}`", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


def on_page_markdown(markdown: str, **_: Any) -> str:
    if CONFIGURATION in markdown:
        markdown = markdown.replace(CONFIGURATION, configuration_reference())
    if CLI in markdown:
        markdown = markdown.replace(CLI, cli_reference())
    return markdown
