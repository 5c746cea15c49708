"""The algorithm interface: a round in pieces, and ``FederatedAlgorithm`` their composition.

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

``compose`` turns them into ``FederatedAlgorithm(init, round, server_params)``: one
federated program (broadcast, ``map_clients``, the finite check, the aggregator, the server
update), so the simulator compiles it once and FAD differentiates it end to end. The same
pieces are what a networked or asynchronous runtime calls one at a time.

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
from fedax.aggregators import Aggregator, client_stage, mean, reduce_stage, round_keys
from fedax.algorithms.round_metrics import merge_metrics, spread_metrics
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


_ADVERSARY_KEY = 0x61647672  # "advr": the stream of simulated attackers' random numbers
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


def client_half(pieces: RoundPieces, payload: Any, client_state: Any, batches: Batches,
                num_examples: jax.Array, raw_key: jax.Array | None) -> ClientMessage:
    """One client's half of a round: the algorithm's ``client_update`` on what the
    server sent, the client's own state and batches, and its training key (raw key data;
    None in a round without a key, which an update that draws random numbers refuses).
    Every engine runs this one function per client, always with the client's key: mapped
    over the cohort (``cohort_round``), on a real client (``fedax.runtime``), per trip
    (FedBuff)."""
    key = None if raw_key is None else jax.random.wrap_key_data(raw_key)
    return pieces.client_update(payload, client_state, batches, num_examples, key)


def refuse_uncovered_sums(aggregator: Aggregator, sums: Any) -> None:
    """Refuse, when a round is traced, exact ``sums`` beside an aggregator that declares a
    DP release or secure aggregation: neither covers them (they are summed in the clear),
    whatever the algorithm's registry entry declared."""
    if not jax.tree.leaves(sums) or not (aggregator.private or aggregator.secure is not None):
        return
    what = "a DP release" if aggregator.private else "secure aggregation"
    raise ValueError(f"the clients' messages carry exact sums beside the update "
                     f"({len(jax.tree.leaves(sums))} arrays), which {what} does not cover; "
                     "use an algorithm without them (its AlgorithmSpec.exact_sums=())")


def server_half(
    pieces: RoundPieces, state: RoundState, updates: Any, weights: jax.Array,
    stats: dict[str, jax.Array], sums: Any, counted: jax.Array, key: jax.Array | None,
    keep: jax.Array | None = None, *, client_keys: jax.Array | None = None,
    staged: bool = False, staged_stats: Any = None,
    extra_metrics: dict[str, jax.Array] | None = None, summed: Any = None,
) -> tuple[RoundState, dict[str, jax.Array]]:
    """The server's half of a round, from the accepted clients' client-placed messages
    (leading axis C; a client left out has weight 0 and zero values) to the new state and
    the round's metrics. Every engine runs this one function: ``cohort_round`` (the
    simulator), the networked server (``fedax.runtime``) and FedBuff's flush.

    The aggregator's client stage on each client (``client_keys [C]``, raw key data;
    default ``round_keys(key, C)``'s; its stats summed over ``keep``), unless the caller
    ran it already (``staged``, with the summed stats ``staged_stats``: FedBuff, at each
    update's computation); then its reduction and server stage; the federated sum of the exact
    ``sums``; the algorithm's ``server_update``. ``stats`` become n_k-weighted means with
    weights ``counted`` (0 for a client left out). Metrics: the stats, ``extra_metrics``,
    the aggregator's and the server update's (a name twice is an error).

    ``summed``: ``(terms, sums)``, the updates' ``fed.weighted_terms`` and the ``sums``
    already summed over the accepted clients (``fused_cohort_round``; ``updates`` and
    ``sums`` are then None): the aggregator, which has no client stage, reduces them with
    its ``linear`` form. Where the round would fuse (``fuses_sums``), stacked updates are
    summed the same way, client after client (``fed.map_and_sum``)."""
    num_clients = weights.shape[0]
    default_keys, reduce_key, server_key = round_keys(key, num_clients)
    aggregator = pieces.aggregator
    refuse_uncovered_sums(aggregator, sums if summed is None else summed[1])
    if summed is None and fuses_sums(pieces):
        # the stacked updates summed in the fused loop's order, as a fused round sums
        # them (so FedBuff in lockstep is the synchronous run bit for bit)
        _, summed = fed.map_and_sum(
            lambda v, w, s: ((), (fed.weighted_terms(v, w), s)), updates, weights, sums)
    terms = None
    if summed is not None:
        terms, sums = summed
        staged = True  # (sums are fused only without a client stage: ``fuses_sums``)
    if not staged:
        keys = None
        if aggregator.client is not None:
            keys = default_keys if client_keys is None else client_keys
        updates, weights, staged_stats = client_stage(aggregator, updates, weights,
                                                      state.aggregator, keys, keep)
    value, aggregator_state, aggregator_metrics = reduce_stage(
        aggregator, updates, weights, staged_stats, state.aggregator, reduce_key,
        server_key, summed=terms)
    if summed is None and jax.tree.leaves(sums):
        sums = fed.sum(sums)
    means = {name: fed.weighted_mean(s, counted) for name, s in stats.items()}
    return apply_aggregate(pieces, state, value, aggregator_state, sums,
                           merge_metrics(means, extra_metrics or {}, aggregator_metrics))


def apply_aggregate(pieces: RoundPieces, state: RoundState, value: Any, aggregator_state: Any,
                    sums: Any, metrics: dict[str, jax.Array]
                    ) -> tuple[RoundState, dict[str, jax.Array]]:
    """The end of every round, in every engine: the algorithm's ``server_update`` on the
    aggregator's ``value`` and the summed exact ``sums``, and the next ``RoundState``;
    ``metrics`` (the round's so far) gain the server update's."""
    server, server_metrics = pieces.server_update(state.server, value, sums)
    return (RoundState(server, aggregator_state, state.clients, state.round + 1),
            merge_metrics(metrics, server_metrics))


def apply_reduced(pieces: RoundPieces, state: RoundState, total: Any, key: jax.Array | None
                  ) -> tuple[RoundState, dict[str, jax.Array]]:
    """The server's half of a round whose reduction secure aggregation computed
    (``total``: what the aggregator's reduction gives, from the protocol's sums): the
    aggregator's server stage with ``round_keys``' server key, as ``server_half`` runs it
    (no per-client stats: the server sees none), then ``apply_aggregate``."""
    _, _, server_key = round_keys(key, 1)
    value, aggregator_state, metrics = reduce_stage(
        pieces.aggregator, None, None, None, state.aggregator, None, server_key,
        reduced=total)
    return apply_aggregate(pieces, state, value, aggregator_state, None, metrics)


def cohort_round(
    pieces: RoundPieces, state: RoundState, cohort: CohortBatches, key: jax.Array,
    client_states: Any = None, adversary: Callable[..., tuple[Any, jax.Array]] | None = None,
) -> tuple[RoundState, dict[str, jax.Array], Any, jax.Array]:
    """One round with the cohort's per-client states given (leaves ``[C, ...]``).

    ``adversary``: None, or simulated misbehaving clients (``fedax.attacks.Adversary``, not
    part of the algorithm) on the client-placed messages, after the clients' updates and
    before the server sees them (its finite check, its aggregator), with the round key
    folded with a constant of its own.

    Returns ``(state, metrics, client_states, written)``: the clients' new states, and
    ``written [C]`` bool, the clients whose new state counts (real, n_k > 0, and accepted);
    the others' must be left as they were. ``state.clients`` passes through untouched.
    A client whose message is not finite is left out of everything and counted in
    ``rejected_clients`` (``accept_finite``).
    """
    num_clients = cohort.num_examples.shape[0]
    at_clients = place_payload(pieces, state.server, num_clients, key)
    keys = client_training_keys(key, num_clients)
    if adversary is None and fuses_sums(pieces):
        return fused_cohort_round(pieces, state, cohort, key, at_clients, keys, client_states)
    if pieces.client_state is None:
        message = fed.map_clients(
            lambda p, b, n, k: client_half(pieces, p, None, b, n, k),
            at_clients, cohort.batches, cohort.num_examples, keys)
    else:
        message = fed.map_clients(
            functools.partial(client_half, pieces), at_clients, client_states,
            cohort.batches, cohort.num_examples, keys)
    weights = message.weight
    if adversary is not None:
        adversary_key = None if key is None else jax.random.fold_in(key, _ADVERSARY_KEY)
        update, weights = adversary(message.update, weights, cohort.client_ids,
                                    adversary_key)
        message = message._replace(update=update, weight=weights)
    if pieces.reweigh is not None:
        weights = pieces.reweigh(weights, message.stats)
    accepted = accept_finite(
        (message.update, message.stats, message.sums, message.client_state), weights,
        cohort.num_examples)
    sums = message.sums
    if jax.tree.leaves(sums):
        sums = keep_clients(sums, accepted.finite)
    counted = jnp.where(accepted.finite, cohort.num_examples, 0.0)
    new_state, metrics = server_half(
        pieces, state, keep_clients(message.update, accepted.finite), accepted.weights,
        message.stats, sums, counted, key, accepted.finite,
        extra_metrics={"rejected_clients": accepted.rejected})
    metrics = merge_metrics(metrics, spread_metrics(message.stats, pieces.spread,
                                             cohort.num_examples))
    written = jnp.logical_and(cohort.num_examples > 0, accepted.finite)
    return new_state, metrics, message.client_state, written


def fuses_sums(pieces: RoundPieces) -> bool:
    """Whether a simulated round sums the clients' updates as they are made
    (``fused_cohort_round``): under the ``sequential`` map strategy, for an aggregator with
    a ``linear`` form and no client stage, and no ``reweigh`` (which reads every client's
    stats before the weights are known)."""
    aggregator = pieces.aggregator
    return (fed.current_map_strategy() == "sequential" and aggregator.linear is not None
            and aggregator.client is None and pieces.reweigh is None)


class _Kept(NamedTuple):
    """What ``fused_cohort_round`` keeps of each client: all but the update and sums."""

    stats: dict[str, jax.Array]
    client_state: Any
    finite: jax.Array
    weight: jax.Array


def fused_cohort_round(
    pieces: RoundPieces, state: RoundState, cohort: CohortBatches, key: jax.Array,
    at_clients: Any, keys: jax.Array | None, client_states: Any,
) -> tuple[RoundState, dict[str, jax.Array], Any, jax.Array]:
    """``cohort_round`` (no adversary; ``fuses_sums``) with the updates never stacked: each
    client's finite check (``accept_finite``'s, on that client's message) and its term of
    the reduction (``fed.weighted_terms`` of its update with its accepted weight, and its
    ``sums`` where finite) are made beside it, and go up through ``fed.map_and_sum``, so
    the server holds one running total, not ``[C, P]`` updates. The same function as the
    stacked round, float order aside; derivatives are the stacked round's."""

    def alone(tree):  # one client's values as a cohort of one, for the cohort checks
        return jax.tree.map(lambda a: jnp.asarray(a)[None], tree)

    def one(payload, client_state, batches, num_examples, raw_key):
        message = client_half(pieces, payload, client_state, batches, num_examples, raw_key)
        finite = client_finite(alone(
            (message.update, message.stats, message.sums, message.client_state)))[0]
        weight = jnp.where(finite, message.weight, 0)
        sums = jax.tree.map(lambda a: a[0], keep_clients(alone(message.sums), finite[None]))
        terms = fed.weighted_terms(message.update, weight)
        return _Kept(message.stats, message.client_state, finite, weight), (terms, sums)

    if pieces.client_state is None:
        kept, summed = fed.map_and_sum(lambda p, b, n, k: one(p, None, b, n, k), at_clients,
                                       cohort.batches, cohort.num_examples, keys)
    else:
        kept, summed = fed.map_and_sum(one, at_clients, client_states, cohort.batches,
                                       cohort.num_examples, keys)
    bad = jnp.logical_and(~kept.finite, cohort.num_examples > 0).astype(jnp.int32)
    counted = jnp.where(kept.finite, cohort.num_examples, 0.0)
    new_state, metrics = server_half(
        pieces, state, None, kept.weight, kept.stats, None, counted, key, kept.finite,
        extra_metrics={"rejected_clients": fed.sum(bad)}, summed=summed)
    metrics = merge_metrics(metrics, spread_metrics(kept.stats, pieces.spread,
                                             cohort.num_examples))
    written = jnp.logical_and(cohort.num_examples > 0, kept.finite)
    return new_state, metrics, kept.client_state, written


def _scatter_rows(table: Any, rows: jax.Array, values: Any) -> Any:
    """``table[rows] = values`` leafwise; rows out of range are dropped.

    ``values`` (and ``rows``, which depend on them) come out of ``map_clients``, so under an
    explicitly sharded ``clients`` mesh axis they are sharded over it while the table is
    not: they are first resharded to the table's (replicated) layout, as a scatter of mixed
    layouts is an error.
    """

    def like(a, template):
        if any(axis is not None for axis in jax.typeof(a).sharding.spec):
            spec = jax.typeof(template).sharding.spec
            a = jax.sharding.reshard(a, jax.sharding.PartitionSpec(*spec[:a.ndim]))
        return a

    def scatter(column, new):
        return column.at[like(rows, column)].set(like(new, column), mode="drop")

    return jax.tree.map(scatter, table, values)


def compose(pieces: RoundPieces, num_clients: int | None = None, *,
            adversary: Callable[..., tuple[Any, jax.Array]] | None = None
            ) -> FederatedAlgorithm:
    """``FederatedAlgorithm`` from ``pieces``; with per-client state, ``num_clients`` is the
    size of the population whose table ``round`` keeps (``cohort.client_ids`` index it; the
    real clients of a cohort must have distinct ids, and padding clients, n_k = 0, are never
    written). ``adversary``: simulated attackers every round runs (``cohort_round``; see
    ``fedax.attacks.attacked``), kept as the algorithm's ``adversary``."""
    has_clients = pieces.client_state is not None
    if has_clients and (isinstance(num_clients, bool) or not isinstance(num_clients, int)
                        or num_clients < 1):
        raise ValueError(f"num_clients must be a positive int, got {num_clients!r}.")

    def init(params, key):
        del key
        return init_state(pieces, params, num_clients if has_clients else None)

    def round_fn(state: RoundState, cohort: CohortBatches, key):
        if not has_clients:
            state, metrics, _, _ = cohort_round(pieces, state, cohort, key,
                                                adversary=adversary)
            return state, metrics
        if state.clients is None:
            raise ValueError(
                "this state has no per-client table (made with init_state(pieces, params)): "
                "run it with cohort_round and the cohort's client states.")
        assert num_clients is not None  # (a positive int with per-client state: checked)
        ids = cohort.client_ids
        gathered = jax.tree.map(lambda column: column[ids], state.clients)
        state, metrics, new_states, written = cohort_round(pieces, state, cohort, key,
                                                           gathered, adversary)
        rows = jnp.where(written, ids, num_clients)  # out of range: dropped
        return state._replace(clients=_scatter_rows(state.clients, rows, new_states)), metrics

    return FederatedAlgorithm(init, round_fn, lambda state: pieces.server_params(state.server),
                              pieces, adversary)
