"""What a reproduction is: a table experiment (:class:`Experiment`, its rows :class:`Cell`)
or a :class:`CustomExperiment` that runs and reports itself."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Cell:
    """One row of a paper table.

    Attributes:
      name: a short unique id, used for the run directory (e.g. ``fedavg-e5-b10-iid``).
      method: the method's name as the paper writes it (``FedSGD``, ``FedAvg``, ...).
      group: the column it belongs to (``IID``, ``non-IID``, ``s=10%``, ...); one figure
        and one baseline per group.
      config: keys that override the experiment's base config.
      lr_grid: the learning rates tried; the best is chosen.
      paper: the paper's number for this cell (rounds to target), None if not reported.
      baseline: the cell that speedups in its group are measured against (FedSGD).
      lr_key: the config key the grid sets (``client_lr`` or ``server.lr``).
      note: shown beside the cell in the report.
    """

    name: str
    method: str
    group: str
    config: Mapping[str, Any]
    lr_grid: Sequence[float]
    paper: float | None = None
    baseline: bool = False
    lr_key: str = "client_lr"
    note: str = ""

    def describe(self) -> str:
        e = self.config.get("local_epochs", "")
        b = self.config.get("batch_size", "")
        return f"{self.method} E={e} B={b} ({self.group})"


@dataclass(frozen=True)
class Experiment:
    """A named paper experiment: a base config and the cells of the full and quick runs.

    ``metric`` is how a run is scored: ``rounds_to_target`` (fewer is better; the paper's
    Tables 1-2) or ``last_accuracy`` (the mean test accuracy over the last ``last_k``
    evaluations; higher is better, as in Reddi et al.'s Table 2).
    """

    name: str
    title: str
    paper: str
    base: Mapping[str, Any]
    full: Sequence[Cell]
    quick: Sequence[Cell]
    notes: str = ""
    quick_notes: str = ""
    full_time: str = ""
    metric: str = "rounds_to_target"
    last_k: int = 10
    columns: Sequence[str] = ("local_epochs", "batch_size")
    # Extra markdown appended to the report, computed from the results (optional).
    extra_report: Callable[[dict[str, Any], Path], str] | None = None
    # Runs a cell's config and returns its summary (default: fedax.experiments.run).
    runner: Callable[..., dict[str, Any]] | None = None

    def cells(self, quick: bool) -> Sequence[Cell]:
        return self.quick if quick else self.full


@dataclass(frozen=True)
class CustomExperiment:
    """An experiment that does not fit the cell/grid shape (e.g. learned hyperparameters):
    ``run(out_dir, quick, progress, command) -> results`` writes ``results.json``,
    ``report.md`` and its figures into ``out_dir`` itself (:mod:`fedax.reproduce.custom`
    runs its configs and fills the common fields; ``framework.save_results`` writes them)."""

    name: str
    title: str
    run: Callable[[Path, bool, bool, str], dict[str, Any]]
    full_description: str = ""
    quick_description: str = ""
