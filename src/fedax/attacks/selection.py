"""Which clients attack: a fraction f of the population, chosen by seed."""

from __future__ import annotations

import numpy as np

_ATTACKER_STREAM = 0x61747461  # "atta"


def choose_attackers(num_clients: int, fraction: float, seed: int) -> np.ndarray:
    """The sorted int64 ids of ``round(fraction · num_clients)`` attackers drawn uniformly
    without replacement from the population ``[0, num_clients)``; a pure function of
    ``(num_clients, fraction, seed)`` (NumPy's ``default_rng([seed, "atta"])``, a stream
    apart from the cohort sampler's), so the same seed
    corrupts the same clients in every run and every aggregator compared."""
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise ValueError(f"num_clients must be a positive int, got {num_clients!r}.")
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"attacker fraction must be in [0, 1), got {fraction!r}.")
    count = int(round(fraction * num_clients))
    # A stream of its own: default_rng(seed) is also how a run draws cohorts, and the same
    # draw made round 1's cohort exactly the attackers (every client of it attacked).
    rng = np.random.default_rng([seed, _ATTACKER_STREAM])
    return np.sort(rng.choice(num_clients, size=count, replace=False)).astype(np.int64)


def attacker_table(attackers: np.ndarray, num_clients: int) -> np.ndarray:
    """bool ``[num_clients]``: True at each attacker's id."""
    attackers = np.asarray(attackers, np.int64)
    if attackers.size and (attackers.min() < 0 or attackers.max() >= num_clients):
        raise ValueError(f"attacker ids must lie in [0, {num_clients}), got {attackers}.")
    table = np.zeros(num_clients, bool)
    table[attackers] = True
    return table
