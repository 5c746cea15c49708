"""The DP experiments of ``fedax reproduce``: tiny runs of ``dp-adaptive-clipping`` and
``dp-fedavg-mnist`` write their report, figures and results with the expected keys."""

import json
import math

import pytest

from fedax.reproduce import EXPERIMENTS, dp_paper
from fedax.reproduce.custom import diverged

# MNIST with 200 clients (300 examples each, 20 a round), logistic regression, 1-2 rounds.
TINY_BASE = {"num_clients": 200}


def test_registered():
    assert EXPERIMENTS["dp-adaptive-clipping"] is dp_paper.ADAPTIVE_CLIPPING
    assert EXPERIMENTS["dp-fedavg-mnist"] is dp_paper.DP_FEDAVG_MNIST


def test_epsilons_without_noise_are_infinite():
    eps = dp_paper.epsilons(0.0, 10, 0.1, 1000)
    assert eps["rdp"] is None and eps["pld"] is None  # ∞, null in strict JSON
    assert "RDP" in eps["accounting"] and "Poisson" in eps["accounting"]
    # A z = 0 run's records hold ε = inf (null, status "diverged"): not a diverged run.
    assert not diverged({"final_test_accuracy": 0.9, "status": "diverged"})
    assert diverged({"final_test_accuracy": None})
    assert diverged({"final_test_accuracy": 0.1, "diverged": True})


def test_adaptive_clipping_tiny_report(tmp_path):
    settings = dict(model="logistic", rounds=2, eval_every=1, last_k=2, seeds=(0,),
                    epsilons=(2.0,), clips=(1.0,), base=TINY_BASE)
    command = "fedax reproduce dp-adaptive-clipping (tiny)"
    results = dp_paper.run_adaptive(tmp_path, True, False, command, settings=settings,
                                    log=lambda _: None)
    saved = json.loads((tmp_path / "results.json").read_text())
    for key in ("experiment", "command", "machine", "wall_time_s", "settings", "levels",
                "claim_held", "figures", "delta", "sampling", "accountant"):
        assert key in saved, key
    assert saved["figures"] == ["accuracy.png", "clip.png"]
    assert [lv["key"] for lv in saved["levels"]] == ["eps2"]
    noisy = saved["levels"][0]
    assert noisy["noise_multiplier"] > 0 and noisy["epsilon"]["rdp"] <= 2.0
    assert saved["claim_held"] == {"eps2": noisy["within_one_point"]}
    for lv in saved["levels"]:
        for key in ("best_fixed_clip", "best_fixed_accuracy", "adaptive_accuracy",
                    "difference", "within_one_point", "adaptive_tail_clip"):
            assert key in lv, key
        assert lv["difference"] == pytest.approx(lv["adaptive_accuracy"]
                                                 - lv["best_fixed_accuracy"])
        records = lv["adaptive"]["per_seed"][0]["records"]
        assert [r["round"] for r in records] == [1, 2]
        assert all(r["clip_norm"] > 0 and 0 <= r["unclipped_fraction"] <= 1
                   for r in records)  # the adaptive runs record C and b̄ every record
    # ε grows over the noisy run and matches the ledger at the end
    eps = [r["epsilon"] for r in noisy["fixed"][0]["per_seed"][0]["records"]]
    assert eps[0] < eps[1] == pytest.approx(noisy["epsilon"]["rdp"])
    report = (tmp_path / "report.md").read_text()
    assert command in report and "Verdict" in report and "![clip](clip.png)" in report
    assert "ε ≈ 2" in report
    for name in saved["figures"]:
        assert (tmp_path / name).stat().st_size > 0
    assert results["levels"][0]["noise_multiplier"] == noisy["noise_multiplier"]


def test_dp_fedavg_tiny_report(tmp_path):
    settings = dict(model="logistic", rounds=1, eval_every=1, last_k=1, seeds=(0,),
                    noise_multipliers=(1.0,), clip=0.5, base=TINY_BASE)
    command = "fedax reproduce dp-fedavg-mnist (tiny)"
    dp_paper.run_fedavg(tmp_path, True, False, command, settings=settings,
                        log=lambda _: None)
    saved = json.loads((tmp_path / "results.json").read_text())
    for key in ("experiment", "command", "machine", "wall_time_s", "rows",
                "epsilon_table", "figures"):
        assert key in saved, key
    (row,) = saved["rows"]
    assert row["noise_multiplier"] == 1.0 and math.isfinite(row["accuracy"])
    assert row["epsilon"]["pld"] < row["epsilon"]["rdp"]
    assert row["per_seed"][0]["epsilon"] == pytest.approx(row["epsilon"]["rdp"])
    assert row["noise_stddev"] == pytest.approx(1.0 * 0.5 / 20)  # z·C/m, m = 0.1·200
    assert row["minus_no_noise"] is None  # no z = 0 row to compare with
    assert [(e["noise_multiplier"], e["rounds"]) for e in saved["epsilon_table"]] == [(1.0, 1)]
    report = (tmp_path / "report.md").read_text()
    assert command in report and "ε RDP" in report and "ε PLD" in report
    assert (tmp_path / "accuracy_vs_epsilon.png").stat().st_size > 0
