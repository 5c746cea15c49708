"""The server side of the round protocol, written once for every engine that receives
reports one by one: the networked synchronous server, its holdout phase, FedBuff's flush
in the simulator and in the networked ``AsyncServer``.

A ``Reports`` record is what C clients sent, stacked on a leading clients axis (one
client's, unstacked, is the same record: a real client builds one). ``apply_reports`` is
the server's half on them: the algorithm's ``reweigh``, the sum of the aggregator client
stage's statistics where the clients (or the caller, per report) already ran that stage,
then ``server_half`` (the aggregator's client stage where it did not run, its reduction and
server stage, the exact sums, the server update). The simulator's compiled round
(``cohort_round``) reaches the same ``server_half`` with its own finite check in between;
the secure path reaches ``apply_reduced`` with the protocol's sum.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedax import federated as fed
from fedax.algorithms.base import RoundPieces, RoundState, server_half


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


__all__ = ["Reports", "apply_reports", "summed_stage_stats"]
