"""The thin RPC layer between a client and a fedax server: ``Connection`` (a TLS channel,
the client's token on every call, chunked streams), ``server_status``, and the errors a
client raises: ``Refused`` (the server refused the credentials) and ``Unreachable``
(``cannot connect to HOST:PORT: <cause>; <what to do>``, the cause read from a failed
call's status by ``grpc_problem`` where ``security.probe`` could not look).

``fedax.runtime.client.Client`` runs on it; the load test's light client stubs and
``fedax status`` use it directly. It does not load JAX.
"""

from __future__ import annotations

from typing import Any

import grpc

from fedax.runtime import wire
from fedax.runtime.security import ClientTLS, Problem, metadata, probe

# The status codes of a failure worth retrying (the server away, busy or restarting).
RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
         grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED,
         grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


class Refused(PermissionError):
    """The server refused this client (unknown, wrong token or revoked)."""


class Unreachable(ConnectionError):
    """The server cannot be reached: ``cannot connect to ADDRESS: CAUSE; FIX``."""

    def __init__(self, address: str, cause: str, fix: str):
        super().__init__(f"cannot connect to {address}: {cause}; {fix}")
        self.address, self.cause, self.fix = address, cause, fix


def grpc_problem(err: grpc.RpcError, address: str) -> Problem:
    """``(cause, fix, worth retrying)`` from a failed call's status (when ``probe`` could
    not look: a proxy, a ``dns:///`` target, or the server went away after it looked)."""
    code = err.code()
    details = " ".join((err.details() or "").split())
    low = details.lower()
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return (f"the server there is not a fedax server ({details})",
                "check the port in the server address (--server)", False)
    if "connection refused" in low:
        return "connection refused", "check that the server runs and the port", True
    if "resolv" in low or "dns" in low or "domain name not found" in low:
        return (f"unknown host ({details[:200]})",
                "check the host name in the server address (--server)", True)
    if "certificate" in low:
        return (f"TLS verification failed ({details[-200:]})",
                "pass the CA that signed the server's certificate with --ca, and connect by "
                "a name the certificate lists (or pass --server-name)", False)
    if "handshake" in low or "ssl" in low or "tls" in low:
        return (f"TLS handshake failed ({details[-200:]})",
                f"check that {address} is a fedax server's port (it speaks TLS only)", True)
    return (f"{code.name}: {details[:200]}" if details else code.name,
            "check that the server runs and the address", True)


class Connection:
    """RPCs to a fedax server over TLS as one client (``metadata`` on every call)."""

    def __init__(self, address: str, tls: ClientTLS, client_id: int, token: str,
                 chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES, timeout_s: float = 30.0,
                 max_chunk_bytes: int = 4 << 20):
        # The receive limit is the largest piece this client takes; it says so at Join and
        # the server cuts its messages to the size it answers (at most this).
        self.max_chunk_bytes = int(max_chunk_bytes)
        options = wire.grpc_options(max(self.max_chunk_bytes, chunk_bytes))
        if tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        self.channel = grpc.secure_channel(address, tls.credentials(), options=options)
        self.client_id, self.chunk_bytes, self.timeout_s = int(client_id), chunk_bytes, timeout_s
        self._meta = metadata(client_id, token)
        calls = {}
        for name, (req, resp, req_stream, resp_stream) in wire.METHODS.items():
            make = {(False, False): self.channel.unary_unary,
                    (False, True): self.channel.unary_stream,
                    (True, False): self.channel.stream_unary}[(req_stream, resp_stream)]
            calls[name] = make(f"/{wire.SERVICE}/{name}", request_serializer=req.SerializeToString,
                               response_deserializer=resp.FromString)
        self._calls = calls

    def join(self) -> Any:
        """The server's ``JoinReply`` (the task, the chunk size both sides use, which this
        connection adopts)."""
        meta = (*self._meta, (wire.MAX_CHUNK_KEY, str(self.max_chunk_bytes)))
        reply = self._calls["Join"](wire.JoinRequest(client_id=self.client_id),
                                    metadata=meta, timeout=self.timeout_s)
        if reply.chunk_bytes > 0:
            self.chunk_bytes = min(int(reply.chunk_bytes), self.max_chunk_bytes)
        return reply

    def poll(self, max_bytes: int = 256 << 20) -> Any:
        """The server's envelope: ``task``, ``wait`` or ``done``."""
        stream = self._calls["Poll"](wire.PollRequest(client_id=self.client_id),
                                     metadata=self._meta, timeout=self.timeout_s)
        return wire.join_chunks(stream, max_bytes)

    def submit(self, envelope: Any, chunks: Any = None) -> Any:
        """Stream ``envelope`` (or other ready ``chunks``, under ``envelope``'s header) to
        the server; its ``SubmitReply``. The call's metadata names the report's round,
        attempt, model version and nonce (``wire.report_metadata``)."""
        if chunks is None:
            chunks = wire.chunks(envelope, self.chunk_bytes)
        meta = (*self._meta, *wire.report_metadata(envelope))
        return self._calls["Submit"](iter(chunks), metadata=meta, timeout=self.timeout_s)

    def status(self) -> dict[str, Any]:
        import json

        reply = self._calls["Status"](wire.StatusRequest(), metadata=self._meta,
                                      timeout=self.timeout_s)
        return json.loads(reply.json)

    def close(self) -> None:
        self.channel.close()


def server_status(address: str, tls: ClientTLS, timeout_s: float = 5.0) -> dict[str, Any]:
    """The server's status (state, rounds done, alive clients, the open round, the last
    round's log); needs TLS, no client token."""
    problem = probe(address, tls, timeout_s)
    if problem is not None:
        raise Unreachable(address, *problem[:2])
    conn = Connection(address, tls, 0, "", timeout_s=timeout_s)
    try:
        return conn.status()
    except grpc.RpcError as err:
        if err.code() not in RETRY + (grpc.StatusCode.UNIMPLEMENTED,):
            raise
        raise Unreachable(address, *grpc_problem(err, address)[:2]) from None
    finally:
        conn.close()
