"""The virtual clock of asynchronous simulation: client latencies, staleness weights, and
the blocks of client trips (``TripBlocks``).

Latencies follow FLSim's training-duration distributions
(``flsim/utils/timing/training_duration_distribution.py``; docs/references.md,
asynchronous aggregation), drawn per client trip (one draw each time a client trains), seeded:

* ``constant``: every trip takes ``mean``;
* ``half_normal`` (FLSim's PerUserHalfNormal): ``min + |N(0, sd²)|``;
* ``uniform`` (PerUserUniform): ``U(min, 2·mean − min)``;
* ``exponential`` (PerUserExponential): ``Exp`` with mean ``mean``;
* ``per_example_gaussian`` (PerExampleGaussian): ``n_k · max(N(mean, sd²), min)``, a
  duration per example, so a client with more data takes longer.

Trips are numbered j = 0, 1, 2, ... in the order clients start. They are drawn in blocks of
the cohort size C, the same blocks the synchronous runner's rounds are: trip j is client
``j mod C`` of block ``j // C`` (``PartitionSource.round_data(j // C)``: its client, its
shuffles), and block b's durations are ``Latency.durations(default_rng([seed, 0x6C6174,
b]), n_k)``. So synchronous round t (block t) waits ``max_k d_{t,k}``, and FedBuff with
K = C = concurrency and no spread runs exactly FedAvg's rounds.

Staleness weights (FLSim ``async_staleness_weights.py``; FedBuff, Nguyen et al. 2022): a
client that started on model version v and arrives when the server is at version v' has
staleness τ = v' − v, and its update is scaled by s(τ):

* ``constant``: s(τ) = 1 (FLSim's default);
* ``polynomial``: s(τ) = (1 + τ)^(−a), a ∈ [0, 1]; a = 0.5 gives FedBuff's 1/√(1 + τ);
* ``threshold``: s(τ) = 1 if τ ≤ cutoff, else ``value_after``.

FLSim further divides every weight by its value at ``avg_staleness`` (default 1); here
s(0) = 1 always (that constant factor is the server learning rate's), and s(τ) ≤ 1 for
every kind with ``value_after`` ≤ 1, which DP relies on (a scaled clipped update stays
within the clip).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedax.simulation.sources import PartitionSource

LATENCY_KINDS = ("constant", "half_normal", "uniform", "exponential", "per_example_gaussian")
STALENESS_KINDS = ("constant", "polynomial", "threshold")

LATENCY_STREAM = 0x6C6174  # "lat": the stream of the clients' trip durations


def _number(name: str, value: Any, low: float = 0.0, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) \
            or not math.isfinite(value) or (value <= low if strict else value < low):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {low}, "
                         f"got {value!r}.")
    return float(value)


class Latency(NamedTuple):
    """A client-trip duration distribution (see the module docstring).

    Attributes:
      kind: one of ``LATENCY_KINDS``.
      mean: the mean (``constant``, ``uniform``, ``exponential``; per example for
        ``per_example_gaussian``).
      sd: the standard deviation (``half_normal``, ``per_example_gaussian``).
      min: the lower bound (``half_normal``, ``uniform``; per example for
        ``per_example_gaussian``).
    """

    kind: str = "half_normal"
    mean: float = 1.0
    sd: float = 1.0
    min: float = 0.0

    def validate(self) -> Latency:
        if self.kind not in LATENCY_KINDS:
            raise ValueError(f"latency kind {self.kind!r} is not one of {LATENCY_KINDS}.")
        _number("latency mean", self.mean)
        _number("latency sd", self.sd)
        _number("latency min", self.min)
        if self.kind == "uniform" and self.min > self.mean:
            raise ValueError(f"uniform latency needs min <= mean (U(min, 2 mean - min)), got "
                             f"min={self.min}, mean={self.mean}.")
        if self.kind in ("constant", "exponential", "uniform") and self.mean <= 0:
            raise ValueError(f"{self.kind} latency needs mean > 0, got {self.mean}.")
        if self.kind == "half_normal" and self.sd == 0 and self.min == 0:
            raise ValueError("half_normal latency with sd = 0 and min = 0 makes every trip "
                             "take no time; set min > 0 (or sd > 0).")
        return self

    def durations(self, rng: np.random.Generator, num_examples: np.ndarray) -> np.ndarray:
        """float64 ``[C]`` trip durations of one block, ``num_examples`` its clients' n_k."""
        n = np.asarray(num_examples, np.float64)
        c: int = n.shape[0]  # (an int: numpy's size overloads then give arrays)
        if self.kind == "constant":
            return np.full(c, float(self.mean))
        if self.kind == "half_normal":
            return self.min + np.abs(rng.standard_normal(c)) * self.sd
        if self.kind == "uniform":
            return rng.uniform(self.min, 2.0 * self.mean - self.min, c)
        if self.kind == "exponential":
            return rng.exponential(self.mean, c)
        per_example = np.maximum(rng.normal(self.mean, self.sd, c), self.min)
        return n * per_example

    @property
    def spread(self) -> bool:
        """Whether trips can differ in duration (False: every trip takes ``mean``)."""
        return self.kind != "constant"


def block_durations(latency: Latency, seed: int, block: int,
                    num_examples: np.ndarray) -> np.ndarray:
    """The trip durations of block ``block`` (trips ``block·C ... block·C + C − 1``)."""
    rng = np.random.default_rng([int(seed), LATENCY_STREAM, int(block)])
    return latency.durations(rng, num_examples)


class Staleness(NamedTuple):
    """A staleness weighting s(τ) (see the module docstring).

    Attributes:
      kind: one of ``STALENESS_KINDS``.
      exponent: a of ``polynomial``, in [0, 1].
      cutoff: the largest τ with weight 1 under ``threshold``.
      value_after: the weight beyond the cutoff (``threshold``), in [0, 1].
    """

    kind: str = "polynomial"
    exponent: float = 0.5
    cutoff: int = 0
    value_after: float = 0.0

    def validate(self) -> Staleness:
        if self.kind not in STALENESS_KINDS:
            raise ValueError(f"staleness kind {self.kind!r} is not one of {STALENESS_KINDS}.")
        if not 0.0 <= _number("staleness exponent", self.exponent) <= 1.0:
            raise ValueError(f"staleness exponent must be in [0, 1] (FLSim's polynomial), got "
                             f"{self.exponent}.")
        if isinstance(self.cutoff, bool) or not isinstance(self.cutoff, (int, np.integer)) \
                or self.cutoff < 0:
            raise ValueError(f"staleness cutoff must be an int >= 0, got {self.cutoff!r}.")
        if not 0.0 <= _number("staleness value_after", self.value_after) <= 1.0:
            raise ValueError(f"staleness value_after must be in [0, 1], got "
                             f"{self.value_after}.")
        return self

    def weights(self, tau: Any) -> jnp.ndarray:
        """float32 s(τ) for integer staleness ``tau`` (any shape; traceable)."""
        tau = jnp.asarray(tau)
        t = tau.astype(jnp.float32)
        if self.kind == "constant":
            return jnp.ones_like(t)
        if self.kind == "polynomial":
            return jnp.power(1.0 + t, jnp.float32(-self.exponent))
        return jnp.where(tau <= self.cutoff, jnp.float32(1.0), jnp.float32(self.value_after))

    def scale(self, values: Any, tau: Any) -> tuple[Any, jnp.ndarray]:
        """``values`` (leaves ``[K, ...]``) each times its s(τ_k), and s(τ) ``[K]``; a
        constant weighting leaves the values as they are (bit for bit)."""
        weights = self.weights(tau)
        if self.kind == "constant":
            return values, weights
        return jax.tree.map(
            lambda v: v * weights.reshape(weights.shape + (1,) * (v.ndim - 1)).astype(v.dtype),
            values), weights


def fedbuff_staleness() -> Staleness:
    """FedBuff's s(τ) = 1/√(1 + τ) (polynomial, a = 0.5)."""
    return Staleness("polynomial", 0.5)


class TripBlocks:
    """The source's blocks of C trips (round b's cohort and durations, as the module
    docstring describes), cached: FedBuff's trips and ``SynchronousClock``'s rounds."""

    def __init__(self, source: PartitionSource, latency: Latency, seed: int):
        self.source, self.latency, self.seed = source, latency, seed
        self.cache: dict[int, tuple] = {}

    def get(self, block: int) -> tuple:
        if block not in self.cache:
            data = self.source.round_data(block, 1)
            idx, mask = data.sharded
            n, ids = data.plain
            real = data.real
            durations = block_durations(self.latency, self.seed, block, n[:real])
            self.cache[block] = (idx[:real], mask[:real], n[:real], ids[:real], durations)
        return self.cache[block]

    def size(self) -> int:
        return len(self.get(0)[2])

    def forget_below(self, block: int) -> None:
        for b in [b for b in self.cache if b < block]:
            del self.cache[b]
