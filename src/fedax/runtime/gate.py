"""The server's door: every call is authenticated from its metadata before any work.

grpcio reads a unary request on a worker thread *before* it calls the handler, so a peer
that opens a unary call and never sends its message parks a thread of the pool; 32 such
calls without a token used to stall every authenticated client. Here no handler is unary
on the server side (the wire is the same, clients still make unary calls): ``Gate``, a
``grpc.GenericRpcHandler``, runs in gRPC's own polling thread when a call's headers
arrive, checks the client id and token in its metadata, and only then hands the call to a
behaviour that reads what it needs. An unauthenticated call gets a behaviour that refuses
it at once (``UNAUTHENTICATED``, one reason for every failure, so a caller cannot tell an
unknown id from a wrong token) without reading a byte; a client with ``per_client`` calls
already open gets ``RESOURCE_EXHAUSTED`` the same way. Refusals are logged at most once
per ``log_every_s`` per kind, with the count of those not logged.

``Rejections`` is the bounded record of refused reports: reason codes and numbers only
(never a string a client chose), the last ``size`` of them and a count per kind.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from fedax.runtime import wire
from fedax.runtime.security import CLIENT_ID_KEY, TOKEN_KEY, Registry

log = logging.getLogger("fedax.runtime.server")

REFUSED = "refused: unknown client, wrong token or revoked client"

# A behaviour: (request iterator, context, authenticated client id or None) -> reply(s).
Behaviour = Callable[[Any, grpc.ServicerContext, "int | None"], Any]


class RateLimitedLog:
    """``warning(kind, message)`` logs at most once per ``every_s`` per kind and says
    how many were not logged since."""

    def __init__(self, every_s: float = 5.0):
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._skipped: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def warning(self, kind: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -1e18) < self.every_s:
                self._skipped[kind] += 1
                return
            self._last[kind] = now
            skipped = self._skipped.pop(kind, 0)
        if skipped:
            message += f" ({skipped} more like it not logged)"
        log.warning(message, *args)


class Rejections:
    """The last ``size`` refused reports as ``{round, attempt, client, kind}`` and a
    count per kind (``counts``) since the server started."""

    def __init__(self, size: int = 256):
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=size)
        self.counts: collections.Counter[str] = collections.Counter()

    def add(self, t: int | None, attempt: int | None, client: int, kind: str) -> None:
        self.recent.append({"round": t, "attempt": attempt, "client": int(client),
                            "kind": kind})
        self.counts[kind] += 1

    def __iter__(self):
        return iter(list(self.recent))

    def __len__(self) -> int:
        return len(self.recent)


def _refuse(code: grpc.StatusCode, details: str, streaming: bool) -> grpc.RpcMethodHandler:
    def behaviour(request_iterator, context):
        context.abort(code, details)

    if streaming:
        def stream(request_iterator, context):
            context.abort(code, details)
            yield  # pragma: no cover (abort raises)

        return grpc.stream_stream_rpc_method_handler(stream)
    return grpc.stream_unary_rpc_method_handler(behaviour)


class Gate(grpc.GenericRpcHandler):
    """Routes ``wire.SERVICE``'s methods to ``behaviours`` (name -> (behaviour, needs a
    client)) after authenticating the call from its metadata (see the module docstring).
    Every handler is request-streaming on this side, so nothing is read before the
    behaviour asks for it."""

    def __init__(self, registry: Registry, behaviours: dict[str, tuple[Behaviour, bool]],
                 per_client: int = 4, refusals: RateLimitedLog | None = None):
        self.registry = registry
        self.per_client = int(per_client)
        self.refusals = refusals or RateLimitedLog()
        self._active: collections.Counter[int] = collections.Counter()
        self._lock = threading.Lock()
        self._handlers: dict[str, tuple[Behaviour, bool, Any, Any, bool]] = {}
        for name, (behaviour, needs_client) in behaviours.items():
            _, response, _, streaming = wire.METHODS[name]
            # Requests stay raw bytes: a behaviour parses what it reads, so a message that
            # does not parse is refused by fedax with a reason (grpcio's own failed parse
            # aborts the call, and the reply that follows never completes, which hung
            # Server.stop; tests/test_runtime_fuzz.py).
            self._handlers[f"/{wire.SERVICE}/{name}"] = (
                behaviour, needs_client, None, response.SerializeToString, streaming)

    def active(self, client_id: int) -> int:
        with self._lock:
            return self._active[client_id]

    def service(self, handler_call_details):
        entry = self._handlers.get(handler_call_details.method)
        if entry is None:
            return None  # UNIMPLEMENTED, from gRPC, with no thread used
        behaviour, needs_client, deserialize, serialize, streaming = entry
        cid = None
        if needs_client:
            meta = dict(handler_call_details.invocation_metadata or ())
            cid, reason = self.registry.check(meta.get(CLIENT_ID_KEY), meta.get(TOKEN_KEY))
            if cid is None:
                kind = "auth-" + "".join(ch for ch in reason if not ch.isdigit())
                self.refusals.warning(kind, "refused a call: %s", reason)
                return _refuse(grpc.StatusCode.UNAUTHENTICATED, REFUSED, streaming)
            with self._lock:
                if self._active[cid] >= self.per_client:
                    busy = True
                else:
                    busy = False
                    self._active[cid] += 1
            if busy:
                self.refusals.warning("busy", "refused a call from client %d: %d calls "
                                      "already open", cid, self.per_client)
                return _refuse(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"too many open calls (limit {self.per_client})", streaming)
        release = self._releaser(cid)
        if streaming:
            def stream(request_iterator, context):
                try:
                    yield from behaviour(request_iterator, context, cid)
                finally:
                    release()

            return grpc.stream_stream_rpc_method_handler(
                stream, request_deserializer=deserialize, response_serializer=serialize)

        def unary(request_iterator, context):
            try:
                return behaviour(request_iterator, context, cid)
            finally:
                release()

        return grpc.stream_unary_rpc_method_handler(
            unary, request_deserializer=deserialize, response_serializer=serialize)

    def _releaser(self, cid: int | None) -> Callable[[], None]:
        done = [False]

        def release() -> None:
            if cid is None or done[0]:
                return
            done[0] = True
            with self._lock:
                self._active[cid] -= 1
                if self._active[cid] <= 0:
                    del self._active[cid]

        return release


def read_deadline(context: grpc.ServicerContext, seconds: float) -> threading.Timer:
    """Cancel the call if the behaviour is still reading after ``seconds`` (a server-side
    deadline for a request stream, whatever deadline the peer set); ``cancel()`` the
    returned timer when the read is done."""
    timer = threading.Timer(seconds, context.cancel)
    timer.daemon = True
    timer.start()
    return timer
