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
from fedax.algorithms.base import (
    ClientMessage,
    FederatedAlgorithm,
    RoundPieces,
    client_mean_loss,
    compose,
    default_aggregator,
)
from fedax.algorithms.fedavg import server_sgd_pieces
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
    server_init, sgd_update = server_sgd_pieces(server_optimizer or optax.sgd(1.0))
    client_grad = jax.value_and_grad(functools.partial(client_mean_loss, loss_fn))

    def client_update(params, client_state, batches, num_examples):
        del client_state
        loss, grad = client_grad(params, batches)
        return ClientMessage(grad, num_examples, {"train_loss": loss})

    def server_update(server, mean_grad, sums):
        pseudo_grad = jax.tree.map(lambda g: client_lr * g, mean_grad)
        server, metrics = sgd_update(server, pseudo_grad, sums)
        return server, dict(metrics, local_steps=jnp.ones((), jnp.float32))

    pieces = RoundPieces(
        server_init=server_init,
        payload=lambda server: server.params,
        client_update=client_update,
        server_update=server_update,
        server_params=lambda server: server.params,
        aggregator=default_aggregator(aggregator),
    )
    return compose(pieces)
