"""Asynchronous federated learning on a virtual clock: FedBuff (Nguyen et al. 2022), FedAsync
(Xie et al. 2019), and synchronous FedAvg measured on the same clock.

    config = fedbuff(buffer_size=10, concurrency=100, latency=Latency("half_normal"))
    history = run_async(fedavg(loss, optax.sgd(0.1), optax.sgd(1.0)), params, source,
                        evaluate, config, server_updates=200, seed=0)
    history.to_target(0.9, "virtual_time"), history.to_target(0.9, "client_updates")
"""

from fedax.simulation.asynchronous.clock import (
    LATENCY_KINDS,
    STALENESS_KINDS,
    Latency,
    Staleness,
    block_durations,
    fedbuff_staleness,
)
from fedax.simulation.asynchronous.config import WEIGHTINGS, AsyncConfig
from fedax.simulation.asynchronous.fedbuff import AsyncHistory, fedasync, fedbuff, run_async
from fedax.simulation.asynchronous.synchronous import SynchronousClock, run_synchronous

__all__ = [
    "LATENCY_KINDS",
    "STALENESS_KINDS",
    "WEIGHTINGS",
    "AsyncConfig",
    "AsyncHistory",
    "Latency",
    "Staleness",
    "SynchronousClock",
    "block_durations",
    "fedasync",
    "fedbuff",
    "fedbuff_staleness",
    "run_async",
    "run_synchronous",
]
