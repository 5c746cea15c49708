"""Which combinations secure aggregation composes with, decided from declared capabilities.

The server sees only the sum of what the clients' stage made, so everything that needs a
client's own update (a robust rule, a compressed message's decoder, an adaptive clip's
per-client bits) cannot run beside it, and an algorithm that declares other sums uploaded
in the clear (``exact_sums``: SCAFFOLD, FedNova) would undo it: each is refused in one line
naming the key. Distributed DP (``privacy.mechanism: skellam`` or ``discrete_gaussian``)
needs it. The aggregator itself is built by ``fedax.builder.secure_plan``.
"""

from __future__ import annotations

from typing import Any

from fedax.algorithms import ALGORITHMS

DISTRIBUTED = ("skellam", "discrete_gaussian")


def secure_combination(config: Any) -> tuple[str, str] | None:
    """Why ``config`` cannot run with (or without) its ``secure`` section, as ``(key,
    message)``, or None."""
    p, secure = config.privacy, config.secure
    distributed = p is not None and p.level == "user" and p.mechanism in DISTRIBUTED
    if secure is None:
        if distributed:
            return ("privacy.mechanism", f"{p.mechanism!r} is distributed DP: each client "
                                         "noises its own integers, which only a secure sum "
                                         "keeps noised; add a secure section (e.g. secure: "
                                         "{bits: 20}) or use mechanism gaussian")
        return None
    if config.robust is not None:
        return ("secure", "a robust rule needs each client's update, which secure "
                          "aggregation hides from the server; drop robust or secure")
    if config.compression is not None:
        return ("secure", "compression decodes each client's message, which secure "
                          "aggregation hides; drop compression (secure.bits already sets "
                          "the bits per coordinate)")
    if p is not None and p.level == "user" and p.mechanism in ("adaptive", "adaclip"):
        return ("privacy.mechanism", f"{p.mechanism!r} with secure: its clip adapts from "
                                     "per-client statistics the server would read in the "
                                     "clear; use gaussian, skellam or discrete_gaussian")
    spec = ALGORITHMS[config.algorithm]
    if spec.exact_sums:
        able = ", ".join(n for n, s in ALGORITHMS.items() if not s.exact_sums)
        return ("secure", f"algorithm {config.algorithm!r} uploads "
                          f"{'; '.join(spec.exact_sums)} beside the update, outside the "
                          f"secure sum; use one of {able}, or drop secure")
    if config.server.lr == "learned":
        return ("server.lr", "'learned' with secure: the holdout clients' reports are not "
                             "securely aggregated; use a fixed server.lr "
                             "(fedax.hyper.secure_loss differentiates through secure rounds "
                             "in Python)")
    asynchronous = config.execution.mode == "async" or (
        config.execution.mode == "network" and config.network.asynchronous)
    if asynchronous:
        return ("secure", "asynchronous buffered aggregation with secure: a flush sums "
                          "updates of different model versions that arrive one by one, "
                          "which a secure sum over one cohort does not cover; use "
                          "execution.mode sync or network (synchronous)")
    t, k = config.secure.threshold, config.secure.num_shares
    if t is not None and k is not None and t > k:
        return ("secure.threshold", f"{t} exceeds num_shares {k}; a secret shared among k "
                                    "neighbours is rebuilt from at most k shares")
    if t is not None and k is not None and 2 * t <= k:
        return ("secure.threshold", f"{t} is at most half of num_shares {k}: a server that "
                                    "lies about who dropped could gather t shares of both "
                                    "secrets of one client; use more than k/2")
    return None
