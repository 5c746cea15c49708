"""Federated automatic differentiation applied: hypergradients and learned hyperparameters."""

from fedax.hyper.carried import CarriedState, learned_server_lr_carried
from fedax.hyper.client_weights import client_features, learned_client_weights, weighting
from fedax.hyper.hypergradient import federated_loss, hypergradient, loss_after_rounds
from fedax.hyper.hypergradient_descent import HyperCohort, HyperState, hypergradient_descent
from fedax.hyper.losses import soft_error
from fedax.hyper.server_lr import learned_server_lr, learned_server_lr_in_state

__all__ = [
    "CarriedState",
    "HyperCohort",
    "HyperState",
    "client_features",
    "federated_loss",
    "hypergradient",
    "hypergradient_descent",
    "learned_client_weights",
    "learned_server_lr",
    "learned_server_lr_carried",
    "learned_server_lr_in_state",
    "loss_after_rounds",
    "soft_error",
    "weighting",
]
