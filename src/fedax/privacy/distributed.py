"""ε for distributed DP on secure aggregation (``fedax.aggregators.distributed_dp``).

Each of the n expected clients clips its update to L2 norm C, rotates it, scales it by s,
rounds it to integers, adds an integer noise share of its own and reduces mod 2^b; secure
aggregation reveals only the modular sum. The aggregator's parameters for a d-coordinate
update (``fedax.aggregators.distributed_dp.distributed_dp_params``: s, the local noise
variance, the sensitivities; TFF's rules) are all this accountant reads, by their field
names, in the scaled (integer) domain, d the padded dimension:

* **sensitivity**: every client's rounded vector has L2 norm ≤ Δ₂ (checked on the client,
  with a 10⁻⁵ leeway for the check's float32 error) and, being integer, L1 norm
  ≤ Δ₁ = min(√d·Δ₂, Δ₂²). Neighbouring rounds differ in one participant's integer vector,
  replaced by zeros while that participant still adds its noise share (Kairouz et al.'s and
  TFF's relation), so Δ₁, Δ₂ bound the change of the summed vector.
* **Skellam** (Agarwal, Kairouz, Liu, NeurIPS 2021): the n shares sum to Sk(μ/2, μ/2) per
  coordinate exactly (Skellam is closed under sums), μ = n·σ² = (z·C·s)². Its RDP at integer
  α > 1 (their multi-dimensional Skellam bound, in the form of TFF's / the authors'
  ``skellam_rdp`` accounting):
  ε(α) = α Δ₂²/(2μ) + min(((2α − 1)Δ₂² + 6Δ₁)/(4μ²), 3Δ₁/(2μ)).
  The first term is the Gaussian's α/(2z'²) with z' = sqrt(μ)/Δ₂; the rest vanishes as μ
  grows, so with fine quantization (Δ₂ → s·C) the ε tends to the central Gaussian's with
  the same z.
* **distributed discrete Gaussian** (Kairouz, Liu, Steinke, ICML 2021, Theorem 1 and
  Proposition 14, in the form of the authors' ``accounting_utils``): n shares N_ℤ(0, σ²)^d,
  σ ≥ 1/2, τ = 10·Σ_{k=1}^{n−1} exp(−2π²σ²·k/(k+1)), ε₂ = Δ₂/(√n σ), ε₁ = Δ₁/(√n σ):
  ε(α) = min(α ε₂²/2 + τd, α(ε₂² + 2ε₁τ + τ²d)/2, α(ε₂ + τ√d)²/2).
  With n = 1, τ = 0 and this is the discrete Gaussian's ½ε₂²-concentrated DP (Canonne,
  Kamath, Steinke 2020), which dp-accounting's ``GaussianDpEvent(σ/Δ₂)`` models exactly.

Composition and conversion: T rounds add their RDP (``rounds`` times one round's curve, at
integer orders) and dp-accounting's ``rdp.compute_epsilon`` turns the curve into (ε, δ).
**No subsampling amplification** is claimed: each round is accounted as if its cohort were
fixed and public. The noise is calibrated to n = ``expected_clients`` shares; a round in
which only m < n clients added noise has multiplier z·sqrt(m/n) and a larger ε than
reported here (the aggregator reports ``noised_clients`` every round).

Nothing here imports JAX or the rest of fedax.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Protocol

import numpy as np
from dp_accounting import rdp

MECHANISMS = ("skellam", "discrete_gaussian")
# Integer orders: the Skellam bound is stated for integer α.
ORDERS = tuple(range(2, 65)) + tuple(range(72, 257, 8)) + (320, 384, 448, 512, 640, 768,
                                                           896, 1024)


class MechanismParams(Protocol):
    """What the accountant reads of one round (``distributed_dp_params``' fields), in the
    scaled integer domain."""

    mechanism: str
    noise_multiplier: float
    expected_clients: int
    padded_dim: int
    local_variance: float
    l2_sensitivity: float
    l1_sensitivity: float


def _orders(orders: Sequence[int]) -> np.ndarray:
    out = np.asarray(orders, dtype=np.float64)
    if out.ndim != 1 or not out.size or np.any(out < 2) or np.any(out != np.round(out)):
        raise ValueError("RDP orders must be whole numbers >= 2.")
    return out


def skellam_rdp(orders: Sequence[int], *, l1_sensitivity: float, l2_sensitivity: float,
                variance: float) -> np.ndarray:
    """RDP of the multi-dimensional Skellam mechanism Sk(μ/2, μ/2)^d, μ = ``variance``,
    for integer queries with L1/L2 sensitivities Δ₁, Δ₂ (Agarwal et al. 2021; module
    docstring), at integer ``orders``. μ = 0 gives inf."""
    a = _orders(orders)
    if variance <= 0:
        return np.full(a.shape, np.inf)
    d1, d2sq, mu = float(l1_sensitivity), float(l2_sensitivity) ** 2, float(variance)
    return a * d2sq / (2 * mu) + np.minimum(((2 * a - 1) * d2sq + 6 * d1) / (4 * mu ** 2),
                                            3 * d1 / (2 * mu))


def discrete_gaussian_tau(local_stddev: float, num_clients: int) -> float:
    """τ = 10·Σ_{k=1}^{n−1} exp(−2π²σ²·k/(k+1)) of Kairouz et al.'s Theorem 1."""
    k = np.arange(1, int(num_clients), dtype=np.float64)
    return float(10 * np.sum(np.exp(-2 * math.pi ** 2 * local_stddev ** 2 * k / (k + 1))))


def discrete_gaussian_rdp(orders: Sequence[int], *, l1_sensitivity: float,
                          l2_sensitivity: float, local_stddev: float, num_clients: int,
                          dim: int) -> np.ndarray:
    """RDP of the sum of ``num_clients`` shares N_ℤ(0, σ²)^d, σ = ``local_stddev`` ≥ 1/2
    (Kairouz et al. 2021, Proposition 14; module docstring), at integer ``orders``. σ = 0
    gives inf."""
    a = _orders(orders)
    if local_stddev <= 0:
        return np.full(a.shape, np.inf)
    if local_stddev < 0.5:
        raise ValueError(f"the distributed discrete Gaussian bound needs a local stddev >= 1/2 "
                         f"(integer units), got {local_stddev:.3g}; raise the noise "
                         f"multiplier or use mechanism='skellam'.")
    tau = discrete_gaussian_tau(local_stddev, num_clients)
    central = math.sqrt(num_clients) * local_stddev
    e2, e1 = l2_sensitivity / central, l1_sensitivity / central
    return np.minimum.reduce([a * e2 ** 2 / 2 + tau * dim,
                              a * (e2 ** 2 + 2 * e1 * tau + tau ** 2 * dim) / 2,
                              a * (e2 + tau * math.sqrt(dim)) ** 2 / 2])


def round_rdp(params: MechanismParams,
              orders: Sequence[int] = ORDERS) -> tuple[np.ndarray, np.ndarray]:
    """``(orders, rdp)`` of one round of ``params``' mechanism (no amplification)."""
    if params.mechanism == "skellam":
        curve = skellam_rdp(orders, l1_sensitivity=params.l1_sensitivity,
                            l2_sensitivity=params.l2_sensitivity,
                            variance=params.expected_clients * params.local_variance)
    elif params.mechanism == "discrete_gaussian":
        curve = discrete_gaussian_rdp(
            orders, l1_sensitivity=params.l1_sensitivity,
            l2_sensitivity=params.l2_sensitivity,
            local_stddev=math.sqrt(params.local_variance),
            num_clients=params.expected_clients, dim=params.padded_dim)
    else:
        raise ValueError(f"unknown distributed DP mechanism {params.mechanism!r}; allowed: "
                         f"{MECHANISMS}.")
    return _orders(orders), curve


def distributed_epsilon(params: MechanismParams, rounds: int, delta: float,
                        orders: Sequence[int] = ORDERS) -> float:
    """ε after ``rounds`` rounds of ``params`` (``distributed_dp_params``' result) at
    ``delta``: T times one round's RDP, converted by dp-accounting's
    ``rdp.compute_epsilon``. No subsampling amplification; z = 0 gives inf, rounds = 0
    gives 0."""
    if isinstance(rounds, bool) or not isinstance(rounds, numbers.Integral) or rounds < 0:
        raise ValueError(f"rounds must be a whole number >= 0, got {rounds!r}.")
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not 0 < delta < 1:
        raise ValueError(f"delta must be a number in (0, 1), got {delta!r}.")
    if rounds == 0:
        return 0.0
    if params.noise_multiplier == 0:
        return math.inf
    a, curve = round_rdp(params, orders)
    return float(rdp.compute_epsilon(a, int(rounds) * curve, float(delta))[0])


__all__ = [
    "MECHANISMS",
    "ORDERS",
    "MechanismParams",
    "discrete_gaussian_rdp",
    "discrete_gaussian_tau",
    "distributed_epsilon",
    "round_rdp",
    "skellam_rdp",
]
