"""Distributed DP's parameters by TFF's rules (``DistributedDpSumFactory``; Kairouz et al.
2021): the wrap margin k from ``modclip_prob``, the padded dimension, the scale s, the local
noise variance and the sensitivities after conditional rounding (``fedax.aggregators.
distributed_dp``'s module docstring states the conditions they rest on)."""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from typing import Any

import numpy as np

from fedax.aggregators.dp import _non_negative, _positive

# --------------------------------------------------------------- parameters (TFF's rules)

MECHANISMS = ("skellam", "discrete_gaussian")
MAX_BITS = 22  # TFF's bound: the clients' and the decoder's float32 arithmetic
MAX_SCALE = 1e6  # TFF's MAX_SCALE_FACTOR: larger scales gain nothing and overflow int32
NORM_LEEWAY = 1e-5  # relative; covers the float32 norm check (``conditional_round``)


@dataclasses.dataclass(frozen=True)
class DistributedDpParams:
    """One round of ``distributed_dp`` on a ``dim``-coordinate update; the noise and the
    sensitivities are in the scaled (integer) domain, what
    ``fedax.privacy.distributed.distributed_epsilon`` reads.

    Attributes:
      mechanism: ``"skellam"`` or ``"discrete_gaussian"``.
      clip: C, the L2 bound of a client's update before scaling.
      noise_multiplier: z, the central-equivalent multiplier of the n summed shares.
      expected_clients: n, the number of shares the noise is split into.
      bits: b, the modulus 2^b of the secure sum.
      dim: the update's number of coordinates.
      padded_dim: d' = 2^⌈log₂ dim⌉, the rotated (noised, sent) vector's length.
      beta: β of conditional randomized rounding (0: unconditional).
      modclip_prob: p, the per-coordinate modular-wrap probability the scale aims for.
      k_stddevs: k = Φ⁻¹(1 − p/2).
      scale: s.
      local_variance: one client's noise variance per coordinate, (z·C·s)²/n (for the
        discrete Gaussian: the σ² of its N_ℤ(0, σ²) shares).
      rounding_bound: the bound a client checks its rounded vector's L2 norm against,
        s·``inflated_l2_bound``(C, 1/s, β, d').
      l2_sensitivity: Δ₂ = ``rounding_bound``·(1 + 10⁻⁵) (the check's float32 leeway).
      l1_sensitivity: Δ₁ = min(√d'·Δ₂, Δ₂²) (integer vectors).
    """

    mechanism: str
    clip: float
    noise_multiplier: float
    expected_clients: int
    bits: int
    dim: int
    padded_dim: int
    beta: float
    modclip_prob: float
    k_stddevs: float
    scale: float
    local_variance: float
    rounding_bound: float
    l2_sensitivity: float
    l1_sensitivity: float

    @property
    def central_variance(self) -> float:
        """The summed noise's variance per coordinate, n·σ² = (z·C·s)² (integer units)."""
        return self.expected_clients * self.local_variance


def _whole(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be a whole number, got {value!r}.")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value!r}.")
    return int(value)


def _clients(value: Any) -> int:
    """n as an int: a whole number ≥ 1, given as an int or an integral float."""
    whole = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, bool) and math.isfinite(value) and float(value).is_integer()
    if not whole or value < 1:
        raise ValueError(f"distributed_dp expected_clients must be a whole number >= 1 (the "
                         f"number of noise shares), got {value!r}; round a fractional "
                         f"expected cohort down (fewer, larger shares).")
    return int(value)


def modclip_stddevs(modclip_prob: float) -> float:
    """k = Φ⁻¹(1 − p/2): the standard deviations of a normal sum inside ±2^{b−1} for a
    two-sided wrap probability p per coordinate (TFF's ``_clip_prob_to_num_stddevs``)."""
    p = _non_negative("distributed_dp modclip_prob", modclip_prob)
    if not 0 < p < 1:
        raise ValueError(f"distributed_dp modclip_prob must be in (0, 1), got {modclip_prob!r}.")
    return statistics.NormalDist().inv_cdf(1 - p / 2)


def check_bits(bits: int, expected_clients: int, modclip_prob: float) -> float:
    """Validate b for n clients (2^b ≥ n and 2^{2b} > n·k²); returns k. The ValueError
    names the smallest b that works."""
    b = _whole("distributed_dp bits", bits, 1, MAX_BITS)
    n = _clients(expected_clients)
    k = modclip_stddevs(modclip_prob)
    if 2 ** b < n or 2 ** (2 * b) <= n * k * k:
        need = max(math.ceil(math.log2(n)), math.floor(math.log2(n * k * k) / 2) + 1)
        hint = (f"raise bits to at least {need}" if need <= MAX_BITS
                else f"no bits <= {MAX_BITS} fit, so lower expected_clients")
        raise ValueError(
            f"distributed_dp bits={b} is too small for {n} expected clients at "
            f"modclip_prob={modclip_prob}: the sum needs 2^bits >= n and 2^(2*bits) > "
            f"n*k^2 (k = {k:.3g}); {hint}, lower expected_clients or raise modclip_prob.")
    return k


def padded_dim(dim: int) -> int:
    """2^⌈log₂ dim⌉, the length of the Hadamard-rotated vector."""
    d = _whole("distributed_dp dimension", dim, 1)
    return 1 << (d - 1).bit_length()


def inflated_l2_bound(clip: float, gamma: float, beta: float, dim: int) -> float:
    """The L2 bound after (conditional) randomized rounding of a vector of norm ≤ ``clip``
    to the grid γℤ^d (Kairouz et al. 2021, §4.1; TFF's ``inflated_l2_norm_bound``):
    min(C + γ√d, sqrt(C² + γ²d/4 + sqrt(2 ln(1/β))·γ·(C + γ√d/2))); β = 0: the first."""
    bound_1 = clip + gamma * math.sqrt(dim)
    if beta == 0:
        return bound_1
    bound_2 = math.sqrt(clip ** 2 + gamma ** 2 * dim / 4 + math.sqrt(2 * math.log(1 / beta))
                        * gamma * (clip + gamma * math.sqrt(dim) / 2))
    return min(bound_1, bound_2)


@functools.lru_cache(maxsize=256)
def distributed_dp_params(
    clip: float,
    noise_multiplier: float,
    expected_clients: int,
    dim: int,
    *,
    bits: int = 20,
    mechanism: str = "skellam",
    beta: float = math.exp(-0.5),
    modclip_prob: float = 1e-4,
) -> DistributedDpParams:
    """``distributed_dp``'s scale, local noise and sensitivities for an update of ``dim``
    coordinates (module docstring): s = sqrt(2^{2b} − n k²)/(2k·sqrt((nC)²/d' + z²C²)), at
    most 10⁶. Raises a ValueError when b cannot hold the cohort's sum. Memoized."""
    c = _positive("distributed_dp clip", clip)
    z = _non_negative("distributed_dp noise_multiplier", noise_multiplier)
    if mechanism not in MECHANISMS:
        raise ValueError(f"distributed_dp mechanism must be one of {MECHANISMS}, got "
                         f"{mechanism!r}.")
    beta = _non_negative("distributed_dp beta", beta)
    if not beta < 1:
        raise ValueError(f"distributed_dp beta must be in [0, 1), got {beta!r}.")
    k = check_bits(bits, expected_clients, modclip_prob)
    n, d = _clients(expected_clients), padded_dim(dim)
    numerator = math.sqrt(2.0 ** (2 * bits) - n * k * k)
    denominator = 2 * k * math.sqrt((n * c) ** 2 / d + (z * c) ** 2)
    s = min(numerator / denominator, MAX_SCALE)
    bound = s * inflated_l2_bound(c, 1 / s, beta, d)
    l2 = bound * (1 + NORM_LEEWAY)
    return DistributedDpParams(
        mechanism=mechanism, clip=c, noise_multiplier=z, expected_clients=n, bits=int(bits),
        dim=int(dim), padded_dim=d, beta=beta, modclip_prob=float(modclip_prob),
        k_stddevs=k, scale=s, local_variance=(z * c * s) ** 2 / n, rounding_bound=bound,
        l2_sensitivity=l2, l1_sensitivity=min(math.sqrt(d) * l2, l2 * l2))
