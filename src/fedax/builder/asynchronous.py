"""The asynchronous settings of a config, built once for both asynchronous engines.

``async_settings(config, N)`` turns the ``asynchronous:`` section into the simulator's
``AsyncConfig`` (K = ``buffer_size`` and M = ``concurrency``, both defaulting to the
cohort size m, the staleness weights, ``max_staleness``, the latency model and
``weighting``); the virtual clock (``fedax.simulation.asynchronous.run_async``) and the
networked ``AsyncServer`` (``fedax.runtime.async_server``) take the same record, so a
setting means the same in both. The network's trips take as long as they take: there the
latency model is not used.
"""

from __future__ import annotations

from typing import Any

from fedax.builder.privacy_plan import cohort_size
from fedax.simulation.asynchronous import AsyncConfig, Latency, Staleness


def async_settings(config: Any, num_clients: int) -> AsyncConfig:
    """``config.asynchronous`` as a validated ``AsyncConfig`` for ``num_clients`` clients."""
    a = config.asynchronous
    m = cohort_size(config, num_clients)
    return AsyncConfig(
        buffer_size=a.buffer_size or m, concurrency=a.concurrency or m,
        staleness=Staleness(**a.staleness.model_dump()), max_staleness=a.max_staleness,
        latency=Latency(**a.latency.model_dump()), weighting=a.weighting).validate()
