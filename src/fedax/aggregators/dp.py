"""User-level differential privacy: DP-FedAvg's Gaussian aggregator (McMahan et al., ICLR 2018).

``dp_gaussian(S, z, D)`` is a complete aggregator (pass it as ``aggregator=`` to any
algorithm). Each round, over the accepted clients k (weight > 0):

1. client stage: clip the update to L2 norm S,

   * flat (``per_layer=False``): Δ_k ← Δ_k · min(1, S/‖Δ_k‖₂), the global norm over every
     leaf (FlatClip; TF Privacy's ``GaussianSumQuery``);
   * per layer (``per_layer=True``): leaf j is clipped on its own to
     S_j = S·sqrt(d_j/d) (d_j its size, d the total), TFF's allocation, so that
     sqrt(Σ_j S_j²) = S and the whole update still has norm ≤ S (PerLayerClip);

   and set its weight w_k: ``weighting="uniform"``: w_k = 1 (TFF's ``gaussian_fixed``);
   ``weighting="capped"``: w_k = min(n_k/ŵ, 1) with ŵ = ``example_cap`` and n_k the weight
   the algorithm hands in (FedAvg's n_k), the paper's weights. Either way w_k ≤ 1, so one
   client moves the weighted sum by at most S;
2. reduction: the sum Σ_k w_k Δ_k (a zero-weight client, e.g. one the server rejected, is
   left out by selection, ``aggregators.total``); a secure-aggregation sum in a real runtime;
3. server stage: add N(0, (z·S)² I) to the sum, on every coordinate (per-layer included:
   the sensitivity of the whole vector is S), drawn from the aggregator's server key (the
   round key: same key, same noise), and divide by the **fixed** denominator D = q·W
   (the paper's f̃_f estimator). With uniform weights D is the expected number of
   clients per round m = qK; with capped weights D = q·Σ_k min(n_k/ŵ, 1) over the whole
   population. The result's noise has standard deviation σ = z·S/D per coordinate.

Privacy: each round is one Gaussian mechanism with noise multiplier z (sensitivity S of the
sum under adding or removing one client); with Poisson sampling at rate q and T rounds the
accountant composes ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` T times
(``dp_accounting``). S and D only scale utility. The fixed denominator matters: dividing
by the realised cohort weight would leak the cohort's size.

Metrics (every round):

* ``clipped_clients``: accepted clients whose update was clipped (per layer: any leaf).
  A *diagnostic, not privatised*: do not publish it as part of a DP release;
* ``dp_noise_stddev``: σ = z·S/D, the noise standard deviation per coordinate of the
  aggregate (of the average, not of the sum).

Shared helpers for the other DP aggregators (``adaptive_clipping``, ``adaclip``) live
here too.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax

from fedax import federated as fed
from fedax.aggregators.base import Aggregator, no_state
from fedax.federated import SecureSum, dp_clip, dp_noise
from fedax.federated._dp import _non_negative, _number, _positive  # noqa: F401 (shared)

Weighting = Literal["uniform", "capped"]


# ----------------------------------------------------------------------------- helpers


def _unit_weights(weight: jax.Array) -> jax.Array:
    """1 for a client that counts (weight > 0), 0 otherwise, in ``weight``'s dtype."""
    return jnp.where(weight > 0, 1, 0).astype(weight.dtype)


def _scale_tree(tree: Any, factor: jax.Array) -> Any:
    return jax.tree.map(lambda v: v * factor.astype(v.dtype), tree)


def _clip_global(tree: Any, bound: jax.Array | float) -> tuple[Any, jax.Array]:
    """``tree`` scaled to global L2 norm at most ``bound``, and its norm before."""
    norm = optax.tree.norm(tree)
    factor = jnp.minimum(1.0, bound / jnp.maximum(norm, 1e-30))
    return _scale_tree(tree, factor), norm


def _gaussian_noise(key: jax.Array | None, like: Any, stddev: jax.Array | float, what: str):
    """N(0, stddev²) per coordinate, one pytree shaped and typed like ``like``."""
    if key is None:
        raise ValueError(
            f"{what} adds noise and needs a key: run the aggregator with a round key "
            "(aggregate(..., key) / alg.round(state, cohort, key)), not None.")
    leaves, treedef = jax.tree.flatten(like)
    keys = jax.random.split(key, len(leaves))
    noise = [jax.random.normal(k, jnp.shape(leaf), jnp.result_type(leaf))
             * jnp.asarray(stddev, jnp.result_type(leaf))
             for k, leaf in zip(keys, leaves, strict=True)]
    return jax.tree.unflatten(treedef, noise)


def _add_noise(key, value, stddev, what):
    noise = _gaussian_noise(key, value, stddev, what)
    return jax.tree.map(jnp.add, value, noise)


def per_layer_clips(template: Any, clip: float) -> list[float]:
    """TFF's per-layer allocation S_j = S·sqrt(d_j/d) for the leaves of ``template`` (in
    ``jax.tree.leaves`` order), so that sqrt(Σ_j S_j²) = S."""
    sizes = [math.prod(jnp.shape(leaf)) for leaf in jax.tree.leaves(template)]
    d = sum(sizes)
    if d == 0:
        raise ValueError("per-layer clipping needs a value with at least one coordinate.")
    return [clip * math.sqrt(d_j / d) for d_j in sizes]


# ------------------------------------------------------------------------- the aggregator


def dp_gaussian(
    clip: float,
    noise_multiplier: float,
    denominator: float,
    *,
    per_layer: bool = False,
    weighting: Weighting = "uniform",
    example_cap: float | None = None,
    secure: SecureSum | int | None = None,
) -> Aggregator:
    """DP-FedAvg's Gaussian aggregator with a fixed denominator (see the module docstring).

    Args:
      clip: S > 0, the L2 bound of one client's (weighted) contribution.
      noise_multiplier: z ≥ 0; the noise added to the sum has std z·S (z = 0: no noise,
        not private; then no key is needed).
      denominator: D > 0, the fixed q·W; with ``weighting="uniform"`` the expected number of
        clients per round.
      per_layer: clip each leaf j to S·sqrt(d_j/d) instead of the whole update to S.
      weighting: ``"uniform"`` (w_k = 1, TFF's ``gaussian_fixed``) or ``"capped"``
        (w_k = min(n_k/ŵ, 1), McMahan et al.), n_k being the incoming weight.
      example_cap: ŵ > 0, needed by (and only by) ``weighting="capped"``.
      secure: sum through secure aggregation (``fedax.federated.secure_sum``): a
        ``SecureSum``, or its number of bits with the clip range [−S, S] per coordinate
        (no clipped coordinate exceeds S). The server then sees only the sum (and noises
        it); distributed DP (``distributed_dp``) keeps the sum noised even from it.

    Returns:
      a stateless, complete ``Aggregator``; metrics ``clipped_clients``, ``dp_noise_stddev``.
    """
    clip = _positive("dp_gaussian clip", clip)
    z = _non_negative("dp_gaussian noise_multiplier", noise_multiplier)
    denominator = _positive("dp_gaussian denominator", denominator)
    if weighting not in ("uniform", "capped"):
        raise ValueError(
            f"dp_gaussian weighting must be 'uniform' or 'capped', got {weighting!r}.")
    if weighting == "capped":
        if example_cap is None:
            raise ValueError("dp_gaussian weighting='capped' needs example_cap (ŵ > 0).")
        cap = _positive("dp_gaussian example_cap", example_cap)
    elif example_cap is not None:
        raise ValueError(
            "dp_gaussian example_cap applies to weighting='capped' only; uniform weights "
            "ignore the clients' sizes.")

    def contribution_weight(weight):
        if weighting == "uniform":
            return _unit_weights(weight)
        weight = weight.astype(jnp.result_type(weight, jnp.float32))
        w = jnp.minimum(weight / jnp.asarray(cap, weight.dtype), 1)
        return jnp.where(weight > 0, w, jnp.zeros((), w.dtype))

    def client(value, weight, state, key):
        del state, key
        if per_layer:
            norms = [optax.tree.norm(leaf) for leaf in jax.tree.leaves(value)]
            bits = [n > b for n, b in zip(norms, per_layer_clips(value, clip), strict=True)]
            was_clipped = jnp.any(jnp.stack(bits)) if bits else jnp.asarray(False)
        else:
            was_clipped = optax.tree.norm(value) > clip
        w = contribution_weight(weight)
        # the clip (a marker primitive the audit recognises) applies w ≤ 1 too, so what
        # leaves the client already moves the sum by at most S
        value = dp_clip(value, clip, client_placed=False, weights=w, per_layer=per_layer)
        counted = jnp.logical_and(was_clipped, weight > 0)
        # the weight is in the value now: a later reduction that weighs (dp_compressed's
        # sum) must not apply it twice
        return value, _unit_weights(w), {"clipped": counted.astype(jnp.int32)}

    if secure is None:
        def sum_reduce(values, weights, state, key):
            del weights, state, key  # weighted (and zeroed where w = 0) by the clip
            return fed.sum(values), {}
    else:
        spec = secure if isinstance(secure, SecureSum) else SecureSum(clip=clip, bits=secure)

        def sum_reduce(values, weights, state, key):
            del weights, state
            return fed.secure_sum(values, spec, key), {}

    def server(value, stats, state, key):
        if z > 0:
            if key is None:
                raise ValueError("dp_gaussian adds noise and needs a key: run the aggregator "
                                 "with a round key (aggregate(..., key) / alg.round(state, "
                                 "cohort, key)), not None.")
            value = dp_noise(value, z * clip, key)
        value = jax.tree.map(lambda v: v / jnp.asarray(denominator, v.dtype), value)
        metrics = {"dp_noise_stddev": jnp.asarray(z * clip / denominator, jnp.float32)}
        if stats is not None:  # (a secure sum over the network hides the per-client bits)
            metrics["clipped_clients"] = stats["clipped"]
        return value, state, metrics

    return Aggregator(no_state, client=client, reduce=sum_reduce, server=server,
                      secure=None if secure is None else spec, private=z > 0)
