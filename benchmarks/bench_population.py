"""Round time and memory against population size: virtual populations of up to 1M clients.

    python benchmarks/bench_population.py                       # N = 10k, 100k, 1M; C = 1000
    python benchmarks/bench_population.py --sizes 1000,10000 --cohort 50 --rounds 3   # smoke
    python benchmarks/bench_population.py --out benchmarks/results   # also writes JSON

Workload: a Synthetic(1, 1)-style ``VirtualPopulation`` (60 features, 10 classes, client
sizes ``min(int(LogNormal(4, 2)) + 50, --max-size)``, 90% of each client's examples for
training), multinomial logistic regression (610 parameters), cohorts of ``--cohort``
clients sampled uniformly without replacement, E = ``--epochs``, B = ``--batch-size``,
client SGD; FedAvg, and SCAFFOLD (Option II) with its c_i in a host ``ClientStateStore``
(memory-mapped ``.npy`` files in a temporary directory from N >= ``--memmap-from``, NumPy
arrays in memory below) and a cohort-sized slot buffer on the device.
``--algorithms scaffold_device`` adds the on-device SCAFFOLD (c_i of all N clients in the
algorithm state) for contrast.

Each (N, algorithm) runs in a fresh process (peak RSS is per process) through
``fedax.simulation.population.run_population``; a round is everything a user's round
costs: sampling, generating the cohort's data, batching, moving c_i in and out, the
compiled round, reading the loss back. The quantity is seconds per round (median over the
``--rounds`` rounds after ``--warmup``; one more round runs and is left out, since a round
also prepares the next cohort, which the last one does not), its ratio to the smallest N,
peak RSS, the state on the device after the last round (live device arrays: the model,
SCAFFOLD's c (its cohort's c_i arrive and leave with each round), or its whole c_i table
for ``scaffold_device``), the bytes moved to
the device per round, and the store's size (nominal, and what the OS has materialised).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

ALGORITHMS = ("fedavg", "scaffold", "scaffold_device")
DIM, CLASSES = 60, 10
RESULT_PREFIX = "RESULT "


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _disk_bytes(directory: Path) -> int:
    """Bytes the files in ``directory`` really occupy (sparse files count touched blocks)."""
    return sum(p.stat().st_blocks * 512 for p in directory.iterdir() if p.is_file())


def worker(args) -> dict:
    """One (N, algorithm) run in this process; returns its record."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from fedax.algorithms import fedavg, scaffold
    from fedax.data import VirtualPopulation, num_local_steps, sample_cohort
    from fedax.models import softmax_cross_entropy
    from fedax.simulation import Execution, choose_execution, make_evaluator
    from fedax.simulation.client_state import ClientStateStore
    from fedax.simulation.population import run_population

    n, name = args.worker_n, args.worker_algorithm
    if args.strategy == "default":
        execution = choose_execution()
    else:
        map_, steps, devices = args.strategy.split(":")
        execution = Execution(map_, steps, int(devices)).validate()
    slots = -(-args.cohort // execution.devices) * execution.devices

    def loss_fn(params, batch):
        return softmax_cross_entropy(batch.x @ params["w"] + params["b"], batch.y, batch.mask)

    params = {"w": jnp.zeros((DIM, CLASSES), jnp.float32), "b": jnp.zeros(CLASSES, jnp.float32)}
    population = VirtualPopulation(
        n, 1.0, 1.0, dim=DIM, num_classes=CLASSES, seed=0, max_size=args.max_size
    )
    rss_start = _rss_bytes()
    store, tmp = None, None
    if name == "fedavg":
        algorithm = fedavg(loss_fn, optax.sgd(args.client_lr))
    elif name == "scaffold":
        algorithm = scaffold(loss_fn, args.client_lr, n)
        if n >= args.memmap_from:
            tmp = tempfile.TemporaryDirectory(prefix="fedax_population_", dir=args.tmpdir)
        store = ClientStateStore(params, n, None if tmp is None else tmp.name)
    else:
        algorithm = scaffold(loss_fn, args.client_lr, n)

    clock = common.RoundClock()
    clock.mark()
    # One extra round, left out: a round's time includes preparing the next cohort
    # (overlapping the device's work), which the last round of a run does not do.
    history = run_population(
        algorithm,
        params,
        population,
        None,
        rounds=args.warmup + args.rounds + 1,
        cohort_size=args.cohort,
        local_epochs=args.epochs,
        batch_size=args.batch_size,
        seed=0,
        client_state=store,
        execution=execution,
        callbacks=[lambda _: clock.mark()],
    )
    jax.block_until_ready(history.state)
    live_device = sum(a.nbytes for a in jax.live_arrays())
    device_stats = jax.devices()[0].memory_stats() or {}
    times = history.round_times[args.warmup : args.warmup + args.rounds]
    disturbed = [r["disturbed"] for r in clock.rounds()][args.warmup : args.warmup + args.rounds]
    # What moves to the device each round: the cohort's examples in fixed-shape buffers
    # (C·T rows), the [C, S, B] indices and masks, and SCAFFOLD's cohort c_i in and out.
    rows = population.capacity("train")
    steps = num_local_steps(rows, args.epochs, args.batch_size)
    slot_bytes = 2 * slots * (DIM + 1) * CLASSES * 4 if store is not None else 0
    round_bytes = (
        args.cohort * rows * (DIM + 1) * 4
        + slots * steps * args.batch_size * 8
        + slots * 12
        + slot_bytes
    )

    # Outside the timing: accuracy on the test examples of 200 other clients.
    test = population.client_data(sample_cohort(12345, n, min(200, n)), "test")
    accuracy, _ = make_evaluator(lambda p, x: x @ p["w"] + p["b"], test.x, test.y)(
        algorithm.server_params(history.state)
    )
    record = {
        "num_clients": n,
        "algorithm": name,
        "execution": execution._asdict(),
        "compile_and_first_round_s": history.round_times[0],
        "warmup_s": history.round_times[: args.warmup],
        "round_s": times,
        "s_per_round": {"median": statistics.median(times), "min": min(times), "max": max(times)},
        "rounds_disturbed": int(sum(disturbed)),
        "train_loss": [r["train_loss"] for r in history.records],
        "test_accuracy_200_clients": accuracy,
        "peak_rss_mb": common.RssMonitor().peak_bytes / 2**20,
        "rss_before_run_mb": rss_start / 2**20,
        "rss_end_mb": _rss_bytes() / 2**20,
        "live_device_mb": live_device / 2**20,
        "round_transfer_mb": round_bytes / 2**20,
        "device_peak_mb": device_stats.get("peak_bytes_in_use", 0) / 2**20 or None,
        "store": None,
    }
    if store is not None:
        record["store"] = {
            "kind": "memmap" if tmp is not None else "memory",
            "nominal_mb": store.nbytes / 2**20,
            "on_disk_mb": None if tmp is None else _disk_bytes(Path(tmp.name)) / 2**20,
        }
        if tmp is not None:
            tmp.cleanup()
    if name == "scaffold_device":
        c = history.state.clients
        record["device_table_mb"] = sum(np.asarray(a).nbytes for a in jax.tree.leaves(c)) / 2**20
    return record


def run_one(args, n: int, name: str) -> dict:
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker-n",
        str(n),
        "--worker-algorithm",
        name,
        *args.passthrough,
    ]
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"num_clients": n, "algorithm": name, "error": f"timeout {args.timeout} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {
            "num_clients": n,
            "algorithm": name,
            "error": f"exit {proc.returncode}: " + " | ".join(tail),
        }
    record = json.loads(lines[-1][len(RESULT_PREFIX) :])
    record["process_s"] = time.perf_counter() - start
    return record


def _fmt(value, spec=".3g"):
    return "—" if value is None else format(value, spec)


def table(records: list[dict]) -> str:
    header = [
        "algorithm",
        "N",
        "s/round median",
        "min",
        "max",
        "x N_min",
        "peak RSS MB",
        "device state MB",
        "to device MB/round",
        "store MB (touched)",
        "1st round s",
        "notes",
    ]
    base = {}
    rows = []
    for r in records:
        if "error" in r:
            rows.append(
                [r["algorithm"], f"{r['num_clients']:,}", *["—"] * 9, "FAILED: " + r["error"]]
            )
            continue
        s = r["s_per_round"]
        base.setdefault(r["algorithm"], s["median"])
        store = r.get("store")
        store_text = "—"
        if store:
            touched = store["on_disk_mb"]
            store_text = f"{store['nominal_mb']:.0f} {store['kind']}"
            if touched is not None:
                store_text += f" ({touched:.0f})"
        elif "device_table_mb" in r:
            store_text = f"{r['device_table_mb']:.0f} on device"
        notes = f"{r['rounds_disturbed']} disturbed" if r["rounds_disturbed"] else ""
        rows.append(
            [
                r["algorithm"],
                f"{r['num_clients']:,}",
                _fmt(s["median"]),
                _fmt(s["min"]),
                _fmt(s["max"]),
                f"{s['median'] / base[r['algorithm']]:.2f}",
                f"{r['peak_rss_mb']:.0f}",
                f"{r['live_device_mb']:.1f}",
                f"{r['round_transfer_mb']:.1f}",
                store_text,
                _fmt(r["compile_and_first_round_s"]),
                notes,
            ]
        )
    widths = [max(len(c) for c in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    return "\n".join(lines + [fmt.format(*row) for row in rows])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        default="10000,100000,1000000",
        help="population sizes N, comma-separated (ratios are to the first)",
    )
    parser.add_argument(
        "--algorithms",
        default="fedavg,scaffold",
        help=f"comma-separated, of {', '.join(ALGORITHMS)}",
    )
    parser.add_argument("--cohort", type=int, default=1000, help="clients per round C")
    parser.add_argument("--rounds", type=int, default=10, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=2, help="rounds before measuring")
    parser.add_argument("--epochs", type=int, default=1, help="local epochs E")
    parser.add_argument("--batch-size", type=int, default=10, help="local batch size B")
    parser.add_argument("--max-size", type=int, default=200, help="largest client n_k")
    parser.add_argument("--client-lr", type=float, default=0.05)
    parser.add_argument(
        "--memmap-from",
        type=int,
        default=1_000_000,
        help="SCAFFOLD's store is a memmap file from this N on",
    )
    parser.add_argument("--tmpdir", default=None, help="where memmap stores go")
    parser.add_argument(
        "--strategy",
        default="default",
        help="execution MAP:STEPS:DEVICES, or 'default' (choose_execution)",
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    parser.add_argument(
        "--out", default=None, help="directory for population_<date>.json (default: no file)"
    )
    parser.add_argument("--worker-n", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--worker-algorithm", choices=ALGORITHMS, default=None, help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 1:
        raise SystemExit("--rounds and --warmup must be >= 1 (round 1 compiles)")

    if args.worker_n is not None:
        record = worker(args)
        print(RESULT_PREFIX + json.dumps(record, default=common._json_default), flush=True)
        return 0

    sizes = [int(s) for s in args.sizes.split(",")]
    names = args.algorithms.split(",")
    unknown = sorted(set(names) - set(ALGORITHMS))
    if unknown or min(sizes) < args.cohort:
        raise SystemExit(f"bad --algorithms {unknown} or a size below --cohort {args.cohort}")
    skip = {"--sizes", "--algorithms", "--out", "--timeout"}
    args.passthrough = []
    for key, value in vars(args).items():
        flag = "--" + key.replace("_", "-")
        if value is None or flag in skip or key.startswith("worker") or key == "passthrough":
            continue
        args.passthrough += [flag, str(value)]

    records = []
    for name in names:
        for n in sizes:
            record = run_one(args, n, name)
            records.append(record)
            done = record.get("s_per_round", {}).get("median")
            print(
                f"{name} N={n:,}: " + (f"{done:.3f} s/round" if done else record.get("error")),
                flush=True,
            )
    print()
    print(table(records))
    if args.out:
        path = common.dated_result(args.out, "population")
        common.write_json(
            path,
            {
                "benchmark": "population",
                "config": {
                    k: v
                    for k, v in vars(args).items()
                    if not k.startswith("worker") and k != "passthrough"
                },
                "workload": {
                    "data": "VirtualPopulation Synthetic(1, 1)",
                    "dim": DIM,
                    "classes": CLASSES,
                    "model": "multinomial logistic regression",
                    "size_law": f"min(int(LogNormal(4, 2)) + 50, {args.max_size})",
                    "train_fraction": 0.9,
                },
                "results": records,
                "versions": common.versions("jax", "jaxlib", "optax"),
                "machine": common.machine_info(),
                "date": common.now_iso(),
            },
        )
        print(f"\nwrote {path}")
    return 0 if all("error" not in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
