"""The server's aggregation on XLA:CPU: fedax's ``weighted_mean`` against a plain reduction.

    python benchmarks/bench_aggregate.py --clients 10 --repeats 5 --json out.json

For each model's parameters (2NN, CNN), ten clients' updates ``[C, ...]`` are averaged
with weights n_k, in one jitted program each way, alternating, in this one process:

* ``reduce``: ``jnp.sum(x * w, axis=0) / jnp.sum(w)``, the textbook form (what
  ``fedax.federated.sum`` lowered to before, and what JAX users write);
* ``fedax``: ``fedax.federated.weighted_mean``, whose sum is lowered on CPU as a product
  with a vector of ones.

Prints the median seconds of each per model and the ratio reduce / fedax, and checks that
both give the same mean (float tolerance).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from fedax import federated as fed
    from fedax.models import get_model
    from fedax.simulation.host import compiler_options

    def reduce_mean(x, w):
        total = jnp.sum(w)
        return jax.tree.map(
            lambda a: jnp.sum(a * w.reshape((-1,) + (1,) * (a.ndim - 1)), axis=0) / total, x
        )

    results = []
    for name in ("2nn", "cnn"):
        params = get_model(name).init(jax.random.key(0))
        rng = np.random.default_rng(0)
        deltas = jax.tree.map(
            lambda p, rng=rng: jnp.asarray(rng.normal(size=(args.clients, *p.shape)), p.dtype),
            params,
        )
        weights = jnp.asarray(rng.integers(100, 1000, args.clients), jnp.float32)
        fns = {
            "reduce": jax.jit(reduce_mean, compiler_options=compiler_options()),
            "fedax": jax.jit(fed.weighted_mean, compiler_options=compiler_options()),
        }
        outs = {k: jax.block_until_ready(f(deltas, weights)) for k, f in fns.items()}
        pairs = zip(jax.tree.leaves(outs["reduce"]), jax.tree.leaves(outs["fedax"]), strict=True)
        for a, b in pairs:
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.repeats):
            for k, f in fns.items():  # alternate
                start = time.perf_counter()
                jax.block_until_ready(f(deltas, weights))
                times[k].append(time.perf_counter() - start)
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"model": name, "clients": args.clients, "median_s": med, "samples_s": times,
               "ratio_reduce_over_fedax": med["reduce"] / med["fedax"]}
        results.append(row)
        print(f"{name}: reduce {med['reduce'] * 1e3:9.2f} ms   fedax {med['fedax'] * 1e3:7.2f} ms"
              f"   ratio {row['ratio_reduce_over_fedax']:.1f}x")
    if args.json:
        common.write_json(args.json, {
            "benchmark": "aggregate", "results": results, "machine": common.machine_info(),
            "versions": common.versions("jax", "jaxlib"), "date": common.now_iso(),
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
