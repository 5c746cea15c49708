"""Federated automatic differentiation applied: hypergradients and learned hyperparameters."""

from fedax.hyper.hypergradient import federated_loss, hypergradient, loss_after_rounds
from fedax.hyper.server_lr import HyperCohort, LearnedLRState, learned_server_lr

__all__ = [
    "HyperCohort",
    "LearnedLRState",
    "federated_loss",
    "hypergradient",
    "learned_server_lr",
    "loss_after_rounds",
]
