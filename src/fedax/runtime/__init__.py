"""The networked runtime: a real server and real clients over gRPC, running the same
``RoundPieces`` as the simulator (DESIGN.md, "Runtime"; docs/deployment.md).

* ``Server`` / ``ServerConfig``: the server state, round schedule, selection with
  over-selection, deadlines, minimum reports and retries, report checks, checkpoints and
  resume (``fedax.runtime.server``);
* ``Client`` / ``ClientConfig``: one client's data, per-client state and the algorithm's
  client piece (``fedax.runtime.client``); ``Connection``, ``server_status``: the RPC layer
  under it (``fedax.runtime.connection``);
* ``Task``: the algorithm, model and hyperparameters both sides build from
  (``fedax.runtime.task``);
* ``ServerTLS``, ``ClientTLS``, ``Registry``, ``make_dev_pki``: TLS and client tokens
  (``fedax.runtime.security``); ``fedax.runtime.wire``: the messages.
"""

from __future__ import annotations

import importlib

_NAMES = {  # name -> the module that defines it; loaded on first use (PEP 562), so a
    # light client stub (``fedax.runtime.connection.Connection``) does not load JAX
    "Client": "client", "ClientConfig": "client", "Connection": "connection",
    "Refused": "connection", "Unreachable": "connection", "local_batches": "client_task",
    "server_status": "connection",
    "ClientTLS": "security", "Registry": "security", "ServerTLS": "security",
    "make_dev_pki": "security", "read_token": "security",
    "RoundFailed": "rounds", "Server": "server", "CannotListen": "listening",
    "ServerConfig": "config",
    "Task": "task", "build": "task",
}


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"fedax.runtime.{_NAMES[name]}"), name)
    if name in ("wire", "store", "security", "task", "server", "client"):
        return importlib.import_module(f"fedax.runtime.{name}")
    raise AttributeError(f"module 'fedax.runtime' has no attribute {name!r}")


__all__ = [
    "CannotListen",
    "Client",
    "ClientConfig",
    "ClientTLS",
    "Connection",
    "Refused",
    "Registry",
    "RoundFailed",
    "Server",
    "ServerConfig",
    "ServerTLS",
    "Task",
    "Unreachable",
    "build",
    "local_batches",
    "make_dev_pki",
    "read_token",
    "server_status",
]
