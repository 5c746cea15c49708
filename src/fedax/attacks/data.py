"""Data-level attacks: the attackers train honestly on corrupted data.

* **Label flipping** (ByzFL's client; docs/references.md, robust aggregation and attacks):
  every example of an attacker is relabelled y' = (K − 1) − y, K the number of classes.
* **Backdoor** (Sun, Kairouz, Suresh, McMahan 2019's setting on MNIST digits, with a pixel
  trigger in the manner of Bagdasaryan et al.): a fraction of each attacker's examples gets
  the trigger, a white ``size × size`` square one pixel from the bottom-right corner, and
  the target label. Its success rate is the share of the test examples whose true label is
  not the target that, with the trigger, are classified as the target
  (``backdoor_test_set`` gives those inputs and the target labels, so any accuracy
  evaluator measures it).

All functions return new arrays (the inputs are not modified) and are pure functions of
their arguments and ``seed``.
"""

from __future__ import annotations

import numpy as np


def flip_labels(labels: np.ndarray, parts: list[np.ndarray], attackers: np.ndarray,
                num_classes: int) -> np.ndarray:
    """A copy of ``labels`` with every example of the clients ``attackers`` (ids into
    ``parts``) relabelled (K − 1) − y."""
    if num_classes < 2:
        raise ValueError(f"label flipping needs num_classes >= 2, got {num_classes}.")
    out = np.array(labels, copy=True)
    for k in np.asarray(attackers, np.int64):
        idx = np.asarray(parts[k], np.int64)
        out[idx] = (num_classes - 1) - np.asarray(labels)[idx]
    return out.astype(np.asarray(labels).dtype)


def add_trigger(x: np.ndarray, size: int = 4, value: float = 1.0) -> np.ndarray:
    """A copy of images ``x [N, H, W, ...]`` with the trigger: pixels
    ``[H−size−1 : H−1, W−size−1 : W−1]`` set to ``value`` (1.0: white for fedax's MNIST
    in [0, 1]; the same value in training and at test time)."""
    x = np.array(x, copy=True)
    if x.ndim < 3 or size < 1 or size + 1 > min(x.shape[1], x.shape[2]):
        raise ValueError(f"add_trigger needs images [N, H, W, ...] larger than size+1 = "
                         f"{size + 1}, got shape {x.shape}.")
    x[:, -size - 1:-1, -size - 1:-1, ...] = np.asarray(value, x.dtype)
    return x


def poison_backdoor(x: np.ndarray, y: np.ndarray, parts: list[np.ndarray],
                    attackers: np.ndarray, target: int, poison_fraction: float = 0.5,
                    seed: int = 0, size: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` copies where, for each attacker, ``round(poison_fraction · n_k)`` of its
    examples (chosen by ``seed``) carry the trigger and the label ``target``."""
    if not 0.0 < poison_fraction <= 1.0:
        raise ValueError(f"poison_fraction must be in (0, 1], got {poison_fraction!r}.")
    x_out, y_out = np.array(x, copy=True), np.array(y, copy=True)
    rng = np.random.default_rng(seed)
    for k in np.asarray(attackers, np.int64):
        idx = np.asarray(parts[k], np.int64)
        chosen = rng.choice(idx, size=int(round(poison_fraction * len(idx))), replace=False)
        if chosen.size:
            x_out[chosen] = add_trigger(x[chosen], size)
            y_out[chosen] = target
    return x_out, y_out


def backdoor_test_set(x_test: np.ndarray, y_test: np.ndarray, target: int,
                      size: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """The backdoor's test inputs: every test example whose label is not ``target``, with
    the trigger, labelled ``target``; the accuracy on it is the backdoor success rate."""
    keep = np.asarray(y_test) != target
    xs = add_trigger(np.asarray(x_test)[keep], size)
    return xs, np.full(int(keep.sum()), target, np.asarray(y_test).dtype)
