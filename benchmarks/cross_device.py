"""The cross-device workload, shared by fedax's side (``gpu/cross_device.py``) and the peers'
(``bench_cross_device_peers.py``, ``compare_cross_device.py``).

Population (:func:`population`): ``NUM_CLIENTS`` N = 10,000 MNIST clients. Client k has n_k
examples, ``n_k = clip(int(LogNormal(ln 45, 0.5)), 20, 100)`` (a skewed natural-looking size
law: median 45, mean about 50), and its own class mix ``q_k ~ Dir(alpha)`` over the 10
digits (Hsu et al. 2019's Dirichlet scheme; ``ALPHA`` 0.5: most clients dominated by 2-4
digits); its class counts are ``Multinomial(n_k, q_k)`` and its examples of class c a run of
a fixed random permutation of MNIST's class-c training examples from a random start (distinct
within a client). N x 50 examples are about 500,000 draws from 60,000 images, so one image
serves several clients, as one word serves many phones' keyboards.

Round: FedAvg of the 2NN, E = 1, B = 10 (2-10 local steps a client), client SGD lr 0.05, the
n_k-weighted mean of the client models, K clients a round drawn uniformly without
replacement. :func:`round_clients` is round t's cohort exactly as ``fedax.simulation.run``
draws it (``PartitionSource``): the ids from ``default_rng([seed, t])``, each client's
shuffle from its own ``default_rng([seed, t, k])``; so every implementation that takes its
cohorts from here trains the very batches fedax trains.

NumPy and fedax's NumPy-only data layer only: every implementation's process can import it.
"""

from __future__ import annotations

from typing import Any

import common
import numpy as np

NUM_CLIENTS = 10_000
MIN_SIZE, MAX_SIZE = 20, 100
SIZE_MEDIAN, SIZE_SIGMA = 45.0, 0.5
ALPHA = 0.5
LOCAL_EPOCHS, BATCH_SIZE, CLIENT_LR = 1, 10, 0.05
MODEL = "2nn"
SEED = common.SEED


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


def load_population(num_clients: int = NUM_CLIENTS, alpha: float = ALPHA, seed: int = SEED):
    """``(ClientData of the population, x_train, y_train)`` over fedax's MNIST arrays (x
    float32 ``[60000, 28, 28, 1]`` in [0, 1], y int32); client k's indices point into x."""
    from fedax.data import ClientData, load_mnist

    arrays = load_mnist()
    x, y = arrays["x_train"], arrays["y_train"]
    indices, offsets = population(y, num_clients, alpha, seed)
    return ClientData(x, y, indices, offsets), x, y


def round_clients(train, t: int, per_round: int, seed: int = SEED,
                  client_ids=None) -> tuple[np.ndarray, list[tuple[float, list[np.ndarray]]]]:
    """Round t (0-based) as fedax's runner draws it: ``(ids, [(n_k, batches)])``, the ids
    in id order and, for each, its E·⌈n_k/B⌉ batches of example indices into x.
    ``client_ids`` given (a peer that samples its clients itself): those clients' batches
    for round t, from the same per-client streams."""
    from fedax.data import make_cohort, num_local_steps, sample_clients

    rng = np.random.default_rng([seed, t])
    if client_ids is None:
        client_ids = np.sort(sample_clients(rng, train.num_clients, per_round / train.num_clients))
    ids = np.asarray(client_ids, np.int64)
    steps = num_local_steps(int(train.sizes[ids].max()), LOCAL_EPOCHS, BATCH_SIZE)
    cohort = make_cohort(train, ids, LOCAL_EPOCHS, BATCH_SIZE, rng, num_steps=steps,
                         client_streams=(seed, t))
    return ids, [(float(n), common.client_batches(i, m))
                 for i, m, n in zip(cohort.idx, cohort.mask, cohort.num_examples, strict=True)]


def workload(sizes: np.ndarray, num_clients: int, per_round: int, alpha: float, model: str,
             seed: int) -> dict[str, Any]:
    """The record's description of the workload (``sizes``: every client's n_k)."""
    from fedax.data import num_local_steps

    return {
        "dataset": "mnist", "partition": "dirichlet class mix per client, sizes lognormal",
        "num_clients": num_clients, "clients_per_round": per_round,
        "client_fraction": per_round / num_clients, "alpha": alpha,
        "size_law": f"clip(int(LogNormal(ln {SIZE_MEDIAN:g}, {SIZE_SIGMA:g})), "
                    f"{MIN_SIZE}, {MAX_SIZE})",
        "sizes": {"min": int(sizes.min()), "median": float(np.median(sizes)),
                  "mean": float(sizes.mean()), "max": int(sizes.max()),
                  "total": int(sizes.sum())},
        "local_epochs": LOCAL_EPOCHS, "batch_size": BATCH_SIZE,
        "max_local_steps": num_local_steps(int(sizes.max()), LOCAL_EPOCHS, BATCH_SIZE),
        "client_optimizer": f"sgd(lr={CLIENT_LR})", "aggregation": "n_k-weighted mean",
        "model": model, "seed": seed,
    }


def add_rates(record: dict[str, Any], per_round: int, mean_size: float) -> None:
    """``client_updates_per_s`` (K / median s a round) and ``examples_per_s`` (K x the mean
    n_k / median: E = 1) into a record with ``s_per_round``."""
    s = record.get("s_per_round")
    if s:
        record["client_updates_per_s"] = per_round / s["median"]
        record["examples_per_s"] = per_round * mean_size / s["median"]


def first_round(per_round: int, num_clients: int = NUM_CLIENTS):
    """The benchmarks' one-round setup: ``(execution, model, params, data, cohort)``, with
    fedax's CPU default execution (``sequential:scan`` over every XLA device), the 2NN's
    initial parameters, round 0's host ``RoundData`` of ``per_round`` clients, and its
    ``CohortBatches`` on the device (the features gathered from the population)."""
    import jax
    import jax.numpy as jnp

    from fedax.algorithms import CohortBatches
    from fedax.client import Batches
    from fedax.models import get_model
    from fedax.simulation import Execution
    from fedax.simulation.sources import PartitionSource

    execution = Execution("sequential", "scan", jax.device_count()).validate()
    model = get_model(MODEL)
    params = jax.jit(model.init)(jax.random.key(SEED))
    train, x_all, y_all = load_population(num_clients)
    source = PartitionSource(train, per_round / num_clients, LOCAL_EPOCHS, BATCH_SIZE,
                             seed=SEED)
    data = source.round_data(0, execution.devices)
    (idx, mask), (n, ids) = data.sharded, data.plain
    cohort = CohortBatches(Batches(jnp.asarray(x_all[idx]), jnp.asarray(y_all[idx]),
                                   jnp.asarray(mask)), jnp.asarray(n), jnp.asarray(ids))
    return execution, model, params, data, cohort


def round_parser(doc: str):
    """The command line of a one-round benchmark on this workload: ``--per-round`` (K),
    ``--clients`` (N), ``--repeats``, ``--json``."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--per-round", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=NUM_CLIENTS)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    return parser


def round_record(benchmark: str, execution, per_round: int, rows: list, **extra) -> dict:
    """A one-round benchmark's JSON record: its name, time, machine, JAX versions, K, the
    execution and its ``rows`` (plus ``extra`` fields)."""
    return {"benchmark": benchmark, "time": common.now_iso(),
            "machine": common.machine_info(), "versions": common.versions("jax", "jaxlib"),
            "per_round": per_round, "devices": execution.devices,
            "execution": execution._asdict(), **extra, "rows": rows}
