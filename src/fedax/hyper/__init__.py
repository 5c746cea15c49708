"""Federated automatic differentiation applied: hypergradients and learned hyperparameters."""

from fedax.hyper.client_weights import client_features, learned_client_weights, weighting
from fedax.hyper.hypergradient import federated_loss, hypergradient, loss_after_rounds
from fedax.hyper.hypergradient_descent import HyperCohort, HyperState, hypergradient_descent
from fedax.hyper.server_lr import learned_server_lr

__all__ = [
    "HyperCohort",
    "HyperState",
    "client_features",
    "federated_loss",
    "hypergradient",
    "hypergradient_descent",
    "learned_client_weights",
    "learned_server_lr",
    "loss_after_rounds",
    "weighting",
]
