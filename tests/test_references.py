"""Every reference a reader follows resolves in the repository: no file cites the private
reference notes the code was first written from (the bibliography is docs/references.md), each
docs/references.md section a file cites exists, every relative link in the documentation and the
README leads to a file of the repository, and the generated reference pages
(docs/reference/cli.md, docs/reference/config.md) are what the code generates now."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The name of the notes that live outside the repository; spelled in two pieces so that this
# file does not cite them itself.
PRIVATE_NOTES = "papers" + ".md"


# Outside a git checkout, the folders that hold no source (builds, caches, environments).
_NOT_SOURCE = {".git", ".venv", ".venv-bench", "site", "runs", ".jax-cache", ".pytest_cache",
               ".ruff_cache", "__pycache__", "node_modules", "fedax.egg-info"}


def _walked() -> set[str]:
    return {str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
            if p.is_file() and not (set(p.relative_to(ROOT).parts[:-1]) & _NOT_SOURCE)}


def _repository_files() -> list[pathlib.Path]:
    """Tracked files and untracked ones git does not ignore, outside shared/, that exist."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk the tree
        names = _walked()
    else:
        names = set(out.decode().split("\0"))
    names = {n for n in names if n and not n.startswith("shared/")}
    return [ROOT / n for n in sorted(names) if (ROOT / n).is_file()]


def test_outside_git_the_tree_walk_finds_the_same_sources():
    """The fallback of ``_repository_files`` (a copy without .git) reads the same source and
    documentation files as git's list."""
    listed = {str(p.relative_to(ROOT)) for p in _repository_files()}
    walked = _walked()
    for suffix in (".py", ".md", ".yml", ".yaml"):
        assert {n for n in listed if n.endswith(suffix)} == {
            n for n in walked if n.endswith(suffix) and not n.startswith("shared/")}, suffix


def test_no_file_cites_the_private_reference_notes():
    citing = [str(p.relative_to(ROOT)) for p in _repository_files()
              if PRIVATE_NOTES.encode() in p.read_bytes()]
    assert not citing, (f"{PRIVATE_NOTES} is not in the repository; cite the paper and the "
                        f"section of docs/references.md instead: {citing}")


def test_every_cited_section_of_the_references_page_exists():
    headings = [h.strip().lower() for h in
                re.findall(r"^## (.+)$", (ROOT / "docs/references.md").read_text(), re.M)]
    cite = re.compile(r"docs/references\.md, ([^);:.,\"]+)")
    missing = []
    for path in _repository_files():
        if (path.suffix not in (".py", ".md", ".yml", ".yaml", ".txt")
                or path == ROOT / "docs/references.md"):
            continue
        # a citation may wrap: join lines (and comment continuations) with a space
        text = re.sub(r"[ \t]*\n[ \t]*(?:# ?)?", " ", path.read_text(encoding="utf-8"))
        for section in cite.findall(text):
            section = " ".join(section.split()).lower()
            if not any(h.startswith(section) for h in headings):
                missing.append(f"{path.relative_to(ROOT)}: {section!r}")
    assert not missing, f"no such section of docs/references.md: {missing}"


_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _relative_links(page: pathlib.Path) -> list[str]:
    """The targets of the page's inline links that point into the repository (no scheme, not
    a bare #anchor), code blocks and code spans left out."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", page.read_text(encoding="utf-8")))
    return [t for t in _LINK.findall(text)
            if not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", t) and not t.startswith("#")]


PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves_to_a_file_of_the_repository(page):
    broken = []
    for target in _relative_links(page):
        path = target.split("#", 1)[0].split("?", 1)[0]
        resolved = (page.parent / path).resolve()
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to nothing in the repository: {broken}"


def test_the_link_check_sees_links():
    """The pages do link to each other (and to the generated reference pages): an empty
    harvest would pass the test above for nothing."""
    targets = {t for page in PAGES for t in _relative_links(page)}
    assert "reference/cli.md" in targets and "../reference/config.md" in targets


def _docs_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "tools/docs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_reference_pages_are_current():
    """docs/reference/*.md are committed (so that links to them resolve in the repository)
    and must be what the parser and the config schema generate now."""
    hooks = _docs_hooks()
    assert set(hooks.PAGES) == {"reference/cli.md", "reference/config.md"}
    stale = hooks.stale_pages()
    assert not stale, (f"stale generated pages {stale}: run `python tools/docs_hooks.py write` "
                       "and commit the result")
