"""Synchronous FedAvg measured on the asynchronous virtual clock (``run_synchronous``): the
ordinary runner (``fedax.simulation.run``); round t takes the slowest of its C clients' trip
durations, the same draws as the asynchronous clock's trips of block t.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedax.algorithms import FederatedAlgorithm
from fedax.simulation.asynchronous.clock import Latency, TripBlocks
from fedax.simulation.asynchronous.fedbuff import AsyncHistory
from fedax.simulation.runner import run
from fedax.simulation.sources import PartitionSource


class SynchronousClock:
    """Virtual time of synchronous rounds: round t starts when round t − 1 ends and lasts
    its slowest client's trip, ``max_k d_{t,k}`` (block t's durations, the same draws as
    the asynchronous clock's trips ``t·C ... t·C + C − 1``)."""

    def __init__(self, source: PartitionSource, latency: Latency, seed: int):
        self.blocks = TripBlocks(source, latency.validate(), seed)
        self.ends: list[float] = [0.0]
        self.cohort = self.blocks.size()

    def time(self, rounds: int) -> float:
        """Virtual time at the end of round ``rounds`` (1-based count of rounds done)."""
        while len(self.ends) <= rounds:
            t = len(self.ends) - 1
            durations = self.blocks.get(t)[4]
            self.ends.append(self.ends[-1] + float(durations.max()))
            self.blocks.forget_below(t + 1)
        return self.ends[rounds]

    def fields(self, rounds: int) -> dict[str, Any]:
        return {"virtual_time": self.time(rounds), "client_updates": rounds * self.cohort}


def run_synchronous(
    algorithm: FederatedAlgorithm,
    init_params: Any,
    source: PartitionSource,
    evaluate: Callable[[Any], Any] | None,
    latency: Latency,
    *,
    rounds: int,
    seed: int = 0,
    **kwargs: Any,
) -> AsyncHistory:
    """Synchronous rounds (``fedax.simulation.run``) with each record's ``virtual_time``
    (``SynchronousClock``: a round waits for its slowest client) and ``client_updates``
    (C per round). ``kwargs`` go to ``run`` (eval_every, checkpoints, execution, ...)."""
    if not isinstance(source, PartitionSource):
        raise ValueError("run_synchronous needs a PartitionSource, got "
                         f"{type(source).__name__}.")
    clock = SynchronousClock(source, latency, seed)
    history = run(algorithm, init_params, source, evaluate, rounds=rounds, seed=seed,
                  record_fields=clock.fields, **kwargs)
    return AsyncHistory(history.records, history.state, history.resumed_from,
                        history.round_times)


__all__ = ["SynchronousClock", "run_synchronous"]
