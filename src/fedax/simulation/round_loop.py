"""The synchronous runner's loop (``fedax.simulation.run``): the compiled round, the state
on its devices, and round after round driven by the run's ``Schedule``.

Round t's cohort is built on the host while the device computes round t − 1, which is
checked (finite server model, rejected clients) only then; a round that records or saves
is checked first, so that no diverged round is evaluated or saved.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from fedax import federated as fed
from fedax.algorithms import FederatedAlgorithm, RoundPieces, cohort_round, init_state
from fedax.federated import _lockstep
from fedax.simulation import distributed
from fedax.simulation.client_state import ClientStateStore
from fedax.simulation.execution import Execution
from fedax.simulation.history import Callback, DivergenceError, History, RunInterrupted
from fedax.simulation.host import compiler_options
from fedax.simulation.schedule import Schedule, notify_resume
from fedax.simulation.sources import CohortSource, RoundData

RoundCallback = Callable[[int, dict[str, Any], RoundData], None]
"""Called after every round (not only evaluated ones) with its number, its metrics as host
values, and its ``RoundData`` (the cohort's ids)."""


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


def maybe_mesh(mesh):
    """``jax.set_mesh(mesh)``, or nothing without a mesh."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def _evaluation(evaluate, params) -> dict[str, Any]:
    result = evaluate(params)
    if isinstance(result, Mapping):
        return dict(result)
    acc, loss = result
    return {"test_accuracy": acc, "test_loss": loss}


def _padded_rows(values: Any, size: int) -> Any:
    """Host per-client rows ``[n, ...]`` padded with zero rows to ``[size, ...]``."""
    return jax.tree.map(
        lambda v: np.concatenate([v, np.zeros((size - len(v), *v.shape[1:]), v.dtype)]),
        values)


class RoundLoop:
    """One synchronous run: placement, the compiled round, the state and the records.

    ``start`` compiles (inside the execution strategy's context) and makes the initial
    state; ``restore`` continues a checkpoint; ``run`` runs the remaining rounds."""

    def __init__(self, algorithm: FederatedAlgorithm, source: CohortSource,
                 evaluate: Callable[[Any], Any] | None, schedule: Schedule,
                 execution: Execution, seed: int, client_state: ClientStateStore | None,
                 callbacks: Sequence[Callback], round_callbacks: Sequence[RoundCallback]):
        self.algorithm, self.source, self.evaluate = algorithm, source, evaluate
        self.schedule, self.seed, self.store = schedule, seed, client_state
        self.callbacks, self.round_callbacks = callbacks, round_callbacks
        self.mesh = execution.mesh()
        distributed.check_mesh(self.mesh)
        self.pad_to = execution.devices if self.mesh is not None else 1
        # Where server-side values live (the state, the training set): the first device, or
        # replicated over the mesh; under a mesh, cohort arrays are split over clients.
        self.home: Any = jax.devices()[0]
        self.client_block, self.block_spec = None, None
        if self.mesh is not None:
            self.home = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            self.block_spec = jax.sharding.PartitionSpec(fed.CLIENTS_AXIS)
            self.client_block = jax.sharding.NamedSharding(self.mesh, self.block_spec)
        self.placed = source.place(self.home)
        self.history = History()
        self.first, self.elapsed_before = 0, 0.0
        # Clients rejected since the last record, and the newest checkpoint's round.
        self.rejected_since_record = 0
        self.checkpoint_round: int | None = None
        self.done = 0
        self.started = self.last_settled = 0.0  # (run sets them)

    @property
    def pieces(self) -> RoundPieces:
        assert self.algorithm.pieces is not None  # (run checks it with a client store)
        return self.algorithm.pieces

    # What lives on the device for the whole run is an argument of the compiled round, not
    # a closed-over constant (embedding it makes every compilation much slower). Under a
    # mesh the cohort arrives sharded over clients, so each device gathers its own clients.
    def device_round(self, state, placed, sharded, plain, key):
        cohort = self.source.cohort(placed, sharded, plain, self.block_spec)
        state, metrics = self.algorithm.round(state, cohort, key)
        metrics = dict(metrics)
        metrics["server_finite"] = _all_finite(self.algorithm.server_params(state))
        return state, _on_every_device(metrics, self.mesh)

    def device_cohort_round(self, state, placed, sharded, plain, client_states, key):
        cohort = self.source.cohort(placed, sharded, plain, self.block_spec)
        state, metrics, client_states, written = cohort_round(
            self.pieces, state, cohort, key, client_states, self.algorithm.adversary)
        metrics = dict(metrics)
        metrics["server_finite"] = _all_finite(self.algorithm.server_params(state))
        return state, _on_every_device(metrics, self.mesh), client_states, written

    def start(self, init_params: Any) -> None:
        """Compile the round (traced now, inside the strategy context: the program captures
        it) and make the initial state where the round leaves it."""
        device_round = self.device_round if self.store is None else \
            self.device_cohort_round
        self.round_fn = jax.jit(device_round, donate_argnums=(0,),
                                compiler_options=compiler_options())
        self.base_key = jax.random.key(self.seed)
        init_key = jax.random.fold_in(self.base_key, -1 & 0x7FFFFFFF)
        if self.store is None:
            state = self.algorithm.init(init_params, init_key)
        else:  # the per-client state lives in the store, not in the algorithm state
            state = init_state(self.pieces, init_params)
        # Commit the state where the round leaves it, so round 2 does not recompile
        # (a copy: the round donates its state, and the caller keeps init_params usable).
        self.state = jax.device_put(jax.tree.map(jnp.copy, state), self.home)

    def restore(self, identity: Mapping[str, Any] | None, ignore: Sequence[str]) -> None:
        """Continue the newest checkpoint (``Schedule.restore``): its state (the fresh
        state is the template: structure checked leaf by leaf, placement kept, so the
        rounds compile as in a fresh run), records and counters."""
        if self.schedule.resume and self.store is not None:
            raise ValueError("resume with a host client-state store is not supported: "
                             "the store is not part of the checkpoint.")
        restored = self.schedule.restore(self.state, identity, ignore)
        if restored is None:
            self.done = self.first
            return
        self.state, self.first = restored.state, restored.round
        self.elapsed_before = restored.elapsed_s
        self.checkpoint_round = restored.round
        self.rejected_since_record = int(restored.counters.get("rejected_clients", 0))
        records = list(restored.history)
        # Extended past its last round, off the eval_every schedule: a longer run records
        # no evaluation there, and its rejected clients count in the next.
        if records and records[-1]["round"] % self.schedule.eval_every and \
                records[-1]["round"] < self.schedule.steps:
            self.rejected_since_record += int(records.pop().get("rejected_clients", 0))
        self.history = History(records, resumed_from=restored.round)
        notify_resume(self.callbacks, self.history.records)
        if any(self.schedule.reached(r) for r in self.history.records):
            self.first = self.schedule.steps  # the run had stopped at the target
        self.done = self.first

    def _settle(self, dispatched) -> dict[str, Any]:
        """Wait for a dispatched round and check it; raise if it diverged. Writes the
        accepted clients' new per-client state back to the host store."""
        number, metrics, data, written = dispatched
        if written is not None:
            assert self.store is not None
            new_states, written = written
            keep = np.asarray(written)[:len(data.ids)]
            rows = [np.asarray(v)[:len(data.ids)][keep]
                    for v in jax.device_get(jax.tree.leaves(new_states))]
            self.store.scatter(data.ids[keep], jax.tree.unflatten(self.store.treedef, rows))
        metrics = jax.device_get(metrics)
        now = time.perf_counter()
        self.history.round_times.append(now - self.last_settled)
        self.last_settled = now
        rejected = int(metrics.get("rejected_clients", 0))
        self.rejected_since_record += rejected
        self.schedule.check_step(number, metrics, rejected, data.real)
        self.done = number
        for callback in self.round_callbacks:
            callback(number, metrics, data)
        return metrics

    def _dispatch(self, t: int, pending) -> Any:
        """Start round t on the device (round t − 1, ``pending``, is checked meanwhile);
        returns what ``_settle`` takes."""
        data = self.source.round_data(t, self.pad_to)
        key = jax.random.fold_in(self.base_key, t)
        sharded = data.sharded
        if self.client_block is not None and jax.tree.leaves(sharded):
            sharded = jax.device_put(sharded, self.client_block)  # each device its clients'
        # The previous round is checked only now: this round's cohort was built on the
        # host while the device computed it.
        if pending is not None:
            self._settle(pending)
        # Whether balanced devices move clients this round, decided here from its steps: a
        # program that moves or one that does not (_lockstep.decided_moves)
        moves = None
        if data.steps is not None and self.pad_to > 1:
            moves = _lockstep.worth_moving_host(data.steps, self.pad_to)
        with _lockstep.decided_moves(moves):
            if self.store is None:
                self.state, metrics = self.round_fn(self.state, self.placed, sharded,
                                                    data.plain, key)
                return t + 1, metrics, data, None
            states = _padded_rows(self.store.gather(data.ids), data.size)
            self.state, metrics, new_states, written = self.round_fn(
                self.state, self.placed, sharded, data.plain,
                jax.device_put(states, self.home), key)
            return t + 1, metrics, data, (new_states, written)

    def _record(self, t: int, metrics: dict[str, Any]) -> dict[str, Any]:
        evaluation = {} if self.evaluate is None else _evaluation(
            self.evaluate, self.algorithm.server_params(self.state))
        record = self.schedule.record(
            t, evaluation, metrics, {"rejected_clients": self.rejected_since_record},
            self.elapsed_before + time.perf_counter() - self.started)
        self.rejected_since_record = 0
        self.history.records.append(record)
        return record

    def _finish(self, t: int, metrics: dict[str, Any], bar, identity) -> bool:
        """After round t (settled): record, save, call back; True where the run stops."""
        schedule = self.schedule
        record, diverged, stop = None, False, False
        if schedule.records_at(t):
            record = self._record(t, metrics)
            if isinstance(record.get("test_accuracy"), float):
                bar.set_postfix(acc=f"{record['test_accuracy']:.4f}")
            diverged = not all(
                math.isfinite(record[name]) for name in ("test_loss", "train_loss")
                if isinstance(record.get(name), float))
            stop = schedule.reached(record)
        # Save before the callbacks run: a callback that fails (or a kill while it runs)
        # loses no finished round. A diverged state is not saved.
        if schedule.checkpoint_every and not diverged and (schedule.saves_at(t) or stop):
            schedule.save(t, self.state, self.history.records, identity,
                          self.elapsed_before + time.perf_counter() - self.started,
                          counters={"rejected_clients": self.rejected_since_record})
            self.checkpoint_round = t
        if record is None:
            return False
        for callback in self.callbacks:
            callback(record)
        if diverged and schedule.stop_on_divergence:
            raise DivergenceError(
                f"round {t}: the model diverged (test loss {record.get('test_loss')}, "
                f"train loss {record['train_loss']}); lower client_lr or server.lr", t)
        return stop

    def run(self, progress: bool, identity: Mapping[str, Any] | None) -> History:
        """The remaining rounds; the ``History`` with the final state."""
        steps = self.schedule.steps
        self.started = self.last_settled = time.perf_counter()
        bar = tqdm(range(self.first, steps), desc="rounds", unit="round",
                   disable=not progress, initial=self.first, total=steps)
        pending = None  # the last dispatched round, not yet checked
        try:
            for t in bar:
                pending = self._dispatch(t, pending)
                if not (self.schedule.records_at(t + 1) or self.schedule.saves_at(t + 1)):
                    continue
                metrics = self._settle(pending)  # never evaluate or save a diverged round
                pending = None
                if self._finish(t + 1, metrics, bar, identity):
                    break
            if pending is not None:
                self._settle(pending)
        except KeyboardInterrupt:
            raise RunInterrupted(self.done, self.checkpoint_round) from None
        finally:
            bar.close()
        self.history.state = self.state
        return self.history


__all__ = ["RoundCallback", "RoundLoop", "maybe_mesh"]
