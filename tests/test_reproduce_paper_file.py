"""A paper is one YAML file: the toy paper beside this test runs end to end through the one
engine; paper files, expressions and claims refuse what they should."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedax.reproduce import reproduce
from fedax.reproduce.claims import check_claims, claim_lines
from fedax.reproduce.expr import ExprError, evaluate, render
from fedax.reproduce.paper import load_paper, parse_paper
from fedax.spec.config import ConfigError

TOY = Path(__file__).parent / "papers" / "toy-paper.yaml"


def test_a_paper_that_is_only_a_yaml_file_runs_end_to_end(tmp_path):
    logs: list[str] = []
    results = reproduce(TOY, tmp_path, quick=True, progress=False, log=logs.append)
    runs = {r["run"]: r for r in results["runs"]}
    assert set(runs) == {"fedavg", "fedprox"}
    saved = {r["run"]: json.loads((tmp_path / "runs" / r["run"] / "summary.json").read_text())
             for r in results["runs"]}
    assert saved["fedprox"]["config"]["mu"] == 0.1 and saved["fedavg"]["config"]["rounds"] == 3
    for name, row in runs.items():  # last_k = 2: the mean of the last two evaluations
        accs = [p[1] for p in row["curve"]]
        assert len(accs) == 3 and row["last_accuracy"] == pytest.approx(sum(accs[-2:]) / 2)
        assert results["accuracy"][name] == row["last_accuracy"]  # the paper's derive
    assert [c["held"] for c in results["claims"]] == [
        results["accuracy"][m] > 0.1 for m in ("fedavg", "fedprox")]
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# Toy: FedAvg against FedProx")
    assert f"| fedprox | {runs['fedprox']['last_accuracy']:.4f} | 3 |" in report
    assert "(Nobody et al.)" in report and (tmp_path / "curves.png").stat().st_size > 1000
    assert json.loads((tmp_path / "results.json").read_text())["source"]["arxiv"] == "0000.00000"

    # Again: every run is reused; --report-only rewrites the same report from results.json.
    logs.clear()
    again = reproduce(TOY, tmp_path, quick=True, progress=False, log=logs.append)
    assert sum("(reused)" in line for line in logs) == 2
    assert again["accuracy"] == results["accuracy"]
    (tmp_path / "report.md").unlink()
    reproduce(TOY, tmp_path, report_only=True, progress=False, log=logs.append)
    assert (tmp_path / "report.md").read_text().split("## Accuracy")[1] == \
        report.split("## Accuracy")[1]


def test_paper_files_are_checked_one_line_naming_the_file_and_key(tmp_path):
    base = {"name": "x", "title": "x", "paper": "x", "kind": "runs", "base": {},
            "runs": [{"name": "a"}]}
    with pytest.raises(ConfigError, match=r"x\.yaml: unknown key 'tabel'"):
        parse_paper({**base, "tabel": 1}, Path("x.yaml"))
    with pytest.raises(ConfigError, match="kind must be one of table, runs"):
        parse_paper({**base, "kind": "grid"})
    with pytest.raises(ConfigError, match="missing base"):
        parse_paper({k: v for k, v in base.items() if k != "base"})
    with pytest.raises(ConfigError, match="lrs must be a list of positive numbers"):
        parse_paper({**base, "kind": "table", "cells": [
            {"name": "c", "method": "m", "group": "g", "config": {}, "lrs": [0]}]})
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="broken.yaml is not valid YAML"):
        load_paper(broken)


def test_expressions_read_results_and_cannot_run_code():
    results = {"table": {"mean": {"clean": 0.93, "sign_flip@0.2": 0.5}},
               "settings": {"fractions": [0.1, 0.2]}, "rows": [{"m": "a", "x": 1}]}
    drop = evaluate("table.mean.clean - table['mean']['sign_flip@' + fmt(max(settings."
                    "fractions), 'g')]", results)
    assert drop == pytest.approx(0.43)
    assert evaluate("find(rows, m='a').x", results) == 1
    assert evaluate("find(rows, m='b')", results) is None
    assert evaluate("mean([1, None, nan, 3])", {}) == 2.0
    assert render("{None:.3f} and {1/3:.2f} {{literal}} {x != 2}", {"x": 1}) == \
        "— and 0.33 {literal} True"
    assert math.isnan(evaluate("nan", {}))
    for bad, why in (("().__class__", "attribute '__class__'"), ("__import__('os')", "name"),
                     ("(lambda: 1)()", "Lambda"), ("'a'.encode()", "method 'encode'"),
                     ("open('x')", "NameError")):
        with pytest.raises(ExprError, match=why):
            evaluate(bad, {})
    with pytest.raises(ExprError, match=r"'table.nope': AttributeError"):
        evaluate("table.nope", results)


def test_claims_expand_bind_skip_and_report():
    results = {"acc": {"a": 0.9, "b": 0.5, "c": None}}
    claims = [{"claim": "{m} beats chance by {gap:.2f}", "source": "s",
               "for": {"m": "acc"}, "let": {"gap": "acc[m] - 0.6 if acc[m] else None"},
               "when": "m != 'c' or True", "held": "gap > 0 if gap is not None else None",
               "evidence": "{m}: {acc[m]:.1f}"}]
    checked = check_claims(claims, results, {"s": "Someone, Somewhere, 2026"})
    assert [(c["claim"], c["held"]) for c in checked] == [
        ("a beats chance by 0.30", True), ("b beats chance by -0.10", False),
        ("c beats chance by —", None)]
    assert claim_lines(checked)[2] == ("- **not tested**: c beats chance by — (Someone et al.)."
                                       " c: —.")
    skipped = check_claims([{**claims[0], "when": "m == 'a'"}], results, {})
    assert [c["claim"] for c in skipped] == ["a beats chance by 0.30"]
    with pytest.raises(ExprError, match="unknown keys"):
        check_claims([{"claim": "x", "held": "True", "hold": 1}], results, {})


def test_the_tutorial_shows_the_toy_paper_and_a_committed_table_verbatim():
    root = Path(__file__).resolve().parents[1]
    tutorial = (root / "docs" / "tutorials" / "reproduce.md").read_text()
    assert TOY.read_text() in tutorial
    fedopt = (root / "experiments" / "results" / "fedopt-fashion-quick" / "report.md")
    row = next(line for line in tutorial.splitlines() if line.startswith("| FedAdam"))
    assert row in fedopt.read_text().splitlines()
