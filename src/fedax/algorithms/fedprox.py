"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, MLSys 2020).

FedProx is FedAvg whose clients minimize, instead of their local loss F_k, the proximal
subproblem

    h_k(w; w_t) = F_k(w) + (μ/2)‖w − w_t‖²,        ∇h_k(w) = ∇F_k(w) + μ (w − w_t),

so a local SGD step is w ← w − η (∇F_k(w) + μ (w − w_t)). It is written as
``fedavg(..., client_objective=proximal(mu))``: broadcast, masked local steps, aggregation
and the server optimizer are FedAvg's own code. With μ = 0 it is FedAvg.

Aggregation: the paper's Algorithm 2 averages 1/K Σ w_k over devices sampled with
probability p_k = n_k/n, but its experiments sample uniformly and weight by n_k (the McMahan
et al. scheme); we do the latter, FedAvg's n_k-weighted mean.

Stragglers (the paper's "partial work"): a straggler that runs fewer epochs is a client whose
cohort masks hold fewer real steps; its masked-out steps are skipped, so FedProx keeps its
partial update at its full weight n_k. FedAvg in the paper *drops* stragglers instead, i.e.
gives them weight 0: see ``fedax.simulation.stragglers``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedax.aggregators import Aggregator
from fedax.algorithms.base import FederatedAlgorithm
from fedax.algorithms.fedavg import fedavg
from fedax.client import EBStopping, LossFn


def proximal(mu: float) -> Callable[[LossFn, Any], LossFn]:
    """The FedProx client objective: ``loss_fn(w, b) + (μ/2)‖w − w_t‖²``.

    A ``client_objective`` for :func:`fedax.algorithms.fedavg`. The anchor w_t is the server
    model the client received; it is not stop-gradiented, so derivatives of a whole round with
    respect to the server model see that the local objective depends on it (the prox term's
    gradient in the local steps, taken with respect to w only, is μ (w − w_t) either way).

    Args:
      mu: the proximal coefficient μ ≥ 0.
    """
    if mu < 0:
        raise ValueError(f"FedProx needs mu >= 0, got {mu!r}.")

    def objective(loss_fn: LossFn, anchor: Any) -> LossFn:
        def prox_loss(params, batch):
            sq = jax.tree.map(lambda w, a: jnp.sum(jnp.square(w - a)), params, anchor)
            return loss_fn(params, batch) + 0.5 * mu * sum(jax.tree.leaves(sq))

        return prox_loss

    return objective


def fedprox(
    loss_fn: LossFn,
    client_optimizer: optax.GradientTransformation,
    mu: float,
    server_optimizer: optax.GradientTransformation | None = None,
    aggregator: Aggregator | None = None,
    example_privacy: tuple[float, float] | None = None,
    local_stopping: EBStopping | None = None,
) -> FederatedAlgorithm:
    """FedProx: FedAvg with the proximal local objective F_k(w) + (μ/2)‖w − w_t‖².

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, the masked mean loss of one batch.
      client_optimizer: the local solver, e.g. ``optax.sgd(client_lr)`` (the paper's).
      mu: proximal coefficient μ ≥ 0 (the paper tries 0.001, 0.01, 0.1, 1).
      server_optimizer: applied to the pseudo-gradient; default ``optax.sgd(1.0)``.
      aggregator: combines the clients' deltas; default the n_k-weighted mean.
      example_privacy: ``(l2_clip, noise_multiplier)`` for example-level DP-SGD in the
        local steps (see ``fedavg``).
      local_stopping: an ``EBStopping`` rule (see ``fedavg``): the criterion tests the
        gradient of the proximal objective, the one the client descends (its proximal part
        is the same for every example: it moves g, not Σ̂).

    Returns:
      A ``FederatedAlgorithm`` with FedAvg's state and metrics; note that
      ``train_loss`` is the mean local *objective* h_k, proximal term included.
    """
    return fedavg(loss_fn, client_optimizer, server_optimizer, client_objective=proximal(mu),
                  aggregator=aggregator, example_privacy=example_privacy,
                  local_stopping=local_stopping)
