"""The MNIST CNN's local step under each convolution form, inside a compiled loop.

    python benchmarks/bench_conv.py --steps 20 --reps 3 --json out.json

One client's W local steps (B = 10, SGD) as ``lax.scan`` over ``--steps`` batches, with
each ``conv_impl`` of ``fedax.models.mnist.cnn`` (``auto``, fedax's CPU default: ``patches``
for the one-channel first convolution, ``lax_vjp`` for the second; ``lax_vjp`` or
``patches`` for both; ``lax``, whose autodiff weight gradients XLA:CPU runs slowly inside
loops), compiled as the runner compiles a round and timed alternately in this one process
(pin it to one core with ``taskset -c 0`` for the single-core figure). Prints ms per step
(median) and the ratio to the first form. The loop's results agree across forms to float
tolerance (checked).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

IMPLS = ("auto", "lax_vjp", "patches", "lax")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--impls", default="auto,lax_vjp,patches", help=f"subset of {IMPLS}")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from fedax.client import Batches, local_train
    from fedax.models import softmax_cross_entropy
    from fedax.models.mnist import cnn
    from fedax.simulation.host import compiler_options

    impls = args.impls.split(",")
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.uniform(keys[0], (args.steps, 10, 28, 28, 1))
    y = jax.random.randint(keys[1], (args.steps, 10), 0, 10)
    batches = Batches(x, y, jnp.ones((args.steps, 10)))
    params = cnn("lax").init(keys[2])
    fns, outs = {}, {}
    for impl in impls:
        model = cnn(impl)

        def loss(p, b, model=model):
            return softmax_cross_entropy(model.apply(p, b.x), b.y, b.mask)

        fns[impl] = jax.jit(lambda p, b, loss=loss: local_train(loss, p, b, optax.sgd(0.05)).params,
                            compiler_options=compiler_options())
        outs[impl] = jax.block_until_ready(fns[impl](params, batches))
    ref = impls[0]
    for impl in impls[1:]:
        for a, b in zip(jax.tree.leaves(outs[ref]), jax.tree.leaves(outs[impl]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-4)
    seconds: dict[str, list[float]] = {impl: [] for impl in impls}
    for _ in range(args.reps):
        for impl in impls:
            start = time.perf_counter()
            jax.block_until_ready(fns[impl](params, batches))
            seconds[impl].append(time.perf_counter() - start)
    ms = {impl: 1e3 * statistics.median(s) / args.steps for impl, s in seconds.items()}
    for impl in impls:
        print(f"{impl:8s} {ms[impl]:7.2f} ms/step  x{ms[impl] / ms[ref]:.2f} vs {ref}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"comparison": "cnn_conv_forms", "steps": args.steps, "reps": args.reps,
                       "ms_per_step_median": ms, "seconds": seconds,
                       "jax": jax.__version__}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
