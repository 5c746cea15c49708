"""A secure round against a plain round of fedax's networked runtime, same run, same data.

The setting: MNIST 2NN (199,210 parameters), IID, n clients of 60,000/n examples, every
client in every round (C = 1), E = 1, B = 50, client lr 0.1, hosted by ``--processes``
``fedax client`` processes on loopback (TLS, tokens), the server in this process. For each
n, three runs of ``--rounds`` rounds: plain FedAvg, and ``secure: {bits: 32}`` (SecAgg+: the
clients train, encode, and run the protocol's stages; the server unmasks the sum) without
and with the consistency check (identity keys and the roster, a fifth stage: the setup's
``roster.json`` removed, or kept).

Per round (the median over rounds 2.., so that compilation and start-up are left out):

* wall seconds (``round_s``, opening to close, all four stages for the secure round);
* server CPU seconds: this process's CPU between two closed rounds of the server's round
  log (``checkpoints/rounds.jsonl``; the server's threads:
  gRPC, checks, the protocol, the server step; no evaluation runs between them), and the
  protocol's own share (``secure_server_cpu_s``);
* client CPU seconds: the ``fedax client`` processes' CPU between the same lines (training,
  encoding, the protocol), per client;
* bytes each way (``bytes_in``, ``bytes_out``; per client).

Linux only (CPU times from /proc).

Usage: python benchmarks/bench_secagg_network.py [--clients 10,50,100] [--rounds 4]
    [--processes 2] [--out benchmarks/results/secagg-network-DATE.json]
Runs alone (a benchmark): the client processes share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

from fedax.experiments.network import run_network
from fedax.runtime import make_dev_pki
from fedax.spec.config import validate_config

BASE = {"seed": 0, "dataset": "mnist", "partition": "iid", "model": "2nn",
        "algorithm": "fedavg", "client_fraction": 1.0, "local_epochs": 1, "batch_size": 50,
        "client_lr": 0.1, "execution": {"devices": 1, "mode": "network"}}


TICK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``; 0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def _descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *_descendants(child)]
    return found


class Sampler(threading.Thread):
    """Samples this process's and its children's CPU seconds whenever a new record lands
    in ``metrics.jsonl``."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.samples, self.done = path, [], threading.Event()

    def cpu(self) -> tuple[float, float]:
        me = os.getpid()
        return _cpu(me), sum(_cpu(child) for child in _descendants(me))

    def run(self) -> None:
        seen = 0
        while not self.done.is_set():
            lines = self.path.read_text().splitlines() if self.path.exists() else []
            if len(lines) > seen:
                seen = len(lines)
                self.samples.append((seen, *self.cpu()))
            time.sleep(0.05)


def run(n: int, rounds: int, processes: int, secure: bool, work: Path,
        checked: bool = True) -> dict:
    data = {**BASE, "num_clients": n, "rounds": rounds, "eval_every": 10 * rounds,
            "network": {"local_clients": processes, "deadline_s": 300}}
    if secure:
        data["secure"] = {"bits": 32}
    name = f"{'secure' if secure else 'plain'}{'' if checked else '-unchecked'}-{n}"
    out = work / name
    if not checked:  # a setup without the roster: no consistency check
        setup = make_dev_pki(work / f"pki-{name}", n)
        Path(setup["roster"]).unlink()
        data["network"]["setup"] = str(work / f"pki-{name}")
    log = out / "checkpoints" / "rounds.jsonl"  # the server's round log, line by line
    sampler = Sampler(log)
    sampler.start()
    try:
        run_network(validate_config(data), out, progress=False)
    finally:
        sampler.done.set()
        sampler.join()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = records[1:-1] or records[1:]  # the last may carry the final evaluation
    samples = {count: (s, c) for count, s, c in sampler.samples}
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    closed = [i + 1 for i, line in enumerate(lines) if line.get("status") == "closed"]
    server_cpu, client_cpu = [], []
    for before, after in zip(closed[:-1], closed[1:], strict=True):
        if before in samples and after in samples:
            server_cpu.append(samples[after][0] - samples[before][0])
            client_cpu.append(samples[after][1] - samples[before][1])
    median = statistics.median
    row = {"num_clients": n, "secure": secure, "checked": secure and checked,
           "round_s": median(r["round_s"] for r in steady),
           "server_cpu_s": median(server_cpu) if server_cpu else None,
           "client_cpu_s_per_client": median(client_cpu) / n if client_cpu else None,
           "bytes_in_per_client": median(r["bytes_in"] for r in steady) / n,
           "bytes_out_per_client": median(r["bytes_out"] for r in steady) / n,
           "test_accuracy": records[-1].get("test_accuracy")}
    if secure:
        row["protocol_server_cpu_s"] = median(r["secure_server_cpu_s"] for r in steady)
        row["survivors"] = steady[-1]["secure_survivors"]
        row["signers"] = steady[-1]["secure_signers"]  # the consistency check (0: none)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="10,50,100")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="secagg-network-"))
    results = []
    for n in [int(c) for c in args.clients.split(",")]:
        plain = run(n, args.rounds, args.processes, False, work)
        unchecked = run(n, args.rounds, args.processes, True, work, checked=False)
        secure = run(n, args.rounds, args.processes, True, work)
        results += [plain, unchecked, secure]
        print(f"n={n}: without the consistency check: round {unchecked['round_s']:.2f} s "
              f"({unchecked['round_s'] / plain['round_s']:.2f}x plain), server CPU "
              f"{unchecked['server_cpu_s']:.2f} s "
              f"({unchecked['server_cpu_s'] / plain['server_cpu_s']:.2f}x), client CPU "
              f"{unchecked['client_cpu_s_per_client']:.3f} s", flush=True)
        print(f"n={n}: round {plain['round_s']:.2f} s plain, {secure['round_s']:.2f} s "
              f"secure ({secure['round_s'] / plain['round_s']:.2f}x); server CPU "
              f"{plain['server_cpu_s']:.2f} s plain, {secure['server_cpu_s']:.2f} s secure "
              f"({secure['server_cpu_s'] / plain['server_cpu_s']:.2f}x; protocol "
              f"{secure['protocol_server_cpu_s']:.2f} s); client CPU "
              f"{plain['client_cpu_s_per_client']:.3f} / "
              f"{secure['client_cpu_s_per_client']:.3f} s; up "
              f"{plain['bytes_in_per_client'] / 1e3:.0f} / "
              f"{secure['bytes_in_per_client'] / 1e3:.0f} kB, down "
              f"{plain['bytes_out_per_client'] / 1e3:.0f} / "
              f"{secure['bytes_out_per_client'] / 1e3:.0f} kB per client", flush=True)
    record = {"benchmark": "secure vs plain networked round, MNIST 2NN",
              "machine": platform.platform(), "argv": vars(args),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
              "results": results}
    out = Path(args.out or Path(__file__).parent / "results" /
               f"secagg-network-{time.strftime('%Y-%m-%d')}.json")
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
