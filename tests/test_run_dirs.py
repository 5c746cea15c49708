"""`fedax run` and `fedax demo` never lose results: run directories, refusals, atomic and
strict-JSON outputs."""

import hashlib
import json
import math
import os
import shutil

import pytest
from conftest import TINY_CONFIG, run_fedax

from fedax.cli.main import main
from fedax.experiments.run import accuracy_figure, dumps, with_status, write_atomic
from fedax.simulation import History


def snapshot(directory):
    """Every file under ``directory`` (hidden ones too) -> SHA-256 of its bytes."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def last_line(stderr):
    lines = stderr.strip().splitlines()
    assert lines and "Traceback" not in stderr, stderr
    return lines[-1]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run with checkpoints: (directory, config path); copy it before changing."""
    root = tmp_path_factory.mktemp("finished")
    (root / "tiny.yaml").write_text(TINY_CONFIG)
    done = run_fedax("run", "tiny.yaml", "--out", "run", "--no-progress",
                 "--set", "checkpoint_every=1", cwd=root)
    assert done.returncode == 0, done.stderr
    return root / "run", root / "tiny.yaml"


@pytest.fixture
def run_copy(finished, tmp_path):
    run, config = finished
    shutil.copytree(run, tmp_path / "run")
    shutil.copy(config, tmp_path / "tiny.yaml")
    return tmp_path / "run"


def test_a_refused_resume_changes_nothing_on_disk(run_copy):
    before = snapshot(run_copy)
    assert {"metrics.jsonl", "summary.json", "accuracy.png",
            "checkpoints/ckpt_2.msgpack"} <= set(before)
    other = run_fedax("run", "tiny.yaml", "--out", "run", "--no-progress", "--resume",
                  "--set", "checkpoint_every=1", "--set", "client_lr=0.2", cwd=run_copy.parent)
    assert other.returncode == 2
    assert snapshot(run_copy) == before
    line = last_line(other.stderr)
    assert line.startswith("fedax: error: cannot resume") and "client_lr" in line
    assert "nothing in run was changed" in line

    for path in (run_copy / "checkpoints").iterdir():  # both checkpoints corrupt
        blob = bytearray(path.read_bytes())
        blob[-5] ^= 0xFF
        path.write_bytes(bytes(blob))
    before = snapshot(run_copy)
    corrupt = run_fedax("run", "tiny.yaml", "--out", "run", "--no-progress", "--resume",
                    "--set", "checkpoint_every=1", cwd=run_copy.parent)
    assert corrupt.returncode == 2
    assert snapshot(run_copy) == before
    line = last_line(corrupt.stderr)
    assert line.startswith("fedax: error: cannot resume") and "verifies" in line
    assert all(x.startswith("fedax: ") for x in corrupt.stderr.strip().splitlines())


def test_an_existing_run_is_refused_without_resume_or_overwrite(run_copy):
    before = snapshot(run_copy)
    again = run_fedax("run", "tiny.yaml", "--out", "run", "--no-progress", cwd=run_copy.parent)
    assert again.returncode == 2
    line = last_line(again.stderr)
    assert line.startswith("fedax: error: run already holds a run")
    assert "--resume" in line and "--overwrite" in line
    assert snapshot(run_copy) == before

    shutil.rmtree(run_copy / "checkpoints")  # a finished run that cannot be resumed
    before = snapshot(run_copy)
    resume = run_fedax("run", "tiny.yaml", "--out", "run", "--resume", cwd=run_copy.parent)
    assert resume.returncode == 2 and "no checkpoint" in last_line(resume.stderr)
    assert snapshot(run_copy) == before

    replaced = run_fedax("run", "tiny.yaml", "--out", "run", "--no-progress", "--overwrite",
                     "--set", "rounds=3", cwd=run_copy.parent)
    assert replaced.returncode == 0, replaced.stderr
    rounds = [json.loads(x)["round"] for x in (run_copy / "metrics.jsonl").open()]
    assert rounds == [1, 2, 3]
    assert json.loads((run_copy / "summary.json").read_text())["config"]["rounds"] == 3


def test_default_out_dirs_do_not_collide(tmp_path):
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG)
    outs = []
    for _ in range(2):
        done = run_fedax("run", "tiny.yaml", "--no-progress", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        line = next(x for x in done.stdout.splitlines() if x.startswith("outputs in "))
        outs.append(line.split()[2].rstrip("/"))
    assert outs[0] != outs[1]
    for out in outs:
        assert out.startswith("runs/tiny-") and (tmp_path / out / "summary.json").is_file()

    resume = run_fedax("run", "tiny.yaml", "--resume", cwd=tmp_path)
    assert resume.returncode == 2
    line = last_line(resume.stderr)
    assert "--resume needs --out" in line and f"--out {outs[1]} --resume" in line


def _demo_args(out, *extra):
    sets = ["dataset=synthetic", "partition=natural", "model=logistic", "num_clients=12",
            "rounds=2", "eval_every=1", "execution.devices=1", *extra]
    return ["demo", "--out", str(out), "--no-progress", *[x for s in sets for x in ("--set", s)]]


def test_demo_twice_into_the_same_out_reuses_finished_runs(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(_demo_args(out)) == 0
    runs = {name: snapshot(out / name) for name in ("mnist_2nn_noniid_fedsgd",
                                                    "mnist_2nn_noniid_fedavg")}
    table = (out / "table.md").read_text()
    capsys.readouterr()

    assert main(_demo_args(out)) == 0
    said = capsys.readouterr().out
    assert said.count("reusing the finished run") == 2
    assert {name: snapshot(out / name) for name in runs} == runs
    assert (out / "table.md").read_text() == table

    before = snapshot(out)
    assert main(_demo_args(out, "rounds=3")) == 2  # another config: refused, nothing changed
    line = last_line(capsys.readouterr().err)
    assert line.startswith("fedax: error:") and "--overwrite" in line
    assert snapshot(out) == before
    assert main([*_demo_args(out, "rounds=3"), "--overwrite"]) == 0
    summary = json.loads((out / "mnist_2nn_noniid_fedavg" / "summary.json").read_text())
    assert summary["rounds_run"] == 3


def test_records_and_summaries_are_strict_json():
    record = {"round": 3, "test_accuracy": 0.5, "test_loss": math.nan,
              "train_loss": math.inf, "elapsed_s": 1.0}
    clean = with_status(record)
    assert clean["test_loss"] is None and clean["train_loss"] is None
    assert clean["status"] == "diverged" and record["test_loss"] != record["test_loss"]
    assert with_status({"round": 1, "test_accuracy": 0.5})["status"] == "ok"
    assert "NaN" not in dumps(clean) and "Infinity" not in dumps(clean)
    with pytest.raises(ValueError):
        dumps(record)  # an unsanitized NaN fails loudly


def test_write_atomic_leaves_the_old_file_when_the_disk_is_full(tmp_path, monkeypatch):
    import errno

    path = tmp_path / "summary.json"
    path.write_text("old")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as err:
        write_atomic(path, "new")
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(path)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["summary.json"]
    monkeypatch.undo()
    write_atomic(path, "new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["summary.json"]


def test_the_plot_shows_every_point_with_integer_rounds_and_a_title():
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    records = [{"round": r, "test_accuracy": a}
               for r, a in [(1, 0.11), (2, 0.6), (3, 0.9), (4, 0.95), (5, 0.96)]]
    fig = accuracy_figure({"FedAvg": History(records)}, target=0.97, title="my run")
    ax = fig.axes[0]
    lo, hi = ax.get_ylim()
    assert lo < 0.11 and hi == 1.0
    assert isinstance(ax.xaxis.get_major_locator(), MaxNLocator)
    assert all(float(t).is_integer() for t in ax.get_xticks())
    assert ax.get_title() == "my run"
    plt.close(fig)
