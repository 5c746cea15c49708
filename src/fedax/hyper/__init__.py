"""Federated automatic differentiation applied: hypergradients and learned hyperparameters."""

from fedax.hyper.audit import audit_sums, unprivatized_sums
from fedax.hyper.carried import CarriedState, learned_server_lr_carried
from fedax.hyper.client_weights import client_features, learned_client_weights, weighting
from fedax.hyper.hypergradient import federated_loss, hypergradient, loss_after_rounds
from fedax.hyper.hypergradient_descent import HyperCohort, HyperState, hypergradient_descent
from fedax.hyper.losses import soft_error
from fedax.hyper.private import (
    HoldoutPrivacy,
    extra_releases_per_round,
    private_federated_loss,
    private_learned_server_lr,
)
from fedax.hyper.private_sums import (
    private_broadcast,
    private_sum,
    privatize_payload,
    with_private_payload,
)
from fedax.hyper.secure import secure_loss
from fedax.hyper.server_lr import learned_server_lr, learned_server_lr_in_state

__all__ = [
    "CarriedState",
    "HoldoutPrivacy",
    "HyperCohort",
    "HyperState",
    "audit_sums",
    "client_features",
    "extra_releases_per_round",
    "federated_loss",
    "hypergradient",
    "hypergradient_descent",
    "learned_client_weights",
    "learned_server_lr",
    "learned_server_lr_carried",
    "learned_server_lr_in_state",
    "loss_after_rounds",
    "private_broadcast",
    "private_federated_loss",
    "private_learned_server_lr",
    "private_sum",
    "secure_loss",
    "privatize_payload",
    "soft_error",
    "unprivatized_sums",
    "weighting",
    "with_private_payload",
]
