"""FedNova (Wang, Liu, Liang, Joshi, Poor, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization", NeurIPS 2020), with plain local SGD.

When clients take different numbers of local steps τ_i, FedAvg's mean of the updates
x − y_i (each about τ_i steps long) in effect weighs client i by p_i τ_i, not p_i, so it
converges to a stationary point of a different objective. FedNova averages *normalized*
updates. With local SGD (the paper's a_i = [1, ..., 1], ‖a_i‖₁ = τ_i, the client's real
local steps) client i runs its τ_i steps from x to y_i and sends its mean step

    d_i = (x − y_i) / τ_i

and with p_i = n_i / Σ_{j accepted} n_j the server takes

    τ_eff = Σ_i p_i τ_i,        x ← x − η_g · τ_eff · Σ_i p_i d_i

(the paper's update with the client learning rate inside d_i), as a server optimizer on the
pseudo-gradient τ_eff Σ p_i d_i (``optax.sgd(η_g)``; default η_g = 1). With equal τ_i it is
FedAvg exactly.

In pieces: the update is d_i with weight n_i, through the aggregator (Σ p_i d_i by default);
τ_eff takes two exact federated sums, Σ n_i τ_i and Σ n_i, which each client puts in ``sums``
(summed over the same accepted clients; an aggregator may clip or noise the updates, never
the sums). The round metric ``local_steps``, the n_k-weighted mean of τ_i, is τ_eff.

With ``local_stopping`` (``fedax.client.EBStopping``) the τ_i are the steps each client took
before its EB criterion fired: unequal by design, the case FedNova is for. Against FedAvg
with the same rule (whose mean of raw updates weighs client i by about p_i τ_i), a client
that stopped early keeps its weight p_i here, its few steps rescaled to τ_eff.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedax.aggregators import Aggregator
from fedax.algorithms.base import ClientMessage, FederatedAlgorithm
from fedax.algorithms.fedavg import (
    check_stopping,
    model_pieces,
    stopping_spread,
    stopping_stats,
)
from fedax.algorithms.protocol import compose
from fedax.client import Batches, EBStopping, LossFn, local_train


def fednova(
    loss_fn: LossFn,
    client_lr: float,
    server_optimizer: optax.GradientTransformation | None = None,
    aggregator: Aggregator | None = None,
    local_stopping: EBStopping | None = None,
) -> FederatedAlgorithm:
    """FedNova with local SGD at ``client_lr`` and an optax server optimizer.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, the masked mean loss of one batch.
      client_lr: the local learning rate η_l.
      server_optimizer: applied to the pseudo-gradient τ_eff Σ p_i d_i; default
        ``optax.sgd(1.0)``.
      aggregator: combines the d_i with weights n_i; default the weighted mean Σ p_i d_i.
      local_stopping: an ``EBStopping`` rule: τ_i is then the steps client i took before
        its EB criterion fired (see the module docstring).

    Returns:
      A ``FederatedAlgorithm`` (state ``RoundState`` with server ``ServerState``). Metrics:
      ``train_loss``, ``local_steps`` (τ_eff), ``rejected_clients`` and the aggregator's;
      with ``local_stopping`` also ``stopped_early`` and the spread of the τ_i.
    """
    check_stopping(local_stopping)
    client_optimizer = optax.sgd(client_lr)

    def client_update(x, client_state, batches: Batches, num_examples):
        del client_state
        result = local_train(loss_fn, x, batches, client_optimizer, stopping=local_stopping)
        tau = result.num_steps  # τ_i; 0 for a padding client, whose d_i is then 0
        d = jax.tree.map(
            lambda a, b: (a - b) / jnp.maximum(tau, 1.0).astype(a.dtype), x, result.params)
        return ClientMessage(d, num_examples, stopping_stats(result),
                             sums=(num_examples * tau, num_examples))

    def pseudo_gradient(mean_d, sums):
        weighted_steps, total = sums  # Σ n_i τ_i and Σ n_i over the accepted clients
        tau_eff = weighted_steps / jnp.where(total > 0, total, 1.0)
        return jax.tree.map(lambda d: tau_eff.astype(d.dtype) * d, mean_d)

    return compose(model_pieces(client_update, server_optimizer, aggregator,
                                pseudo_gradient=pseudo_gradient,
                                spread=stopping_spread(local_stopping)))


def make_fednova(
    loss_fn: LossFn,
    *,
    num_clients: int,
    client_lr: float,
    server_optimizer: optax.GradientTransformation | None = None,
    aggregator: Aggregator | None = None,
    local_stopping: EBStopping | None = None,
) -> FederatedAlgorithm:
    """The registry's factory (``fedax.algorithms.ALGORITHMS``); FedNova keeps no
    per-client state, so ``num_clients`` is unused."""
    del num_clients
    return fednova(loss_fn, client_lr, server_optimizer, aggregator, local_stopping)


def check_sums(client_lr: float):
    """The server's re-check of a FedNova report's exact sums (the registry's
    ``ExactSums.check``): (Σ n_i τ_i, Σ n_i) must be (n_k K_i, n_k) exactly, from the
    report's own checked n_k and steps."""
    del client_lr

    def check(report, payload, steps):
        del payload
        weighted, total = (float(np.asarray(s)) for s in report.sums)
        n = float(report.num_examples)
        if total != n or weighted != np.float32(n * steps):
            return (f"FedNova sums ({weighted:g}, {total:g}) are not (n_k·τ_k, n_k) = "
                    f"({n * steps:g}, {n:g})")
        return None

    return check
