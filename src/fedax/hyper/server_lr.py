"""FedOpt with a server learning rate learned by hypergradient descent.

The server learning rate η is learned in log space (η = exp(u)): positivity is free and steps
are relative. With server SGD the hypergradient is ∂L/∂u = −η ⟨∇F_H(x_{t+1}), Δ_t⟩, the
classic hypergradient-descent signal (Baydin et al. 2018) computed federatedly; for any
other server optimizer it is whatever the chain rule gives through that optimizer.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from fedax.algorithms import (
    FederatedAlgorithm,
    server_learning_rate,
    with_server_learning_rate,
)
from fedax.client import LossFn
from fedax.hyper.hypergradient import Mode
from fedax.hyper.hypergradient_descent import hypergradient_descent


def learned_server_lr(
    make_algorithm: Callable[[jax.Array], FederatedAlgorithm],
    init_lr: float,
    loss_fn: LossFn,
    hyper_optimizer: optax.GradientTransformation | None = None,
    mode: Mode = "forward",
) -> FederatedAlgorithm:
    """``make_algorithm(server_lr)`` that learns its server learning rate.

    The state's ``hparams`` is ``log η``; round metrics add ``server_lr`` (the η used).
    Default hyper-optimizer: ``optax.adam(0.05)`` on log η.
    """
    inner = hypergradient_descent(
        lambda log_lr: make_algorithm(jnp.exp(log_lr)),
        jnp.log(jnp.float32(init_lr)),
        loss_fn,
        hyper_optimizer or optax.adam(0.05),
        mode,
    )

    def round_fn(state, cohort, key):
        new_state, metrics = inner.round(state, cohort, key)
        return new_state, dict(metrics, server_lr=jnp.exp(state.hparams))

    return FederatedAlgorithm(inner.init, round_fn, inner.server_params)


def with_state_lr(algorithm: FederatedAlgorithm, lr: jax.Array) -> FederatedAlgorithm:
    """``algorithm`` whose every round first sets the server learning rate held in its
    ``RoundState.server.opt_state`` (``optax.inject_hyperparams``) to ``lr``."""

    def round_fn(state, cohort, key):
        server = state.server
        opt_state = with_server_learning_rate(server.opt_state, lr)
        return algorithm.round(state._replace(server=server._replace(opt_state=opt_state)),
                               cohort, key)

    return FederatedAlgorithm(algorithm.init, round_fn, algorithm.server_params)


def require_injected_lr(state) -> None:
    """Raise unless ``state`` (a ``RoundState``) holds its server learning rate."""
    held = getattr(getattr(state, "server", None), "opt_state", None)
    if held is None or server_learning_rate(held) is None:
        raise ValueError(
            "a learned server learning rate needs an algorithm whose state holds its "
            "server optimizer's learning rate (built with "
            "fedax.algorithms.server_optimizer, as the registry does).")


def learned_server_lr_in_state(
    algorithm: FederatedAlgorithm,
    init_lr: float,
    loss_fn: LossFn,
    hyper_optimizer: optax.GradientTransformation | None = None,
    mode: Mode = "forward",
) -> FederatedAlgorithm:
    """Learn the server learning rate η that ``algorithm`` holds in its server optimizer's
    state (``fedax.algorithms.server_optimizer``, built with ``optax.inject_hyperparams``).

    Any algorithm whose state is a ``RoundState`` with ``server.opt_state`` works (FedAvg,
    FedProx, the FedOpt names, SCAFFOLD, FedNova): each round sets η = exp(u) in that state,
    runs the round, and descends the holdout loss in u = log η by hypergradient (as
    :func:`learned_server_lr`). The round takes a ``HyperCohort``; metrics add
    ``server_lr`` (the η used), ``holdout_loss`` and ``hypergradient_norm``. Default
    hyper-optimizer: ``optax.adam(0.05)`` on log η.
    """

    def init(params, key):
        state = inner.init(params, key)
        require_injected_lr(state.inner)
        return state

    inner = hypergradient_descent(
        lambda log_lr: with_state_lr(algorithm, jnp.exp(log_lr)),
        jnp.log(jnp.float32(init_lr)), loss_fn, hyper_optimizer or optax.adam(0.05), mode)

    def round_fn(state, cohort, key):
        new_state, metrics = inner.round(state, cohort, key)
        return new_state, dict(metrics, server_lr=jnp.exp(state.hparams))

    return FederatedAlgorithm(init, round_fn, inner.server_params)
