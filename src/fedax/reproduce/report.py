"""The reports: a table experiment's ``report.md`` and figures, and the markdown helpers that
every experiment's report shares (pyplot, a figure's PNG, sections and paragraphs, the write
of ``report.md``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fedax.reproduce.spec import Experiment


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (figures are only saved)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: Path) -> None:
    """Lays ``fig`` out (``tight_layout``), writes it to ``path`` as a PNG at 110 dpi and
    closes it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_section(title: str, text: str) -> list[str]:
    """The lines of a report section: ``## title``, a blank line, ``text`` (stripped), a
    blank line."""
    return [f"## {title}", "", text.strip(), ""]


def notes_sections(notes: str, quick_notes: str = "") -> list[str]:
    """A report's closing notes: ``## Notes`` (when ``notes`` is not empty) and ``## The
    quick subset`` (when ``quick_notes`` is not empty: give it for a ``--quick`` run only)."""
    lines = markdown_section("Notes", notes) if notes else []
    if quick_notes:
        lines += markdown_section("The quick subset", quick_notes)
    return lines


def paragraph(text: str) -> str:
    """``text``, a paragraph wrapped over lines (e.g. a filled-in template), on one line:
    its lines stripped and joined by single spaces."""
    return " ".join(line.strip() for line in text.strip().splitlines())


def save_report(lines: list[str], out: Path) -> str:
    """Writes ``lines`` as ``out/report.md`` (a newline after each); returns the text."""
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text


# ------------------------------------------------------------------- a table experiment


def _fmt(value: Any, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _fmt_column(value: Any) -> str:
    """A config value in the table: floats as written (0.5, 0.001), not rounded."""
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:g}"
    return _fmt(value)


def _ratio_check(cell: dict[str, Any]) -> str:
    """Within 2x of the paper? '✓', '✗ (1.3x the paper)', or the reason it cannot say."""
    ours, paper = cell["rounds_to_target"], cell["paper"]
    if paper is None:
        return "no paper value"
    if ours is None and cell.get("in_progress"):
        return f"in progress (not reached in {cell['rounds_run']} rounds)"
    if ours is None:
        return f"missed (target not reached in {cell['rounds_cap']} rounds)"
    ratio = ours / paper
    mark = "✓" if 0.5 <= ratio <= 2.0 else "✗"
    return f"{mark} {ratio:.2f}× the paper"


def figures(experiment: Experiment, cells: list[dict[str, Any]], out: Path,
            target: float | None) -> list[str]:
    """One figure per group, ``<group>.png`` in ``out``: test accuracy against rounds of each
    cell at its chosen learning rate (the paper's Figure 2); returns the file names."""
    plt = pyplot()

    names = []
    for group in dict.fromkeys(c["group"] for c in cells):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        members = [c for c in cells if c["group"] == group]
        group_target = members[0].get("target_accuracy", target)  # a cell may set its own
        accs = []
        for c in members:
            label = (f"{c['method']} E={c['local_epochs']} B={c['batch_size']} "
                     f"lr={c['lr']:g}")
            if not experiment.columns:
                label = f"{c['method']} ({c['lr_key']}={c['lr']:g})"
            ax.plot(c["curve"]["round"], c["curve"]["test_accuracy"], label=label,
                    linewidth=1.2)
            accs += c["curve"]["test_accuracy"]
        if group_target is not None:
            ax.axhline(group_target, color="gray", linestyle="--", linewidth=0.8)
        if accs:
            lo = sorted(accs)[len(accs) // 20]
            top = min(1.0, max(accs) + 0.02)
            ax.set_ylim(max(0.0, min(lo, (group_target or top) - 0.05)), top)
        ax.set_xlabel("communication rounds")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"{experiment.title}: {group}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in group) + ".png"
        save_png(fig, out / name)
        names.append(name)
    return names


def write_report(experiment: Experiment, results: dict[str, Any], out: Path) -> str:
    """Writes ``out/report.md`` of a table experiment: the header, our numbers beside the
    paper's, the learning-rate grids, the notes and the figures; returns its text."""
    cells = results["cells"]
    target = results["target_accuracy"]
    lines = [
        f"# {experiment.title}",
        "",
        f"Paper: {experiment.paper}.",
        "",
        f"Command: `{results['command']}` ({'quick subset' if results['quick'] else 'full'}"
        f"), {results['wall_time_s'] / 60:.1f} min on {results['machine']['cpus']} CPU cores "
        f"({results['machine']['backend']}, JAX {results['machine']['jax']}), "
        f"{'written' if results.get('in_progress') else 'finished'} {results['finished']}.",
        "",
    ]
    if results.get("in_progress"):
        lines += [
            "**In progress.** Cells marked *in progress* are unfinished runs, read from their "
            "newest checkpoints (`--report-only`); the command above continues them and "
            "rewrites this report when they finish.",
            "",
        ]
    if experiment.metric == "rounds_to_target":
        several = len({c.get("target_accuracy", target) for c in cells}) > 1
        goal = "each cell's target" if several else f"{target:.0%}"
        lines += [
            f"Rounds to {goal} test accuracy (best-so-far curve, linear interpolation; "
            "— = not reached within the cap). Speedup = the group's FedSGD rounds / the "
            "cell's rounds (≥ when FedSGD missed within its cap, or so far).",
            "",
        ]
        header = ["method"] + [_COLUMN_NAMES.get(c, c) for c in experiment.columns] + [
            "group", "lr", "rounds (fedax)", "rounds (paper)", "speedup (fedax)",
            "speedup (paper)", "best acc", "vs paper", "wall s"]
    else:
        lines += [
            f"Mean test accuracy over the last {experiment.last_k} evaluations (higher is "
            "better); the learning rate is the grid value with the best such mean.",
            "",
        ]
        header = ["method"] + [_COLUMN_NAMES.get(c, c) for c in experiment.columns] + [
            "group", "lr", f"last-{experiment.last_k} acc", "best acc", "paper",
            "rounds", "wall s"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in cells:
        cols = [_fmt_column(c["config"].get(k, c.get(k))) for k in experiment.columns]
        lr = (f"{c['lr']:g}" + (" (edge)" if c["lr_at_grid_edge"] else "")
              + (" *in progress*" if c.get("in_progress") else ""))
        if experiment.metric == "rounds_to_target":
            speed = c["speedup"]
            speed_s = "—" if speed is None else (
                f"{'≥' if c['speedup_bound'] else ''}{speed:.1f}×")
            paper_speed = "—" if c["paper_speedup"] is None else f"{c['paper_speedup']:.1f}×"
            row = [c["method"], *cols, c["group"], lr, _fmt(c["rounds_to_target"]),
                   _fmt(c["paper"]), speed_s, paper_speed,
                   f"{c['best_test_accuracy']:.4f}", _ratio_check(c),
                   f"{c['wall_time_s']:.0f}"]
        else:
            row = [c["method"], *cols, c["group"], lr, f"{c['last_accuracy']:.4f}",
                   f"{c['best_test_accuracy']:.4f}", _fmt(c["paper"], 1),
                   str(c["rounds_run"]), f"{c['wall_time_s']:.0f}"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "(edge) = the chosen learning rate is at the edge of its grid.", ""]
    lines += ["## Learning-rate grids", ""]
    for c in cells:
        pts = ", ".join(
            f"{p['lr']:g} → "
            + (_fmt(p["rounds_to_target"]) if experiment.metric == "rounds_to_target"
               else f"{p['last_accuracy']:.4f}")
            + (f" (best acc {p['best_test_accuracy']:.4f})"
               if experiment.metric == "rounds_to_target" and p["rounds_to_target"] is None
               else "")
            + (f" (in progress, {p['rounds_run']} rounds)" if p.get("in_progress") else "")
            for p in c["grid"])
        lines.append(f"- {c['method']} {c['name']}: {c['lr_key']} ∈ {{{pts}}}"
                     + (f". {c['note']}" if c["note"] else ""))
    lines.append("")
    lines += notes_sections(experiment.notes,
                            experiment.quick_notes if results["quick"] else "")
    if experiment.full_time:
        lines += markdown_section("The full table", experiment.full_time)
    if experiment.extra_report is not None:
        lines += [experiment.extra_report(results, out), ""]
    lines += ["## Figures", ""]
    lines += [f"![{name}]({name})" for name in results["figures"]]
    return save_report(lines, out)


_COLUMN_NAMES = {"local_epochs": "E", "batch_size": "B", "target_accuracy": "target"}
