"""What differential privacy costs a FedAvg round: the DP variants against the plain round,
alternated in one process.

    python benchmarks/bench_dp.py --out benchmarks/results

One compiled FedAvg round of the MNIST 2NN (client SGD, lr 0.05) on a fixed cohort of 10
IID clients x 600 examples (the first 10 of ``fedax.data.iid(60000, 100, 0)``), E = 1,
B = 50 (12 local steps a client), for each variant:

* ``plain``: ``fedavg(loss, sgd(0.05))``, the default aggregator (the n_k-weighted mean);
* ``dp_gaussian``: ``aggregators.dp_gaussian(clip=1.0, noise_multiplier=1.0,
  denominator=10)``, user-level DP-FedAvg: each client's update clipped, the sum noised;
* ``dp_gaussian per_layer``: the same with ``per_layer=True`` (each leaf its own bound);
* ``dp_adaptive_gaussian``: ``aggregators.dp_adaptive_gaussian(1.0, 10,
  clipped_count_stddev=1.0)``, the quantile-tracking clip (its state carried from round to
  round; the default count noise, 10/20, would need a noise multiplier below 1);
* ``adaclip``: ``aggregators.adaclip(1.0, 10)``, coordinate-wise adaptive clipping;
* ``dp_sgd``: example-level DP-SGD: the clients train with ``client.dp_local_train``
  (per-example gradients, each clipped to 1.0, noise multiplier 1.0 on every step), the
  server takes the plain weighted mean.

Each round is ``jax.jit`` of ``algorithm.round`` (state donated, the new state fed to the
next round, as ``fedax.simulation.run`` does) compiled ahead of time with fedax's CPU
compiler options, clients mapped ``sequential`` and local steps ``scan`` (the runner's
CPU choice for the 2NN, here on one XLA device; ``--map vmap`` for the batched form).
Compilation and ``--warmup`` rounds come first; then ``--repeats`` times, each variant runs
``--rounds`` rounds back to back from its state after the warm-up (a copy; every sample is
the same work), timed until ``block_until_ready`` of the new state, the variants
alternating (the order reversed every other repetition). Per variant: the median over the
repetitions of the seconds per round, its ratio to ``plain``'s (``x plain``), and the
median over the repetitions of each sample's ratio to ``plain``'s sample of the same
repetition (``paired``: load that comes and goes during the run cancels in each pair). A
sample during which other processes used more than ``common.DISTURBED_CORES`` cores is
left out of the median where undisturbed samples remain (``common.summarize``). The
table's last column is the last timed round's ``train_loss``, a check that the round ran
(finite), not a measure of utility: DP noise calibrated for 10 clients a round swamps the
model within a few rounds (``adaclip``'s within the timed rounds).

Real MNIST from fedax's cache (never the network); without it, random data of the same
shape, with a note (the time of a round does not depend on the values).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

CLIENTS = 10
EXAMPLES_PER_CLIENT = 600
EPOCHS = 1
BATCH = 50
LR = 0.05
CLIP = 1.0
NOISE = 1.0
VARIANTS = ("plain", "dp_gaussian", "dp_gaussian per_layer", "dp_adaptive_gaussian",
            "adaclip", "dp_sgd")


def load_data(seed: int):
    """(x_train, y_train, source): MNIST from the cache only, else random data alike."""
    import numpy as np

    from fedax.data import DataUnavailableError, load_mnist

    try:
        arrays = load_mnist(sources=())  # the cache only: no download
        return arrays["x_train"], arrays["y_train"], "mnist"
    except DataUnavailableError:
        print("note: MNIST is not in fedax's cache; timing on random data of the same shape "
              "(float32 [60000, 28, 28, 1] in [0, 1], 10 classes)", flush=True)
        rng = np.random.default_rng(seed)
        x = rng.random((60000, 28, 28, 1), dtype=np.float32)
        y = rng.integers(0, 10, 60000).astype(np.int32)
        return x, y, "random"


def make_algorithms(loss_fn, seed: int):
    """({name: (FederatedAlgorithm, description)}, dp_sgd's per-client keys [C, 2])."""
    import jax
    import jax.numpy as jnp
    import optax

    from fedax import aggregators
    from fedax.algorithms import ClientMessage, compose, fedavg
    from fedax.algorithms.fedavg import model_pieces
    from fedax.client import dp_local_train

    sgd = optax.sgd(LR)
    algs = {
        "plain": (fedavg(loss_fn, sgd), "fedavg, aggregators.mean()"),
        "dp_gaussian": (
            fedavg(loss_fn, sgd, aggregator=aggregators.dp_gaussian(
                clip=CLIP, noise_multiplier=NOISE, denominator=CLIENTS)),
            f"dp_gaussian(clip={CLIP}, noise_multiplier={NOISE}, denominator={CLIENTS})"),
        "dp_gaussian per_layer": (
            fedavg(loss_fn, sgd, aggregator=aggregators.dp_gaussian(
                clip=CLIP, noise_multiplier=NOISE, denominator=CLIENTS, per_layer=True)),
            f"dp_gaussian(clip={CLIP}, noise_multiplier={NOISE}, denominator={CLIENTS}, "
            "per_layer=True)"),
        # The default clipped_count_stddev, expected_clients/20 = 0.5, needs z < 2 * 0.5:
        # with z = 1 and 10 clients the count takes a larger share (sigma_b = 1.0).
        "dp_adaptive_gaussian": (
            fedavg(loss_fn, sgd, aggregator=aggregators.dp_adaptive_gaussian(
                NOISE, CLIENTS, clipped_count_stddev=CLIENTS / 10)),
            f"dp_adaptive_gaussian({NOISE}, {CLIENTS}, clipped_count_stddev={CLIENTS / 10})"),
        "adaclip": (fedavg(loss_fn, sgd, aggregator=aggregators.adaclip(NOISE, CLIENTS)),
                    f"adaclip({NOISE}, {CLIENTS})"),
    }

    # Example-level DP-SGD. Each client's noise key is its per-client state (raw key data,
    # split every round, so every client draws fresh noise each round). Here the benchmark
    # derives the keys from a fixed seed (below); a real deployment needs each client's own
    # secret key, made and kept on the client: whoever knows it can subtract the noise.
    def dp_client_update(params, key_data, batches, num_examples):
        key, next_key = jax.random.split(jax.random.wrap_key_data(key_data))
        result = dp_local_train(loss_fn, params, batches, sgd, l2_clip=CLIP,
                                noise_multiplier=NOISE, key=key)
        delta = jax.tree.map(jnp.subtract, params, result.params)
        stats = {"train_loss": result.loss, "local_steps": result.num_steps}
        return ClientMessage(delta, num_examples, stats,
                             client_state=jax.random.key_data(next_key))

    # The table's initial rows are placeholders; main() puts ``client_keys`` in their place.
    pieces = model_pieces(dp_client_update)._replace(
        client_state=lambda params: jax.random.key_data(jax.random.key(0)))
    algs["dp_sgd"] = (compose(pieces, num_clients=CLIENTS),
                      f"fedavg pieces, client update dp_local_train(sgd({LR}), "
                      f"l2_clip={CLIP}, noise_multiplier={NOISE})")
    client_keys = jax.random.key_data(
        jax.random.split(jax.random.fold_in(jax.random.key(seed), 15), CLIENTS))
    return algs, client_keys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds timed back to back in one sample (default 5)")
    parser.add_argument("--repeats", type=int, default=7,
                        help="samples per variant, alternated (default 7)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="rounds per variant after compiling, before timing (default 1)")
    parser.add_argument("--map", choices=("sequential", "vmap"), default="sequential",
                        help="how map_clients runs the cohort (default sequential)")
    parser.add_argument("--only", default=",".join(VARIANTS),
                        help="comma-separated variants (plain is always run)")
    parser.add_argument("--out", default=None,
                        help="write <out>/dp_2nn_<date>.json (e.g. benchmarks/results)")
    args = parser.parse_args(argv)
    names = ["plain"] + [n for n in args.only.split(",") if n and n != "plain"]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; allowed: {', '.join(VARIANTS)}")

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fedax.algorithms import CohortBatches
    from fedax.client import Batches, steps_strategy
    from fedax.data import ClientData, iid, make_cohort
    from fedax.federated import map_strategy
    from fedax.models import get_model, softmax_cross_entropy
    from fedax.simulation.host import compiler_options

    seed = common.SEED
    x, y, data_source = load_data(seed)
    train = ClientData.from_partition(x, y, iid(len(y), len(y) // EXAMPLES_PER_CLIENT, seed))
    cohort_np = make_cohort(train, np.arange(CLIENTS), EPOCHS, BATCH,
                            np.random.default_rng([seed, 0]))
    cohort = CohortBatches(
        Batches(jnp.asarray(train.x[cohort_np.idx]), jnp.asarray(train.y[cohort_np.idx]),
                jnp.asarray(cohort_np.mask)),
        jnp.asarray(cohort_np.num_examples), jnp.asarray(cohort_np.client_ids))
    steps = cohort_np.idx.shape[1]

    model = get_model("2nn")
    params = jax.jit(model.init)(jax.random.key(seed))

    def loss_fn(p, b):
        return softmax_cross_entropy(model.apply(p, b.x), b.y, b.mask)

    algs, client_keys = make_algorithms(loss_fn, seed)
    base_key = jax.random.key(seed)
    keys = [jax.random.fold_in(base_key, t) for t in range(args.warmup + args.rounds)]
    print(f"MNIST 2NN ({data_source}), {CLIENTS} clients x {EXAMPLES_PER_CLIENT} examples, "
          f"E = {EPOCHS}, B = {BATCH} ({steps} steps a client), map {args.map}, "
          f"{common.num_cores()} cores, {jax.devices()[0].platform}", flush=True)

    compiled, states, compile_s, metrics = {}, {}, {}, {}
    for name in names:
        alg = algs[name][0]
        # Its own copy: the round donates its state, and the variants share ``params``.
        state = jax.tree.map(jnp.copy, alg.init(params, base_key))
        if name == "dp_sgd":
            state = state._replace(clients=client_keys)
        start = time.perf_counter()
        with map_strategy(args.map), steps_strategy("scan"):
            fn = jax.jit(alg.round, donate_argnums=(0,), compiler_options=compiler_options())
            compiled[name] = fn.lower(state, cohort, keys[0]).compile()
        compile_s[name] = time.perf_counter() - start
        for t in range(args.warmup):
            state, m = compiled[name](state, cohort, keys[t])
        states[name] = jax.block_until_ready(state)
        print(f"  {name:<22} compiled in {compile_s[name]:5.1f} s", flush=True)

    samples: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.repeats):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            # Every sample runs the same rounds from the same state (a copy: the round
            # donates it), so that samples are the same work and no model drifts far.
            state = jax.block_until_ready(jax.tree.map(jnp.copy, states[name]))
            fn = compiled[name]
            before = common.CpuSnapshot()
            for t in range(args.warmup, args.warmup + args.rounds):
                state, m = fn(state, cohort, keys[t])
            jax.block_until_ready(state)
            after = common.CpuSnapshot()
            metrics[name] = m
            sample = common.interval_cpu(before, after)
            sample["seconds"] /= args.rounds
            samples[name].append(sample)

    rows = []
    for name in names:
        summary = common.summarize(samples[name])
        last = {k: float(v) for k, v in jax.device_get(metrics[name]).items()}
        if not np.isfinite(last["train_loss"]):
            raise SystemExit(f"{name}: non-finite train_loss {last['train_loss']}")
        rows.append({"variant": name, "description": algs[name][1],
                     "compile_s": compile_s[name], "samples": samples[name],
                     "last_round_metrics": last, **summary})
    plain = rows[0]["s_per_round"]["median"]
    plain_samples = [p["seconds"] for p in samples["plain"]]
    for row in rows:
        row["ratio_to_plain"] = row["s_per_round"]["median"] / plain
        # Each repetition's sample against plain's of the same repetition (run next to it):
        # load that comes and goes over the run cancels in the pair.
        row["paired_ratios"] = [v["seconds"] / p for v, p in
                                zip(row["samples"], plain_samples, strict=True)]
        row["paired_ratio_median"] = statistics.median(row["paired_ratios"])

    widths = max(len(n) for n in names)
    print(f"\n{'variant':<{widths}}  s/round median     min     max  x plain  paired  "
          "kept  compile s  train loss")
    for row in rows:
        s = row["s_per_round"]
        kept = f"{row['rounds_kept']}/{row['rounds_total']}"
        print(f"{row['variant']:<{widths}}  {s['median']:14.4f}  {s['min']:6.4f}  "
              f"{s['max']:6.4f}  {row['ratio_to_plain']:7.2f}  {row['paired_ratio_median']:6.2f}  "
              f"{kept:>4}  "
              f"{row['compile_s']:9.1f}  {row['last_round_metrics']['train_loss']:10.4g}")
    if any(r["all_disturbed"] for r in rows):
        print("(some variants had every sample disturbed by other processes: all were used)")
    machine = common.machine_info()
    print(f"machine: {machine.get('cpu', '?')}, {machine['cores']} cores, "
          f"load {os.getloadavg()[0]:.2f}")

    if args.out:
        path = common.dated_result(args.out, "dp_2nn")
        common.write_json(path, {
            "benchmark": "dp",
            "workload": {"model": "2nn", "data": data_source, "clients": CLIENTS,
                         "examples_per_client": EXAMPLES_PER_CLIENT, "local_epochs": EPOCHS,
                         "batch_size": BATCH, "local_steps": steps,
                         "client_optimizer": f"sgd(lr={LR})", "map": args.map,
                         "steps": "scan", "devices": jax.device_count()},
            "timing": {"rounds_per_sample": args.rounds, "repeats": args.repeats,
                       "warmup_rounds": args.warmup, "order": "alternated, reversed "
                       "every other repetition"},
            "results": rows, "machine": machine,
            "versions": common.versions("jax", "jaxlib", "optax"), "date": common.now_iso(),
        })
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
