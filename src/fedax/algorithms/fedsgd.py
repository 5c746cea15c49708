"""FederatedSGD (McMahan et al. 2017): one full-batch gradient per client per round.

Each client k computes ∇F_k(w) on its whole local data (its mean loss over its real
batches); the server forms the n_k-weighted mean Σ_k (n_k/m) ∇F_k(w), the gradient of the
cohort's loss f(w) = Σ_k (n_k/m) F_k(w), and applies ``server_optimizer`` to the
pseudo-gradient η·∇f(w) (η the client learning rate). That makes it identical to FedAvg with
B = ∞ and E = 1 (the paper's equivalence), a fact the tests check against that independent
code path. The gradients are computed per client, rather than by differentiating
``federated_loss`` through the placement primitives, so that the server can check each
client's gradient and leave a non-finite one out (``accept_finite``); the round remains a
federated program and is differentiable end to end.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from fedax.aggregators import Aggregator
from fedax.algorithms.base import ClientMessage, FederatedAlgorithm, client_mean_loss
from fedax.algorithms.fedavg import model_pieces
from fedax.algorithms.protocol import compose
from fedax.client import LossFn


def fedsgd(
    loss_fn: LossFn,
    client_lr: float,
    server_optimizer: optax.GradientTransformation | None = None,
    aggregator: Aggregator | None = None,
) -> FederatedAlgorithm:
    """FedSGD. The cohort must hold each client's data as full batches (B = ∞, E = 1):
    every real step of a client contributes the gradient of its loss on that batch. The
    aggregator (default: the n_k-weighted mean) combines the clients' gradients."""
    client_grad = jax.value_and_grad(functools.partial(client_mean_loss, loss_fn))

    def client_update(params, client_state, batches, num_examples):
        del client_state
        loss, grad = client_grad(params, batches)
        stats = {"train_loss": loss, "local_steps": jnp.ones((), jnp.float32)}
        return ClientMessage(grad, num_examples, stats)

    def pseudo_gradient(mean_grad, sums):
        return jax.tree.map(lambda g: client_lr * g, mean_grad)

    return compose(model_pieces(client_update, server_optimizer, aggregator,
                                pseudo_gradient=pseudo_gradient))
