"""What a compressed uplink costs: each compressor against the plain weighted mean, for a
cohort of 10 and of 100 clients, in one run.

    flock /tmp/fedax-bench.lock python benchmarks/bench_compression.py --out benchmarks/results

MNIST 2NN (199,210 parameters), IID clients × 600 examples (``fedax.data.iid(60000, 100,
0)``), E = 1, B = 50 (12 local steps a client), client SGD lr 0.05. Per cohort size C and
variant, two timings:

* ``round``: one compiled FedAvg round (``jax.jit(alg.round)``, state donated, clients
  mapped ``sequential``, local steps ``scan``, fedax's CPU compiler options, as
  ``bench_dp.py``), the local training included;
* ``aggregate``: the aggregator alone (``aggregators.aggregate`` on fixed client-placed
  updates of the 2NN's shape, weights n_k): encode on every client, collect, decode and
  average, against ``aggregators.mean()``.

Variants: ``plain`` (``mean()``), ``float16``, ``bfloat16``, ``int8``, ``qsgd s=7`` (4 bits),
``qsgd s=1`` (2 bits), ``rotation b=4``, ``rotation b=1``, ``top_k 1%`` and ``top_k 1% + EF``
(``algorithms.error_feedback``: the residual table as per-client state; the client
computes C(p) once more to update it). Samples alternate between variants (order reversed
every other repetition); per variant the median seconds and its ratio to ``plain``'s
(``x plain``) and the median of each repetition's paired ratio (``paired``), as in
``bench_dp.py``. Real MNIST from fedax's cache; without it, random data of the same shape.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from bench_dp import load_data  # noqa: E402

EXAMPLES_PER_CLIENT = 600
EPOCHS = 1
BATCH = 50
LR = 0.05
VARIANTS = ("plain", "float16", "bfloat16", "int8", "qsgd s=7", "qsgd s=1", "rotation b=4",
            "rotation b=1", "top_k 1%", "top_k 1% + EF")


def compressor_of(name: str):
    from fedax import aggregators as agg

    return {"float16": agg.cast("float16"), "bfloat16": agg.cast("bfloat16"),
            "int8": agg.cast("int8"), "qsgd s=7": agg.qsgd(7), "qsgd s=1": agg.qsgd(1),
            "rotation b=4": agg.rotation(4), "rotation b=1": agg.rotation(1),
            "top_k 1%": agg.top_k(0.01), "top_k 1% + EF": agg.top_k(0.01)}.get(name)


def make_algorithm(name: str, loss_fn, clients: int):
    import optax

    from fedax.aggregators import compressed, mean
    from fedax.algorithms import fedavg
    from fedax.algorithms.error_feedback import error_feedback

    comp = compressor_of(name)
    alg = fedavg(loss_fn, optax.sgd(LR),
                 aggregator=mean() if comp is None else compressed(comp))
    return error_feedback(alg, comp, clients) if name.endswith("EF") else alg


def time_samples(names, run_one, repeats):
    samples = {n: [] for n in names}
    for rep in range(repeats):
        for name in (names if rep % 2 == 0 else names[::-1]):
            before = common.CpuSnapshot()
            run_one(name)
            samples[name].append(common.interval_cpu(before, common.CpuSnapshot()))
    return samples


def summarize(names, samples, per):
    rows = []
    plain = [s["seconds"] / per for s in samples["plain"]]
    for name in names:
        for s in samples[name]:
            s["seconds"] /= per
        summary = common.summarize(samples[name])
        rows.append({"variant": name, "samples": samples[name], **summary})
    base = rows[0]["s_per_round"]["median"]
    for row in rows:
        row["ratio_to_plain"] = row["s_per_round"]["median"] / base
        row["paired_ratio_median"] = statistics.median(
            s["seconds"] / p for s, p in zip(row["samples"], plain, strict=True))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="10,100", help="cohort sizes (default 10,100)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per sample (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="samples per variant (3)")
    parser.add_argument("--only", default=",".join(VARIANTS),
                        help="comma-separated variants (plain is always run)")
    parser.add_argument("--out", default=None,
                        help="write <out>/compression_2nn_<date>.json")
    args = parser.parse_args(argv)
    names = ["plain"] + [n for n in args.only.split(",") if n and n != "plain"]
    if set(names) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(set(names) - set(VARIANTS))}; allowed: "
                     f"{', '.join(VARIANTS)}")

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fedax.aggregators import aggregate, compressed, mean
    from fedax.algorithms import CohortBatches
    from fedax.client import Batches, steps_strategy
    from fedax.data import ClientData, iid, make_cohort
    from fedax.federated import map_strategy
    from fedax.models import get_model, softmax_cross_entropy
    from fedax.simulation.host import compiler_options

    seed = common.SEED
    x, y, data_source = load_data(seed)
    train = ClientData.from_partition(x, y, iid(len(y), len(y) // EXAMPLES_PER_CLIENT, seed))
    model = get_model("2nn")
    params = jax.jit(model.init)(jax.random.key(seed))

    def loss_fn(p, b):
        return softmax_cross_entropy(model.apply(p, b.x), b.y, b.mask)

    base_key = jax.random.key(seed)
    keys = [jax.random.fold_in(base_key, t) for t in range(args.rounds + 1)]
    print(f"MNIST 2NN ({data_source}), E = {EPOCHS}, B = {BATCH}, map sequential, "
          f"{common.num_cores()} cores, {jax.devices()[0].platform}", flush=True)
    results = []
    for clients in [int(c) for c in args.clients.split(",")]:
        cohort_np = make_cohort(train, np.arange(clients), EPOCHS, BATCH,
                                np.random.default_rng([seed, 0]))
        cohort = CohortBatches(
            Batches(jnp.asarray(train.x[cohort_np.idx]), jnp.asarray(train.y[cohort_np.idx]),
                    jnp.asarray(cohort_np.mask)),
            jnp.asarray(cohort_np.num_examples), jnp.asarray(cohort_np.client_ids))
        compiled, states, agg_fns, compile_s = {}, {}, {}, {}
        updates = jax.tree.map(
            lambda p, c=clients: 1e-3 * jax.random.normal(jax.random.key(1), (c, *p.shape)),
            params)
        weights = jnp.asarray(cohort_np.num_examples, jnp.float32)
        for name in names:
            alg = make_algorithm(name, loss_fn, clients)
            state = jax.tree.map(jnp.copy, alg.init(params, base_key))
            start = time.perf_counter()
            with map_strategy("sequential"), steps_strategy("scan"):
                fn = jax.jit(alg.round, donate_argnums=(0,),
                             compiler_options=compiler_options())
                compiled[name] = fn.lower(state, cohort, keys[0]).compile()
            compile_s[name] = time.perf_counter() - start
            state, _ = compiled[name](state, cohort, keys[0])  # warm-up round
            states[name] = jax.block_until_ready(state)
            comp = compressor_of(name)
            agg = mean() if comp is None else compressed(comp)
            agg_state = agg.init(params)
            with map_strategy("sequential"):
                agg_fns[name] = jax.jit(
                    lambda u, w, s, agg=agg: aggregate(agg, u, w, s, keys[0])[0],
                    compiler_options=compiler_options()).lower(
                        updates, weights, agg_state).compile()
            jax.block_until_ready(agg_fns[name](updates, weights, agg_state))
            agg_fns[name] = (agg_fns[name], agg_state)
            print(f"  C={clients:<3} {name:<14} compiled in {compile_s[name]:5.1f} s",
                  flush=True)

        def one_round(name, states=states, compiled=compiled, cohort=cohort):
            state = jax.block_until_ready(jax.tree.map(jnp.copy, states[name]))
            for t in range(1, args.rounds + 1):
                state, _ = compiled[name](state, cohort, keys[t])
            jax.block_until_ready(state)

        def one_aggregate(name, agg_fns=agg_fns, updates=updates, weights=weights):
            fn, s = agg_fns[name]
            for _ in range(args.rounds):
                jax.block_until_ready(fn(updates, weights, s))

        for what, fn in (("round", one_round), ("aggregate", one_aggregate)):
            rows = summarize(names, time_samples(names, fn, args.repeats), args.rounds)
            for row in rows:
                row.update(clients=clients, timing=what,
                           compile_s=compile_s[row["variant"]] if what == "round" else None)
            results += rows
            print(f"\nC = {clients}, {what}: {'variant':<14} s median   x plain  paired")
            for row in rows:
                print(f"{'':>{len(str(clients)) + len(what) + 8}}{row['variant']:<14} "
                      f"{row['s_per_round']['median']:8.4f}  {row['ratio_to_plain']:7.2f}  "
                      f"{row['paired_ratio_median']:6.2f}", flush=True)
    machine = common.machine_info()
    print(f"machine: {machine.get('cpu', '?')}, {machine['cores']} cores, "
          f"load {os.getloadavg()[0]:.2f}")
    if args.out:
        path = common.dated_result(args.out, "compression_2nn")
        common.write_json(path, {
            "benchmark": "compression",
            "workload": {"model": "2nn", "data": data_source, "clients": args.clients,
                         "examples_per_client": EXAMPLES_PER_CLIENT, "local_epochs": EPOCHS,
                         "batch_size": BATCH, "client_optimizer": f"sgd(lr={LR})",
                         "map": "sequential", "steps": "scan"},
            "timing": {"rounds_per_sample": args.rounds, "repeats": args.repeats},
            "results": results, "machine": machine,
            "versions": common.versions("jax", "jaxlib", "optax"), "date": common.now_iso(),
        })
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
