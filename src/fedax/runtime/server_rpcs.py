"""The server's RPCs (a ``Server`` mixin): the behaviours the ``Gate``
(``fedax.runtime.gate``) calls once it has authenticated a call, and the checks of a report.

* ``Join``: the task and the chunk size both sides use (at most ``chunk_bytes``, at least
  1 KiB); a client is alive only once it polls.
* ``Poll``: the client's task in the open round, streamed in chunks, or "wait" / "done";
  an idle poll is held open until there is news (a round opening or closing, the end), up
  to ``poll_hold_s`` and ``max_workers // 2`` polls at a time, and otherwise paced so that
  idle clients poll ``max_idle_polls_per_s`` times a second in all.
* ``Submit``: a report, refused before its body is read unless its header (round, attempt,
  model version, nonce) matches the open round; read within ``report_read_s``, at most
  ``max_message_bytes`` in at most ``wire.max_chunks`` chunks; then checked against the
  report template and the bounds (``_checked_report``). A refusal is counted with its reason
  code (``Rejections``) and excludes the client from the round.
* ``Status``: counts only (no token needed, no metrics, no client ids).
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

import grpc

from fedax.runtime import wire
from fedax.runtime.gate import read_deadline
from fedax.runtime.rounds import OpenRound
from fedax.runtime.server_base import ServerBase

log = logging.getLogger("fedax.runtime.server")


class ServerRPCs(ServerBase):
    """Mixin of ``fedax.runtime.server.Server``: ``_rpc_join``, ``_rpc_poll``,
    ``_rpc_submit`` and ``_rpc_status`` (the Gate's behaviours), ``_task_for`` and the
    report's checks (``_check_header``, ``_check_report``, ``_reject``), on the server's
    open round, lock and counters."""

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

    # ------------------------------------------------------------------------ RPCs
    # Behaviours called by the Gate after it authenticated the call (``cid``); none of
    # Join, Poll, Status reads its request: what they need is in the metadata.

    def _rpc_join(self, request_iterator, context, cid):
        meta = dict(context.invocation_metadata())
        try:
            wanted = int(meta.get(wire.MAX_CHUNK_KEY, wire.DEFAULT_CHUNK_BYTES))
        except ValueError:
            wanted = wire.DEFAULT_CHUNK_BYTES
        chunk = min(max(wanted, 1024), self.config.chunk_bytes)
        with self._lock:
            self.chunk_bytes[cid] = chunk
        # Alive only once it polls (after compiling its client step), not at join.
        log.info("client %d joined (peer %s)", cid, context.peer())
        return wire.JoinReply(task_json=self.task.to_json(), chunk_bytes=chunk)

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

    def _idle(self, cid: int, held: bool) -> bytes:
        """A "wait" (or "done") answer; a poll that was not held is paced so that idle
        clients poll ``max_idle_polls_per_s`` times a second in all."""
        cfg = self.config
        included = self.included.get(cid, (-1, -1))
        pace = min(max(cfg.poll_interval_s, len(self.last_seen) / cfg.max_idle_polls_per_s),
                   cfg.liveness_s / 2)
        return wire.Envelope(kind="done" if self._done else "wait", client_id=cid,
                             rounds_done=self.rounds_done,
                             retry_after_s=0.0 if held else pace,
                             included_round=included[0],
                             included_attempt=included[1]).SerializeToString()

    def _rpc_poll(self, request_iterator, context, cid):
        cfg = self.config
        remaining = context.time_remaining()  # the caller's own deadline, if it set one
        hold = min(cfg.poll_hold_s,
                   math.inf if remaining is None else remaining * 0.8 - 0.2)
        with self._lock:
            self.last_seen[cid] = time.monotonic()
            self._lock.notify_all()
            data = self._task_for(cid)
            idle = data is None and not self._done and self._error is None
            held = idle and hold > 0 and self._held < cfg.max_workers // 2
            if held:
                self._held += 1
                self._holding[cid] += 1
        if held:  # long poll: wait for news (a round opening, the end), not for time
            end = time.monotonic() + hold
            try:
                while not self._stop.is_set() and context.is_active():
                    with self._lock:
                        data = self._task_for(cid)
                        if data is not None or self._done or self._error is not None:
                            break
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    with self._news:
                        self._news.wait(min(left, 1.0))
            finally:
                with self._lock:
                    self._held -= 1
                    self._holding[cid] -= 1
                    if self._holding[cid] <= 0:
                        del self._holding[cid]
                    self.last_seen[cid] = time.monotonic()
        with self._lock:
            if data is None:
                data = self._idle(cid, held)
            size = self.chunk_bytes.get(cid, min(wire.DEFAULT_CHUNK_BYTES, cfg.chunk_bytes))
        for start in range(0, max(len(data), 1), size):
            piece = data[start:start + size]
            with self._lock:
                self._bytes["out"] += len(piece)
            yield wire.Chunk(data=piece, last=start + size >= len(data))

    def _header(self, context) -> tuple[int, int, str, str] | None:
        meta = dict(context.invocation_metadata())
        values: list[Any] = [meta.get(k) for k in wire.REPORT_KEYS]  # None where missing
        try:
            t, attempt, version, nonce = values
            return int(t), int(attempt), str(version), str(nonce)
        except (TypeError, ValueError):
            return None

    def _rpc_submit(self, request_iterator, context, cid):
        with self._lock:
            self.last_seen[cid] = time.monotonic()
            r = self._round
        header = self._header(context)
        if header is None:
            return self._reject(None, cid, "malformed", "the call has no report header "
                                "(round, attempt, model version and nonce metadata)")
        refusal = self._check_header(r, cid, *header)
        if refusal is not None:  # refused before a byte of the body is read
            return refusal
        if not self._readers.acquire(timeout=10.0):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many reports being "
                          "read; retry")
        counter = [0]
        chunk = self.chunk_bytes.get(cid, self.config.chunk_bytes)
        timer = read_deadline(context, self.config.report_read_s)
        try:  # raw bytes from gRPC (see gate.Gate): a piece that is no Chunk is ours to refuse
            env = wire.join_chunks(wire.parse_chunks(request_iterator),
                                   self.config.max_message_bytes, counter,
                                   wire.max_chunks(self.config.max_message_bytes, chunk))
        except wire.WireError as err:
            return self._reject(r, cid, err.kind, str(err))
        finally:
            timer.cancel()
            self._readers.release()
            with self._lock:
                self._bytes["in"] += counter[0]
        return self._check_report(r, cid, header, env)

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

    def _rpc_status(self, request_iterator, context, cid):
        """Counts only (no token needed): no metrics, no client ids."""
        del cid
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
                "rejected_reports": dict(self.rejections.counts),
            }
        return wire.StatusReply(json=json.dumps(status))
