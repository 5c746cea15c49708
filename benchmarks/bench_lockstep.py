"""Shakespeare FedAvg rounds: contiguous device blocks against balanced ones and lockstep.

    python benchmarks/bench_lockstep.py                     # 129 clients, E = 5, B = 10
    python benchmarks/bench_lockstep.py --torch .venv-bench/bin/python --json out.json
    python benchmarks/bench_lockstep.py --max-clients 40 --rounds 1   # toy
    python benchmarks/bench_lockstep.py --rounds 1 --no-lockstep      # the full round, CPU

The round of ``fedax reproduce fedavg-shakespeare``'s fastest cell: the natural partition
of the Folger text (1,294 roles), C = 0.1 (129 clients), E = 5, B = 10, the paper's
char-LSTM, client SGD lr 1.47, n_k-weighted mean. One cohort (round 0's sample and
batches, as the runner makes them) is fed again and again to each compiled round, so every
configuration runs exactly the same client steps. Configurations, alternated in every
repeat, each over the host's cores as XLA devices (one per core):

- ``sequential contiguous``: fedax before balancing: the cohort cut into contiguous
  blocks, one per device, each device running its clients one after another;
- ``sequential balanced``: fedax's default now: blocks of equal count and near-equal
  steps (``fedax.federated._lockstep``);
- ``lockstep W``: balanced blocks, and on each device clients sorted by steps and run in
  vectorized groups of W that stop at their longest client;
- ``vmap`` (``--vmap``): every client padded to the cohort's longest (slow; the form
  lockstep replaces on accelerators);
- ``processes`` (``--processes``): the clients in one single-threaded worker process per
  core, blocks balanced by steps (the CPU default for convolutional models).

For each, seconds per round (median), client steps per second (the cohort's real local
steps over the round's time) and the largest difference of the new model from the
contiguous one's, beside the *rounding floor*: the contiguous round again from an initial
model nudged by 1e-7 (relative). At lr 1.47 a client of 80 steps is chaotic (a nudge of
1e-7 moves its model by up to 7 in a parameter), so any change of float order, as
lockstep's batched products make, can move the round's model that far.

Per-device busy time comes from the devices themselves: a host callback
when a device starts its block and one when it has its block's outputs (``--no-busy`` to
skip); the ideal round is the busy time summed over devices divided by their number, and
``x ideal`` is the round's time over it.

``--torch PYTHON``: the same clients trained by PyTorch's ``nn.LSTM`` one after another in
one process using every core (its natural use; ``nn.LSTM`` holds one set of weights, so
clients cannot be batched into one call), and in one single-threaded process per core
taking balanced halves (``--torch-procs``), each client from the same starting weights.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from bench_fedax import split_host  # noqa: E402

VOCAB, EMBED, HIDDEN, LAYERS = 98, 8, 256, 2
LR, EPOCHS, BATCH, FRACTION = 1.47, 5, 10, 0.1


def cohort_arrays(max_clients: int | None, seed: int, epochs: int = EPOCHS):
    """Round 0's cohort of the natural partition: ``(x [C,S,B,T], y, mask [C,S,B], n [C],
    ids [C])`` as the runner's source makes it (sample, per-client shuffle streams)."""
    import numpy as np

    from fedax.data import ClientData, load_shakespeare, make_cohort, sample_clients

    data = load_shakespeare(max_clients=max_clients, seed=seed)
    train = ClientData.from_partition(data["x_train"], data["y_train"],
                                      data["train_partition"])
    ids = sample_clients(np.random.default_rng([seed, 0]), train.num_clients, FRACTION)
    cohort = make_cohort(train, ids, epochs, BATCH, 0, client_streams=(seed, 0))
    x = data["x_train"][cohort.idx]
    y = data["y_train"][cohort.idx]
    return x, y, cohort.mask, cohort.num_examples, cohort.client_ids


def fedax_part(args, arrays) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from fedax import federated as fed
    from fedax.algorithms import CohortBatches, fedavg
    from fedax.client import Batches
    from fedax.federated import _map
    from fedax.models import char_lstm
    from fedax.models.losses import token_cross_entropy
    from fedax.simulation import Execution, use_execution
    from fedax.simulation.host import compiler_options, cpu_dots_for

    x, y, mask, n, ids = arrays
    devices = jax.device_count()
    pad = -len(n) % devices
    if pad:  # empty clients, as the runner pads
        x, y, mask = (np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)])
                      for a in (x, y, mask))
        n = np.concatenate([n, np.zeros(pad, n.dtype)])
        ids = np.concatenate([ids, np.zeros(pad, ids.dtype)])
    cohort = CohortBatches(Batches(jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask)),
                           jnp.asarray(n), jnp.asarray(ids))
    steps = np.asarray(Batches(x, y, mask).client_steps())
    model = char_lstm(VOCAB, EMBED, HIDDEN, LAYERS)

    def loss(p, b):
        return token_cross_entropy(model.apply(p, b.x), b.y, b.mask)

    alg = fedavg(loss, optax.sgd(LR))
    params = jax.jit(model.init)(jax.random.key(args.seed))
    state0 = alg.init(params, None)
    options = compiler_options(dots=cpu_dots_for("char_lstm"))

    stamps: list[tuple[str, int, float]] = []
    original = _map._map_local

    def timed_map_local(f, xs, strategy, same_rows=None):  # per-device busy, from the device
        i = jax.lax.axis_index(fed.CLIENTS_AXIS)
        first = jax.tree.leaves(xs)[0]
        jax.debug.callback(lambda i, _: stamps.append(("start", int(i), time.perf_counter())),
                           i, first.reshape(-1)[0])
        out = original(f, xs, strategy, same_rows)
        last = jax.tree.leaves(out)[0]
        jax.debug.callback(lambda i, _: stamps.append(("end", int(i), time.perf_counter())),
                           i, last.reshape(-1)[0])
        return out

    configs = [("sequential contiguous", "sequential", False),
               ("sequential balanced", "sequential", True)]
    if not args.no_lockstep:
        configs.append((f"lockstep {args.width}", "lockstep", True))
    if args.processes:
        configs.append(("processes (balanced workers)", "processes", True))
    if args.vmap:
        configs.append(("vmap", "vmap", True))
    compiled = {}
    for name, map_, balanced in configs:
        execution = Execution(map_, "scan", devices)
        if not args.no_busy and execution.mesh() is not None:
            _map._map_local = timed_map_local
        try:
            with _on_mesh(execution), \
                    use_execution(execution), fed.balance_devices(balanced), \
                    fed.lockstep_width(args.width):
                started = time.perf_counter()
                fn = jax.jit(lambda s, c: alg.round(s, c, None)[0].server.params,
                             compiler_options=options).lower(state0, cohort).compile()
                out = jax.block_until_ready(fn(state0, cohort))
                compiled[name] = (fn, execution, balanced, time.perf_counter() - started, out)
        finally:
            _map._map_local = original
    reference = compiled["sequential contiguous"][4]
    # How far rounding alone can carry this round: the contiguous round again from the
    # initial model moved by 1e-7 (relative) noise. At lr 1.47 a Shakespeare client of 80
    # steps is chaotic: such a nudge moves its model by O(1-100), as far as any change of
    # float order (another strategy) can.
    leaves, tree = jax.tree.flatten(params)
    noise = jax.random.split(jax.random.key(args.seed + 1), len(leaves))
    nudged = jax.tree.unflatten(tree, [a * (1 + 1e-7 * jax.random.normal(k, a.shape, a.dtype))
                                       for a, k in zip(leaves, noise, strict=True)])
    fn, execution, *_ = compiled["sequential contiguous"]
    with _on_mesh(execution):
        floor_out = jax.block_until_ready(fn(alg.init(nudged, None), cohort))
    rounding_floor = _max_diff(floor_out, reference)
    times: dict[str, list[float]] = {name: [] for name, *_ in configs}
    busy: dict[str, list[list[float]]] = {name: [] for name, *_ in configs}
    for r in range(args.rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for name, *_ in order:
            fn, execution, balanced, _, _ = compiled[name]
            stamps.clear()
            with _on_mesh(execution):
                started = time.perf_counter()
                jax.block_until_ready(fn(state0, cohort))
                times[name].append(time.perf_counter() - started)
            per_device = _busy(stamps, devices)
            if per_device:
                busy[name].append(per_device)
    total_steps = int(steps.sum())
    rows = []
    for name, _, balanced in configs:
        fn, execution, _, first_s, out = compiled[name]
        median = statistics.median(times[name])
        diff = _max_diff(out, reference)
        row = {"config": name, "execution": execution._asdict(), "balanced": balanced,
               "s_per_round": {"median": median, "min": min(times[name]),
                               "max": max(times[name]), "all": times[name]},
               "client_steps_per_s": total_steps / median,
               "compile_and_first_s": first_s, "max_abs_diff_vs_contiguous": diff}
        if busy[name]:
            sums = [statistics.median(b[d] for b in busy[name]) for d in range(devices)]
            ideal = sum(sums) / devices
            row["busy_s_per_device"] = sums
            row["ideal_s"] = ideal
            row["x_ideal"] = median / ideal
            row["busiest_over_mean"] = max(sums) / ideal
        rows.append(row)
    contiguous_blocks = steps.reshape(devices, -1).sum(axis=1).tolist()
    perm = np.asarray(fed._lockstep.balanced_permutation(jnp.asarray(steps), devices))
    balanced_blocks = steps[perm].reshape(devices, -1).sum(axis=1).tolist()
    return {"rows": rows, "devices": devices, "clients": int((n > 0).sum()),
            "max_abs_diff_from_1e-7_nudge": rounding_floor,
            "steps": {"total": total_steps, "max": int(steps.max()),
                      "median": float(np.median(steps[n > 0])), "padded_to": int(x.shape[1])},
            "block_steps": {"contiguous": contiguous_blocks, "balanced": balanced_blocks}}


def _max_diff(a, b) -> float:
    import jax
    import jax.numpy as jnp

    return max(float(jnp.max(jnp.abs(u - v)))
               for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _busy(stamps, devices: int) -> list[float]:
    starts = {i: t for kind, i, t in stamps if kind == "start"}
    ends = {i: t for kind, i, t in stamps if kind == "end"}
    if len(starts) < devices or len(ends) < devices:
        return []
    return [ends[d] - starts[d] for d in range(devices)]


def _on_mesh(execution):
    import jax

    mesh = execution.mesh()
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def torch_worker(path: str, threads: int, part: int, parts: int) -> None:
    """Train this worker's share of the cohort in ``path`` (npz) with ``nn.LSTM``; print
    the seconds and the steps taken as JSON."""
    import numpy as np
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    z = np.load(path)
    x, y, mask, mine = z["x"], z["y"], z["mask"], z["assign"] == part

    class CharLSTM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, EMBED)
            self.lstm = torch.nn.LSTM(EMBED, HIDDEN, num_layers=LAYERS, batch_first=True)
            self.out = torch.nn.Linear(HIDDEN, VOCAB)

        def forward(self, t):
            return self.out(self.lstm(self.embed(t))[0])

    model = CharLSTM()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    xs = torch.from_numpy(x.astype(np.int64))
    ys = torch.from_numpy(y.astype(np.int64))
    ms = torch.from_numpy(mask)
    taken = 0
    began = time.perf_counter()
    for c in np.flatnonzero(mine):
        model.load_state_dict(start)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for s in range(x.shape[1]):
            m = ms[c, s]
            if not bool(m.any()):
                break
            logits = model(xs[c, s])
            per = torch.nn.functional.cross_entropy(
                logits.reshape(-1, VOCAB), ys[c, s].reshape(-1), reduction="none")
            per = per.reshape(m.shape[0], -1) * m[:, None]
            lossv = per.sum() / (m.sum() * per.shape[1])
            opt.zero_grad()
            lossv.backward()
            opt.step()
            taken += 1
    print(json.dumps({"s": time.perf_counter() - began, "steps": taken}))


def torch_part(python: str, arrays, procs: list[int], repeats: int) -> list[dict]:
    import numpy as np

    x, y, mask, n, _ = arrays
    steps = (mask.reshape(*mask.shape[:2], -1) > 0).any(-1).sum(-1)
    cores = common.num_cores()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in procs:
            assign = np.zeros(len(n), np.int64)
            if p > 1:  # balanced shares, the serpentine deal fedax uses
                order = np.argsort(-steps, kind="stable")
                rnd, j = np.arange(len(n)) // p, np.arange(len(n)) % p
                assign[order] = np.where(rnd % 2 == 0, j, p - 1 - j)
            path = os.path.join(tmp, f"cohort{p}.npz")
            np.savez(path, x=x, y=y, mask=mask, assign=assign)
            threads = cores if p == 1 else 1
            times = []
            for _ in range(repeats):
                began = time.perf_counter()
                workers = [subprocess.Popen(
                    [python, __file__, "--torch-worker", path, str(threads), str(i), str(p)],
                    stdout=subprocess.PIPE, text=True) for i in range(p)]
                outs = [json.loads(w.communicate()[0].strip().splitlines()[-1])
                        for w in workers]
                # the slowest worker's training time: process start-up is not the round's
                times.append(max(o["s"] for o in outs))
                del began
            median = statistics.median(times)
            rows.append({"config": f"pytorch nn.LSTM, {p} proc x {threads} thread(s)",
                         "s_per_round": {"median": median, "min": min(times),
                                         "max": max(times), "all": times},
                         "client_steps_per_s": int(steps.sum()) / median})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds a config")
    parser.add_argument("--max-clients", type=int, default=None, help="roles kept (toy)")
    parser.add_argument("--width", type=int, default=16, help="lockstep group width")
    parser.add_argument("--vmap", action="store_true", help="also plain vmap (slow)")
    parser.add_argument("--processes", action="store_true",
                        help="also the processes strategy (one single-threaded worker a core)")
    parser.add_argument("--no-lockstep", action="store_true",
                        help="leave lockstep out (on a CPU it takes ~9x sequential's time)")
    parser.add_argument("--no-busy", action="store_true", help="no per-device stamps")
    parser.add_argument("--torch", default=None, metavar="PYTHON",
                        help="a python with torch, to time nn.LSTM on the same clients")
    parser.add_argument("--torch-procs", default="1,2", help="PyTorch process counts")
    parser.add_argument("--torch-worker", nargs=4, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=EPOCHS, help="E (toy runs: 1)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.torch_worker:
        path, threads, part, parts = args.torch_worker
        torch_worker(path, int(threads), int(part), int(parts))
        return 0
    cores = common.num_cores()
    from fedax.cli.processes import with_collective_patience

    split_host(cores)
    # contiguous blocks of skewed clients keep one device at the sum for minutes
    os.environ["XLA_FLAGS"] = with_collective_patience(os.environ["XLA_FLAGS"])
    arrays = cohort_arrays(args.max_clients, args.seed, args.epochs)
    record = {"benchmark": "bench_lockstep", "time": common.now_iso(),
              "machine": common.machine_info(), "args": vars(args),
              "workload": {"dataset": "shakespeare", "partition": "natural",
                           "client_fraction": FRACTION, "local_epochs": args.epochs,
                           "batch_size": BATCH, "client_lr": LR, "model": "char_lstm"},
              "versions": common.versions("jax", "jaxlib", "optax")}
    record.update(fedax_part(args, arrays))
    if args.torch:
        procs = [int(p) for p in args.torch_procs.split(",")]
        record["torch"] = torch_part(args.torch, arrays, procs, args.rounds)
    base = record["rows"][0]["s_per_round"]["median"]
    print(f"{record['clients']} clients, {record['steps']['total']} real steps "
          f"(max {record['steps']['max']}, padded to {record['steps']['padded_to']}); "
          f"block steps contiguous {record['block_steps']['contiguous']}, balanced "
          f"{record['block_steps']['balanced']}")
    for row in record["rows"] + record.get("torch", []):
        s = row["s_per_round"]["median"]
        extra = ""
        if "x_ideal" in row:
            extra = (f"  busy {[round(b, 2) for b in row['busy_s_per_device']]}  "
                     f"x ideal {row['x_ideal']:.3f}")
        if "max_abs_diff_vs_contiguous" in row:
            extra += f"  |diff| {row['max_abs_diff_vs_contiguous']:.1e}"
        print(f"{row['config']:<40} {s:8.2f} s/round  {row['client_steps_per_s']:7.1f} "
              f"client-steps/s  {base / s:5.2f}x{extra}")
    print(f"rounding floor: a 1e-7 relative nudge of the initial model moves the contiguous "
          f"round's model by up to {record['max_abs_diff_from_1e-7_nudge']:.1e}; a |diff| "
          "below it is float order, not a defect")
    if args.json:
        common.write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
