"""Several runs compared: one figure of their curves and a markdown table of rounds to target.

``compare_runs([DIR, ...], out)`` reads each run directory's ``metrics.jsonl`` (and
``summary.json`` when there), and writes ``out/compare.png`` (the curves, each run's rounds
to target marked on the target line) and ``out/compare.md`` (the table). It answers the
question users ask most: which setting reached the target in fewer rounds. The target is
``target`` if given, else the runs' own ``target_accuracy`` when they all share one.
``metric`` may be any per-evaluation accuracy, e.g. ``client_accuracy_worst10`` (runs with
``per_client_eval``): the target is then read on that curve.

Each row names its run's setting from the summary's config (``setting``: the algorithm and
what changes its aggregate: DP, compression, a robust rule, attackers, e.g. ``fedavg + dp
gaussian (z=1, fixed)``), and a DP run's ε and δ from the summary's ``privacy`` section
(``—`` for a run without DP; ``∞`` for one whose ε has no bound, z = 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from fedax.experiments.outputs import accuracy_figure, read_records, save_figure
from fedax.io import read_json, write_atomic
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
    run_paths = [Path(p) for p in paths]
    runs = []
    for path, label in zip(run_paths, _labels(run_paths), strict=True):
        metrics = path / "metrics.jsonl"
        if not metrics.is_file():
            raise FileNotFoundError(f"{path} holds no run (no metrics.jsonl)")
        summary = None
        if (path / "summary.json").is_file():
            summary = read_json(path / "summary.json")
        runs.append(RunCurve(label, path, read_records(metrics), summary))
    return runs


def _points(records, metric) -> tuple[list[int], list[float]]:
    rows = [(r["round"], r[metric]) for r in records
            if isinstance(r.get(metric), (int, float)) and math.isfinite(r[metric])]
    return [r for r, _ in rows], [a for _, a in rows]


def _shared_target(runs: Sequence[RunCurve]) -> float | None:
    targets = {(r.summary or {}).get("target_accuracy") for r in runs}
    return targets.pop() if len(targets) == 1 else None


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def _options(pairs) -> str:
    """`` (a, b)`` of the pairs whose value is given, or ``""``."""
    given = [f"{name}{_number(value)}" for name, value in pairs
             if value is not None and value is not False]
    return f" ({', '.join(given)})" if given else ""


def setting(summary: dict[str, Any] | None) -> str:
    """A run's setting in a few words, from its summary: the algorithm, then each part that
    changes its aggregate (``+ eb stopping (every 5)``, ``+ dp gaussian (z=1, fixed)``,
    ``+ qsgd (s=4)``, ``+ median``, ``+ attack label_flip (fraction 0.1)``); ``—`` without a
    summary's config."""
    summary = summary or {}
    config = summary.get("config") or {}
    if not config:
        return "—"
    parts = [str(config.get("algorithm", "?"))]
    client = config.get("client") or {}
    if client.get("stopping", "none") != "none":
        parts.append(f"{client['stopping']} stopping" + _options(
            [("every ", client.get("stopping_every")),
             ("threshold ", client.get("stopping_threshold")),
             ("β=", client.get("stopping_smoothing")),
             ("", "calibrated" if client.get("stopping_calibrated") else None)]))
    privacy = config.get("privacy")
    if privacy:
        # the z the run used (calibrated to target_epsilon if not given) is the summary's
        z = (summary.get("privacy") or {}).get("noise_multiplier",
                                                privacy.get("noise_multiplier"))
        budget = None if z is not None else privacy.get("target_epsilon")
        if privacy.get("level") == "example":
            parts.append("dp-sgd example-level" + _options([("z=", z), ("target ε=", budget)]))
        else:
            parts.append(f"dp {privacy.get('mechanism', '?')}" + _options(
                [("z=", z), ("target ε=", budget), ("", privacy.get("sampling"))]))
    compression = config.get("compression")
    if compression:
        parts.append(str(compression.get("scheme", "?")) + _options(
            [("s=", compression.get("levels")), ("bits=", compression.get("bits")),
             ("fraction ", compression.get("fraction")),
             ("", "error feedback" if compression.get("error_feedback") else None)]))
    robust = config.get("robust")
    if robust:
        parts.append(str(robust.get("rule", "?")) + _options(
            [("β=", robust.get("beta")), ("f=", robust.get("byzantine")),
             ("keep ", robust.get("keep")), ("M=", robust.get("norm_bound")),
             ("noise ", robust.get("noise_stddev")), ("clip ", robust.get("clip"))]))
    attack = config.get("attack")
    if attack:
        parts.append(f"attack {attack.get('kind', '?')}"
                     + _options([("fraction ", attack.get("fraction"))]))
    return " + ".join(parts)


def privacy_cells(summary: dict[str, Any] | None) -> tuple[str, str]:
    """A run's ε and δ as the table shows them: ``—`` without DP, ``∞`` where ε has no
    bound (z = 0; the summary's ε is null), else ε rounded up to 4 significant digits
    (never understated)."""
    privacy = (summary or {}).get("privacy")
    if not privacy:
        return "—", "—"
    eps = privacy.get("epsilon")
    delta = privacy.get("delta")
    delta = "—" if delta is None else _number(delta)
    if eps is None or not math.isfinite(eps):
        return "∞", delta
    from fedax.privacy import round_up

    return round_up(eps, 4), delta


def comparison_table(runs: Sequence[RunCurve], target: float | None,
                     metric: str = "test_accuracy") -> str:
    """The markdown table: one row per run, with its setting, its rounds to ``target`` on
    ``metric``, and its ε and δ (DP runs)."""
    head = ["run", "setting", "rounds run", f"final {metric}", f"best {metric}",
            "rounds to target" if target is None else f"rounds to {target:g}", "ε", "δ"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        rounds, accs = _points(run.records, metric)
        reached = rounds_to_target(rounds, accs, target) if target is not None and accs \
            else None
        cells = [f"`{run.label}`", setting(run.summary),
                 str(run.records[-1]["round"]) if run.records else "0",
                 f"{accs[-1]:.4f}" if accs else "—", f"{max(accs):.4f}" if accs else "—",
                 "—" if target is None else ("not reached" if reached is None
                                             else f"{reached:.1f}"),
                 *privacy_cells(run.summary)]
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
