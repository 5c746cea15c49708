"""Several runs compared: one figure of their curves and a markdown table of rounds to target.

``compare_runs([DIR, ...], out)`` reads each run directory's ``metrics.jsonl`` (and
``summary.json`` when there), and writes ``out/compare.png`` (the curves, each run's rounds
to target marked on the target line) and ``out/compare.md`` (the table). It answers the
question users ask most: which setting reached the target in fewer rounds. The target is
``target`` if given, else the runs' own ``target_accuracy`` when they all share one.
``metric`` may be any per-evaluation accuracy, e.g. ``client_accuracy_worst10`` (runs with
``per_client_eval``): the target is then read on that curve.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from fedax.experiments.run import accuracy_figure, read_records, save_figure, write_atomic
from fedax.simulation import History, rounds_to_target


class RunCurve(NamedTuple):
    """One run: its label, its records and its summary (None without ``summary.json``)."""

    label: str
    path: Path
    records: list[dict[str, Any]]
    summary: dict[str, Any] | None


def _labels(paths: Sequence[Path]) -> list[str]:
    """The shortest path suffix that tells the runs apart (``z1/seed0``, not ``seed0``)."""
    parts = [p.resolve().parts for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]


def load_runs(paths: Sequence[str | Path]) -> list[RunCurve]:
    """The runs in ``paths``; a directory without ``metrics.jsonl`` is an error naming it."""
    paths = [Path(p) for p in paths]
    runs = []
    for path, label in zip(paths, _labels(paths), strict=True):
        metrics = path / "metrics.jsonl"
        if not metrics.is_file():
            raise FileNotFoundError(f"{path} holds no run (no metrics.jsonl)")
        summary = None
        if (path / "summary.json").is_file():
            summary = json.loads((path / "summary.json").read_text())
        runs.append(RunCurve(label, path, read_records(metrics), summary))
    return runs


def _points(records, metric) -> tuple[list[int], list[float]]:
    rows = [(r["round"], r[metric]) for r in records
            if isinstance(r.get(metric), (int, float)) and math.isfinite(r[metric])]
    return [r for r, _ in rows], [a for _, a in rows]


def _shared_target(runs: Sequence[RunCurve]) -> float | None:
    targets = {(r.summary or {}).get("target_accuracy") for r in runs}
    return targets.pop() if len(targets) == 1 else None


def comparison_table(runs: Sequence[RunCurve], target: float | None,
                     metric: str = "test_accuracy") -> str:
    """The markdown table: one row per run, with its rounds to ``target`` on ``metric``."""
    head = ["run", "algorithm", "rounds run", f"final {metric}", f"best {metric}",
            "rounds to target" if target is None else f"rounds to {target:g}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        rounds, accs = _points(run.records, metric)
        config = (run.summary or {}).get("config") or {}
        reached = rounds_to_target(rounds, accs, target) if target is not None and accs \
            else None
        cells = [f"`{run.label}`", str(config.get("algorithm", "—")),
                 str(run.records[-1]["round"]) if run.records else "0",
                 f"{accs[-1]:.4f}" if accs else "—", f"{max(accs):.4f}" if accs else "—",
                 "—" if target is None else ("not reached" if reached is None
                                             else f"{reached:.1f}")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def comparison_figure(runs: Sequence[RunCurve], target: float | None,
                      metric: str = "test_accuracy", title: str | None = None):
    """The runs' curves of ``metric`` in one figure (every point drawn, integer rounds),
    with each run's rounds to ``target`` marked where its curve crosses the target."""
    curves = {}
    for run in runs:
        rounds, accs = _points(run.records, metric)
        history = History([{"round": r, "test_accuracy": a}
                           for r, a in zip(rounds, accs, strict=True)])
        label = run.label
        if target is not None:
            reached = history.rounds_to_target(target)
            label += (f": {target:g} not reached" if reached is None
                      else f": {target:g} in {reached:.0f} rounds")
        curves[label] = history
    fig = accuracy_figure(curves, target,
                          title or f"{metric.replace('_', ' ')} of {len(runs)} runs")
    ax = fig.axes[0]
    ax.set_ylabel(metric.replace("_", " "))
    if target is not None:  # where each curve crosses the target, in its colour
        for line, history in zip(ax.get_lines(), curves.values(), strict=False):
            reached = history.rounds_to_target(target)
            if reached is not None:
                ax.plot([reached], [target], marker="o", markersize=6, color=line.get_color(),
                        markeredgecolor="black", zorder=5)
    fig.tight_layout()
    return fig


def compare_runs(paths: Sequence[str | Path], out: str | Path, *, target: float | None = None,
                 metric: str = "test_accuracy", title: str | None = None) -> str:
    """Writes ``out/compare.png`` and ``out/compare.md``; returns the markdown table."""
    runs = load_runs(paths)
    target = target if target is not None else _shared_target(runs)
    if not any(_points(r.records, metric)[0] for r in runs):
        raise ValueError(f"no run records {metric!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = comparison_table(runs, target, metric)
    save_figure(comparison_figure(runs, target, metric, title), out / "compare.png")
    text = (f"# {title or 'Runs compared'}\n\n![{metric}](compare.png)\n\n{table}\n"
            "Rounds to target are read as in McMahan et al. (2017): the best-so-far curve, "
            "linearly interpolated between evaluations.\n")
    write_atomic(out / "compare.md", text)
    return table
