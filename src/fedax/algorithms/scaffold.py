"""SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, ICML 2020, Algorithm 1).

Stochastic controlled averaging: the server keeps a control variate c, every client i of the
population keeps its own c_i, and each local step corrects the client's gradient for drift:

    y_i ← y_i − η_l (g_i(y_i) − c_i + c)                      (K_i real local steps)

    Option I:   c_i⁺ = g_i(x)              (gradient at the server model over the local data)
    Option II:  c_i⁺ = c_i − c + (x − y_i) / (K_i η_l)

    Δy = (1/|S|) Σ_{i∈S} (y_i − x),     x ← x + η_g Δy,     c ← c + (1/N) Σ_{i∈S} (c_i⁺ − c_i)

Implementation notes:

* **Corrected local steps through** ``local_train``. The client runs FedAvg's masked local
  SGD on the surrogate loss ``ℓ(y) + (t − stop_gradient(t))`` with ``t = ⟨c − c_i, y⟩``: its
  gradient is ∇ℓ(y) + c − c_i, exactly the corrected direction, while its *value* is ℓ(y)
  (t − t = 0 exactly), so the reported training loss is the real one. Padded steps (all-zero
  masks) are skipped as in every algorithm, and K_i is the client's count of real steps, so
  a client (or straggler) with fewer steps gets its own K_i in Option II.
* **Option I** uses the gradient at x of the client's loss over all its real examples:
  Σ_s m_s ∇ℓ(x; b_s) / Σ_s m_s with m_s the number of real examples of batch s (``loss_fn``
  is a masked mean per batch, so this is the mean over real examples; each epoch lists every
  example once, so E epochs give the same mean). It costs one extra pass over the batches.
* **Aggregation**: the paper's plain average over the sampled clients, 1/|S| Σ_{i∈S}, by
  default (``weighting="uniform"``: weight 1 for every client with ``num_examples > 0``, so
  padded empty clients and dropped stragglers count for nothing); ``weighting="num_examples"``
  uses FedAvg's n_k weights instead. The control-variate update is always the paper's
  (1/N) Σ_{i∈S} Δc_i, which keeps c = (1/N) Σ_i c_i when it holds initially (all zeros).
* **Server step** through an optax server optimizer on the pseudo-gradient x − mean(y_i)
  = −Δy, as in FedAvg: ``optax.sgd(η_g)`` (default η_g = 1) is the paper's x ← x + η_g Δy, and
  FedOpt optimizers (``fedax.algorithms.server_optimizers``) compose.
* **Per-client state**: c_i is SCAFFOLD's declared per-client state (``client_state``,
  zeros like the model). Whoever runs the algorithm keeps it: ``round`` in a
  ``[num_clients, ...]`` table in its state, gathered and scattered by
  ``cohort.client_ids`` (written back only for real, accepted clients); the population
  runner in a host or memory-mapped store through ``cohort_round``
  (``fedax.algorithms.base``). The c-update divides by N = ``num_clients`` either way.
* The client optimizer is plain SGD with ``client_lr`` (Option II's formula assumes it).
* **Early stopping** (``local_stopping``, ``fedax.client.EBStopping``): the EB criterion
  tests the corrected gradient, the step the client would take (the correction c − c_i is
  the same for every example: it moves g, not Σ̂), and K_i is the number of steps the
  client took, so Option II's c_i⁺ divides by the steps that made y_i.

Communication per round is twice FedAvg's, as in the paper: (x, c) down, (Δy_i, Δc_i) up.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedax.aggregators import Aggregator
from fedax.algorithms.base import (
    ClientMessage,
    FederatedAlgorithm,
    RoundPieces,
    default_aggregator,
    keyless,
)
from fedax.algorithms.fedavg import check_stopping, stopping_spread, stopping_stats
from fedax.algorithms.protocol import compose
from fedax.client import Batches, EBStopping, LossFn, local_train, mean_gradient


class ScaffoldServer(NamedTuple):
    """SCAFFOLD's server state: the model x, its optimizer state and the control c."""

    params: Any
    opt_state: Any
    control: Any


def _vdot(a: Any, b: Any) -> jax.Array | int:
    """Σ over the leaves of ⟨a, b⟩ (the int 0 for trees without leaves)."""
    return sum(jax.tree.leaves(jax.tree.map(lambda u, v: jnp.sum(u * v), a, b)))


def scaffold(
    loss_fn: LossFn,
    client_lr: float,
    num_clients: int,
    option: Literal["I", "II"] = "II",
    server_optimizer: optax.GradientTransformation | None = None,
    weighting: Literal["uniform", "num_examples"] = "uniform",
    aggregator: Aggregator | None = None,
    local_stopping: EBStopping | None = None,
) -> FederatedAlgorithm:
    """SCAFFOLD, vectorized over the cohort, with per-client control variates c_i.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, the masked mean loss of one batch.
      client_lr: the local learning rate η_l (local SGD).
      num_clients: N, the size of the population; ``cohort.client_ids`` index into it.
      option: ``"I"`` (c_i⁺ = g_i(x)) or ``"II"`` (c_i⁺ = c_i − c + (x − y_i)/(K_i η_l); the
        paper's experiments use it).
      server_optimizer: applied to the pseudo-gradient x − mean(y_i); default
        ``optax.sgd(1.0)``, i.e. η_g = 1. ``optax.sgd(η_g)`` is the paper's global step.
      weighting: ``"uniform"`` (the paper's 1/|S| mean of y_i − x) or ``"num_examples"``
        (n_k-weighted, as FedAvg).
      aggregator: combines the clients' x − y_i with those weights; default the weighted
        mean. (Δc_i is summed exactly, as the paper's c-update needs.)
      local_stopping: an ``EBStopping`` rule: each client stops its corrected local steps
        when the EB criterion fires (see the module docstring); K_i counts the steps taken.

    Returns:
      A ``FederatedAlgorithm`` (state ``RoundState``: server ``ScaffoldServer``, clients the
      c_i table). Metrics, as FedAvg's: ``train_loss`` (n_k-weighted mean of the clients'
      mean local loss ``loss_fn``, without the correction), ``local_steps`` (n_k-weighted
      mean of real local steps) and ``rejected_clients``; with ``local_stopping`` also
      ``stopped_early`` and the spread of the steps (see ``fedavg``).
    """
    check_stopping(local_stopping)
    if option not in ("I", "II"):
        raise ValueError(f"SCAFFOLD option must be 'I' or 'II', got {option!r}.")
    if weighting not in ("uniform", "num_examples"):
        raise ValueError(
            f"SCAFFOLD weighting must be 'uniform' or 'num_examples', got {weighting!r}."
        )
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise ValueError(f"num_clients must be a positive int, got {num_clients!r}.")
    server_optimizer = server_optimizer or optax.sgd(1.0)
    client_optimizer = optax.sgd(client_lr)

    def server_init(params):
        control = jax.tree.map(jnp.zeros_like, params)
        return ScaffoldServer(params, server_optimizer.init(params), control)

    def client_update(payload, c_i, batches: Batches, num_examples):
        x, c = payload
        active = num_examples > 0
        correction = jax.tree.map(jnp.subtract, c, c_i)  # c − c_i

        def corrected_loss(y, batch):
            # value: loss_fn(y, batch); gradient: ∇loss_fn(y, batch) + c − c_i.
            t = _vdot(correction, y)
            return loss_fn(y, batch) + (t - jax.lax.stop_gradient(t))

        result = local_train(corrected_loss, x, batches, client_optimizer,
                             stopping=local_stopping)
        y = result.params
        if option == "I":
            c_plus = mean_gradient(loss_fn, x, batches)
        else:
            steps = jnp.maximum(result.num_steps, 1)  # K_i, a whole number

            def c_plus_leaf(ci, cs, xs, ys):
                # K_i·η_l in the leaf's dtype (at least float32): a float64 run divides by
                # the float64 product, as a float64 Algorithm 1 does
                dtype = jnp.promote_types(xs.dtype, jnp.float32)
                scale = steps.astype(dtype) * jnp.asarray(client_lr, dtype)
                return ci - cs + (xs - ys) / scale.astype(xs.dtype)

            c_plus = jax.tree.map(c_plus_leaf, c_i, c, x, y)
        delta_y = jax.tree.map(jnp.subtract, x, y)  # server − client: the pseudo-gradient
        # Only participating clients report a control change (padding reports zero).
        delta_c = jax.tree.map(
            lambda new, old: jnp.where(active, new - old, jnp.zeros_like(old)), c_plus, c_i
        )
        weight = active.astype(num_examples.dtype) if weighting == "uniform" else num_examples
        return ClientMessage(delta_y, weight, stopping_stats(result), delta_c, c_plus)

    def server_update(server: ScaffoldServer, pseudo_grad, delta_c_sum):
        updates, opt_state = server_optimizer.update(pseudo_grad, server.opt_state,
                                                     server.params)
        params = optax.apply_updates(server.params, updates)
        control = jax.tree.map(
            lambda cs, dc: cs + dc / jnp.asarray(num_clients, dc.dtype),
            server.control,
            delta_c_sum,
        )
        return ScaffoldServer(params, opt_state, control), {}

    pieces = RoundPieces(
        server_init=server_init,
        payload=lambda server: (server.params, server.control),
        client_update=keyless(client_update),
        server_update=server_update,
        server_params=lambda server: server.params,
        aggregator=default_aggregator(aggregator),
        client_state=lambda params: jax.tree.map(jnp.zeros_like, params),
        spread=stopping_spread(local_stopping),
    )
    return compose(pieces, num_clients)


def check_sums(client_lr: float):
    """The server's re-check of a SCAFFOLD (Option II) report's exact sums (the registry's
    ``ExactSums.check``): ``check(report, payload, steps) -> reason | None`` with
    Δc_i = −c + Δy_i / (K_i η_l), the server's own c and the report's own update and steps,
    to float tolerance (the client computes (c_i − c + Δy/s) − c_i: rounding of order
    |c_i| ~ |c|). A client with n_k = 0 sends zeros."""

    def check(report, payload, steps):
        _, control = payload
        scale = max(steps, 1.0) * client_lr
        active = float(report.num_examples) > 0
        leaves, _ = jax.tree_util.tree_flatten_with_path(report.sums)
        for (path, dc), c, u in zip(leaves, jax.tree.leaves(control),
                                    jax.tree.leaves(report.update), strict=True):
            dc, c, u = (np.asarray(a, np.float64) for a in (dc, c, u))
            expected = (-c + u / scale) if active else np.zeros_like(c)
            tolerance = 1e-3 * (np.abs(expected).max(initial=0.0)
                                + np.abs(c).max(initial=0.0)) + 1e-6
            if np.abs(dc - expected).max(initial=0.0) > tolerance:
                return (f"SCAFFOLD control delta {jax.tree_util.keystr(path)} is not "
                        f"−c + Δy/(K·η_l) for the report's own update and K={steps:g}")
        return None

    return check
