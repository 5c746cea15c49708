"""The configuration of an asynchronous run: ``AsyncConfig`` (the buffer, the concurrency,
the staleness weights and the trip latencies), built by ``fedbuff(...)`` or ``fedasync(...)``
(``fedax.simulation.asynchronous.fedbuff``, whose module docstring describes the algorithm).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fedax.simulation.asynchronous.clock import Latency, Staleness

WEIGHTINGS = ("algorithm", "equal")


class AsyncConfig(NamedTuple):
    """FedBuff's (or FedAsync's) server and clock (see ``fedax.simulation.asynchronous.fedbuff``).

    Attributes:
      buffer_size: K, updates per server step (1: FedAsync).
      concurrency: M >= K, clients training at every moment.
      staleness: s(τ), the weight of an update τ versions old.
      max_staleness: updates staler than this are dropped and counted (None: never).
      latency: the trip-duration distribution.
      weighting: ``algorithm`` (the client's message weight, FedAvg's n_k) or ``equal``
        (1 per update, FLSim's default).
      mixing: FedAsync's rule: aggregate w_current − w_local instead of Δ_i.
    """

    buffer_size: int = 10
    concurrency: int = 10
    staleness: Staleness = Staleness()
    max_staleness: int | None = None
    latency: Latency = Latency()
    weighting: str = "algorithm"
    mixing: bool = False

    def validate(self) -> AsyncConfig:
        for name in ("buffer_size", "concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
                    or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
        if self.concurrency < self.buffer_size:
            raise ValueError(f"concurrency ({self.concurrency}) must be >= buffer_size "
                             f"({self.buffer_size}): raise concurrency or lower buffer_size.")
        if self.max_staleness is not None and (
                isinstance(self.max_staleness, bool)
                or not isinstance(self.max_staleness, (int, np.integer))
                or self.max_staleness < 0):
            raise ValueError(f"max_staleness must be an int >= 0 or None, got "
                             f"{self.max_staleness!r}.")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting {self.weighting!r} is not one of {WEIGHTINGS}.")
        self.staleness.validate()
        self.latency.validate()
        return self


__all__ = ["WEIGHTINGS", "AsyncConfig"]
