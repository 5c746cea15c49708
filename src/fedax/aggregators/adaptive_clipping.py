"""DP-FedAvg with an adaptive clip: quantile tracking (Andrew, Thakkar, McMahan, Ramaswamy,
NeurIPS 2021), as TF Privacy's ``QuantileAdaptiveClipSumQuery`` (geometric update) and TFF's
``gaussian_adaptive`` wire it.

State: the clip C^t (``QuantileClipState.clip``, initially C⁰). Each round, with m the
expected number of clients per round (the fixed denominator) and the accepted clients i
(weight > 0; all weigh 1):

1. client stage: b_i = 1[‖Δ_i‖₂ ≤ C^t] (the global norm; "unclipped"), and
   Δ̂_i = Δ_i · min(1, C^t/‖Δ_i‖₂); the client sends Δ̂_i and b_i − 0.5 (sensitivity 0.5);
2. reduction: Σ Δ̂_i (a zero-weight client is left out by selection);
3. server stage, from the aggregator's server key:

   * Δ̃ = (Σ Δ̂_i + N(0, (z_Δ·C^t)² I)) / m, the value returned;
   * b̄ = clamp((Σ(b_i − 0.5) + N(0, σ_b²)) / m + 0.5, 0, 1), the noisy unclipped fraction;
   * C^{t+1} = C^t · exp(−η_C (b̄ − γ)) (geometric, the default), or
     C^{t+1} = max(0, C^t − η_C (b̄ − γ)) (``geometric=False``, arithmetic).

   More updates unclipped than the target γ shrinks C; a geometric rate η_C changes C by
   at most a factor e^{η_C} per round. C^t (not C^{t+1}) sets this round's value noise.

Noise split: the total noise multiplier z is split between the value (z_Δ) and the count
(multiplier 2σ_b, since its sensitivity is 0.5) so that the two Gaussian mechanisms compose
to one with multiplier z: z_Δ = (z⁻² − (2σ_b)⁻²)^{−1/2} (``split_noise_multiplier``); it
needs z < 2σ_b. **For the accountant the pair is one Gaussian mechanism with multiplier z**
per round (``GaussianDpEvent(z)``, Poisson-sampled at q, composed over the rounds), exactly
as for ``dp_gaussian``; C^t only scales utility.

Choices where the sources are silent or differ:

* z = 0 means no noise anywhere (not private): σ_b defaults to 0 and an explicit σ_b > 0
  with z = 0 is a ValueError (it would buy no guarantee). The count is then exact: this is
  the non-private quantile tracker, with which C converges to the γ-quantile of the norms;
* z > 0 with σ_b = 0 is a ValueError (z ≥ 2σ_b: the count would be released exactly, so
  no split can make the pair z-private), as TFF raises;
* defaults: γ = 0.5, η_C = 0.2 (TF Privacy), C⁰ = 0.1, σ_b = m/20 when z > 0 (TFF);
* TFF warns when z_Δ/z ≥ 2 (the count eats most of the budget); so does this module.

Metrics (every round): ``clip_norm`` (C^t, the clip used this round), ``unclipped_fraction``
(b̄, noised when σ_b > 0: releasing it is covered by the privacy guarantee) and
``dp_noise_stddev`` (z_Δ·C^t/m, the noise std per coordinate of the average).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedax.aggregators.base import Aggregator
from fedax.aggregators.dp import (
    _add_noise,
    _clip_global,
    _non_negative,
    _number,
    _positive,
    _unit_weights,
)
from fedax.aggregators.mean import total


class QuantileClipState(NamedTuple):
    """The state of ``dp_adaptive_gaussian``.

    Attributes:
      clip: C^t, the clip the next round uses (float32 scalar).
    """

    clip: jax.Array


def split_noise_multiplier(noise_multiplier: float, clipped_count_stddev: float) -> float:
    """z_Δ = (z⁻² − (2σ_b)⁻²)^{−1/2}: the value's noise multiplier such that the value
    (multiplier z_Δ) and the unclipped count (std σ_b, sensitivity 0.5, so multiplier 2σ_b)
    together are one Gaussian mechanism with multiplier z: (z_Δ⁻² + (2σ_b)⁻²)^{−1/2} = z.

    z = 0 gives 0 (no noise). z > 0 needs z < 2σ_b (ValueError otherwise, σ_b = 0
    included). Warns when z_Δ ≥ 2z.
    """
    z = _non_negative("noise_multiplier", noise_multiplier)
    sigma_b = _non_negative("clipped_count_stddev", clipped_count_stddev)
    if z == 0:
        return 0.0
    if z >= 2 * sigma_b:
        raise ValueError(
            f"noise_multiplier z = {z} must be < 2·clipped_count_stddev = {2 * sigma_b}: the "
            "count's noise alone must leave budget for the value's "
            "(z_value = (z^-2 - (2 sigma_b)^-2)^-1/2); raise clipped_count_stddev (default "
            "expected_clients/20) or lower z.")
    z_value = (z ** -2 - (2 * sigma_b) ** -2) ** -0.5
    if z_value >= 2 * z:
        warnings.warn(
            f"the value's noise multiplier {z_value:.4g} is at least twice the total "
            f"{z}: the clipped count takes most of the privacy budget; consider a larger "
            "clipped_count_stddev.", stacklevel=2)
    return z_value


def dp_adaptive_gaussian(
    noise_multiplier: float,
    expected_clients: float,
    *,
    initial_clip: float = 0.1,
    target_quantile: float = 0.5,
    learning_rate: float = 0.2,
    clipped_count_stddev: float | None = None,
    geometric: bool = True,
) -> Aggregator:
    """DP-FedAvg with the quantile-tracking clip (see the module docstring).

    Args:
      noise_multiplier: z ≥ 0, the total multiplier of the round (value and count).
      expected_clients: m > 0, the fixed denominator (expected clients per round).
      initial_clip: C⁰ > 0.
      target_quantile: γ in [0, 1], the fraction of updates to leave unclipped.
      learning_rate: η_C ≥ 0.
      clipped_count_stddev: σ_b ≥ 0; default m/20 when z > 0, 0 when z = 0.
      geometric: the geometric update (default) or the arithmetic one.

    Returns:
      a complete ``Aggregator`` with state ``QuantileClipState``; metrics ``clip_norm``,
      ``unclipped_fraction``, ``dp_noise_stddev``.
    """
    z = _non_negative("dp_adaptive_gaussian noise_multiplier", noise_multiplier)
    m = _positive("dp_adaptive_gaussian expected_clients", expected_clients)
    c0 = _positive("dp_adaptive_gaussian initial_clip", initial_clip)
    gamma = _number("dp_adaptive_gaussian target_quantile", target_quantile)
    if not 0 <= gamma <= 1:
        raise ValueError(
            f"dp_adaptive_gaussian target_quantile must be in [0, 1], got {target_quantile!r}.")
    eta = _non_negative("dp_adaptive_gaussian learning_rate", learning_rate)
    if clipped_count_stddev is None:
        sigma_b = m / 20 if z > 0 else 0.0
    else:
        sigma_b = _non_negative("dp_adaptive_gaussian clipped_count_stddev",
                                clipped_count_stddev)
        if z == 0 and sigma_b > 0:
            raise ValueError(
                "dp_adaptive_gaussian with noise_multiplier 0 adds no noise anywhere; "
                f"clipped_count_stddev {clipped_count_stddev!r} would buy no guarantee: "
                "leave it None (or 0), or set noise_multiplier > 0.")
    z_value = split_noise_multiplier(z, sigma_b)

    def init(template):
        del template
        return QuantileClipState(jnp.asarray(c0, jnp.float32))

    def client(value, weight, state, key):
        del key
        clip = state.clip
        value, norm = _clip_global(value, clip)
        below = (norm <= clip).astype(jnp.float32) - 0.5
        below = jnp.where(weight > 0, below, jnp.zeros((), jnp.float32))
        return value, _unit_weights(weight), {"below": below}

    def server(value, stats, state, key):
        clip = state.clip
        value_key, count_key = (None, None) if key is None else jax.random.split(key)
        if z_value > 0:
            value = _add_noise(value_key, value, z_value * clip, "dp_adaptive_gaussian")
        value = jax.tree.map(lambda v: v / jnp.asarray(m, v.dtype), value)
        count = stats["below"]
        if sigma_b > 0:  # then z_value > 0: _add_noise has refused a None key
            assert count_key is not None
            count = count + sigma_b * jax.random.normal(count_key, (), jnp.float32)
        unclipped = jnp.clip(count / m + 0.5, 0.0, 1.0)
        if geometric:
            new_clip = clip * jnp.exp(-eta * (unclipped - gamma))
        else:
            new_clip = jnp.maximum(clip - eta * (unclipped - gamma), 0.0)
        metrics = {"clip_norm": clip, "unclipped_fraction": unclipped,
                   "dp_noise_stddev": z_value * clip / m}
        return value, QuantileClipState(new_clip.astype(jnp.float32)), metrics

    return Aggregator(init, client=client, reduce=total().reduce, server=server,
                      private=z > 0)
