"""Federated hypergradients: derivatives of a loss after T rounds w.r.t. hyperparameters.

For hyperparameters h (server or client learning rates, server optimizer parameters, client
weights, ...) and an algorithm factory ``make_algorithm(h)``, the loss after T rounds on a
set of evaluation clients,

    L(h) = Σ_{k∈E} (n_k / n_E) F_k(x_T(h)),   x_{t+1} = round_h(x_t, S_t),

is an ordinary JAX function built from placement primitives, so its derivative is one too
(Rush, Charles, Garrett, "Federated Automatic Differentiation", JMLR 2024):

* forward mode (``jax.jvp``): a tangent rides with the model through every broadcast and
  every federated sum; no extra communication rounds, payload doubles, cost grows with the
  number of hyperparameters;
* reverse mode (``jax.vjp``): each broadcast is mirrored by a federated sum (and vice versa)
  in a backward pass; clients must recompute or keep residuals; cost independent of the
  number of hyperparameters.

Memory (reverse mode): with ``remat=True`` each round is rematerialized
(``jax.checkpoint``), so the tape holds the T round inputs (T server states) plus, during
the backward pass of one round, that round's per-step residuals (S local steps × cohort ×
model) — instead of T times that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, cast

import jax
import jax.numpy as jnp

from fedax.algorithms import CohortBatches, FederatedAlgorithm, federated_loss
from fedax.client import LossFn

Mode = Literal["forward", "reverse"]


def loss_after_rounds(
    make_algorithm: Callable[[Any], FederatedAlgorithm],
    hparams: Any,
    params: Any,
    cohorts: CohortBatches,
    eval_cohort: CohortBatches,
    loss_fn: LossFn,
    key: jax.Array | None = None,
    remat: bool = True,
    evaluate: Callable[[Any, CohortBatches, Any], jax.Array] | None = None,
) -> jax.Array:
    """Run ``T`` rounds of ``make_algorithm(hparams)`` from ``params`` (the cohorts stacked
    along a leading axis of size T) and return the federated loss on ``eval_cohort``.
    Round t's key is ``fold_in(key, t)`` (a DP aggregator must not reuse its noise across
    rounds: the difference of two releases would reveal the difference of the sums).
    ``evaluate(params, eval_cohort, key)`` replaces ``federated_loss`` (e.g.
    ``fedax.hyper.secure_loss``); its key is ``fold_in(key, T)``."""
    algorithm = make_algorithm(hparams)
    # FederatedAlgorithm types its keys jax.Array; its functions take None (no randomness)
    state = algorithm.init(params, cast(jax.Array, key))
    num_rounds = jax.tree.leaves(cohorts)[0].shape[0]

    def one_round(state, inputs):
        cohort, t = inputs
        round_key = None if key is None else jax.random.fold_in(key, t)
        state, _ = algorithm.round(state, cohort, cast(jax.Array, round_key))
        return state, None

    body = jax.checkpoint(one_round) if remat else one_round
    state, _ = jax.lax.scan(body, state, (cohorts, jnp.arange(num_rounds)))
    if evaluate is not None:
        eval_key = None if key is None else jax.random.fold_in(key, num_rounds)
        return evaluate(algorithm.server_params(state), eval_cohort, eval_key)
    return federated_loss(loss_fn, algorithm.server_params(state), eval_cohort)


def hypergradient(
    make_algorithm: Callable[[Any], FederatedAlgorithm],
    hparams: Any,
    params: Any,
    cohorts: CohortBatches,
    eval_cohort: CohortBatches,
    loss_fn: LossFn,
    *,
    mode: Mode = "reverse",
    key: jax.Array | None = None,
    remat: bool = True,
    evaluate: Callable[[Any, CohortBatches, Any], jax.Array] | None = None,
) -> tuple[jax.Array, Any]:
    """``(L(h), dL/dh)`` for the loss after ``T`` rounds, in forward or reverse mode.

    ``hparams`` is any pytree of float arrays (typically a few scalars). Forward mode costs
    one tangent per scalar hyperparameter; reverse mode one backward pass in total.
    """

    def f(h):
        return loss_after_rounds(make_algorithm, h, params, cohorts, eval_cohort, loss_fn,
                                 key, remat, evaluate)

    if mode == "reverse":
        return jax.value_and_grad(f)(hparams)
    if mode == "forward":
        try:
            grads, value = jax.jacfwd(lambda h: (f(h),) * 2, has_aux=True)(hparams)
        except TypeError as err:
            if "custom_vjp" not in str(err):
                raise
            raise TypeError(
                "forward-mode hypergradients need a model that JAX can differentiate in "
                "forward mode, but it has a reverse-mode-only rule (custom_vjp). On CPU the "
                "MNIST CNN's default convolutions include conv_impl='lax_vjp': build it with "
                "get_model('cnn', conv_impl='lax') or conv_impl='patches', or use "
                "mode='reverse'."
            ) from err
        return value, grads
    raise ValueError(f"mode must be 'forward' or 'reverse', got {mode!r}.")
