"""An asynchronous networked server: FedBuff (Nguyen et al. 2022) run by a real server, as
Papaya (Huba et al. 2022) runs it in production. There are no rounds.

The server keeps up to M = ``concurrency`` *trips* in flight: an idle, alive client is
given the current model version v with a trip id (its shuffles' and training keys' round
index) and a single-use nonce; it trains and reports whenever it is done. A report is
checked as in the synchronous server (authenticated before any byte is read, its trip's
id, version and nonce, exact arrays, finite, every bound re-checked on the server) and
buffered with its staleness τ = (current version) − v; a report staler than
``max_staleness`` is refused and counted, never averaged. When K = ``buffer_size`` reports
are buffered the server applies them with the simulator's own flush
(``fedax.simulation.asynchronous.updates.buffered_step``): the aggregator's client stage on
each (on the server, with the aggregator state of the version its client downloaded and
the trip's key, drawn from the server's secret, as the simulator runs it where the update
is computed), the weighting (``weighting: equal`` gives every report 1), the staleness
weights s(τ) (``fedax.simulation.asynchronous.Staleness``), the reduction and server stage
and the algorithm's server update; then the new version is checkpointed, evaluated and
logged. A trip whose report has not come within
``deadline_s`` is dropped and its slot given to another client. Clients need nothing new:
a trip is a task like a round's (``fedax.runtime.client``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import secrets
import time
from typing import Any

import jax
import numpy as np

from fedax.aggregators.base import round_keys
from fedax.runtime import store, wire
from fedax.runtime.rounds import RoundFailed, finite, selection_words
from fedax.runtime.server import Server
from fedax.runtime.task import broadcast, round_key, stage_key
from fedax.simulation.asynchronous.config import AsyncConfig
from fedax.simulation.asynchronous.updates import buffered_step, stage_each, weigh

log = logging.getLogger("fedax.runtime.server")


@dataclasses.dataclass
class Trip:
    """One client's trip: the version it trains on, what it was sent, the aggregator state
    of that version (its report's client stage runs with it, as the client would) and the
    trip's client-stage key."""

    trip: int
    version: int
    nonce: str
    model_version: str
    shared: bytes
    payload: Any
    aggregator: Any
    key: Any
    deadline: float


class AsyncServer(Server):
    """A FedBuff server (see the module docstring): ``Server``'s transport, gate, checks
    and checkpoints with trips instead of rounds; ``config.rounds`` counts server steps
    (model versions). ``start_with``: alive clients to wait for before the first trip (a
    rehearsal's local clients, so that early ones do not run the whole stream)."""

    def __init__(self, *args, buffered: AsyncConfig, start_with: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        buffered = buffered.validate()
        if buffered.mixing:
            raise ValueError("mixing (FedAsync's w_current - w_local) forms each value from "
                             "the client's local model, which a report does not carry; not "
                             "with an asynchronous server")
        self._start_with = start_with  # alive clients before the first trip
        if self.phases.learned is not None:
            raise ValueError("a learned server learning rate differentiates a synchronous "
                             "round; not with an asynchronous server")
        if self.secure is not None:
            raise ValueError("secure aggregation sums one cohort's updates; not with an "
                             "asynchronous server (use the synchronous one)")
        if buffered.weighting == "equal" and self._encodes:
            raise ValueError("weighting 'equal' reweighs a report before the aggregator's "
                             "client stage, which these clients run; not with an "
                             "asynchronous server")
        self.buffered = buffered
        self._trips: dict[int, Trip] = {}
        self._buffer: list[tuple[int, Any, int, Trip]] = []  # (client, report, τ, trip)
        self._next_trip = 0
        self._sent: tuple[int, bytes, str, Any, Any] | None = None  # the current version's
        self._stats = {"trips": 0, "dropped": 0, "stale": 0}
        self._flush = jax.jit(self._flush_fn)

    # ------------------------------------------------------------------ the stream

    def _schedule(self) -> bool:
        """The stream: trips dispatched, expired and applied K at a time until every
        server step is done (``Server._run_rounds`` runs it)."""
        if self._wait_alive(self._start_with) is None:
            return False
        started = None  # the first version's time counts from the first trip
        while self.rounds_done < self.config.rounds and not self._stop.is_set():
            self._dispatch()
            if started is None and self._next_trip:
                started = time.monotonic()
            with self._lock:
                self._expire()
                if len(self._buffer) < self.buffered.buffer_size:
                    self._lock.wait(0.05)
                    continue
                batch = self._buffer[:self.buffered.buffer_size]
                del self._buffer[:self.buffered.buffer_size]
            assert started is not None  # (reports came back: a trip went out)
            self._apply(batch, started)
            started = time.monotonic()
        with self._lock:
            self._trips.clear()  # a trip still out now is late
        return True

    def _version_sent(self) -> tuple[int, bytes, str, Any, Any]:
        """The current version's shared tensors, model version, payload and aggregator state
        (made once per version)."""
        v = self.rounds_done
        if self._sent is None or self._sent[0] != v:
            sent = broadcast(self.pieces, self.state, self._encodes)
            shared = wire.Envelope(tensors=wire.encode_tree(store.raw(sent))).SerializeToString()
            self._sent = (v, shared, hashlib.sha256(shared).hexdigest()[:16],
                          jax.device_get(sent["payload"]),
                          jax.device_get(self.state.aggregator))
        return self._sent

    def _dispatch(self) -> None:
        """Idle alive clients get trips until M are in flight (drawn from the secret)."""
        with self._lock:
            free = self.buffered.concurrency - len(self._trips)
            idle = [c for c in self._alive() if c not in self._trips]
        if free <= 0 or not idle:
            return
        v, shared, model_version, payload, aggregator = self._version_sent()
        rng = np.random.default_rng([*selection_words(self._secret), self._next_trip])
        chosen = [idle[i] for i in rng.permutation(len(idle))[:free]]
        keys = np.asarray(round_keys(round_key(self._key, self._next_trip + (1 << 30)),
                                     len(chosen))[0])
        deadline = time.monotonic() + self.config.deadline_s
        with self._lock:
            for i, cid in enumerate(chosen):
                self._trips[cid] = Trip(self._next_trip, v, secrets.token_hex(16),
                                        model_version, shared, payload, aggregator, keys[i],
                                        deadline)
                self._next_trip += 1
                self._stats["trips"] += 1
            self._lock.notify_all()
        self._announce()

    def _expire(self) -> None:
        now = time.monotonic()
        for cid in [c for c, t in self._trips.items() if t.deadline < now]:
            del self._trips[cid]
            self._stats["dropped"] += 1

    def _flush_fn(self, state, reports, taus, downloaded, keys, key):
        """FedBuff's step on K reports (``buffered_step``, the simulator's flush): each
        report weighed (``weighting``) and, unless its client encoded, put through the
        aggregator's client stage here with the aggregator state of the version its client
        downloaded (``downloaded``, stacked) and its trip's key (``keys``, raw)."""
        pieces = self.pieces
        weights = weigh(reports.weight, reports.num_examples, self.buffered.weighting)
        values, stage_stats = reports.update, reports.stage_stats
        if not self._encodes and pieces.aggregator.client is not None:
            values, weights, stage_stats = stage_each(pieces.aggregator, values, weights,
                                                      downloaded, keys)
        buffered = reports._replace(update=values, weight=weights, stage_stats=stage_stats)
        return buffered_step(pieces, state, buffered, taus, key, self.buffered.staleness)

    def _apply(self, batch: list[tuple[int, Any, int, Trip]], started: float) -> None:
        """A server step on K buffered reports; the new version is checkpointed, then
        evaluated and logged."""
        def stack(*xs):
            return np.stack(xs)

        reports = jax.tree.map(stack, *[r for _, r, _, _ in batch])
        downloaded = jax.tree.map(stack, *[trip.aggregator for *_, trip in batch])
        keys = np.stack([trip.key for *_, trip in batch])
        taus = np.array([tau for _, _, tau, _ in batch], np.int32)
        v = self.rounds_done
        state, metrics = self._flush(self.state, reports, taus, downloaded, keys,
                                     round_key(self._key, v))
        if not finite(state):
            raise RoundFailed(f"server step {v}: the new state is not finite")
        self.state = state
        metrics = {k: float(x) for k, x in metrics.items()}
        if self.evaluate is not None:
            metrics.update(self.evaluate(self.params))
        with self._lock:
            record = {"round": v, "clients": sorted(c for c, *_ in batch),
                      "mean_staleness": float(taus.mean()), "max_staleness": int(taus.max()),
                      **self._stats, "bytes_in": self._bytes["in"],
                      "bytes_out": self._bytes["out"], "status": "closed",
                      "round_s": round(time.monotonic() - started, 4), **metrics}
            self._bytes = {"in": 0, "out": 0}
            self._stats = {"trips": 0, "dropped": 0, "stale": 0}
        self.rounds_done = v + 1
        self.checkpoints.commit(record, dict(self.included))

    # -------------------------------------------------------------- the protocol

    def _task_for(self, cid: int) -> bytes | None:
        trip = self._trips.get(cid)
        if trip is None:
            return None
        header = wire.Envelope(kind="task", client_id=cid, round=trip.trip, attempt=0,
                               model_version=trip.model_version, nonce=trip.nonce,
                               deadline_s=max(trip.deadline - time.monotonic(), 0.0),
                               rounds_done=self.rounds_done, included_round=-1,
                               included_attempt=-1)
        if self._encodes:
            header.tensors.extend(stage_key(trip.key))
        return wire.task_bytes(header, trip.shared)

    def _check_header(self, r, cid: int, t: int, attempt: int, version: str,
                      nonce: str) -> Any:
        del r
        with self._lock:
            trip = self._trips.get(cid)
        if trip is None and 0 <= t < self._next_trip:  # a trip dropped or the stream ended
            return wire.SubmitReply(accepted=False, reason="late: the trip has ended")
        if trip is None or (t, attempt, version) != (trip.trip, 0, trip.model_version) \
                or not secrets.compare_digest(nonce.encode(), trip.nonce.encode()):
            return self._reject(None, cid, "wrong-round", f"no trip {t} of client {cid} is "
                                "in flight with that model version and nonce")
        return None

    def _read_seconds(self, r, cid: int) -> float:
        del r
        with self._lock:
            trip = self._trips.get(cid)
        return 0.0 if trip is None else max(trip.deadline - time.monotonic(), 0.0) + 1.0

    def _check_report(self, r, cid: int, header: tuple, env: Any) -> Any:
        del r
        with self._lock:
            trip = self._trips.get(cid)
        if trip is None:  # ended while its body was read
            return wire.SubmitReply(accepted=False, reason="late: the trip has ended")
        if env.client_id != cid or \
                (env.round, env.attempt, env.model_version, env.nonce) != header:
            return self._reject(None, cid, "sender", "the report's envelope does not match "
                                "its call and trip")
        report, problem = self._checked_report(_TripRound(trip.payload), env)
        if problem is not None:
            with self._lock:
                self._trips.pop(cid, None)
            return self._reject(None, cid, *problem)
        with self._lock:
            if self._trips.get(cid) is not trip:
                return wire.SubmitReply(accepted=False, reason="late: the trip has expired")
            del self._trips[cid]
            tau = self.rounds_done - trip.version
            limit = self.buffered.max_staleness
            if limit is not None and tau > limit:
                self._stats["stale"] += 1
                return self._reject(None, cid, "stale", f"staleness {tau} exceeds "
                                    f"max_staleness {limit}")
            self._buffer.append((cid, report, tau, trip))
            self._lock.notify_all()
        return wire.SubmitReply(accepted=True)


@dataclasses.dataclass
class _TripRound:
    """What the report checks read of an open round: its phase and payload."""

    payload: Any
    phase: str = "train"
