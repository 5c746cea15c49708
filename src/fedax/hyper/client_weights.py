"""Learned client weighting: the weights of FedAvg's weighted mean as a small parametrised
function of per-client quantities, trained by federated hypergradient descent.

    w_k(θ) = n_k · exp(θ · φ_k),   φ_k = (log n_k − log 600, ℓ_k − 1)

with ℓ_k the client's mean local training loss this round (uploaded with its update). θ = 0
is plain FedAvg (w_k = n_k). The server broadcasts θ, each client computes its own weight,
and ``weighted_mean`` is differentiated in its weights, so the derivative w.r.t. θ is a
federated program (the cotangent of each weight comes from a broadcast; θ's from a sum).
A client whose updates hurt the holdout loss (for example one with mislabelled data, whose
local loss is high) can be learned to be down-weighted.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from fedax import federated as fed
from fedax.algorithms import FederatedAlgorithm
from fedax.client import LossFn
from fedax.hyper.hypergradient import Mode
from fedax.hyper.hypergradient_descent import hypergradient_descent

NUM_FEATURES = 2


def client_features(num_examples: jax.Array, local_loss: jax.Array) -> jax.Array:
    """φ_k for one client: centred log size and local loss."""
    return jnp.stack([jnp.log(jnp.maximum(num_examples, 1.0)) - jnp.log(600.0),
                      local_loss - 1.0])


def weighting(theta: jax.Array) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The ``client_weights`` function of ``fedavg`` for parameters ``theta``."""

    def weights(num_examples, local_losses):
        n = num_examples.shape[0]

        def one(t, nk, lk):
            return nk * jnp.exp(jnp.dot(t, client_features(nk, lk)))

        return fed.map_clients(one, fed.broadcast(theta, n), num_examples, local_losses)

    return weights


def learned_client_weights(
    make_algorithm: Callable[[Callable[[jax.Array, jax.Array], jax.Array]], FederatedAlgorithm],
    loss_fn: LossFn,
    hyper_optimizer: optax.GradientTransformation | None = None,
    mode: Mode = "reverse",
) -> FederatedAlgorithm:
    """``make_algorithm(client_weights)`` (e.g. ``lambda w: fedavg(..., client_weights=w)``)
    that learns θ of ``weighting``; state ``hparams`` is θ (starts at 0 = FedAvg)."""
    return hypergradient_descent(
        lambda theta: make_algorithm(weighting(theta)),
        jnp.zeros(NUM_FEATURES, jnp.float32),
        loss_fn,
        hyper_optimizer or optax.adam(0.05),
        mode,
    )
