"""What a run returns and how it ends early, shared by the synchronous runner
(``fedax.simulation.run``) and the asynchronous one (``run_async``): the ``History`` of
evaluation records, read as rounds to a target accuracy (``rounds_to_target``, McMahan et
al.'s reading); a round's metrics as record values (``round_metrics``); the ``Callback``
that receives each record; and the two early ends, ``DivergenceError`` and
``RunInterrupted``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def rounds_to_target(
    rounds: Sequence[float], accuracies: Sequence[float], target: float
) -> float | None:
    """Rounds to reach ``target`` as read in McMahan et al. 2017.

    The accuracy curve is made monotone (best so far), then the first crossing of the
    target is found by linear interpolation between evaluation points. Returns ``None``
    when the target is never reached.
    """
    if len(rounds) != len(accuracies):
        raise ValueError("rounds and accuracies must have the same length.")
    best = np.maximum.accumulate(np.asarray(accuracies, dtype=np.float64))
    hits = np.nonzero(best >= target)[0]
    if hits.size == 0:
        return None
    i = int(hits[0])
    if i == 0:
        return float(rounds[0])
    r0, r1, a0, a1 = rounds[i - 1], rounds[i], best[i - 1], best[i]
    return float(r0 + (target - a0) / (a1 - a0) * (r1 - r0))


@dataclass
class History:
    """Evaluation records (one dict per evaluation) and the final state.

    ``resumed_from`` is the round of the checkpoint a resumed run started from (else None).
    ``round_times`` are the wall seconds of each round run (resumed rounds only), from the
    moment the previous round's results were on the host to this one's: they include
    making the next round's cohort on the host, which overlaps with the device's work,
    and the first includes compilation; evaluation is included in the rounds that
    evaluate.
    """

    records: list[dict[str, Any]] = field(default_factory=list)
    state: Any = None
    resumed_from: int | None = None
    round_times: list[float] = field(default_factory=list)

    def column(self, key: str) -> list[Any]:
        return [r[key] for r in self.records]

    def rounds_to_target(self, target: float) -> float | None:
        return rounds_to_target(self.column("round"), self.column("test_accuracy"), target)


class DivergenceError(FloatingPointError):
    """A run stopped because round ``round`` produced a non-finite server model, or more of
    its clients sent non-finite updates than ``max_rejected_fraction`` allows. The state of
    that round is never checkpointed; the newest checkpoint (if any) is from before it."""

    def __init__(self, message: str, round: int):  # noqa: A002 - the round number
        super().__init__(message)
        self.round = round


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run: ``rounds_done`` rounds had finished, and ``checkpoint_round`` is
    the round of the newest checkpoint this run saved or resumed from (None if none)."""

    def __init__(self, rounds_done: int, checkpoint_round: int | None):
        super().__init__(f"interrupted after round {rounds_done}")
        self.rounds_done = rounds_done
        self.checkpoint_round = checkpoint_round


Callback = Callable[[dict[str, Any]], None]
"""Called with each evaluation record. A callback may also have an ``on_resume(records)``
method: a resumed run calls it once, before its first round, with the records restored
from the checkpoint (e.g. to rewrite a metrics log that may hold records of rounds after
the checkpoint, which the resumed run recomputes)."""


_RECORDED_APART = ("train_loss", "rejected_clients", "server_finite")


def round_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The round's other metrics (the algorithm's and its aggregator's: local steps, clipped
    clients, a learned rate) as JSON values: a float per scalar, nested lists otherwise."""
    out = {}
    for name in sorted(metrics):
        if name in _RECORDED_APART:
            continue
        value = np.asarray(metrics[name])
        out[name] = value.item() if value.ndim == 0 else value.tolist()
        if value.ndim == 0 and np.issubdtype(value.dtype, np.floating):
            out[name] = float(value)
    return out


__all__ = [
    "Callback",
    "DivergenceError",
    "History",
    "RunInterrupted",
    "round_metrics",
    "rounds_to_target",
]
