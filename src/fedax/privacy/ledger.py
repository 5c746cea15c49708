"""A run's ε after any number of rounds, for a runner that reports ε per round and stops
before a budget is spent: ``PrivacyLedger`` (user level, DP-FedAvg's rounds) and
``ExampleLevelLedger`` (example-level DP-SGD in local training). Both ask
``fedax.privacy.accounting`` for every ε; nothing here imports JAX or the rest of fedax.
"""

from __future__ import annotations

import math

from fedax.privacy.accounting import (
    PLD_DISCRETIZATION,
    _common,
    _delta,
    _dp_accounting_version,
    _epsilon,
    _number,
    _rounds,
    describe,
    epsilon,
)


class PrivacyLedger:
    """ε of a run with fixed (z, q, δ) after any number of rounds, for a runner that reports
    ε per round and stops before a budget is exceeded::

        ledger = PrivacyLedger(1.0, 0.01, 1e-5)
        ledger.epsilon_after(100)        # ε after 100 rounds
        ledger.rounds_within(2.0)        # the most rounds whose ε <= 2.0

    Arguments as in ``epsilon``. Pure: ``epsilon_after`` is memoized per rounds value.
    """

    def __init__(self, noise_multiplier, sampling_probability: float, delta: float,
                 accountant: str = "rdp", *, sampling: str = "poisson",
                 population: int | None = None, extra_releases_per_round: int = 0,
                 pld_discretization: float = PLD_DISCRETIZATION):
        args = _common(noise_multiplier, sampling_probability, 0, accountant=accountant,
                       sampling=sampling, population=population,
                       extra_releases_per_round=extra_releases_per_round,
                       pld_discretization=pld_discretization)
        (self._zs, self.sampling_probability, _, self.accountant, self.sampling,
         self.population, self.extra_releases_per_round, self._discretization) = args
        self.noise_multiplier = self._zs[0] if len(self._zs) == 1 else self._zs
        self.delta = _delta(delta, self.population)
        self._cache: dict[int, float] = {}

    def epsilon_after(self, rounds: int) -> float:
        """ε after ``rounds`` rounds (0 for none)."""
        rounds = _rounds(rounds)
        if rounds not in self._cache:
            self._cache[rounds] = _epsilon(
                self._zs, self.sampling_probability, rounds, self.delta, self.accountant,
                self.sampling, self.population, self.extra_releases_per_round,
                self._discretization)
        return self._cache[rounds]

    def rounds_within(self, target_epsilon: float, max_rounds: int | None = None) -> int:
        """The largest T (at most ``max_rounds``, if given) with ``epsilon_after(T) <=
        target_epsilon``; 0 if even one round exceeds it. ε grows with T, so a doubling
        search then a bisection (about 2·log2 T evaluations: microseconds each with RDP,
        which scales one round's RDP; a PLD composition each with PLD, about a second at
        T = 1000 and the default discretization)."""
        target = _number("target_epsilon", target_epsilon)
        if math.isnan(target) or target < 0:
            raise ValueError(f"target_epsilon must be a number >= 0, got {target}")
        cap = _rounds(max_rounds) if max_rounds is not None else None
        if math.isinf(target) and cap is None:
            raise ValueError("an infinite target_epsilon needs max_rounds")
        if cap == 0 or self.epsilon_after(1) > target:
            return 0
        lo, hi = 1, 2
        while True:
            if cap is not None and hi >= cap:
                if self.epsilon_after(cap) <= target:
                    return cap
                hi = cap
                break
            if self.epsilon_after(hi) > target:
                break
            if hi >= 2 ** 62:
                return hi
            lo, hi = hi, 2 * hi
        while hi - lo > 1:  # epsilon_after(lo) <= target < epsilon_after(hi)
            mid = (lo + hi) // 2
            if self.epsilon_after(mid) <= target:
                lo = mid
            else:
                hi = mid
        return lo

    def describe(self) -> str:
        """What this ledger's ε assumes, in one line (see ``describe``)."""
        return describe(self._zs, self.sampling_probability, accountant=self.accountant,
                        sampling=self.sampling, population=self.population,
                        extra_releases_per_round=self.extra_releases_per_round)

    def __repr__(self) -> str:
        return (f"PrivacyLedger(noise_multiplier={self.noise_multiplier!r}, "
                f"sampling_probability={self.sampling_probability!r}, delta={self.delta!r}, "
                f"accountant={self.accountant!r}, sampling={self.sampling!r}, "
                f"population={self.population!r}, "
                f"extra_releases_per_round={self.extra_releases_per_round!r})")


class ExampleLevelLedger:
    """ε of example-level DP-SGD in local training (``fedax.client.dp_local_train``), for
    the record-level setting: a client with n_k examples, batch size B and E local epochs
    takes E·⌈n_k/B⌉ noisy steps per round, each over a batch of rate q_k = min(B/n_k, 1).

    Assumptions, stated because they are approximations: every round counts for every
    client (no amplification by client sampling: conservative), and the shuffled batches
    are accounted as Poisson-subsampled with rate q_k (the usual DP-SGD practice; shuffling
    is not Poisson sampling). ε is the largest over the clients' distinct sizes. RDP
    accountant (PLD at this many compositions is slow)."""

    def __init__(self, noise_multiplier: float, client_sizes, batch_size: float,
                 local_epochs: int, delta: float):
        self.noise_multiplier = _number("noise_multiplier", noise_multiplier)
        self.delta = _delta(delta, None)
        sizes = sorted({int(n) for n in client_sizes if int(n) > 0})
        if not sizes:
            raise ValueError("example-level accounting needs clients with data")
        self._groups = []
        for n in sizes:
            batch = n if math.isinf(batch_size) else min(int(batch_size), n)
            steps = local_epochs * math.ceil(n / batch)
            self._groups.append((min(batch / n, 1.0), steps))
        self._cache: dict[int, float] = {}

    def epsilon_after(self, rounds: int) -> float:
        rounds = _rounds(rounds)
        if rounds not in self._cache:
            self._cache[rounds] = max(
                epsilon(self.noise_multiplier, q, rounds * steps, self.delta)
                for q, steps in self._groups) if rounds else 0.0
        return self._cache[rounds]

    def rounds_within(self, target_epsilon: float, max_rounds: int) -> int:
        """The largest T ≤ ``max_rounds`` with ``epsilon_after(T) <= target_epsilon``."""
        lo, hi = 0, _rounds(max_rounds)
        if self.epsilon_after(hi) <= target_epsilon:
            return hi
        while hi - lo > 1:  # epsilon_after(lo) <= target < epsilon_after(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.epsilon_after(mid) <= target_epsilon else (lo, mid)
        return lo

    def describe(self) -> str:
        return (f"RDP accountant (dp-accounting {_dp_accounting_version()}); example level: "
                f"each local step a Gaussian (z = {self.noise_multiplier:g}) on a batch "
                "accounted as Poisson-subsampled at rate B/n_k, every round counted for "
                "every client (no client-sampling amplification); the largest ε over the "
                "clients' sizes")
