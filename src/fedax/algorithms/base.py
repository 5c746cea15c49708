"""The algorithm interface: a round in pieces (the types every engine passes around).

An algorithm declares ``RoundPieces`` (DESIGN.md, "A round in pieces"):

* ``server_init(params) -> server_state`` and ``server_params(server_state) -> params``;
* ``payload(server_state)``: what the server broadcasts (the model; SCAFFOLD adds c);
* ``client_update(payload, client_state, batches, num_examples, key) -> ClientMessage``:
  one client's computation: the update to aggregate, its weight, per-client statistics (the
  local loss), values to sum (SCAFFOLD's Δc_i) and its new per-client state. ``key`` is the
  client's own training key (example-level DP-SGD's noise), which every engine passes;
  an update that draws no random numbers is written without it and adapted by ``keyless``;
* ``aggregator``: how the server combines the updates (``fedax.aggregators``);
* ``server_update(server_state, aggregate, sums) -> (server_state, metrics)``.

This module holds those types (``RoundPieces``, ``ClientMessage``, ``RoundState``,
``CohortBatches``, ``FederatedAlgorithm``), the initial state and the finite rule; the
round protocol that runs them (``client_half``, ``server_half``, ``cohort_round``,
``compose``, ``apply_reports``) is ``fedax.algorithms.protocol``.

Per-client state (``client_state(params) -> one client's initial state``) belongs to whoever
runs the algorithm. ``round`` keeps it in a ``[num_clients, ...]`` table in its state,
gathered and scattered by ``cohort.client_ids``; ``cohort_round`` takes the cohort's states
as an argument and returns the new ones, for a runtime that keeps them elsewhere (the
population runner's host store, a real client's disk). The algorithm never knows which.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedax import federated as fed
from fedax.aggregators import Aggregator, mean
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
      pieces: the ``RoundPieces`` ``round`` is composed of (None for a wrapper such as a
        hypergradient learner whose round is not a plain composition).
      adversary: None, or the simulated attackers ``round`` runs (``fedax.attacks.attacked``;
        ``cohort_round``'s ``adversary``): not the algorithm's, so not a piece; whoever runs
        ``pieces`` with ``cohort_round`` itself (the population runner) passes it on.
    """

    init: Callable[[Any, jax.Array], Any]
    round: Callable[[Any, CohortBatches, jax.Array], tuple[Any, dict[str, jax.Array]]]
    server_params: Callable[[Any], Any]
    pieces: RoundPieces | None = None
    adversary: Callable[..., tuple[Any, jax.Array]] | None = None


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


# ----------------------------------------------------------------------- a round in pieces


class ClientMessage(NamedTuple):
    """What one client returns from ``client_update`` (inside ``map_clients``: one client).

    Attributes:
      update: the value to aggregate (a model delta), through the aggregator.
      weight: its aggregation weight (n_k for FedAvg; 0 counts for nothing).
      stats: per-client scalars; each round metric of that name is their n_k-weighted mean
        over the accepted clients (e.g. ``train_loss``, ``local_steps``).
      sums: values the server needs summed over the accepted clients (SCAFFOLD's Δc_i);
        ``()`` for none.
      client_state: the client's new per-client state (None without one).
    """

    update: Any
    weight: jax.Array
    stats: dict[str, jax.Array]
    sums: Any = ()
    client_state: Any = None


class RoundPieces(NamedTuple):
    """An algorithm's pieces (see the module docstring for each signature).

    Attributes:
      server_init: ``server_init(params) -> server_state``.
      payload: ``payload(server_state) -> pytree`` broadcast to the cohort.
      client_update: ``client_update(payload, client_state, batches, num_examples, key) ->
        ClientMessage`` for one client; ``key`` is its own training key (a typed PRNG key,
        or None where the round has none; see ``client_half``). An update that draws no
        random numbers takes four arguments and is given as ``keyless(update)``.
      server_update: ``server_update(server_state, aggregate, sums) -> (server_state,
        metrics)``.
      server_params: ``server_params(server_state) -> params``.
      aggregator: a complete ``fedax.aggregators.Aggregator``; its ``init`` gets the params
        as template.
      client_state: ``client_state(params) -> one client's initial state``, or None.
      reweigh: None, or ``reweigh(weights, stats) -> weights`` on client-placed ``[C]``
        arrays, written with the placement primitives (learned client weights).
      spread: names of per-client ``stats`` whose spread over the cohort the round also
        reports (``spread_metrics``), e.g. ``("local_steps",)`` when clients stop early.
    """

    server_init: Callable[[Any], Any]
    payload: Callable[[Any], Any]
    client_update: Callable[..., ClientMessage]
    server_update: Callable[[Any, Any, Any], tuple[Any, dict[str, jax.Array]]]
    server_params: Callable[[Any], Any]
    aggregator: Aggregator
    client_state: Callable[[Any], Any] | None = None
    reweigh: Callable[[jax.Array, dict[str, jax.Array]], jax.Array] | None = None
    spread: tuple[str, ...] = ()


_PAYLOAD_KEY = 0x7061796C  # "payl": the rounding of a secure payload's transposed sum


def place_payload(pieces: RoundPieces, server: Any, num_clients: int,
                  key: jax.Array | None) -> Any:
    """The payload at the clients: ``fed.broadcast``, or, when the aggregator sums through
    secure aggregation with a clip range (``aggregator.secure``), ``fed.secure_broadcast``
    of every float leaf with that range, so that in a derivative of the round what flows
    back up to the server goes through a secure sum too (same value, same cost forward)."""
    payload = pieces.payload(server)
    spec = pieces.aggregator.secure
    if spec is None or spec.clip is None or key is None:
        return fed.broadcast(payload, num_clients)
    key = jax.random.fold_in(key, _PAYLOAD_KEY)
    leaves, treedef = jax.tree.flatten(payload)
    placed = [fed.secure_broadcast(leaf, num_clients, spec, jax.random.fold_in(key, j))
              if jnp.issubdtype(jnp.result_type(leaf), jnp.floating)
              else fed.broadcast(leaf, num_clients) for j, leaf in enumerate(leaves)]
    return jax.tree.unflatten(treedef, placed)


_CLIENT_TRAINING_KEY = 0x636C6B65  # "clke": the stream of the clients' own training keys


class RoundState(NamedTuple):
    """The state of a composed algorithm.

    Attributes:
      server: the algorithm's server state (``server_params(server)`` is the model).
      aggregator: the aggregator's state.
      clients: per-client state as a table with leaves ``[num_clients, ...]`` (``round``),
        or None (no per-client state, or kept by the runtime: ``cohort_round``).
      round: rounds run (int32).
    """

    server: Any
    aggregator: Any
    clients: Any
    round: jax.Array


def default_aggregator(aggregator: Aggregator | None) -> Aggregator:
    """``aggregator``, or the weighted mean; a part without a reduction is an error."""
    aggregator = mean() if aggregator is None else aggregator
    if not isinstance(aggregator, Aggregator) or aggregator.reduce is None:
        raise ValueError(
            "aggregator must be a complete fedax.aggregators.Aggregator (with a reduction), "
            f"got {aggregator!r}; chain stages with one, e.g. chain(clip_norm(1.0), mean())."
        )
    return aggregator


def init_state(pieces: RoundPieces, params: Any, num_clients: int | None = None) -> RoundState:
    """The initial ``RoundState``; with ``num_clients`` and per-client state, a table of
    ``num_clients`` rows (every client starts at ``client_state(params)``)."""
    clients = None
    if pieces.client_state is not None and num_clients is not None:
        one = pieces.client_state(params)
        clients = jax.tree.map(
            lambda a: jnp.broadcast_to(jnp.asarray(a), (num_clients, *jnp.shape(a))).copy(), one)
    return RoundState(pieces.server_init(params), pieces.aggregator.init(params), clients,
                      jnp.zeros((), jnp.int32))


def client_training_keys(key: jax.Array | None, num_clients: int) -> jax.Array | None:
    """``[C, ...]`` raw keys of the clients' own training (the client updates' ``key``,
    e.g. example-level DP-SGD's noise) in a simulated round: ``split(fold_in(key,
    "clke"), C)``, disjoint from the aggregator's keys (``split(key, 3)`` and its
    descendants, i.e. ``fold_in(key, 0..2)`` under JAX's partitionable threefry); None for
    a round without a key. A real client draws its own (``fedax.runtime.client``), FedBuff
    one per trip."""
    if key is None:
        return None
    return jax.random.key_data(
        jax.random.split(jax.random.fold_in(key, _CLIENT_TRAINING_KEY), num_clients))


def keyless(client_update: Callable[..., ClientMessage]) -> Callable[..., ClientMessage]:
    """``client_update(payload, client_state, batches, num_examples)``, an update that draws
    no random numbers, as a ``RoundPieces.client_update``: it takes the client's training
    key too (optional, so the four-argument call still works) and drops it."""

    def update(payload, client_state, batches, num_examples, key=None):
        del key
        return client_update(payload, client_state, batches, num_examples)

    return update
