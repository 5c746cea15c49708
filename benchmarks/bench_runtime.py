"""The networked runtime on loopback: server CPU per client per round, idle-client cost,
rounds per second and bytes on the wire against ``comm_cost``, for the MNIST 2NN (199,210
parameters); optionally the same measurements on an older fedax in the same run.

    flock /tmp/fedax-bench.lock .venv/bin/python benchmarks/bench_runtime.py \\
        --clients 100 --population 1000 --cohort 100 --over-selection 0.3 \\
        --baseline ac877f4 --out benchmarks/results

Two workloads:

* **cross-silo** (``--clients N``): N clients, every one in every round (the setting of
  the earlier figure, 6-9 ms of server CPU per client per round);
* **cross-device** (``--population P --cohort K --over-selection f``): P connected
  clients, ceil(K(1+f)) selected a round, K reports close it (the rest are "unneeded"),
  3 rounds within their deadline. Plus the **idle cost**: P connected clients and no
  round open for ``--idle-s`` seconds (``min_clients`` above P), server CPU per idle
  client per second.

Setup: a ``fedax.runtime.Server`` (FedAvg, TLS, tokens) in this process; the clients are
light stubs in ``--processes`` child processes (one TLS channel, token and poll loop each,
as ``tests/test_runtime_faults.py``'s load test): each answers its task with a fixed,
valid 2NN report, so the figures are the runtime's own cost (TLS, authentication, polls,
chunked streaming, per-report checks, the server-side clip stage, stacking, the compiled
aggregation and server update), not local training. The server process's CPU time
(``resource.getrusage``) over the measured rounds, divided by rounds x selected clients,
is the server CPU per client per round; it includes answering idle polls. The first
``--warmup`` rounds (which compile the server step) are not measured.

``--baseline REV`` checks REV out into a temporary ``git worktree`` and runs the same
measurements there (a child process with that tree's ``src`` first on ``PYTHONPATH``,
in the same run, one after the other, never at once), then prints new/old ratios. The
script adapts to the older API (settings it lacks are left out).

Bytes: ``bytes_out`` / ``bytes_in`` are the application bytes the server streamed and
received per round; TLS, HTTP/2 and gRPC framing are not counted. ``comm_cost``
(``fedax.federated``) prices the same FedAvg round as a federated program. Flower's
deployment runtime beside it: ``bench_flower_runtime.py`` (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

STUBS = "--stubs"


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _task(num_clients: int):
    from fedax.runtime import Task

    config = {"seed": 0, "rounds": 1, "dataset": "mnist", "partition": "iid",
              "num_clients": num_clients, "model": "2nn", "algorithm": "fedavg",
              "client_fraction": 1.0, "local_epochs": 1, "batch_size": 10, "client_lr": 0.05}
    return Task(config, num_clients, [28, 28, 1])


def run_stubs(port: int, ca: str, tokens: dict[int, str], num_clients: int,
              ids: list[int]) -> None:
    """A child process: stubs ``ids`` answering every task with a fixed, valid report
    until the server says done or goes away."""
    import jax
    import numpy as np

    from fedax.runtime import ClientTLS, Connection, build, wire
    from fedax.runtime.task import report_template

    task = _task(num_clients)
    built = build(task)
    template = report_template(built.pieces, built.params, task.input_shape)
    report = jax.tree.map(lambda a: np.full(a.shape, 1e-4, a.dtype), template)
    stats = dict(report.stats)
    if "local_steps" in stats:  # E * ceil(600 / 10): a bound the server checks
        stats["local_steps"] = np.float32(60.0)
    report = report._replace(weight=np.float32(600.0), num_examples=np.float32(600.0),
                             stats=stats)
    tensors = wire.encode_tree(report)

    def stub(cid):
        conn = Connection(f"127.0.0.1:{port}", ClientTLS(ca), cid, tokens[cid], timeout_s=60)
        try:
            conn.chunk_bytes = conn.join().chunk_bytes
            while True:
                env = conn.poll()
                if env.kind == "done":
                    break
                if env.kind == "wait":
                    time.sleep(env.retry_after_s)
                    continue
                conn.submit(wire.Envelope(kind="update", client_id=cid, round=env.round,
                                          attempt=env.attempt,
                                          model_version=env.model_version,
                                          nonce=env.nonce, tensors=tensors))
        except Exception:  # the server stopped (the idle measurement ends that way)
            pass
        finally:
            conn.close()

    threads = [threading.Thread(target=stub, args=(k,), daemon=True) for k in ids]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def predicted_bytes(num_clients: int) -> tuple[int, int]:
    """``comm_cost`` of one composed FedAvg round of the 2NN with ``num_clients`` clients:
    (server -> clients, clients -> server) bytes."""
    import jax
    import numpy as np

    from fedax.algorithms import CohortBatches, make
    from fedax.client import Batches
    from fedax.federated import comm_cost
    from fedax.models import get_model, softmax_cross_entropy

    model = get_model("2nn")

    def loss_fn(params, batch):
        return softmax_cross_entropy(model.apply(params, batch.x), batch.y, batch.mask)

    algorithm = make("fedavg", loss_fn, num_clients=num_clients, client_lr=0.05)
    params = model.init(jax.random.key(0))
    state = algorithm.init(params, jax.random.key(0))
    n = num_clients
    cohort = CohortBatches(Batches(np.zeros((n, 1, 1, 28, 28, 1), np.float32),
                                   np.zeros((n, 1, 1), np.int32), np.ones((n, 1, 1), np.float32)),
                           np.ones(n, np.float32), np.arange(n, dtype=np.int32))
    cost = comm_cost(algorithm.round, state, cohort, jax.random.key(0))
    return cost.server_to_clients_bytes, cost.clients_to_server_bytes


def _config(**settings):
    """A ``ServerConfig`` with the settings this fedax has (an older one lacks some)."""
    import dataclasses

    from fedax.runtime import ServerConfig

    names = {f.name for f in dataclasses.fields(ServerConfig)}
    return ServerConfig(**{k: v for k, v in settings.items() if k in names})


def _serve(population: int, settings: dict, processes: int):
    """A started server over a fresh PKI and its stub processes."""
    from fedax.runtime import Registry, Server, ServerTLS, make_dev_pki

    tmp = tempfile.TemporaryDirectory()
    pki = make_dev_pki(tmp.name, population)
    server = Server(_task(population), _config(**settings),
                    ServerTLS(pki["cert"], pki["key"]), Registry.load(pki["registry"]))
    port = server.start()
    tokens = Path(tmp.name) / "tokens.json"
    tokens.write_text(json.dumps({str(k): v for k, v in pki["tokens"].items()}))
    children = []
    for p in range(processes):
        ids = ",".join(str(k) for k in range(p, population, processes))
        children.append(subprocess.Popen([sys.executable, __file__, STUBS, str(port),
                                          pki["ca"], str(tokens), str(population), ids]))
    return server, children, tmp


def _reap(server, children, tmp) -> None:
    try:
        for child in children:
            try:
                child.wait(120)
            except subprocess.TimeoutExpired:
                child.kill()
    finally:
        server.stop()
        tmp.cleanup()


def bench(population: int, cohort: int, over_selection: float, rounds: int, warmup: int,
          poll_interval_s: float, processes: int, max_workers: int = 512) -> dict:
    import numpy as np

    server, children, tmp = _serve(population, dict(
        rounds=warmup + rounds, cohort_size=cohort, over_selection=over_selection,
        deadline_s=60, poll_interval_s=poll_interval_s, max_workers=max_workers), processes)
    try:
        while len(server.history) < warmup:
            if server._error is not None:
                raise server._error
            time.sleep(0.01)
        cpu0, t0 = _cpu(), time.perf_counter()
        server.wait(1800)
        cpu1, t1 = _cpu(), time.perf_counter()
    finally:
        _reap(server, children, tmp)
    measured = server.history[warmup:]
    selected = float(np.mean([r["selected"] for r in measured]))
    row = {
        "population": population, "cohort": cohort, "selected": selected,
        "rounds": len(measured), "rounds_per_s": len(measured) / (t1 - t0),
        "median_round_s": float(np.median([r["round_s"] for r in measured])),
        "max_round_s": float(np.max([r["round_s"] for r in measured])),
        "reported": [r["reported"] for r in measured],
        "server_cpu_ms_per_client_round": 1000 * (cpu1 - cpu0) / (len(measured) * selected),
        "bytes_out_per_round": float(np.median([r["bytes_out"] for r in measured])),
        "bytes_in_per_round": float(np.median([r["bytes_in"] for r in measured])),
    }
    if population == cohort and over_selection == 0:
        down, up = predicted_bytes(population)
        row.update(predicted_down=down, overhead_down=row["bytes_out_per_round"] / down - 1,
                   predicted_up=up, overhead_up=row["bytes_in_per_round"] / up - 1)
    return row


def idle(population: int, seconds: float, poll_interval_s: float, processes: int,
         max_workers: int = 512) -> dict:
    """Server CPU per idle client per second: every client connected and polling, no round
    opens (``min_clients`` above the population)."""
    server, children, tmp = _serve(population, dict(
        rounds=1, cohort_size=1, min_clients=population + 1, deadline_s=60,
        poll_interval_s=poll_interval_s, max_workers=max_workers), processes)
    try:
        end = time.monotonic() + 120
        while len(server._alive()) < population and time.monotonic() < end:
            time.sleep(0.1)
        alive = len(server._alive())
        cpu0, t0 = _cpu(), time.perf_counter()
        time.sleep(seconds)
        cpu1, t1 = _cpu(), time.perf_counter()
    finally:
        for child in children:
            child.kill()
        _reap(server, children, tmp)
    return {"population": population, "alive": alive, "seconds": t1 - t0,
            "server_cpu_ms_per_idle_client_s": 1000 * (cpu1 - cpu0) / (alive * (t1 - t0)),
            "server_cpu_share": (cpu1 - cpu0) / (t1 - t0)}


def measure(args) -> dict:
    out = {"cross_silo": [bench(int(n), int(n), 0.0, args.rounds, args.warmup,
                                args.poll_interval_s, args.processes, args.max_workers)
                          for n in args.clients.split(",") if n]}
    if args.population:
        out["cross_device"] = bench(args.population, args.cohort, args.over_selection,
                                    args.device_rounds, args.warmup, args.poll_interval_s,
                                    args.processes, args.max_workers)
        out["idle"] = idle(args.population, args.idle_s, args.poll_interval_s,
                           args.processes, args.max_workers)
    return out


def baseline(rev: str, argv: list[str]) -> dict:
    """The same measurements on fedax at ``rev`` (a temporary worktree, a child
    process)."""
    repo = Path(__file__).resolve().parents[1]
    tree = tempfile.mkdtemp(prefix="fedax-baseline-")
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", tree, rev],
                   check=True, capture_output=True)
    try:
        env = dict(os.environ, PYTHONPATH=str(Path(tree) / "src"))
        result = Path(tree) / "result.json"
        subprocess.run([sys.executable, __file__, *argv, "--measure-only", str(result)],
                       check=True, env=env)
        return json.loads(result.read_text())
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", tree],
                       check=False, capture_output=True)


def _print(name: str, out: dict) -> None:
    print(f"== {name}")
    for r in out["cross_silo"]:
        if "overhead_down" not in r:
            continue
        print(f"cross-silo {r['population']:>5} clients: {r['rounds_per_s']:.2f} rounds/s, "
              f"round {r['median_round_s']:.3f} s, server CPU "
              f"{r['server_cpu_ms_per_client_round']:.2f} ms/client/round, down "
              f"{r['bytes_out_per_round']:.0f} B (+{100 * r['overhead_down']:.2f}% over "
              f"comm_cost), up {r['bytes_in_per_round']:.0f} B "
              f"(+{100 * r['overhead_up']:.2f}%)")
    if "cross_device" in out:
        r = out["cross_device"]
        print(f"cross-device {r['population']} connected, {r['selected']:.0f} selected, "
              f"cohort {r['cohort']}: rounds {r['median_round_s']:.3f} s (max "
              f"{r['max_round_s']:.3f}), reported {r['reported']}, server CPU "
              f"{r['server_cpu_ms_per_client_round']:.2f} ms/selected client/round")
        i = out["idle"]
        print(f"idle: {i['alive']} clients connected, no round: server CPU "
              f"{i['server_cpu_ms_per_idle_client_s']:.3f} ms/idle client/s "
              f"({100 * i['server_cpu_share']:.1f}% of a core)")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == STUBS:
        port, ca, tokens, n, ids = sys.argv[2:7]
        run_stubs(int(port), ca, {int(k): v for k, v in
                                  json.loads(Path(tokens).read_text()).items()}, int(n),
                  [int(k) for k in ids.split(",")])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="10,100", help="cross-silo sizes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--population", type=int, default=0,
                        help="cross-device: connected clients (0: skip)")
    parser.add_argument("--cohort", type=int, default=100)
    parser.add_argument("--over-selection", type=float, default=0.3)
    parser.add_argument("--device-rounds", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--processes", type=int, default=4, help="stub processes")
    parser.add_argument("--max-workers", type=int, default=512,
                        help="the server's handler threads (half of them may hold polls)")
    parser.add_argument("--poll-interval-s", type=float, default=0.5)
    parser.add_argument("--baseline", help="a git revision to measure in the same run")
    parser.add_argument("--measure-only", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="write runtime-<date>.json here")
    args = parser.parse_args()
    if args.measure_only:
        Path(args.measure_only).write_text(json.dumps(measure(args)))
        return
    own = sys.argv[1:]
    rows = {"fedax": measure(args)}
    if args.baseline:
        skip = {"--baseline", "--out"}
        argv = [a for i, a in enumerate(own) if a not in skip and own[i - 1] not in skip]
        rows[f"fedax@{args.baseline}"] = baseline(args.baseline, argv)
    for name, out in rows.items():
        _print(name, out)
    if args.baseline:
        new, old = rows["fedax"], rows[f"fedax@{args.baseline}"]
        key = "server_cpu_ms_per_client_round"
        for a, b in zip(new["cross_silo"], old["cross_silo"], strict=True):
            print(f"ratio cross-silo {a['population']}: server CPU per client-round new/old "
                  f"{a[key] / b[key]:.2f}, rounds/s new/old "
                  f"{a['rounds_per_s'] / b['rounds_per_s']:.2f}")
        if "cross_device" in new:
            print(f"ratio cross-device: server CPU per client-round new/old "
                  f"{new['cross_device'][key] / old['cross_device'][key]:.2f}; idle cost "
                  f"new/old {new['idle']['server_cpu_ms_per_idle_client_s'] / old['idle']['server_cpu_ms_per_idle_client_s']:.2f}")  # noqa: E501
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = Path(args.out) / f"runtime-{dt.date.today().isoformat()}.json"
        n = 1
        while path.exists():  # never replace an earlier result
            n += 1
            path = path.with_name(f"runtime-{dt.date.today().isoformat()}-{n}.json")
        path.write_text(json.dumps({"rows": rows, "argv": sys.argv[1:],
                                    "cpus": os.cpu_count()}, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
