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

from fedax import federated as fed
from fedax.algorithms.base import CohortBatches, FederatedAlgorithm
from fedax.algorithms.fedavg import FedAvgState
from fedax.client import Batches, LossFn


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

    def client_loss(params, batches: Batches):
        # Mean over the client's real full-batch steps (one for E = 1).
        losses = jax.vmap(loss_fn, in_axes=(None, 0))(params, batches)
        valid = jnp.any(batches.mask > 0, axis=-1).astype(losses.dtype)
        return jnp.sum(losses * valid) / jnp.maximum(jnp.sum(valid), 1.0)

    def cohort_loss(params, cohort: CohortBatches):
        num_clients = cohort.num_examples.shape[0]
        losses = fed.map_clients(
            client_loss, fed.broadcast(params, num_clients), cohort.batches
        )
        return fed.weighted_mean(losses, cohort.num_examples)

    def round_fn(state: FedAvgState, cohort: CohortBatches, key):
        del key
        loss, grads = jax.value_and_grad(cohort_loss)(state.params, cohort)
        pseudo_grad = jax.tree.map(lambda g: client_lr * g, grads)
        updates, opt_state = server_optimizer.update(
            pseudo_grad, state.server_opt_state, state.params
        )
        params = optax.apply_updates(state.params, updates)
        metrics = {"train_loss": loss, "local_steps": jnp.ones((), jnp.float32)}
        return FedAvgState(params, opt_state, state.round + 1), metrics

    return FederatedAlgorithm(init, round_fn, lambda state: state.params)
