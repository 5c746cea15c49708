"""The fedax server: the algorithm's server state and the round schedule, over gRPC + TLS.

Round t, attempt a (Bonawitz et al. 2019's selection / reporting phases; docs/references.md,
deployment runtime):

1. **Selection.** Once ``min_clients`` clients are alive (polled within ``liveness_s``),
   the server picks ``ceil(cohort_size · (1 + over_selection))`` of them with
   ``default_rng([seed, t, a])`` (over-selection: more than needed, so that drop-outs do
   not stall the round) and opens the round: each selected client gets, on its next
   ``Poll``, the payload, the round id ``(t, a)``, the model version (a hash of the
   payload) and a single-use nonce.
2. **Reporting.** Each ``Submit`` is checked before it can touch an aggregate: the
   authenticated sender is the selected client this report names, round, attempt, model
   version and nonce match the open round (so a replay or a stale report is refused), the
   client has not reported already, the stream is complete and within
   ``max_message_bytes``, and the arrays have exactly the expected paths, dtypes and
   shapes and are finite. A refused report is logged with its reason, the client is
   excluded from the round, and its values are never stacked or averaged.
3. **Closing.** The round closes when ``cohort_size`` reports are accepted, or at the
   deadline. With at least ``min_reports`` accepted, ``server_step`` (the algorithm's
   aggregator and server update, ``fedax.runtime.task``) makes the new state over the
   accepted reports in client-id order, a checkpoint is written and the round is logged
   (selected, reported, rejected, dropped: no report by the deadline, unneeded: the
   over-selected clients still busy when the round filled, bytes in and out on the wire,
   round time, the algorithm's metrics); with fewer, the
   round is retried as attempt a + 1 (selecting again among the clients alive then).

A client's new per-client state is its own business: the server tells each client, on its
next poll, the last ``(round, attempt)`` whose aggregate included its report
(``included_round``/``included_attempt``), and the client keeps the state of exactly that
report (``fedax.runtime.client``). With ``checkpoint_dir`` and ``resume=True`` the server
continues from its last checkpoint; clients keep polling through the outage.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import jax
import jax.numpy as jnp
import numpy as np

from fedax.runtime import store, wire
from fedax.runtime.security import CLIENT_ID_KEY, TOKEN_KEY, Registry, ServerTLS
from fedax.runtime.task import (
    Report,
    Task,
    aggregator_client_keys,
    build,
    payload_template,
    report_template,
    round_key,
    server_state,
    server_step,
)

log = logging.getLogger("fedax.runtime.server")
CHECKPOINT = "server_checkpoint.msgpack"
ROUND_LOG = "rounds.jsonl"


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """How the server schedules rounds and what it accepts.

    Attributes:
      rounds: T, rounds to run.
      cohort_size: K, accepted reports that close a round early.
      over_selection: select ``ceil(K · (1 + over_selection))`` clients (at most those
        alive), e.g. 0.3.
      min_reports: a round closing at its deadline with fewer accepted reports is retried
        (default K).
      min_clients: alive clients needed before a round is opened (default: the
        selection size).
      deadline_s: seconds a round stays open.
      max_attempts: retries of one round before the run stops with an error.
      poll_interval_s: how long an idle client waits between polls (sent to clients).
      liveness_s: a client counts as alive if it polled within this many seconds.
      max_message_bytes: a larger report is refused (``oversized``).
      chunk_bytes: the size of the pieces of a streamed message (also bounds every gRPC
        message).
      checkpoint_dir: where the checkpoint (after every round) and ``rounds.jsonl`` go.
      max_workers: gRPC handler threads.
    """

    rounds: int
    cohort_size: int
    over_selection: float = 0.0
    min_reports: int | None = None
    min_clients: int | None = None
    deadline_s: float = 60.0
    max_attempts: int = 10
    poll_interval_s: float = 0.5
    liveness_s: float = 10.0
    max_message_bytes: int = 256 << 20
    chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES
    checkpoint_dir: str | None = None
    max_workers: int = 32

    def __post_init__(self):
        checks = [("rounds", self.rounds >= 1), ("cohort_size", self.cohort_size >= 1),
                  ("over_selection", self.over_selection >= 0),
                  ("deadline_s", self.deadline_s > 0),
                  ("min_reports", self.min_reports is None
                   or 1 <= self.min_reports <= self.cohort_size),
                  ("chunk_bytes", self.chunk_bytes >= 1024)]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"server setting {name}={getattr(self, name)!r} is out of "
                                 "range; see fedax server --help")

    @property
    def selection_size(self) -> int:
        return math.ceil(self.cohort_size * (1.0 + self.over_selection) - 1e-9)


@dataclasses.dataclass
class _Round:
    """The open round (guarded by the server's lock)."""

    t: int
    attempt: int
    selected: list[int]
    nonces: dict[int, str]
    envelopes: dict[int, bytes]  # serialized task envelope per selected client
    model_version: str
    deadline: float
    started: float
    accepted: dict[int, Report] = dataclasses.field(default_factory=dict)
    rejected: dict[int, str] = dataclasses.field(default_factory=dict)
    closed: bool = False


class RoundFailed(RuntimeError):
    """A round got fewer than ``min_reports`` accepted reports ``max_attempts`` times."""


def _auth(context, registry: Registry) -> int:
    meta = dict(context.invocation_metadata())
    cid, reason = registry.check(meta.get(CLIENT_ID_KEY), meta.get(TOKEN_KEY))
    if cid is None:
        log.warning("refused a call: %s (peer %s)", reason, context.peer())
        context.abort(grpc.StatusCode.UNAUTHENTICATED, f"refused: {reason}")
    return cid


class Server:
    """A fedax server for ``task`` (see the module docstring).

    Example::

        server = Server(task, ServerConfig(rounds=5, cohort_size=10),
                        ServerTLS("server.pem", "server.key"), Registry.load("registry.json"))
        port = server.start()
        server.wait()          # all rounds done
        params = server.params
        server.stop()
    """

    def __init__(self, task: Task, config: ServerConfig, tls: ServerTLS, registry: Registry,
                 address: str = "127.0.0.1:0", resume: bool = False,
                 evaluate: Callable[[Any], dict[str, float]] | None = None):
        self.task, self.config, self.tls, self.registry = task, config, tls, registry
        self.address = address
        self.evaluate = evaluate
        built = build(task)
        self.pieces = built.pieces
        self.state = server_state(self.pieces, built.params)
        self._state_template = jax.eval_shape(lambda: self.state)
        self._sent_template = store.raw_template(payload_template(self.pieces, built.params))
        report = report_template(self.pieces, built.params, task.input_shape)
        self.report_template = report  # what every report must look like
        self._report_layout = wire.expected_layout(report)
        self._report_treedef = jax.tree.structure(report)
        self._step = jax.jit(lambda s, r, k: server_step(self.pieces, s, r, k))
        self._lock = threading.Condition()
        self._round: _Round | None = None
        self._last_closed: _Round | None = None  # its late reports are not violations
        self._done = False
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self.rounds_done = 0
        self.last_seen: dict[int, float] = {}
        self.included: dict[int, tuple[int, int]] = {}
        self.history: list[dict[str, Any]] = []  # closed rounds (kept in the checkpoint)
        self.records: list[dict[str, Any]] = []  # every attempt, closed or retried
        self.rejections: list[dict[str, Any]] = []
        self._bytes = {"in": 0, "out": 0}
        self._grpc: grpc.Server | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        if resume:
            self._restore()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> int:
        """Serve (TLS only) and start the rounds; returns the bound port."""
        handlers = {}
        for name, (req, resp, req_stream, resp_stream) in wire.METHODS.items():
            kind = {(False, False): grpc.unary_unary_rpc_method_handler,
                    (False, True): grpc.unary_stream_rpc_method_handler,
                    (True, False): grpc.stream_unary_rpc_method_handler}[
                        (req_stream, resp_stream)]
            handlers[name] = kind(getattr(self, f"_rpc_{name.lower()}"),
                                  request_deserializer=req.FromString,
                                  response_serializer=resp.SerializeToString)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.config.max_workers),
                             options=wire.grpc_options(self.config.chunk_bytes))
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(wire.SERVICE, handlers),))
        port = server.add_secure_port(self.address, self.tls.credentials())
        if port == 0:
            raise OSError(f"cannot listen on {self.address}; choose a free host:port")
        server.start()
        self._grpc, self.port = server, port
        self._thread = threading.Thread(target=self._run_rounds, name="fedax-rounds",
                                        daemon=True)
        self._thread.start()
        log.info("serving on port %d (TLS), %d rounds from round %d", port,
                 self.config.rounds, self.rounds_done)
        return port

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every round is done (True) or ``timeout`` passes (False); re-raises
        the error that stopped the rounds."""
        if self._thread is not None:
            self._thread.join(timeout)
        if self._error is not None:
            raise self._error
        return self._done

    def stop(self, grace: float = 0.5) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        if self._grpc is not None:
            self._grpc.stop(grace).wait()
        if self._thread is not None:
            self._thread.join(5.0)

    @property
    def params(self) -> Any:
        return self.pieces.server_params(self.state.server)

    # ---------------------------------------------------------------- checkpoints

    def _checkpoint_path(self) -> Path | None:
        d = self.config.checkpoint_dir
        return None if d is None else Path(d) / CHECKPOINT

    def _save(self) -> None:
        path = self._checkpoint_path()
        if path is None:
            return
        store.save(path, {
            "version": 1, "task_sha256": self.task.sha256(), "round": self.rounds_done,
            "state": store.encode(self.state),
            "included": {str(k): list(v) for k, v in self.included.items()},
            "history": self.history})

    def _restore(self) -> None:
        path = self._checkpoint_path()
        if path is None:
            raise ValueError("resume needs a checkpoint_dir")
        if not path.exists():
            log.warning("no checkpoint in %s; starting from round 0", path.parent)
            return
        data = store.load(path)
        if data.get("task_sha256") != self.task.sha256():
            raise ValueError(f"the checkpoint in {path.parent} is from another task; resume "
                             "with the same task settings or use a new checkpoint dir")
        self.state = store.decode(data["state"], self._state_template, "checkpoint")
        self.state = jax.tree.map(jnp.asarray, self.state)
        self.rounds_done = int(data["round"])
        self.included = {int(k): (int(v[0]), int(v[1])) for k, v in data["included"].items()}
        self.history = list(data["history"])
        log.info("resumed from %s after round %d", path, self.rounds_done)

    # --------------------------------------------------------------------- rounds

    def _alive(self) -> list[int]:
        now = time.monotonic()
        return sorted(c for c, seen in self.last_seen.items()
                      if now - seen <= self.config.liveness_s)

    def _open(self, t: int, attempt: int) -> _Round | None:
        cfg = self.config
        need = cfg.min_clients if cfg.min_clients is not None else cfg.selection_size
        with self._lock:
            while not self._stop.is_set():
                alive = self._alive()
                if len(alive) >= need:
                    break
                self._lock.wait(cfg.poll_interval_s)
            if self._stop.is_set():
                return None
        rng = np.random.default_rng([self.task.seed, t, attempt])
        count = min(cfg.selection_size, len(alive))
        selected = sorted(int(c) for c in rng.choice(alive, size=count, replace=False))
        key = round_key(self.task.seed, t)
        sent = {"payload": self.pieces.payload(self.state.server), "aggregator": ()}
        agg_keys = None
        if self.pieces.aggregator.client is not None:
            sent["aggregator"] = self.state.aggregator
            agg_keys = np.asarray(aggregator_client_keys(key, count))
        tensors = wire.encode_tree(store.raw(sent))
        version = hashlib.sha256(b"".join(x.data for x in tensors)).hexdigest()[:16]
        nonces = {c: secrets.token_hex(16) for c in selected}
        envelopes = {}
        deadline_s = cfg.deadline_s
        for i, c in enumerate(selected):
            env = wire.Envelope(kind="task", client_id=c, round=t, attempt=attempt,
                                model_version=version, nonce=nonces[c],
                                deadline_s=deadline_s, rounds_done=self.rounds_done,
                                tensors=tensors)
            if agg_keys is not None:
                env.tensors.extend(wire.encode_arrays([("aggregator_key", agg_keys[i])]))
            envelopes[c] = env.SerializeToString()
        now = time.monotonic()
        with self._lock:
            self._bytes = {"in": 0, "out": 0}
            self._round = _Round(t, attempt, selected, nonces, envelopes, version,
                                 now + deadline_s, now)
            self._lock.notify_all()
        log.info("round %d attempt %d: selected %d of %d alive clients", t, attempt, count,
                 len(alive))
        return self._round

    def _close(self, r: _Round) -> dict[str, Any]:
        with self._lock:
            while not self._stop.is_set():
                settled = len(r.accepted) + len(r.rejected)
                if (len(r.accepted) >= self.config.cohort_size
                        or settled >= len(r.selected)
                        or time.monotonic() >= r.deadline):
                    break
                self._lock.wait(min(0.05, max(r.deadline - time.monotonic(), 0.0)))
            r.closed = True
            self._last_closed = r
            accepted = dict(r.accepted)
            rejected = dict(r.rejected)
            traffic = dict(self._bytes)
        missing = len(r.selected) - len(accepted) - len(rejected)
        full = len(accepted) >= self.config.cohort_size  # over-selected, not needed
        record = {"round": r.t, "attempt": r.attempt, "selected": len(r.selected),
                  "reported": len(accepted), "rejected": len(rejected),
                  "dropped": 0 if full else missing, "unneeded": missing if full else 0,
                  "bytes_in": traffic["in"], "bytes_out": traffic["out"]}
        return {"record": record, "accepted": accepted}

    def _aggregate(self, t: int, accepted: dict[int, Report]) -> dict[str, float]:
        ids = sorted(accepted)
        rows = [accepted[c] for c in ids]
        pad = self.config.cohort_size - len(rows)
        zeros = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), self.report_template)
        rows += [zeros] * max(pad, 0)
        stacked = jax.tree.map(lambda *xs: np.stack(xs), *rows)
        self.state, metrics = self._step(self.state, stacked, round_key(self.task.seed, t))
        return {k: float(v) for k, v in metrics.items()}

    def _run_rounds(self) -> None:
        try:
            while self.rounds_done < self.config.rounds and not self._stop.is_set():
                t = self.rounds_done
                for attempt in range(self.config.max_attempts):
                    r = self._open(t, attempt)
                    if r is None:
                        return
                    closed = self._close(r)
                    record, accepted = closed["record"], closed["accepted"]
                    need = self.config.min_reports or self.config.cohort_size
                    if len(accepted) >= need:
                        metrics = self._aggregate(t, accepted)
                        if self.evaluate is not None:
                            metrics.update(self.evaluate(self.params))
                        with self._lock:
                            for c in accepted:
                                self.included[c] = (t, attempt)
                            self.rounds_done = t + 1
                        record.update(status="closed", round_s=round(
                            time.monotonic() - r.started, 4), **metrics)
                        self.history.append(record)
                        self._save()
                        self._log(record)
                        break
                    record.update(status="retry", round_s=round(time.monotonic() - r.started,
                                                                4))
                    self._log(record)
                else:
                    raise RoundFailed(
                        f"round {t} got fewer than {need} accepted reports in "
                        f"{self.config.max_attempts} attempts; start more clients or lower "
                        "min_reports")
            with self._lock:
                self._done = self.rounds_done >= self.config.rounds
                self._round = None
                self._lock.notify_all()
        except BaseException as err:  # surfaced by wait()
            self._error = err
            log.error("rounds stopped: %s", err)

    def _log(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        log.info("round %s", json.dumps(record))
        if self.config.checkpoint_dir is not None:
            path = Path(self.config.checkpoint_dir) / ROUND_LOG
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def _reject(self, r: _Round | None, cid: int, kind: str, reason: str) -> Any:
        entry = {"round": None if r is None else r.t,
                 "attempt": None if r is None else r.attempt,
                 "client": cid, "kind": kind, "reason": reason}
        log.warning("rejected a report from client %d: %s: %s", cid, kind, reason)
        with self._lock:
            self.rejections.append(entry)
            if r is not None and not r.closed and cid in r.nonces and cid not in r.accepted:
                r.rejected.setdefault(cid, f"{kind}: {reason}")
                self._lock.notify_all()
        return wire.SubmitReply(accepted=False, reason=f"{kind}: {reason}")

    # ------------------------------------------------------------------------ RPCs

    def _rpc_join(self, request, context):
        cid = _auth(context, self.registry)
        if request.client_id != cid:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"authenticated as client {cid}, not {request.client_id}")
        # Alive only once it polls (after compiling its client step), not at join.
        log.info("client %d joined (peer %s)", cid, context.peer())
        return wire.JoinReply(task_json=self.task.to_json(), chunk_bytes=self.config.chunk_bytes)

    def _rpc_poll(self, request, context):
        cid = _auth(context, self.registry)
        with self._lock:
            self.last_seen[cid] = time.monotonic()
            self._lock.notify_all()
            r = self._round
            data = None
            if (r is not None and not r.closed and cid in r.envelopes
                    and cid not in r.accepted and cid not in r.rejected):
                data = r.envelopes[cid]
            included = self.included.get(cid, (-1, -1))
            if data is None:
                kind = "done" if self._done else "wait"
                env = wire.Envelope(kind=kind, client_id=cid, rounds_done=self.rounds_done,
                                    retry_after_s=self.config.poll_interval_s,
                                    included_round=included[0],
                                    included_attempt=included[1])
                data = env.SerializeToString()
            else:
                env = wire.Envelope()
                env.ParseFromString(data)
                env.included_round, env.included_attempt = included
                env.deadline_s = max(r.deadline - time.monotonic(), 0.0)
                data = env.SerializeToString()
        size = self.config.chunk_bytes
        for start in range(0, max(len(data), 1), size):
            piece = data[start:start + size]
            with self._lock:
                self._bytes["out"] += len(piece)
            yield wire.Chunk(data=piece, last=start + size >= len(data))

    def _rpc_submit(self, request_iterator, context):
        cid = _auth(context, self.registry)
        with self._lock:
            self.last_seen[cid] = time.monotonic()
            r = self._round
        counter = [0]
        try:
            env = wire.join_chunks(request_iterator, self.config.max_message_bytes, counter)
        except wire.WireError as err:
            self._count_in(counter[0])
            return self._reject(r, cid, err.kind, str(err))
        self._count_in(counter[0])
        if env.client_id != cid:
            return self._reject(r, cid, "sender", f"report names client {env.client_id}, "
                                                  f"sent by client {cid}")
        last = self._last_closed
        if (last is not None and (env.round, env.attempt) == (last.t, last.attempt)
                and last.nonces.get(cid) == env.nonce and cid not in last.accepted
                and cid not in last.rejected):
            return wire.SubmitReply(accepted=False, reason="late: the round has closed")
        if r is None or r.closed:
            return self._reject(None, cid, "wrong-round", f"report for round {env.round}."
                                f"{env.attempt}, no round is open")
        if (env.round, env.attempt) != (r.t, r.attempt):
            return self._reject(r, cid, "wrong-round", f"report for round {env.round}."
                                f"{env.attempt}, the open round is {r.t}.{r.attempt}")
        if cid not in r.nonces:
            return self._reject(None, cid, "not-selected",
                                f"client {cid} is not selected for round {r.t}.{r.attempt}")
        if env.model_version != r.model_version:
            return self._reject(r, cid, "model-version", f"report on model "
                                f"{env.model_version!r}, current {r.model_version!r}")
        if cid in r.accepted or cid in r.rejected:
            return self._reject(None, cid, "replay", f"client {cid} already reported in "
                                f"round {r.t}.{r.attempt}")
        if env.nonce != r.nonces[cid]:
            return self._reject(r, cid, "replay", "the report's nonce is not the one issued "
                                "for this round")
        try:
            arrays = wire.decode_arrays(list(env.tensors), self._report_layout, "report")
        except wire.WireError as err:
            return self._reject(r, cid, err.kind, str(err))
        bad = wire.all_finite(arrays)
        if bad is not None:
            return self._reject(r, cid, "non-finite",
                                f"array {self._report_layout[int(bad)][0]!r} holds NaN or "
                                "infinity")
        report = self._report_treedef.unflatten(arrays)
        with self._lock:
            if r.closed:
                return wire.SubmitReply(accepted=False, reason="late: the round has closed")
            if cid in r.accepted or cid in r.rejected:
                return self._reject(None, cid, "replay", "a second report in this round")
            if len(r.accepted) >= self.config.cohort_size:
                return wire.SubmitReply(accepted=False, reason="late: the round is full")
            r.accepted[cid] = report
            self._lock.notify_all()
        return wire.SubmitReply(accepted=True)

    def _count_in(self, n: int) -> None:
        with self._lock:
            self._bytes["in"] += n

    def _rpc_status(self, request, context):
        with self._lock:
            r = self._round
            status = {
                "state": "done" if self._done else ("round" if r and not r.closed
                                                    else "waiting"),
                "rounds_done": self.rounds_done, "rounds": self.config.rounds,
                "alive_clients": len(self._alive()),
                "registered_clients": len(self.registry.clients),
                "round": None if r is None else {
                    "round": r.t, "attempt": r.attempt, "selected": len(r.selected),
                    "reported": len(r.accepted), "rejected": len(r.rejected),
                    "seconds_left": round(max(r.deadline - time.monotonic(), 0.0), 3)},
                "last": self.history[-1] if self.history else None,
            }
        return wire.StatusReply(json=json.dumps(status))
