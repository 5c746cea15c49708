"""`fedax run` and `fedax demo` never lose results: run directories, refusals, atomic and
strict-JSON outputs."""

import hashlib
import json
import math
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
from conftest import TINY_CONFIG, run_fedax

from fedax.cli.main import main
from fedax.experiments import run as experiment
from fedax.experiments.outputs import accuracy_figure, dumps, with_status
from fedax.io import write_atomic
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
    assert "--resume needs --out" in line and "has a checkpoint" in line
    assert suggestions(line) == [["run", "tiny.yaml"]]  # none to resume: start a new one


def _demo_args(out, *extra):
    sets = ["dataset=synthetic", "partition=natural", "model=logistic", "num_clients=12",
            "rounds=2", "eval_every=1", "execution.devices=1", *extra]
    return ["demo", "--out", str(out), "--no-progress", *[x for s in sets for x in ("--set", s)]]


def test_demo_twice_into_the_same_out_reuses_finished_runs(tmp_path, capsys):
    """The demo is a reproduction (the 2NN table's non-IID quick cells): its runs live in
    OUT/runs/<cell>/lr_<lr>/, a second invocation reuses them all and writes the same
    table, a run of another config is refused until --overwrite."""
    out = tmp_path / "demo"
    assert main(_demo_args(out)) == 0
    runs = snapshot(out / "runs")
    assert {str(Path(k).parent) for k in runs if k.endswith("summary.json")} == {
        "fedsgd-e1-binf-pathological/lr_0.464", "fedavg-e1-b10-pathological/lr_0.215",
        "fedavg-e1-b10-pathological/lr_0.1"}
    report = (out / "report.md").read_text()
    table = [line for line in report.splitlines() if line.startswith("|")]
    assert table[2].startswith("| FedSGD | 1 | inf | non-IID | 0.464 |") and len(table) == 4
    said = capsys.readouterr().out
    assert "\n".join(table) in said

    assert main(_demo_args(out)) == 0
    assert capsys.readouterr().out.count("(reused)") == 3
    assert snapshot(out / "runs") == runs
    assert [line for line in (out / "report.md").read_text().splitlines()
            if line.startswith("|")] == table

    before = snapshot(out)
    assert main(_demo_args(out, "client_fraction=0.5")) == 2  # another config: refused
    line = last_line(capsys.readouterr().err)
    assert line.startswith("fedax: error:") and "--overwrite" in line
    assert snapshot(out) == before
    assert main([*_demo_args(out, "client_fraction=0.5"), "--overwrite"]) == 0
    summary = summary_of(out / "runs" / "fedavg-e1-b10-pathological" / "lr_0.215")
    assert summary["config"]["client_fraction"] == 0.5


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


# ------------------------------------------------------------------ extending, suggestions


# A command the CLI prints: up to the next ", ", "; ", " (" or the end of the line.
_COMMAND = re.compile(r"fedax (?:run|demo) .*?(?=, |; | \(|$)")


def suggestions(line):
    """The argv of each ``fedax ...`` command ``line`` suggests (``fedax`` dropped)."""
    found = [shlex.split(m) for m in _COMMAND.findall(line)]
    assert found and all(argv[0] == "fedax" for argv in found), line
    return [argv[1:] for argv in found]


def records(run):
    """The records of ``run/metrics.jsonl``, ``elapsed_s`` left out."""
    return [{k: v for k, v in json.loads(x).items() if k != "elapsed_s"}
            for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def summary_of(run):
    return json.loads((Path(run) / "summary.json").read_text())


def error_line(capsys):
    return last_line(capsys.readouterr().err)


@pytest.fixture
def here(tmp_path, monkeypatch):
    """An empty working directory holding tiny.yaml (suggested commands are relative)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FEDAX_DEBUG", raising=False)
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG)
    return tmp_path


def test_resume_with_more_rounds_extends_a_run_as_an_uninterrupted_run(here, capsys):
    """`--resume --set rounds=6` continues a finished 3-round run; with eval_every=2 its
    round-3 record (the old last one) is not a 6-round run's and goes. Fewer rounds than
    done are one line that changes nothing, and the commands it prints run as printed."""
    every = ["--set", "eval_every=2", "--set", "checkpoint_every=2", "--no-progress"]
    assert main(["run", "tiny.yaml", "--out", "run", "--set", "rounds=3", *every]) == 0
    assert [r["round"] for r in records("run")] == [2, 3]
    assert main(["run", "tiny.yaml", "--out", "full", "--set", "rounds=6", *every]) == 0
    assert main(["run", "tiny.yaml", "--out", "run", "--set", "rounds=6", "--resume",
                 *every]) == 0, capsys.readouterr().err
    assert [r["round"] for r in records("run")] == [2, 4, 6]
    assert records("run") == records("full")  # same program, same machine: equal
    summary = summary_of("run")
    assert summary["rounds_run"] == 6 and summary["resumed_from_round"] == 3
    assert summary["config"]["rounds"] == 6

    capsys.readouterr()
    before = snapshot(here / "run")
    assert main(["run", "tiny.yaml", "--out", "run", "--set", "rounds=4", "--resume",
                 *every]) == 2
    line = error_line(capsys)
    assert line.startswith("fedax: error: cannot resume the run in run: it has done 6 "
                           "rounds, more than rounds=4; nothing in run was changed")
    assert snapshot(here / "run") == before
    resume, overwrite = suggestions(line)
    assert resume[-1] == "--resume" and "rounds=6" in resume and "rounds=4" not in resume
    assert main(resume) == 0
    assert records("run") == records("full") and summary_of("run")["rounds_run"] == 6
    assert overwrite[-1] == "--overwrite" and main(overwrite) == 0
    assert [r["round"] for r in records("run")] == [2, 4]
    assert summary_of("run")["config"]["rounds"] == 4


def test_a_z_calibrated_to_the_rounds_is_given_to_extend_the_run(here, capsys):
    """target_epsilon without noise_multiplier: z belongs to the run's rounds. Extending it
    is refused in one line that says so; the command it prints gives the run its z and
    continues it, equal to an uninterrupted run with that z."""
    dp = ["--set", "privacy.mechanism=gaussian", "--set", "privacy.clip=1.0",
          "--set", "privacy.target_epsilon=8", "--set", "privacy.delta=1e-3",
          "--set", "checkpoint_every=1", "--no-progress"]
    assert main(["run", "tiny.yaml", "--out", "run", "--set", "rounds=2", *dp]) == 0
    first = records("run")
    z = summary_of("run")["privacy"]["noise_multiplier"]
    capsys.readouterr()
    before = snapshot(here / "run")
    assert main(["run", "tiny.yaml", "--out", "run", "--set", "rounds=4", "--resume",
                 *dp]) == 2
    line = error_line(capsys)
    assert f"its noise multiplier z = {z!r} was calibrated to rounds=2" in line
    assert snapshot(here / "run") == before
    resume, _ = suggestions(line)
    assert f"privacy.noise_multiplier={z!r}" in resume and resume[-1] == "--resume"
    assert main(resume) == 0, capsys.readouterr().err
    extended = records("run")
    assert [r["round"] for r in extended] == [1, 2, 3, 4] and extended[:2] == first
    assert [r["epsilon"] for r in extended] == sorted({r["epsilon"] for r in extended})
    full = [a for a in resume if a != "--resume"]
    full[full.index("--out") + 1] = "full"
    assert main(full) == 0
    assert extended == records("full")


def test_every_command_a_refusal_suggests_runs_as_printed(here, capsys):
    done = ["--no-progress"]
    assert main(["run", "tiny.yaml", "--set", "checkpoint_every=1", *done]) == 0
    assert main(["run", "tiny.yaml", *done]) == 0  # the newest run: no checkpoint
    with_ckpt, without = sorted(Path("runs").iterdir(), key=lambda p: p.stat().st_mtime)
    assert (with_ckpt / "checkpoints").is_dir() and not (without / "checkpoints").exists()
    capsys.readouterr()

    # --resume without --out: the newest run this config continues, not the newest run
    assert main(["run", "tiny.yaml", "--set", "checkpoint_every=1", "--resume"]) == 2
    line = error_line(capsys)
    (resume,) = suggestions(line)
    assert resume == ["run", "tiny.yaml", "--set", "checkpoint_every=1", "--out",
                      str(with_ckpt), "--resume"]
    assert main(resume) == 0 and summary_of(with_ckpt)["resumed_from_round"] == 2
    # ... and when none does, a command that starts one
    assert main(["run", "tiny.yaml", "--set", "client_lr=0.2", "--resume"]) == 2
    (start,) = suggestions(error_line(capsys))
    assert start == ["run", "tiny.yaml", "--set", "client_lr=0.2"]
    assert main(start) == 0 and len(list(Path("runs").iterdir())) == 3

    # --out holding a run that this config continues: continue it, or replace it
    shutil.copytree(with_ckpt, "copy")
    capsys.readouterr()
    assert main(["run", "tiny.yaml", "--out", "copy", "--set", "checkpoint_every=1"]) == 2
    line = error_line(capsys)
    assert line.startswith("fedax: error: copy already holds a run")
    resume, overwrite = suggestions(line)
    assert resume[-1] == "--resume" and overwrite[-1] == "--overwrite"
    kept = records("copy")
    assert main(resume) == 0 and records("copy") == kept
    assert main(overwrite) == 0 and summary_of("copy")["resumed_from_round"] is None
    # ... that it does not continue (another config, or no checkpoint): replace it
    for argv in (["--set", "client_lr=0.2"], ["--resume"]):
        capsys.readouterr()
        assert main(["run", "tiny.yaml", "--out", str(without), *argv]) == 2
        (overwrite,) = suggestions(error_line(capsys))
        assert overwrite[-1] == "--overwrite" and main(overwrite) == 0


def _interrupt_after(monkeypatch, round_):
    """Ctrl-C right after the record of ``round_`` is written."""
    original = experiment.JsonlWriter.__call__

    def call(self, record):
        original(self, record)
        if record["round"] == round_:
            raise KeyboardInterrupt

    monkeypatch.setattr(experiment.JsonlWriter, "__call__", call)
    return lambda: monkeypatch.setattr(experiment.JsonlWriter, "__call__", original)


@pytest.mark.parametrize("every", [1, 0])
def test_the_command_a_ctrl_c_suggests_runs_as_printed(here, capsys, monkeypatch, every):
    argv = ["run", "tiny.yaml", "--out", "run", "--set", "rounds=4",
            "--set", f"checkpoint_every={every}"]
    assert main([*argv[:3], "full", *argv[4:], "--no-progress"]) == 0
    restore = _interrupt_after(monkeypatch, 2)
    assert main([*argv, "--no-progress"]) == 130
    restore()
    line = error_line(capsys)
    assert line.startswith("fedax: interrupted: stopped after round 2 in run")
    (command,) = suggestions(line)
    assert command[-1] == ("--resume" if every else "--overwrite")
    assert main(command) == 0
    assert records("run") == records("full")
    assert summary_of("run")["resumed_from_round"] == (2 if every else None)


@pytest.mark.parametrize("every", [1, 0])
def test_the_command_a_ctrl_c_of_the_demo_suggests_runs_as_printed(tmp_path, capsys,
                                                                   monkeypatch, every):
    monkeypatch.chdir(tmp_path)
    args = _demo_args("demo", f"checkpoint_every={every}")
    restore = _interrupt_after(monkeypatch, 1)
    assert main(args) == 130
    restore()
    line = error_line(capsys)
    assert line.startswith("fedax: interrupted: stopped; continue with: fedax demo")
    (command,) = suggestions(line)
    assert command[:3] == ["demo", "--out", "demo"]
    assert main(command) == 0
    fedsgd = summary_of("demo/runs/fedsgd-e1-binf-pathological/lr_0.464")
    assert fedsgd["rounds_run"] == 2 and fedsgd["resumed_from_round"] == (1 if every else None)
    assert Path("demo/report.md").is_file()


def test_a_command_that_fails_before_a_result_leaves_no_directory_it_created(here, capsys):
    """A config error found only against the data (batch_size larger than every client's
    data): no directory this command created stays behind, none that existed goes."""
    too_big = ["--set", "batch_size=100000", "--no-progress"]
    assert main(["run", "tiny.yaml", "--out", "new/deeper/run", *too_big]) == 2
    assert "larger than every client's data" in error_line(capsys)
    assert main(["run", "tiny.yaml", *too_big]) == 2  # runs/<name>-<time>, and runs/
    for existing in ("empty", "parent"):
        Path(existing).mkdir()
    assert main(["run", "tiny.yaml", "--out", "empty", *too_big]) == 2
    assert main(["run", "tiny.yaml", "--out", "parent/run", *too_big]) == 2
    assert sorted(p.name for p in here.iterdir()) == ["empty", "parent", "tiny.yaml"]
    assert not any(Path("empty").iterdir()) and not any(Path("parent").iterdir())
    Path("runs").mkdir()
    assert main(["run", "tiny.yaml", *too_big]) == 2
    assert Path("runs").is_dir() and not any(Path("runs").iterdir())
    # the demo too (a budget too small for one round is found against the data)
    assert main(_demo_args("demo", "privacy.mechanism=gaussian", "privacy.clip=1.0",
                           "privacy.noise_multiplier=0.01", "privacy.target_epsilon=0.01")) == 2
    assert "one round at noise_multiplier" in error_line(capsys)
    assert not Path("demo").exists()
