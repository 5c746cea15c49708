"""The simulation runner: seeded cohorts, compiled rounds, evaluation and callbacks.

A run is a pure function of its inputs and seed. Round t draws its cohort and the clients'
shuffles from ``np.random.default_rng([seed, t])`` and its JAX key from
``fold_in(key(seed), t)``, so any round can be reproduced (and a run resumed) on its own.
The whole training set lives on the device once; a cohort travels as example indices
``[C, S, B]`` plus masks, and the gather happens inside the compiled round.

With ``checkpoint_dir`` and ``checkpoint_every``, the state and the records so far are saved
every k rounds (see ``fedax.simulation.checkpoint``), and ``resume=True`` continues from the
newest valid checkpoint: the resumed run's records and final state are bit-identical to an
uninterrupted run's (``elapsed_s`` aside). A resumed run may have more rounds than the run it
continues (a finished run is extended): its records are then those of an uninterrupted run
of the new length.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from fedax import federated as fed
from fedax.algorithms import FederatedAlgorithm, cohort_round, init_state
from fedax.data import ClientData
from fedax.federated import _lockstep
from fedax.simulation import checkpoint as ckpt
from fedax.simulation import distributed
from fedax.simulation.client_state import ClientStateStore
from fedax.simulation.execution import Execution, choose_execution, use_execution
from fedax.simulation.history import (
    Callback,
    DivergenceError,
    History,
    RunInterrupted,
    round_metrics,
)
from fedax.simulation.host import compiler_options
from fedax.simulation.sources import CohortSource, PartitionSource, RoundData


def _all_finite(tree: Any) -> jax.Array:
    """Whether every inexact leaf of ``tree`` is finite (one boolean, on the device)."""
    checks = [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)
              if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]
    return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)


def _on_every_device(tree: Any, mesh) -> Any:
    """Under a mesh, ``tree`` replicated on every device of it: the metrics, which every
    process of a multi-process run reads (a value on one device is not addressable from
    the others)."""
    if mesh is None:
        return tree
    spec = jax.sharding.PartitionSpec()
    if all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return jax.tree.map(lambda a: jax.sharding.reshard(a, spec), tree)
    return jax.lax.with_sharding_constraint(tree, jax.sharding.NamedSharding(mesh, spec))


def check_schedule(eval_every: int, checkpoint_every: int, resume: bool,
                   checkpoint_dir: Any) -> None:
    """The evaluation and checkpoint settings every runner takes (``ValueError`` naming the
    bad one)."""
    if eval_every < 1:
        raise ValueError(f"eval_every must be >= 1, got {eval_every}.")
    if checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}.")
    if (checkpoint_every or resume) and checkpoint_dir is None:
        raise ValueError("checkpoint_every > 0 and resume=True need a checkpoint_dir.")


def _maybe_mesh(mesh):
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def flat_items(tree: Mapping[str, Any], prefix: str):
    """``(dotted key, leaf)`` of a nested mapping, each key starting with ``prefix``."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from flat_items(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _identity(init_params, execution: Execution, source, extra, **arguments) -> dict:
    """What identifies a run for resuming: its arguments, the execution strategy (others
    give close but not bit-identical numbers), SHA-256 of the initial params, the cohort
    source's own items (for a data set, SHA-256 of the training data), plus the caller's
    ``extra`` items (prefixed ``config.``)."""
    items: dict[str, Any] = dict(arguments)
    items.update(source.identity())
    items.update({f"execution.{k}": v for k, v in execution._asdict().items()})
    items["init_params.sha256"] = ckpt.tree_sha256(init_params)
    for key, value in flat_items(extra or {}, "config."):
        items[key] = value
    return items


RoundCallback = Callable[[int, dict[str, Any], RoundData], None]
"""Called after every round (not only evaluated ones) with its number, its metrics as host
values, and its ``RoundData`` (the cohort's ids)."""


def _evaluation(evaluate, params) -> dict[str, Any]:
    result = evaluate(params)
    if isinstance(result, Mapping):
        return dict(result)
    acc, loss = result
    return {"test_accuracy": acc, "test_loss": loss}


def run(
    algorithm: FederatedAlgorithm,
    init_params: Any,
    source: ClientData | CohortSource,
    evaluate: Callable[[Any], Any] | None,
    *,
    rounds: int,
    client_fraction: float | None = None,
    local_epochs: int | None = None,
    batch_size: float | None = None,
    seed: int = 0,
    eval_every: int = 1,
    target_accuracy: float | None = None,
    stop_at_target: bool = False,
    execution: Execution | None = None,
    callbacks: Sequence[Callback] = (),
    round_callbacks: Sequence[RoundCallback] = (),
    progress: bool = False,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    fingerprint: Mapping[str, Any] | None = None,
    schedule: Sequence[str] = (),
    straggler_fraction: float = 0.0,
    drop_stragglers: bool = False,
    client_state: ClientStateStore | None = None,
    max_rejected_fraction: float = 0.5,
    stop_on_divergence: bool = True,
    record_fields: Callable[[int], Mapping[str, Any]] | None = None,
) -> History:
    """Run ``rounds`` rounds of ``algorithm`` on a cohort source, evaluating every
    ``eval_every``. The one round loop of fedax: data sets, virtual populations and the
    hypergradient experiments all run through it.

    Args:
      algorithm: a ``FederatedAlgorithm``.
      init_params: the initial server model.
      source: a ``ClientData`` (then ``client_fraction``, ``local_epochs``, ``batch_size``
        and the straggler options make its ``PartitionSource``), or any cohort source
        (``fedax.simulation.sources``: ``PopulationSource``, ``HostCohorts``).
      evaluate: ``evaluate(params) -> (accuracy, loss)`` on the test set, or a dict of
        named values; None records no evaluation.
      rounds: T. A resumed run may have more rounds than the run it continues (not fewer
        than its checkpoint has done: ``ResumeError``).
      client_fraction, local_epochs, batch_size: the paper's C, E, B for a ``ClientData``
        (``batch_size=math.inf`` is the full local data set).
      seed: the run's only source of randomness (with the source's own seed).
      eval_every: record (and evaluate) after every k-th round and after the last one.
      target_accuracy: report ``rounds_to_target`` against this accuracy.
      stop_at_target: end the run at the first evaluation that reaches the target.
      execution: execution strategy; default ``choose_execution(params=init_params)``,
        chosen for the backend and the model.
      callbacks: each is called with every record (see ``Callback``).
      round_callbacks: each is called after every round (see ``RoundCallback``).
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
      schedule: keys of ``fingerprint`` (dotted for nested items) that a resumed run may
        change, as ``rounds`` may: the caller's own schedule (e.g. the config's rounds),
        which the caller checks.
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
      client_state: a host ``ClientStateStore`` of the algorithm's per-client state (one
        row per client of the source): the round then runs with ``cohort_round``, the
        cohort's rows gathered before it and the accepted clients' rows scattered back
        after, so nothing of size N is on the device. Default: the algorithm keeps its
        per-client state in its own state (``round``).
      max_rejected_fraction: every round, clients whose update is not finite are left out
        of the aggregate and counted (the algorithm's ``rejected_clients`` metric; each
        record holds the count since the previous record). A round in which more than this
        fraction of its clients were rejected stops the run with ``DivergenceError``, as
        does a round whose server model is not finite (checked inside the compiled round).
        Either way the run stops before that round's state is checkpointed.
      stop_on_divergence: False records a diverged run to the end instead of raising
        (a learning-rate sweep that expects some runs to diverge).
      record_fields: ``record_fields(round) -> dict`` of more values for the record of that
        round (e.g. the privacy spent, ε), added before it is checkpointed or passed on.

    Returns:
      The ``History`` of evaluation records (restored ones included), with the final
      algorithm state and each round's wall time. Every record holds the round, the
      evaluation, ``train_loss``, ``rejected_clients`` and every other metric the round
      returned (the algorithm's and its aggregator's), as JSON values.

    Raises:
      DivergenceError: see ``max_rejected_fraction``.
      RunInterrupted: on Ctrl-C, with the rounds done and the newest checkpoint's round.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}.")
    check_schedule(eval_every, checkpoint_every, resume, checkpoint_dir)
    if not 0.0 <= max_rejected_fraction <= 1.0:
        raise ValueError(
            f"max_rejected_fraction must be in [0, 1], got {max_rejected_fraction}.")
    if isinstance(source, ClientData):
        missing = [name for name, value in (("client_fraction", client_fraction),
                                            ("local_epochs", local_epochs),
                                            ("batch_size", batch_size)) if value is None]
        if missing:
            raise ValueError(f"run on a ClientData needs {', '.join(missing)}.")
        source = PartitionSource(source, client_fraction, local_epochs, batch_size, seed,
                                 straggler_fraction, drop_stragglers)
    elif (client_fraction, local_epochs, batch_size) != (None, None, None) or \
            straggler_fraction or drop_stragglers:
        raise ValueError("client_fraction, local_epochs, batch_size and the straggler options "
                         "belong to a ClientData; a cohort source carries its own.")
    pieces = algorithm.pieces
    if client_state is not None:
        if pieces is None or pieces.client_state is None:
            raise ValueError("client_state needs an algorithm with per-client state "
                             "(pieces.client_state), e.g. scaffold.")
        if client_state.num_clients != source.num_clients:
            raise ValueError(f"the client state store has {client_state.num_clients} rows, "
                             f"the cohort source {source.num_clients} clients.")
    execution = execution or choose_execution(params=init_params)
    # What a resumed run may change: how many rounds it runs, and the caller's schedule.
    schedule_items = ("rounds", *(f"config.{key}" for key in schedule))
    identity = None
    if checkpoint_every or resume:
        identity = _identity(
            init_params, execution, source, fingerprint, rounds=rounds, seed=seed,
            eval_every=eval_every, target_accuracy=target_accuracy,
            stop_at_target=stop_at_target)

    mesh = execution.mesh()
    distributed.check_mesh(mesh)
    pad_to = execution.devices if mesh is not None else 1
    # Where server-side values live (the state, the training set): the first device, or
    # replicated over the mesh; under a mesh, cohort arrays are split over its clients axis.
    home, client_block, block_spec = jax.devices()[0], None, None
    if mesh is not None:
        home = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        block_spec = jax.sharding.PartitionSpec(fed.CLIENTS_AXIS)
        client_block = jax.sharding.NamedSharding(mesh, block_spec)
    placed = source.place(home)

    # What lives on the device for the whole run is an argument of the compiled round, not
    # a closed-over constant (embedding it makes every compilation much slower). Under a
    # mesh the cohort arrives sharded over clients, so each device gathers its own clients.
    def device_round(state, placed, sharded, plain, key):
        cohort = source.cohort(placed, sharded, plain, block_spec)
        state, metrics = algorithm.round(state, cohort, key)
        metrics = dict(metrics)
        metrics["server_finite"] = _all_finite(algorithm.server_params(state))
        return state, _on_every_device(metrics, mesh)

    def device_cohort_round(state, placed, sharded, plain, client_states, key):
        cohort = source.cohort(placed, sharded, plain, block_spec)
        state, metrics, client_states, written = cohort_round(
            pieces, state, cohort, key, client_states, algorithm.adversary)
        metrics = dict(metrics)
        metrics["server_finite"] = _all_finite(algorithm.server_params(state))
        return state, _on_every_device(metrics, mesh), client_states, written

    def reached(record: dict[str, Any]) -> bool:
        return (stop_at_target and target_accuracy is not None
                and record.get("test_accuracy", -math.inf) >= target_accuracy)

    with use_execution(execution), _maybe_mesh(mesh):
        options = compiler_options()
        if client_state is None:
            round_fn = jax.jit(device_round, donate_argnums=(0,), compiler_options=options)
        else:
            round_fn = jax.jit(device_cohort_round, donate_argnums=(0,),
                               compiler_options=options)
        # Trace now, inside the strategy context: the compiled program captures it.
        base_key = jax.random.key(seed)
        init_key = jax.random.fold_in(base_key, -1 & 0x7FFFFFFF)
        if client_state is None:
            state = algorithm.init(init_params, init_key)
        else:  # the per-client state lives in the store, not in the algorithm state
            state = init_state(pieces, init_params)
        # Commit the state where the round leaves it, so round 2 does not recompile
        # (a copy: the round donates its state, and the caller keeps init_params usable).
        state = jax.device_put(jax.tree.map(jnp.copy, state), home)
        history = History()
        first, elapsed_before = 0, 0.0
        # Clients rejected since the last record, and the newest checkpoint's round.
        rejected_since_record, checkpoint_round = 0, None
        if resume:
            if client_state is not None:
                raise ValueError("resume with a host client-state store is not supported: "
                                 "the store is not part of the checkpoint.")
            # The fresh state is the template: a restored state gets its structure (checked
            # leaf by leaf) and its placement, so the rounds compile and run as in a fresh run.
            restored = ckpt.latest_checkpoint(checkpoint_dir, state, identity,
                                              ignore=schedule_items)
            if restored is not None and restored.round > rounds:
                raise ckpt.ResumeError(
                    f"checkpoint {restored.path} is of round {restored.round}, after this "
                    f"run's last round {rounds}: a resumed run cannot have fewer rounds "
                    "than it has done")
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
                records = list(restored.history)
                # Extended past its last round, off the eval_every schedule: a longer run
                # records no evaluation there, and its rejected clients count in the next.
                if records and records[-1]["round"] % eval_every and \
                        records[-1]["round"] < rounds:
                    rejected_since_record += int(records.pop().get("rejected_clients", 0))
                history = History(records, resumed_from=restored.round)
                for callback in callbacks:
                    on_resume = getattr(callback, "on_resume", None)
                    if on_resume is not None:
                        on_resume(list(history.records))
                if any(reached(r) for r in history.records):
                    first = rounds  # the run had stopped at the target
        elif checkpoint_every:
            ckpt.remove_checkpoints(checkpoint_dir)
        done = first  # rounds finished and checked
        last_settled = time.perf_counter()

        def settle(dispatched) -> dict[str, Any]:
            """Wait for a dispatched round and check it; raise if it diverged. Writes the
            accepted clients' new per-client state back to the host store."""
            nonlocal rejected_since_record, done, last_settled
            number, metrics, data, written = dispatched
            if written is not None:
                new_states, written = written
                keep = np.asarray(written)[:len(data.ids)]
                rows = [np.asarray(v)[:len(data.ids)][keep]
                        for v in jax.device_get(jax.tree.leaves(new_states))]
                client_state.scatter(data.ids[keep],
                                     jax.tree.unflatten(client_state.treedef, rows))
            metrics = jax.device_get(metrics)
            now = time.perf_counter()
            history.round_times.append(now - last_settled)
            last_settled = now
            rejected = int(metrics.get("rejected_clients", 0))
            rejected_since_record += rejected
            if stop_on_divergence and not bool(metrics["server_finite"]):
                raise DivergenceError(
                    f"round {number}: the server model is no longer finite (NaN or inf); "
                    "lower client_lr or server.lr", number)
            if stop_on_divergence and rejected > max_rejected_fraction * data.real:
                raise DivergenceError(
                    f"round {number}: {rejected} of {data.real} clients sent non-finite "
                    f"updates, more than max_rejected_fraction={max_rejected_fraction}; "
                    "lower client_lr, or check those clients' data", number)
            done = number
            for callback in round_callbacks:
                callback(number, metrics, data)
            return metrics

        start = time.perf_counter()
        bar = tqdm(range(first, rounds), desc="rounds", unit="round", disable=not progress,
                   initial=first, total=rounds)
        pending = None  # the last dispatched round, not yet checked
        try:
            for t in bar:
                data = source.round_data(t, pad_to)
                key = jax.random.fold_in(base_key, t)
                sharded = data.sharded
                if client_block is not None and jax.tree.leaves(sharded):
                    # each device receives its own clients' batches
                    sharded = jax.device_put(sharded, client_block)
                # The previous round is checked only now: this round's cohort was built on
                # the host while the device computed it.
                if pending is not None:
                    settle(pending)
                    pending = None
                # Whether balanced devices move clients this round, decided here from its
                # steps: a program that moves or one that does not (_lockstep.decided_moves)
                moves = None
                if data.steps is not None and pad_to > 1:
                    moves = _lockstep.worth_moving_host(data.steps, pad_to)
                with _lockstep.decided_moves(moves):
                    if client_state is None:
                        state, metrics = round_fn(state, placed, sharded, data.plain, key)
                        pending = (t + 1, metrics, data, None)
                    else:
                        states = _padded_rows(client_state.gather(data.ids), data.size)
                        state, metrics, new_states, written = round_fn(
                            state, placed, sharded, data.plain, jax.device_put(states, home),
                            key)
                        pending = (t + 1, metrics, data, (new_states, written))
                evaluating = (t + 1) % eval_every == 0 or t + 1 == rounds
                due = (t + 1) % checkpoint_every == 0 if checkpoint_every else False
                if not (evaluating or due):
                    continue
                metrics = settle(pending)  # never evaluate or save a round that diverged
                pending = None
                record, diverged, stop = None, False, False
                if evaluating:
                    record = {"round": t + 1}
                    if evaluate is not None:
                        record.update(_evaluation(evaluate, algorithm.server_params(state)))
                    record.setdefault("train_loss", float(metrics["train_loss"]))
                    record["rejected_clients"] = rejected_since_record
                    for name, value in round_metrics(metrics).items():
                        record.setdefault(name, value)
                    if record_fields is not None:
                        record.update(record_fields(t + 1))
                    record["elapsed_s"] = elapsed_before + time.perf_counter() - start
                    rejected_since_record = 0
                    history.records.append(record)
                    if isinstance(record.get("test_accuracy"), float):
                        bar.set_postfix(acc=f"{record['test_accuracy']:.4f}")
                    diverged = not all(
                        math.isfinite(record[name]) for name in ("test_loss", "train_loss")
                        if isinstance(record.get(name), float))
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
                if diverged and stop_on_divergence:
                    raise DivergenceError(
                        f"round {t + 1}: the model diverged (test loss "
                        f"{record.get('test_loss')}, train loss {record['train_loss']}); "
                        "lower client_lr or server.lr", t + 1)
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


def _padded_rows(values: Any, size: int) -> Any:
    """Host per-client rows ``[n, ...]`` padded with zero rows to ``[size, ...]``."""
    return jax.tree.map(
        lambda v: np.concatenate([v, np.zeros((size - len(v), *v.shape[1:]), v.dtype)]),
        values)
