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
* **Per-client state** c_i lives in the algorithm state for the whole population, as a pytree
  with leaves ``[num_clients, ...]`` (N times the model size). Each round gathers the cohort's
  rows by ``cohort.client_ids`` and scatters c_i⁺ back for the clients with
  ``num_examples > 0`` only (the runner's padding clients carry id 0 and must not overwrite
  client 0). The real clients of a cohort must have distinct ids.
* **Cohort slots** (``cohort_slots=C``) for populations too large for that table: the state
  then holds only C rows, slot j being the c_i of the cohort's j-th client (padding
  included), read and written in place; ``cohort.client_ids`` are not used. The caller keeps
  the population's c_i elsewhere and fills the slots before each round, reading c_i⁺ back
  after (``fedax.simulation.population``: a host-memory or memory-mapped
  ``ClientStateStore``, so only the cohort's rows move). Same update code, same numbers; the
  c-update still divides by N = ``num_clients``.
* The client optimizer is plain SGD with ``client_lr`` (Option II's formula assumes it).

Communication per round is twice FedAvg's, as in the paper: (x, c) down, (Δy_i, Δc_i) up.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedax import federated as fed
from fedax.algorithms.base import CohortBatches, FederatedAlgorithm, accept_finite, keep_clients
from fedax.client import Batches, LossFn, current_steps_strategy, local_train


class ScaffoldState(NamedTuple):
    """SCAFFOLD's state.

    Attributes:
      params: the server model x.
      server_opt_state: the server optimizer's state.
      control: the server control variate c (shaped like ``params``).
      client_controls: every client's c_i, leaves ``[num_clients, *param.shape]``; with
        ``cohort_slots=C``, the cohort's c_i only, leaves ``[C, *param.shape]`` (slot j is
        the cohort's j-th client).
      round: the number of rounds run.
    """

    params: Any
    server_opt_state: Any
    control: Any
    client_controls: Any
    round: jax.Array


def _vdot(a: Any, b: Any) -> jax.Array:
    return sum(jax.tree.leaves(jax.tree.map(lambda u, v: jnp.sum(u * v), a, b)))


def _scatter_rows(population: Any, rows: jax.Array, values: Any) -> Any:
    """``population[rows] = values`` leafwise; rows out of range are dropped.

    ``values`` (and ``rows``, which depend on them) come out of ``map_clients``, so under an
    explicitly sharded ``clients`` mesh axis they are sharded over it while the population
    table is not: they are first resharded to the table's (replicated) layout, as a scatter
    of mixed layouts is an error.
    """

    def like(a, template):
        if any(axis is not None for axis in jax.typeof(a).sharding.spec):
            spec = jax.typeof(template).sharding.spec
            a = jax.sharding.reshard(a, jax.sharding.PartitionSpec(*spec[:a.ndim]))
        return a

    def scatter(pop, new):
        return pop.at[like(rows, pop)].set(like(new, pop), mode="drop")

    return jax.tree.map(scatter, population, values)


def scaffold(
    loss_fn: LossFn,
    client_lr: float,
    num_clients: int,
    option: Literal["I", "II"] = "II",
    server_optimizer: optax.GradientTransformation | None = None,
    weighting: Literal["uniform", "num_examples"] = "uniform",
    cohort_slots: int | None = None,
) -> FederatedAlgorithm:
    """SCAFFOLD, vectorized over the cohort, with the population's c_i in the state.

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
      cohort_slots: None (default): the state holds all ``num_clients`` c_i, gathered and
        scattered by ``cohort.client_ids``. An int C: the state holds C slots, one per cohort
        position (every cohort must have exactly C clients, padding included), which the
        caller fills with the cohort's c_i before each round and reads back after (see the
        module notes; ``fedax.simulation.population.run_population`` does this).

    Returns:
      A ``FederatedAlgorithm`` with ``ScaffoldState``. Metrics, as FedAvg's: ``train_loss``
      (n_k-weighted mean of the clients' mean local loss ``loss_fn``, without the correction)
      and ``local_steps`` (n_k-weighted mean of real local steps).
    """
    if option not in ("I", "II"):
        raise ValueError(f"SCAFFOLD option must be 'I' or 'II', got {option!r}.")
    if weighting not in ("uniform", "num_examples"):
        raise ValueError(
            f"SCAFFOLD weighting must be 'uniform' or 'num_examples', got {weighting!r}."
        )
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise ValueError(f"num_clients must be a positive int, got {num_clients!r}.")
    if cohort_slots is not None and (
        isinstance(cohort_slots, bool) or not isinstance(cohort_slots, int) or cohort_slots < 1
    ):
        raise ValueError(f"cohort_slots must be None or a positive int, got {cohort_slots!r}.")
    # Rows of state.client_controls: the population, or one slot per cohort position.
    table_rows = num_clients if cohort_slots is None else cohort_slots
    server_optimizer = server_optimizer or optax.sgd(1.0)
    client_optimizer = optax.sgd(client_lr)

    def init(params, key):
        del key
        control = jax.tree.map(jnp.zeros_like, params)
        client_controls = jax.tree.map(
            lambda p: jnp.zeros((table_rows, *jnp.shape(p)), jnp.result_type(p)), params
        )
        return ScaffoldState(
            params,
            server_optimizer.init(params),
            control,
            client_controls,
            jnp.zeros((), jnp.int32),
        )

    def full_gradient(x, batches: Batches):
        """Option I: mean gradient at x over the client's real examples."""

        def step(acc, batch: Batches):
            m = jnp.sum(batch.mask)
            g = jax.grad(loss_fn)(x, batch)
            new = jax.tree.map(lambda a, gi: a + m.astype(gi.dtype) * gi, acc, g)
            return jax.tree.map(lambda n, a: jnp.where(m > 0, n, a), new, acc), m

        zeros = jax.tree.map(jnp.zeros_like, x)
        num_steps = batches.mask.shape[0]
        unroll = num_steps if current_steps_strategy() == "unroll" else 1
        total, ms = jax.lax.scan(step, zeros, batches, unroll=max(unroll, 1))
        count = jnp.maximum(jnp.sum(ms), 1.0)
        return jax.tree.map(lambda t: t / count.astype(t.dtype), total)

    def client_update(x, c, c_i, active, batches: Batches):
        correction = jax.tree.map(jnp.subtract, c, c_i)  # c − c_i

        def corrected_loss(y, batch):
            # value: loss_fn(y, batch); gradient: ∇loss_fn(y, batch) + c − c_i.
            t = _vdot(correction, y)
            return loss_fn(y, batch) + (t - jax.lax.stop_gradient(t))

        result = local_train(corrected_loss, x, batches, client_optimizer)
        y = result.params
        if option == "I":
            c_plus = full_gradient(x, batches)
        else:
            scale = jnp.maximum(result.num_steps, 1.0) * client_lr
            c_plus = jax.tree.map(
                lambda ci, cs, xs, ys: ci - cs + (xs - ys) / scale.astype(xs.dtype),
                c_i,
                c,
                x,
                y,
            )
        delta_y = jax.tree.map(jnp.subtract, x, y)  # server − client: the pseudo-gradient
        # Only participating clients report a control change (padding reports zero).
        delta_c = jax.tree.map(
            lambda new, old: jnp.where(active, new - old, jnp.zeros_like(old)), c_plus, c_i
        )
        return delta_y, delta_c, c_plus, result.loss, result.num_steps

    def round_fn(state: ScaffoldState, cohort: CohortBatches, key):
        del key
        size = cohort.num_examples.shape[0]
        active = cohort.num_examples > 0
        if cohort_slots is None:
            ids = cohort.client_ids
        elif size == cohort_slots:
            ids = jnp.arange(size, dtype=jnp.int32)  # slot j holds the j-th client's c_i
        else:
            raise ValueError(
                f"SCAFFOLD with cohort_slots={cohort_slots} got a cohort of {size} clients."
            )
        c_i = jax.tree.map(lambda pop: pop[ids], state.client_controls)
        deltas, delta_c, c_plus, losses, steps = fed.map_clients(
            client_update,
            fed.broadcast(state.params, size),
            fed.broadcast(state.control, size),
            c_i,
            active,
            cohort.batches,
        )
        if weighting == "uniform":
            weights = active.astype(cohort.num_examples.dtype)
        else:
            weights = cohort.num_examples
        # A client whose update, control or loss is not finite is left out, and counted:
        # it changes neither the model, nor c, nor its own c_i.
        accepted = accept_finite((deltas, c_plus, losses), weights, cohort.num_examples)
        pseudo_grad = fed.weighted_mean(deltas, accepted.weights)
        updates, opt_state = server_optimizer.update(
            pseudo_grad, state.server_opt_state, state.params
        )
        params = optax.apply_updates(state.params, updates)
        control = jax.tree.map(
            lambda cs, dc: cs + dc / jnp.asarray(num_clients, dc.dtype),
            state.control,
            fed.sum(keep_clients(delta_c, accepted.finite)),
        )
        # Scatter c_i⁺ back; non-participants get an out-of-range index and are dropped.
        rows = jnp.where(active & accepted.finite, ids, table_rows)
        client_controls = _scatter_rows(state.client_controls, rows, c_plus)
        counted = jnp.where(accepted.finite, cohort.num_examples, 0.0)
        metrics = {
            "train_loss": fed.weighted_mean(losses, counted),
            "local_steps": fed.weighted_mean(steps, counted),
            "rejected_clients": accepted.rejected,
        }
        new_state = ScaffoldState(params, opt_state, control, client_controls, state.round + 1)
        return new_state, metrics

    return FederatedAlgorithm(init, round_fn, lambda state: state.params)
