"""Coded cohorts: does decoding 8-bit codes inside local training cost CNN step time?

    taskset -c 0 python benchmarks/bench_coded_decode.py --steps 60 --repeats 3

Two clients' local training (``lax.map`` over clients, ``local_train`` over steps, MNIST
CNN, B = 10) on the same random images given three ways, alternated in one process:

* ``float``: float32 features (the baseline);
* ``coded``: ``ByteCoded`` uint8 codes, decoded by ``local_train`` step by step (what the
  runner passes);
* ``per-loss``: raw uint8 codes decoded by the loss function itself.

Prints the median milliseconds per local step of each and its ratio to ``float``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="local steps per client")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from fedax import federated as fed
    from fedax.client import Batches, local_train
    from fedax.data import BYTE_SCALE_TABLE, ByteCoded
    from fedax.models import get_model, softmax_cross_entropy
    from fedax.simulation.host import compiler_options

    model = get_model("cnn")
    params = model.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    shape = (2, args.steps, 10)
    codes = rng.integers(0, 256, (*shape, 28, 28, 1), dtype=np.uint8)
    y = rng.integers(0, 10, shape).astype(np.int32)
    mask = np.ones(shape, np.float32)

    def loss(p, b):
        x = b.x
        if x.dtype == jnp.uint8:  # per-loss: the loss decodes raw codes itself
            x = jnp.asarray(BYTE_SCALE_TABLE)[x]
        return softmax_cross_entropy(model.apply(p, x), b.y, b.mask)

    def round_(p, b):
        def client(pc, bc):
            return local_train(loss, pc, bc, optax.sgd(0.05)).params

        return fed.map_clients(client, fed.broadcast(p, 2), b)

    inputs = {
        "float": Batches(jnp.asarray(BYTE_SCALE_TABLE[codes]), y, mask),
        "coded": Batches(ByteCoded(jnp.asarray(codes)), y, mask),
        "per-loss": Batches(jnp.asarray(codes), y, mask),
    }
    with fed.map_strategy("sequential"):
        f = jax.jit(round_, compiler_options=compiler_options())
        for b in inputs.values():
            jax.block_until_ready(f(params, b))
        times: dict[str, list[float]] = {k: [] for k in inputs}
        for _ in range(args.repeats):
            for k, b in inputs.items():  # alternate
                start = time.perf_counter()
                jax.block_until_ready(f(params, b))
                times[k].append((time.perf_counter() - start) * 1e3 / (2 * args.steps))
    base = statistics.median(times["float"])
    for k, v in times.items():
        med = statistics.median(v)
        print(f"{k:9s} {med:7.2f} ms/step   x float {med / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
