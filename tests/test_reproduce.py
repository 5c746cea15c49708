"""`fedax reproduce`: learning-rate selection, speedups, the report, reuse of finished runs."""

import json
import math

import pytest

from fedax.cli.main import main
from fedax.reproduce import EXPERIMENTS, Cell, cell_config, report, runs, table
from fedax.reproduce.engine import reproduce
from fedax.reproduce.paper import Paper
from fedax.spec.config import ConfigError

BASE = {
    "seed": 0, "dataset": "mnist", "num_clients": 100, "client_fraction": 0.1,
    "model": "2nn", "target_accuracy": 0.85, "stop_at_target": True, "eval_every": 1,
    "checkpoint_every": 2, "partition": "iid",
}


def _tiny_experiment(rounds_fedsgd=4):
    return Paper(
        name="tiny", title="tiny", paper="none", kind="table", base=BASE,
        cells=[],
        quick=[
            Cell("sgd", "FedSGD", "IID", {"algorithm": "fedsgd", "rounds": rounds_fedsgd},
                 (0.1,), paper=40, baseline=True),
            Cell("avg", "FedAvg", "IID", {"algorithm": "fedavg", "local_epochs": 1,
                                          "batch_size": 10, "rounds": 8},
                 (0.1, 0.001), paper=5),
        ],
    )


def test_cells_validate_and_the_registered_experiments_build_their_configs():
    for experiment in EXPERIMENTS.values():
        for cell in [*experiment.cells, *experiment.quick]:
            for lr in cell.lrs:
                config = cell_config(experiment, cell, lr)
                assert config.client_lr == lr or cell.lr_key != "client_lr"


def test_long_paper_cells_evaluate_every_percent_of_the_paper_rounds():
    MNIST_2NN, MNIST_CNN = EXPERIMENTS["fedavg-mnist-2nn"], EXPERIMENTS["fedavg-mnist-cnn"]
    cnn = {c.name: c for c in MNIST_CNN.cells}
    # 626 paper rounds: every 6th round, so rounds to target stay exact to 1%
    assert cnn["fedsgd-e1-binf-iid"].config["eval_every"] == 6
    assert cnn["fedavg-e5-binf-pathological"].config["eval_every"] == 10
    # short cells keep the experiment's own (finer) resolution
    assert "eval_every" not in cnn["fedavg-e1-b10-iid"].config
    assert MNIST_CNN.base["eval_every"] == 2
    two_nn = {c.name: c for c in MNIST_2NN.cells}
    assert two_nn["fedsgd-e1-binf-iid"].config["eval_every"] == 14
    assert two_nn["fedavg-e1-b10-pathological"].config["eval_every"] == 6
    assert "eval_every" not in two_nn["fedavg-e1-b10-iid"].config  # 87 rounds: every 5th


def test_shakespeare_line_sample_column_repeats_the_non_iid_cells():
    """The third column runs the non-IID cells on one sample per line (the paper's u); the
    chunk cells' configs carry no ``sample`` key, so their runs' fingerprints, and the
    committed run's checkpoints, still match."""
    SHAKESPEARE = EXPERIMENTS["fedavg-shakespeare"]
    cells = {c.name: c for c in SHAKESPEARE.cells}
    line = [c for c in SHAKESPEARE.cells if c.group == "non-IID, line samples"]
    chunk = [c for c in SHAKESPEARE.cells if c.group == "non-IID"]
    assert [c.name for c in line] == [f"{c.name}-line" for c in chunk]
    for c in line:
        twin = cells[c.name.removesuffix("-line")]
        assert (c.paper, c.method, c.baseline, c.lrs) == (
            twin.paper, twin.method, twin.baseline, twin.lrs)
        assert cell_config(SHAKESPEARE, c, 1.47).shakespeare.sample == "line"
        assert cell_config(SHAKESPEARE, twin, 1.47).shakespeare.sample == "chunk"
    assert all("sample" not in c.config["shakespeare"] for c in SHAKESPEARE.cells
               if not c.name.endswith("-line"))
    assert [c for c in line if c.baseline] == [cells["fedsgd-e1-binf-natural-line"]]


def test_speedups_ratio_check_and_the_grid_cap():
    cells = [
        {"group": "g", "baseline": True, "paper": 100, "rounds_to_target": 50.0,
         "rounds_cap": 200},
        {"group": "g", "baseline": False, "paper": 10, "rounds_to_target": 10.0,
         "rounds_cap": 200},
        {"group": "h", "baseline": True, "paper": 100, "rounds_to_target": None,
         "rounds_cap": 30},
        {"group": "h", "baseline": False, "paper": 25, "rounds_to_target": 6.0,
         "rounds_cap": 200},
    ]
    table._speedups(cells)
    assert cells[1]["speedup"] == 5.0 and not cells[1]["speedup_bound"]
    assert cells[1]["paper_speedup"] == 10.0
    assert cells[3]["speedup"] == 5.0 and cells[3]["speedup_bound"]  # >= 30 / 6
    assert report._ratio_check(cells[1]).startswith("✓ 1.00")
    assert report._ratio_check({"rounds_to_target": 50.0, "paper": 10}).startswith("✗ 5.00")
    assert "missed" in report._ratio_check(cells[2])

    experiment = _tiny_experiment()
    cell = experiment.quick[1]
    assert table._cap(experiment, cell, []) is None
    # best so far 3.5 rounds, evaluations every round: a later point stops after round 5
    assert table._cap(experiment, cell, [(0.1, {"rounds_to_target": 3.5})]) == 5


@pytest.mark.slow  # an end-to-end reproduction
def test_reproduce_picks_the_best_lr_writes_the_report_and_reuses_runs(tmp_path):
    experiment = _tiny_experiment()
    out = tmp_path / "rep"
    logs = []
    results = reproduce(experiment, out, quick=True, progress=False, log=logs.append)
    sgd, avg = results["cells"]
    # lr 0.001 cannot reach 85% in 8 rounds of 60 steps; 0.1 reaches it within 2 rounds
    assert avg["lr"] == 0.1 and avg["rounds_to_target"] is not None
    assert avg["rounds_to_target"] <= 2
    losing = next(p for p in avg["grid"] if p["lr"] == 0.001)
    assert losing["rounds_to_target"] is None
    assert losing["rounds_run"] < 8  # stopped at the cap once 0.1 had won
    # FedSGD with lr 0.1 stays far below 85% in 4 rounds: a miss and a speedup bound
    assert sgd["rounds_to_target"] is None and sgd["best_test_accuracy"] < 0.85
    assert avg["speedup_bound"] and avg["speedup"] == pytest.approx(4 / avg["rounds_to_target"])
    assert avg["paper_speedup"] == 8.0
    saved = json.loads((out / "results.json").read_text())
    assert saved["cells"][1]["lr"] == 0.1 and saved["quick"] is True
    report = (out / "report.md").read_text()
    assert "| FedAvg | 1 | 10 | IID | 0.1" in report and "missed" in report
    assert (out / "IID.png").stat().st_size > 1000
    curve = avg["curve"]
    assert curve["round"][-1] == math.ceil(avg["rounds_to_target"])

    # A second invocation reuses every finished run and reports the same numbers.
    logs.clear()
    again = reproduce(experiment, out, quick=True, progress=False, log=logs.append)
    assert sum("(reused)" in line for line in logs) == 3
    assert [c["rounds_to_target"] for c in again["cells"]] == [
        c["rounds_to_target"] for c in results["cells"]]

    # One cell at one learning rate (--cells avg --lrs 0.1) reuses that run alone, and so
    # does a config that differs only in how often it saves (not a different run).
    logs.clear()
    chosen = table.select_cells(experiment, True, ["avg"], [0.1])
    assert [(c.name, tuple(c.lrs)) for c in chosen] == [("avg", (0.1,))]
    one = reproduce(experiment, out, quick=True, progress=False, log=logs.append,
                       cells=["avg"], lrs=[0.1])
    assert [c["name"] for c in one["cells"]] == ["avg"] and one["cells"][0]["lr"] == 0.1
    assert sum("(reused)" in line for line in logs) == 1
    assert one["cells"][0]["rounds_to_target"] == avg["rounds_to_target"]
    saved_config = json.loads((out / "runs" / "avg" / "lr_0.1" / "summary.json").read_text())[
        "config"]
    assert runs.same_config({**saved_config, "checkpoint_every": 7}, saved_config)
    assert not runs.same_config({**saved_config, "rounds": 9}, saved_config)

    # --report-only runs nothing and reads an unfinished run from its newest readable
    # checkpoint: FedSGD made to look stopped after round 2 (no summary; its round-4
    # checkpoint torn).
    sgd_dir = out / "runs" / "sgd" / "lr_0.1"
    (sgd_dir / "summary.json").unlink()
    torn = sgd_dir / "checkpoints" / "ckpt_4.msgpack"
    torn.write_bytes(torn.read_bytes()[:100])
    before = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*") if p.is_file()}
    logs.clear()
    status = reproduce(experiment, out, quick=True, progress=False, log=logs.append,
                          report_only=True)
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*") if p.is_file()} == before
    sgd_now, avg_now = status["cells"]
    assert status["in_progress"] and sgd_now["in_progress"] and not avg_now["in_progress"]
    assert sgd_now["rounds_run"] == 2 and sgd_now["curve"]["round"] == [1, 2]
    assert sgd_now["curve"]["test_accuracy"] == sgd["curve"]["test_accuracy"][:2]
    ours = avg_now["rounds_to_target"]
    assert ours == avg["rounds_to_target"]
    # FedSGD has missed in the 2 rounds it ran so far: the bound uses those, not its cap
    assert avg_now["speedup"] == (pytest.approx(2 / ours) if ours < 2 else None)
    report = (out / "report.md").read_text()
    assert "**In progress.**" in report and "in progress (not reached in 2 rounds)" in report
    from fedax.experiments.resume import run_progress

    other = cell_config(experiment, experiment.quick[0], 0.2)  # not this run's config
    assert run_progress(other, sgd_dir) is None
    assert run_progress(cell_config(experiment, experiment.quick[0], 0.1),
                        sgd_dir)["round"] == 2


def test_cell_and_learning_rate_choices_are_checked(capsys):
    experiment = _tiny_experiment()
    assert [c.name for c in table.select_cells(experiment, True, ["avg", "sgd"])] == ["sgd", "avg"]
    with pytest.raises(ConfigError, match="no cell named 'nope'; its cells: sgd, avg"):
        table.select_cells(experiment, True, ["nope"])
    with pytest.raises(ConfigError, match="positive and finite"):
        table.select_cells(experiment, True, None, [0.1, 0.0])
    assert main(["reproduce", "fedavg-shakespeare", "--cells", "fedavg-e5-b10-natrual"]) == 2
    err = capsys.readouterr().err
    assert "no cell named 'fedavg-e5-b10-natrual'" in err and "fedavg-e5-b10-natural" in err
    assert main(["reproduce", "fedavg-shakespeare", "--lrs", "1.47,fast"]) == 2
    assert "expected comma-separated numbers" in capsys.readouterr().err
    assert main(["reproduce", "fedbuff", "--cells", "x"]) == 2
    assert "not a table of cells" in capsys.readouterr().err
    assert main(["reproduce", "fedbuff", "--report-only"]) == 2
    assert "--report-only" in capsys.readouterr().err


def test_report_only_without_runs_is_a_one_line_error(tmp_path, capsys):
    out = tmp_path / "empty"
    assert main(["reproduce", "fedavg-mnist-cnn", "--cells", "fedsgd-e1-binf-iid",
                 "--report-only", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds no runs of the chosen cells" in err and len(err.strip().splitlines()) == 1


def test_the_command_lists_experiments_and_rejects_unknown_names(capsys):
    assert main(["reproduce", "--list"]) == 0
    listed = capsys.readouterr().out
    for name in ("fedavg-mnist-2nn", "fedavg-mnist-cnn"):
        assert name in listed
    assert main(["reproduce", "no-such-thing"]) == 2
    assert "available:" in capsys.readouterr().err


def test_a_diverging_grid_point_is_a_miss_not_the_end_of_the_reproduction(tmp_path):
    experiment = Paper(
        name="tiny-diverge", title="t", paper="none", kind="table", base=BASE, cells=[],
        quick=[Cell("avg", "FedAvg", "IID", {"algorithm": "fedavg", "local_epochs": 1,
                                             "batch_size": 10, "rounds": 3},
                    (1e4, 0.1))],
    )
    results = reproduce(experiment, tmp_path, quick=True, progress=False,
                           log=lambda _: None)
    (cell,) = results["cells"]
    assert cell["lr"] == 0.1 and cell["rounds_to_target"] is not None
    big = next(p for p in cell["grid"] if p["lr"] == 1e4)
    assert big["rounds_to_target"] is None
    saved = json.loads((tmp_path / "runs" / "avg" / "lr_10000" / "summary.json").read_text())
    assert saved["diverged"] is True


def test_a_run_of_another_config_is_set_aside_not_deleted(tmp_path):
    def paper(rounds):
        return Paper(name="tiny-aside", title="t", paper="none", kind="table", base=BASE,
                     cells=[], quick=[Cell("avg", "FedAvg", "IID", {
                         "algorithm": "fedavg", "local_epochs": 1, "batch_size": 10,
                         "rounds": rounds, "stop_at_target": False}, (0.1,))])

    reproduce(paper(2), tmp_path, quick=True, progress=False, log=lambda _: None)
    first = (tmp_path / "runs" / "avg" / "lr_0.1" / "summary.json").read_text()
    reproduce(paper(3), tmp_path, quick=True, progress=False, log=lambda _: None)
    (aside,) = (tmp_path / "runs" / "avg" / "replaced").iterdir()
    assert aside.name.startswith("lr_0.1-") and (aside / "summary.json").read_text() == first
    now = json.loads((tmp_path / "runs" / "avg" / "lr_0.1" / "summary.json").read_text())
    assert now["rounds_run"] == 3 and json.loads(first)["rounds_run"] == 2
