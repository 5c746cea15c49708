"""The privacy values of the DP papers (``papers/dp-adaptive-clipping.yaml``,
``papers/dp-fedavg-mnist.yaml``), computed before their runs.

Each noise level of the settings' ``levels`` has its noise multiplier ``z`` (given, or the
smallest whose ε after the run's ``rounds`` is at most its ``target``, by the RDP
accountant the runs use), its ε after the run by RDP and PLD (``epsilon``), and, with an
``adaptive`` setting, the multiplier ``z_value`` adaptive clipping gives its clipped sum
(the count release, noise m/20, takes a share of z). ``epsilon_after`` (fractions of the
run's rounds) asks for an ε table. All for Poisson sampling of q = ``fraction`` of
N = ``clients``, add-or-remove-one neighbours, δ = ``delta``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fedax.privacy import (
    PrivacyLedger,
    adaptive_clip_noise_multipliers,
    noise_multiplier_for,
)


def epsilons(z: float, rounds: int, s: Mapping[str, Any]) -> dict[str, Any]:
    """ε after ``rounds`` rounds at noise multiplier z: RDP (what the runs record) and PLD
    (tighter); None (∞) for z = 0; ``accounting``: what the RDP ε assumes."""
    out: dict[str, Any] = {}
    for accountant in ("rdp", "pld"):
        ledger = PrivacyLedger(z, s["fraction"], s["delta"], accountant, sampling="poisson",
                               population=s["clients"])
        eps = ledger.epsilon_after(rounds)
        out[accountant] = eps if math.isfinite(eps) else None
        if accountant == "rdp":
            out["accounting"] = ledger.describe()
    return out


def level(spec: Mapping[str, Any], s: Mapping[str, Any]) -> dict[str, Any]:
    """A noise level of the settings completed (see the module's docstring)."""
    q, n = s["fraction"], s["clients"]
    z = float(spec["z"]) if "z" in spec else noise_multiplier_for(
        spec["target"], q, s["rounds"], s["delta"], accountant="rdp", sampling="poisson",
        population=n)
    z_value = (adaptive_clip_noise_multipliers(z, q * n / 20)[0]
               if "adaptive" in s and z > 0 else None)
    return {**spec, "z": z, "z_value": z_value, "epsilon": epsilons(z, s["rounds"], s)}


def settings(paper: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The subset's settings with its levels completed and its ε table."""
    s = dict(settings)
    s["levels"] = [level(spec, s) for spec in s["levels"]]
    if "epsilon_after" in s:
        marks = sorted({max(1, int(s["rounds"] * f)) for f in s["epsilon_after"]})
        s["epsilon_table"] = [{"z": lv["z"], "rounds": t, **epsilons(lv["z"], t, s)}
                              for lv in s["levels"] if lv["z"] > 0 for t in marks]
    return s
