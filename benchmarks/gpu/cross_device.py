"""The cross-device workload, fedax only: many small clients a round, one cohort size a process.

    python benchmarks/gpu/cross_device.py --per-round 1000 --rounds 5 --json out.json
    python benchmarks/gpu/cross_device.py --clients 200 --per-round 20 --rounds 1   # toy

Population (:func:`population`): ``--clients`` N = 10,000 MNIST clients. Client k has n_k
examples, ``n_k = clip(int(LogNormal(ln 45, 0.5)), 20, 100)`` (a skewed natural-looking size
law: median 45, mean about 50), and its own class mix ``q_k ~ Dir(alpha 1)`` over the 10
digits (Hsu et al. 2019's Dirichlet scheme; ``--alpha`` 0.5: most clients dominated by 2-4
digits); its class counts are ``Multinomial(n_k, q_k)`` and its examples of class c a run of
a fixed random permutation of MNIST's class-c training examples from a random start (distinct
within a client). N x 50 examples are about 500,000 draws from 60,000 images, so one image
serves several clients, as one word serves many phones' keyboards.

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

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import common  # noqa: E402

NUM_CLIENTS = 10_000
MIN_SIZE, MAX_SIZE = 20, 100
SIZE_MEDIAN, SIZE_SIGMA = 45.0, 0.5
ALPHA = 0.5
LOCAL_EPOCHS, BATCH_SIZE, CLIENT_LR = 1, 10, 0.05


def population(labels: np.ndarray, num_clients: int, alpha: float, seed: int,
               min_size: int = MIN_SIZE, max_size: int = MAX_SIZE
               ) -> tuple[np.ndarray, np.ndarray]:
    """``(indices, offsets)`` of a ``ClientData`` over ``labels``'s examples (see the module
    docstring): client k owns ``indices[offsets[k]:offsets[k + 1]]``, grouped by class.
    Deterministic given the arguments."""
    rng = np.random.default_rng(seed)
    sizes = np.clip(rng.lognormal(np.log(SIZE_MEDIAN), SIZE_SIGMA, num_clients).astype(np.int64),
                    min_size, max_size)
    classes = np.unique(labels)
    mix = rng.dirichlet(np.full(len(classes), alpha), num_clients)
    counts = rng.multinomial(sizes, mix)  # [N, classes]
    owners, chosen = [], []
    for c, label in enumerate(classes):
        pool = rng.permutation(np.flatnonzero(labels == label))
        if counts[:, c].max() > len(pool):
            raise ValueError(f"class {label} has {len(pool)} examples, a client wants more")
        clients = np.flatnonzero(counts[:, c])
        runs = counts[clients, c]
        starts = rng.integers(0, len(pool), len(clients))
        within = np.arange(runs.sum()) - np.repeat(np.cumsum(runs) - runs, runs)
        chosen.append(pool[(np.repeat(starts, runs) + within) % len(pool)])
        owners.append(np.repeat(clients, runs))
    owner = np.concatenate(owners)
    order = np.argsort(owner, kind="stable")  # client by client, classes in order
    indices = np.concatenate(chosen)[order].astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    assert offsets[-1] == len(indices)
    return indices, offsets


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
    from fedax.data import ClientData, load_mnist, num_local_steps
    from fedax.models import get_model
    from fedax.simulation import Execution, choose_execution, run

    started = time.perf_counter()
    arrays = load_mnist()
    x, y = arrays["x_train"], arrays["y_train"]
    indices, offsets = population(y, args.clients, args.alpha, args.seed)
    train = ClientData(x, y, indices, offsets)
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
    workload = {
        "dataset": "mnist", "partition": "dirichlet class mix per client, sizes lognormal",
        "num_clients": args.clients, "clients_per_round": args.per_round,
        "client_fraction": fraction, "alpha": args.alpha,
        "size_law": f"clip(int(LogNormal(ln {SIZE_MEDIAN:g}, {SIZE_SIGMA:g})), "
                    f"{MIN_SIZE}, {MAX_SIZE})",
        "sizes": {"min": int(sizes.min()), "median": float(np.median(sizes)),
                  "mean": float(sizes.mean()), "max": int(sizes.max()),
                  "total": int(sizes.sum())},
        "local_epochs": LOCAL_EPOCHS, "batch_size": BATCH_SIZE,
        "max_local_steps": num_local_steps(int(sizes.max()), LOCAL_EPOCHS, BATCH_SIZE),
        "client_optimizer": f"sgd(lr={CLIENT_LR})", "aggregation": "n_k-weighted mean",
        "model": args.model, "seed": args.seed,
    }
    record = common.run_record(
        "fedax", config, args.model, clock, args.warmup, rss, train_losses=losses,
        packages=("jax", "jaxlib", "optax"),
        extra={"execution": execution._asdict(), "fedax_version": fedax.__version__,
               "device": common.jax_device_info(),
               "device_memory": common.jax_device_memory(),
               "population_build_s": built_s})
    record["workload"] = workload
    s = record.get("s_per_round")
    if s:
        record["client_updates_per_s"] = args.per_round / s["median"]
        # real examples a round (E = 1): about per_round x mean size
        record["examples_per_s"] = args.per_round * float(sizes.mean()) / s["median"]
    common.finish(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
