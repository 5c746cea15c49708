"""Every script under examples/ is short, complete, and runs in its quick mode."""

import runpy
import shlex
import sys

import pytest
from docs_runner import ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def quick_args(path):
    lines = [x for x in path.read_text().splitlines() if x.startswith("# quick:")]
    assert len(lines) == 1, f"{path.name} must declare its quick mode: '# quick: ARGS'"
    return shlex.split(lines[0].split(":", 1)[1])


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs_in_quick_mode(example, tmp_path, monkeypatch, capsys):
    assert len(example.read_text().splitlines()) <= 60
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(example), *quick_args(example)])
    runpy.run_path(str(example), run_name="__main__")
    assert capsys.readouterr().out.strip()
