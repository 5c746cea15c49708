"""Where a cross-device round's time goes (fedax, the CPU default), one process.

    python benchmarks/profile_cross_device.py --per-round 1000 --json out.json

The workload of ``cross_device.py`` (10,000 MNIST clients of 20-100 examples, 2NN, FedAvg
E = 1, B = 10, lr 0.05), K clients a round over the host's cores as XLA devices
(``sequential:scan`` on each, as fedax's default). Each part is timed on its own, medians of
``--repeats``:

- ``host_cohort_s``: the runner's host side of a round (``PartitionSource.round_data``:
  sampling, each client's own shuffle stream, the ``[K, S, B]`` index batches);
- ``round_s``: the compiled round (``alg.round`` on the cohort's features, already on the
  device): broadcast, K clients' local steps, the weighted mean, the server update;
- ``round_no_steps_s``: the same program on the same cohort with every mask zero: no client
  takes a step, everything else (the model placed at K clients, each client's program
  entered and its update stacked, the weighted mean) still runs;
- ``steps_s`` = round_s - round_no_steps_s, and ``ms_per_step`` over the cohort's real
  steps, against ``ms_per_step_big_clients``: the same model and devices with 10 clients of
  600 examples (workload W's clients, E = 1: 60 steps each), a step's cost when clients
  are large.

Prints each part's share of (host + round) and writes the record with ``--json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import cross_device as cd  # noqa: E402
from bench_fedax import split_host  # noqa: E402


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _no_steps(cohort):
    """The cohort with every mask zero: no client takes a step."""
    import jax.numpy as jnp

    batches = cohort.batches
    return cohort._replace(batches=batches._replace(mask=jnp.zeros_like(batches.mask)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-round", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=cd.NUM_CLIENTS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-balance", action="store_true",
                        help="contiguous device blocks (fedax.federated.balance_devices(False))")
    args = parser.parse_args(argv)
    cores = common.num_cores()
    split_host(cores)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from fedax import federated as fed
    from fedax.algorithms import CohortBatches
    from fedax.client import Batches
    from fedax.models import get_model
    from fedax.simulation import Execution, use_execution
    from fedax.simulation.host import compiler_options
    from fedax.simulation.sources import PartitionSource

    train, x_all, y_all = cd.load_population(args.clients)
    execution = Execution("sequential", "scan", jax.device_count()).validate()
    source = PartitionSource(train, args.per_round / args.clients, cd.LOCAL_EPOCHS,
                             cd.BATCH_SIZE, seed=cd.SEED)
    host_s = _median_time(lambda: source.round_data(0, execution.devices), args.repeats)
    data = source.round_data(0, execution.devices)
    idx, mask = data.sharded
    n, ids = data.plain
    model = get_model(cd.MODEL)
    params = jax.jit(model.init)(jax.random.key(cd.SEED))

    alg, _, _ = common.timed_fedavg(model, cd.CLIENT_LR)
    state = alg.init(params, None)

    def cohort(idx, mask, n, ids):
        return CohortBatches(Batches(jnp.asarray(x_all[idx]), jnp.asarray(y_all[idx]),
                                     jnp.asarray(mask)), jnp.asarray(n), jnp.asarray(ids))

    with jax.set_mesh(execution.mesh()), use_execution(execution), \
            fed.balance_devices(not args.no_balance):
        fn = jax.jit(lambda s, c: alg.round(s, c, None)[0].server.params,
                     compiler_options=compiler_options())
        full = cohort(idx, mask, n, ids)
        empty = _no_steps(full)
        compiled = fn.lower(state, full).compile()
        jax.block_until_ready(compiled(state, full))
        round_s = _median_time(lambda: jax.block_until_ready(compiled(state, full)), args.repeats)
        no_steps_s = _median_time(lambda: jax.block_until_ready(compiled(state, empty)),
                                  args.repeats)
        steps = int(np.asarray(full.batches.client_steps()).sum())
        # W's clients: 10 of 600 examples, E = 1 (60 steps each), the same devices
        rng = np.random.default_rng(0)
        big_ids = rng.choice(len(x_all), size=(10, 60, 10))
        pad = -10 % execution.devices
        big_mask = np.ones((10 + pad, 60, 10), np.float32)
        big_mask[10:] = 0
        big_idx = np.concatenate([big_ids, np.zeros((pad, 60, 10), big_ids.dtype)])
        big = cohort(big_idx, big_mask, np.full(10 + pad, 600.0, np.float32),
                     np.arange(10 + pad, dtype=np.int32))
        big_fn = fn.lower(state, big).compile()
        jax.block_until_ready(big_fn(state, big))
        big_s = _median_time(lambda: jax.block_until_ready(big_fn(state, big)), args.repeats)
        big_empty = _no_steps(big)
        big_none_s = _median_time(lambda: jax.block_until_ready(big_fn(state, big_empty)),
                                  args.repeats)
    steps_s = round_s - no_steps_s
    total = host_s + round_s
    record = {
        "benchmark": "profile_cross_device", "time": common.now_iso(),
        "machine": common.machine_info(), "versions": common.versions("jax", "jaxlib"),
        "per_round": args.per_round, "clients": args.clients, "devices": execution.devices,
        "execution": execution._asdict(), "balanced": not args.no_balance,
        "real_steps": steps,
        "padded_shape": list(idx.shape),
        "host_cohort_s": host_s, "round_s": round_s, "round_no_steps_s": no_steps_s,
        "steps_s": steps_s, "ms_per_step": 1000 * steps_s / steps,
        "ms_per_step_big_clients": 1000 * (big_s - big_none_s) / 600,
        "shares": {"host_cohort": host_s / total, "no_step_part": no_steps_s / total,
                   "steps": steps_s / total},
    }
    print(f"K = {args.per_round}: {steps} real steps, padded [K, S, B] = {list(idx.shape)}")
    print(f"host cohort   {host_s:7.3f} s  ({100 * host_s / total:4.1f}%)")
    print(f"round, no steps {no_steps_s:5.3f} s  ({100 * no_steps_s / total:4.1f}%)")
    print(f"client steps  {steps_s:7.3f} s  ({100 * steps_s / total:4.1f}%), "
          f"{record['ms_per_step']:.3f} ms a step against "
          f"{record['ms_per_step_big_clients']:.3f} ms with W's 600-example clients")
    if args.json:
        common.write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
