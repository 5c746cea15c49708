"""Every committed reproduction report regenerates from the engine (``--report-only``) with
the same tables, and a paper that exists only as one YAML file runs end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fedax.reproduce import EXPERIMENTS, reproduce

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"


def _reports() -> list[Path]:
    found = []
    for results in sorted(RESULTS.glob("*/results.json")):
        if json.loads(results.read_text()).get("experiment") in EXPERIMENTS:
            found.append(results.parent)
    return found


def _tables(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def test_every_shipped_paper_has_a_committed_report():
    reported = {json.loads((d / "results.json").read_text())["experiment"]
                for d in _reports()}
    assert reported == set(EXPERIMENTS)


@pytest.mark.parametrize("report", _reports(), ids=lambda p: p.name)
def test_committed_report_regenerates_with_the_same_tables(report, tmp_path):
    out = tmp_path / report.name
    shutil.copytree(report, out)
    (out / "report.md").unlink()
    name = json.loads((report / "results.json").read_text())["experiment"]
    reproduce(name, out, report_only=True, progress=False, log=lambda line: None)
    committed = _tables((report / "report.md").read_text())
    assert committed, f"{report}/report.md has no table"
    assert _tables((out / "report.md").read_text()) == committed
