"""FedBuff's virtual clock (``run_async``'s loop): trips in flight, the device pool of their
computed updates, the buffer, and a server step every K usable arrivals, recorded, saved
and checked through the run's ``Schedule`` (``fedax.simulation.schedule``), as the round
runner's are.

The clock's host arrays (``host_template``) are the checkpoint's ``host`` part, beside the
server state and the pool, so that a resumed run is bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedax.algorithms import RoundPieces, init_state
from fedax.simulation.asynchronous.clock import TripBlocks
from fedax.simulation.asynchronous.config import AsyncConfig
from fedax.simulation.asynchronous.updates import update_functions
from fedax.simulation.history import Callback, DivergenceError, History, RunInterrupted
from fedax.simulation.host import compiler_options
from fedax.simulation.schedule import Schedule, notify_resume
from fedax.simulation.sources import PartitionSource

TRAINING_STREAM = 0x74726E  # "trn": the clients' own training keys, per trip
AGGREGATOR_STREAM = 0x616763  # "agc": the aggregator client stage's keys, per trip
UNCOMPUTED, EMPTY = -1, -2  # pool slot of a trip whose update is not computed / no trip
_PER_RECORD = ("record_trips", "record_rejected", "record_stale", "record_tau_sum",
               "record_tau_max", "record_accepted")


def host_template(config: AsyncConfig) -> dict[str, np.ndarray]:
    """The clock's host arrays, zero: trips in flight, the buffer, totals and counts since
    the last record and the last server update."""
    m, k = config.concurrency, config.buffer_size
    i64 = np.int64
    return {
        "now": np.zeros((), np.float64), "next_trip": np.zeros((), i64),
        "version": np.zeros((), i64),
        "flight_trip": np.zeros(m, i64), "flight_start": np.zeros(m, np.float64),
        "flight_finish": np.zeros(m, np.float64), "flight_version": np.zeros(m, i64),
        "flight_slot": np.full(m, UNCOMPUTED, i64), "flight_finite": np.zeros(m, bool),
        "flight_client": np.zeros(m, i64),
        "buffer_slot": np.zeros(k, i64), "buffer_tau": np.zeros(k, i64),
        "buffer_count": np.zeros((), i64),
        "trips": np.zeros((), i64), "accepted": np.zeros((), i64),
        "rejected": np.zeros((), i64), "stale": np.zeros((), i64),
        **{name: np.zeros((), i64) for name in _PER_RECORD},
        "update_trips": np.zeros((), i64), "update_rejected": np.zeros((), i64),
    }


class BufferedStream:
    """One asynchronous run on the virtual clock (see ``fedax.simulation.asynchronous.
    fedbuff``): ``start`` compiles and places, ``restore`` continues a checkpoint, ``run``
    advances the clock until ``schedule.steps`` server updates are done."""

    def __init__(self, pieces: RoundPieces, source: PartitionSource,
                 evaluate: Callable[[Any], Any] | None, config: AsyncConfig,
                 schedule: Schedule, seed: int, callbacks: Sequence[Callback],
                 history: History, trace: bool):
        self.pieces, self.source, self.evaluate = pieces, source, evaluate
        self.config, self.schedule, self.callbacks = config, schedule, callbacks
        self.history, self.trace = history, trace
        self.k, self.m = config.buffer_size, config.concurrency
        self.capacity = self.m + self.k
        self.blocks = TripBlocks(source, config.latency, seed)
        self.cohort_size = self.blocks.size()
        self.home = jax.devices()[0]
        self.placed = source.place(self.home)
        self.base_key = jax.random.key(seed)
        self.streams = (jax.random.fold_in(self.base_key, TRAINING_STREAM),
                        jax.random.fold_in(self.base_key, AGGREGATOR_STREAM))
        self.host = host_template(config)
        self.checkpoint_round: int | None = None
        self.elapsed_before, self.started = 0.0, 0.0

    # ------------------------------------------------------------------ set-up

    def start(self, init_params: Any) -> None:
        """Compile the device functions (inside the execution context), place the initial
        state and an empty pool of M + K rows."""
        compute, compute_into, server_step = update_functions(self.pieces, self.source,
                                                              self.config)
        options = compiler_options()
        self.compute_fn = jax.jit(compute_into, donate_argnums=(1,), compiler_options=options)
        self.server_fn = jax.jit(server_step, donate_argnums=(0,), compiler_options=options)
        self.state = jax.device_put(jax.tree.map(jnp.copy, init_state(self.pieces,
                                                                      init_params)), self.home)
        self.idx0, self.mask0 = self.blocks.get(0)[:2]
        empty = self._padded(self.idx0[:0], self.mask0[:0], np.zeros(0), np.zeros(0))
        shapes = jax.eval_shape(compute, self.state, self.placed, *empty,
                                np.zeros(self.k, np.int32), self.streams)[0]
        pool = jax.tree.map(lambda s: jnp.zeros((self.capacity, *s.shape[1:]), s.dtype),
                            shapes)
        self.pool = jax.device_put(pool, self.home)

    def restore(self, identity: Mapping[str, Any] | None) -> bool:
        """Continue the newest checkpoint (state, pool, clock); True where one was
        restored. Then the free pool slots are those no trip or buffered update holds."""
        template = {"state": self.state, "pool": self.pool, "host": self.host}
        restored = self.schedule.restore(template, identity)
        if restored is not None:
            self.state, self.pool = restored.state["state"], restored.state["pool"]
            self.host = {name: np.array(v) for name, v in restored.state["host"].items()}
            self.checkpoint_round = restored.round
            self.elapsed_before = restored.elapsed_s
            self.history.records[:] = list(restored.history)
            self.history.resumed_from = restored.round
            notify_resume(self.callbacks, self.history.records)
        host = self.host
        occupied = {int(s) for s in host["flight_slot"] if s >= 0}
        occupied |= {int(s) for s in host["buffer_slot"][:int(host["buffer_count"])]}
        self.free = [s for s in range(self.capacity) if s not in occupied]
        heapq.heapify(self.free)
        if restored is None:
            for position in range(self.m):
                self._start_trip(position, 0.0)
        return restored is not None

    # ------------------------------------------------------------------ host state

    def _put(self, name: str, value: Any) -> None:
        """Set a host scalar, keeping its dtype (the checkpoint template's)."""
        self.host[name] = np.asarray(value, self.host[name].dtype)

    def _bump(self, *names: str, by: int = 1) -> None:
        for name in names:
            self._put(name, int(self.host[name]) + by)

    def _padded(self, rows_idx, rows_mask, rows_n, rows_ids):
        """A chunk's rows padded to K with empty clients (n_k = 0, all masked)."""
        extra = self.k - len(rows_n)

        def pad(a, dtype):
            a = np.asarray(a, dtype)
            return np.concatenate([a, np.zeros((extra, *a.shape[1:]), dtype)])

        return (pad(rows_idx, self.idx0.dtype), pad(rows_mask, np.float32),
                pad(rows_n, np.float32), pad(rows_ids, np.int32))

    def _start_trip(self, position: int, now: float) -> None:
        host = self.host
        j = int(host["next_trip"])
        self._put("next_trip", j + 1)
        block = self.blocks.get(j // self.cohort_size)
        host["flight_client"][position] = block[3][j % self.cohort_size]
        host["flight_trip"][position] = j
        host["flight_start"][position] = now
        host["flight_finish"][position] = now + float(block[4][j % self.cohort_size])
        host["flight_version"][position] = host["version"]
        host["flight_slot"][position] = UNCOMPUTED
        host["flight_finite"][position] = False

    def _compute_pending(self) -> None:
        """The updates of the trips in flight not computed yet, K at a time, in trip
        order, on the current model (they all started on it)."""
        host = self.host
        pending = np.nonzero(host["flight_slot"] == UNCOMPUTED)[0]
        if pending.size == 0:
            return
        pending = pending[np.argsort(host["flight_trip"][pending], kind="stable")]
        for start in range(0, pending.size, self.k):
            positions = pending[start:start + self.k]
            trips = host["flight_trip"][positions]
            rows = [(self.blocks.get(int(j) // self.cohort_size), int(j) % self.cohort_size)
                    for j in trips]
            idx, mask, n, ids = self._padded(*(
                np.stack([b[part][i] for b, i in rows]) if part < 2
                else np.asarray([b[part][i] for b, i in rows]) for part in range(4)))
            slots = np.full(self.k, self.capacity, np.int32)
            for i in range(len(positions)):
                slots[i] = heapq.heappop(self.free)
            trip_ids = np.zeros(self.k, np.int32)
            trip_ids[:len(positions)] = trips
            self.pool, finite = self.compute_fn(self.state, self.pool, self.placed, idx,
                                                mask, n, ids, trip_ids, self.streams, slots)
            host["flight_slot"][positions] = slots[:len(positions)]
            host["flight_finite"][positions] = np.asarray(finite)[:len(positions)]
        self.blocks.forget_below(int(host["next_trip"]) // self.cohort_size)

    # ------------------------------------------------------------------ arrivals

    def _arrive(self, position: int, now: float, version: int) -> None:
        """Trip ``position`` reaches the server: buffered, or dropped and counted (not
        finite, or staler than ``max_staleness``)."""
        host, config = self.host, self.config
        if host["flight_slot"][position] == UNCOMPUTED:
            self._compute_pending()
        tau = version - int(host["flight_version"][position])
        slot = int(host["flight_slot"][position])
        self._bump("trips", "record_trips", "update_trips")
        if not host["flight_finite"][position]:
            status = "nonfinite"
            self._bump("rejected", "record_rejected", "update_rejected")
            heapq.heappush(self.free, slot)
        elif config.max_staleness is not None and tau > config.max_staleness:
            status = "stale"
            self._bump("stale", "record_stale")
            heapq.heappush(self.free, slot)
        else:
            status = "buffered"
            count = int(host["buffer_count"])
            host["buffer_slot"][count] = slot
            host["buffer_tau"][count] = tau
            self._bump("buffer_count", "accepted", "record_accepted")
            self._bump("record_tau_sum", by=tau)
            self._put("record_tau_max", max(int(host["record_tau_max"]), tau))
        if self.trace:
            self.history.trace.append((  # type: ignore[attr-defined]  # (an AsyncHistory)
                int(host["flight_trip"][position]), int(host["flight_client"][position]),
                float(host["flight_start"][position]), now,
                int(host["flight_version"][position]), version, status))
        host["flight_slot"][position] = EMPTY
        host["flight_finish"][position] = math.inf
        if int(host["update_trips"]) > 10 * (self.m + self.k):
            raise DivergenceError(
                f"{int(host['update_trips'])} client updates arrived without K = {self.k}"
                " usable ones (non-finite or too stale); lower client_lr or raise "
                "max_staleness", version)

    def _step(self, version: int) -> dict[str, Any]:
        """The server step on the full buffer (the clients that started on this version
        are computed first, before the model changes); checked by the schedule."""
        self._compute_pending()
        slots = self.host["buffer_slot"].astype(np.int32)
        taus = self.host["buffer_tau"].astype(np.int32)
        self.state, metrics = self.server_fn(self.state, self.pool, slots, taus,
                                             jax.random.fold_in(self.base_key, version))
        for s in slots:
            heapq.heappush(self.free, int(s))
        self._put("buffer_count", 0)
        self._put("version", version + 1)
        metrics = jax.device_get(metrics)
        bad, arrived = int(self.host["update_rejected"]), int(self.host["update_trips"])
        self._put("update_trips", 0)
        self._put("update_rejected", 0)
        self.schedule.check_step(version + 1, metrics, bad, arrived,
                                 updates="arrivals were non-finite", fix="lower client_lr")
        return metrics

    def _record(self, version: int, metrics: dict[str, Any]) -> dict[str, Any]:
        host = self.host
        evaluation: dict[str, Any] = {}
        if self.evaluate is not None:
            result = self.evaluate(self.pieces.server_params(self.state.server))
            evaluation = dict(result) if isinstance(result, Mapping) else dict(
                zip(("test_accuracy", "test_loss"), result, strict=True))
        accepted = int(host["record_accepted"])
        clock = {
            "virtual_time": float(host["now"]), "client_updates": int(host["trips"]),
            "accepted_updates": int(host["accepted"]),
            "rejected_clients": int(host["record_rejected"]),
            "stale_clients": int(host["record_stale"]),
            "mean_staleness": float(host["record_tau_sum"]) / accepted if accepted else 0.0,
            "max_staleness": int(host["record_tau_max"])}
        for name in _PER_RECORD:
            self._put(name, 0)
        return self.schedule.record(version, evaluation, metrics, clock,
                                    self.elapsed_before + time.perf_counter() - self.started)

    # ------------------------------------------------------------------ the clock

    def _instant(self, identity, stop: bool) -> bool:
        """Every arrival of the next instant (in trip order), the server steps they fill,
        their replacements, a due checkpoint and the records' callbacks; True to stop."""
        host, schedule = self.host, self.schedule
        now = float(host["flight_finish"].min())
        self._put("now", now)
        arriving = np.nonzero(host["flight_finish"] == now)[0]
        arriving = arriving[np.argsort(host["flight_trip"][arriving], kind="stable")]
        freed, new_records, due = [], [], False
        for position in arriving:
            version = int(host["version"])
            if version >= schedule.steps or stop:
                break
            self._arrive(int(position), now, version)
            freed.append(int(position))
            if int(host["buffer_count"]) < self.k:
                continue
            metrics = self._step(version)
            self.done = version + 1
            if schedule.records_at(self.done):
                record = self._record(self.done, metrics)
                self.history.records.append(record)
                new_records.append(record)
                stop = schedule.reached(record)
            due = due or schedule.saves_at(self.done)
        for free_position in freed:
            self._start_trip(free_position, now)
        if schedule.checkpoint_every and (due or stop):
            schedule.save(int(host["version"]),
                          {"state": self.state, "pool": self.pool, "host": host},
                          self.history.records, identity,
                          self.elapsed_before + time.perf_counter() - self.started)
            self.checkpoint_round = int(host["version"])
        for record in new_records:
            for callback in self.callbacks:
                callback(record)
        return stop

    def run(self, identity: Mapping[str, Any] | None) -> History:
        """Advance the clock until every server update is done (or the target is
        reached); the history with the final state."""
        self.started = time.perf_counter()
        self.done = int(self.host["version"])
        stop = any(self.schedule.reached(r) for r in self.history.records)
        try:
            while int(self.host["version"]) < self.schedule.steps and not stop:
                stop = self._instant(identity, stop)
        except KeyboardInterrupt:
            raise RunInterrupted(self.done, self.checkpoint_round) from None
        self.history.state = self.state
        return self.history


__all__ = ["AGGREGATOR_STREAM", "TRAINING_STREAM", "BufferedStream", "host_template"]
