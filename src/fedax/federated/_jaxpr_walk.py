"""The sub-programs of a jaxpr equation: one definition for every walker of fedax.

:func:`fedax.federated.comm_cost` (``_comm``) and :func:`fedax.federated.audit_sums`
(``_audit``) both descend from an equation into the jaxprs it runs (a ``cond``'s branches, a
``scan``'s body, a ``while``'s body and condition, the program of a ``pjit``, a
``custom_vjp``/``custom_jvp`` call, a ``remat``, a ``shard_map``...). They take them from
:func:`sub_jaxprs`, so the two cannot disagree about which sub-programs exist; each reads
the context it needs (how often the sub-program runs, whether it is one of alternatives).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

from jax.extend import core as jcore


class SubJaxpr(NamedTuple):
    """A jaxpr that an equation runs, with how it runs.

    Attributes:
      jaxpr: the (open) sub-program.
      trips: how many times it runs per execution of the equation: a ``scan``'s length,
        None for a ``while`` loop's body and condition (unknown trip count), else 1.
      branch: one of a ``cond``'s branches, of which exactly one runs.
    """

    jaxpr: jcore.Jaxpr
    trips: int | None = 1
    branch: bool = False


def _jaxprs_in(value: Any) -> Iterator[jcore.Jaxpr]:
    """The jaxprs in one equation parameter: a Jaxpr, a ClosedJaxpr (or anything holding
    its program in ``.jaxpr``), or tuples and lists of them, nested."""
    if isinstance(value, jcore.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _jaxprs_in(item)
    else:
        inner = getattr(value, "jaxpr", None)
        if isinstance(inner, jcore.Jaxpr):
            yield inner


def _devices(eqn: jcore.JaxprEqn) -> int:
    """How many devices run a ``shard_map``'s body: the product of its manual axes' sizes
    (each runs it on its own block, e.g. ``map_and_sum``'s per-device uploads)."""
    shape = eqn.params["mesh"].shape
    axes = eqn.params.get("newly_manual_axes") or eqn.params.get("manual_axes") or shape
    count = 1
    for axis in axes:
        count *= int(shape[axis])
    return count


def sub_jaxprs(eqn: jcore.JaxprEqn) -> Iterator[SubJaxpr]:
    """Every sub-program of ``eqn`` (all jaxprs among its parameters, in parameter order),
    each with its multiplicity: a ``scan`` body runs ``length`` times, a ``shard_map`` body
    once per device of its manual axes, a ``while`` loop's body and condition an unknown
    number of times (``trips`` None), a ``cond`` branch is one of alternatives
    (``branch``); any other sub-program runs once."""
    name = eqn.primitive.name
    for key, value in eqn.params.items():
        for jaxpr in _jaxprs_in(value):
            if name == "cond" and key == "branches":
                yield SubJaxpr(jaxpr, 1, branch=True)
            elif name == "scan" and key == "jaxpr":
                yield SubJaxpr(jaxpr, int(eqn.params["length"]))
            elif name == "shard_map" and key == "jaxpr":
                yield SubJaxpr(jaxpr, _devices(eqn))
            elif name == "while" and key in ("body_jaxpr", "cond_jaxpr"):
                yield SubJaxpr(jaxpr, None)
            else:
                yield SubJaxpr(jaxpr)


__all__ = ["SubJaxpr", "sub_jaxprs"]
