"""The networked runtime on loopback: bytes on the wire per round against ``comm_cost``'s
prediction, rounds per second and server CPU per client, for the MNIST 2NN (199,210
parameters) with 10 and 100 clients.

    flock /tmp/fedax-bench.lock .venv/bin/python benchmarks/bench_runtime.py \\
        --clients 10,100 --rounds 5 --out benchmarks/results

Setup: a ``fedax.runtime.Server`` (FedAvg, cohort = every client, TLS, tokens) in this
process; the clients are light stubs in one child process (one TLS channel, token and
poll loop each, as ``tests/test_runtime_faults.py``'s load test): each answers its task
with a fixed, valid 2NN report, so the figures are the runtime's own cost (TLS, chunked
streaming, per-report checks, stacking, the compiled aggregation and server update), not
local training. The server process's CPU time (``resource.getrusage``) over the measured
rounds, divided by rounds x clients, is the server CPU per client per round; it includes
answering idle polls (every ``--poll-interval-s``). The first ``--warmup`` rounds (which
compile the server step) are not measured.

Bytes: ``bytes_out`` / ``bytes_in`` are the application bytes the server streamed (the
serialized protobuf envelopes of tasks and idle-poll answers) and received (reports), per
round; TLS records, HTTP/2 and gRPC framing below that are not counted. ``comm_cost``
(``fedax.federated``) prices the same FedAvg round as a federated program: N x the
broadcast model down, N x (update, weight, statistics) up. The ratio is the runtime's
framing overhead (paths, dtypes, shapes, round ids, nonces, idle polls).

Flower's deployment runtime (SuperLink + SuperNodes) beside it, in the same run:
``bench_flower_runtime.py`` (needs the benchmark environment ``.venv-bench``, ``make
bench-env``; see benchmarks/README.md).
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

    return Task("fedavg", "2nn", num_clients, client_lr=0.05, local_epochs=1, batch_size=10,
                seed=0, input_shape=[28, 28, 1])


def run_stubs(port: int, ca: str, tokens: dict[int, str], num_clients: int) -> None:
    """The child process: ``num_clients`` stubs answering every task with a fixed report."""
    import jax
    import numpy as np

    from fedax.runtime import ClientTLS, Connection, build, wire
    from fedax.runtime.task import report_template

    task = _task(num_clients)
    built = build(task)
    template = report_template(built.pieces, built.params, task.input_shape)
    report = jax.tree.map(lambda a: np.full(a.shape, 1e-4, a.dtype), template)
    report = report._replace(weight=np.float32(600.0), num_examples=np.float32(600.0))
    tensors = wire.encode_tree(report)

    def stub(cid):
        conn = Connection(f"127.0.0.1:{port}", ClientTLS(ca), cid, tokens[cid], timeout_s=60)
        conn.chunk_bytes = conn.join().chunk_bytes
        while True:
            env = conn.poll()
            if env.kind == "done":
                break
            if env.kind == "wait":
                time.sleep(env.retry_after_s)
                continue
            conn.submit(wire.Envelope(kind="update", client_id=cid, round=env.round,
                                      attempt=env.attempt, model_version=env.model_version,
                                      nonce=env.nonce, tensors=tensors))
        conn.close()

    threads = [threading.Thread(target=stub, args=(k,), daemon=True)
               for k in range(num_clients)]
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


def bench(num_clients: int, rounds: int, warmup: int, poll_interval_s: float) -> dict:
    import numpy as np

    from fedax.runtime import Registry, Server, ServerConfig, ServerTLS, make_dev_pki

    with tempfile.TemporaryDirectory() as tmp:
        pki = make_dev_pki(tmp, num_clients)
        server = Server(_task(num_clients),
                        ServerConfig(rounds=warmup + rounds, cohort_size=num_clients,
                                     deadline_s=300, poll_interval_s=poll_interval_s,
                                     max_workers=32),
                        ServerTLS(pki["cert"], pki["key"]), Registry.load(pki["registry"]))
        port = server.start()
        tokens = Path(tmp) / "tokens.json"
        tokens.write_text(json.dumps({str(k): v for k, v in pki["tokens"].items()}))
        child = subprocess.Popen([sys.executable, __file__, STUBS, str(port), pki["ca"],
                                  str(tokens), str(num_clients)])
        try:
            while len(server.history) < warmup:
                time.sleep(0.01)
            cpu0, t0 = _cpu(), time.perf_counter()
            server.wait(1800)
            cpu1, t1 = _cpu(), time.perf_counter()
            child.wait(120)
        finally:
            if child.poll() is None:
                child.kill()
            server.stop()
    measured = server.history[warmup:]
    down, up = predicted_bytes(num_clients)
    out = float(np.median([r["bytes_out"] for r in measured]))
    inn = float(np.median([r["bytes_in"] for r in measured]))
    return {
        "clients": num_clients, "rounds": len(measured),
        "rounds_per_s": len(measured) / (t1 - t0),
        "median_round_s": float(np.median([r["round_s"] for r in measured])),
        "server_cpu_ms_per_client_round": 1000 * (cpu1 - cpu0) / (len(measured) * num_clients),
        "bytes_out_per_round": out, "predicted_down": down, "overhead_down": out / down - 1,
        "bytes_in_per_round": inn, "predicted_up": up, "overhead_up": inn / up - 1,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == STUBS:
        port, ca, tokens, n = sys.argv[2:6]
        run_stubs(int(port), ca, {int(k): v for k, v in
                                  json.loads(Path(tokens).read_text()).items()}, int(n))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="10,100")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--poll-interval-s", type=float, default=0.05)
    parser.add_argument("--out", default=None, help="write runtime-<date>.json here")
    args = parser.parse_args()
    rows = [bench(int(n), args.rounds, args.warmup, args.poll_interval_s)
            for n in args.clients.split(",")]
    print(f"{'clients':>7} {'rounds/s':>9} {'round s':>8} {'srv CPU ms/client':>18} "
          f"{'down B/round':>13} {'comm_cost':>11} {'+%':>6} {'up B/round':>12} "
          f"{'comm_cost':>11} {'+%':>6}")
    for r in rows:
        print(f"{r['clients']:>7} {r['rounds_per_s']:>9.2f} {r['median_round_s']:>8.3f} "
              f"{r['server_cpu_ms_per_client_round']:>18.2f} {r['bytes_out_per_round']:>13.0f} "
              f"{r['predicted_down']:>11} {100 * r['overhead_down']:>6.2f} "
              f"{r['bytes_in_per_round']:>12.0f} {r['predicted_up']:>11} "
              f"{100 * r['overhead_up']:>6.2f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = Path(args.out) / f"runtime-{dt.date.today().isoformat()}.json"
        path.write_text(json.dumps({"rows": rows, "argv": sys.argv[1:],
                                    "cpus": os.cpu_count()}, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
