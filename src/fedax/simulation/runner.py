"""The simulation runner: seeded cohorts, compiled rounds, evaluation and callbacks.

A run is a pure function of its inputs and seed. Round t draws its cohort and the clients'
shuffles from ``np.random.default_rng([seed, t])`` and its JAX key from
``fold_in(key(seed), t)``, so any round can be reproduced (and a run resumed) on its own.
The whole training set lives on the device once; a cohort travels as example indices
``[C, S, B]`` plus masks, and the gather happens inside the compiled round.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from fedax.algorithms import CohortBatches, FederatedAlgorithm
from fedax.client import Batches
from fedax.data import ClientData, Cohort, make_cohort, num_local_steps, sample_clients
from fedax.simulation.execution import Execution, choose_execution, use_execution


def rounds_to_target(
    rounds: Sequence[float], accuracies: Sequence[float], target: float
) -> float | None:
    """Rounds to reach ``target`` as read in McMahan et al. 2017.

    The accuracy curve is made monotone (best so far), then the first crossing of the
    target is found by linear interpolation between evaluation points. Returns ``None``
    when the target is never reached.
    """
    if len(rounds) != len(accuracies):
        raise ValueError("rounds and accuracies must have the same length.")
    best = np.maximum.accumulate(np.asarray(accuracies, dtype=np.float64))
    hits = np.nonzero(best >= target)[0]
    if hits.size == 0:
        return None
    i = int(hits[0])
    if i == 0:
        return float(rounds[0])
    r0, r1, a0, a1 = rounds[i - 1], rounds[i], best[i - 1], best[i]
    return float(r0 + (target - a0) / (a1 - a0) * (r1 - r0))


@dataclass
class History:
    """Evaluation records (one dict per evaluation) and the final state."""

    records: list[dict[str, Any]] = field(default_factory=list)
    state: Any = None

    def column(self, key: str) -> list[Any]:
        return [r[key] for r in self.records]

    def rounds_to_target(self, target: float) -> float | None:
        return rounds_to_target(self.column("round"), self.column("test_accuracy"), target)


Callback = Callable[[dict[str, Any]], None]


def make_evaluator(
    apply_fn: Callable[[Any, jax.Array], jax.Array],
    x: np.ndarray,
    y: np.ndarray,
    chunk: int = 1000,
) -> Callable[[Any], tuple[float, float]]:
    """A compiled ``evaluate(params) -> (accuracy, mean cross-entropy)`` over a test set.

    The test set is padded to a multiple of ``chunk`` and scanned chunk by chunk with a
    mask, so memory is one chunk's activations.
    """
    n = len(y)
    chunks = math.ceil(n / chunk)
    pad = chunks * chunk - n
    xs = jnp.asarray(np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)]))
    ys = jnp.asarray(np.concatenate([y, np.zeros(pad, y.dtype)]).astype(np.int32))
    mask = jnp.asarray(np.arange(chunks * chunk) < n, jnp.float32)
    xs = xs.reshape(chunks, chunk, *x.shape[1:])
    ys, mask = ys.reshape(chunks, chunk), mask.reshape(chunks, chunk)

    @jax.jit
    def evaluate(params):
        def body(carry, batch):
            bx, by, bm = batch
            logits = apply_fn(params, bx)
            logp = jax.nn.log_softmax(logits.astype(jnp.float32))
            nll = -jnp.take_along_axis(logp, by[:, None], axis=1)[:, 0]
            correct = (jnp.argmax(logits, axis=-1) == by).astype(jnp.float32)
            return (carry[0] + jnp.sum(correct * bm), carry[1] + jnp.sum(nll * bm)), None

        (correct, nll), _ = jax.lax.scan(body, (0.0, 0.0), (xs, ys, mask))
        return correct / n, nll / n

    def run(params):
        acc, loss = evaluate(params)
        return float(acc), float(loss)

    return run


def _maybe_mesh(mesh):
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def _pad_cohort(cohort: Cohort, multiple: int) -> Cohort:
    """Pad with empty clients (no real steps, weight n_k = 0) to a multiple of ``multiple``,
    so a cohort splits evenly over devices; padded clients change no aggregate."""
    extra = -len(cohort.client_ids) % multiple
    if extra == 0:
        return cohort

    def pad(a):
        return np.concatenate([a, np.zeros((extra, *a.shape[1:]), a.dtype)])

    return Cohort(*(pad(a) for a in cohort))


def run(
    algorithm: FederatedAlgorithm,
    init_params: Any,
    train: ClientData,
    evaluate: Callable[[Any], tuple[float, float]],
    *,
    rounds: int,
    client_fraction: float,
    local_epochs: int,
    batch_size: float,
    seed: int = 0,
    eval_every: int = 1,
    target_accuracy: float | None = None,
    stop_at_target: bool = False,
    execution: Execution | None = None,
    callbacks: Sequence[Callback] = (),
    progress: bool = False,
) -> History:
    """Run ``rounds`` rounds of ``algorithm`` on ``train``, evaluating every ``eval_every``.

    Args:
      algorithm: a ``FederatedAlgorithm``.
      init_params: the initial server model.
      train: the federated training data.
      evaluate: ``evaluate(params) -> (accuracy, loss)`` on the test set.
      rounds, client_fraction, local_epochs, batch_size: the paper's T, C, E, B
        (``batch_size=math.inf`` is the full local data set).
      seed: the run's only source of randomness.
      eval_every: evaluate after every k-th round (and after the last one).
      target_accuracy: report ``rounds_to_target`` against this accuracy.
      stop_at_target: end the run at the first evaluation that reaches the target.
      execution: execution strategy; default chosen for the backend.
      callbacks: each is called with every evaluation record.
      progress: show a progress bar with the round, test accuracy and rounds/s.

    Returns:
      The ``History`` of evaluation records, with the final algorithm state.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}.")
    execution = execution or choose_execution()
    sizes = train.sizes
    # Fixed shapes for every round (no recompilation): B = ∞ is one full batch of the
    # largest client, and S covers the largest client's E·⌈n_k/B⌉ steps.
    batch = int(sizes.max()) if math.isinf(batch_size) else int(batch_size)
    num_steps = num_local_steps(int(sizes.max()), local_epochs, batch)

    mesh = execution.mesh()
    pad_to = execution.devices
    x_all = jnp.asarray(train.x)
    y_all = jnp.asarray(train.y.astype(np.int32))
    if mesh is not None:
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        x_all, y_all = jax.device_put((x_all, y_all), replicated)

    def device_round(state, idx, mask, num_examples, client_ids, key):
        batches = Batches(x_all[idx], y_all[idx], mask)
        return algorithm.round(state, CohortBatches(batches, num_examples, client_ids), key)

    with use_execution(execution), _maybe_mesh(mesh):
        round_fn = jax.jit(device_round, donate_argnums=(0,))
        # Trace now, inside the strategy context: the compiled program captures it.
        base_key = jax.random.key(seed)
        state = algorithm.init(init_params, jax.random.fold_in(base_key, -1 & 0x7FFFFFFF))
        # Commit the state where the round leaves it, so round 2 does not recompile.
        home = replicated if mesh is not None else jax.devices()[0]
        state = jax.device_put(state, home)
        history = History()
        start = time.perf_counter()
        bar = tqdm(range(rounds), desc="rounds", unit="round", disable=not progress)
        for t in bar:
            rng = np.random.default_rng([seed, t])
            ids = sample_clients(rng, train.num_clients, client_fraction)
            cohort = _pad_cohort(
                make_cohort(train, ids, local_epochs, batch, rng, num_steps=num_steps), pad_to
            )
            key = jax.random.fold_in(base_key, t)
            state, metrics = round_fn(
                state, cohort.idx, cohort.mask, cohort.num_examples, cohort.client_ids, key
            )
            if (t + 1) % eval_every == 0 or t + 1 == rounds:
                acc, loss = evaluate(algorithm.server_params(state))
                record = {
                    "round": t + 1,
                    "test_accuracy": acc,
                    "test_loss": loss,
                    "train_loss": float(metrics["train_loss"]),
                    "elapsed_s": time.perf_counter() - start,
                }
                history.records.append(record)
                bar.set_postfix(acc=f"{acc:.4f}", loss=f"{loss:.3f}")
                for callback in callbacks:
                    callback(record)
                if not math.isfinite(loss) or not math.isfinite(record["train_loss"]):
                    raise FloatingPointError(
                        f"round {t + 1}: the model diverged (test loss {loss}, train loss "
                        f"{record['train_loss']}); lower client_lr or server.lr."
                    )
                if stop_at_target and target_accuracy is not None and acc >= target_accuracy:
                    break
        bar.close()
    history.state = state
    return history
