"""The audit: what each client → server transfer of a program reveals to the server.

:func:`audit_sums` walks a jaxpr (``jax.make_jaxpr``) and reports every upload: each
``federated_sum`` and ``federated_collect`` (plain placements), each ``federated_secure_sum``
and ``federated_modular_sum`` (secure aggregation: the server learns only the sum). Each is
classified by dataflow, not by name, as

* ``plain``: the server sees the sum (or each value, for a collect) in the clear;
* ``dp``: a central DP release, the operand an output of ``federated_dp_clip`` and the
  result going nowhere but into ``federated_dp_noise`` with stddev > 0 (multiplier
  stddev/clip);
* ``secure``: a secure sum, the server sees only the (quantized) sum;
* ``secure+dp``: both: a secure sum of clipped values noised by the server
  (``federated_dp_clip`` → ``federated_secure_sum`` → ``federated_dp_noise``), or distributed
  DP, a modular sum whose operand is the output of ``federated_dp_local_noise`` (each client
  clipped and noised its own integers; the multiplier is the summed noise's, in the
  primitive's params).

The clip and the noises are marker primitives that *are* the operations
(``fedax.federated.dp_clip``, ``dp_noise``; ``fedax.aggregators.distributed_dp``), so
renaming or wrapping a plain sum does not pass the check, and a clipped sum whose raw value
is also used elsewhere fails it. A transfer is in the *derivative program* when JAX traced
it in a transpose (its name stack says ``transpose(...)``, or an enclosing equation's does).
It assumes the default ``vmap`` map strategy (under ``sequential``/``unroll`` a client-side
clip sits inside a loop body or per-client copies, and its sums are reported as plain).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jax.extend import core as jcore

from fedax.federated._dp import CLIP_PRIMITIVE, NOISE_PRIMITIVE
from fedax.federated._jaxpr_walk import sub_jaxprs
from fedax.federated._secure import MODULAR_SUM_PRIMITIVE, SECURE_SUM_PRIMITIVE

LOCAL_NOISE_PRIMITIVE = "federated_dp_local_noise"
PLAIN = ("federated_sum", "federated_collect")
SECURE = (SECURE_SUM_PRIMITIVE, MODULAR_SUM_PRIMITIVE)


class SumAudit(NamedTuple):
    """One client → server transfer of a jaxpr.

    Attributes:
      shape: the operand's shape (clients axis first).
      derivative: traced in a transpose (reverse mode's derivative program).
      private: DP-noised (central: from ``federated_dp_clip``, only into
        ``federated_dp_noise`` with stddev > 0; distributed: a modular sum of
        ``federated_dp_local_noise``'s output).
      noise_multiplier: the noise multiplier when private, else None.
      name_stack: where JAX traced it.
      secure: a secure sum (the server learns only the sum).
      primitive: the primitive's name.
    """

    shape: tuple[int, ...]
    derivative: bool
    private: bool
    noise_multiplier: float | None
    name_stack: str
    secure: bool = False
    primitive: str = "federated_sum"

    @property
    def kind(self) -> str:
        """``plain``, ``dp``, ``secure`` or ``secure+dp``."""
        if self.secure:
            return "secure+dp" if self.private else "secure"
        return "dp" if self.private else "plain"


def _audit(jaxpr: jcore.Jaxpr, in_derivative: bool, found: list[SumAudit]) -> None:
    producer: dict[jcore.Var, jcore.JaxprEqn] = {}
    consumers: dict[jcore.Var, list[jcore.JaxprEqn]] = {}
    for eqn in jaxpr.eqns:
        for out in eqn.outvars:
            producer[out] = eqn
        for arg in eqn.invars:
            if isinstance(arg, jcore.Var):
                consumers.setdefault(arg, []).append(eqn)
    outputs = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    for eqn in jaxpr.eqns:
        stack = str(eqn.source_info.name_stack)
        derivative = in_derivative or "transpose(" in stack
        name = eqn.primitive.name
        if name in PLAIN or name in SECURE:
            operand, result = eqn.invars[0], eqn.outvars[0]
            source = producer.get(operand) if isinstance(operand, jcore.Var) else None
            multiplier = None
            if name == MODULAR_SUM_PRIMITIVE:
                if source is not None and source.primitive.name == LOCAL_NOISE_PRIMITIVE \
                        and source.params["noise_multiplier"] > 0:
                    multiplier = source.params["noise_multiplier"]
            elif name != "federated_collect":  # a collect's values are apart: never DP
                uses = consumers.get(result, [])
                if (source is not None and source.primitive.name == CLIP_PRIMITIVE
                        and result not in outputs and uses
                        and all(u.primitive.name == NOISE_PRIMITIVE for u in uses)):
                    stddevs = {u.params["stddev"] for u in uses}
                    if min(stddevs) > 0:
                        multiplier = min(stddevs) / source.params["clip"]
            aval: Any = operand.aval  # a ShapedArray (AbstractValue declares no shape)
            found.append(SumAudit(tuple(aval.shape), derivative, multiplier is not None,
                                  multiplier, stack, name in SECURE, name))
        for sub in sub_jaxprs(eqn):  # every sub-program, as comm_cost walks them
            _audit(sub.jaxpr, derivative, found)


def audit_sums(jaxpr: Any) -> list[SumAudit]:
    """Every client → server transfer of ``jaxpr`` (a ``jax.make_jaxpr`` result), nested
    jaxprs included, with whether it is in the derivative program and its ``kind``
    (module docstring)."""
    found: list[SumAudit] = []
    _audit(getattr(jaxpr, "jaxpr", jaxpr), False, found)
    return found


def unprivatized_sums(jaxpr: Any, *, derivative_only: bool = True) -> list[SumAudit]:
    """The transfers of :func:`audit_sums` that are not DP-noised (in the derivative program
    only, by default): empty means no client → server sum there bypasses clip and noise."""
    return [s for s in audit_sums(jaxpr) if not s.private and
            (s.derivative or not derivative_only)]


def unsecured_sums(jaxpr: Any, *, derivative_only: bool = True) -> list[SumAudit]:
    """The transfers of :func:`audit_sums` that are not secure sums (in the derivative
    program only, by default): empty means the server sees no single client's value or
    unaggregated sum there."""
    return [s for s in audit_sums(jaxpr) if not s.secure and
            (s.derivative or not derivative_only)]


def audit_table(jaxpr: Any) -> dict[str, int]:
    """How many transfers of each kind (forward and derivative program apart), e.g.
    ``{"secure": 3, "derivative secure": 2}``."""
    table: dict[str, int] = {}
    for s in audit_sums(jaxpr):
        name = ("derivative " if s.derivative else "") + s.kind
        table[name] = table.get(name, 0) + 1
    return table


__all__ = ["LOCAL_NOISE_PRIMITIVE", "SumAudit", "audit_sums", "audit_table",
           "unprivatized_sums", "unsecured_sums"]
