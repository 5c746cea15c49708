"""Where a server listens: its address checked first (a port in use, a host that is not
this machine's, a privileged port), in one line, then gRPC's TLS server bound there with
``SO_REUSEPORT`` off, so that a second server on a port in use fails instead of sharing the
port, and the clients, with the first."""

from __future__ import annotations

import errno
import socket
from concurrent import futures
from typing import Any

import grpc

from fedax.runtime import wire
from fedax.runtime.config import ServerConfig
from fedax.runtime.security import ServerTLS, split_address


class CannotListen(OSError):
    """``Server.start`` could not bind its address (e.g. another server listens there);
    the message is one line naming the address and what to do."""


IN_USE = ("the address is in use (another server listens there); start this one on another "
          "port (fedax server start --port) or stop the one that listens there")


def listen_problem(address: str) -> str | None:
    """Why ``address`` (``host:port``) cannot be listened on and what to do, or None: a
    plain socket binds it first, so that a port in use is refused in one line rather than
    in gRPC's C-core log (gRPC's own failed bind is the fallback). Port 0 and addresses
    that are not a plain ``host:port`` are left to gRPC."""
    parsed = split_address(address)
    if parsed is None or parsed[1] == 0:
        return None
    host, port = parsed
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except OSError as err:
        return (f"unknown host {host!r} ({err.strerror or err}); listen on a name or IP "
                "of this machine (--host)")
    for family, kind, proto, _, where in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(where)
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    return IN_USE
                if err.errno == errno.EACCES:
                    return (f"permission denied (port {port} needs privileges); choose a "
                            "port above 1023 (--port)")
    return None


def listen(address: str, handler: Any, config: ServerConfig,
           tls: ServerTLS) -> tuple[grpc.Server, int]:
    """A gRPC server with ``handler`` (the Gate), bound to ``address`` with TLS, not yet
    started, and its port; ``CannotListen`` (one line) where it cannot bind."""
    cfg = config
    problem = listen_problem(address)
    if problem is None:
        # SO_REUSEPORT off: a second server on a port in use fails to bind instead of
        # sharing the port (and the clients) with the first
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.max_workers),
                             handlers=(handler,),
                             options=[*wire.server_grpc_options(cfg.chunk_bytes),
                                      ("grpc.so_reuseport", 0)],
                             maximum_concurrent_rpcs=cfg.max_concurrent_rpcs)
        try:
            port = server.add_secure_port(address, tls.credentials())
        except RuntimeError:  # grpcio >= 1.5x raises where older ones returned 0
            port = 0
        if port == 0:
            server.stop(None)
            problem = ("gRPC could not bind it (in use, or not an address of this "
                       "machine); choose another --host or --port, or stop the server "
                       "that listens there")
    if problem is not None:
        raise CannotListen(f"cannot listen on {address}: {problem}")
    return server, port


__all__ = ["IN_USE", "CannotListen", "listen", "listen_problem"]
