"""The device side of asynchronous simulation: the pool of computed updates awaiting
delivery (a ``Reports`` record, ``[capacity, ...]`` per leaf, whose ``update`` is the
update after the aggregator's client stage: with ``mixing``, the client's local model), what
a client trip computes into it, and the server update of a full buffer.

Everything runs the algorithm's ``RoundPieces``: ``payload`` and ``client_update`` (the
client half) when a client starts, ``server_update`` (the server half) at every buffer
flush. ``compute`` takes a chunk of trips that start on the same model version (padded to
K) in one ``map_clients`` call; ``compute_into`` writes their updates into pool slots;
``server_step`` takes the K buffered updates out of the pool by slot.

**Aggregators compose as follows.** The aggregator's *client stage* (clipping, an
indicator bit, encoding) runs on each client when its update is computed, with the
aggregator state of the version it downloaded, as a real client would. At a flush the
buffered values are scaled by s(τ_i) (≤ 1, so a clipped update stays within its clip),
then the aggregator's *reduction* runs over the K buffered values with their weights, and
its *server stage* (noise, an adaptive clip's update from the buffer's summed client
statistics) on the result, with the flush's key. So ``chain(clip_norm(S), mean())``, DP's
``dp_gaussian(S, z, D)`` (use D = K, the buffer's fixed size) and adaptive clipping
compose; robust reductions see the K buffered values. FedAsync's mixing values are formed
on the server, so ``mixing=True`` takes no aggregator client stage. DP accounting for
asynchronous participation is not provided.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedax import federated as fed
from fedax.algorithms import FederatedAlgorithm, RoundPieces, RoundState
from fedax.algorithms.base import client_finite, keep_clients
from fedax.algorithms.protocol import Reports, apply_reports, client_half
from fedax.simulation.asynchronous.config import AsyncConfig
from fedax.simulation.sources import PartitionSource


def check_pieces(algorithm: FederatedAlgorithm | RoundPieces, config: AsyncConfig) -> RoundPieces:
    """``algorithm``'s pieces, if the update functions can run them (``ValueError`` if not):
    no per-client state, no reweighing, and with ``mixing`` no aggregator client stage."""
    pieces = algorithm.pieces if isinstance(algorithm, FederatedAlgorithm) else algorithm
    if pieces is None:
        raise ValueError("asynchronous simulation needs an algorithm composed of RoundPieces "
                         "(algorithm.pieces is None); use fedavg, fedprox or a FedOpt name.")
    if pieces.client_state is not None:
        raise ValueError("asynchronous simulation keeps no per-client state; use an algorithm "
                         "whose registry entry declares client_state=False.")
    if pieces.reweigh is not None:
        raise ValueError("asynchronous simulation cannot reweigh a cohort (learned client "
                         "weights need the whole cohort); drop client_weights.")
    if config.mixing and pieces.aggregator.client is not None:
        raise ValueError("mixing (FedAsync) forms each value on the server, so it takes no "
                         "aggregator client stage; use a plain reduction such as mean().")
    return pieces


class UpdateFunctions(NamedTuple):
    """The device functions of an asynchronous run (to be compiled by the caller).

    Attributes:
      compute: ``compute(state, placed, idx, mask, num_examples, client_ids, trips,
        streams) -> (Reports rows, finite & real)``: a chunk of trips' updates.
      compute_into: ``compute`` written into the pool at ``slots``: ``(pool, finite)``.
      server_step: ``server_step(state, pool, slots, taus, key) -> (state, metrics)``: one
        server update from the K buffered updates.
    """

    compute: Callable[..., Any]
    compute_into: Callable[..., Any]
    server_step: Callable[..., Any]


def weigh(weights: jax.Array, num_examples: jax.Array, weighting: str) -> jax.Array:
    """A buffered update's weight: the algorithm's (``"algorithm"``, FedAvg's n_k) or 1 for
    every update with examples (``"equal"``); both asynchronous engines weigh by this."""
    if weighting == "equal":
        return (num_examples > 0).astype(jnp.float32)
    return weights


def stage_each(aggregator: Any, values: Any, weights: jax.Array, downloaded: Any,
               raw_keys: jax.Array) -> tuple[Any, jax.Array, Any]:
    """The aggregator's client stage on each of C updates, each with the aggregator state
    of the version its client downloaded (``downloaded``: client-placed, or a stateless
    aggregator's leafless state) and its own key (``raw_keys [C]``, raw key data). Returns
    the staged values, weights and per-client stage statistics (summed at the flush)."""
    stateful = bool(jax.tree.leaves(downloaded))
    at = (downloaded,) if stateful else ()

    def one(v, w, raw, *s):
        return aggregator.client(v, w, s[0] if stateful else downloaded,
                                 jax.random.wrap_key_data(raw))

    return fed.map_clients(one, values, weights, raw_keys, *at)


def buffered_step(pieces: RoundPieces, state: RoundState, buffered: Reports,
                  taus: jax.Array, key: jax.Array, staleness: Any, mixing: bool = False
                  ) -> tuple[RoundState, dict[str, jax.Array]]:
    """FedBuff's server step on K buffered reports, in both asynchronous engines (the
    virtual clock's flush and ``fedax.runtime.async_server``): each value scaled by its
    staleness weight s(τ_k) (with ``mixing``, FedAsync's value ``w_current − w_local``
    first), then ``apply_reports`` with the aggregator's client stage already run
    (``staged``: where each update was computed, with its version's state; its per-update
    statistics in ``buffered.stage_stats`` are summed there):
    x ← server_update(x, reduce_k(w_k, s(τ_k) Δ_k)). Metrics gain
    ``mean_staleness_weight``."""
    values = buffered.update
    if mixing:  # w_current − w_local
        current = fed.broadcast(pieces.server_params(state.server), taus.shape[0])
        values = jax.tree.map(jnp.subtract, current, values)
    values, scale = staleness.scale(values, taus)
    state, metrics = apply_reports(pieces, state, buffered._replace(update=values), key,
                                   staged=True)
    metrics["mean_staleness_weight"] = jnp.mean(scale)
    return state, metrics


def update_functions(pieces: RoundPieces, source: PartitionSource,
                     config: AsyncConfig) -> UpdateFunctions:
    """The device functions of ``run_async`` for ``pieces`` on ``source`` with ``config``
    (see ``UpdateFunctions``)."""
    aggregator = pieces.aggregator

    def compute(state: RoundState, placed, idx, mask, num_examples, client_ids, trips,
                streams):
        """The update of each trip in a chunk, all on the current model (client-placed).
        ``streams``: the training and aggregator key streams (arguments, not constants, so
        that runs with other seeds compile to the same program)."""
        train_stream, aggregator_stream = streams
        cohort = source.cohort(placed, (idx, mask), (num_examples, client_ids), None)
        size = num_examples.shape[0]
        payload = pieces.payload(state.server)
        at_clients = fed.broadcast(payload, size)
        train_keys = jax.vmap(lambda j: jax.random.key_data(
            jax.random.fold_in(train_stream, j)))(trips)

        def one(p, b, n, raw):
            return client_half(pieces, p, None, b, n, raw)

        message = fed.map_clients(one, at_clients, cohort.batches, cohort.num_examples,
                                  train_keys)
        finite = client_finite((message.update, message.stats, message.sums))
        real = cohort.num_examples > 0
        weights = jnp.where(finite, weigh(message.weight, cohort.num_examples,
                                          config.weighting), 0)
        values = keep_clients(message.update, finite)
        aggregator_stats: Any = ()
        if config.mixing:  # FedAsync: keep the client's local model w_v − Δ_i
            model = fed.broadcast(pieces.server_params(state.server), size)
            values = keep_clients(jax.tree.map(jnp.subtract, model, values), finite)
        elif aggregator.client is not None:
            keys = jax.vmap(lambda j: jax.random.key_data(
                jax.random.fold_in(aggregator_stream, j)))(trips)
            stateful = bool(jax.tree.leaves(state.aggregator))
            downloaded = fed.broadcast(state.aggregator, size) if stateful \
                else state.aggregator
            values, weights, aggregator_stats = stage_each(aggregator, values, weights,
                                                           downloaded, keys)
        sums = (keep_clients(message.sums, finite) if jax.tree.leaves(message.sums)
                else message.sums)
        out = Reports(values, weights, message.stats, sums, cohort.num_examples,
                      aggregator_stats)
        return out, finite & real

    def compute_into(state, pool, placed, idx, mask, num_examples, client_ids, trips, streams,
                     slots):
        out, finite = compute(state, placed, idx, mask, num_examples, client_ids, trips,
                              streams)
        pool = jax.tree.map(lambda table, new: table.at[slots].set(new, mode="drop"),
                            pool, out)
        return pool, finite

    def server_step(state: RoundState, pool: Reports, slots, taus, key):
        """One server update from the K buffered updates (``slots`` into the pool)."""
        buffered = jax.tree.map(lambda leaf: leaf[slots], pool)
        state, metrics = buffered_step(pieces, state, buffered, taus, key, config.staleness,
                                       mixing=config.mixing)
        new_params = pieces.server_params(state.server)
        metrics["server_finite"] = jnp.all(jnp.stack([
            jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(new_params)
            if jnp.issubdtype(leaf.dtype, jnp.inexact)]))
        return state, metrics

    return UpdateFunctions(compute, compute_into, server_step)


__all__ = ["UpdateFunctions", "buffered_step", "check_pieces", "stage_each",
           "update_functions", "weigh"]
