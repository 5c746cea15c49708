"""FedOpt with hypergradient descent on the server learning rate (Rush et al., FAD, Alg. 2).

Each round t runs the inner algorithm with the current server learning rate η_t, producing
x_{t+1}(η_t). On a freshly sampled set of clients H_t from the same population, the
hypergradient  h_t = ∂/∂η  Σ_{k∈H_t} (n_k/n_H) F_k(x_{t+1}(η)) |_{η=η_t}  is computed
federatedly (forward mode: the server broadcasts x_{t+1} with its tangent ∂x_{t+1}/∂η, each
client returns its loss and the loss's directional derivative; reverse mode: a mirrored
exchange), and a hyper-optimizer updates log η (log space keeps η > 0 and makes steps
relative): log η_{t+1} = log η_t − β · η_t h_t for plain SGD.

With server SGD the derivative is −⟨∇F_H(x_{t+1}), Δ_t⟩, the classic hypergradient-descent
signal (Baydin et al. 2018); for any other server optimizer it is whatever the chain rule
gives through that optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedax.algorithms import CohortBatches, FederatedAlgorithm
from fedax.client import LossFn
from fedax.hyper.hypergradient import Mode, federated_loss


class HyperCohort(NamedTuple):
    """A round's two client sets: ``train`` runs the round, ``holdout`` (fresh clients
    from the same population) measures the loss the hypergradient descends."""

    train: CohortBatches
    holdout: CohortBatches


class LearnedLRState(NamedTuple):
    inner: Any
    log_lr: jax.Array
    hyper_opt_state: Any


def learned_server_lr(
    make_algorithm: Callable[[jax.Array], FederatedAlgorithm],
    init_lr: float,
    loss_fn: LossFn,
    hyper_optimizer: optax.GradientTransformation | None = None,
    mode: Mode = "forward",
) -> FederatedAlgorithm:
    """Wrap ``make_algorithm(server_lr)`` so that it learns its server learning rate.

    Args:
      make_algorithm: builds the algorithm for a (traced) server learning rate; its state
        structure must not depend on the value.
      init_lr: the starting server learning rate.
      loss_fn: the per-batch loss used on the holdout clients.
      hyper_optimizer: optax transform on log η (default ``optax.adam(0.05)``).
      mode: ``"forward"`` (tangent rides with the model) or ``"reverse"``.

    Returns:
      A ``FederatedAlgorithm`` whose ``round`` takes a ``HyperCohort`` and reports
      ``server_lr`` and ``hypergradient`` (∂ holdout loss / ∂ log η) in its metrics.
    """
    hyper_optimizer = hyper_optimizer or optax.adam(0.05)

    def init(params, key):
        log_lr = jnp.log(jnp.asarray(init_lr, jnp.float32))
        inner = make_algorithm(jnp.exp(log_lr)).init(params, key)
        return LearnedLRState(inner, log_lr, hyper_optimizer.init(log_lr))

    def round_fn(state: LearnedLRState, cohort: HyperCohort, key):
        def holdout_loss(log_lr):
            algorithm = make_algorithm(jnp.exp(log_lr))
            inner, metrics = algorithm.round(state.inner, cohort.train, key)
            loss = federated_loss(loss_fn, algorithm.server_params(inner), cohort.holdout)
            return loss, (inner, metrics)

        if mode == "forward":
            loss, dloss, (inner, metrics) = jax.jvp(
                holdout_loss, (state.log_lr,), (jnp.ones_like(state.log_lr),), has_aux=True
            )
        elif mode == "reverse":
            (loss, (inner, metrics)), dloss = jax.value_and_grad(holdout_loss, has_aux=True)(
                state.log_lr
            )
        else:
            raise ValueError(f"mode must be 'forward' or 'reverse', got {mode!r}.")
        updates, hyper_state = hyper_optimizer.update(dloss, state.hyper_opt_state, state.log_lr)
        log_lr = optax.apply_updates(state.log_lr, updates)
        metrics = dict(metrics, server_lr=jnp.exp(state.log_lr), hypergradient=dloss,
                       holdout_loss=loss)
        return LearnedLRState(inner, log_lr, hyper_state), metrics

    def server_params(state: LearnedLRState):
        return make_algorithm(jnp.exp(state.log_lr)).server_params(state.inner)

    return FederatedAlgorithm(init, round_fn, server_params)
