"""A run over two processes with JAX's distributed runtime, on loopback.

``fedax run CONFIG --num-processes 2`` starts two processes (one CPU device each, Gloo
collectives); the cohort is split over both. The reference is the same run in one process
over two devices: the README's guarantee across device layouts is one round to float32
rounding and later rounds within relative 1e-3 (losses) and 0.2 points (accuracy). The two
processes read the same replicated outputs, so their copies of the run are identical.
"""

from __future__ import annotations

import json

import pytest
from conftest import TINY_CONFIG, run_fedax

CONFIG = TINY_CONFIG.replace("rounds: 2", "rounds: 3")


def _records(path):
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"}
            for line in path.read_text().splitlines()]


def test_two_processes_equal_one_process_over_two_devices(tmp_path):
    (tmp_path / "tiny.yaml").write_text(CONFIG)
    two = run_fedax("run", "tiny.yaml", "--num-processes", "2", "--out", "two",
                    "--no-progress", cwd=tmp_path, timeout=240)
    assert two.returncode == 0, two.stderr[-2000:]
    one = run_fedax("run", "tiny.yaml", "--devices", "2", "--set", "execution.devices=2",
                    "--out", "one", "--no-progress", cwd=tmp_path, timeout=240)
    assert one.returncode == 0, one.stderr[-2000:]
    ours, reference = _records(tmp_path / "two" / "metrics.jsonl"), _records(
        tmp_path / "one" / "metrics.jsonl")
    assert [r["round"] for r in ours] == [1, 2, 3]
    assert ours[0]["train_loss"] == pytest.approx(reference[0]["train_loss"], rel=1e-5)
    for a, b in zip(ours, reference, strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-3)
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-3)
        assert a["test_accuracy"] == pytest.approx(b["test_accuracy"], abs=2e-3)
    # process 1 kept its own, identical copy (its checkpoints would resume it)
    assert _records(tmp_path / "two" / "processes" / "1" / "metrics.jsonl") == ours
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["rounds_run"] == 3


@pytest.mark.parametrize("args, fragment", [
    (["--process-id", "0"], "--process-id and --coordinator go together"),
    (["--process-id", "2", "--coordinator", "127.0.0.1:1", "--num-processes", "2"],
     "--process-id must be in 0..1"),
    (["--process-id", "0", "--coordinator", "127.0.0.1:1"], "needs --num-processes"),
])
def test_bad_process_flags_are_one_line(tmp_path, args, fragment):
    (tmp_path / "tiny.yaml").write_text(CONFIG)
    result = run_fedax("run", "tiny.yaml", *args, cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr


def test_one_process_of_a_multi_process_run_needs_every_device(monkeypatch):
    """The runner's check, without starting a second process: a mesh that misses a
    process's devices is refused with the fix."""
    import jax

    from fedax.simulation import distributed

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "device_count", lambda: 16)
    with pytest.raises(ValueError, match="execution.devices = 16"):
        distributed.check_mesh(None)
    with pytest.raises(ValueError, match=r"processes \[0\] only, of 2"):
        distributed.check_mesh(jax.make_mesh((8,), ("clients",)))
    with pytest.raises(ValueError, match="HOST:PORT"):
        distributed.initialize("localhost", 2, 0)
