"""Hypergradient descent on any hyperparameters of any algorithm (Rush et al., FAD, Alg. 2).

Each round t runs the inner algorithm built with the current hyperparameters h_t,
producing the server model x_{t+1}(h_t). On a fresh set of clients H_t from the same
population, the hypergradient  g_t = ∂/∂h Σ_{k∈H_t} (n_k/n_H) F_k(x_{t+1}(h)) |_{h=h_t}  is
computed federatedly (forward mode: one tangent per scalar hyperparameter rides with the
model; reverse mode: a mirrored exchange), and an optax hyper-optimizer updates h.

``learned_server_lr`` (server learning rate, in log space) and ``learned_client_weights``
(a weighting function of per-client quantities) are instances.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

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


class HyperState(NamedTuple):
    inner: Any
    hparams: Any
    hyper_opt_state: Any


def hypergradient_descent(
    make_algorithm: Callable[[Any], FederatedAlgorithm],
    init_hparams: Any,
    loss_fn: LossFn,
    hyper_optimizer: optax.GradientTransformation,
    mode: Mode = "forward",
) -> FederatedAlgorithm:
    """Wrap ``make_algorithm(hparams)`` so that it learns ``hparams`` while it trains.

    Args:
      make_algorithm: builds the algorithm for (traced) hyperparameters; its state
        structure must not depend on their values.
      init_hparams: a pytree of float arrays (the starting point).
      loss_fn: the per-batch loss used on the holdout clients.
      hyper_optimizer: optax transform applied to the hypergradient.
      mode: ``"forward"`` or ``"reverse"`` accumulation.

    Returns:
      A ``FederatedAlgorithm`` whose ``round`` takes a ``HyperCohort`` and adds
      ``holdout_loss`` and ``hypergradient_norm`` to the inner metrics.
    """
    if mode not in ("forward", "reverse"):
        raise ValueError(f"mode must be 'forward' or 'reverse', got {mode!r}.")

    def init(params, key):
        hparams = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), init_hparams)
        inner = make_algorithm(hparams).init(params, key)
        return HyperState(inner, hparams, hyper_optimizer.init(hparams))

    def round_fn(state: HyperState, cohort: HyperCohort, key):
        def holdout_loss(hparams):
            algorithm = make_algorithm(hparams)
            inner, metrics = algorithm.round(state.inner, cohort.train, key)
            loss = federated_loss(loss_fn, algorithm.server_params(inner), cohort.holdout)
            return loss, (loss, inner, metrics)

        if mode == "forward":
            grads, (loss, inner, metrics) = jax.jacfwd(holdout_loss, has_aux=True)(
                state.hparams
            )
        else:
            grads, (loss, inner, metrics) = jax.grad(holdout_loss, has_aux=True)(
                state.hparams
            )
        updates, hyper_state = hyper_optimizer.update(grads, state.hyper_opt_state,
                                                      state.hparams)
        hparams = optax.apply_updates(state.hparams, updates)
        metrics = dict(metrics, holdout_loss=loss, hypergradient_norm=optax.tree.norm(grads))
        return HyperState(inner, hparams, hyper_state), metrics

    def server_params(state: HyperState):
        return make_algorithm(state.hparams).server_params(state.inner)

    # FederatedAlgorithm types a round's cohort as CohortBatches; this one's is a HyperCohort
    return FederatedAlgorithm(init, cast(Any, round_fn), server_params)
