"""A table paper (``kind: table``): each cell's learning-rate grid, the paper's selection
rule, and speedups over the group's baseline.

Each cell runs once per value of its grid, and the value that reaches the target in the
fewest rounds is chosen (the paper's protocol: "the best η is picked separately" for each
cell; when no value reaches the target, the best accuracy decides and the cell is reported
as a miss); with ``metric: last_accuracy`` the best mean of the last ``last_k`` evaluations
wins. Runs live in ``runs/<cell>/lr_<lr>/`` and are reused or resumed (:mod:`runs`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedax.reproduce.paper import Cell, Paper
from fedax.reproduce.runs import cell_config, lr_dirname, progress_summary, run_one
from fedax.spec.config import ConfigError


def _score(paper: Paper, summary: Mapping[str, Any]) -> tuple[float, float]:
    """Sort key, lower is better: (rounds to target or inf, -best accuracy), or
    (-mean accuracy over the last k evaluations, 0)."""
    if paper.metric == "last_accuracy":
        return (-summary["last_accuracy"], 0.0)
    rounds = summary.get("rounds_to_target")
    return (math.inf if rounds is None else rounds, -summary["best_test_accuracy"])


def _cap(paper: Paper, cell: Cell, points) -> int | None:
    """Rounds a further grid point needs at most to matter: once a learning rate reached
    the target in r rounds, another one that has not reached it by the next evaluation
    after r cannot be chosen, so it stops there (the chosen value and its rounds are the
    same as with uncapped runs; the losers are reported as "not within the cap")."""
    if paper.metric != "rounds_to_target":
        return None
    reached = [s["rounds_to_target"] for _, s in points if s.get("rounds_to_target")]
    if not reached:
        return None
    config = cell_config(paper, cell, cell.lrs[0])
    every = config.eval_every
    cap = (math.ceil(min(reached) / every) + 1) * every
    return cap if cap < config.rounds else None


def run_cell(paper: Paper, cell: Cell, out_dir: Path, *, progress: bool,
             log: Callable[[str], None] = print,
             report_only: bool = False) -> dict[str, Any] | None:
    """Run every learning rate of ``cell``'s grid; the best one is the cell's result.

    With ``report_only``, nothing runs: the cell is read from its finished and unfinished
    runs (None when it has neither), marked ``in_progress`` when its best point is
    unfinished."""
    points: list[tuple[float, dict[str, Any]]] = []
    e, b = (cell.config.get(k) for k in ("local_epochs", "batch_size"))
    what = f"{cell.method}{f' E={e} B={b}' if e or b else ''} ({cell.group})"
    for lr in cell.lrs:
        cap = _cap(paper, cell, points)
        out = out_dir / "runs" / cell.name / lr_dirname(lr)
        log(f"-- {what}: {cell.lr_key}={lr:g}" + (f" (cap {cap} rounds)" * bool(cap)))
        point = (progress_summary(paper, cell, lr, out, cap) if report_only else
                 run_one(paper, cell, lr, out, progress=progress, rounds=cap))
        if point is not None:
            points.append((lr, point))
            state = ("in progress" if point.get("in_progress") else
                     "reused" if point.get("reused") else "run")
            log(f"   {state}: {point['rounds_run']} rounds, rounds to target "
                f"{point.get('rounds_to_target')}, best acc {point['best_test_accuracy']:.4f}, "
                f"{point['wall_time_s']:.0f} s" + (" (reused)" * bool(point.get("reused"))))
    if not points:
        log(f"-- {what}: no runs yet")
        return None
    best_lr, best = min(points, key=lambda p: _score(paper, p[1]))
    config = cell_config(paper, cell, best_lr)
    lrs = sorted(lr for lr, _ in points)
    edge = len(lrs) > 1 and best_lr in (lrs[0], lrs[-1])
    return {
        "name": cell.name, "method": cell.method, "group": cell.group,
        "config": dict(cell.config), "local_epochs": config.local_epochs,
        "batch_size": "inf" if config.batch_size == math.inf else config.batch_size,
        "lr_key": cell.lr_key, "lr": best_lr, "lr_at_grid_edge": edge,
        "rounds_run": best["rounds_run"], "rounds_cap": config.rounds,
        "rounds_to_target": best.get("rounds_to_target"),
        "target_accuracy": config.target_accuracy,
        **{k: best[k] for k in ("best_test_accuracy", "final_test_accuracy", "last_accuracy")},
        "paper": cell.paper, "baseline": cell.baseline, "note": cell.note,
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


def run_table(paper: Paper, out: Path, *, quick: bool, progress: bool,
              log: Callable[[str], None] = print, cells: Sequence[str] | None = None,
              lrs: Sequence[float] | None = None, report_only: bool = False) -> dict[str, Any]:
    """Runs the chosen cells (all of the subset, or those named in ``cells``; every grid
    replaced by ``lrs`` when given) and returns the results' body: each cell's chosen
    learning rate and result beside the paper's, with speedups. ``report_only`` runs
    nothing: cells are read from their finished and unfinished runs in ``out``."""
    rows = []
    for cell in select_cells(paper, quick, cells, lrs):
        result = run_cell(paper, cell, out, progress=progress, log=log,
                          report_only=report_only)
        if result is not None:
            rows.append(result)
    if not rows:
        raise ConfigError(f"{out} holds no runs of the chosen cells yet: nothing to report "
                          "(run the command without --report-only first)")
    _speedups(rows)
    return {
        "target_accuracy": paper.base.get("target_accuracy"),
        "metric": paper.metric,
        "base_config": dict(paper.base),
        "cells": rows,
        "in_progress": any(c["in_progress"] for c in rows),
        # Compute time of every run in the report (reused runs count with their own time).
        "wall_time_s": round(sum(c["wall_time_s"] for c in rows), 1),
    }


def select_cells(paper: Paper, quick: bool, names: Sequence[str] | None = None,
                 lrs: Sequence[float] | None = None) -> list[Cell]:
    """The cells of ``experiment`` (quick or full) named in ``names`` (all when None), in the
    table's order, each with its grid replaced by ``lrs`` when given. Unknown names and
    non-positive learning rates are a ``ConfigError`` that lists the choices."""
    available = list(paper.table_cells(quick))
    if names is not None:
        known = {c.name for c in available}
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise ConfigError(
                f"experiment {paper.name}{' --quick' * quick}: no cell named "
                f"{', '.join(map(repr, unknown)) or '(none given)'}; its cells: "
                f"{', '.join(c.name for c in available)}")
        available = [c for c in available if c.name in set(names)]
    if lrs is not None:
        if not lrs or any(not (lr > 0 and math.isfinite(lr)) for lr in lrs):
            raise ConfigError(f"learning rates must be positive and finite, got {list(lrs)}")
        available = [replace(c, lrs=tuple(lrs)) for c in available]
    return available


