"""The algorithm interface: ``FederatedAlgorithm(init, round, server_params)``."""

from __future__ import annotations

import functools
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


def client_mean_loss(loss_fn: LossFn, params: Any, batches: Batches) -> jax.Array:
    """One client's mean of ``loss_fn`` over its real batches (padded steps count for
    nothing); runs inside ``map_clients``."""
    batches = decoded(batches)
    losses = jax.vmap(loss_fn, in_axes=(None, 0))(params, batches)
    real = jnp.sum(batches.mask, axis=-1)
    return jnp.sum(losses * real) / jnp.maximum(jnp.sum(real), 1.0)


def federated_loss(loss_fn: LossFn, params: Any, cohort: CohortBatches) -> jax.Array:
    """The n_k-weighted mean over clients of each client's mean loss over its real batches.

    Communication: the model is broadcast, each client returns one scalar.
    """
    num_clients = cohort.num_examples.shape[0]
    per_client = fed.map_clients(
        functools.partial(client_mean_loss, loss_fn),
        fed.broadcast(params, num_clients),
        cohort.batches,
    )
    return fed.weighted_mean(per_client, cohort.num_examples)


def client_finite(message: Any) -> jax.Array:
    """``[C]`` bool: whether every inexact leaf of each client's message is finite.

    A per-client reduction over a client-placed pytree (leading clients axis); it moves
    nothing between placements, so under a mesh each device checks its own clients.
    """
    checks = [
        jnp.all(jnp.isfinite(leaf).reshape(leaf.shape[0], -1), axis=1)
        for leaf in jax.tree.leaves(message)
        if jnp.issubdtype(leaf.dtype, jnp.inexact)
    ]
    if not checks:
        raise ValueError("client_finite needs at least one float leaf in the message.")
    return functools.reduce(jnp.logical_and, checks)


def keep_clients(tree: Any, keep: jax.Array) -> Any:
    """Client-placed ``tree`` with every client where ``keep`` is False replaced by zeros
    (by selection, so a NaN there is gone too)."""

    def select(leaf):
        mask = keep.reshape(keep.shape + (1,) * (leaf.ndim - 1))
        return jnp.where(mask, leaf, jnp.zeros((), leaf.dtype))

    return jax.tree.map(select, tree)


class Accepted(NamedTuple):
    """The clients whose messages the server accepts this round (see ``accept_finite``).

    Attributes:
      weights: ``[C]`` aggregation weights, 0 for every rejected client.
      finite: ``[C]`` bool, the client's message was finite.
      rejected: server-placed int32, real clients (n_k > 0) whose message was non-finite.
    """

    weights: jax.Array
    finite: jax.Array
    rejected: jax.Array


def accept_finite(message: Any, weights: jax.Array, num_examples: jax.Array) -> Accepted:
    """Reject every client whose ``message`` holds a NaN or an infinity.

    A rejected client gets weight 0, and ``fed.weighted_mean`` leaves zero-weight clients
    out by selection, so its values never touch the aggregate (no ``0 · NaN``). The count
    of rejected real clients is a federated sum of one indicator bit per client.
    """
    finite = client_finite(message)
    accepted = jnp.where(finite, weights, 0)
    bad = jnp.logical_and(~finite, num_examples > 0).astype(jnp.int32)
    return Accepted(accepted, finite, fed.sum(bad))
