"""The round protocol, written once for every engine: how a round's pieces
(``fedax.algorithms.base``) run.

* ``client_half``: one client's half, the algorithm's ``client_update`` with the client's
  own key; every engine runs it per client.
* ``server_half``: the server's half on client-placed messages (the aggregator's client
  stage, reduction and server stage, the exact sums, the server update), and its ends
  ``apply_aggregate`` and ``apply_reduced`` (a secure sum's).
* ``cohort_round`` (and ``fused_cohort_round``, which sums the updates as they are made):
  the simulator's compiled round, both halves with the finite check between them;
  ``compose`` makes it ``FederatedAlgorithm(init, round, server_params)``, one federated
  program that the simulator compiles once and FAD differentiates end to end.
* ``Reports`` and ``apply_reports``: what clients send, as an engine that receives reports
  one by one holds them (the networked server, its holdout phase, FedBuff's flush in both
  asynchronous engines), and the server's half on them: the algorithm's ``reweigh``, the
  sum of the aggregator client stage's statistics where the clients (or the caller, per
  report) already ran that stage, then ``server_half``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedax import federated as fed
from fedax.aggregators.base import Aggregator, client_stage, reduce_stage, round_keys
from fedax.algorithms.base import (
    ClientMessage,
    CohortBatches,
    FederatedAlgorithm,
    RoundPieces,
    RoundState,
    accept_finite,
    client_finite,
    client_training_keys,
    init_state,
    keep_clients,
    place_payload,
)
from fedax.algorithms.round_metrics import merge_metrics, spread_metrics
from fedax.client import Batches

_ADVERSARY_KEY = 0x61647672  # "advr": the stream of simulated attackers' random numbers


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


class Reports(NamedTuple):
    """What clients send, client-placed (leading axis C; a padding row has weight 0 and
    zeros): the ``ClientMessage``'s update (or, where the aggregator's client stage ran
    before the server, what it made: a compressed message, a staleness-scaled value), the
    weight, per-client statistics, the exact sums, n_k, and that stage's statistics."""

    update: Any
    weight: jax.Array
    stats: dict[str, jax.Array]
    sums: Any
    num_examples: jax.Array
    stage_stats: Any = {}


def summed_stage_stats(stage_stats: Any, keep: jax.Array | None = None) -> Any:
    """The federated sum of the client stage's per-client statistics over the rows
    ``keep`` (all rows when None); None when the stage reports none."""
    if not jax.tree.leaves(stage_stats):
        return None
    if keep is not None:
        stage_stats = jax.tree.map(
            lambda v: jnp.where(keep.reshape(keep.shape + (1,) * (v.ndim - 1)), v, 0),
            stage_stats)
    return fed.sum(stage_stats)


def apply_reports(pieces: RoundPieces, state: RoundState, reports: Reports,
                  key: jax.Array | None, *, keep: jax.Array | None = None,
                  client_keys: jax.Array | None = None, staged: bool = False,
                  unit_weights: bool = False,
                  extra_metrics: dict[str, jax.Array] | None = None,
                  ) -> tuple[RoundState, dict[str, jax.Array]]:
    """The server's half of round ``state.round`` on accepted ``reports`` (the trust
    checks, finite and bounds, are the engine's, at its edge, before this call).

    ``weights ← reweigh(weights, stats)`` (an algorithm's learned client weights; with
    ``unit_weights``, DP over a compressed uplink, each weight is first set again to
    1[w > 0], as DP-FedAvg's client stage sets it, so a client's contribution stays within
    the sensitivity whatever it claims), then ``server_half`` with ``keep`` (the real
    rows), the aggregator's client stage run here with ``client_keys[i]`` (raw key data;
    default ``round_keys``') unless ``staged``, in which case ``reports.stage_stats`` are
    summed over ``keep`` here. ``state.clients`` is None in the result: an engine that
    applies reports keeps per-client state with the clients."""
    weights = reports.weight
    if unit_weights:
        weights = (weights > 0).astype(weights.dtype)
    if pieces.reweigh is not None:  # before the aggregator, as in ``cohort_round``
        weights = pieces.reweigh(weights, reports.stats)
    staged_stats = summed_stage_stats(reports.stage_stats, keep) if staged else None
    new_state, metrics = server_half(
        pieces, state, reports.update, weights, dict(reports.stats), reports.sums,
        reports.num_examples, key, keep, client_keys=client_keys, staged=staged,
        staged_stats=staged_stats, extra_metrics=extra_metrics)
    return new_state._replace(clients=None), metrics


__all__ = ["Reports", "apply_aggregate", "apply_reduced", "apply_reports", "client_half",
           "cohort_round", "compose", "fused_cohort_round", "fuses_sums",
           "refuse_uncovered_sums", "server_half", "summed_stage_stats"]
