"""Communication cost of a federated program, read off its traced jaxpr.

Every byte that crosses a placement goes through ``federated_broadcast`` or
``federated_distribute`` (server -> clients) or ``federated_sum`` or ``federated_collect``
(clients -> server). A broadcast of a value of b bytes to n clients sends n·b bytes down; a
sum (or a collect) of a client-placed value of shape (n, ...) uploads n·b bytes, b being one
client's share; a distribute of ``[n, ...]`` sends each client its own row (n·b in all).
``broadcasts`` counts the downward operations, ``aggregations`` the upward ones. Loops
multiply by their trip count; of two branches the dearer counts.
Because derivatives are written with the same primitives, ``comm_cost(jax.grad(f), ...)``
prices the derivative program too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend import core as jcore

from fedax.federated._primitives import broadcast_p, collect_p, distribute_p, sum_p
from fedax.federated._secure import modular_sum_p, secure_broadcast_p, secure_sum_p


class CommCost(NamedTuple):
    """Bytes and messages moved by one execution of a federated program.

    Attributes:
      server_to_clients_bytes: total bytes sent down, summed over all clients.
      clients_to_server_bytes: total bytes sent up, summed over all clients.
      broadcasts: number of broadcast operations (array leaves) executed.
      aggregations: number of sum operations (array leaves) executed.
      unbounded_loops: number of while loops met whose trip count is unknown; their
        bodies are counted once, so the figures are a lower bound when this is nonzero.
    """

    server_to_clients_bytes: int
    clients_to_server_bytes: int
    broadcasts: int
    aggregations: int
    unbounded_loops: int = 0

    def __add__(self, other):  # type: ignore[override]
        return CommCost(*(a + b for a, b in zip(self, other, strict=True)))

    def scale(self, k: int) -> CommCost:
        return CommCost(*(a * k for a in self[:4]), self.unbounded_loops)


_ZERO = CommCost(0, 0, 0, 0, 0)


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _sub_jaxprs(value) -> list:
    if isinstance(value, jcore.ClosedJaxpr):
        return [value.jaxpr]
    if isinstance(value, jcore.Jaxpr):
        return [value]
    if isinstance(value, (tuple, list)):
        return [j for v in value for j in _sub_jaxprs(v)]
    return []


def _jaxpr_cost(jaxpr) -> CommCost:
    total = _ZERO
    for eqn in jaxpr.eqns:
        prim = eqn.primitive
        if prim is broadcast_p:
            total += CommCost(_nbytes(eqn.outvars[0].aval), 0, 1, 0)
            continue
        if prim is sum_p or prim is collect_p:
            total += CommCost(0, _nbytes(eqn.invars[0].aval), 0, 1)
            continue
        if prim is distribute_p or prim is secure_broadcast_p:
            total += CommCost(_nbytes(eqn.outvars[0].aval), 0, 1, 0)
            continue
        if prim is secure_sum_p or prim is modular_sum_p:  # b bits a coordinate go up
            count = int(np.prod(eqn.invars[0].aval.shape, dtype=np.int64))
            total += CommCost(0, -(-count * eqn.params["bits"] // 8), 0, 1)
            continue
        name = prim.name
        if name == "cond":
            branch_costs = [_jaxpr_cost(b.jaxpr) for b in eqn.params["branches"]]
            total += max(branch_costs, key=lambda c: c[0] + c[1])
            continue
        if name == "scan":
            total += _jaxpr_cost(eqn.params["jaxpr"].jaxpr).scale(int(eqn.params["length"]))
            continue
        if name == "while":
            body = _jaxpr_cost(eqn.params["body_jaxpr"].jaxpr)
            body = body + _jaxpr_cost(eqn.params["cond_jaxpr"].jaxpr)
            total += CommCost(*body[:4], body.unbounded_loops + 1)
            continue
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                total += _jaxpr_cost(sub)
    return total


def comm_cost(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CommCost:
    """Trace ``fn(*args, **kwargs)`` and count the bytes its placement primitives move.

    Works for any traceable function: a round, ``jax.grad`` or ``jax.jvp`` of a round,
    several rounds in a ``lax.scan``. Nothing is executed.
    """
    closed = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
    return _jaxpr_cost(closed.jaxpr)
