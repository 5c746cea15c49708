"""Every code block of the documentation runs (tests/docs_runner.py), and a broken copy of
a page fails the runner."""

import os
import pathlib

import pytest
from docs_runner import ROOT, DocsError, blocks, example_of, run_page

PAGES = sorted((ROOT / "docs").rglob("*.md"))


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A reader's working directory: the committed runs reachable as in the repository."""
    (tmp_path / "experiments").symlink_to(ROOT / "experiments")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDAX_DEVICES", "1")  # in-process fedax commands: one device
    return tmp_path


# The four longest pages (each trains MNIST models for most of a minute) run in make test-slow.
SLOW_PAGES = {"tutorials/robust.md", "tutorials/engines.md", "tutorials/compression.md",
              "tutorials/asynchronous.md"}


def _page(p):
    name = str(p.relative_to(ROOT / "docs"))
    return pytest.param(p, id=name, marks=[pytest.mark.slow] if name in SLOW_PAGES else [])


@pytest.mark.parametrize("page", [_page(p) for p in PAGES])
def test_every_code_block_of_the_page_runs(page, workdir):
    ran = run_page(page, workdir)
    if page.name == "results.md":
        check_the_results_page(ran, workdir)
    code = [b for b in blocks(page.read_text()) if b.language in ("python", "sh", "bash")]
    assert len(code) == 0 or any(ran.values()), page


def test_every_example_is_on_a_page_and_every_included_example_exists():
    included = {example_of(b) for page in PAGES for b in blocks(page.read_text())} - {None}
    assert included == set((ROOT / "examples").glob("*.py"))


def check_the_results_page(ran, workdir):
    """The results page made two runs, compared them, and shows what compare prints."""
    outputs = dict(ran["commands"])
    table = outputs["fedax compare runs/lr-0.05 runs/lr-0.2 --out runs/compare"]
    assert "`lr-0.05`" in table and "`lr-0.2`" in table and "rounds to 0.4" in table
    assert (workdir / "runs/compare/compare.png").stat().st_size > 10_000
    assert (workdir / "runs/lr-0.2/client_accuracy.png").is_file()
    assert any((workdir / "runs/lr-0.2/tensorboard").glob("events.out.tfevents.*"))
    # the committed comparison shown on the page is what the command prints
    page = (ROOT / "docs/tutorials/results.md").read_text()
    dp = next(v for k, v in ran["commands"] if "--out runs/dp" in k)
    assert all(line in page for line in dp.splitlines() if line.startswith("| `"))


def test_a_broken_copy_of_a_page_fails(workdir):
    page = (ROOT / "docs" / "concepts.md").read_text()
    broken = workdir / "concepts.md"
    broken.write_text(page.replace("fed.mean(losses)", "fed.mean(losses, axis=0)"))
    with pytest.raises(DocsError, match=r"concepts\.md:\d+: TypeError"):
        run_page(broken, workdir)
    wrong = workdir / "wrong.md"
    wrong.write_text(page.replace("assert jnp.allclose(grad, 2 * (w - data.mean(0)))",
                                  "assert jnp.allclose(grad, w - data.mean(0))"))
    with pytest.raises(DocsError, match="AssertionError"):
        run_page(wrong, workdir)


def test_a_failing_command_an_unmarked_shell_line_and_a_stale_quick_mode_fail(workdir):
    cases = {
        "```sh\nfedax run missing.yaml --out runs/x\n```\n": "exited 2",
        "```sh\nmake demo\n```\n": "not a fedax command",
        '<!-- docs-test: replace "rounds=200" "rounds=2" -->\n```python\nrounds = 20\n```\n':
            "replace marker",
        "<!-- docs-test: skip -->\n```sh\nmake demo\n```\n": "needs a reason",
    }
    for i, (text, message) in enumerate(cases.items()):
        path = workdir / f"case{i}.md"
        path.write_text(text)
        with pytest.raises(DocsError, match=message):
            run_page(path, workdir)
    assert os.path.exists(workdir)


def test_the_site_config_names_every_page():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in PAGES:
        assert str(page.relative_to(ROOT / "docs")) in nav, page
    assert pathlib.Path(ROOT / "tools" / "docs_hooks.py").is_file()
