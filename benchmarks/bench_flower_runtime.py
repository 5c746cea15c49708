"""Flower's deployment runtime (SuperLink + SuperNodes) beside fedax's networked runtime,
in the same run: rounds per second and server CPU per client per round of FedAvg on the
MNIST 2NN (199,210 parameters) with 10 and 100 clients on loopback.

    flock /tmp/fedax-bench.lock .venv-bench/bin/python benchmarks/bench_flower_runtime.py \\
        --clients 10,100 --rounds 5 --out benchmarks/results

Both sides measure the runtime's own cost, not local training (as ``bench_runtime.py``):

* **fedax**: ``bench_runtime.bench`` (a ``fedax.runtime.Server`` with TLS and tokens in
  this process; N light client stubs in one child process, each answering its task with a
  fixed, valid 2NN report).
* **Flower** (``flwr`` of ``.venv-bench``, Flower's documented deployment path):
  ``flower-superlink --insecure`` (it starts its SuperExec, which runs the ServerApp in a
  subprocess), N ``flower-supernode --insecure`` processes (each with its SuperExec, which
  runs the ClientApp in a subprocess) and ``flwr run APP`` submitting a Flower App whose
  ServerApp runs Flower's own ``FedAvg`` strategy (``flwr.serverapp.strategy``, every node
  every round, no evaluation) over the 2NN's arrays, and whose ClientApp answers each
  train message with fixed arrays of the model's shapes and ``num-examples`` 600 (no
  training, like fedax's stubs). The ServerApp records a time stamp after each round's
  aggregation; the harness samples the CPU time of the SuperLink's process tree
  (SuperLink, SuperExec, ServerApp; ``psutil``) at the first measured round's start and
  at the last one's end.

Differences that remain: Flower here runs without TLS (``--insecure``, as its how-to
guide) while fedax always has TLS; Flower's fleet API is HTTP (flwr 1.42), fedax's gRPC;
each Flower client is two or three processes where fedax's stubs share one. Server CPU is
CPU seconds over (measured rounds x clients); it includes answering idle polls on both
sides.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# A SuperNode's log line when a ClientApp process it started missed its deadline (under
# CPU overload the processes spawned per message time out and are started again).
FAILED = "task-token authentication failed"

APP = '''\
"""The Flower App of bench_flower_runtime.py (written by it)."""

import json
import time

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

SHAPES = [(784, 200), (200,), (200, 200), (200,), (200, 10), (10,)]  # the 2NN

server_app = ServerApp()
client_app = ClientApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    marks_path, clients = str(config["marks"]), int(config["clients"])
    marks = []

    def mark():
        marks.append(time.time())
        with open(marks_path + ".tmp", "w") as f:
            json.dump(marks, f)
        import os
        os.replace(marks_path + ".tmp", marks_path)

    class Timed(FedAvg):
        def configure_train(self, server_round, arrays, config, grid):
            if not marks:
                mark()
            return super().configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round, replies):
            out = super().aggregate_train(server_round, replies)
            mark()
            return out

    strategy = Timed(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=clients,
                     min_available_nodes=clients)
    init = ArrayRecord([np.zeros(s, np.float32) for s in SHAPES])
    strategy.start(grid=grid, initial_arrays=init, num_rounds=int(config["num-rounds"]),
                   train_config=ConfigRecord({"lr": 0.05}))


_REPLY = ArrayRecord([np.full(s, 1e-4, np.float32) for s in SHAPES])


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    msg.content["arrays"].to_numpy_ndarrays()  # the client reads the model it was sent
    content = RecordDict({"arrays": _REPLY,
                          "metrics": MetricRecord({"num-examples": 600})})
    return Message(content=content, reply_to=msg)
'''

PYPROJECT = '''\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedaxbenchapp"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedax"

[tool.flwr.app.components]
serverapp = "fedaxbench_app:server_app"
clientapp = "fedaxbench_app:client_app"

[tool.flwr.app.config]
num-rounds = 2
clients = 2
marks = "marks.json"
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and its live descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _stop_tree(pids: list[int], ports: list[int]) -> None:
    """Terminate the processes ``pids`` started, every descendant, and the Flower apps they
    started detached (a ``flwr-clientapp``/``flwr-serverapp`` whose parent has gone is
    re-parented to init; it is recognized by one of this run's ``ports`` on its command
    line), by pid; kill what is left after 10 s."""
    import psutil

    procs = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    ours = {f"127.0.0.1:{port}" for port in ports}
    for p in psutil.process_iter(["cmdline"]):
        args = p.info["cmdline"] or []
        if (p not in procs and any("flwr-" in a for a in args[:2])
                and any(a in ours for a in args)):
            procs.append(p)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import terminate_processes

    terminate_processes(procs, timeout=10)


def _wait_port(port: int, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


def flower(num_clients: int, rounds: int, warmup: int, timeout: float,
           keep_logs: str | None = None) -> dict:
    """One Flower deployment run: SuperLink, ``num_clients`` SuperNodes, ``flwr run``."""
    import numpy as np

    bin_dir = Path(sys.executable).parent
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    tmp = Path(tempfile.mkdtemp(prefix="fedax-flwr-"))
    env["FLWR_HOME"] = str(tmp / "flwr-home")
    app = tmp / "app"
    app.mkdir()
    (app / "fedaxbench_app.py").write_text(APP)
    (app / "pyproject.toml").write_text(PYPROJECT)
    port = _free_port()
    ports = [port]
    Path(env["FLWR_HOME"]).mkdir()
    (Path(env["FLWR_HOME"]) / "config.toml").write_text(
        f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    marks = tmp / "marks.json"
    logs = tmp / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen] = []

    def start(name, command):
        with open(logs / f"{name}.log", "w") as log:
            procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                          env=env, cwd=tmp))
        return procs[-1]

    try:
        link = start("superlink", ["flower-superlink", "--insecure", "--port", str(port),
                                   "--disable-runtime-dependency-installation"])
        _wait_port(port, 60)
        for k in range(num_clients):
            ports.append(_free_port())
            start(f"supernode{k}", ["flower-supernode", "--insecure",
                                    "--superlink", f"127.0.0.1:{port}",
                                    "--port", str(ports[-1]),
                                    "--node-config", f"partition-id={k}"])
        total = warmup + rounds
        run = subprocess.run(
            ["flwr", "run", str(app), "--run-config",
             f'num-rounds={total} clients={num_clients} marks="{marks}"'],
            env=env, cwd=tmp, capture_output=True, text=True, timeout=120)
        if run.returncode != 0:
            raise RuntimeError(f"flwr run failed: {run.stdout}\n{run.stderr}")
        end = time.monotonic() + timeout
        cpu0 = t0 = None
        seen = 0
        checked = time.monotonic()
        while time.monotonic() < end:
            if time.monotonic() - checked > 5:  # ClientApps timing out: stop, do not thrash
                checked = time.monotonic()
                failed = sum(log.read_text(errors="replace").count(FAILED)
                             for log in logs.glob("supernode*.log"))
                if failed > num_clients:
                    raise RuntimeError(
                        f"Flower's ClientApp processes are failing ({failed} x "
                        f"'{FAILED}'): the machine cannot run {num_clients} SuperNodes")
            done = json.loads(marks.read_text()) if marks.exists() else []
            if len(done) > seen:
                seen = len(done)
                if seen == warmup + 1 and cpu0 is None:  # the first measured round starts
                    cpu0, t0 = _tree_cpu(link.pid), done[-1]
                if seen == total + 1:
                    cpu1 = _tree_cpu(link.pid)
                    break
            time.sleep(0.01)
        else:
            raise TimeoutError(f"Flower did {max(seen - 1, 0)} of {total} rounds in "
                               f"{timeout} s; logs in {logs}")
        if cpu0 is None:  # warmup 0: the first mark is the start
            cpu0, t0 = 0.0, done[0]
        times = np.diff(done)[warmup:]
        measured = len(times)
        return {"clients": num_clients, "rounds": measured,
                "rounds_per_s": measured / (done[-1] - t0),
                "median_round_s": float(np.median(times)),
                "server_cpu_ms_per_client_round":
                    1000 * (cpu1 - cpu0) / (measured * num_clients)}
    finally:
        _stop_tree([p.pid for p in procs], ports)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if keep_logs:
            shutil.copytree(logs, Path(keep_logs) / f"flower-{num_clients}",
                            dirs_exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="10,100")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--poll-interval-s", type=float, default=0.05,
                        help="fedax's idle-poll interval")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds for one Flower run's rounds")
    parser.add_argument("--only", default="fedax,flower")
    parser.add_argument("--keep-logs", help="copy Flower's process logs here")
    parser.add_argument("--out", default=None,
                        help="write runtime-flower-<clients>-<date>.json here")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    import bench_runtime

    rows = []
    for n in (int(c) for c in args.clients.split(",")):
        row = {"clients": n}
        if "fedax" in args.only:
            row["fedax"] = bench_runtime.bench(n, args.rounds, args.warmup,
                                               args.poll_interval_s)
        if "flower" in args.only:
            try:
                row["flower"] = flower(n, args.rounds, args.warmup, args.timeout,
                                       args.keep_logs)
            except (RuntimeError, TimeoutError, OSError) as err:
                row["flower"] = {"error": str(err)[-2000:]}
        if "rounds_per_s" in row.get("fedax", {}) and "rounds_per_s" in row.get("flower", {}):
            row["fedax_speedup_rounds_per_s"] = (row["fedax"]["rounds_per_s"]
                                                 / row["flower"]["rounds_per_s"])
            row["flower_over_fedax_server_cpu"] = (
                row["flower"]["server_cpu_ms_per_client_round"]
                / row["fedax"]["server_cpu_ms_per_client_round"])
        rows.append(row)
    print(f"{'clients':>7} {'runtime':>8} {'rounds/s':>9} {'round s':>8} "
          f"{'srv CPU ms/client':>18}")
    for row in rows:
        for name in ("fedax", "flower"):
            r = row.get(name)
            if r is None:
                continue
            if "error" in r:
                print(f"{row['clients']:>7} {name:>8} error: {r['error'][-300:]}")
                continue
            print(f"{row['clients']:>7} {name:>8} {r['rounds_per_s']:>9.2f} "
                  f"{r['median_round_s']:>8.3f} {r['server_cpu_ms_per_client_round']:>18.2f}")
        if "fedax_speedup_rounds_per_s" in row:
            print(f"{row['clients']:>7}    ratio  fedax rounds/s = "
                  f"{row['fedax_speedup_rounds_per_s']:.2f} x Flower's; Flower's server CPU "
                  f"per client = {row['flower_over_fedax_server_cpu']:.2f} x fedax's")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = f"runtime-flower-{args.clients.replace(',', '-')}-{dt.date.today().isoformat()}"
        path, n = Path(args.out) / f"{stem}.json", 1
        while path.exists():  # never replace an earlier result
            n += 1
            path = Path(args.out) / f"{stem}-{n}.json"
        import flwr

        path.write_text(json.dumps({"rows": rows, "argv": sys.argv[1:], "cpus": os.cpu_count(),
                                    "flwr": flwr.__version__}, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
