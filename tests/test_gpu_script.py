"""``benchmarks/gpu/run.sh --smoke``: the GPU run's one script at toy sizes on the CPU, every
part through the same code as on the GPU, so that the script cannot rot before a GPU is at
hand (benchmarks/gpu/README.md)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu" / "run.sh"
COMMITTED = REPO / "experiments" / "results" / "fedavg-shakespeare" / "runs"
FILES = {"run.json", "w_2nn.json", "w_cnn.json", "lstm.json", "cross_device.json",
         "shakespeare.json", "run.log", "shakespeare_runs.tar.gz"}


def _module(name: str):
    """A module of benchmarks/gpu (not a package) by file."""
    spec = importlib.util.spec_from_file_location(
        f"gpu_{name}", REPO / "benchmarks" / "gpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and value > 0


@pytest.mark.slow  # the whole GPU script at toy sizes: 2 minutes on 2 cores
def test_gpu_run_script_smoke(tmp_path, child_env):
    out = tmp_path / "out"
    committed_before = _digest(COMMITTED)
    env = dict(child_env, PYTHON=sys.executable, FEDAX_GPU_WORK=str(tmp_path / "work"))
    started = time.monotonic()
    done = subprocess.run(["bash", str(SCRIPT), "--smoke", str(out)], env=env,
                          capture_output=True, text=True, timeout=400)
    wall = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    log = (out / "run.log").read_text() if (out / "run.log").exists() else ""

    # At most 8 files: what the device tool brings back from $OUT.
    assert {p.name for p in out.iterdir()} == FILES, log[-4000:]
    assert _digest(COMMITTED) == committed_before  # nothing written into experiments/

    run = json.loads((out / "run.json").read_text())
    assert run["mode"] == "smoke" and run["machine"]["jax"]["backend"] == "cpu"
    assert run["machine"]["jax"]["fedax"]["version"]
    assert set(run["parts"]) == {"machine", "w_2nn", "w_cnn", "lstm", "cross_device",
                                 "shakespeare"}
    assert all(p["status"] == "ok" for p in run["parts"].values()), (run["parts"], log[-4000:])
    has_torch = importlib.util.find_spec("torch") is not None
    assert run["machine"]["torch"]["available"] == has_torch

    for model in ("2nn", "cnn"):
        w = json.loads((out / f"w_{model}.json").read_text())
        assert w["model"] == model and w["workload"]["smoke"] is True
        fedax = [r for r in w["runs"] if r["implementation"] == "fedax"]
        assert fedax and all(_positive(r["s_per_round"]["median"]) for r in fedax)
        assert all(_positive(r["peak_rss_mb"]) for r in w["runs"])
        assert all(r["rounds_total"] == 1 for r in w["runs"])
        names = {r["implementation"] for r in w["runs"]}
        if has_torch:
            assert "pytorch" in names
        else:  # skipped, and the JSON says why
            assert "pytorch" not in names
            assert [s["implementation"] for s in w["skipped"]] == ["pytorch"]
            assert "torch" in w["skipped"][0]["why"]
        assert _positive(w["summary"][0]["s_per_round_median"])
        assert w["summary"][0]["x_fedax_default"] in (1.0, None)

    lstm = json.loads((out / "lstm.json").read_text())
    rows = {r["impl"]: r for r in lstm["rows"]}
    assert _positive(rows["fedax"]["ms_per_step_median"])
    assert _positive(rows["fedax"]["gflops_per_s"])
    assert ("pytorch" in rows) == has_torch
    if not has_torch:
        assert "torch" in lstm["skipped"]["pytorch"]
    lockstep = {r["config"]: r for r in lstm["lockstep"]["rows"]}
    assert set(lockstep) == {"sequential contiguous", "sequential balanced", "lockstep 2"}
    for r in lockstep.values():
        assert _positive(r["s_per_round"]["median"]) and _positive(r["client_steps_per_s"])
        # E = 1 is not chaotic: lockstep's batched products agree to rounding
        assert r["max_abs_diff_vs_contiguous"] < 1e-4, r
    assert lstm["lockstep"]["steps"]["total"] > 0

    cross = json.loads((out / "cross_device.json").read_text())
    assert [r["workload"]["clients_per_round"] for r in cross["runs"]] == [20, 200]
    for r in cross["runs"]:
        assert r["workload"]["num_clients"] == 200
        assert 20 <= r["workload"]["sizes"]["min"] <= r["workload"]["sizes"]["max"] <= 100
        assert _positive(r["s_per_round"]["median"]) and _positive(r["client_updates_per_s"])
        assert _positive(r["examples_per_s"]) and _positive(r["peak_rss_mb"])

    shakespeare = json.loads((out / "shakespeare.json").read_text())
    cells = {c["cell"]: c for c in shakespeare["cells"]}
    fedavg, fedsgd = cells["fedavg-e5-b10-natural"], cells["fedsgd-e1-binf-natural"]
    # The committed FedAvg run: copied, adopted to this machine's execution, restored.
    assert fedavg["status"].startswith("restored"), fedavg
    assert fedavg["resumed_from"] == fedavg["committed_checkpoint_round"] == 70
    assert fedavg["copied_from"].startswith("experiments/results/fedavg-shakespeare/runs/")
    assert isinstance(fedavg["adopted"], list)
    # FedSGD (no committed run): 2 rounds from scratch, each timed, with its records.
    assert fedsgd["status"] == "finished", fedsgd
    assert fedsgd["committed_checkpoint_round"] is None and fedsgd["resumed_from"] == 0
    assert [r["round"] for r in fedsgd["rounds"]] == [1, 2]
    assert all(_positive(r["seconds"]) for r in fedsgd["rounds"])
    assert [r["round"] for r in fedsgd["new_records"]] == [1, 2]
    assert 0.0 <= fedsgd["new_records"][-1]["test_accuracy"] <= 1.0
    with tarfile.open(out / "shakespeare_runs.tar.gz") as tar:
        names = tar.getnames()
    assert "fedavg-e5-b10-natural/lr_1.47/metrics.jsonl" in names
    assert any(n.startswith("smoke-fedsgd-e1-binf-natural/") and n.endswith(".msgpack")
               for n in names)

    print(f"run.sh --smoke took {wall:.1f} s")


def test_shakespeare_cell_stops_before_a_round_that_would_not_fit():
    shakespeare = _module("shakespeare")
    saved = []
    cell = shakespeare.CellRun("c", time.perf_counter() + 1.0, lambda: saved.append(1))
    cell.check_time(70)  # the first round: always run (it compiles)
    assert cell.info["resumed_from"] == 70
    cell.info["rounds"] = [{"round": 71, "seconds": 30.0}]
    cell.check_time(71)  # the compile round alone is no estimate: go on
    cell.info["rounds"].append({"round": 72, "seconds": 2.0})
    with pytest.raises(shakespeare.OutOfTime, match="round 73"):
        cell.check_time(72)  # now + 2 s > the deadline, 1 s away
    cell.deadline = time.perf_counter() + 60.0
    cell.check_time(72)


def test_adopting_a_checkpoint_rewrites_only_the_given_items(tmp_path):
    import jax.numpy as jnp

    from fedax.checkpoint import read_file
    from fedax.simulation.checkpoint import save_checkpoint

    shakespeare = _module("shakespeare")
    saved = {"execution.map": "sequential", "execution.devices": 2, "train.sha256": "abc",
             "init_params.sha256": "old", "config.client_lr": 1.47}
    save_checkpoint(tmp_path, 70, {"w": jnp.ones(3)}, fingerprint=saved)
    now = {"execution.map": "vmap", "execution.devices": 1, "init_params.sha256": "old",
           "shuffles": "per-client"}
    changed = shakespeare.adopt_checkpoints(tmp_path, now)
    assert changed == [{"file": "ckpt_70.msgpack", "round": 70, "items": {
        "execution.map": {"was": "sequential", "now": "vmap"},
        "execution.devices": {"was": 2, "now": 1},
        "shuffles": {"was": None, "now": "per-client"}}}]
    fingerprint = read_file(tmp_path / "ckpt_70.msgpack")["fingerprint"]
    assert fingerprint == {**saved, **now}  # the data's hash and the config untouched
    assert shakespeare.adopt_checkpoints(tmp_path, now) == []  # already adopted
