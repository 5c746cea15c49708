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

from fedax import federated as fed
from fedax.algorithms.base import (
    CohortBatches,
    FederatedAlgorithm,
    accept_finite,
    client_mean_loss,
)
from fedax.algorithms.fedavg import FedAvgState
from fedax.client import LossFn


def fedsgd(
    loss_fn: LossFn,
    client_lr: float,
    server_optimizer: optax.GradientTransformation | None = None,
) -> FederatedAlgorithm:
    """FedSGD. The cohort must hold each client's data as full batches (B = ∞, E = 1):
    every real step of a client contributes the gradient of its loss on that batch."""
    server_optimizer = server_optimizer or optax.sgd(1.0)

    def init(params, key):
        del key
        return FedAvgState(params, server_optimizer.init(params), jnp.zeros((), jnp.int32))

    client_grad = jax.value_and_grad(functools.partial(client_mean_loss, loss_fn))

    def round_fn(state: FedAvgState, cohort: CohortBatches, key):
        del key
        num_clients = cohort.num_examples.shape[0]
        losses, grads = fed.map_clients(
            client_grad, fed.broadcast(state.params, num_clients), cohort.batches
        )
        accepted = accept_finite((grads, losses), cohort.num_examples, cohort.num_examples)
        pseudo_grad = jax.tree.map(
            lambda g: client_lr * g, fed.weighted_mean(grads, accepted.weights)
        )
        updates, opt_state = server_optimizer.update(
            pseudo_grad, state.server_opt_state, state.params
        )
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "train_loss": fed.weighted_mean(losses, accepted.weights),
            "local_steps": jnp.ones((), jnp.float32),
            "rejected_clients": accepted.rejected,
        }
        return FedAvgState(params, opt_state, state.round + 1), metrics

    return FederatedAlgorithm(init, round_fn, lambda state: state.params)
