"""Running a table experiment (:mod:`fedax.reproduce.spec`): each cell's learning-rate grid,
resumable runs and the results (:mod:`fedax.reproduce.report` writes the report and figures).

An :class:`Experiment` is a list of :class:`Cell` s (one row of a paper table: a method with
its E, B and partition) over a base config. Each cell runs once per value of its learning
rate grid, and the value that reaches the target in the fewest rounds is chosen (the paper's
protocol: "the best η is picked separately" for each cell; when no value reaches the
target, the best accuracy decides and the cell is reported as a miss). ``reproduce`` writes:

* ``results.json``: every cell with its chosen learning rate, our rounds to target (or
  null), the paper's, the speedup over the experiment's baseline cell, the wall time, and
  every grid point's result;
* ``report.md``: the table of our numbers beside the paper's, the grid, notes, the figures;
* ``<group>.png``: test accuracy against communication rounds for each method (the best
  learning rate of each cell), as in the paper's Figure 2;
* ``runs/<cell>/<lr>/``: each run's ``metrics.jsonl``, ``summary.json`` and checkpoints.

Runs resume: a run whose ``summary.json`` matches its config is reused, and a run that was
interrupted continues from its last checkpoint (bit-identical to an uninterrupted run), so
``fedax reproduce NAME`` after a crash or a kill picks up where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedax.experiments.config import Config, ConfigError, config_to_dict, validate_config
from fedax.reproduce.report import figures, write_report
from fedax.reproduce.spec import Cell, CustomExperiment, Experiment
from fedax.simulation.checkpoint import CheckpointError


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    *path, last = dotted.split(".")
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(base))
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = json.loads(json.dumps(value)) if isinstance(value, Mapping) else value
    return out


def cell_config(experiment: Experiment, cell: Cell, lr: float) -> Config:
    data = _merge(experiment.base, cell.config)
    _set(data, cell.lr_key, float(lr))
    try:
        return validate_config(data)
    except ConfigError as err:
        raise ConfigError(f"experiment {experiment.name}, cell {cell.name}: {err}") from None


def lr_dirname(lr: float) -> str:
    return f"lr_{lr:.6g}"


def _score(experiment: Experiment, summary: Mapping[str, Any]) -> tuple[float, float]:
    """Sort key, lower is better: (rounds to target or inf, -best accuracy), or
    (-mean accuracy over the last k evaluations, 0)."""
    if experiment.metric == "last_accuracy":
        return (-summary["last_accuracy"], 0.0)
    rounds = summary.get("rounds_to_target")
    return (math.inf if rounds is None else rounds, -summary["best_test_accuracy"])


def _default_runner(config: Config, out: Path, *, progress: bool, resume: bool,
                    label: str) -> dict[str, Any]:
    from fedax.experiments.run import run_experiment

    return run_experiment(config, out, progress=progress, resume=resume, label=label)


def _cap(experiment: Experiment, cell: Cell, points) -> int | None:
    """Rounds a further grid point needs at most to matter: once a learning rate reached
    the target in r rounds, another one that has not reached it by the next evaluation
    after r cannot be chosen, so it stops there (the chosen value and its rounds are the
    same as with uncapped runs; the losers are reported as "not within the cap")."""
    if experiment.metric != "rounds_to_target":
        return None
    reached = [s["rounds_to_target"] for _, s in points if s.get("rounds_to_target")]
    if not reached:
        return None
    config = cell_config(experiment, cell, cell.lr_grid[0])
    every = config.eval_every
    cap = (math.ceil(min(reached) / every) + 1) * every
    return cap if cap < config.rounds else None


# Config keys that do not change a run's numbers (how often it saves a checkpoint).
_NOT_THE_RUN = ("checkpoint_every",)


def _same_config(saved: Any, wanted: dict[str, Any]) -> bool:
    """A saved run's config is the wanted one, keys added to the schema since (at their
    defaults) and keys that do not change the run (:data:`_NOT_THE_RUN`) aside: the saved
    config is validated again, which fills them in."""
    def run_keys(config: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in config.items() if k not in _NOT_THE_RUN}

    if not isinstance(saved, dict):
        return False
    if run_keys(saved) == run_keys(wanted):
        return True
    try:
        return run_keys(config_to_dict(validate_config(saved))) == run_keys(wanted)
    except ConfigError:
        return False


def _finished(experiment: Experiment, cell: Cell, lr: float, out: Path, rounds: int | None):
    """``(config, its dict, the finished run's summary with records or None)`` of a grid
    point (``rounds`` replacing the cell's cap when given)."""
    config = cell_config(experiment, cell, lr)
    if rounds is not None:
        config = config.model_copy(update={"rounds": rounds})
    wanted = config_to_dict(config)
    summary_path = out / "summary.json"
    if summary_path.exists():
        done = json.loads(summary_path.read_text())
        if _same_config(done.get("config"), wanted):
            return config, wanted, _with_records(experiment, {**done, "reused": True}, out)
    return config, wanted, None


def run_one(
    experiment: Experiment, cell: Cell, lr: float, out: Path, *, progress: bool,
    rounds: int | None = None,
) -> dict[str, Any]:
    """Run (or reuse, or resume) one grid point; returns its summary with the records."""
    config, wanted, done = _finished(experiment, cell, lr, out, rounds)
    if done is not None:
        return done
    if (out / "summary.json").exists():
        shutil.rmtree(out)  # a finished run of another config: start over
    runner = experiment.runner or _default_runner
    label = f"{cell.method} lr={lr:g}"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="resume: no checkpoint")
        try:
            summary = _diverged_as_miss(runner, config, out, wanted, progress, label)
        except CheckpointError:
            # Checkpoints of another config (e.g. the cell's rounds changed): start over.
            shutil.rmtree(out)
            summary = _diverged_as_miss(runner, config, out, wanted, progress, label)
    return _with_records(experiment, summary, out)


def _diverged_as_miss(runner, config, out, wanted, progress, label) -> dict[str, Any]:
    try:
        return runner(config, out, progress=progress, resume=True, label=label)
    except FloatingPointError:
        return _diverged_summary(config, out, wanted)


def _diverged_summary(config: Config, out: Path, wanted: dict[str, Any]) -> dict[str, Any]:
    """A grid point whose model diverged (a learning rate too large) is a point that did not
    win, not the end of the reproduction: its summary is read from the records it left."""
    from fedax.simulation import rounds_to_target

    records = _read_records(out)
    accs = [r["test_accuracy"] for r in records]
    target = config.target_accuracy
    reached = (rounds_to_target([r["round"] for r in records], accs, target)
               if records and target is not None else None)
    summary = {
        "config": wanted,
        "rounds_run": records[-1]["round"] if records else 0,
        "final_test_accuracy": accs[-1] if accs else 0.0,
        "best_test_accuracy": max(accs) if accs else 0.0,
        "rounds_to_target": reached,
        "wall_time_s": records[-1]["elapsed_s"] if records else 0.0,
        "diverged": True,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _read_records(out: Path) -> list[dict[str, Any]]:
    """The evaluation records a run left in ``out/metrics.jsonl``."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def _with_records(experiment: Experiment, summary: dict[str, Any], out: Path,
                  records: list[dict[str, Any]] | None = None) -> dict:
    """``summary`` with its evaluation records (``out``'s, unless given) and the mean
    accuracy of the last ``experiment.last_k`` of them."""
    records = _read_records(out) if records is None else records
    summary = dict(summary)
    summary["records"] = records
    accs = [r["test_accuracy"] for r in records]
    k = min(experiment.last_k, len(accs))
    summary["last_accuracy"] = sum(accs[-k:]) / k if k else float("nan")
    return summary


def progress_summary(experiment: Experiment, cell: Cell, lr: float, out: Path,
                     rounds: int | None = None) -> dict[str, Any] | None:
    """A grid point's summary without running anything: its finished run's, or where its
    unfinished run stands (``"in_progress": True``, from the newest checkpoint of this
    config); None when ``out`` holds neither."""
    from fedax.experiments.resume import run_progress
    from fedax.simulation import rounds_to_target

    config, wanted, done = _finished(experiment, cell, lr, out, rounds)
    if done is not None:
        return done
    state = run_progress(config, out)
    if state is None or not state["records"]:
        return None
    records = state["records"]
    accs = [r["test_accuracy"] for r in records]
    target = config.target_accuracy
    summary = {
        "config": wanted, "rounds_run": state["round"], "in_progress": True,
        "rounds_to_target": (rounds_to_target([r["round"] for r in records], accs, target)
                             if target is not None else None),
        "best_test_accuracy": max(accs), "final_test_accuracy": accs[-1],
        "wall_time_s": state["elapsed_s"],
    }
    return _with_records(experiment, summary, out, records)


def run_cell(experiment: Experiment, cell: Cell, out_dir: Path, *, progress: bool,
             log: Callable[[str], None] = print,
             report_only: bool = False) -> dict[str, Any] | None:
    """Run every learning rate of ``cell``'s grid; the best one is the cell's result.

    With ``report_only``, nothing runs: the cell is read from its finished and unfinished
    runs (None when it has neither), marked ``in_progress`` when its best point is
    unfinished."""
    points: list[tuple[float, dict[str, Any]]] = []
    for lr in cell.lr_grid:
        cap = _cap(experiment, cell, points)
        if report_only:
            point = progress_summary(experiment, cell, lr,
                                     out_dir / "runs" / cell.name / lr_dirname(lr), cap)
            if point is not None:
                points.append((lr, point))
                state = ("in progress" if point.get("in_progress") else "finished")
                log(f"-- {cell.describe()}: {cell.lr_key}={lr:g}: {state}, "
                    f"{point['rounds_run']} rounds, best acc "
                    f"{point['best_test_accuracy']:.4f}")
            continue
        log(f"-- {cell.describe()}: {cell.lr_key}={lr:g}" + (f" (cap {cap} rounds)" if cap
                                                             else ""))
        summary = run_one(experiment, cell, lr, out_dir / "runs" / cell.name / lr_dirname(lr),
                          progress=progress, rounds=cap)
        points.append((lr, summary))
        log(f"   rounds to target {summary.get('rounds_to_target')}, "
            f"best acc {summary['best_test_accuracy']:.4f}, {summary['wall_time_s']:.0f} s"
            + (" (reused)" if summary.get("reused") else ""))
    if not points:
        log(f"-- {cell.describe()}: no runs yet")
        return None
    best_lr, best = min(points, key=lambda p: _score(experiment, p[1]))
    config = cell_config(experiment, cell, best_lr)
    lrs = sorted(lr for lr, _ in points)
    edge = len(lrs) > 1 and best_lr in (lrs[0], lrs[-1])
    return {
        "name": cell.name,
        "method": cell.method,
        "group": cell.group,
        "config": {k: cell.config[k] for k in cell.config},
        "local_epochs": config.local_epochs,
        "batch_size": "inf" if config.batch_size == math.inf else config.batch_size,
        "lr_key": cell.lr_key,
        "lr": best_lr,
        "lr_at_grid_edge": edge,
        "rounds_run": best["rounds_run"],
        "rounds_cap": config.rounds,
        "rounds_to_target": best.get("rounds_to_target"),
        "target_accuracy": config.target_accuracy,
        "best_test_accuracy": best["best_test_accuracy"],
        "final_test_accuracy": best["final_test_accuracy"],
        "last_accuracy": best["last_accuracy"],
        "paper": cell.paper,
        "baseline": cell.baseline,
        "note": cell.note,
        "in_progress": bool(best.get("in_progress")),
        "wall_time_s": sum(s["wall_time_s"] for _, s in points),
        "grid": [
            {"lr": lr, "rounds_to_target": s.get("rounds_to_target"),
             "rounds_run": s["rounds_run"], "best_test_accuracy": s["best_test_accuracy"],
             "last_accuracy": s["last_accuracy"], "wall_time_s": s["wall_time_s"],
             "in_progress": bool(s.get("in_progress"))}
            for lr, s in points
        ],
        "curve": {"round": [r["round"] for r in best["records"]],
                  "test_accuracy": [r["test_accuracy"] for r in best["records"]]},
    }


def _speedups(cells: list[dict[str, Any]]) -> None:
    """Speedup over the group's baseline: ours (when both reached the target; a lower
    bound when only this cell did) and the paper's."""
    for group in {c["group"] for c in cells}:
        members = [c for c in cells if c["group"] == group]
        base = next((c for c in members if c["baseline"]), None)
        for c in members:
            c["speedup"], c["speedup_bound"], c["paper_speedup"] = None, False, None
            if base is None:
                continue
            if base["paper"] and c["paper"]:
                c["paper_speedup"] = base["paper"] / c["paper"]
            ours, theirs = c["rounds_to_target"], base["rounds_to_target"]
            if ours and theirs:
                c["speedup"] = theirs / ours
            elif ours and theirs is None:
                # The baseline missed within its cap (or, unfinished, within the rounds it
                # has run): the speedup is at least those rounds / ours (shown only when
                # that bound says something, i.e. exceeds 1).
                missed_in = base["rounds_run"] if base.get("in_progress") else base["rounds_cap"]
                if missed_in > ours:
                    c["speedup"], c["speedup_bound"] = missed_in / ours, True


def machine_info() -> dict[str, Any]:
    """The machine a report ran on (platform, Python, JAX, backend, devices, CPUs)."""
    import jax

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "cpus": os.cpu_count(),
    }


def reproduce(
    experiment: Experiment,
    out_dir: str | os.PathLike[str],
    *,
    quick: bool = False,
    progress: bool = True,
    command: str | None = None,
    log: Callable[[str], None] = print,
    cells: Sequence[str] | None = None,
    lrs: Sequence[float] | None = None,
    report_only: bool = False,
) -> dict[str, Any]:
    """Run ``experiment`` (its quick subset with ``quick``) and write the report.

    ``cells`` runs only the named cells (a table too long for one sitting can be run cell
    by cell, each resuming where it stopped); ``lrs`` replaces every cell's learning-rate
    grid (e.g. the paper's own choice, to skip the grid search). The report then covers the
    cells run, and names the grids actually tried. ``report_only`` runs nothing: the report
    covers the cells with runs in ``out_dir``, unfinished ones read from their newest
    checkpoints and marked in progress (nothing in ``out_dir`` but the report changes).
    """
    chosen = select_cells(experiment, quick, cells, lrs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    cells = []
    for cell in chosen:
        result = run_cell(experiment, cell, out, progress=progress, log=log,
                          report_only=report_only)
        if result is not None:
            cells.append(result)
    if not cells:
        raise ConfigError(f"{out} holds no runs of the chosen cells yet: nothing to report "
                          "(run the command without --report-only first)")
    _speedups(cells)
    base = _merge(experiment.base, {})
    target = base.get("target_accuracy")
    results = {
        "experiment": experiment.name,
        "title": experiment.title,
        "paper": experiment.paper,
        "quick": quick,
        "command": command or f"fedax reproduce {experiment.name}" + (" --quick" * quick),
        "target_accuracy": target,
        "metric": experiment.metric,
        "base_config": base,
        "machine": machine_info(),
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cells": cells,
        "in_progress": any(c["in_progress"] for c in cells),
    }
    results["figures"] = figures(experiment, cells, out, target)
    # Compute time of every run in the report (reused runs count with their own time).
    results["wall_time_s"] = round(sum(c["wall_time_s"] for c in cells), 1)
    results["this_invocation_s"] = round(time.perf_counter() - started, 1)
    write_report(experiment, results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def select_cells(experiment: Experiment, quick: bool, names: Sequence[str] | None = None,
                 lrs: Sequence[float] | None = None) -> list[Cell]:
    """The cells of ``experiment`` (quick or full) named in ``names`` (all when None), in the
    table's order, each with its grid replaced by ``lrs`` when given. Unknown names and
    non-positive learning rates are a ``ConfigError`` that lists the choices."""
    available = list(experiment.cells(quick))
    if names is not None:
        known = {c.name for c in available}
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise ConfigError(
                f"experiment {experiment.name}{' --quick' * quick}: no cell named "
                f"{', '.join(map(repr, unknown)) or '(none given)'}; its cells: "
                f"{', '.join(c.name for c in available)}")
        available = [c for c in available if c.name in set(names)]
    if lrs is not None:
        if not lrs or any(not (lr > 0 and math.isfinite(lr)) for lr in lrs):
            raise ConfigError(f"learning rates must be positive and finite, got {list(lrs)}")
        available = [replace(c, lr_grid=tuple(lrs)) for c in available]
    return available


def save_results(results: dict[str, Any], out: Path) -> None:
    """Write ``results.json`` (indented JSON, trailing newline)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


__all__ = ["Cell", "CustomExperiment", "Experiment", "cell_config", "figures", "lr_dirname",
           "machine_info", "progress_summary", "reproduce", "run_cell", "run_one",
           "save_results", "select_cells", "write_report"]
