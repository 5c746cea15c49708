"""Partitioners: split a data set's examples among clients.

Each returns a list with one int64 array of example indices per client. Results depend only on
the arguments and the seed (an int or a ``np.random.Generator``), never on hash order.
"""

from __future__ import annotations

import numpy as np

Seed = int | np.random.Generator


def _check_counts(num_examples: int, num_clients: int) -> None:
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if num_examples < num_clients:
        raise ValueError(
            f"cannot give {num_clients} clients at least one example each from "
            f"{num_examples} examples"
        )


def iid(num_examples: int, num_clients: int, seed: Seed) -> list[np.ndarray]:
    """Shuffles all examples and splits them into near-equal client shares.

    McMahan et al.'s IID MNIST partition is ``iid(60000, 100, seed)``: 100 clients x 600. When
    ``num_clients`` does not divide ``num_examples``, sizes differ by at most one (the first
    ``num_examples % num_clients`` clients get one more), as in ``np.array_split``.

    Raises:
      ValueError: ``num_clients < 1`` or more clients than examples.
    """
    _check_counts(num_examples, num_clients)
    order = np.random.default_rng(seed).permutation(num_examples).astype(np.int64)
    return np.array_split(order, num_clients)


def pathological(
    labels: np.ndarray, num_clients: int, shards_per_client: int = 2, *, seed: Seed
) -> list[np.ndarray]:
    """McMahan et al.'s pathological non-IID partition: label-sorted shards.

    Examples are stably sorted by label and cut into ``num_clients * shards_per_client``
    contiguous shards of equal size; each client receives ``shards_per_client`` shards drawn
    at random without replacement. Client k's indices are its shards concatenated, each in
    sorted-label order. For MNIST (``num_clients=100``) this is 200 shards of 300.

    Raises:
      ValueError: Bad counts, or the number of shards does not divide the number of examples.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if shards_per_client < 1:
        raise ValueError(f"shards_per_client must be >= 1, got {shards_per_client}")
    num_examples = labels.shape[0]
    _check_counts(num_examples, num_clients)
    num_shards = num_clients * shards_per_client
    if num_examples % num_shards:
        raise ValueError(
            f"{num_shards} shards ({num_clients} clients x {shards_per_client}) do not divide "
            f"{num_examples} examples evenly"
        )
    shards = np.argsort(labels, kind="stable").astype(np.int64).reshape(num_shards, -1)
    assignment = np.random.default_rng(seed).permutation(num_shards)
    assignment = assignment.reshape(num_clients, shards_per_client)
    return [shards[row].reshape(-1) for row in assignment]


def _largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    """Integers proportional to ``weights`` summing exactly to ``total``."""
    raw = weights / weights.sum() * total
    counts = np.floor(raw).astype(np.int64)
    short = total - int(counts.sum())
    # Ties broken by position (stable), so the result is deterministic.
    counts[np.argsort(counts - raw, kind="stable")[:short]] += 1
    return counts


def unbalanced(
    num_examples: int, num_clients: int, seed: Seed, *, min_size: int = 1, sigma: float = 1.0
) -> list[np.ndarray]:
    """Shuffled examples split into client shares of log-normal sizes.

    Client k's size is ``min_size`` plus a share of the remaining examples proportional to
    ``w_k ~ LogNormal(0, sigma)`` (rounded by largest remainder), so sizes sum exactly to
    ``num_examples`` and every example is used once. ``sigma=0`` gives near-equal sizes.

    Raises:
      ValueError: ``min_size < 1``, ``sigma < 0``, or ``num_clients * min_size`` exceeds
        ``num_examples``.
    """
    if min_size < 1:
        raise ValueError(f"min_size must be >= 1, got {min_size}")
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    _check_counts(num_examples, num_clients)
    if num_clients * min_size > num_examples:
        raise ValueError(
            f"{num_clients} clients x min_size {min_size} exceeds {num_examples} examples"
        )
    rng = np.random.default_rng(seed)
    weights = rng.lognormal(0.0, sigma, size=num_clients)
    sizes = min_size + _largest_remainder(weights, num_examples - num_clients * min_size)
    order = rng.permutation(num_examples).astype(np.int64)
    return np.split(order, np.cumsum(sizes)[:-1])
