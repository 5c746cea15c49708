"""An algorithm under attack: its pieces composed again, with an adversary between the
clients and the server (``compose(pieces, adversary=...)``; the adversary is not one of the
algorithm's pieces, it is the simulated cohort's).

Every round of an attacked algorithm whose attackers are known (``attackers=``, or the
adversary's own ``attackers``, as every ``fedax.attacks`` factory records them) reports
``attackers_in_cohort``: the attackers among the cohort's real clients whose messages the
server accepted (a rejected, non-finite message is counted in ``rejected_clients``
instead), and the robust rule's attacker diagnostics (Krum's ``attackers_selected``; see
``fedax.aggregators.robust.flagging``). The attackers are marked where the adversary acts:
each client's message goes on with a flag beside it (``Flagged``), the aggregator's client
stage passes the flag on untouched, and its reduction takes it off, counts the flags with a
federated sum and shows them to the robust rule. So whoever runs the attacked round
(``round``, or ``cohort_round`` with the algorithm's ``adversary``) records them, and the
numbers are those of the unflagged round. A flag is
a simulation's bookkeeping (one bool per client), not part of what the server decodes; an
engine that runs no adversary (FedBuff, the networked runtime) sees no flags and reports
none.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedax import federated as fed
from fedax.aggregators import Aggregator
from fedax.aggregators.robust import flagging
from fedax.algorithms import FederatedAlgorithm, compose
from fedax.attacks.updates import Adversary


class Flagged(NamedTuple):
    """Client-placed messages with each client's attacker flag beside them.

    Attributes:
      update: the clients' updates (leaves ``[C, ...]``), as the adversary left them.
      attacker: ``[C]`` bool, the client is an attacker and real (weight > 0).
    """

    update: Any
    attacker: jax.Array


def _flagging(adversary: Adversary | None, attackers: np.ndarray) -> Adversary:
    """``adversary`` (None: nobody's update changes, a data-level attack) whose output
    carries each client's flag: its population id is an attacker's and it is real."""
    ids = np.unique(np.asarray(attackers, np.int64)).astype(np.int32)

    def flagged(updates, weights, client_ids, key):
        def one(client_id, weight):
            return jnp.logical_and(jnp.any(client_id == jnp.asarray(ids)), weight > 0)

        attacker = fed.map_clients(one, client_ids, weights)
        if adversary is not None:
            updates, weights = adversary(updates, weights, client_ids, key)
        return Flagged(updates, attacker), weights

    return flagged


def _passing_flags(inner: Aggregator) -> Aggregator:
    """``inner`` taking ``Flagged`` messages: its client stage sees the update alone (the
    flag passes by), its reduction the updates alone, inside ``flagging`` (the flags of the
    clients it counts, w > 0), and it adds ``attackers_in_cohort``. Plain messages (an
    engine without the adversary) go through ``inner`` unchanged."""

    def client(value, weight, state, key):
        assert inner.client is not None  # (client is passed on only when inner has one)
        if not isinstance(value, Flagged):
            return inner.client(value, weight, state, key)
        update, weight, stats = inner.client(value.update, weight, state, key)
        return Flagged(update, value.attacker), weight, stats

    def reduce(values, weights, state, key):
        assert inner.reduce is not None  # an aggregator that flags reduces
        if not isinstance(values, Flagged):
            return inner.reduce(values, weights, state, key)
        attacker = fed.map_clients(lambda a, w: jnp.logical_and(a, w > 0), values.attacker,
                                   weights)
        with flagging(attacker):
            value, metrics = inner.reduce(values.update, weights, state, key)
        if "attackers_in_cohort" in metrics:
            raise ValueError("the aggregator already reports attackers_in_cohort.")
        return value, {**metrics, "attackers_in_cohort": fed.sum(attacker.astype(jnp.int32))}

    return Aggregator(inner.init, None if inner.client is None else client, reduce,
                      inner.server, inner.secure, private=inner.private)


def attacked(algorithm: FederatedAlgorithm, adversary: Adversary | None,
             num_clients: int | None = None, *,
             attackers: Any = None) -> FederatedAlgorithm:
    """``algorithm`` whose clients pass through ``adversary`` (``cohort_round``'s: after
    the clients' updates, before the server's finite check and aggregator), kept as the
    result's ``adversary``.

    Args:
      algorithm: a composed algorithm (``algorithm.pieces`` not None), not yet attacked.
      adversary: an update-level attack (``fedax.attacks.sign_flip``, ...), or None (a
        data-level attack, whose attackers train on corrupted data: give ``attackers``).
      num_clients: the population size, needed by algorithms with per-client state
        (SCAFFOLD), as for ``compose``.
      attackers: the attackers' population ids; default the adversary's ``attackers``.
        With them, every round reports ``attackers_in_cohort`` and the robust rule's
        attacker diagnostics (see the module docstring).

    Returns:
      the attacked algorithm; ``algorithm`` itself when there is neither an adversary nor
      attackers.
    """
    if attackers is None:
        attackers = getattr(adversary, "attackers", None)
    if adversary is None and attackers is None:
        return algorithm
    if algorithm.pieces is None:
        raise ValueError("this algorithm is not a composition of RoundPieces (e.g. a "
                         "hypergradient wrapper); attack the inner algorithm instead.")
    if algorithm.adversary is not None:
        raise ValueError("this algorithm is already attacked; wrap the clean one once.")
    pieces = algorithm.pieces
    if attackers is None:  # an adversary that does not say who attacks: no diagnostics
        return compose(pieces, num_clients, adversary=adversary)
    return compose(pieces._replace(aggregator=_passing_flags(pieces.aggregator)),
                   num_clients, adversary=_flagging(adversary, attackers))
