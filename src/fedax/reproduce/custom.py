"""Helpers for the experiments that are not tables of cells (:class:`CustomExperiment`): an
:class:`Experiment` without cells whose runs are configs over its base, one such run
(resumable and reused, through :func:`run_one`) and whether it diverged, the fields every
``results.json`` opens with, the machine's load average and the mean over seeds.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedax.reproduce.framework import Cell, Experiment, machine_info, run_one


def load_average() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def runs_experiment(name: str, base: Mapping[str, Any], last_k: int, *, title: str,
                    runner: Callable[..., dict[str, Any]] | None = None) -> Experiment:
    """The framework's view of a custom experiment's runs: no cells (:func:`run_config`
    runs each config), the base config, and a run's score, the mean test accuracy over its
    last ``last_k`` evaluations."""
    return Experiment(name=name, title=title, paper="", base=base, full=(), quick=(),
                      metric="last_accuracy", last_k=last_k, runner=runner)


def run_config(experiment: Experiment, name: str, label: str, config: Mapping[str, Any],
               out: Path, *, progress: bool) -> dict[str, Any]:
    """Runs ``config`` over ``experiment.base`` at the base's client learning rate into
    ``out`` (reused when ``out`` holds a finished run of it, resumed when it holds an
    unfinished one); returns the summary with its records (:func:`run_one`). ``name`` and
    ``label`` name the run in messages and progress lines."""
    lr = experiment.base["client_lr"]
    cell = Cell(name=name, method=label, group="", config=config, lr_grid=(lr,))
    return run_one(experiment, cell, lr, out, progress=progress)


def diverged(summary: Mapping[str, Any]) -> bool:
    """Whether a run stopped on a non-finite model (the framework's diverged summary) or
    its last test accuracy is not a finite number."""
    final = summary.get("final_test_accuracy")
    return bool(summary.get("diverged")) or not (
        isinstance(final, (int, float)) and math.isfinite(final))


def results_header(name: str, title: str, paper: str, *, quick: bool, command: str,
                   started: float) -> dict[str, Any]:
    """The fields a custom experiment's ``results.json`` opens with: its name, title and
    paper, the subset and the command, the machine, when it finished and the wall time since
    ``started`` (a ``time.perf_counter()`` reading)."""
    return {
        "experiment": name, "title": title, "paper": paper, "quick": quick,
        "command": command, "machine": machine_info(),
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "wall_time_s": round(time.perf_counter() - started, 1),
    }


def mean_finite(values: Sequence[float | None]) -> float:
    """The mean of the finite values (None and NaN left out); NaN when there are none."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(values)) if values else math.nan
