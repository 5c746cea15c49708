"""The algorithm interface: ``FederatedAlgorithm(init, round, server_params)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedax import federated as fed
from fedax.client import Batches, LossFn, decoded


class CohortBatches(NamedTuple):
    """One round's cohort as device arrays (client-placed: leading clients axis C).

    Attributes:
      batches: ``Batches`` with ``x [C, S, B, ...]``, ``y [C, S, B, ...]``, ``mask [C, S, B]``.
      num_examples: ``[C]`` float, n_k of each client (the FedAvg weights).
      client_ids: ``[C]`` int32, population index of each client (for per-client state).
    """

    batches: Batches
    num_examples: jax.Array
    client_ids: jax.Array


class FederatedAlgorithm(NamedTuple):
    """A federated algorithm as pure functions (optax's shape, FedJAX's semantics).

    Attributes:
      init: ``init(params, key) -> state``.
      round: ``round(state, cohort: CohortBatches, key) -> (state, metrics)``; written with
        the placement primitives, so it jit-compiles to one program and is differentiable.
      server_params: ``server_params(state) -> params``, the model to evaluate.
    """

    init: Callable[[Any, jax.Array], Any]
    round: Callable[[Any, CohortBatches, jax.Array], tuple[Any, dict[str, jax.Array]]]
    server_params: Callable[[Any], Any]


def federated_loss(loss_fn: LossFn, params: Any, cohort: CohortBatches) -> jax.Array:
    """The n_k-weighted mean over clients of each client's mean loss over its real batches.

    Communication: the model is broadcast, each client returns one scalar.
    """
    num_clients = cohort.num_examples.shape[0]

    def client_loss(p, batches: Batches):
        batches = decoded(batches)
        losses = jax.vmap(loss_fn, in_axes=(None, 0))(p, batches)
        real = jnp.sum(batches.mask, axis=-1)
        return jnp.sum(losses * real) / jnp.maximum(jnp.sum(real), 1.0)

    per_client = fed.map_clients(client_loss, fed.broadcast(params, num_clients), cohort.batches)
    return fed.weighted_mean(per_client, cohort.num_examples)
