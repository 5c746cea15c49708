"""FederatedAveraging (McMahan et al., AISTATS 2017, Algorithm 1, with erratum 4).

Each round, the server broadcasts w_t to the sampled clients S_t; client k runs
ClientUpdate (E epochs of minibatch SGD with batch size B, i.e. E·⌈n_k/B⌉ steps) and
returns w^k_{t+1}; with m_t = Σ_{k∈S_t} n_k the server forms the pseudo-gradient

    Δ_t = w_t − Σ_{k∈S_t} (n_k / m_t) w^k_{t+1}

and applies a server optimizer to it (Reddi et al. 2021's FedOpt form). With server SGD at
learning rate 1 this is exactly w_{t+1} = Σ (n_k/m_t) w^k_{t+1}, plain FedAvg.

The optional ``client_objective`` changes what the clients minimize while keeping everything
else (broadcast, masked local steps, aggregation, server optimizer): FedProx is FedAvg whose
clients minimize F_k(w) + (μ/2)‖w − w_t‖² (``fedax.algorithms.fedprox``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedax import federated as fed
from fedax.algorithms.base import CohortBatches, FederatedAlgorithm, accept_finite
from fedax.client import Batches, LossFn, local_train


class FedAvgState(NamedTuple):
    params: Any
    server_opt_state: Any
    round: jax.Array


def fedavg(
    loss_fn: LossFn,
    client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation | None = None,
    client_objective: Callable[[LossFn, Any], LossFn] | None = None,
    client_weights: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
) -> FederatedAlgorithm:
    """FedAvg with an optax client optimizer and an optax server optimizer.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, the masked mean loss of one batch.
      client_optimizer: local optimizer, e.g. ``optax.sgd(client_lr)`` (the paper's).
      server_optimizer: applied to the pseudo-gradient Δ_t; default ``optax.sgd(1.0)``.
      client_objective: ``client_objective(loss_fn, server_params) -> LossFn``, the loss each
        client minimizes in its local steps, given the round's server model w_t as received
        by the client; default: ``loss_fn`` itself. It is traced inside ``map_clients``, so
        ``server_params`` is that client's copy of the broadcast model (derivatives flow
        through it).
      client_weights: ``client_weights(num_examples, local_losses) -> weights``, all three
        client-placed ``[C]``: the weights of the weighted mean of client updates; default
        n_k (the paper's). It must be written with the placement primitives (e.g.
        ``map_clients`` with a broadcast parameter) and give weight 0 to clients with
        n_k = 0 (padding). ``fedax.hyper.learned_client_weights`` learns such a function.

    Returns:
      A ``FederatedAlgorithm``. Its round metrics are ``train_loss`` (n_k-weighted mean of
      the accepted clients' mean local objective, i.e. ``loss_fn`` unless
      ``client_objective`` is given), ``local_steps`` (n_k-weighted mean of their real local
      steps) and ``rejected_clients`` (clients whose update or loss was not finite: they are
      left out of the aggregate; see ``accept_finite``).
    """
    server_optimizer = server_optimizer or optax.sgd(1.0)

    def init(params, key):
        del key
        return FedAvgState(params, server_optimizer.init(params), jnp.zeros((), jnp.int32))

    def client_update(params, batches: Batches):
        objective = loss_fn if client_objective is None else client_objective(loss_fn, params)
        result = local_train(objective, params, batches, client_optimizer)
        delta = jax.tree.map(jnp.subtract, params, result.params)
        return delta, result.loss, result.num_steps

    def round_fn(state: FedAvgState, cohort: CohortBatches, key):
        del key
        num_clients = cohort.num_examples.shape[0]
        at_clients = fed.broadcast(state.params, num_clients)
        deltas, losses, steps = fed.map_clients(client_update, at_clients, cohort.batches)
        weights = (
            cohort.num_examples
            if client_weights is None
            else client_weights(cohort.num_examples, losses)
        )
        # A client whose update (or loss) is not finite is left out, and counted.
        accepted = accept_finite((deltas, losses), weights, cohort.num_examples)
        pseudo_grad = fed.weighted_mean(deltas, accepted.weights)
        updates, opt_state = server_optimizer.update(
            pseudo_grad, state.server_opt_state, state.params
        )
        params = optax.apply_updates(state.params, updates)
        counted = jnp.where(accepted.finite, cohort.num_examples, 0.0)
        metrics = {
            "train_loss": fed.weighted_mean(losses, counted),
            "local_steps": fed.weighted_mean(steps, counted),
            "rejected_clients": accepted.rejected,
        }
        return FedAvgState(params, opt_state, state.round + 1), metrics

    return FederatedAlgorithm(init, round_fn, lambda state: state.params)
