"""What a robust (or compressing) aggregator costs a FedAvg round: each against the plain
weighted mean, for 10 and 100 clients, alternated in one process.

    python benchmarks/bench_aggregators.py --out benchmarks/results

One compiled FedAvg round of the MNIST 2NN (client SGD, lr 0.05) on a fixed cohort of C
IID clients x 600 examples (the first C of ``fedax.data.iid(60000, 100, 0)``), E = 1,
B = 50 (12 local steps a client), C in ``--clients`` (default 10 and 100), for each
aggregator in ``VARIANTS``:

* ``plain``: ``aggregators.mean()``, the n_k-weighted mean (FedAvg's);
* ``median``, ``trimmed_mean`` (β = 0.2), ``krum`` (f = C/10), ``multi_krum`` (f = C/10,
  m = C/2), ``geometric_median`` (4 Weiszfeld steps), ``norm_bounding`` (M = 1): the robust
  rules of ``fedax.aggregators.robust``; every one but norm bounding receives the clients'
  values apart (``fed.collect``) and sorts or compares them on the server;
* ``COMPRESSION_VARIANTS`` (``fedax.aggregators.compression``, when the module exists):
  ``compressed(qsgd(4))``, ``compressed(top_k(0.01))``, ``compressed(cast("int8"))``,
  ``compressed(rotation(2))``: encode in the client stage, decode on the server. Add a
  row by adding a (name, factory) pair to ``variants()``.

Timing as in ``bench_dp.py``: ``jax.jit`` of ``algorithm.round`` (state donated) compiled
ahead of time with fedax's CPU compiler options, clients ``sequential``, local steps
``scan``, one XLA device; ``--warmup`` rounds, then ``--repeats`` samples of ``--rounds``
rounds per variant, alternated (reversed every other repetition). Per variant: the median
seconds per round, its ratio to ``plain``'s (``x plain``), and the median of each sample's
ratio to ``plain``'s sample of the same repetition (``paired``). Samples disturbed by other
processes are left out where undisturbed ones remain (``common.summarize``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

EXAMPLES_PER_CLIENT = 600
EPOCHS = 1
BATCH = 50
LR = 0.05
ROBUST_VARIANTS = ("plain", "median", "trimmed_mean", "krum", "multi_krum",
                   "geometric_median", "norm_bounding")
COMPRESSION_VARIANTS = ("qsgd4", "top_k1%", "int8", "rotation2")


def variants(num_clients: int) -> dict:
    """{name: (aggregator, description)}: the robust rules, and the compression aggregators
    when ``fedax.aggregators.compression`` exists (the hook for more rows)."""
    from fedax import aggregators as agg

    f = max(1, num_clients // 10)
    out = {
        "plain": (agg.mean(), "mean()"),
        "median": (agg.median(), "median()"),
        "trimmed_mean": (agg.trimmed_mean(0.2), "trimmed_mean(0.2)"),
        "krum": (agg.krum(f), f"krum({f})"),
        "multi_krum": (agg.multi_krum(f, num_clients // 2),
                       f"multi_krum({f}, {num_clients // 2})"),
        "geometric_median": (agg.geometric_median(4), "geometric_median(4)"),
        "norm_bounding": (agg.norm_bounding(1.0), "norm_bounding(1.0)"),
    }
    try:
        from fedax.aggregators import compression as comp
    except ImportError:  # not there yet: robust rows only
        return out
    for name, make, text in (("qsgd4", lambda: comp.qsgd(4), "qsgd(4)"),
                             ("top_k1%", lambda: comp.top_k(0.01), "top_k(0.01)"),
                             ("int8", lambda: comp.cast("int8"), "cast('int8')"),
                             ("rotation2", lambda: comp.rotation(2), "rotation(2)")):
        out[name] = (comp.compressed(make()), f"compressed({text})")
    return out


def bench(num_clients: int, args, x, y, data_source) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from fedax.algorithms import CohortBatches, fedavg
    from fedax.client import Batches, steps_strategy
    from fedax.data import ClientData, iid, make_cohort
    from fedax.federated import map_strategy
    from fedax.models import get_model, softmax_cross_entropy
    from fedax.simulation.host import compiler_options

    seed = common.SEED
    train = ClientData.from_partition(x, y, iid(len(y), len(y) // EXAMPLES_PER_CLIENT, seed))
    cohort_np = make_cohort(train, np.arange(num_clients), EPOCHS, BATCH,
                            np.random.default_rng([seed, 0]))
    cohort = CohortBatches(
        Batches(jnp.asarray(train.x[cohort_np.idx]), jnp.asarray(train.y[cohort_np.idx]),
                jnp.asarray(cohort_np.mask)),
        jnp.asarray(cohort_np.num_examples), jnp.asarray(cohort_np.client_ids))
    model = get_model("2nn")
    params = jax.jit(model.init)(jax.random.key(seed))

    def loss_fn(p, b):
        return softmax_cross_entropy(model.apply(p, b.x), b.y, b.mask)

    table = variants(num_clients)
    names = ["plain"] + [n for n in args.only.split(",") if n in table and n != "plain"]
    base_key = jax.random.key(seed)
    keys = [jax.random.fold_in(base_key, t) for t in range(args.warmup + args.rounds)]
    print(f"\nMNIST 2NN ({data_source}), {num_clients} clients x {EXAMPLES_PER_CLIENT}, "
          f"E = {EPOCHS}, B = {BATCH} ({cohort_np.idx.shape[1]} steps a client), map "
          f"{args.map}, {common.num_cores()} cores", flush=True)
    compiled, states, compile_s, metrics = {}, {}, {}, {}
    for name in names:
        alg = fedavg(loss_fn, optax.sgd(LR), aggregator=table[name][0])
        state = jax.tree.map(jnp.copy, alg.init(params, base_key))
        start = time.perf_counter()
        with map_strategy(args.map), steps_strategy("scan"):
            fn = jax.jit(alg.round, donate_argnums=(0,), compiler_options=compiler_options())
            compiled[name] = fn.lower(state, cohort, keys[0]).compile()
        compile_s[name] = time.perf_counter() - start
        for t in range(args.warmup):
            state, _ = compiled[name](state, cohort, keys[t])
        states[name] = jax.block_until_ready(state)
        print(f"  {name:<18} compiled in {compile_s[name]:5.1f} s", flush=True)

    samples: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            state = jax.block_until_ready(jax.tree.map(jnp.copy, states[name]))
            before = common.CpuSnapshot()
            for t in range(args.warmup, args.warmup + args.rounds):
                state, m = compiled[name](state, cohort, keys[t])
            jax.block_until_ready(state)
            sample = common.interval_cpu(before, common.CpuSnapshot())
            sample["seconds"] /= args.rounds
            samples[name].append(sample)
            metrics[name] = m

    rows = []
    plain_samples = [s["seconds"] for s in samples["plain"]]
    for name in names:
        summary = common.summarize(samples[name])
        loss = float(jax.device_get(metrics[name]["train_loss"]))
        if not np.isfinite(loss):
            raise SystemExit(f"{name}: non-finite train_loss {loss}")
        paired = [s["seconds"] / p for s, p in zip(samples[name], plain_samples, strict=True)]
        rows.append({"clients": num_clients, "variant": name, "description": table[name][1],
                     "compile_s": compile_s[name], "samples": samples[name],
                     "train_loss": loss, "paired_ratios": paired,
                     "paired_ratio_median": statistics.median(paired), **summary})
    plain = rows[0]["s_per_round"]["median"]
    for row in rows:
        row["ratio_to_plain"] = row["s_per_round"]["median"] / plain
    width = max(len(n) for n in names)
    print(f"\n{'variant':<{width}}  s/round median  x plain  paired  kept  compile s")
    for row in rows:
        kept = f"{row['rounds_kept']}/{row['rounds_total']}"
        print(f"{row['variant']:<{width}}  {row['s_per_round']['median']:14.4f}  "
              f"{row['ratio_to_plain']:7.2f}  {row['paired_ratio_median']:6.2f}  {kept:>4}  "
              f"{row['compile_s']:9.1f}")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="10,100", help="cohort sizes (default 10,100)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per sample (default 3)")
    parser.add_argument("--repeats", type=int, default=5, help="samples per variant (5)")
    parser.add_argument("--warmup", type=int, default=1, help="rounds before timing (1)")
    parser.add_argument("--map", choices=("sequential", "vmap"), default="sequential")
    parser.add_argument("--only", default=",".join(ROBUST_VARIANTS + COMPRESSION_VARIANTS),
                        help="comma-separated variants (plain is always run)")
    parser.add_argument("--out", default=None,
                        help="write <out>/aggregators_2nn_<date>.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_dp import load_data

    x, y, data_source = load_data(common.SEED)
    rows = []
    for c in (int(v) for v in args.clients.split(",")):
        rows += bench(c, args, x, y, data_source)
    machine = common.machine_info()
    print(f"machine: {machine.get('cpu', '?')}, {machine['cores']} cores, "
          f"load {os.getloadavg()[0]:.2f}")
    if args.out:
        import jax

        path = common.dated_result(args.out, "aggregators_2nn")
        common.write_json(path, {
            "benchmark": "aggregators",
            "workload": {"model": "2nn", "data": data_source, "clients": args.clients,
                         "examples_per_client": EXAMPLES_PER_CLIENT, "local_epochs": EPOCHS,
                         "batch_size": BATCH, "client_optimizer": f"sgd(lr={LR})",
                         "map": args.map, "steps": "scan", "devices": jax.device_count()},
            "timing": {"rounds_per_sample": args.rounds, "repeats": args.repeats,
                       "warmup_rounds": args.warmup,
                       "order": "alternated, reversed every other repetition"},
            "results": rows, "machine": machine,
            "versions": common.versions("jax", "jaxlib", "optax"), "date": common.now_iso(),
        })
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
