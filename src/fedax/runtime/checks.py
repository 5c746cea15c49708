"""What the server re-checks in every report, whatever the client says it ran.

Over the network the client half of a round runs on a machine the server does not
control, so every number in a report is a claim. After the wire checks (paths, dtypes,
shapes, finite values; ``fedax.runtime.wire``) the server checks the report's *bounds*
(``ReportChecks``), and then runs the aggregator's client stage (clipping, the adaptive
clip's indicator, AdaCliP's whitening) on the report itself
(``fedax.algorithms.protocol.apply_reports``): in the trusted-server model of DP-FedAvg
(McMahan et al. 2018) the server clips, so no client can skip the clip or lie about
whether it was clipped.

The bounds (a report failing one is refused with kind ``bounds`` and never aggregated):

* ``num_examples`` n_k is an integer in [0, ``max_examples``];
* ``weight`` is in [0, ``max_examples``] (n_k, 1 or 0 for every registered algorithm);
* ``stats["local_steps"]``, where the algorithm reports it, is an integer K_i in
  [0, E·⌈n_k/B⌉] (``fedax.data.num_local_steps``; fewer with early stopping);
* the exact sums an algorithm uploads beside its update (``AlgorithmSpec.exact_sums``,
  which no aggregator sees) are what its client computes from the rest of the report, by
  the check its registry entry declares (``AlgorithmSpec.check_sums``, in the algorithm's
  own module): SCAFFOLD (Option II) Δc_i = −c + Δy_i / (K_i η_l) with the server's own c,
  Δy_i the report's update and K_i its steps, to float tolerance; FedNova (Σ n_i τ_i, Σ n_i)
  = (n_k K_i, n_k) exactly. An algorithm with exact sums and no declared check is refused
  by the runtime (``sums_check``), so a new one cannot slip through unchecked; SCAFFOLD
  Option I (Δc_i = g_i(x) − c_i, a gradient the server cannot recompute) is one.

What the bounds do not cover, by design: a client may send any update within them (the
aggregator bounds its effect: a clip, a robust rule, DP noise), any n_k up to
``max_examples`` (with n_k weights a client can weigh that much; use uniform weights
against it), and training statistics that are only reported (``train_loss``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fedax.data.client_data import num_local_steps
from fedax.runtime import wire

# a check of an algorithm's exact sums: (report, payload, steps) -> reason or None
SumsCheck = Callable[[Any, Any, float], "str | None"]


def sums_check(algorithm: str, client_lr: float) -> SumsCheck | None:
    """The check of ``algorithm``'s exact sums, as its registry entry declares it
    (``AlgorithmSpec.check_sums``, written in the algorithm's own module); None if it
    uploads none. Raises ``ValueError`` (naming the fix) for an algorithm whose sums the
    server cannot check."""
    from fedax.algorithms import ALGORITHMS

    spec = ALGORITHMS[algorithm]
    if not spec.exact_sums:
        return None
    if spec.check_sums is None:
        able = ", ".join(repr(n) for n, s in ALGORITHMS.items()
                         if not s.exact_sums or s.check_sums is not None)
        raise ValueError(f"algorithm {algorithm!r} uploads exact sums the server cannot "
                         f"check over the network ({'; '.join(spec.exact_sums)}); use one "
                         f"of {able}")
    return spec.check_sums(client_lr)


def _integer(value: float) -> bool:
    return float(value) == float(np.floor(value))


class ReportChecks:
    """``check(report, payload) -> (kind, reason) | None`` for one decoded report
    (NumPy leaves), against the payload the server sent this round."""

    def __init__(self, algorithm: str, client_lr: float, local_epochs: int,
                 batch_size: float, max_examples: int):
        self.epochs, self.batch = int(local_epochs), batch_size
        self.max_examples = int(max_examples)
        self.sums = sums_check(algorithm, client_lr)

    def check(self, report: Any, payload: Any) -> tuple[str, str] | None:
        n = float(np.asarray(report.num_examples))
        if not (0 <= n <= self.max_examples and _integer(n)):
            return "bounds", (f"num_examples {n:g} is not an integer in [0, "
                              f"{self.max_examples}] (server setting max_examples)")
        w = float(np.asarray(report.weight))
        if not 0 <= w <= self.max_examples:
            return "bounds", f"weight {w:g} is not in [0, {self.max_examples}]"
        most = num_local_steps(int(n), self.epochs, self.batch)
        steps = report.stats.get("local_steps")
        steps = None if steps is None else float(np.asarray(steps))
        if steps is not None and not (0 <= steps <= most and _integer(steps)):
            return "bounds", (f"local_steps {steps:g} is not an integer in [0, {most}] "
                              f"(E·ceil(n_k/B) for n_k={n:g})")
        if self.sums is not None:
            reason = self.sums(report, payload, most if steps is None else steps)
            if reason is not None:
                return "bounds", reason
        return None


def decoded_report(tensors: Any, layout: Any, treedef: Any) -> tuple[Any, tuple[str, str] | None]:
    """A report's arrays as its pytree, or ``(None, (kind, reason))`` when they are not
    exactly the expected arrays (paths, dtypes, shapes: ``wire.expected_layout``) or not
    all finite."""
    try:
        arrays = wire.decode_arrays(list(tensors), layout, "report")
    except wire.WireError as err:
        return None, (err.kind, str(err))
    bad = wire.all_finite(arrays)
    if bad is not None:
        return None, ("non-finite", f"array {layout[int(bad)][0]!r} holds NaN or infinity")
    return treedef.unflatten(arrays), None
