"""The sequential client map reading a broadcast argument once against row by row.

    python benchmarks/bench_broadcast_rows.py                 # K = 1,000, 2NN-sized model
    python benchmarks/bench_broadcast_rows.py --per-round 5000 --json out.json

``map_clients`` under ``sequential`` reads an argument that ``fed.broadcast`` made as its
first row (``fedax.federated._map._sequential``), so XLA never builds the model's
``[K, ...]`` copy; the baseline is the same program with the detection switched off while
tracing (``_primitives.broadcast_source`` answering None), i.e. the row-by-row map. Both
are compiled in this process and their rounds alternated, over the host's cores as XLA
devices (as the ``fedax`` command splits the host):

- ``map``: ``fed.mean(map_clients(f, broadcast(model, K), x))`` with a step-free client
  (the model's 199,210 floats scaled by a sum of its data): the map alone;
- ``round``: the cross-device FedAvg round (``cross_device.py``'s workload: 10,000 MNIST
  clients of 20-100 examples, 2NN, E = 1, B = 10), K clients a round.

Devices keep contiguous blocks (``balance_devices(False)``) in both forms, so that only
the reading of the broadcast differs. For each: seconds (median of ``--repeats``), the
compiled program's temporary memory (``memory_analysis``), and the ratio row-by-row /
read-once.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import cross_device as cd  # noqa: E402
from bench_fedax import split_host  # noqa: E402


def _compiled(fn, args, read_once: bool):
    import jax

    from fedax.federated import _primitives

    original = _primitives.broadcast_source
    if not read_once:
        _primitives.broadcast_source = lambda leaf: None
    try:
        # a new function object each time: jit's tracing cache would hand back the first
        # form's program for the second
        compiled = jax.jit(lambda *a: fn(*a)).lower(*args).compile()
    finally:
        _primitives.broadcast_source = original
    jax.block_until_ready(compiled(*args))
    return compiled


def _compare(name: str, fn, args, repeats: int) -> dict:
    import jax

    forms = {"read once": _compiled(fn, args, True), "row by row": _compiled(fn, args, False)}
    times: dict[str, list[float]] = {k: [] for k in forms}
    for r in range(repeats):
        for k in (list(forms) if r % 2 == 0 else list(forms)[::-1]):
            started = time.perf_counter()
            jax.block_until_ready(forms[k](*args))
            times[k].append(time.perf_counter() - started)
    row = {"part": name}
    for k, c in forms.items():
        row[k] = {"s_median": statistics.median(times[k]), "s_all": times[k],
                  "temp_bytes": c.memory_analysis().temp_size_in_bytes}
    row["x_faster"] = row["row by row"]["s_median"] / row["read once"]["s_median"]
    row["x_less_temp"] = row["row by row"]["temp_bytes"] / max(row["read once"]["temp_bytes"], 1)
    print(f"{name:<6} read once {row['read once']['s_median']:.3f} s "
          f"({row['read once']['temp_bytes'] / 1e6:.0f} MB temp), row by row "
          f"{row['row by row']['s_median']:.3f} s ({row['row by row']['temp_bytes'] / 1e6:.0f} "
          f"MB temp): {row['x_faster']:.2f}x faster, {row['x_less_temp']:.2f}x less temp",
          flush=True)
    return row


def main(argv=None) -> int:
    parser = cd.round_parser(__doc__)
    args = parser.parse_args(argv)
    split_host(common.num_cores())

    import jax
    import jax.numpy as jnp

    from fedax import federated as fed
    from fedax.simulation import use_execution

    k = args.per_round
    execution, model, params, _, cohort = cd.first_round(k, args.clients)
    rows = []
    # balance_devices(False): moving clients between devices (off in both forms) would
    # otherwise move the row-by-row form's model copy too
    with jax.set_mesh(execution.mesh()), use_execution(execution), fed.balance_devices(False):
        def bare(p, x):
            out = fed.map_clients(
                lambda q, xx: jax.tree.map(lambda a: a * jnp.sum(xx) - a, q),
                fed.broadcast(p, k), x)
            return fed.mean(out)

        rows.append(_compare("map", bare, (params, jnp.ones((k, 10))), args.repeats))

        alg, _, _ = common.timed_fedavg(model, cd.CLIENT_LR)
        state = alg.init(params, None)
        rows.append(_compare("round", lambda s, c: alg.round(s, c, None)[0].server.params,
                             (state, cohort), args.repeats))
    record = cd.round_record("bench_broadcast_rows", execution, k, rows)
    if args.json:
        common.write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
