"""Aggregators: how the server combines the clients' messages (see ``aggregators.base``).

    agg = chain(clip_norm(1.0), mean())
    alg = fedavg(loss_fn, optax.sgd(0.1), aggregator=agg)

Every algorithm takes ``aggregator=`` (default ``mean()``, FedAvg's weighted mean) and keeps
the aggregator's state in its own state; the aggregator's metrics are round metrics.
"""

from fedax.aggregators.base import Aggregator, aggregate, chain, no_state
from fedax.aggregators.clipping import clip_norm
from fedax.aggregators.mean import mean, total

__all__ = ["Aggregator", "aggregate", "chain", "clip_norm", "mean", "no_state", "total"]
