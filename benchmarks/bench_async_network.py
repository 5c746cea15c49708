"""Synchronous rounds against FedBuff over a real network, with clients of two speeds.

The setting (issue 31's check): MNIST 2NN, IID, 20 clients of 3,000 examples, each a
``fedax client`` process of its own on loopback (TLS, tokens), half of them slow: they wait
``--delay-s`` after training each task before reporting (``fedax client --delay-s``, a slow
device). E = 1, B = 50, client lr 0.1.

* **sync**: rounds of m = 10 clients (C = 0.5), the server waiting for all ten (its round
  is as slow as its slowest selected client);
* **async**: FedBuff on the server (``network.asynchronous``), K = 5 reports a server step,
  M = 10 trips in flight, staleness weights s(τ) = 1/√(1 + τ); a server step takes half a
  round's updates, so ``--async-steps`` is twice ``--rounds``;
* **simulator**: the simulator's FedBuff (``execution.mode: async``) with the same K, M and
  staleness, on a latency model of the same mean trip (``--delay-s`` half the time: uniform
  on [0, 2·mean]); its ``virtual_time`` is in trips of that model, not seconds.

For each, the wall time (summed ``round_s`` from the first round's opening, or the first
trip: process start-up and compilation are left out) and server steps to the target
accuracy, the final accuracy, and for async the staleness. Writes ``results.json`` and
``report.md`` into ``--out``.

Usage: python benchmarks/bench_async_network.py [--rounds 12] [--target 0.9] [--delay-s 2]
    [--out benchmarks/results/async-network]
Runs alone (a benchmark): 20 client processes share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from fedax.experiments.network import run_network
from fedax.experiments.run import run_experiment
from fedax.runtime import make_dev_pki
from fedax.spec.config import config_to_dict, validate_config

CLIENTS = 20
BASE = {"seed": 0, "dataset": "mnist", "partition": "iid", "num_clients": CLIENTS,
        "model": "2nn", "algorithm": "fedavg", "client_fraction": 0.5, "local_epochs": 1,
        "batch_size": 50, "client_lr": 0.1, "eval_every": 1, "execution": {"devices": 1}}
FEDBUFF = {"buffer_size": 5, "concurrency": 10,
           "staleness": {"kind": "polynomial", "exponent": 0.5}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def networked(config: dict, out: Path, setup: Path, delay_s: float) -> list[dict]:
    """The config's network run with CLIENTS client processes, the odd ids slow."""
    port = _free_port()
    config = validate_config({**config, "network": {
        **config.get("network", {}), "local_clients": 0, "port": port,
        "setup": str(setup), "deadline_s": 300}})
    spec = out / "config.yaml"
    out.mkdir(parents=True, exist_ok=True)
    spec.write_text(yaml.safe_dump(config_to_dict(config)))
    done: dict[str, BaseException | None] = {}

    def serve():
        try:
            run_network(config, out / "run", progress=False,
                        server_options={"min_clients": CLIENTS})
            done["error"] = None
        except BaseException as err:  # reported below
            done["error"] = err

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    time.sleep(2.0)
    env = {**os.environ, "GRPC_VERBOSITY": "ERROR"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "fedax.cli.main", "client", "--server", f"127.0.0.1:{port}",
         "--ca", str(setup / "ca.pem"), "--config", str(spec), "--id", str(k),
         "--token-file", str(setup / "tokens" / f"{k}.token"), "--connect-s", "120",
         "--delay-s", str(delay_s if k % 2 else 0.0)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        for k in range(CLIENTS)]
    server.join()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    if done.get("error") is not None:
        raise done["error"]
    return [json.loads(line) for line in
            (out / "run" / "metrics.jsonl").read_text().splitlines()]


def to_target(records: list[dict], target: float, clock: str = "round_s") -> dict:
    """Server steps and time (summed ``clock``, or ``virtual_time``) to the target."""
    elapsed = 0.0
    for r in records:
        elapsed = r["virtual_time"] if clock == "virtual_time" else elapsed + r[clock]
        if (r.get("test_accuracy") or 0) >= target:
            return {"steps": r["round"], "time": round(elapsed, 2)}
    return {"steps": None, "time": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--delay-s", type=float, default=2.0)
    parser.add_argument("--out", default="benchmarks/results/async-network")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="fedax-async-network-"))
    setup = work / "setup"
    make_dev_pki(setup, CLIENTS, ("127.0.0.1", "localhost"))
    runs = {}
    started = time.perf_counter()
    runs["sync"] = networked({**BASE, "rounds": args.rounds,
                              "execution": {"mode": "network", "devices": 1}},
                             work / "sync", setup, args.delay_s)
    runs["async"] = networked({**BASE, "rounds": 2 * args.rounds, "asynchronous": FEDBUFF,
                               "execution": {"mode": "network", "devices": 1},
                               "network": {"asynchronous": True}},
                              work / "async", setup, args.delay_s)
    mean = args.delay_s / 2  # half the clients wait delay_s
    simulated = validate_config({**BASE, "rounds": 2 * args.rounds, "execution": {
        "mode": "async", "devices": 1}, "asynchronous": {
        **FEDBUFF, "latency": {"kind": "uniform", "mean": max(mean, 1e-3)}}})
    run_experiment(simulated, work / "simulated", progress=False, tensorboard=False)
    runs["simulated"] = [json.loads(line) for line in
                         (work / "simulated" / "metrics.jsonl").read_text().splitlines()]
    summary = {
        "setting": {"clients": CLIENTS, "slow": CLIENTS // 2, "delay_s": args.delay_s,
                    "target": args.target, "sync_rounds": args.rounds,
                    "fedbuff": FEDBUFF, "base": BASE},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "wall_time_s": round(time.perf_counter() - started, 1),
        "sync": {**to_target(runs["sync"], args.target),
                 "final_accuracy": runs["sync"][-1]["test_accuracy"]},
        "async": {**to_target(runs["async"], args.target),
                  "final_accuracy": runs["async"][-1]["test_accuracy"],
                  "mean_staleness": round(sum(r["mean_staleness"] for r in runs["async"])
                                          / len(runs["async"]), 3)},
        "simulated": {**to_target(runs["simulated"], args.target, "virtual_time"),
                      "final_accuracy": runs["simulated"][-1]["test_accuracy"]},
        "records": runs,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    s, a, m = summary["sync"], summary["async"], summary["simulated"]
    speedup = (f"{s['time'] / a['time']:.2f}×" if s["time"] and a["time"] else "n/a")
    lines = [
        "# Synchronous rounds against FedBuff over a real network, two client speeds",
        "",
        f"`python benchmarks/bench_async_network.py --rounds {args.rounds} --target "
        f"{args.target} --delay-s {args.delay_s}` on {os.cpu_count()} CPU cores: "
        f"{CLIENTS} `fedax client` processes on loopback (TLS, tokens), the odd ids waiting "
        f"{args.delay_s:g} s after each task; MNIST 2NN IID, E = 1, B = 50, client lr 0.1. "
        "Time is summed round time from the first round's opening (sync) or the first trip "
        "(async): start-up and compilation are left out.",
        "",
        "| run | server steps to target | seconds to target | final accuracy |",
        "| --- | --- | --- | --- |",
        f"| sync, 10 clients a round | {s['steps']} | {s['time']} | "
        f"{s['final_accuracy']:.4f} |",
        f"| async (FedBuff K = 5, M = 10, s(τ) = 1/√(1+τ)) | {a['steps']} | {a['time']} | "
        f"{a['final_accuracy']:.4f} |",
        f"| simulator's FedBuff, uniform latency of the same mean | {m['steps']} | "
        f"{m['time']} (virtual) | {m['final_accuracy']:.4f} |",
        "",
        f"Over the network FedBuff reached {args.target:g} in {speedup} less wall time than "
        f"synchronous rounds (mean staleness {a['mean_staleness']}). A synchronous round "
        "waits for its slowest selected client; FedBuff applies the first K reports, so "
        "fast clients carry it. It needs more server steps for the same target (each is "
        "half a round's updates, some stale).",
    ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    shutil.rmtree(work, ignore_errors=True)  # the runs' directories (the figures are out)


if __name__ == "__main__":
    main()
