"""Which combinations secure aggregation composes with, and the aggregator it builds.

The server sees only the sum of what the clients' stage made, so everything that needs a
client's own update (a robust rule, a compressed message's decoder, an adaptive clip's
per-client bits) cannot run beside it, and an algorithm that uploads other sums in the
clear (SCAFFOLD, FedNova) would undo it: each is refused in one line naming the key.
Distributed DP (``privacy.mechanism: skellam`` or ``discrete_gaussian``) needs it.
"""

from __future__ import annotations

from typing import Any

from fedax.algorithms import ALGORITHMS

DISTRIBUTED = ("skellam", "discrete_gaussian")
DEFAULT_CLIP = 8.0  # Flower's SecAgg+ clipping range


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


def secure_aggregator(config: Any, *, client_sizes: Any = None, plan: Any = None,
                      cohort: int | None = None) -> Any:
    """The aggregator of ``config.secure`` (None without one): the weighted mean through a
    secure sum; with a DP ``plan``, ``dp_gaussian`` over a secure sum (gaussian) or
    ``distributed_dp`` (skellam, discrete_gaussian). With ``cohort`` (clients a round),
    a sum that could wrap around is refused here, naming ``secure.bits``."""
    secure = config.secure
    if secure is None:
        return None
    aggregator = _secure_aggregator(config, client_sizes, plan)
    spec = aggregator.secure
    if cohort is not None and spec is not None and spec.clip is not None:
        from fedax.experiments.errors import ConfigError

        try:
            spec.levels_for(cohort)
        except ValueError as err:
            raise ConfigError(f"config key 'secure.bits': {str(err).rstrip('.')}") from None
    return aggregator


def _secure_aggregator(config: Any, client_sizes: Any, plan: Any) -> Any:
    secure = config.secure
    from fedax import aggregators
    from fedax.federated import SecureSum

    p = config.privacy
    if plan is not None and p is not None and p.level == "user":
        if p.mechanism in DISTRIBUTED:
            from fedax.aggregators.distributed_dp import distributed_dp

            return distributed_dp(float(p.clip), plan.noise_multiplier,
                                  int(plan.expected_clients), bits=secure.bits,
                                  mechanism=p.mechanism, seed=config.seed)
        spec = SecureSum(clip=float(secure.clip or p.clip), bits=secure.bits,
                         levels=secure.levels)
        return aggregators.dp_gaussian(float(p.clip), plan.noise_multiplier,
                                       plan.expected_clients, per_layer=p.per_layer,
                                       secure=spec)
    max_weight = secure.max_weight
    if max_weight is None:
        if client_sizes is None:
            raise ValueError("secure.max_weight is needed here (the largest n_k a client "
                             "may weigh with; the simulator takes the data's largest n_k): "
                             "set secure.max_weight")
        max_weight = float(max(1, int(max(client_sizes))))
    return aggregators.secure_mean(float(secure.clip or DEFAULT_CLIP), float(max_weight),
                                   bits=secure.bits, levels=secure.levels)
