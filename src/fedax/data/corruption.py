"""Corrupted client data: label noise confined to some clients.

:func:`mislabel_clients` corrupts the labels of a random subset of the clients of a
partition (a client whose annotator confused the classes), as in the FAD client-weights
experiment (``fedax.reproduce.hooks.fad_client_weights``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MISLABEL_MODES = ("permute", "random")
"""The ways :func:`mislabel_clients` corrupts a bad client's labels."""


def _derangement(rng: np.random.Generator, n: int) -> np.ndarray:
    """A uniformly random permutation of ``range(n)`` with no fixed point (n >= 2)."""
    while True:
        perm = rng.permutation(n)
        if not np.any(perm == np.arange(n)):
            return perm


def mislabel_clients(
    labels: np.ndarray,
    parts: list[np.ndarray],
    fraction: float,
    seed: int | Sequence[int] | np.random.Generator,
    mode: str = "permute",
    num_classes: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Corrupts the labels of ``round(fraction · K)`` clients chosen uniformly at random.

    Args:
      labels: int ``[N]`` labels of the whole data set (not modified).
      parts: the partition, ``parts[k]`` client k's example indices (disjoint).
      fraction: in [0, 1], the share of clients made bad.
      seed: an int, a sequence of ints (a ``np.random.SeedSequence``'s entropy) or a
        ``np.random.Generator``; the result is a function of it.
      mode: ``"permute"``: each bad client maps its labels through its own random
        derangement of the classes (every label changes, consistently within the client);
        ``"random"``: each label of a bad client is replaced by a uniformly random *other*
        class (every label changes, inconsistently).
      num_classes: the number of classes (default ``labels.max() + 1``).

    Returns:
      ``(new_labels, bad)``: a corrupted copy of ``labels`` (same dtype) and the sorted int64
      ids of the bad clients. Examples of good clients keep their labels.
    """
    if mode not in MISLABEL_MODES:
        raise ValueError(f"mode must be one of {MISLABEL_MODES}, got {mode!r}")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    labels = np.asarray(labels)
    classes = int(labels.max()) + 1 if num_classes is None else int(num_classes)
    if classes < 2:
        raise ValueError("mislabelling needs at least two classes")
    rng = np.random.default_rng(seed)
    num_bad = int(round(fraction * len(parts)))
    bad = np.sort(rng.choice(len(parts), size=num_bad, replace=False)).astype(np.int64)
    new = labels.copy()
    for k in bad:
        idx = np.asarray(parts[k], np.int64)
        if mode == "permute":
            new[idx] = _derangement(rng, classes)[labels[idx]]
        else:
            shift = rng.integers(1, classes, size=len(idx))
            new[idx] = (labels[idx] + shift) % classes
    return new.astype(labels.dtype), bad
