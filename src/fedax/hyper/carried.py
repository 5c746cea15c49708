"""A learned server learning rate whose hypergradient reaches back over past rounds.

:func:`learned_server_lr_carried` carries the tangent d x_t / d log η across rounds
(a truncated real-time forward-mode hypergradient, Franceschi et al. 2017), with decay γ;
γ = 0 is the one-round hypergradient of :func:`fedax.hyper.learned_server_lr` with
``mode="forward"``. The FAD server-LR experiment (``fedax.reproduce.hooks.fad_server_lr``)
runs it as its horizon variants.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedax.algorithms import FederatedAlgorithm, federated_loss
from fedax.client import LossFn
from fedax.hyper.hypergradient_descent import HyperCohort


def _inexact(a) -> bool:
    return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


class CarriedState(NamedTuple):
    inner: Any
    log_lr: jax.Array
    tangent: Any  # d inner / d log η along the trajectory (zeros for integer leaves)
    hyper_opt_state: Any


def learned_server_lr_carried(
    make_algorithm: Callable[[jax.Array], FederatedAlgorithm],
    init_lr: float,
    loss_fn: LossFn,
    hyper_optimizer: optax.GradientTransformation,
    decay: float | jax.Array = 0.0,
) -> FederatedAlgorithm:
    """Learned server learning rate whose hypergradient reaches back over past rounds.

    Forward mode, carried tangent (real-time hypergradient, Franceschi et al. 2017): with
    u = log η the state carries T_t ≈ d x_t / d u; each round computes, in one forward-mode
    pass through the round and the holdout loss,

        T_{t+1} = ∂round/∂x · T_t + ∂round/∂u,   g_t = ⟨∇L_H(x_{t+1}), T_{t+1}⟩,

    updates u with ``hyper_optimizer`` on g_t, and carries γ·T_{t+1} (``decay`` γ; the
    effective horizon is about 1/(1-γ) rounds). γ = 0 is exactly the one-round
    hypergradient of ``fedax.hyper.learned_server_lr(..., mode="forward")``. Communication
    per round is that of forward mode: a second model-sized tangent rides with the
    broadcast and with each client's update; the carried tangent stays on the server.

    The round takes a ``HyperCohort``; metrics add ``server_lr`` (the η used),
    ``holdout_loss`` and ``hypergradient``.
    """

    def init(params, key):
        log_lr = jnp.log(jnp.float32(init_lr))
        inner = make_algorithm(jnp.exp(log_lr)).init(params, key)
        tangent = jax.tree.map(
            lambda a: jnp.zeros(jnp.shape(a), a.dtype if _inexact(a) else jnp.float32), inner)
        return CarriedState(inner, log_lr, tangent, hyper_optimizer.init(log_lr))

    def round_fn(state: CarriedState, cohort: HyperCohort, key):
        def forward(inner, log_lr):
            algorithm = make_algorithm(jnp.exp(log_lr))
            new_inner, metrics = algorithm.round(inner, cohort.train, key)
            loss = federated_loss(loss_fn, algorithm.server_params(new_inner), cohort.holdout)
            return (new_inner, loss), metrics

        tangent_in = jax.tree.map(
            lambda t, a: t if _inexact(a) else np.zeros(jnp.shape(a), jax.dtypes.float0),
            state.tangent, state.inner)
        (inner, loss), (d_inner, d_loss), metrics = jax.jvp(
            forward, (state.inner, state.log_lr), (tangent_in, jnp.ones_like(state.log_lr)),
            has_aux=True)
        updates, hyper_state = hyper_optimizer.update(d_loss, state.hyper_opt_state,
                                                      state.log_lr)
        log_lr = optax.apply_updates(state.log_lr, updates)
        tangent = jax.tree.map(
            lambda t, a: decay * t if _inexact(a) else jnp.zeros(jnp.shape(a), jnp.float32),
            d_inner, inner)
        metrics = dict(metrics, server_lr=jnp.exp(state.log_lr), holdout_loss=loss,
                       hypergradient=d_loss)
        return CarriedState(inner, log_lr, tangent, hyper_state), metrics

    def server_params(state: CarriedState):
        return make_algorithm(jnp.exp(state.log_lr)).server_params(state.inner)

    # FederatedAlgorithm types a round's cohort as CohortBatches; this one's is a HyperCohort
    return FederatedAlgorithm(init, cast(Any, round_fn), server_params)
