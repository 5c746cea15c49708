"""XLA:CPU matrix products: Eigen (fedax's CPU default) against YNNPACK (XLA's default).

    python benchmarks/bench_cpu_dots.py 2nn --rounds 4              # workload W
    python benchmarks/bench_cpu_dots.py cnn --epochs 1 --rounds 3   # W with E = 1

Both configurations run in this one process, alternating round by round, through the real
runner (``fedax.simulation.run``; ``$FEDAX_CPU_DOTS`` selects the compiler options when a
run compiles its round), with fedax's default execution on a host split one device per
core. Prints the median seconds per round of each and the ratio ynn / eigen (> 1: Eigen
faster), and writes a JSON record with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

VARIANTS = ("eigen", "ynn")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=common.MODELS)
    parser.add_argument("--rounds", type=int, default=4, help="measured rounds per variant")
    parser.add_argument("--epochs", type=int, default=common.LOCAL_EPOCHS, help="E (W: 5)")
    parser.add_argument("--json", default=None, help="write the record here")
    args = parser.parse_args(argv)
    devices = common.num_cores()
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"

    import jax
    import optax

    from fedax.algorithms import fedavg
    from fedax.models import get_model, softmax_cross_entropy
    from fedax.simulation import choose_execution, run

    model = get_model(args.model)
    train, _, _ = common.load_federated_mnist()
    params = jax.jit(model.init)(jax.random.key(common.SEED))
    execution = choose_execution()

    def loss_fn(p, batch):
        return softmax_cross_entropy(model.apply(p, batch.x), batch.y, batch.mask)

    def one_round(variant: str, rounds: int) -> list[float]:
        """``rounds`` + 1 rounds under ``variant``; the seconds of all but the first."""
        os.environ["FEDAX_CPU_DOTS"] = variant
        marks: list[float] = []

        def evaluate(p):
            jax.block_until_ready(p)
            marks.append(time.perf_counter())
            return 0.0, 0.0

        fresh = jax.tree.map(lambda a: a.copy(), params)  # the run donates its state
        run(fedavg(loss_fn, optax.sgd(common.CLIENT_LR)), fresh, train, evaluate,
            rounds=rounds + 1, client_fraction=common.CLIENT_FRACTION,
            local_epochs=args.epochs, batch_size=common.BATCH_SIZE, seed=common.SEED,
            execution=execution)
        return [b - a for a, b in zip(marks, marks[1:], strict=False)]

    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):  # alternate: one measured round of each per pass
        for variant in VARIANTS:
            seconds[variant] += one_round(variant, 1)
    medians = {v: statistics.median(s) for v, s in seconds.items()}
    ratio = medians["ynn"] / medians["eigen"]
    print(f"{args.model} E={args.epochs} {execution}: s/round median "
          + "  ".join(f"{v} {medians[v]:.3f} ({', '.join(f'{s:.3f}' for s in seconds[v])})"
                      for v in VARIANTS)
          + f"  ynn/eigen {ratio:.2f}")
    record = {
        "comparison": "xla_cpu_dots",
        "model": args.model,
        "workload": {**common.WORKLOAD, "local_epochs": args.epochs},
        "execution": execution._asdict(),
        "seconds": seconds,
        "median_s": medians,
        "ratio_ynn_over_eigen": ratio,
        "machine": common.machine_info(),
        "date": common.now_iso(),
        "versions": {"jax": jax.__version__},
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
