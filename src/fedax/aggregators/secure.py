"""Secure aggregation: the server learns only the sum (Bonawitz et al. 2017; SecAgg+,
Bell et al. 2020; fedax.federated's ``secure_sum``).

``secure_mean(clip, max_weight)`` is FedAvg's weighted mean through secure aggregation,
as Flower's SecAgg+ uploads it: client k scales its weight to w̃_k = min(w_k/W, 1)
(W = ``max_weight``, e.g. the largest n_k) and sends the pair (c·w̃_k, w̃_k·x_k) through
one secure sum (each coordinate clipped to [−c, c] and quantized with step Δ = c/L); the
server divides:

    x̄ = Σ_k w̃_k x_k / Σ_k w̃_k,

exactly FedAvg's mean when every w_k ≤ W (the scale W cancels), to within the
quantization error: each sum is within n·Δ of its exact value per coordinate. A client
with w_k = 0 (rejected, or not counted) sends zeros. The range, bits and levels are
checked against the cohort size when the round is traced (``SecureSum.levels_for``).

``secure_total(spec)`` is the reduction alone (Σ_k x_k through a secure sum; the client
stage before it must have applied the weights), which ``dp_gaussian(..., secure=...)``
uses for central DP over secure aggregation. ``fedax.aggregators.distributed_dp`` adds the
noise on the clients instead, so that no party sees an unnoised sum.

In simulation these compute exactly what the protocol computes (same quantization from
the same keys); a networked runtime (``fedax.runtime``) runs SecAgg+ for any aggregator
whose ``secure`` field is set.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedax import federated as fed
from fedax.aggregators.base import Aggregator, ReduceFn, no_state
from fedax.aggregators.dp import _positive
from fedax.federated import SecureSum

WEIGHT = "weight"
VALUE = "value"


def secure_total(spec: SecureSum) -> Aggregator:
    """The reduction Σ_k x_k through a secure sum of range ``spec`` (weights ignored: a
    client stage before it applies them)."""
    if not isinstance(spec, SecureSum):
        raise ValueError(f"secure_total needs a fedax.federated.SecureSum, got {spec!r}.")
    return Aggregator(no_state, reduce=_total(spec), secure=spec)


def _total(spec: SecureSum) -> ReduceFn:
    """``secure_total``'s reduction."""

    def reduce(values, weights, state, key):
        del weights, state
        if spec.clip is None:
            return fed.modular_sum(values, spec.bits), {}
        return fed.secure_sum(values, spec, key), {}

    return reduce


def secure_mean(clip: float, max_weight: float, *, bits: int = 32,
                levels: int | None = None) -> Aggregator:
    """The weighted mean through secure aggregation (module docstring).

    Args:
      clip: c > 0, the range [−c, c] of every coordinate of a client's (weighted) value.
      max_weight: W > 0; weights above it count as W (set it to the largest n_k for
        FedAvg's exact weighting).
      bits: b, the modulus 2^b of the secure sum.
      levels: L quantization levels per side (None: the most the cohort allows).

    Metrics: ``secure_step`` (Δ, the quantization step of one coordinate).
    """
    clip = _positive("secure_mean clip", clip)
    max_weight = _positive("secure_mean max_weight", max_weight)
    spec = SecureSum(clip=clip, bits=bits, levels=levels)

    def client(value, weight, state, key):
        del state, key
        w = jnp.clip(jnp.asarray(weight, jnp.float32) / max_weight, 0.0, 1.0)
        w = jnp.where(weight > 0, w, 0.0)
        scaled = jax.tree.map(lambda v: jnp.where(w > 0, v * w.astype(v.dtype),
                                                  jnp.zeros((), v.dtype)), value)
        return {VALUE: scaled, WEIGHT: w * clip}, w, ()

    def server(total, stats, state, key):
        del stats, key
        weight = total[WEIGHT] / clip
        divisor = jnp.where(weight > 0, weight, 1.0)
        mean = jax.tree.map(lambda v: jnp.where(weight > 0, v / divisor.astype(v.dtype),
                                                jnp.zeros((), v.dtype)), total[VALUE])
        return mean, state, {}

    reduce = _total(spec)

    def reduce_with_step(values, weights, state, key):
        value, _ = reduce(values, weights, state, key)
        return value, {"secure_step": jnp.asarray(spec.step(weights.shape[0]), jnp.float32)}

    return Aggregator(no_state, client=client, reduce=reduce_with_step, server=server,
                      secure=spec)


__all__ = ["secure_mean", "secure_total"]
