"""bfloat16 mixed precision against float32 on this CPU, in one process.

    python benchmarks/bench_precision.py --json benchmarks/results/precision_DATE.json

What ``precision: bfloat16`` (``fedax.models.mixed_precision``: bfloat16 compute, float32
master weights) does to a client's local steps, compiled as the runner compiles them
(``fedax.client.local_train``, SGD; float32 with fedax's CPU product kernels, bfloat16 with
YNNPACK's, which ``precision: bfloat16`` selects). The programs are alternated repeat by
repeat:

- the MNIST CNN (``conv_impl="auto"``), B = 10, 20 steps; and the Shakespeare char-LSTM
  (98 symbols, two layers of 256), B = 10, 10 steps: ms per step;
- for reference, one 1024 x 1024 x 1024 product in each precision: GFLOP/s.

Prints each time and the ratio bfloat16 / float32 (> 1: bfloat16 slower), and whether the
CPU has bfloat16 arithmetic (``fedax.simulation.host.cpu_has_bf16``).
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
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import optax

    from fedax.client import Batches, local_train
    from fedax.models import char_lstm, get_model, softmax_cross_entropy, with_precision
    from fedax.models.losses import token_cross_entropy
    from fedax.simulation.host import compiler_options, cpu_has_bf16

    keys = jax.random.split(jax.random.key(common.SEED), 4)
    workloads = {
        "cnn": (get_model("cnn", conv_impl="auto"), softmax_cross_entropy, 20,
                jax.random.uniform(keys[0], (20, 10, 28, 28, 1)),
                jax.random.randint(keys[1], (20, 10), 0, 10)),
        "char_lstm": (char_lstm(98), token_cross_entropy, 10,
                      jax.random.randint(keys[2], (10, 10, 80), 1, 98),
                      jax.random.randint(keys[3], (10, 10, 80), 1, 98)),
    }
    programs = {}
    for name, (model, loss_of, steps, x, y) in workloads.items():
        batches = Batches(x, y, jnp.ones((steps, 10)))
        for precision, dots in (("float32", None), ("bfloat16", "ynn")):
            m = with_precision(model, precision)
            params = m.init(jax.random.key(common.SEED))

            def loss(p, b, m=m, loss_of=loss_of):
                return loss_of(m.apply(p, b.x), b.y, b.mask)

            train = jax.jit(lambda p, b, loss=loss: local_train(loss, p, b,
                                                                 optax.sgd(0.05)).params,
                            compiler_options=compiler_options("cpu", dots=dots))
            compiled = train.lower(params, batches).compile()
            jax.block_until_ready(compiled(params, batches))
            programs[(name, precision)] = (compiled, (params, batches), steps)
    for dtype in ("float32", "bfloat16"):
        a = jnp.ones((1024, 1024), dtype)
        product = jax.jit(lambda u, v: jnp.dot(u, v, preferred_element_type=jnp.float32),
                          compiler_options=compiler_options(
                              "cpu", dots="ynn" if dtype == "bfloat16" else None))
        jax.block_until_ready(product(a, a))
        programs[("matmul_1024", dtype)] = (product, (a, a), 1)

    times: dict[tuple[str, str], list[float]] = {k: [] for k in programs}
    for _ in range(args.repeats):
        for key, (fn, fn_args, steps) in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*fn_args))
            times[key].append((time.perf_counter() - start) / steps)

    rows = []
    print(f"CPU bfloat16 arithmetic: {cpu_has_bf16()}")
    for name in [*workloads, "matmul_1024"]:
        f32 = statistics.median(times[(name, "float32")])
        bf16 = statistics.median(times[(name, "bfloat16")])
        row = {"workload": name, "float32_ms": 1e3 * f32, "bfloat16_ms": 1e3 * bf16,
               "bfloat16_over_float32": bf16 / f32}
        if name == "matmul_1024":
            row["float32_gflops"] = 2 * 1024**3 / f32 / 1e9
            row["bfloat16_gflops"] = 2 * 1024**3 / bf16 / 1e9
        rows.append(row)
        unit = "ms/step" if name != "matmul_1024" else "ms"
        print(f"{name:12} float32 {1e3 * f32:8.2f} {unit}  bfloat16 {1e3 * bf16:8.2f} {unit}  "
              f"bfloat16/float32 {bf16 / f32:5.2f}")
    if args.json:
        common.write_json(args.json, {
            "comparison": "precision", "rows": rows, "repeats": args.repeats,
            "cpu_has_bf16": cpu_has_bf16(), "machine": common.machine_info(),
            "date": common.now_iso(), "versions": common.versions("jax", "jaxlib"),
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
