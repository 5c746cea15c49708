"""A round whose clients' updates are summed as they are made, against stacked then summed.

    python benchmarks/bench_fused_sum.py                      # K = 1,000
    python benchmarks/bench_fused_sum.py --per-round 5000 --json out.json

Under ``sequential`` a FedAvg round with a linear aggregator (``mean``, the default) runs
``fed.map_and_sum``: each client's weighted update goes up as the client finishes and
joins the server's running total in the loop's carry, so no ``[K, P]`` stack of updates is
built (``fedax.algorithms.protocol.fused_cohort_round``). Three forms of the same round,
compiled in this process and run alternately:

- ``fused``: the default (0.5.0): summed as made; over several devices, whether balanced
  devices move clients is decided on the host from the round's steps, as the runner does
  (``_lockstep.decided_moves``);
- ``stacked``: the same with ``fed.fuse_sums(False)``: the K updates stacked, then one
  federated sum;
- ``0.4.0``: stacked, and the move decided in the program (a ``lax.cond`` per moved
  argument), which is what every round did before.

The workload is ``cross_device.py``'s (10,000 MNIST clients of 20-100 examples, 2NN,
E = 1, B = 10), K clients a round, over the host's cores as XLA devices (as the ``fedax``
command splits the host):

- ``round``: the round;
- ``round_no_steps``: the same program on the same cohort with every mask zero (no client
  takes a step): what the round costs besides the clients' steps, which fusing targets.

For each: seconds (median of ``--repeats``), the compiled program's temporary memory
(``memory_analysis``), fused's speedup over each other form, and the largest difference
of their models (float order only).
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

# name: (fuse_sums, moves decided on the host)
FORMS = {"fused": (True, True), "stacked": (False, True), "0.4.0": (False, False)}


def _compiled(fn, args, fused: bool, moves: bool | None):
    import jax

    from fedax import federated as fed
    from fedax.federated import _lockstep

    with fed.fuse_sums(fused), _lockstep.decided_moves(moves):
        # a new function object each time, and the contexts are part of jit's cache key
        compiled = jax.jit(lambda *a: fn(*a)).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    return compiled


def compare(name: str, fn, args, repeats: int, moves: bool) -> dict:
    """The forms of ``fn(*args)`` (a pytree of arrays), timed alternately; ``moves``: the
    host's decision for the balanced devices (``_lockstep.worth_moving_host``)."""
    import jax
    import numpy as np

    forms = {k: _compiled(fn, args, fuse, moves if decided else None)
             for k, (fuse, decided) in FORMS.items()}
    names = list(forms)
    times: dict[str, list[float]] = {k: [] for k in forms}
    for r in range(repeats):
        for k in (names if r % 2 == 0 else names[::-1]):
            started = time.perf_counter()
            jax.block_until_ready(forms[k](*args))
            times[k].append(time.perf_counter() - started)
    outs = {k: jax.tree.leaves(forms[k](*args)) for k in forms}
    row: dict = {"part": name}
    for k, c in forms.items():
        row[k] = {"s_median": statistics.median(times[k]), "s_all": times[k],
                  "temp_bytes": c.memory_analysis().temp_size_in_bytes}
    for k in names[1:]:
        row[f"fused_x_faster_than_{k}"] = row[k]["s_median"] / row["fused"]["s_median"]
        row[f"fused_x_less_temp_than_{k}"] = (row[k]["temp_bytes"]
                                              / max(row["fused"]["temp_bytes"], 1))
        row[f"max_abs_diff_{k}"] = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(outs["fused"], outs[k], strict=True))
    parts = [f"{k} {row[k]['s_median']:.3f} s ({row[k]['temp_bytes'] / 1e6:.0f} MB temp)"
             for k in names]
    ratios = [f"{row[f'fused_x_faster_than_{k}']:.2f}x {k}" for k in names[1:]]
    print(f"{name:<15} " + ", ".join(parts) + ": fused " + ", ".join(ratios)
          + f"; max |diff| {max(row[f'max_abs_diff_{k}'] for k in names[1:]):.1e}",
          flush=True)
    return row


def main(argv=None) -> int:
    parser = cd.round_parser(__doc__)
    parser.add_argument("--no-balance", action="store_true",
                        help="devices keep contiguous blocks (fed.balance_devices(False))")
    args = parser.parse_args(argv)
    split_host(common.num_cores())

    import jax
    import jax.numpy as jnp

    from fedax import federated as fed
    from fedax.federated._lockstep import worth_moving_host
    from fedax.simulation import use_execution

    k = args.per_round
    execution, model, params, data, cohort = cd.first_round(k, args.clients)
    mask = cohort.batches.mask
    idle = cohort._replace(batches=cohort.batches._replace(mask=jnp.zeros_like(mask)))
    alg, _, _ = common.timed_fedavg(model, cd.CLIENT_LR)
    rows = []
    with jax.set_mesh(execution.mesh()), use_execution(execution), \
            fed.balance_devices(not args.no_balance):
        state = alg.init(params, None)

        def round_(s, c):
            return alg.round(s, c, None)[0].server.params

        moves = worth_moving_host(data.steps, execution.devices)
        rows.append(compare("round", round_, (state, cohort), args.repeats, moves))
        rows.append(compare("round_no_steps", round_, (state, idle), args.repeats, moves))
    record = cd.round_record("bench_fused_sum", execution, k, rows,
                             balance_devices=not args.no_balance, forms=FORMS)
    if args.json:
        common.write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
