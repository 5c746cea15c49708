"""The fedax server: the algorithm's server state and the round schedule, over gRPC + TLS.

Round t, attempt a (Bonawitz et al. 2019's selection / reporting phases; docs/references.md,
deployment runtime):

1. **Selection.** Once ``min_clients`` clients are alive (polled within ``liveness_s``),
   the server picks ``ceil(cohort_size · (1 + over_selection))`` of them with
   ``default_rng([seed, t, a])`` (over-selection: more than needed, so that drop-outs do
   not stall the round) and opens the round: each selected client gets, on its next
   ``Poll``, the payload, the round id ``(t, a)``, the model version (a hash of the
   payload) and a single-use nonce. While fewer are alive, the server logs ``waiting: A
   of N alive, need M (--min-clients)`` and who is not alive.
2. **Reporting.** Each ``Submit`` is checked before it can touch an aggregate. Before its
   body is read (``fedax.runtime.gate``, the call's metadata): the caller is a registered
   client with its token, selected for the open round, whose round, attempt, model
   version and nonce match (a replay or a stale report is refused) and who has not
   reported already. While it is read: at most ``max_message_bytes`` in at most
   ``wire.max_chunks`` chunks, no empty chunk but the last, within ``report_read_s``.
   After: the arrays have exactly the expected paths, dtypes and shapes and are finite,
   and the numbers are within the bounds the server re-checks (``fedax.runtime.checks``).
   A refused report is counted with its reason code, the client is excluded from the
   round, and its values are never stacked or averaged.
3. **Closing.** The round closes when ``cohort_size`` reports are accepted, or at the
   deadline. With at least ``min_reports`` accepted, ``apply_reports`` (``fedax.algorithms.
   protocol``) makes the new state over the accepted reports in client-id order (the
   aggregator's client stage, e.g. the clip, runs here on each report; a compressed
   uplink's encoding runs on the clients); a new state that is not finite is discarded
   and the round retried; otherwise a checkpoint is written and the round is logged
   (selected, reported, rejected, dropped, unneeded, bytes in and out, round time, the
   algorithm's metrics); with fewer, the round is retried as attempt a + 1.

With a secure aggregator (``secure``), reporting and closing are SecAgg+'s four stages
(``fedax.runtime.secure_phase``): the server learns the sum of the surviving clients'
encoded client-stage outputs and nothing else; an attempt the protocol aborts is retried.

A client's per-client state is its own: on its next poll the server tells it the last
``(round, attempt)`` whose aggregate included its report, once the checkpoint holding it is
on disk, and the client keeps the state of exactly that report (``fedax.runtime.client``).
With ``checkpoint_dir`` and ``resume=True`` the server continues from its last checkpoint
(the last ``keep_checkpoints`` kept; a damaged one falls back to the one before); clients
keep polling through the outage. Idle clients long-poll (``poll_hold_s``). The RPCs and
the report checks are ``fedax.runtime.server_rpcs``; the checkpoints and the round log,
``fedax.runtime.server_checkpoint``.

A ``Server`` is its round schedule plus four parts it holds, each an object on the server's
state (not a mixin): ``rpcs`` (the Gate's behaviours), ``checkpoints``, ``phases`` (the
holdout and evaluate rounds) and ``secure`` (SecAgg+, None for plain reports). What a
client's task is and whether a report is admitted (``_task_for``, ``_check_header``,
``_check_report``) are the schedule's: ``fedax.runtime.async_server.AsyncServer`` replaces
them with its trips.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import jax
import numpy as np

from fedax.aggregators.base import round_keys
from fedax.algorithms.protocol import Reports, apply_reports
from fedax.runtime import store, wire
from fedax.runtime.checks import ReportChecks, decoded_report
from fedax.runtime.config import ServerConfig
from fedax.runtime.gate import Gate, RateLimitedLog, Rejections
from fedax.runtime.holdout_phase import Phases
from fedax.runtime.listening import CannotListen, listen
from fedax.runtime.rounds import (
    OpenRound,
    PhaseRound,
    RoundFailed,
    finite,
    select,
    selection_words,
)
from fedax.runtime.secure_phase import SecurePhase
from fedax.runtime.secure_task import REPLIES
from fedax.runtime.security import Registry, ServerTLS
from fedax.runtime.server_checkpoint import CHECKPOINT, ROUND_LOG, Checkpoints
from fedax.runtime.server_rpcs import ServerRPCs
from fedax.runtime.task import (
    Task,
    broadcast,
    build,
    encodes,
    key_from_secret,
    report_template,
    round_key,
    server_state,
    stage_key,
)

log = logging.getLogger("fedax.runtime.server")
__all__ = ["CHECKPOINT", "ROUND_LOG", "CannotListen", "Server"]


def _not_alive(ids: list[int], what: str, shown: int = 10) -> str:
    """``; what: client 3, 7`` (the first ``shown`` ids, then how many more); "" for none."""
    if not ids:
        return ""
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    word = "client" if len(ids) == 1 else "clients"
    return f"; {what}: {word} {', '.join(map(str, ids[:shown]))}{more}"


class Server:
    """A fedax server for ``task`` (see the module docstring).

    ``key``: the server's secret key. Default: drawn from the OS (``os.urandom``) at the
    first start and kept in the checkpoint; never derived from the task, which every
    client receives. A test passes ``jax.random.key(task.seed)`` to get the simulator's
    keys. ``simulator_seed``: the simulator's randomness entirely, ``key(seed)`` and its
    selection (``rounds.select``), for a rehearsal that must reproduce a simulated run
    (``fedax run`` with ``network.server_randomness: seed``); public, so never in a
    deployment. ``roster``: the clients' identity keys (``secagg.Roster``): a secure task
    runs SecAgg+'s consistency check (``fedax.runtime.secure_phase``).

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
                 evaluate: Callable[[Any], dict[str, float]] | None = None,
                 key: jax.Array | None = None, simulator_seed: int | None = None,
                 roster: Any = None):
        self.task, self.config, self.tls, self.registry = task, config, tls, registry
        if simulator_seed is not None:
            key = jax.random.key(simulator_seed)
        self._simulator_seed = simulator_seed
        self.address = address
        self.evaluate = evaluate
        built = build(task)
        self.pieces = built.pieces
        self.state = server_state(self.pieces, built.params)
        self._state_template = jax.eval_shape(lambda: self.state)
        self._encodes = encodes(task)  # clients send compressed codes
        report = report_template(self.pieces, built.params, task.input_shape,
                                 task.input_dtype, task.label_shape, self._encodes)
        self.report_template = report  # what every report must look like
        self._report_layout = wire.expected_layout(report)
        self._report_treedef = jax.tree.structure(report)
        self._checks = ReportChecks(task.algorithm, task.client_lr, task.local_epochs,
                                    task.batch, config.max_examples)
        # DP over a compressed uplink: the clients ran the clip and weight; re-done here
        unit = self._encodes and task.config.get("privacy") is not None
        self._step = jax.jit(lambda s, r, k, m, key: apply_reports(
            self.pieces, s, r, key, keep=m, client_keys=k, staged=self._encodes,
            unit_weights=unit))
        # per_client_eval: whether to evaluate on the clients after round t (t rounds done),
        # and the accuracy ``client_accuracy_above_target`` counts against
        self.client_eval: Callable[[int], bool] | None = None
        self.client_eval_target: float | None = None
        self.rpcs = ServerRPCs(self)
        self.checkpoints = Checkpoints(self)
        self.phases = Phases(self, built, self._encodes)  # holdout (server.lr: learned)
        self.secure = SecurePhase.create(self, task, built, rehearsal=key is not None,
                                         roster=roster)
        self._set_key(key)
        self._lock = threading.Condition()
        self._news = threading.Condition()  # a round opened or closed, or the run ended
        self._held = 0  # polls held open (long poll)
        self._holding: collections.Counter[int] = collections.Counter()  # whose, alive
        self._readers = threading.BoundedSemaphore(config.max_concurrent_reports)
        self._reading: set[int] = set()  # clients whose report is being read
        self._round: OpenRound | None = None
        self._last_closed: OpenRound | None = None  # its late reports are not violations
        self._done = False
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self.rounds_done = 0
        self.last_seen: dict[int, float] = {}
        self.chunk_bytes: dict[int, int] = {}  # negotiated at Join
        self.included: dict[int, tuple[int, int]] = {}
        self.history: list[dict[str, Any]] = []  # closed rounds (kept in the checkpoint)
        # called with each closed round's record once it is checkpointed (a run's
        # metrics.jsonl as it goes: fedax.runtime.launch)
        self.on_round: list[Callable[[dict[str, Any]], None]] = []
        self.records: list[dict[str, Any]] = []  # every attempt, closed or retried
        self.rejections = Rejections()
        self._refusals = RateLimitedLog()
        self._bytes = {"in": 0, "out": 0}
        self._grpc: grpc.Server | None = None
        self._gate: Gate | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        if resume:
            self.checkpoints.restore()

    def _set_key(self, key: jax.Array | None, secret: bytes | None = None) -> None:
        if key is None:
            secret = secret or os.urandom(32)
            key = key_from_secret(secret)
        elif secret is None:
            secret = np.asarray(jax.random.key_data(key)).tobytes()
        self._key, self._secret = key, secret

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> int:
        """Serve (TLS only) and start the rounds; returns the bound port. An address that
        cannot be bound (a port another server listens on) raises ``CannotListen`` with
        one line (``fedax.runtime.listening.listen``)."""
        cfg = self.config
        rpcs = self.rpcs
        self._gate = Gate(self.registry, {"Join": (rpcs.join, True),
                                          "Poll": (rpcs.poll, True),
                                          "Submit": (rpcs.submit, True),
                                          "Status": (rpcs.status, False)},
                          per_client=cfg.per_client_calls, refusals=self._refusals)
        server, port = listen(self.address, self._gate, cfg, self.tls)
        server.start()
        self._grpc, self.port = server, port
        log.info("serving on port %d (TLS), %d rounds from round %d", port,
                 cfg.rounds, self.rounds_done)
        self._thread = threading.Thread(target=self._run_rounds, name="fedax-rounds",
                                        daemon=True)
        self._thread.start()
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
        self._announce()
        if self._grpc is not None:
            self._grpc.stop(grace).wait()
        if self._thread is not None:
            self._thread.join(5.0)

    @property
    def params(self) -> Any:
        return self.pieces.server_params(self.state.server)

    def _announce(self) -> None:
        with self._news:
            self._news.notify_all()

    # --------------------------------------------------------------------- rounds

    def _alive(self) -> list[int]:
        """Clients that polled within ``liveness_s`` or whose poll is held now."""
        now = time.monotonic()
        return sorted({c for c, seen in self.last_seen.items()
                       if now - seen <= self.config.liveness_s} | set(self._holding))

    def _open(self, t: int, attempt: int) -> OpenRound | None:
        cfg = self.config
        alive = self._wait_alive(cfg.min_clients if cfg.min_clients is not None
                                 else cfg.selection_size)
        if alive is None:
            return None
        count = min(cfg.selection_size, len(alive))
        words = ([self._simulator_seed] if self._simulator_seed is not None
                 else selection_words(self._secret))
        selected = select(words, t, attempt, alive, count)
        log.info("round %d attempt %d: selected %d of %d alive clients", t, attempt, count,
                 len(alive))
        if self.secure is not None:
            return self.secure.open(t, attempt, selected)
        sent = broadcast(self.pieces, self.state, self._encodes)
        keys = np.asarray(round_keys(round_key(self._key, t), count)[0])
        own = {c: stage_key(keys[i]) for i, c in enumerate(selected)} if self._encodes else {}
        return self._publish(t, attempt, selected, store.raw(sent), sent["payload"], keys,
                             own=own)

    # While a round waits for clients: a "waiting: ..." line when who is alive changes (at
    # most one per _waiting_change_s) and again every _waiting_repeat_s while nothing does.
    _waiting_change_s = 2.0
    _waiting_repeat_s = 30.0

    def _wait_alive(self, need: int, flag: str = "--min-clients") -> list[int] | None:
        """The alive clients once there are ``need`` (None: the server stopped); meanwhile
        ``waiting: A of N alive, need M (flag); not alive: client ...`` is logged (see
        ``_waiting_change_s``), N the population and the clients seen since the start."""
        shown: list[int] | None = None
        last = -float("inf")
        with self._lock:
            while not self._stop.is_set():
                alive = self._alive()
                if len(alive) >= need:
                    return alive
                now = time.monotonic()
                if ((alive != shown and now - last >= self._waiting_change_s)
                        or now - last >= self._waiting_repeat_s):
                    shown, last = alive, now
                    known = set(range(self.task.num_clients)) | set(self.last_seen)
                    log.info("waiting: %d of %d alive, need %d (%s)%s", len(alive),
                             len(known), need, flag,
                             _not_alive(sorted(known - set(alive)), "not alive"))
                self._lock.wait(self.config.poll_interval_s)
        return None

    def _publish(self, t: int, attempt: int, selected: list[int], sent: Any, payload: Any,
                 keys: Any, phase: str = "train", target: int | None = None,
                 own: dict[int, list] | None = None, version: str | None = None) -> OpenRound:
        """Open round (t, attempt) for ``selected`` with the tensors ``sent`` (and each
        client's ``own`` tensors in its task only)."""
        shared = wire.Envelope(tensors=wire.encode_tree(sent)).SerializeToString()
        version = version or hashlib.sha256(shared).hexdigest()[:16]
        now = time.monotonic()
        with self._lock:
            self._bytes = {"in": 0, "out": 0}
            self._round = OpenRound(t, attempt, selected,
                                    {c: secrets.token_hex(16) for c in selected}, shared,
                                    jax.device_get(payload), keys, version,
                                    now + self.config.deadline_s, now, phase=phase,
                                    target=target, own=own or {})
            self._lock.notify_all()
        self._announce()
        return self._round

    def _close(self, r: OpenRound) -> dict[str, Any]:
        with self._lock:
            while not self._stop.is_set():
                settled = len(r.accepted) + len(r.rejected)
                if (len(r.accepted) >= (r.target or self.config.cohort_size)
                        or settled >= len(r.selected)
                        or time.monotonic() >= r.deadline):
                    break
                self._lock.wait(min(0.05, max(r.deadline - time.monotonic(), 0.0)))
            r.closed = True
            self._last_closed = r
            accepted = dict(r.accepted)
            rejected = dict(r.rejected)
            traffic = dict(self._bytes)
        self._announce()
        missing = len(r.selected) - len(accepted) - len(rejected)
        full = len(accepted) >= (r.target or self.config.cohort_size)  # the rest: unneeded
        record = {"round": r.t, "attempt": r.attempt, "selected": len(r.selected),
                  "reported": len(accepted), "rejected": len(rejected),
                  "dropped": 0 if full else missing, "unneeded": missing if full else 0,
                  "bytes_in": traffic["in"], "bytes_out": traffic["out"]}
        return {"record": record, "accepted": accepted}

    def _aggregate(self, r: OpenRound, accepted: dict[int, Reports]) -> tuple[Any, dict]:
        """The new state from the accepted reports (not yet installed) and the metrics."""
        ids = sorted(accepted)
        rows = [accepted[c] for c in ids]
        keys = [r.client_keys[r.selected.index(c)] for c in ids]
        pad = max(self.config.cohort_size - len(rows), 0)
        zeros = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), self.report_template)
        rows += [zeros] * pad
        keys += [r.client_keys[0]] * pad
        real = np.arange(len(rows)) < len(ids)
        stacked = jax.tree.map(lambda *xs: np.stack(xs), *rows)
        args = (stacked, np.stack(keys), real, round_key(self._key, r.t))
        state, metrics = (self._step(self.state, *args) if self.phases.learned is None
                          else self.phases.aggregate(self.state, *args))
        return state, {k: float(v) for k, v in metrics.items()}

    def _run_rounds(self) -> None:
        """The server's thread: ``_schedule`` until every round is done (or a stop), then
        ``done`` for the clients; an error is surfaced by ``wait``."""
        try:
            if not self._schedule():
                return
            with self._lock:
                self._done = self.rounds_done >= self.config.rounds
                self._round = None
                self._lock.notify_all()
            self._announce()
        except BaseException as err:  # surfaced by wait()
            self._error = err
            log.error("rounds stopped: %s", err)
            self._announce()

    def _schedule(self) -> bool:
        """The rounds, one after another; False if the server stopped first."""
        while self.rounds_done < self.config.rounds and not self._stop.is_set():
            if not self._one_round(self.rounds_done):
                return False
        return True

    def _one_round(self, t: int) -> bool:
        need = self.config.min_reports or self.config.cohort_size
        for attempt in range(self.config.max_attempts):
            r = self._open(t, attempt)
            if r is None:
                return False
            if self.secure is not None:  # SecAgg+: the sum of the survivors' vectors only
                closed = self.secure.close(r, need)
                if closed is None:
                    return False
                record, accepted, result = closed
            else:
                plain = self._close(r)
                record, accepted = plain["record"], plain["accepted"]
                result = self._aggregate(r, accepted) if len(accepted) >= need else None
                if result is None and not self._stop.is_set():
                    silent = sorted(set(r.selected) - set(accepted) - set(r.rejected))
                    log.info("round %d attempt %d: %d of %d selected reported, need %d "
                             "(--min-reports)%s%s; retrying", t, attempt, len(accepted),
                             len(r.selected), need, _not_alive(silent, "missing"),
                             _not_alive(sorted(r.rejected), "refused"))
            if result is not None:
                state, metrics = result
                if finite(state):
                    if self.phases.learned is not None:  # the hypergradient's own phase
                        metrics.update(self.phases.holdout(t, state))
                    if self.client_eval is not None and self.client_eval(t + 1):
                        metrics.update(self.phases.evaluate(t, state))
                    self.checkpoints.install(r, state, accepted, record, metrics)
                    return True
                record["status"] = "non-finite"  # the old state stays; tried again
                log.warning("round %d attempt %d: the new state is not finite; discarded",
                            t, attempt)
            record.setdefault("status", "retry")
            record["round_s"] = round(time.monotonic() - r.started, 4)
            self.checkpoints.log_record(record)
        raise RoundFailed(
            f"round {t} got fewer than {need} accepted reports (or no finite new state) in "
            f"{self.config.max_attempts} attempts; start more clients or lower min_reports")

    # ------------------------------------------------------- admission (the schedule's)

    def _reject(self, r: OpenRound | None, cid: int, kind: str, reason: str) -> Any:
        self._refusals.warning(f"report-{kind}", "rejected a report from client %d: %s: %s",
                               cid, kind, reason)
        with self._lock:
            self.rejections.add(None if r is None else r.t,
                                None if r is None else r.attempt, cid, kind)
            if r is not None and not r.closed and cid in r.nonces and cid not in r.accepted:
                r.rejected.setdefault(cid, kind)
                self._lock.notify_all()
        return wire.SubmitReply(accepted=False, reason=f"{kind}: {reason}")

    def _task_for(self, cid: int) -> bytes | None:
        """Client ``cid``'s task in the open round, if it has one (under the lock)."""
        r = self._round
        if (r is None or r.closed or cid not in r.nonces or cid in r.accepted
                or cid in r.rejected):
            return None
        included = self.included.get(cid, (-1, -1))
        header = wire.Envelope(kind="task" if r.phase == "train" else r.phase,
                               client_id=cid, round=r.t, attempt=r.attempt,
                               model_version=r.model_version, nonce=r.nonces[cid],
                               deadline_s=max(r.deadline - time.monotonic(), 0.0),
                               rounds_done=self.rounds_done, included_round=included[0],
                               included_attempt=included[1])
        header.tensors.extend(r.own.get(cid, ()))  # its own keys, in its task only
        return wire.task_bytes(header, r.shared)

    def _check_header(self, r: OpenRound | None, cid: int, t: int, attempt: int,
                      version: str, nonce: str) -> Any:
        last = self._last_closed
        if last is not None and last.late(cid, t, attempt, nonce):
            return wire.SubmitReply(accepted=False, reason="late: the round has closed")
        if r is None or r.closed:
            return self._reject(None, cid, "wrong-round", f"report for round {t}.{attempt}, "
                                "no round is open")
        problem = r.header_problem(cid, t, attempt, version, nonce)
        if problem is None:
            return None
        kind, reason, this_round = problem
        return self._reject(r if this_round else None, cid, kind, reason)

    def _read_seconds(self, r: OpenRound | None, cid: int) -> float:
        """How long a report from ``cid`` may still be read: until the round closes (with
        a second's grace for the last chunk in flight)."""
        del cid
        return 0.0 if r is None else max(r.deadline - time.monotonic(), 0.0) + 1.0

    def _check_report(self, r: OpenRound | None, cid: int, header: tuple, env: Any) -> Any:
        # (None only for the asynchronous server's trips: here _check_header refused it)
        assert r is not None
        if env.client_id != cid or (env.round, env.attempt, env.model_version,
                                    env.nonce) != header:
            return self._reject(r, cid, "sender", "the report's envelope does not match "
                                "its call (client, round, attempt, version, nonce)")
        report, problem = self._checked_report(r, env)
        if problem is not None:
            return self._reject(r, cid, *problem)
        with self._lock:
            if r.closed:
                return wire.SubmitReply(accepted=False, reason="late: the round has closed")
            if cid in r.accepted or cid in r.rejected:
                return self._reject(None, cid, "replay", "a second report in this round")
            if len(r.accepted) >= (r.target or self.config.cohort_size):
                return wire.SubmitReply(accepted=False, reason="late: the round is full")
            r.accepted[cid] = report
            self._lock.notify_all()
        return wire.SubmitReply(accepted=True)

    def _checked_report(self, r: PhaseRound, env: Any) -> tuple[Any, tuple[str, str] | None]:
        """A report decoded and checked for the open round's phase: a training report
        against the template and the bounds, a secure stage's reply by ``secure``, a
        holdout or evaluate report by ``phases``."""
        if self.secure is not None and r.phase in REPLIES:
            return self.secure.checked(r, env)
        if r.phase != "train":
            return self.phases.checked(r, env)
        report, problem = decoded_report(env.tensors, self._report_layout,
                                         self._report_treedef)
        return report, problem or (None if report is None
                                   else self._checks.check(report, r.payload))
