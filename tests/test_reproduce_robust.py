"""The ``robust-aggregation`` paper (``papers/robust-aggregation.yaml``, a paper of runs
with no hook): a tiny grid through the engine, whose configs, table, backdoor rows, claims
and report follow from its runs."""

import json
from dataclasses import replace

import pytest

from fedax.reproduce import EXPERIMENTS, reproduce

PAPER = EXPERIMENTS["robust-aggregation"]
# MNIST, logistic regression, 10 clients (5 a round), 2 rounds (1 for the backdoor).
TINY = {"num_clients": 10, "client_fraction": 0.5, "rounds": 2, "eval_every": 1,
        "aggregators": ["mean", "median"], "attacks": ["gaussian"], "fractions": [0.2],
        "backdoor_fractions": [0.2], "backdoor_rounds": 1}


@pytest.mark.slow
def test_robust_aggregation_paper_runs_end_to_end(tmp_path):
    paper = replace(PAPER, base={**PAPER.base, "model": "logistic"},
                    settings={"common": PAPER.settings["common"], "quick": TINY})
    logs: list[str] = []
    results = reproduce(paper, tmp_path, quick=True, progress=False, log=logs.append)
    runs = {r["run"]: r for r in results["runs"]}
    assert list(runs) == ["mean/clean", "median/clean", "mean/gaussian-f0.2",
                          "median/gaussian-f0.2", "backdoor/mean-f0.2",
                          "backdoor/norm_bounding-f0.2", "backdoor/norm_bounding-clean"]
    config = {name: json.loads((tmp_path / "runs" / name / "summary.json").read_text())[
        "config"] for name in runs}
    assert "robust" not in config["mean/clean"] and "attack" not in config["mean/clean"]
    assert config["median/gaussian-f0.2"]["robust"]["rule"] == "median"
    attack = config["median/gaussian-f0.2"]["attack"]
    assert (attack["kind"], attack["stddev"], attack["fraction"]) == ("gaussian", 1.0, 0.2)
    backdoor = config["backdoor/norm_bounding-f0.2"]
    assert backdoor["rounds"] == 1 and config["median/clean"]["rounds"] == 2
    robust = backdoor["robust"]
    assert (robust["rule"], robust["norm_bound"]) == ("norm_bounding", 1.0)
    assert (backdoor["attack"]["kind"], backdoor["attack"]["scale"]) == ("backdoor", 5.0)

    table = results["table"]
    assert table == {a: {"clean": runs[f"{a}/clean"]["final_test_accuracy"],
                         "gaussian@0.2": runs[f"{a}/gaussian-f0.2"]["final_test_accuracy"]}
                     for a in ("mean", "median")}
    rows = results["backdoor"]
    assert list(rows) == ["mean@0.2", "norm_bounding@0.2", "norm_bounding@clean"]
    assert rows["mean@0.2"]["backdoor_success"] is not None
    assert rows["norm_bounding@clean"]["backdoor_success"] is None
    assert rows["norm_bounding@0.2"]["clipped_clients"] is not None

    claims = {c["claim"]: c for c in results["claims"]}
    mean_drop = table["mean"]["clean"] - table["mean"]["gaussian@0.2"]
    median_drop = table["median"]["clean"] - table["median"]["gaussian@0.2"]
    assert [c["held"] for c in claims.values()] == [
        mean_drop > 0.2, median_drop < 0.05,
        rows["norm_bounding@0.2"]["backdoor_success"]
        < rows["mean@0.2"]["backdoor_success"] - 0.2
        and rows["norm_bounding@clean"]["final_test_accuracy"]
        - rows["norm_bounding@0.2"]["final_test_accuracy"] < 0.02]
    mean_claim = claims["the mean does not tolerate Byzantine clients (gaussian, f = 0.2)"]
    assert mean_claim["source"].startswith("Blanchard") and f"{mean_drop:.4f}" in \
        mean_claim["evidence"]
    assert "median tolerates a minority of arbitrary clients (gaussian, f = 0.2)" in claims

    report = (tmp_path / "report.md").read_text()
    assert "| aggregator | clean | gaussian f=0.2 |" in report
    assert (f"| median | {table['median']['clean']:.3f} | "
            f"{table['median']['gaussian@0.2']:.3f} |") in report
    assert "| norm_bounding (no attack) | " in report and report.endswith(
        "![robust_accuracy.png](robust_accuracy.png)\n")
    assert (tmp_path / "robust_accuracy.png").stat().st_size > 1000

    logs.clear()
    again = reproduce(paper, tmp_path, quick=True, progress=False, log=logs.append)
    assert sum("(reused)" in line for line in logs) == 7
    assert again["table"] == table
