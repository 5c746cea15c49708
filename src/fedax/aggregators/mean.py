"""Reductions: the weighted mean (FedAvg's, the default of every algorithm) and the sum.

``mean()``: Σ_k w_k Δ_k / Σ_k w_k over the clients with w_k > 0 (McMahan et al. 2017 with
w_k = n_k); a zero-weight client is left out by selection, and all-zero weights give zeros
("no update"), as ``fedax.federated.weighted_mean`` defines.
``total()``: Σ_k w_k Δ_k, unnormalised (for algorithms that normalise themselves).
"""

from __future__ import annotations

from fedax import federated as fed
from fedax.aggregators.base import Aggregator, no_state


def mean() -> Aggregator:
    """The weighted mean Σ w_k x_k / Σ w_k (stateless, ignores its key, no metrics)."""

    def reduce(values, weights, state, key):
        del state, key
        return fed.weighted_mean(values, weights), {}

    def linear(total, weight, state, key):
        del state, key
        return fed.divide_by_weight(total, weight), {}

    return Aggregator(no_state, reduce=reduce, linear=linear)


def total() -> Aggregator:
    """The weighted sum Σ w_k x_k (zero-weight clients left out by selection)."""

    def reduce(values, weights, state, key):
        del state, key
        return fed.sum(fed.weighted_terms(values, weights)), {}

    def linear(total, weight, state, key):
        del weight, state, key
        return total, {}

    return Aggregator(no_state, reduce=reduce, linear=linear)
