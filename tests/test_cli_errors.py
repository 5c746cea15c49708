"""Every failure of the `fedax` command ends in one readable line and a non-zero status;
Ctrl-C stops a run (and its worker processes) quietly and says how to continue."""

import errno
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_CONFIG, _child_env, run_fedax

import fedax
from fedax.builder import datasets
from fedax.cli.main import main
from fedax.experiments import run as experiment


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("fedax: "), stderr
    return lines[0]


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A tiny config in an empty working directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FEDAX_DEBUG", raising=False)
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG)
    return tmp_path / "tiny.yaml"


def test_version(tmp_path):
    done = run_fedax("--version", cwd=tmp_path, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"fedax {fedax.__version__}"
    # The command's module loads no JAX until a command needs it (--version, --help and
    # usage errors answer at once).
    import subprocess
    import sys

    probe = subprocess.run([sys.executable, "-c", "import sys, fedax.cli.main; "
                            "print(sorted(m for m in ('jax', 'optax') if m in sys.modules))"],
                           capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "[]", probe.stderr


def test_usage_errors_are_one_line(capsys):
    for argv in (["run"], ["data", "fetch", "no-such-data"], ["run", "x", "--resume",
                                                               "--overwrite"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert one_error_line(capsys.readouterr().err).startswith("fedax: error: ")


def test_a_duplicate_yaml_key_is_one_line_naming_it(tiny, capsys):
    tiny.write_text(TINY_CONFIG + "client_lr: 0.5\n")
    assert main(["run", str(tiny), "--out", "run"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "'client_lr' twice" in line and "lines 9 and 12" in line
    assert not Path("run").exists()


def test_divergence_is_one_line_and_the_json_has_no_nan(tmp_path):
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG)
    done = run_fedax("run", "tiny.yaml", "--out", "run", "--no-progress",
                     "--set", "client_lr=1e35", "--set", "rounds=3", cwd=tmp_path)
    assert done.returncode == 1
    line = one_error_line(done.stderr)
    assert line.startswith("fedax: error: round ") and "client_lr" in line

    def strict(text):
        def refuse(token):
            raise AssertionError(f"{token} in strict JSON")
        return json.loads(text, parse_constant=refuse)

    text = (tmp_path / "run" / "metrics.jsonl").read_text()
    records = [strict(x) for x in text.splitlines()]
    assert all(r["status"] in ("ok", "diverged") for r in records)
    summary = strict((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "diverged"


def _failing_source():
    from fedax.data._cache import Source

    def fetch(names):
        raise ConnectionError("no network in this test")

    return Source("test mirror", fetch)


@pytest.mark.parametrize("argv", [["data", "fetch", "mnist"],
                                  ["run", "mnist_2nn_noniid_fedavg", "--out", "run"]])
def test_missing_data_is_a_message_not_a_traceback(tiny, tmp_path, monkeypatch, capsys, argv):
    from fedax.data import mnist

    monkeypatch.setenv("FEDAX_DATA_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(mnist, "default_sources", lambda: (_failing_source(),))
    monkeypatch.setattr(datasets, "_DATASETS", {})
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [x for x in err.splitlines() if x.startswith("fedax: error: ")]
    assert len(errors) == 1 and "mnist" in errors[0].lower()
    assert "test mirror" in err  # the sources tried are listed
    assert not Path("run").exists()  # the run failed before a result: no --out left behind


def test_an_unwritable_out_names_the_path_and_the_fix(tiny, monkeypatch, capsys):
    target = Path("locked") / "run"
    original = Path.mkdir

    def read_only(self, *args, **kwargs):
        if "locked" in self.parts:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert main(["run", str(tiny), "--out", str(target), "--no-progress"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line == f"fedax: error: read-only file system: {target}; choose a writable --out"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_out_directory_is_one_line(tmp_path):
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG)
    (tmp_path / "ro").mkdir(mode=0o555)
    done = run_fedax("run", "tiny.yaml", "--out", "ro/run", "--no-progress", cwd=tmp_path)
    assert done.returncode == 1
    assert "choose a writable --out" in one_error_line(done.stderr)


def test_an_out_below_a_file_is_one_line(tiny, capsys):
    Path("file").write_text("")
    assert main(["run", str(tiny), "--out", "file/run", "--no-progress"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "file/run" in line and "--out must name a directory" in line


def test_a_full_disk_is_one_line_and_leaves_nothing_behind(tiny, monkeypatch, capsys):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    assert main(["run", str(tiny), "--out", "run", "--no-progress"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line == ("fedax: error: no space left on device: run/metrics.jsonl; free some "
                    "space or choose another --out")
    assert not Path("run").exists()  # no empty file, and no directory this command made
    Path("run").mkdir()  # one that existed before stays
    assert main(["run", str(tiny), "--out", "run", "--no-progress"]) == 1
    assert Path("run").is_dir() and list(Path("run").iterdir()) == []


def test_any_other_failure_is_one_line_and_debug_shows_the_traceback(tiny, monkeypatch,
                                                                      capsys):
    def boom(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(experiment, "run_experiment", boom)
    assert main(["run", str(tiny), "--out", "run"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line == "fedax: error: RuntimeError: boom; run with --debug for the traceback"
    for argv, env in ((["--debug", "run", str(tiny), "--out", "run"], None),
                      (["run", str(tiny), "--out", "run", "--debug"], None),
                      (["run", str(tiny), "--out", "run"], "1")):
        if env:
            monkeypatch.setenv("FEDAX_DEBUG", env)
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "Traceback" in err and err.strip().splitlines()[-1].startswith("fedax: error:")


def _terminal_sigint() -> None:
    """In the child before exec: SIGINT at its default, as a terminal's foreground job has
    it. A job started in the background by a non-interactive shell (``cmd &``) inherits
    SIGINT ignored, and Python then leaves it ignored: its Ctrl-C would never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("strategy,every", [("sequential", 1), ("processes", 1),
                                            ("sequential", 0)])
def test_ctrl_c_stops_quietly_and_says_how_to_continue(tmp_path, strategy, every):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it (the workers of
    the `processes` strategy included)."""
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG)
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedax.cli.main", "run", "tiny.yaml", "--out", "run",
         "--no-progress", "--set", "rounds=1000000", "--set", f"checkpoint_every={every}",
         "--set", f"execution.strategy={strategy}"],
        cwd=tmp_path, env={**_child_env(), "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_terminal_sigint)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if every and list((out / "checkpoints").glob("ckpt_*.msgpack")):
                break
            if not every and (out / "metrics.jsonl").is_file():
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            _, stderr = proc.communicate(timeout=120)  # a loaded CI machine is slow to stop
        except subprocess.TimeoutExpired:  # where it hangs: faulthandler prints every thread
            proc.send_signal(signal.SIGABRT)
            pytest.fail(f"no exit 120 s after Ctrl-C; its threads:\n{proc.communicate()[1]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr
    line = one_error_line(stderr)
    assert line.startswith("fedax: interrupted: stopped after round ")
    if every:
        command = line.split("continue with: ")[1]
        assert shlex.split(command) == [
            "fedax", "run", "tiny.yaml", "--set", "rounds=1000000",
            "--set", f"checkpoint_every={every}", "--set", f"execution.strategy={strategy}",
            "--out", "run", "--resume"]
    else:
        assert "no checkpoint" in line and "checkpoint_every=N" in line
    deadline = time.monotonic() + 20  # the workers are gone too
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "processes of the run are still alive"
        time.sleep(0.1)
