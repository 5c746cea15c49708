"""mkdocs hook: the CLI and config reference pages, generated at build time.

``reference/cli.md`` comes from the ``fedax`` command's argparse parser and
``reference/config.md`` from the pydantic config schema (``fedax.experiments.config``):
the help strings, field types, bounds, defaults and the comments above each field in
``config.py`` are the only text, so nothing is written by hand twice. The pages are never
committed; ``python tools/docs_hooks.py cli|config`` prints one.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import sys
from typing import Any


def cli_markdown() -> str:
    """Every command's ``--help``, in the order the parser defines them."""
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: fix the width
    from fedax.cli.main import build_parser

    out = ["# The `fedax` command", "",
           "Generated from the command's own parser (`fedax ... --help`).", ""]

    def walk(parser: argparse.ArgumentParser, name: str, depth: int) -> None:
        out.extend([f"{'#' * min(depth, 4)} `{name}`", "", "```text",
                    parser.format_help().rstrip(), "```", ""])
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    walk(sub, f"{name} {sub_name}", depth + 1)

    walk(build_parser(), "fedax", 2)
    return "\n".join(out) + "\n"


def _field_comments(cls: type) -> dict[str, str]:
    """The ``# comments`` directly above (and at the end of) each field of ``cls``."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comments: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            text, i = [], node.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                text.insert(0, lines[i].strip().lstrip("# "))
                i -= 1
            line = lines[node.end_lineno - 1]
            if "  # " in line:
                text.append(line.split("  # ", 1)[1].strip())
            comments[node.target.id] = " ".join(text)
    return comments


def _default(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.default is PydanticUndefined:
        return "required"
    value = field.default
    if hasattr(value, "model_dump"):
        return "see below"
    return f"`{value!r}`" if value is not None else "`None`"


def config_markdown() -> str:
    """One table per config section: key, allowed values, default, meaning."""
    from pydantic import BaseModel

    from fedax.experiments import config as schema

    out = ["# Config keys", "",
           "Generated from the config schema (`fedax.experiments.config`). "
           "A config is a YAML mapping of these keys; `fedax run CONFIG --set key=value` "
           "overrides one (dotted for a section's keys).", "",
           inspect.cleandoc(schema.__doc__ or "").replace("``", "`"), ""]
    sections: list[tuple[str, type[BaseModel]]] = [("", schema.Config)]
    seen = set()
    while sections:
        prefix, model = sections.pop(0)
        if model in seen:
            continue
        seen.add(model)
        doc = inspect.cleandoc(model.__doc__ or "")
        out += [f"## `{prefix.rstrip('.') or 'top level'}`", "", doc.replace("``", "`"), "",
                "| key | allowed | default | meaning |", "|---|---|---|---|"]
        comments = _field_comments(model)
        for name, field in model.model_fields.items():
            section = schema._section(field.annotation)
            if section is not None:
                sections.append((f"{prefix}{name}.", section))
            allowed = "a section (below)" if section else schema._allowed(field)
            meaning = comments.get(name) or field.description or ""
            cells = [f"`{prefix}{name}`", allowed, _default(field), meaning]
            out.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ")
                                         for c in cells) + " |")
        out.append("")
    return "\n".join(out) + "\n"


def on_files(files, config):
    """mkdocs: add the generated pages."""
    from mkdocs.structure.files import File

    for uri, make in (("reference/cli.md", cli_markdown), ("reference/config.md",
                                                           config_markdown)):
        files.append(File.generated(config, uri, content=make()))
    return files


if __name__ == "__main__":
    print({"cli": cli_markdown, "config": config_markdown}[sys.argv[1]]())
