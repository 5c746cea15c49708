"""The simulation runner: seeded cohorts, compiled rounds, evaluation and callbacks.

A run is a pure function of its inputs and seed. Round t draws its cohort and the clients'
shuffles from ``np.random.default_rng([seed, t])`` and its JAX key from
``fold_in(key(seed), t)``, so any round can be reproduced (and a run resumed) on its own.
The whole training set lives on the device once; a cohort travels as example indices
``[C, S, B]`` plus masks, and the gather happens inside the compiled round.

With ``checkpoint_dir`` and ``checkpoint_every``, the state and the records so far are saved
every k rounds (see ``fedax.simulation.checkpoint``), and ``resume=True`` continues from the
newest valid checkpoint: the resumed run's records and final state are bit-identical to an
uninterrupted run's (``elapsed_s`` aside).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from fedax import federated as fed
from fedax.algorithms import CohortBatches, FederatedAlgorithm, straggler_epochs
from fedax.algorithms import drop_stragglers as drop_stragglers_fn
from fedax.client import Batches
from fedax.data import ClientData, Cohort, make_cohort, num_local_steps, sample_clients
from fedax.simulation import checkpoint as ckpt
from fedax.simulation.device_data import cohort_features, put_features, take
from fedax.simulation.execution import Execution, choose_execution, use_execution
from fedax.simulation.host import compiler_options


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
    """Evaluation records (one dict per evaluation) and the final state.

    ``resumed_from`` is the round of the checkpoint a resumed run started from (else None).
    """

    records: list[dict[str, Any]] = field(default_factory=list)
    state: Any = None
    resumed_from: int | None = None

    def column(self, key: str) -> list[Any]:
        return [r[key] for r in self.records]

    def rounds_to_target(self, target: float) -> float | None:
        return rounds_to_target(self.column("round"), self.column("test_accuracy"), target)


class DivergenceError(FloatingPointError):
    """A run stopped because round ``round`` produced a non-finite server model, or more of
    its clients sent non-finite updates than ``max_rejected_fraction`` allows. The state of
    that round is never checkpointed; the newest checkpoint (if any) is from before it."""

    def __init__(self, message: str, round: int):  # noqa: A002 - the round number
        super().__init__(message)
        self.round = round


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run: ``rounds_done`` rounds had finished, and ``checkpoint_round`` is
    the round of the newest checkpoint this run saved or resumed from (None if none)."""

    def __init__(self, rounds_done: int, checkpoint_round: int | None):
        super().__init__(f"interrupted after round {rounds_done}")
        self.rounds_done = rounds_done
        self.checkpoint_round = checkpoint_round


Callback = Callable[[dict[str, Any]], None]
"""Called with each evaluation record. A callback may also have an ``on_resume(records)``
method: a resumed run calls it once, before its first round, with the records restored
from the checkpoint (e.g. to rewrite a metrics log that may hold records of rounds after
the checkpoint, which the resumed run recomputes)."""


def make_evaluator(
    apply_fn: Callable[[Any, jax.Array], jax.Array],
    x: np.ndarray,
    y: np.ndarray,
    chunk: int = 1000,
    pad_id: int = 0,
) -> Callable[[Any], tuple[float, float]]:
    """A compiled ``evaluate(params) -> (accuracy, mean cross-entropy)`` over a test set.

    The test set is padded to a multiple of ``chunk`` and scanned chunk by chunk with a
    mask, so memory is one chunk's activations. Sequence labels ``y [N, T]`` (next-token
    prediction) are scored per token, and targets equal to ``pad_id`` count for nothing.
    """
    n = len(y)
    sequence = y.ndim > 1
    total = float(np.sum(y != pad_id)) if sequence else float(n)
    chunks = math.ceil(n / chunk)
    pad = chunks * chunk - n
    xs = jnp.asarray(np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)]))
    ys = jnp.asarray(np.concatenate([y, np.zeros((pad, *y.shape[1:]), y.dtype)])
                     .astype(np.int32))
    mask = jnp.asarray(np.arange(chunks * chunk) < n, jnp.float32)
    xs = xs.reshape(chunks, chunk, *x.shape[1:])
    ys, mask = ys.reshape(chunks, chunk, *y.shape[1:]), mask.reshape(chunks, chunk)

    # The test set is an argument, not a closed-over constant: XLA compiles a program with
    # a large embedded constant far more slowly.
    @jax.jit
    def evaluate(params, xs, ys, mask):
        def body(carry, batch):
            bx, by, bm = batch
            logits = apply_fn(params, bx)
            logp = jax.nn.log_softmax(logits.astype(jnp.float32))
            nll = -jnp.take_along_axis(logp, by[..., None], axis=-1)[..., 0]
            correct = (jnp.argmax(logits, axis=-1) == by).astype(jnp.float32)
            if sequence:
                bm = bm[:, None] * (by != pad_id)
            return (carry[0] + jnp.sum(correct * bm), carry[1] + jnp.sum(nll * bm)), None

        (correct, nll), _ = jax.lax.scan(body, (0.0, 0.0), (xs, ys, mask))
        return correct / total, nll / total

    def run(params):
        acc, loss = evaluate(params, xs, ys, mask)
        return float(acc), float(loss)

    return run


def _all_finite(tree: Any) -> jax.Array:
    """Whether every inexact leaf of ``tree`` is finite (one boolean, on the device)."""
    checks = [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)
              if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]
    return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)


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


def run_fingerprint(
    init_params: Any,
    train: ClientData,
    execution: Execution,
    *,
    extra: Mapping[str, Any] | None = None,
    **arguments: Any,
) -> dict[str, Any]:
    """What identifies a run for resuming: its arguments, the execution strategy (others
    give close but not bit-identical numbers), SHA-256 of the initial params and of the
    training data, plus the caller's ``extra`` items (prefixed ``config.``)."""
    items: dict[str, Any] = dict(arguments)
    items.update({f"execution.{k}": v for k, v in execution._asdict().items()})
    items["init_params.sha256"] = ckpt.tree_sha256(init_params)
    items["train.sha256"] = ckpt.arrays_sha256(train.x, train.y, train.indices, train.offsets)
    for key, value in _flatten(extra or {}, "config."):
        items[key] = value
    return items


def _flatten(tree: Mapping[str, Any], prefix: str):
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


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
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    fingerprint: Mapping[str, Any] | None = None,
    straggler_fraction: float = 0.0,
    drop_stragglers: bool = False,
    max_rejected_fraction: float = 0.5,
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
      execution: execution strategy; default ``choose_execution(params=init_params)``,
        chosen for the backend and the model.
      callbacks: each is called with every evaluation record (see ``Callback``).
      progress: show a progress bar with the round, test accuracy and rounds/s.
      checkpoint_dir: where checkpoints ``ckpt_<round>.msgpack`` go (the last two kept).
      checkpoint_every: save a checkpoint after every k-th round and after the last one
        (also an early stop at the target); 0 saves none. A fresh run (``resume=False``)
        that saves checkpoints first deletes old ones in ``checkpoint_dir``.
      resume: continue from the newest checkpoint in ``checkpoint_dir`` that verifies
        (a bad newer one is skipped with a ``CheckpointWarning``); with none there, start
        from round 0 with a warning. The checkpoint must come from the same run: same
        arguments, execution, initial params, training data and ``fingerprint``, or a
        ``CheckpointError`` names what differs.
      fingerprint: items identifying the run that the runner cannot see, e.g. the
        experiment config the algorithm was built from; stored in every checkpoint and
        compared on resume.
      straggler_fraction: FedProx's systems heterogeneity (Li et al. 2020, §5): each round,
        ``straggler_epochs(rng, C, E, straggler_fraction)`` (drawn from the round's rng after
        the cohort is sampled) gives every client its epochs; a straggler runs U{1..E}
        epochs and its unused steps are padding. 0 (default) draws nothing, so runs are
        bit-identical to runs without stragglers. The step count S stays that of E epochs,
        so the round compiles once.
      drop_stragglers: give the clients that ran fewer than E epochs weight 0
        (``drop_stragglers``; FedAvg's treatment in the paper) instead of aggregating their
        partial work. Requires ``round(straggler_fraction * C) < C``, so that at least one
        client of every cohort runs E epochs.
      max_rejected_fraction: every round, clients whose update is not finite are left out
        of the aggregate and counted (the algorithm's ``rejected_clients`` metric; each
        record holds the count since the previous record). A round in which more than this
        fraction of its clients were rejected stops the run with ``DivergenceError``, as
        does a round whose server model is not finite (checked inside the compiled round).
        Either way the run stops before that round's state is checkpointed.

    Returns:
      The ``History`` of evaluation records (restored ones included), with the final
      algorithm state.

    Raises:
      DivergenceError: see ``max_rejected_fraction``.
      RunInterrupted: on Ctrl-C, with the rounds done and the newest checkpoint's round.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}.")
    if checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}.")
    if (checkpoint_every or resume) and checkpoint_dir is None:
        raise ValueError("checkpoint_every > 0 and resume=True need a checkpoint_dir.")
    if not 0.0 <= straggler_fraction <= 1.0:
        raise ValueError(f"straggler_fraction must be in [0, 1], got {straggler_fraction}.")
    if not 0.0 <= max_rejected_fraction <= 1.0:
        raise ValueError(
            f"max_rejected_fraction must be in [0, 1], got {max_rejected_fraction}.")
    cohort_size = len(sample_clients(0, train.num_clients, client_fraction))
    if drop_stragglers and round(straggler_fraction * cohort_size) >= cohort_size:
        raise ValueError(
            f"drop_stragglers with straggler_fraction={straggler_fraction} makes all "
            f"{cohort_size} clients of a cohort stragglers; a round could drop every client "
            "(no weight to average). Use a smaller fraction or keep the stragglers."
        )
    execution = execution or choose_execution(params=init_params)
    sizes = train.sizes
    # Fixed shapes for every round (no recompilation): B = ∞ is one full batch of the
    # largest client, and S covers the largest client's E·⌈n_k/B⌉ steps.
    batch = int(sizes.max()) if math.isinf(batch_size) else int(batch_size)
    num_steps = num_local_steps(int(sizes.max()), local_epochs, batch)
    identity = None
    if checkpoint_every or resume:
        identity = run_fingerprint(
            init_params, train, execution, extra=fingerprint, rounds=rounds,
            client_fraction=client_fraction, local_epochs=local_epochs,
            batch_size=batch_size, seed=seed, eval_every=eval_every,
            target_accuracy=target_accuracy, stop_at_target=stop_at_target,
        )
        if straggler_fraction or drop_stragglers:  # absent when off: older checkpoints match
            identity.update(straggler_fraction=straggler_fraction,
                            drop_stragglers=drop_stragglers)

    mesh = execution.mesh()
    pad_to = execution.devices if mesh is not None else 1
    # Where server-side values live (the state, the training set): the first device, or
    # replicated over the mesh; under a mesh, cohort arrays are split over its clients axis.
    home, client_block, block_spec = jax.devices()[0], None, None
    if mesh is not None:
        home = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        block_spec = jax.sharding.PartitionSpec(fed.CLIENTS_AXIS)
        client_block = jax.sharding.NamedSharding(mesh, block_spec)
    # The training set lives on the device once, as 8-bit codes when it is exactly k/255
    # image data; see fedax.simulation.device_data.
    features = put_features(train.x, home)
    x_all, table = features.values, features.table
    y_all = jax.device_put(train.y.astype(np.int32), home)

    # The training set is an argument of the compiled round, not a closed-over constant
    # (embedding it in the program makes every compilation much slower). Under a mesh the
    # cohort arrives sharded over clients, so each device gathers only its own clients.
    def device_round(state, x_all, y_all, idx, mask, num_examples, client_ids, key):
        x = cohort_features(x_all, table, idx, block_spec)
        batches = Batches(x, take(y_all, idx, block_spec), mask)
        state, metrics = algorithm.round(
            state, CohortBatches(batches, num_examples, client_ids), key)
        metrics = dict(metrics)
        metrics["server_finite"] = _all_finite(algorithm.server_params(state))
        return state, metrics

    def reached(record: dict[str, Any]) -> bool:
        return (stop_at_target and target_accuracy is not None
                and record["test_accuracy"] >= target_accuracy)

    with use_execution(execution), _maybe_mesh(mesh):
        round_fn = jax.jit(device_round, donate_argnums=(0,),
                           compiler_options=compiler_options())
        # Trace now, inside the strategy context: the compiled program captures it.
        base_key = jax.random.key(seed)
        state = algorithm.init(init_params, jax.random.fold_in(base_key, -1 & 0x7FFFFFFF))
        # Commit the state where the round leaves it, so round 2 does not recompile
        # (a copy: the round donates its state, and the caller keeps init_params usable).
        state = jax.device_put(jax.tree.map(jnp.copy, state), home)
        history = History()
        first, elapsed_before = 0, 0.0
        # Clients rejected since the last record, and the newest checkpoint's round.
        rejected_since_record, checkpoint_round = 0, None
        if resume:
            # The fresh state is the template: a restored state gets its structure (checked
            # leaf by leaf) and its placement, so the rounds compile and run as in a fresh run.
            restored = ckpt.latest_checkpoint(checkpoint_dir, state, identity)
            if restored is None:
                warnings.warn(
                    f"resume: no checkpoint in {checkpoint_dir}; starting from round 0",
                    ckpt.CheckpointWarning, stacklevel=2,
                )
            else:
                state, first = restored.state, restored.round
                elapsed_before = restored.elapsed_s
                checkpoint_round = restored.round
                rejected_since_record = int(restored.counters.get("rejected_clients", 0))
                history = History(list(restored.history), resumed_from=restored.round)
                for callback in callbacks:
                    on_resume = getattr(callback, "on_resume", None)
                    if on_resume is not None:
                        on_resume(list(history.records))
                if any(reached(r) for r in history.records):
                    first = rounds  # the run had stopped at the target
        elif checkpoint_every:
            ckpt.remove_checkpoints(checkpoint_dir)
        done = first  # rounds finished and checked

        def settle(dispatched) -> None:
            """Wait for a dispatched round and check it; raise if it diverged."""
            nonlocal rejected_since_record, done
            number, metrics, real = dispatched
            rejected = int(metrics.get("rejected_clients", 0))
            rejected_since_record += rejected
            if not bool(metrics["server_finite"]):
                raise DivergenceError(
                    f"round {number}: the server model is no longer finite (NaN or inf); "
                    "lower client_lr or server.lr", number)
            if rejected > max_rejected_fraction * real:
                raise DivergenceError(
                    f"round {number}: {rejected} of {real} clients sent non-finite updates, "
                    f"more than max_rejected_fraction={max_rejected_fraction}; lower "
                    "client_lr, or check those clients' data", number)
            done = number

        start = time.perf_counter()
        bar = tqdm(range(first, rounds), desc="rounds", unit="round", disable=not progress,
                   initial=first, total=rounds)
        pending = None  # the last dispatched round, not yet checked
        try:
            for t in bar:
                rng = np.random.default_rng([seed, t])
                ids = sample_clients(rng, train.num_clients, client_fraction)
                epochs: int | np.ndarray = local_epochs
                if straggler_fraction:
                    epochs = straggler_epochs(rng, len(ids), local_epochs, straggler_fraction)
                cohort = make_cohort(train, ids, epochs, batch, rng, num_steps=num_steps)
                if drop_stragglers and straggler_fraction:
                    cohort = drop_stragglers_fn(cohort, epochs < local_epochs)
                cohort = _pad_cohort(cohort, pad_to)
                key = jax.random.fold_in(base_key, t)
                idx, mask = cohort.idx, cohort.mask
                if client_block is not None:  # each device receives its own clients' batches
                    idx, mask = jax.device_put((idx, mask), client_block)
                # The previous round is checked only now: its cohort was built on the host
                # while the device computed it.
                if pending is not None:
                    settle(pending)
                    pending = None
                state, metrics = round_fn(
                    state, x_all, y_all, idx, mask, cohort.num_examples, cohort.client_ids, key,
                )
                pending = (t + 1, metrics, len(ids))
                evaluating = (t + 1) % eval_every == 0 or t + 1 == rounds
                due = (t + 1) % checkpoint_every == 0 if checkpoint_every else False
                if not (evaluating or due):
                    continue
                settle(pending)  # never evaluate or save a round that diverged
                pending = None
                record, diverged, stop = None, False, False
                if evaluating:
                    acc, loss = evaluate(algorithm.server_params(state))
                    record = {
                        "round": t + 1,
                        "test_accuracy": acc,
                        "test_loss": loss,
                        "train_loss": float(metrics["train_loss"]),
                        "rejected_clients": rejected_since_record,
                        "elapsed_s": elapsed_before + time.perf_counter() - start,
                    }
                    rejected_since_record = 0
                    history.records.append(record)
                    bar.set_postfix(acc=f"{acc:.4f}", loss=f"{loss:.3f}")
                    diverged = not (math.isfinite(loss) and math.isfinite(record["train_loss"]))
                    stop = reached(record)
                # Save before the callbacks run: a callback that fails (or a kill while it
                # runs) loses no finished round. A diverged state is not saved.
                if checkpoint_every and not diverged and (due or stop or t + 1 == rounds):
                    ckpt.save_checkpoint(
                        checkpoint_dir, t + 1, state, history=history.records,
                        fingerprint=identity,
                        elapsed_s=elapsed_before + time.perf_counter() - start,
                        counters={"rejected_clients": rejected_since_record},
                    )
                    checkpoint_round = t + 1
                if record is None:
                    continue
                for callback in callbacks:
                    callback(record)
                if diverged:
                    raise DivergenceError(
                        f"round {t + 1}: the model diverged (test loss {record['test_loss']}, "
                        f"train loss {record['train_loss']}); lower client_lr or server.lr",
                        t + 1)
                if stop:
                    break
            if pending is not None:
                settle(pending)
        except KeyboardInterrupt:
            raise RunInterrupted(done, checkpoint_round) from None
        finally:
            bar.close()
    history.state = state
    return history
