"""Hypergradients that stay inside secure aggregation.

A round whose aggregator sums through secure aggregation (``fedax.aggregators.secure_mean``,
``dp_gaussian(..., secure=...)``) places its payload with ``fedax.federated.
secure_broadcast`` (``fedax.algorithms.base.place_payload``), whose transpose is a secure
sum; the secure sum's own transpose is a broadcast. So the reverse pass of T such rounds
sends nothing up to the server but secure sums, and the forward pass's tangents go up
through secure sums too (Rush, Charles, Garrett, "Federated Automatic Differentiation":
the derivative of a computation built from private primitives uses only those
primitives). :func:`secure_loss` is the holdout loss of the same kind, to pass as
``evaluate`` to ``fedax.hyper.hypergradient``; ``fedax.federated.audit_sums`` checks the
whole program (``unsecured_sums(jaxpr) == []`` on the derivative program).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from fedax import federated as fed
from fedax.aggregators import aggregate, secure_mean
from fedax.algorithms import CohortBatches
from fedax.algorithms.base import client_mean_loss
from fedax.client import LossFn
from fedax.federated import SecureSum


def secure_loss(loss_fn: LossFn, spec: SecureSum, max_weight: float
                ) -> Callable[[Any, CohortBatches, jax.Array], jax.Array]:
    """``evaluate(params, cohort, key)``: the n_k-weighted mean loss of ``fedax.algorithms.
    federated_loss``, with the model placed by ``secure_broadcast`` (range ``spec``: the
    clients' cotangents go up through a secure sum) and the losses summed by
    ``secure_mean(spec.clip, max_weight)`` (each client's loss must lie in [−c, c])."""
    if not isinstance(spec, SecureSum) or spec.clip is None:
        raise ValueError("secure_loss needs a SecureSum with a clip range (clip=c).")
    aggregator = secure_mean(spec.clip, max_weight, bits=spec.bits, levels=spec.levels)

    def evaluate(params, cohort: CohortBatches, key):
        if key is None:
            raise ValueError("secure_loss needs a key (the clients' stochastic rounding).")
        place_key, sum_key = jax.random.split(key)
        n = cohort.num_examples.shape[0]
        at_clients = fed.secure_broadcast(params, n, spec, place_key)
        losses = fed.map_clients(functools.partial(client_mean_loss, loss_fn), at_clients,
                                 cohort.batches)
        weights = jnp.where(jnp.isfinite(losses), cohort.num_examples, 0.0)
        losses = jnp.where(weights > 0, losses, 0.0)
        value, _, _ = aggregate(aggregator, losses, weights, (), sum_key)
        return value

    return evaluate


__all__ = ["secure_loss"]
