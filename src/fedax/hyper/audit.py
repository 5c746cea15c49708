"""The audit: which client → server sums of a jaxpr are private.

:func:`audit_sums` walks a jaxpr (``jax.make_jaxpr``) and reports every ``federated_sum``.
The clip and the noise are marker primitives that *are* the operations
(``fedax.hyper.dp_primitives``: ``federated_dp_clip``, each client's pytree scaled to L2
norm ≤ clip; ``federated_dp_noise``, add N(0, stddev²) from a key), so a sum counts as
private exactly when (1) its operand is an output of ``federated_dp_clip`` and (2) its
result goes nowhere but into ``federated_dp_noise`` with stddev > 0; its multiplier is
stddev/clip. A sum is in the *derivative program* when JAX traced it in a transpose (its
name stack says ``transpose(...)``, or an enclosing equation's does). The check is
dataflow, not a name: renaming or wrapping a plain sum does not pass it, and a clipped sum
whose raw value is also used elsewhere fails it. It assumes the default ``vmap`` map
strategy (under ``sequential``/``unroll`` the client-side clip of
``fedax.hyper.with_private_payload`` sits inside a loop body or per-client copies, and its
sums are reported as unprivatized).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from fedax.hyper.dp_primitives import CLIP_PRIMITIVE, NOISE_PRIMITIVE


class SumAudit(NamedTuple):
    """One ``federated_sum`` of a jaxpr.

    Attributes:
      shape: the operand's shape (clients axis first).
      derivative: traced in a transpose (reverse mode's derivative program).
      private: operand from ``federated_dp_clip``, result only into ``federated_dp_noise``
        with stddev > 0.
      noise_multiplier: stddev/clip when private, else None.
      name_stack: where JAX traced it.
    """

    shape: tuple[int, ...]
    derivative: bool
    private: bool
    noise_multiplier: float | None
    name_stack: str


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(sub, "jaxpr", sub)
            if isinstance(inner, jax.extend.core.Jaxpr):
                yield inner


def _audit(jaxpr, in_derivative: bool, found: list[SumAudit]) -> None:
    producer, consumers = {}, {}
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            producer[v] = eqn
        for v in eqn.invars:
            if isinstance(v, jax.extend.core.Var):
                consumers.setdefault(v, []).append(eqn)
    outputs = {v for v in jaxpr.outvars if isinstance(v, jax.extend.core.Var)}
    for eqn in jaxpr.eqns:
        stack = str(eqn.source_info.name_stack)
        derivative = in_derivative or "transpose(" in stack
        # A collect uploads every client's value apart: never private under this audit.
        if eqn.primitive.name in ("federated_sum", "federated_collect"):
            operand, result = eqn.invars[0], eqn.outvars[0]
            source = producer.get(operand) if isinstance(operand, jax.extend.core.Var) \
                else None
            uses = consumers.get(result, [])
            multiplier = None
            if (source is not None and source.primitive.name == CLIP_PRIMITIVE
                    and result not in outputs and uses
                    and all(u.primitive.name == NOISE_PRIMITIVE for u in uses)):
                stddevs = {u.params["stddev"] for u in uses}
                if min(stddevs) > 0:
                    multiplier = min(stddevs) / source.params["clip"]
            found.append(SumAudit(tuple(operand.aval.shape), derivative, multiplier is not None,
                                  multiplier, stack))
        for sub in _sub_jaxprs(eqn):
            _audit(sub, derivative, found)


def audit_sums(jaxpr: Any) -> list[SumAudit]:
    """Every ``federated_sum`` (and ``federated_collect``) of ``jaxpr`` (a
    ``jax.make_jaxpr`` result), nested jaxprs included, with whether it is in the derivative
    program and whether it is private (see the module docstring: dataflow from
    ``federated_dp_clip`` into ``federated_dp_noise``)."""
    found: list[SumAudit] = []
    _audit(getattr(jaxpr, "jaxpr", jaxpr), False, found)
    return found


def unprivatized_sums(jaxpr: Any, *, derivative_only: bool = True) -> list[SumAudit]:
    """The sums of :func:`audit_sums` that are not private (in the derivative program only,
    by default): empty means no client → server sum there bypasses clip and noise."""
    return [s for s in audit_sums(jaxpr) if not s.private and
            (s.derivative or not derivative_only)]


__all__ = ["SumAudit", "audit_sums", "unprivatized_sums"]
