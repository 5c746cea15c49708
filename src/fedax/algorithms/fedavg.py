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

With ``local_stopping`` (``fedax.client.EBStopping``) each client stops its local steps when
the EB criterion of its objective says the gradient is noise (Mahsereci et al. 2017;
docs/references.md, Local training and early stopping), so client k takes τ_k ≤ E·⌈n_k/B⌉
steps. The weights stay n_k: the mean of the deltas, each about τ_k steps long, then weighs
client k by about n_k τ_k (Wang et al. 2020's objective inconsistency), so a client that
stopped early pulls the model less (and one stopped at its first check, after m steps,
little). That is the rule's intent (it stopped because what remained was noise), but the
server then optimizes a τ-weighted objective; FedNova's normalized averaging
(``fedax.algorithms.fednova``, which takes the same ``local_stopping``) averages the mean
step (x − y_k)/τ_k with weights n_k and rescales by τ_eff = Σ p_k τ_k instead, which keeps
the objective Σ p_k F_k at the price of amplifying the few steps of stopped clients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedax.aggregators import Aggregator
from fedax.algorithms.base import (
    ClientMessage,
    FederatedAlgorithm,
    RoundPieces,
    default_aggregator,
    keyless,
)
from fedax.algorithms.protocol import compose
from fedax.client import Batches, EBStopping, LossFn, dp_local_train, local_train


class ServerState(NamedTuple):
    """The server state of FedAvg-style algorithms: the model and its optimizer state."""

    params: Any
    opt_state: Any


def model_pieces(
    client_update: Callable[..., ClientMessage],
    server_optimizer: optax.GradientTransformation | None = None,
    aggregator: Aggregator | None = None,
    *,
    pseudo_gradient: Callable[[Any, Any], Any] | None = None,
    reweigh: Callable[[jax.Array, dict[str, jax.Array]], jax.Array] | None = None,
    keyed: bool = False,
    spread: tuple[str, ...] = (),
) -> RoundPieces:
    """The pieces of the FedAvg family around ``client_update``: the server holds the model
    and its optimizer state (``ServerState``), broadcasts the model, and applies
    ``server_optimizer`` (default ``optax.sgd(1.0)``) to the pseudo-gradient: the
    aggregate, or ``pseudo_gradient(aggregate, sums)``. ``client_update`` takes four
    arguments (``keyless`` adapts it), or with ``keyed`` five, the last the client's own
    training key (``RoundPieces.client_update``)."""
    server_optimizer = server_optimizer or optax.sgd(1.0)

    def server_init(params):
        return ServerState(params, server_optimizer.init(params))

    def server_update(server: ServerState, aggregate, sums):
        grad = aggregate if pseudo_gradient is None else pseudo_gradient(aggregate, sums)
        updates, opt_state = server_optimizer.update(grad, server.opt_state, server.params)
        return ServerState(optax.apply_updates(server.params, updates), opt_state), {}

    return RoundPieces(server_init, lambda server: server.params,
                       client_update if keyed else keyless(client_update), server_update,
                       lambda server: server.params, default_aggregator(aggregator),
                       reweigh=reweigh, spread=spread)


def fedavg(
    loss_fn: LossFn,
    client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation | None = None,
    client_objective: Callable[[LossFn, Any], LossFn] | None = None,
    client_weights: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    aggregator: Aggregator | None = None,
    example_privacy: tuple[float, float] | None = None,
    local_stopping: EBStopping | None = None,
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
      aggregator: how the server combines the clients' deltas w_t − w^k_{t+1}; default
        ``fedax.aggregators.mean()``, the weighted mean above.
      example_privacy: ``(l2_clip, noise_multiplier)``: each client trains with
        example-level DP-SGD (``fedax.client.dp_local_train``: per-example clipping and
        Gaussian noise in every local step, with the client's own key) instead of
        ``local_train``; the round then needs a key.
      local_stopping: an ``EBStopping`` rule: each client stops its local steps when the
        EB criterion of its objective fires (``fedax.client.early_stopping``). Not with
        ``example_privacy`` (the criterion reads the raw per-example gradients).

    Returns:
      A ``FederatedAlgorithm`` (state ``RoundState`` with server ``ServerState``). Its
      round metrics are ``train_loss`` (n_k-weighted mean of the accepted clients' mean
      local objective, i.e. ``loss_fn`` unless ``client_objective`` is given),
      ``local_steps`` (n_k-weighted mean of their real local steps), ``rejected_clients``
      (clients whose update or loss was not finite: they are left out of the aggregate; see
      ``accept_finite``) and the aggregator's metrics. With ``local_stopping`` also
      ``stopped_early`` (the n_k-weighted fraction of clients whose criterion fired) and
      the spread of the steps taken (``local_steps_min``, ``_max``, ``_total``,
      ``_per_client``; ``fedax.algorithms.round_metrics.spread_metrics``).
    """
    check_stopping(local_stopping, example_privacy)

    def client_update(params, client_state, batches: Batches, num_examples, key=None):
        del client_state
        objective = loss_fn if client_objective is None else client_objective(loss_fn, params)
        if example_privacy is None:
            result = local_train(objective, params, batches, client_optimizer,
                                 stopping=local_stopping)
        else:
            if key is None:
                raise ValueError("example-level DP-SGD draws each client's noise from its "
                                 "own key: give the round a key, not None.")
            l2_clip, noise_multiplier = example_privacy
            result = dp_local_train(objective, params, batches, client_optimizer,
                                    l2_clip=l2_clip, noise_multiplier=noise_multiplier,
                                    key=key)
        delta = jax.tree.map(jnp.subtract, params, result.params)
        stats = stopping_stats(result)
        return ClientMessage(delta, num_examples, stats)

    reweigh = None
    if client_weights is not None:
        def reweigh(weights, stats):
            return client_weights(weights, stats["train_loss"])

    return compose(model_pieces(client_update, server_optimizer, aggregator, reweigh=reweigh,
                                keyed=example_privacy is not None,
                                spread=stopping_spread(local_stopping)))


def check_stopping(local_stopping: Any, example_privacy: Any = None) -> None:
    """Raises ``ValueError`` for a ``local_stopping`` that is not None or an ``EBStopping``,
    or one given with example-level DP-SGD."""
    if local_stopping is not None and not isinstance(local_stopping, EBStopping):
        raise ValueError("local_stopping must be None or a fedax.client.EBStopping "
                         f"(fedax.client.eb_stopping(...)), got {local_stopping!r}.")
    if local_stopping is not None and example_privacy is not None:
        raise ValueError("local_stopping does not compose with example_privacy: the EB "
                         "criterion reads the raw per-example gradients, a release the "
                         "example-level epsilon does not count.")


def stopping_stats(result: Any) -> dict[str, jax.Array]:
    """A client's ``train_loss`` and ``local_steps`` (the steps it took), and with a stopping
    rule ``stopped_early`` (1.0 when its criterion fired, else 0.0)."""
    stats = {"train_loss": result.loss, "local_steps": result.num_steps}
    if result.stopping is not None:
        stats["stopped_early"] = result.stopping.stopped.astype(result.num_steps.dtype)
    return stats


def stopping_spread(local_stopping: Any) -> tuple[str, ...]:
    """The stats whose spread a round reports: the local steps when clients may stop."""
    return ("local_steps",) if local_stopping is not None else ()
