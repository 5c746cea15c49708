"""An algorithm under attack: its pieces with an adversary, composed again."""

from __future__ import annotations

from fedax.algorithms import FederatedAlgorithm, compose
from fedax.attacks.updates import Adversary


def attacked(algorithm: FederatedAlgorithm, adversary: Adversary | None,
             num_clients: int | None = None) -> FederatedAlgorithm:
    """``algorithm`` whose clients pass through ``adversary`` (``RoundPieces.adversary``:
    after the clients' updates, before the server's finite check and aggregator); None
    returns ``algorithm`` unchanged. ``num_clients`` is the population size, needed by
    algorithms with per-client state (SCAFFOLD), as for ``compose``."""
    if adversary is None:
        return algorithm
    if algorithm.pieces is None:
        raise ValueError("this algorithm is not a composition of RoundPieces (e.g. a "
                         "hypergradient wrapper); attack the inner algorithm instead.")
    if algorithm.pieces.adversary is not None:
        raise ValueError("this algorithm is already attacked; wrap the clean one once.")
    return compose(algorithm.pieces._replace(adversary=adversary), num_clients)
