"""FederatedSGD (McMahan et al. 2017): one full-batch gradient per client per round.

Written directly as federated automatic differentiation: the server differentiates the
cohort's n_k-weighted loss f(w) = Σ_k (n_k/m) F_k(w) through ``broadcast`` and
``weighted_mean``; reverse mode turns the broadcast into a federated sum, so the gradient
Σ_k (n_k/m) ∇F_k(w) is computed by the clients and summed at the server. The server then
applies ``server_optimizer`` to the pseudo-gradient η·∇f(w) (η the client learning rate),
which makes it identical to FedAvg with B = ∞ and E = 1 (the paper's equivalence), a fact
the tests check against that independent code path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fedax.algorithms.base import CohortBatches, FederatedAlgorithm, federated_loss
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

    def round_fn(state: FedAvgState, cohort: CohortBatches, key):
        del key
        loss, grads = jax.value_and_grad(federated_loss, argnums=1)(
            loss_fn, state.params, cohort
        )
        pseudo_grad = jax.tree.map(lambda g: client_lr * g, grads)
        updates, opt_state = server_optimizer.update(
            pseudo_grad, state.server_opt_state, state.params
        )
        params = optax.apply_updates(state.params, updates)
        metrics = {"train_loss": loss, "local_steps": jnp.ones((), jnp.float32)}
        return FedAvgState(params, opt_state, state.round + 1), metrics

    return FederatedAlgorithm(init, round_fn, lambda state: state.params)
