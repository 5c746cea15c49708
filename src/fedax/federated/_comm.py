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

from fedax.federated._jaxpr_walk import sub_jaxprs
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

    def __add__(self, other: CommCost) -> CommCost:  # type: ignore[override]
        # (tuple's + concatenates any tuples; a cost adds costs field by field)
        return CommCost(self.server_to_clients_bytes + other.server_to_clients_bytes,
                        self.clients_to_server_bytes + other.clients_to_server_bytes,
                        self.broadcasts + other.broadcasts,
                        self.aggregations + other.aggregations,
                        self.unbounded_loops + other.unbounded_loops)

    def scale(self, k: int) -> CommCost:
        return CommCost(self.server_to_clients_bytes * k, self.clients_to_server_bytes * k,
                        self.broadcasts * k, self.aggregations * k, self.unbounded_loops)


_ZERO = CommCost(0, 0, 0, 0, 0)


def _count(aval: Any) -> int:
    """Elements of a shaped aval (JAX's AbstractValue base class declares no shape)."""
    return int(np.prod(aval.shape, dtype=np.int64))


def _nbytes(aval: Any) -> int:
    return _count(aval) * np.dtype(aval.dtype).itemsize


def _jaxpr_cost(jaxpr: jcore.Jaxpr) -> CommCost:
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
            count = _count(eqn.invars[0].aval)
            total += CommCost(0, -(-count * eqn.params["bits"] // 8), 0, 1)
            continue
        # Sub-programs (fedax.federated._jaxpr_walk): a scan body times its length, of a
        # cond's branches the dearer, a while loop's body and condition once (and counted).
        branch_costs: list[CommCost] = []
        unbounded = False
        for sub in sub_jaxprs(eqn):
            cost = _jaxpr_cost(sub.jaxpr)
            if sub.branch:
                branch_costs.append(cost)
            elif sub.trips is None:
                total += cost
                unbounded = True
            else:
                total += cost.scale(sub.trips)
        if branch_costs:
            total += max(branch_costs, key=lambda c: c[0] + c[1])
        if unbounded:
            total += CommCost(0, 0, 0, 0, 1)
    return total


def comm_cost(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CommCost:
    """Trace ``fn(*args, **kwargs)`` and count the bytes its placement primitives move.

    Works for any traceable function: a round, ``jax.grad`` or ``jax.jvp`` of a round,
    several rounds in a ``lax.scan``. Nothing is executed.
    """
    closed = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
    return _jaxpr_cost(closed.jaxpr)
