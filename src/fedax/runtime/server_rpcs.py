"""The server's RPCs (``Server.rpcs``): the behaviours the ``Gate``
(``fedax.runtime.gate``) calls once it has authenticated a call, and the checks of a report.

* ``Join``: the task and the chunk size both sides use (at most ``chunk_bytes``, at least
  1 KiB); a client is alive only once it polls.
* ``Poll``: the client's task in the open round, streamed in chunks, or "wait" / "done";
  an idle poll is held open until there is news (a round opening or closing, the end), up
  to ``poll_hold_s`` and ``max_workers // 2`` polls at a time, and otherwise paced so that
  idle clients poll ``max_idle_polls_per_s`` times a second in all.
* ``Submit``: a report, refused before its body is read unless its header (round, attempt,
  model version, nonce) matches the open round; one at a time per client, read within
  ``report_read_s`` and before the round's (or trip's) deadline, at most
  ``max_message_bytes`` in at most ``wire.max_chunks`` chunks; then checked against the
  report template and the bounds (``Server._check_report``). A refusal is counted with its reason
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

log = logging.getLogger("fedax.runtime.server")


class ServerRPCs:
    """The Gate's behaviours ``join``, ``poll``, ``submit`` and ``status`` on the
    ``server``'s open round, lock and counters; what a client's task is and whether a
    report is admitted the server says (``_task_for``, ``_check_header``,
    ``_check_report``: a round's, or an asynchronous server's trip's)."""

    def __init__(self, server: Any):
        self.server = server

    # ------------------------------------------------------------------------ RPCs
    # Behaviours called by the Gate after it authenticated the call (``cid``); none of
    # Join, Poll, Status reads its request: what they need is in the metadata.

    def join(self, request_iterator, context, cid):
        server = self.server
        meta = dict(context.invocation_metadata())
        try:
            wanted = int(meta.get(wire.MAX_CHUNK_KEY, wire.DEFAULT_CHUNK_BYTES))
        except ValueError:
            wanted = wire.DEFAULT_CHUNK_BYTES
        chunk = min(max(wanted, 1024), server.config.chunk_bytes)
        with server._lock:
            server.chunk_bytes[cid] = chunk
        # Alive only once it polls (after compiling its client step), not at join.
        log.info("client %d joined (peer %s)", cid, context.peer())
        return wire.JoinReply(task_json=server.task.to_json(), chunk_bytes=chunk)

    def _idle(self, cid: int, held: bool) -> bytes:
        """A "wait" (or "done") answer; a poll that was not held is paced so that idle
        clients poll ``max_idle_polls_per_s`` times a second in all."""
        server = self.server
        cfg = server.config
        included = server.included.get(cid, (-1, -1))
        pace = min(max(cfg.poll_interval_s, len(server.last_seen) / cfg.max_idle_polls_per_s),
                   cfg.liveness_s / 2)
        return wire.Envelope(kind="done" if server._done else "wait", client_id=cid,
                             rounds_done=server.rounds_done,
                             retry_after_s=0.0 if held else pace,
                             included_round=included[0],
                             included_attempt=included[1]).SerializeToString()

    def poll(self, request_iterator, context, cid):
        server = self.server
        cfg = server.config
        remaining = context.time_remaining()  # the caller's own deadline, if it set one
        hold = min(cfg.poll_hold_s,
                   math.inf if remaining is None else remaining * 0.8 - 0.2)
        with server._lock:
            server.last_seen[cid] = time.monotonic()
            server._lock.notify_all()
            data = server._task_for(cid)
            idle = data is None and not server._done and server._error is None
            held = idle and hold > 0 and server._held < cfg.max_workers // 2
            if held:
                server._held += 1
                server._holding[cid] += 1
        if held:  # long poll: wait for news (a round opening, the end), not for time
            end = time.monotonic() + hold
            try:
                while not server._stop.is_set() and context.is_active():
                    with server._lock:
                        data = server._task_for(cid)
                        if data is not None or server._done or server._error is not None:
                            break
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    with server._news:
                        server._news.wait(min(left, 1.0))
            finally:
                with server._lock:
                    server._held -= 1
                    server._holding[cid] -= 1
                    if server._holding[cid] <= 0:
                        del server._holding[cid]
                    server.last_seen[cid] = time.monotonic()
        with server._lock:
            if data is None:
                data = self._idle(cid, held)
            size = server.chunk_bytes.get(cid, min(wire.DEFAULT_CHUNK_BYTES, cfg.chunk_bytes))
        for start in range(0, max(len(data), 1), size):
            piece = data[start:start + size]
            with server._lock:
                server._bytes["out"] += len(piece)
            yield wire.Chunk(data=piece, last=start + size >= len(data))

    def _header(self, context) -> tuple[int, int, str, str] | None:
        meta = dict(context.invocation_metadata())
        values: list[Any] = [meta.get(k) for k in wire.REPORT_KEYS]  # None where missing
        try:
            t, attempt, version, nonce = values
            return int(t), int(attempt), str(version), str(nonce)
        except (TypeError, ValueError):
            return None

    def submit(self, request_iterator, context, cid):
        server = self.server
        with server._lock:
            server.last_seen[cid] = time.monotonic()
            r = server._round
        header = self._header(context)
        if header is None:
            return server._reject(None, cid, "malformed", "the call has no report header "
                                "(round, attempt, model version and nonce metadata)")
        refusal = server._check_header(r, cid, *header)
        if refusal is not None:  # refused before a byte of the body is read
            return refusal
        with server._lock:  # one report read per client at a time: a few slow senders
            busy = cid in server._reading  # cannot hold every reader
            server._reading.add(cid)
        if busy:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "a report of this client "
                          "is already being read; retry")
        if not server._readers.acquire(timeout=10.0):
            with server._lock:
                server._reading.discard(cid)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many reports being "
                          "read; retry")
        counter = [0]
        chunk = server.chunk_bytes.get(cid, server.config.chunk_bytes)
        # a report still arriving when its round (or trip) closes cannot count: its reader
        # is reclaimed then, at the latest after report_read_s
        timer = read_deadline(context, min(server.config.report_read_s,
                                           server._read_seconds(r, cid)))
        try:  # raw bytes from gRPC (see gate.Gate): a piece that is no Chunk is ours to refuse
            env = wire.join_chunks(wire.parse_chunks(request_iterator),
                                   server.config.max_message_bytes, counter,
                                   wire.max_chunks(server.config.max_message_bytes, chunk))
        except wire.WireError as err:
            return server._reject(r, cid, err.kind, str(err))
        finally:
            timer.cancel()
            server._readers.release()
            with server._lock:
                server._reading.discard(cid)
                server._bytes["in"] += counter[0]
        return server._check_report(r, cid, header, env)

    def status(self, request_iterator, context, cid):
        """Counts only (no token needed): no metrics, no client ids."""
        server = self.server
        del cid
        with server._lock:
            r = server._round
            status = {
                "state": "done" if server._done else ("round" if r and not r.closed
                                                    else "waiting"),
                "rounds_done": server.rounds_done, "rounds": server.config.rounds,
                "alive_clients": len(server._alive()),
                "registered_clients": len(server.registry.clients),
                "round": None if r is None else {
                    "round": r.t, "attempt": r.attempt, "selected": len(r.selected),
                    "reported": len(r.accepted), "rejected": len(r.rejected),
                    "seconds_left": round(max(r.deadline - time.monotonic(), 0.0), 3)},
                "rejected_reports": dict(server.rejections.counts),
            }
        return wire.StatusReply(json=json.dumps(status))
