"""Runs the code blocks of a documentation page, as a reader would, in a working directory.

Per fenced block, by its language:

* ``python``: executed; the blocks of a page share one namespace, in order (as a notebook).
  A block that is exactly one mkdocs snippet of ``examples/*.py`` (``--8<-- "examples/x.py"``)
  is that example, which ``tests/test_examples.py`` runs (in its quick mode).
* ``sh``/``bash``/``console``: every command line must be a ``fedax ...`` command; each is
  run in-process with ``fedax.cli.main.main`` and must exit 0.
* ``yaml``: parsed; with ``<!-- docs-test: file NAME -->`` above it, written to ``NAME``
  in the working directory (for a later ``fedax run NAME``).
* anything else (``text``, no language: diagrams, printed output) is not code.

Markers are HTML comments (invisible on the site) directly above a block:

* ``<!-- docs-test: skip REASON -->``: not run, for the reason given (required), e.g. a
  command that takes minutes or a fragment with ``...`` placeholders;
* ``<!-- docs-test: replace "OLD" "NEW" -->``: the quick mode: run the block with OLD
  replaced by NEW (e.g. fewer rounds); OLD must occur.

A page whose blocks another test checks verbatim says so once, anywhere:
``<!-- docs-test: tested-by tests/test_x.py -->`` (that file must exist and name the page).
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_MARKER = re.compile(r"<!--\s*docs-test:\s*([\w-]+)\s*(.*?)\s*-->", re.S)
_SNIPPET = re.compile(r'^--8<--\s+"([^"]+)"\s*$')
_SHELL = ("sh", "bash", "console", "shell")


class DocsError(AssertionError):
    """A documented example failed: the page, the block's line and what happened."""


@dataclass
class Block:
    language: str
    code: str
    line: int
    markers: list[tuple[str, str]] = field(default_factory=list)


def blocks(text: str) -> list[Block]:
    """The fenced blocks of a page with the markers between the previous block and each."""
    out, last = [], 0
    for m in _FENCE.finditer(text):
        markers = [(k, v) for k, v in _MARKER.findall(text[last:m.start()])
                   if k != "tested-by"]
        out.append(Block(m.group(1).lower(), m.group(2), text.count("\n", 0, m.start()) + 1,
                         markers))
        last = m.end()
    return out


def tested_by(text: str) -> str | None:
    found = [v for k, v in _MARKER.findall(text) if k == "tested-by"]
    return found[0] if found else None


def example_of(block: Block) -> Path | None:
    """The ``examples/*.py`` a python block includes whole (a lone snippet line), else None."""
    lines = [line for line in block.code.splitlines() if line.strip()]
    if len(lines) == 1 and (m := _SNIPPET.match(lines[0].strip())):
        path = ROOT / m.group(1)
        if path.parent != ROOT / "examples" or path.suffix != ".py":
            return None
        return path
    return None


def _quick(block: Block, page: str) -> str:
    code = block.code
    for kind, argument in block.markers:
        if kind == "replace":
            old, new = shlex.split(argument)
            if old not in code:
                raise DocsError(f"{page}:{block.line}: replace marker: {old!r} not in block")
            code = code.replace(old, new)
    return code


def _fedax(line: str, page: str, block: Block) -> str:
    from fedax.cli.main import main

    argv = shlex.split(line, comments=True)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv[1:])
        except SystemExit as exit_:  # --help, --version, usage errors
            status = exit_.code or 0
    if status != 0:
        raise DocsError(f"{page}:{block.line}: `{line}` exited {status}: "
                        f"{err.getvalue().strip()[-500:]}")
    return out.getvalue()


def run_page(path: Path, workdir: Path) -> dict[str, list]:
    """Runs every block of the page at ``path`` in ``workdir`` (the caller's cwd).

    Returns what ran: ``{"python": [...], "commands": [...], "examples": [...],
    "skipped": [...]}``; raises ``DocsError`` naming the page and line of a failure."""
    text = Path(path).read_text(encoding="utf-8")
    page = str(path)
    ran: dict[str, list] = {"python": [], "commands": [], "examples": [], "skipped": [],
                            "yaml": []}
    if (test := tested_by(text)) is not None:
        checker = ROOT / test
        if not checker.is_file() or Path(path).name not in checker.read_text():
            raise DocsError(f"{page}: tested-by {test}: no such test naming this page")
        ran["skipped"].append(f"tested by {test}")
        return ran
    namespace: dict = {"__name__": "__docs__"}
    for block in blocks(text):
        skip = [v for k, v in block.markers if k == "skip"]
        if skip:
            if not skip[0]:
                raise DocsError(f"{page}:{block.line}: a skip marker needs a reason")
            ran["skipped"].append((block.line, skip[0]))
            continue
        if block.language == "python":
            if (example := example_of(block)) is not None:
                if not example.is_file():
                    raise DocsError(f"{page}:{block.line}: no such example {example}")
                ran["examples"].append(example)
                continue
            code = _quick(block, page)
            try:
                exec(compile(code, f"{page}:{block.line}", "exec"), namespace)
            except Exception as err:
                raise DocsError(f"{page}:{block.line}: {type(err).__name__}: {err}") from err
            ran["python"].append(block.line)
        elif block.language in _SHELL:
            for line in _quick(block, page).replace("\\\n", " ").splitlines():
                command = line.split("#", 1)[0].strip()
                if not command:
                    continue
                if not command.startswith("fedax "):
                    raise DocsError(f"{page}:{block.line}: `{command}` is not a fedax "
                                    "command: mark the block <!-- docs-test: skip REASON -->")
                ran["commands"].append((command, _fedax(command, page, block)))
        elif block.language in ("yaml", "yml"):
            try:
                yaml.safe_load(block.code)
            except yaml.YAMLError as err:
                raise DocsError(f"{page}:{block.line}: invalid YAML: {err}") from err
            for kind, name in block.markers:
                if kind == "file":
                    (Path(workdir) / name).write_text(block.code)
            ran["yaml"].append(block.line)
    return ran
