"""`fedax compare` on two committed runs: one legible figure and a markdown table."""

import json
import math
import pathlib

import matplotlib.image
import yaml
from conftest import TINY_CONFIG

from fedax.builder.privacy_plan import privacy_plan
from fedax.cli.main import main
from fedax.experiments.compare import comparison_figure, load_runs
from fedax.experiments.outputs import read_records
from fedax.simulation import rounds_to_target
from fedax.spec.config import config_to_dict, validate_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNS = ROOT / "experiments/results/dp-fedavg-mnist-quick/runs"
DIRS = [RUNS / "z0" / "seed0", RUNS / "z2" / "seed0"]


def test_compare_writes_the_figure_and_the_table(tmp_path, capsys):
    assert main(["compare", *map(str, DIRS), "--target", "0.8", "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [r.split("|")[1].strip() for r in rows] == ["`z0/seed0`", "`z2/seed0`"]
    for row, run in zip(rows, DIRS, strict=True):
        records = read_records(run / "metrics.jsonl")
        want = rounds_to_target([r["round"] for r in records],
                                [r["test_accuracy"] for r in records], 0.8)
        assert row.split("|")[6].strip() == f"{want:.1f}"
    # both are DP runs: z = 0 (clipped, no noise: no bound on ε) and z = 2, Poisson sampled
    cells = [[c.strip() for c in row.split("|")[1:-1]] for row in rows]
    assert [(c[1], c[6], c[7]) for c in cells] == [
        ("fedavg + dp gaussian (z=0, poisson)", "∞", "1e-05"),
        ("fedavg + dp gaussian (z=2, poisson)", "3.17", "1e-05")]  # ε 3.1693 rounded up
    assert (tmp_path / "compare.md").read_text().count("| `") == 2
    image = matplotlib.image.imread(tmp_path / "compare.png")
    assert image.shape[:2] == (480, 720)  # 6x4 inches at 120 dpi


def test_the_figure_draws_every_point_with_integer_rounds_and_a_title():
    runs = load_runs(DIRS)
    fig = comparison_figure(runs, 0.8)
    ax = fig.axes[0]
    assert ax.get_title() == "test accuracy of 2 runs"
    curves = ax.get_lines()[:2]
    for line, run in zip(curves, runs, strict=True):
        assert list(line.get_xdata()) == [r["round"] for r in run.records]  # none dropped
        assert "0.8 in" in line.get_label()
    fig.canvas.draw()
    ticks = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert ticks and all(t.lstrip("−-").isdigit() for t in ticks)
    low, high = ax.get_ylim()
    assert low <= min(min(line.get_ydata()) for line in curves) and high >= 0.8


def test_a_directory_without_a_run_is_a_one_line_error(tmp_path, capsys):
    assert main(["compare", str(DIRS[0]), str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedax: error: ") and "no metrics.jsonl" in err and "\n" not in err
    assert not (tmp_path / "o").exists()


def _run_dir(path: pathlib.Path, accuracies, **keys) -> dict:
    """A run directory as fedax run leaves it: metrics.jsonl, and summary.json with the
    validated config and, for DP, the privacy section a run writes (its plan's)."""
    data = yaml.safe_load(TINY_CONFIG)
    data.update(num_clients=100, client_fraction=0.25, rounds=len(accuracies), **keys)
    config = validate_config(data)
    summary = {"config": config_to_dict(config), "status": "ok"}
    plan = privacy_plan(config, 100)
    if plan is not None:
        summary["privacy"] = plan.summary(config, len(accuracies))
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(
        json.dumps({"round": t + 1, "test_accuracy": a}) + "\n"
        for t, a in enumerate(accuracies)))
    (path / "summary.json").write_text(json.dumps(summary))
    return summary


def test_each_row_names_its_setting_and_a_dp_runs_epsilon(tmp_path, capsys):
    dp = {"mechanism": "gaussian", "clip": 1.0, "noise_multiplier": 1.0}
    summaries = [
        _run_dir(tmp_path / "plain", [0.5, 0.7]),
        _run_dir(tmp_path / "dp", [0.4, 0.6], privacy=dp),
        _run_dir(tmp_path / "budget", [0.3, 0.5],
                 privacy={"mechanism": "gaussian", "clip": 1.0, "target_epsilon": 30.0}),
        _run_dir(tmp_path / "qsgd", [0.5, 0.65], compression={"scheme": "qsgd", "levels": 4}),
        _run_dir(tmp_path / "median", [0.45, 0.6], robust={"rule": "median"}),
        _run_dir(tmp_path / "dp_qsgd", [0.4, 0.55], privacy=dp,
                 compression={"scheme": "qsgd", "levels": 4}),
    ]
    names = ["plain", "dp", "budget", "qsgd", "median", "dp_qsgd"]
    assert main(["compare", *(str(tmp_path / n) for n in names), "--target", "0.6",
                 "--out", str(tmp_path / "out")]) == 0
    table = capsys.readouterr().out
    head = table.splitlines()[0]
    assert [c.strip() for c in head.split("|")[1:-1]] == [
        "run", "setting", "rounds run", "final test_accuracy", "best test_accuracy",
        "rounds to 0.6", "ε", "δ"]
    rows = {c[0]: c for c in ([x.strip() for x in line.split("|")[1:-1]]
                              for line in table.splitlines() if line.startswith("| `"))}
    z_budget = summaries[2]["privacy"]["noise_multiplier"]  # calibrated to ε = 30
    assert {name: rows[f"`{name}`"][1] for name in names} == {
        "plain": "fedavg",
        "dp": "fedavg + dp gaussian (z=1, fixed)",
        "budget": f"fedavg + dp gaussian (z={z_budget:g}, fixed)",
        "qsgd": "fedavg + qsgd (s=4)",
        "median": "fedavg + median",
        "dp_qsgd": "fedavg + dp gaussian (z=1, fixed) + qsgd (s=4)",
    }
    for name, summary in zip(names, summaries, strict=True):
        eps, delta = rows[f"`{name}`"][6:8]
        if "privacy" not in summary:
            assert (eps, delta) == ("—", "—")
            continue
        want = summary["privacy"]["epsilon"]  # the run's ledger after its rounds
        assert delta == "1e-05"
        assert want <= float(eps) <= want * (1 + 1e-3)  # 4 digits, rounded up
        assert float(eps) == math.ceil(want * 100) / 100  # ε in [10, 100): 2 decimals
    assert (tmp_path / "out" / "compare.md").read_text().count("| `") == len(names)
