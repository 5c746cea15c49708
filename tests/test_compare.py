"""`fedax compare` on two committed runs: one legible figure and a markdown table."""

import pathlib

import matplotlib.image

from fedax.cli.main import main
from fedax.experiments.compare import comparison_figure, load_runs
from fedax.experiments.run import read_records
from fedax.simulation import rounds_to_target

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
