"""The cross-device workload, fedax only: many small clients a round, one cohort size a process.

    python benchmarks/gpu/cross_device.py --per-round 1000 --rounds 5 --json out.json
    python benchmarks/gpu/cross_device.py --clients 200 --per-round 20 --rounds 1   # toy

Population and round: ``benchmarks/cross_device.py`` (shared with the peers of
``benchmarks/compare_cross_device.py``): ``--clients`` N = 10,000 MNIST clients of 20-100
examples (lognormal sizes, median 45), each with its own class mix ``Dir(--alpha 0.5)``.

Round: FedAvg of the 2NN (``--model``; ``logistic`` also works), E = 1, B = 10 (2-10 local
steps a client), client SGD lr 0.05, the n_k-weighted mean, ``--per-round`` clients a round
(C = per_round / N), through ``fedax.simulation.run`` with fedax's default execution for the
backend (``--strategy`` overrides: GPU ``vmap:scan:1``, the whole cohort one batched program),
timed as ``benchmarks/bench_fedax.py`` times a round: an "evaluation" after every round that
only waits for the new model. Reports seconds per round (median of the rounds after
``--warmup``), client updates per second (per_round / median), examples per second, and the
peak of the device's allocator (one process per cohort size, so the peak is that size's).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import common  # noqa: E402
from cross_device import (  # noqa: E402
    ALPHA,
    BATCH_SIZE,
    CLIENT_LR,
    LOCAL_EPOCHS,
    NUM_CLIENTS,
    add_rates,
    load_population,
    workload,
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=NUM_CLIENTS, help="N, the population")
    parser.add_argument("--per-round", type=int, required=True, help="clients a round")
    parser.add_argument("--alpha", type=float, default=ALPHA, help="Dirichlet concentration")
    parser.add_argument("--model", choices=("2nn", "logistic"), default="2nn")
    parser.add_argument("--strategy", default="default", help="MAP:STEPS:DEVICES or default")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds")
    parser.add_argument("--warmup", type=int, default=1, help="rounds before measuring")
    parser.add_argument("--seed", type=int, default=common.SEED)
    parser.add_argument("--json", default=None, help="write the record here")
    args = parser.parse_args(argv)
    if not 1 <= args.per_round <= args.clients:
        parser.error(f"--per-round must lie in [1, {args.clients}]")

    import jax

    import fedax
    from fedax.models import get_model
    from fedax.simulation import Execution, choose_execution, run

    started = time.perf_counter()
    train, _, _ = load_population(args.clients, args.alpha, args.seed)
    sizes = train.sizes
    built_s = time.perf_counter() - started

    model = get_model(args.model)
    params = jax.jit(model.init)(jax.random.key(args.seed))
    if args.strategy == "default":
        execution = choose_execution(params=params)
    else:
        map_, steps, devices = args.strategy.split(":")
        execution = Execution(map_, steps, int(devices)).validate()

    algorithm, clock, timing_evaluate = common.timed_fedavg(model, CLIENT_LR)
    losses: list[float] = []

    fraction = args.per_round / args.clients
    with common.RssMonitor() as rss:
        clock.mark()
        run(algorithm, params, train, timing_evaluate, rounds=args.warmup + args.rounds,
            client_fraction=fraction, local_epochs=LOCAL_EPOCHS, batch_size=BATCH_SIZE,
            seed=args.seed, eval_every=1, execution=execution,
            callbacks=[lambda record: losses.append(record["train_loss"])])
    exec_text = ":".join(str(v) for v in execution)
    config = exec_text if args.strategy != "default" else f"default ({exec_text})"
    record_workload = workload(sizes, args.clients, args.per_round, args.alpha, args.model,
                               args.seed)
    record = common.run_record(
        "fedax", config, args.model, clock, args.warmup, rss, train_losses=losses,
        packages=("jax", "jaxlib", "optax"),
        extra={"execution": execution._asdict(), "fedax_version": fedax.__version__,
               "device": common.jax_device_info(),
               "device_memory": common.jax_device_memory(),
               "population_build_s": built_s})
    record["workload"] = record_workload
    # real examples a round (E = 1): about per_round x mean size
    add_rates(record, args.per_round, float(sizes.mean()))
    common.finish(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
