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


def _check_labels(labels) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    return labels


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    seed: Seed,
    *,
    min_size: int = 10,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Label-skewed partition: each class is split among clients in Dir(α·1) proportions.

    For every class c (in sorted label order), proportions p_c ~ Dir(α, ..., α) over the
    ``num_clients`` clients are drawn, the class's examples are shuffled, and client k receives
    a contiguous run of ``n_c p_ck`` of them (rounded by largest remainder, so every example is
    used exactly once). This is the per-class scheme common in the literature (Yurochkin et al.
    2019; Wang et al. 2020; NIID-Bench) and what "Dirichlet(α) over labels" usually means;
    Hsu et al. (2019) instead draw each *client's* class mix q_k ~ Dir(α·prior). Small α gives
    clients dominated by one or a few classes; large α approaches IID label proportions (with
    sizes near ``N / num_clients``).

    Small or empty clients: if some client receives fewer than ``min_size`` examples, all
    proportions are redrawn (continuing the same random stream), up to ``max_tries`` draws in
    total, as in NIID-Bench (which uses ``min_size=10``). ``min_size=0`` accepts the first
    draw, empty clients included. Sizes are random; only their sum (N) is fixed.

    Client k's indices are grouped by class, in sorted label order; within a class, in random
    order. Deterministic given the arguments and the seed.

    Args:
      labels: ``[N]`` class labels (any sortable dtype).
      num_clients: K >= 1.
      alpha: Concentration α > 0.
      seed: An int or a ``np.random.Generator``.
      min_size: Every client must get at least this many examples (>= 0).
      max_tries: Maximum number of full draws before giving up.

    Raises:
      ValueError: Bad arguments, ``num_clients * min_size > N``, or no draw in ``max_tries``
        gave every client ``min_size`` examples (lower ``min_size`` or raise ``alpha``).
    """
    labels = _check_labels(labels)
    num_examples = labels.shape[0]
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if not (alpha > 0 and np.isfinite(alpha)):
        raise ValueError(f"alpha must be finite and > 0, got {alpha!r}")
    if min_size < 0:
        raise ValueError(f"min_size must be >= 0, got {min_size}")
    if max_tries < 1:
        raise ValueError(f"max_tries must be >= 1, got {max_tries}")
    if num_clients * min_size > num_examples:
        raise ValueError(
            f"{num_clients} clients x min_size {min_size} exceeds {num_examples} examples"
        )
    rng = np.random.default_rng(seed)
    order = np.argsort(labels, kind="stable").astype(np.int64)
    _, class_counts = np.unique(labels, return_counts=True)
    class_members = np.split(order, np.cumsum(class_counts)[:-1])
    smallest = 0
    for _ in range(max_tries):
        counts = np.empty((len(class_counts), num_clients), np.int64)
        for c, n_c in enumerate(class_counts):
            counts[c] = _largest_remainder(rng.dirichlet(np.full(num_clients, alpha)), int(n_c))
        smallest = int(counts.sum(axis=0).min())
        if smallest >= min_size:
            break
    else:
        raise ValueError(
            f"dirichlet: in {max_tries} draws (alpha={alpha}, {num_clients} clients, "
            f"{num_examples} examples) some client always got fewer than min_size={min_size} "
            f"examples (last draw's smallest: {smallest}); lower min_size or raise alpha"
        )
    per_class = [
        np.split(rng.permutation(members), np.cumsum(row)[:-1])
        for members, row in zip(class_members, counts, strict=True)
    ]
    return [
        np.concatenate([chunks[k] for chunks in per_class]).astype(np.int64)
        for k in range(num_clients)
    ]


def similarity(labels: np.ndarray, num_clients: int, s: float, seed: Seed) -> list[np.ndarray]:
    """SCAFFOLD's s-similarity partition (Karimireddy et al. 2020): a share ``s`` is IID.

    ``s`` is a fraction in [0, 1] (``s=0.1`` is the paper's "10% similarity"). The examples are
    shuffled; the first ``round(s * N)`` of them (the IID part) are split into ``num_clients``
    near-equal shares, as in :func:`iid`. The rest are stably sorted by label (within a label,
    in shuffled order) and cut into ``num_clients`` contiguous near-equal chunks, as in
    :func:`pathological` with one shard per client; the chunks are dealt to clients in random
    order. Each client gets one IID share and one sorted chunk, so all sizes lie within 2 of
    ``N / num_clients`` (equal when ``num_clients`` divides both parts). ``s=1`` is
    :func:`iid`-like; ``s=0`` gives each client a label-sorted chunk of ``N / num_clients``
    examples (at most 2 labels each for MNIST with 100 clients).

    Client k's indices: its IID share, then its sorted chunk (in sorted-label order).

    Raises:
      ValueError: ``s`` outside [0, 1], ``num_clients < 1`` or more clients than examples.
    """
    labels = _check_labels(labels)
    num_examples = labels.shape[0]
    _check_counts(num_examples, num_clients)
    if not 0.0 <= s <= 1.0:
        raise ValueError(f"s must be a fraction in [0, 1], got {s!r}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(num_examples).astype(np.int64)
    num_iid = round(s * num_examples)
    shared, rest = order[:num_iid], order[num_iid:]
    rest = rest[np.argsort(labels[rest], kind="stable")]
    iid_shares = np.array_split(shared, num_clients)
    chunks = np.array_split(rest, num_clients)
    dealt = rng.permutation(num_clients)
    return [np.concatenate([iid_shares[k], chunks[dealt[k]]]) for k in range(num_clients)]
