"""Shared pieces of the fedax benchmark harness (see benchmarks/README.md).

The workload W is the FedAvg paper's MNIST setting (McMahan et al. 2017, section 3):
100 clients x 600 examples (IID), C = 0.1 (10 clients a round), E = 5, B = 10, client SGD,
n_k-weighted averaging; models 2NN and CNN. The quantity is seconds per round (median over
the measured rounds after a warm-up) and peak memory.

This module needs only the standard library and NumPy (plus fedax's NumPy-only data layer
for the MNIST cohorts), so every implementation's process, JAX or PyTorch, can import it
without loading the other framework. Linux only: CPU and memory accounting read ``/proc``.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"

# ----------------------------------------------------------------------------- workload W
NUM_CLIENTS = 100
EXAMPLES_PER_CLIENT = 600  # 60,000 MNIST training examples, IID
CLIENT_FRACTION = 0.1  # C: 10 clients a round
LOCAL_EPOCHS = 5  # E
# FEDAX_BENCH_SMOKE=1: toy sizes for smoke runs (benchmarks/gpu/run.sh --smoke): 2 clients a
# round, E = 1 (60 steps a client). The record's workload says so ("smoke": true).
SMOKE = os.environ.get("FEDAX_BENCH_SMOKE", "") not in ("", "0")
if SMOKE:
    CLIENT_FRACTION, LOCAL_EPOCHS = 0.02, 1
BATCH_SIZE = 10  # B
CLIENT_LR = 0.05
SEED = 0
COHORT_SIZE = max(math.floor(CLIENT_FRACTION * NUM_CLIENTS + 1e-9), 1)
STEPS_PER_CLIENT = LOCAL_EPOCHS * math.ceil(EXAMPLES_PER_CLIENT / BATCH_SIZE)  # 300
EXAMPLES_PER_ROUND = COHORT_SIZE * LOCAL_EPOCHS * EXAMPLES_PER_CLIENT  # 30,000 fwd+bwd
MODELS = ("2nn", "cnn")

WORKLOAD = {
    "dataset": "mnist",
    "partition": "iid",
    "num_clients": NUM_CLIENTS,
    "examples_per_client": EXAMPLES_PER_CLIENT,
    "client_fraction": CLIENT_FRACTION,
    "clients_per_round": COHORT_SIZE,
    "local_epochs": LOCAL_EPOCHS,
    "batch_size": BATCH_SIZE,
    "client_optimizer": f"sgd(lr={CLIENT_LR})",
    "aggregation": "n_k-weighted mean",
    "steps_per_client": STEPS_PER_CLIENT,
    "examples_per_round": EXAMPLES_PER_ROUND,
    "seed": SEED,
    **({"smoke": True} if SMOKE else {}),
}

# A measured round is "disturbed" (and left out of the statistics) when other processes
# used more than this many cores during it (CPU time of processes outside the benchmark's
# process tree, plus hypervisor steal time).
DISTURBED_CORES = 0.2


def check_model(model: str) -> str:
    if model not in MODELS:
        raise SystemExit(f"unknown model {model!r}; allowed: {', '.join(MODELS)}")
    return model


def num_cores() -> int:
    """Cores this process may run on (the cgroup/affinity view, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# ----------------------------------------------------------------------------- data
def load_federated_mnist():
    """(ClientData of W's 100 IID clients, x_train, y_train) from fedax's verified cache.

    x is float32 ``[60000, 28, 28, 1]`` in [0, 1], y int32. Same partition in every
    implementation: ``fedax.data.iid(60000, 100, SEED)``.
    """
    from fedax.data import ClientData, iid, load_mnist

    arrays = load_mnist()
    x, y = arrays["x_train"], arrays["y_train"]
    parts = iid(len(y), NUM_CLIENTS, SEED)
    return ClientData.from_partition(x, y, parts), x, y


def round_cohort(train, t: int):
    """Round t's cohort exactly as ``fedax.simulation.run`` builds it: clients and
    per-epoch shuffles from ``np.random.default_rng([SEED, t])``. Returns
    ``(client_ids [C], idx [C, S, B], mask [C, S, B], num_examples [C])`` (NumPy)."""
    from fedax.data import make_cohort, num_local_steps, sample_clients

    rng = np.random.default_rng([SEED, t])
    ids = sample_clients(rng, train.num_clients, CLIENT_FRACTION)
    steps = num_local_steps(int(train.sizes.max()), LOCAL_EPOCHS, BATCH_SIZE)
    cohort = make_cohort(train, ids, LOCAL_EPOCHS, BATCH_SIZE, rng, num_steps=steps)
    return cohort.client_ids, cohort.idx, cohort.mask, cohort.num_examples


def client_batches(idx: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
    """One client's real batches (``idx``/``mask`` ``[S, B]``): E·⌈n_k/B⌉ index arrays,
    padded steps and padded batch entries dropped."""
    out = []
    for row, m in zip(idx, mask, strict=True):
        keep = m > 0
        if keep.any():
            out.append(row[keep].astype(np.int64))
    return out


# ----------------------------------------------------------------------------- FLOPs
def layer_macs(model: str) -> list[tuple[str, int]]:
    """Multiply-accumulates per example of each matmul/conv layer, in order."""
    if model == "2nn":
        return [("dense1", 784 * 200), ("dense2", 200 * 200), ("dense3", 200 * 10)]
    if model == "cnn":
        return [
            ("conv1", 28 * 28 * 32 * (5 * 5 * 1)),  # 'same' conv: every output pixel
            ("conv2", 14 * 14 * 64 * (5 * 5 * 32)),
            ("dense1", 7 * 7 * 64 * 512),
            ("dense2", 512 * 10),
        ]
    raise ValueError(model)


def flops_per_example(model: str) -> dict[str, int]:
    """FLOPs of one training example (forward + backward), counting matmuls/convs only.

    A layer with M multiply-accumulates per example costs 2M FLOPs forward. Backward it
    costs 2M for the weight gradient plus 2M for the input gradient, except the first
    layer, whose input (the data) needs no gradient (PyTorch and JAX both skip it). So
    ``fwd = 2·ΣM`` and ``bwd = 2·ΣM + 2·Σ_{layers after the first} M``; the common
    "backward ≈ 2 x forward" convention (``total_3x``) overcounts by the first layer's
    input gradient. Bias adds, ReLU, pooling, softmax and the SGD update (2 FLOPs per
    parameter per step) are left out: they are memory-bound, not what a matmul peak
    measures, and small (the SGD update is ~4.5% of the 2NN's count, ~0.5% of the CNN's).

    2NN (784-200-200-10), M = 156,800 + 40,000 + 2,000 = 198,800:
      fwd = 397,600; bwd = 397,600 + 2·42,000 = 481,600; total = 879,200
      (3 x fwd = 1,192,800).
    CNN, M = conv1 28·28·32·25 = 627,200 + conv2 14·14·64·(25·32) = 10,035,200
      + fc 3136·512 = 1,605,632 + fc 512·10 = 5,120 = 12,273,152:
      fwd = 24,546,304; bwd = 24,546,304 + 2·11,645,952 = 47,838,208;
      total = 72,384,512 (3 x fwd = 73,638,912).
    A round of W processes 10 clients x 5 epochs x 600 = 30,000 examples:
      2NN 2.64e10 FLOPs (26.4 GFLOP), CNN 2.17e12 (2.17 TFLOP).
    """
    macs = [m for _, m in layer_macs(model)]
    fwd = 2 * sum(macs)
    bwd = 2 * sum(macs) + 2 * sum(macs[1:])
    return {"forward": fwd, "backward": bwd, "total": fwd + bwd, "total_3x": 3 * fwd}


def flops_per_round(model: str) -> int:
    return EXAMPLES_PER_ROUND * flops_per_example(model)["total"]


# ----------------------------------------------------------------------------- matmul peak
_PEAK_SCRIPT = r"""
import json, os, sys, time
import numpy as np
sizes, repeats = [int(s) for s in sys.argv[1].split(",")], int(sys.argv[2])
rng = np.random.default_rng(0)
best = {}
for n in sizes:
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # warm-up: thread pool start, page faults
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter(); a @ b; times.append(time.perf_counter() - t0)
    best[n] = 2 * n**3 / min(times)
info = {"numpy": np.__version__}
try:
    import threadpoolctl
    info["blas"] = threadpoolctl.threadpool_info()
except ImportError:
    try:
        cfg = np.show_config(mode="dicts")
        info["blas"] = cfg.get("Build Dependencies", {}).get("blas")
    except Exception:
        pass
print(json.dumps({"flops": max(best.values()), "by_size": best, "info": info}))
"""


def measure_matmul_peak(
    threads: int | None = None, sizes: Sequence[int] = (1024, 2048), repeats: int = 5
) -> dict[str, Any]:
    """Float32 matmul FLOP/s of this machine: NumPy ``n x n @ n x n`` (2n³ FLOPs), best of
    ``repeats`` for each size, best size; in a fresh subprocess, with ``threads`` BLAS
    threads (default: the BLAS default, all cores).

    OPENBLAS_CORETYPE (and OPENBLAS_L2_SIZE) are set on some of these machines because old
    OpenBLAS builds crash or compute wrong results on their processors; a current NumPy's
    OpenBLAS then picks a slower kernel. The peak is measured with both unset (for this
    subprocess only) so that it is the machine's, and the kernel actually used is recorded
    (``info.blas``, via threadpoolctl where installed).
    """
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    if threads is not None:
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = str(threads)
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, ",".join(map(str, sizes)), str(repeats)],
        env=env, check=True, capture_output=True, text=True,
    )
    result = json.loads(out.stdout)
    result["threads"] = threads
    result["unset"] = [k for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ]
    return result


# ----------------------------------------------------------------------------- /proc accounting
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = resource.getpagesize()


def _proc_table() -> dict[int, tuple[int, int, int]]:
    """pid -> (ppid, utime+stime+cutime+cstime in ticks, rss in bytes) of every process."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                raw = f.read()
        except OSError:  # the process ended meanwhile
            continue
        fields = raw[raw.rfind(b")") + 2 :].split()
        # fields[0] is field 3 (state) of proc(5): ppid 4, utime 14 .. cstime 17, rss 24.
        ppid = int(fields[1])
        ticks = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
        table[int(entry.name)] = (ppid, ticks, int(fields[21]) * _PAGE)
    return table


def _tree(table: dict[int, tuple[int, int, int]], root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            out.append(pid)
            todo.extend(children.get(pid, ()))
    return out


def _system_ticks() -> tuple[int, int]:
    """(busy, steal) ticks summed over all CPUs, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        parts = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (parts + [0] * 8)[:8]
    # guest time is already included in user/nice.
    return user + nice + system + irq + softirq, steal


def _pss_bytes(pid: int) -> int:
    """Proportional set size of ``pid`` (smaps_rollup): its private pages plus its share
    of each page it shares; 0 where the kernel has no smaps_rollup or the process ended."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_memory(root: int | None = None) -> tuple[int, int]:
    """(RSS, PSS) bytes summed over the process tree under ``root`` (default: this process),
    from one scan of /proc. PSS is the memory the tree holds, each shared page (a library's
    text, shared memory between a process and its workers) counted once in total rather
    than once per process as with RSS."""
    table = _proc_table()
    pids = _tree(table, os.getpid() if root is None else root)
    return sum(table[p][2] for p in pids), sum(_pss_bytes(p) for p in pids)


def tree_pss(root: int | None = None) -> int:
    """PSS summed over the process tree under ``root`` (see :func:`tree_memory`)."""
    return tree_memory(root)[1]


def tree_usage(root: int | None = None) -> tuple[int, int]:
    """(CPU ticks, RSS bytes) of the process tree under ``root`` (default: this process).

    CPU counts live processes' own and reaped children's time; RSS is the sum over live
    processes (shared pages counted once per process, as RSS does)."""
    table = _proc_table()
    pids = _tree(table, os.getpid() if root is None else root)
    return sum(table[p][1] for p in pids), sum(table[p][2] for p in pids)


class CpuSnapshot:
    """What the CPUs did up to now: wall clock, system busy and steal ticks, our ticks."""

    __slots__ = ("wall", "busy", "steal", "ours")

    def __init__(self):
        self.wall = time.perf_counter()
        self.busy, self.steal = _system_ticks()
        self.ours = tree_usage()[0]


def interval_cpu(a: CpuSnapshot, b: CpuSnapshot) -> dict[str, float]:
    """Between two snapshots: seconds, and cores used on average by us (this process
    tree), by other processes ('foreign' = system busy - ours, never below 0) and stolen
    by the hypervisor; ``disturbed`` when foreign + steal > ``DISTURBED_CORES``."""
    seconds = b.wall - a.wall
    ours = (b.ours - a.ours) / _CLK_TCK / seconds
    busy = (b.busy - a.busy) / _CLK_TCK / seconds
    steal = (b.steal - a.steal) / _CLK_TCK / seconds
    foreign = max(busy - ours, 0.0)
    return {
        "seconds": seconds,
        "our_cores": round(ours, 3),
        "foreign_cores": round(foreign, 3),
        "steal_cores": round(steal, 3),
        "disturbed": foreign + steal > DISTURBED_CORES,
    }


class RssMonitor:
    """Background thread sampling the RSS and the PSS of this process tree (sums over its
    processes) every ``interval`` seconds; ``peak_bytes`` is the largest RSS sample, or
    this process's own ``ru_maxrss`` if larger (exact for a single process; child
    processes are sampled); ``peak_pss_bytes`` the largest PSS sample. For one process the
    two agree up to its shared libraries; for several, the RSS sum counts every shared
    page once per process and PSS once in all."""

    def __init__(self, interval: float = 0.25):
        self.interval = interval
        self.peak_sampled = 0
        self.peak_pss_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-monitor")

    def _run(self):
        while not self._stop.is_set():
            try:
                rss, pss = tree_memory()
                self.peak_sampled = max(self.peak_sampled, rss)
                self.peak_pss_bytes = max(self.peak_pss_bytes, pss)
            except OSError:
                pass
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def peak_bytes(self) -> int:
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return max(self.peak_sampled, own)


class RoundClock:
    """Timestamps round boundaries: call ``mark()`` when the benchmark starts its first
    round and after each round has finished (results ready). Round i is the interval
    between marks i and i+1, with the CPU use of us and of others during it."""

    def __init__(self):
        self.marks: list[CpuSnapshot] = []

    def mark(self) -> None:
        self.marks.append(CpuSnapshot())

    def rounds(self) -> list[dict[str, float]]:
        return [interval_cpu(a, b) for a, b in zip(self.marks, self.marks[1:], strict=False)]


# ----------------------------------------------------------------------------- statistics
def timed_fedavg(model, lr: float):
    """FedAvg (client SGD at ``lr``, softmax cross-entropy) with a :class:`RoundClock` and an
    ``evaluate`` that only marks it once the round's model is ready: ``(algorithm, clock,
    evaluate)``, the timed setup of every fedax benchmark."""
    import jax
    import optax

    from fedax.algorithms import fedavg
    from fedax.models import softmax_cross_entropy

    def loss_fn(p, batch):
        return softmax_cross_entropy(model.apply(p, batch.x), batch.y, batch.mask)

    clock = RoundClock()

    def timing_evaluate(server_params):
        jax.block_until_ready(server_params)
        clock.mark()
        return 0.0, 0.0

    return fedavg(loss_fn, optax.sgd(lr)), clock, timing_evaluate


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Median/min/max seconds per round over the undisturbed measured rounds (all rounds,
    flagged ``all_disturbed``, when every one was disturbed), and rounds per hour."""
    kept = [r for r in rounds if not r.get("disturbed")]
    all_disturbed = bool(rounds) and not kept
    use = kept or rounds
    if not use:
        return {"rounds_total": 0, "rounds_kept": 0}
    s = [r["seconds"] for r in use]
    median = statistics.median(s)
    return {
        "s_per_round": {"median": median, "min": min(s), "max": max(s)},
        "rounds_per_hour": 3600.0 / median,
        "our_cores": statistics.median(r.get("our_cores", float("nan")) for r in use),
        "rounds_total": len(rounds),
        "rounds_kept": len(kept),
        "all_disturbed": all_disturbed,
    }


# ----------------------------------------------------------------------------- environment
def versions(*names: str) -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("numpy", *names):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cores": num_cores(),
        "cpu_count": os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS", "XLA_FLAGS"):
        if var in os.environ:
            info.setdefault("env", {})[var] = os.environ[var]
    return info


def jax_device_memory() -> dict[str, Any] | None:
    """The first JAX device's allocator figures (``peak_bytes_in_use``, ``bytes_in_use``,
    ``bytes_limit``, in bytes) since the process started; None where the backend keeps none
    (XLA:CPU)."""
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # a backend without allocator statistics
        return None
    if not stats:
        return None
    keys = ("peak_bytes_in_use", "bytes_in_use", "bytes_limit", "largest_alloc_size")
    return {k: int(stats[k]) for k in keys if k in stats}


def jax_device_info() -> dict[str, Any]:
    """JAX's backend and its first device (kind, platform), for a record."""
    import jax

    device = jax.devices()[0]
    return {"backend": jax.default_backend(), "device_kind": device.device_kind,
            "platform": device.platform, "device_count": jax.device_count()}


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def dated_result(directory: str | os.PathLike[str], stem: str) -> Path:
    """``<directory>/<stem>_<today>.json``, or ``..._<today>-2.json``, ``-3``... when that is
    taken: a benchmark's new result never replaces an earlier one of the same day."""
    today = _dt.date.today().isoformat()
    path = Path(directory) / f"{stem}_{today}.json"
    n = 1
    while path.exists():
        n += 1
        path = Path(directory) / f"{stem}_{today}-{n}.json"
    return path


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=_json_default) + "\n")


def _json_default(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def run_record(
    implementation: str,
    config: str,
    model: str,
    clock: RoundClock,
    warmup: int,
    rss: RssMonitor,
    *,
    train_losses: Sequence[float] = (),
    extra: dict[str, Any] | None = None,
    packages: Iterable[str] = (),
) -> dict[str, Any]:
    """The JSON record one benchmark process writes: its measured rounds (after
    ``warmup``), their summary, peak RSS, versions and machine."""
    all_rounds = clock.rounds()
    for r, loss in zip(all_rounds, train_losses, strict=False):
        r["train_loss"] = loss
    warm, measured = all_rounds[:warmup], all_rounds[warmup:]
    return {
        "implementation": implementation,
        "config": config,
        "model": model,
        "workload": WORKLOAD,
        "warmup_s": [r["seconds"] for r in warm],
        "rounds": measured,
        **summarize(measured),
        "peak_rss_mb": rss.peak_bytes / 2**20,
        "peak_pss_mb": rss.peak_pss_bytes / 2**20 or None,
        "versions": versions(*packages),
        "machine": machine_info(),
        "date": now_iso(),
        **(extra or {}),
    }


def finish(record: dict[str, Any], json_path: str | None) -> None:
    """Write ``record`` to ``json_path`` (if given) and print a one-line summary."""
    if json_path:
        write_json(json_path, record)
    s = record.get("s_per_round")
    if s:
        print(
            f"{record['implementation']} {record['config']} {record['model']}: "
            f"{s['median']:.3f} s/round (min {s['min']:.3f}, max {s['max']:.3f}; "
            f"{record['rounds_kept']}/{record['rounds_total']} rounds undisturbed), "
            f"peak RSS {record['peak_rss_mb']:.0f} MB, "
            f"PSS {record.get('peak_pss_mb') or 0:.0f} MB, warm-up {record['warmup_s']}"
        )
    for r in record.get("rounds", ()):
        print("  round", json.dumps(r))


def add_common_args(parser) -> None:
    parser.add_argument("model", choices=MODELS)
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=1, help="rounds run before measuring")
    parser.add_argument("--json", default=None, help="write the run's record here")


def add_process_args(parser) -> None:
    """``--procs`` (1 or 2 processes) and ``--threads`` (intra-op threads per process) of the
    PyTorch-based implementations; :func:`threads_per_process` resolves the default."""
    parser.add_argument("--procs", type=int, choices=(1, 2), default=1)
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads per process (default: cores for --procs 1, "
                             "else 1)")


def threads_per_process(args) -> int:
    return args.threads or (num_cores() if args.procs == 1 else 1)


# ----------------------------------------------------------------------------- tables
COLUMNS = (
    ("implementation", "implementation"),
    ("config", "configuration"),
    ("median", "s/round median"),
    ("min", "min"),
    ("max", "max"),
    ("rph", "rounds/h"),
    ("rss", "peak RSS MB"),
    ("pss", "peak PSS MB"),
    ("cores", "cores used"),
    ("peak", "% peak FLOP/s"),
    ("ratio", "x fedax"),
    ("kept", "rounds kept"),
)


def _fmt_seconds(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:.3g}" if v < 1 else f"{v:.2f}" if v < 100 else f"{v:.0f}"


def table_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    out = []
    for r in rows:
        s = r.get("s_per_round") or {}
        frac = r.get("fraction_of_peak")
        ratio = r.get("ratio_to_fedax")
        rss = r.get("peak_rss_mb")
        pss = r.get("peak_pss_mb")
        cores = r.get("our_cores")
        kept = "—" if "rounds_total" not in r else f"{r['rounds_kept']}/{r['rounds_total']}"
        if r.get("all_disturbed"):
            kept += " (all disturbed)"
        if r.get("error"):
            kept = f"FAILED: {r['error']}"
        out.append([
            r["implementation"],
            r["config"],
            _fmt_seconds(s.get("median")),
            _fmt_seconds(s.get("min")),
            _fmt_seconds(s.get("max")),
            "—" if not r.get("rounds_per_hour") else f"{r['rounds_per_hour']:.0f}",
            "—" if rss is None else f"{rss:.0f}",
            "—" if pss is None else f"{pss:.0f}",
            "—" if cores is None or math.isnan(cores) else f"{cores:.2f}",
            "—" if frac is None else f"{100 * frac:.1f}%",
            "—" if ratio is None else f"{ratio:.2f}",
            kept,
        ])
    return out


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    header = [title for _, title in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(rows)]
    return "\n".join(lines)


def text_table(rows: Sequence[dict[str, Any]]) -> str:
    header = [title for _, title in COLUMNS]
    body = table_rows(rows)
    widths = [max(len(c) for c in col) for col in zip(header, *body, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*cells) for cells in body]
    return "\n".join(lines)


def terminate_processes(procs: list, timeout: float = 10.0) -> None:
    """Terminate the ``psutil.Process`` es ``procs``; kill what is left after ``timeout``."""
    import psutil

    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
