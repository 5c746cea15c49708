"""The aggregator of a config's ``secure`` section: the weighted mean through a secure sum,
DP noise on it, or distributed DP (each client noises its own integers). Which
combinations it composes with is the spec's (``fedax.spec.secure_rules``).
"""

from __future__ import annotations

from typing import Any

from fedax.spec.secure_rules import DISTRIBUTED

DEFAULT_CLIP = 8.0  # Flower's SecAgg+ clipping range


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
        from fedax.spec.errors import ConfigError

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
