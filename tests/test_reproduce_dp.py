"""The DP papers of ``fedax reproduce`` (``papers/dp-*.yaml``, ``hooks/dp.py``): the noise
levels and ε the hook computes, and tiny end-to-end runs of both papers through the engine
whose derived values, claims and report follow from their runs."""

from dataclasses import replace

import pytest

from fedax.privacy import PrivacyLedger, epsilon
from fedax.reproduce import EXPERIMENTS, reproduce
from fedax.reproduce.hooks import dp

ADAPTIVE = EXPERIMENTS["dp-adaptive-clipping"]
FEDAVG = EXPERIMENTS["dp-fedavg-mnist"]
# MNIST with 200 clients (300 examples each, m = 20 a round), logistic regression, 2 rounds.
TINY = {"clients": 200, "model": "logistic", "rounds": 2, "eval_every": 1, "last_k": 2,
        "seeds": [0]}


def _tiny(paper, **settings):
    return replace(paper, settings={"quick": {**paper.subset(True), **TINY, **settings}})


def _run(paper, out):
    return reproduce(paper, out, quick=True, progress=False, log=lambda _: None)


def test_hook_calibrates_z_to_the_target_and_prices_each_level():
    s = dp.settings(ADAPTIVE, {**ADAPTIVE.subset(True), "rounds": 50})
    noisy, free = s["levels"][0], s["levels"][-1]
    assert noisy["target"] == 1.0 and noisy["key"] == "eps1"
    # the smallest z within the target: its RDP ε is at the target, a 1% smaller z exceeds it
    assert 0.99 <= noisy["epsilon"]["rdp"] <= 1.0
    assert epsilon(noisy["z"] * 0.99, 0.1, 50, 1e-5, population=1000) > 1.0
    assert noisy["epsilon"]["pld"] < noisy["epsilon"]["rdp"]
    # adaptive clipping's clipped sum gets z_Δ = (z⁻² − (2·m/20)⁻²)^(-1/2) > z
    assert noisy["z_value"] == pytest.approx((noisy["z"] ** -2 - 10.0 ** -2) ** -0.5)
    assert free["z"] == 0 and free["z_value"] is None
    assert free["epsilon"]["rdp"] is None and free["epsilon"]["pld"] is None  # ∞
    assert "RDP" in free["epsilon"]["accounting"] and "Poisson" in free["epsilon"]["accounting"]


def test_hook_epsilon_table_over_fractions_of_the_rounds():
    s = dp.settings(FEDAVG, {**FEDAVG.subset(True), "rounds": 8,
                             "levels": [{"z": 0.0}, {"z": 1.0}, {"z": 2.0}]})
    assert "z_value" in s["levels"][1] and s["levels"][1]["z_value"] is None  # no adaptive
    assert [(e["z"], e["rounds"]) for e in s["epsilon_table"]] == [
        (z, t) for z in (1.0, 2.0) for t in (2, 4, 8)]
    ledger = PrivacyLedger(2.0, 0.1, 1e-5, "pld", population=1000)
    assert s["epsilon_table"][-1]["pld"] == pytest.approx(ledger.epsilon_after(8))


@pytest.mark.slow
def test_adaptive_clipping_end_to_end(tmp_path):
    paper = _tiny(ADAPTIVE, clips=[0.3, 1.0], levels=[
        {"key": "eps2", "label": "ε ≈ 2", "target": 2.0},
        {"key": "nonoise", "label": "ε = ∞", "z": 0.0}])
    results = _run(paper, tmp_path)
    noisy, free = results["settings"]["levels"]
    assert [r["run"] for r in results["runs"]] == [
        "eps2/clip0.3/seed0", "eps2/clip1/seed0", "nonoise/clip0.3/seed0",
        "nonoise/clip1/seed0", "eps2/adaptive/seed0", "nonoise/adaptive/seed0"]
    rows = {r["run"]: r for r in results["runs"]}
    # the runs record the ε the hook computed, and the adaptive clip and b̄ every evaluation
    assert rows["eps2/clip1/seed0"]["epsilon"] == pytest.approx(noisy["epsilon"]["rdp"])
    assert rows["eps2/adaptive/seed0"]["epsilon"] == pytest.approx(noisy["epsilon"]["rdp"])
    adaptive = rows["eps2/adaptive/seed0"]["series"]
    assert len(adaptive["clip_norm"]) == 2 and all(c > 0 for c in adaptive["clip_norm"])
    assert all(0 <= b <= 1 for b in adaptive["unclipped_fraction"])
    assert rows["nonoise/clip1/seed0"]["series"]["dp_noise_stddev"] == [0.0, 0.0]
    # σ = z·C/m of a fixed clip (float32 in the records)
    sigma = rows["eps2/clip0.3/seed0"]["series"]["dp_noise_stddev"][-1]
    assert sigma == pytest.approx(noisy["z"] * 0.3 / 20, rel=1e-6)
    for level, summary in zip((noisy, free), results["levels"], strict=True):
        fixed = [rows[f"{level['key']}/clip{c}/seed0"]["last_accuracy"] for c in ("0.3", "1")]
        ours = rows[f"{level['key']}/adaptive/seed0"]["last_accuracy"]
        assert summary["fixed"] == pytest.approx(fixed)
        assert summary["best_clip"] == [0.3, 1.0][fixed.index(max(fixed))]
        assert summary["difference"] == pytest.approx(ours - max(fixed))
        assert summary["within"] == (ours - max(fixed) >= -0.01)
        assert summary["adaptive_clip"] == pytest.approx(
            sum(rows[f"{level['key']}/adaptive/seed0"]["series"]["clip_norm"]) / 2)
    assert results["levels"][0]["rdp"] == f"{noisy['epsilon']['rdp']:.2f}"
    assert results["levels"][1]["rdp"] == "∞" and results["levels"][1]["z_value"] is None
    assert [c["held"] for c in results["claims"]] == [lv["within"] for lv in results["levels"]]
    assert "ε ≈ 2 (z = " in results["claims"][0]["claim"]
    report = (tmp_path / "report.md").read_text()
    assert "| noise level | z | ε RDP | ε PLD | C = 0.3 | C = 1 | best fixed |" in report
    assert "| noise level | seed 0 | max seed spread of a fixed clip |" in report
    for name in ("accuracy.png", "clip.png"):
        assert (tmp_path / name).stat().st_size > 0
    # run again: every run is reused (the same configs), the same numbers and report
    again = _run(paper, tmp_path)
    assert all(r["reused"] for r in again["runs"])
    assert again["levels"] == results["levels"]
    assert (tmp_path / "report.md").read_text().split("## Figures")[1] == \
        report.split("## Figures")[1]


@pytest.mark.slow  # an end-to-end reproduction
def test_dp_fedavg_end_to_end(tmp_path):
    paper = _tiny(FEDAVG, levels=[{"z": 0.0}, {"z": 1.0}])
    results = _run(paper, tmp_path)
    assert [r["run"] for r in results["runs"]] == ["z0/seed0", "z1/seed0"]
    free, noisy = results["rows"]
    assert noisy["sigma"] == pytest.approx(1.0 * 0.5 / 20)  # z·C/m, m = 0.1·200
    assert free["sigma"] == 0 and free["rdp"] is None and free["rdp_text"] == "∞"
    level = results["settings"]["levels"][1]["epsilon"]
    assert noisy["rdp"] == level["rdp"] > level["pld"] == noisy["pld"]
    assert results["runs"][1]["epsilon"] == pytest.approx(level["rdp"])  # the run's own ε
    assert [(e["z"], e["rounds"]) for e in results["settings"]["epsilon_table"]] == [
        (1.0, 1), (1.0, 2)]
    assert results["settings"]["epsilon_table"][-1]["rdp"] == level["rdp"]
    assert noisy["accuracy"] == results["runs"][1]["last_accuracy"]
    (claim,) = results["claims"]
    assert claim["held"] == (noisy["accuracy"] - free["accuracy"] > -0.01)
    report = (tmp_path / "report.md").read_text()
    assert f"| 1 | 0.025 | {noisy['rdp_text']} | {noisy['pld_text']} | " in report
    assert "| z | T | ε RDP | ε PLD |" in report
    assert (tmp_path / "accuracy_vs_epsilon.png").stat().st_size > 0
