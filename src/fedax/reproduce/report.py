"""A reproduction's ``report.md``, written from its results by the sections its paper file
lists (one report code for every paper), and the figures of a table paper.

``report`` in a paper file is a list of sections, each one of: ``header`` (title, source,
command, machine), ``{heading: title}``, ``{text: template}``, ``{bullets: {for, let,
text}}`` (one line per binding), ``{table: {rows, as, columns}}`` (a markdown table: one row
per item of the ``rows`` expression, bound to the names in ``as``; each column
``[header, template]`` or ``{for, header, value}`` for one column per binding; a third
item or ``align``: ``right`` or ``center``),
``{repeat: {for, let, sections}}`` (the ``sections`` once per binding), ``cells`` (a table
paper's table and learning-rate grids), ``claims``, ``notes`` and ``figures``. Templates
and expressions are :mod:`fedax.reproduce.expr`'s. Without ``report``, a table paper
writes header, cells, notes and figures, any other header, claims, notes and figures.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fedax.experiments.outputs import save_figure
from fedax.io import write_atomic
from fedax.reproduce.claims import bind, claim_lines, expand
from fedax.reproduce.expr import evaluate, fmt, render
from fedax.reproduce.paper import Paper


def _note(title: str, text: str) -> list[str]:
    return [f"## {title}", "", text.strip(), ""] if text.strip() else []


# ------------------------------------------------------------------- a table experiment


def _fmt_column(value: Any) -> str:
    """A config value in the table: floats as written (0.5, 0.001), not rounded."""
    if isinstance(value, float):
        return fmt(value, "g")
    return fmt(value)


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


def figures(paper: Paper, cells: list[dict[str, Any]], out: Path,
            target: float | None) -> list[str]:
    """One figure per group, ``<group>.png``: test accuracy against rounds of each cell at
    its chosen learning rate (the paper's Figure 2); returns the file names."""
    names = []
    for group in dict.fromkeys(c["group"] for c in cells):
        members = [c for c in cells if c["group"] == group]
        accs = [a for c in members for a in c["curve"]["test_accuracy"]] or [0.0]
        hline = members[0].get("target_accuracy", target)  # a cell may set its own
        top = min(1.0, max(accs) + 0.02)
        series = [{"label": f"{c['method']} E={c['local_epochs']} B={c['batch_size']} "
                            f"lr={c['lr']:g}" if paper.columns else
                            f"{c['method']} ({c['lr_key']}={c['lr']:g})",
                   "x": c["curve"]["round"], "y": c["curve"]["test_accuracy"], "marker": ""}
                  for c in members]
        name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in group) + ".png"
        draw(out / name, [{"title": f"{paper.title}: {group}", "series": series,
                           "hline": hline, "xlabel": "communication rounds",
                           "ylabel": "test accuracy",
                           "ylim": [max(0.0, min(sorted(accs)[len(accs) // 20],
                                                 (hline or top) - 0.05)), top]}])
        names.append(name)
    return names


def draw(path: Path, panels: list[dict[str, Any]]) -> None:
    """A figure of side-by-side panels, each ``{title, xlabel, ylabel, series: [{label, x,
    y}], hline, ylim, xscale, yscale}`` (all but ``series`` optional), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(min(4.8 * len(panels), 16), 3.6),
                             squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for s in panel["series"]:
            ys = [math.nan if y is None else y for y in s["y"]]
            ax.plot(s["x"], ys, marker=s.get("marker", "o"), markersize=3, linewidth=1.2,
                    label=s.get("label"))
        if panel.get("hline") is not None:
            ax.axhline(panel["hline"], color="gray", linestyle="--", linewidth=0.8)
        if panel.get("ylim"):
            ax.set_ylim(*panel["ylim"])
        ax.set_xscale(panel.get("xscale", "linear"))
        ax.set_yscale(panel.get("yscale", "linear"))
        ax.set_title(panel.get("title", ""), fontsize=9)
        ax.set_xlabel(panel.get("xlabel", ""))
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.grid(alpha=0.3)
        if any(s.get("label") for s in panel["series"]):
            ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def draw_figures(paper: Paper, results: dict[str, Any], out: Path) -> list[str]:
    """The figures a paper file lists (``figures: [{file, panels}]``: ``panels`` an
    expression giving :func:`draw`'s panels); returns the file names."""
    names = []
    for spec in paper.figures:
        draw(out / spec["file"], evaluate(spec["panels"], results))
        names.append(spec["file"])
    return names


def cells_section(paper: Paper, results: dict[str, Any]) -> list[str]:
    """A table paper's table (our numbers beside the paper's) and its learning-rate grids."""
    cells = results["cells"]
    target = results["target_accuracy"]
    lines: list[str] = []
    if paper.metric == "rounds_to_target":
        several = len({c.get("target_accuracy", target) for c in cells}) > 1
        goal = "each cell's target" if several else f"{target:.0%}"
        lines += [
            f"Rounds to {goal} test accuracy (best-so-far curve, linear interpolation; "
            "— = not reached within the cap). Speedup = the group's FedSGD rounds / the "
            "cell's rounds (≥ when FedSGD missed within its cap, or so far).",
            "",
        ]
        header = ["method"] + [_COLUMN_NAMES.get(c, c) for c in paper.columns] + [
            "group", "lr", "rounds (fedax)", "rounds (paper)", "speedup (fedax)",
            "speedup (paper)", "best acc", "vs paper", "wall s"]
    else:
        lines += [
            f"Mean test accuracy over the last {paper.last_k} evaluations (higher is "
            "better); the learning rate is the grid value with the best such mean.",
            "",
        ]
        header = ["method"] + [_COLUMN_NAMES.get(c, c) for c in paper.columns] + [
            "group", "lr", f"last-{paper.last_k} acc", "best acc", "paper",
            "rounds", "wall s"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in cells:
        cols = [_fmt_column(c["config"].get(k, c.get(k))) for k in paper.columns]
        lr = (f"{c['lr']:g}" + (" (edge)" if c["lr_at_grid_edge"] else "")
              + (" *in progress*" if c.get("in_progress") else ""))
        if paper.metric == "rounds_to_target":
            speed = c["speedup"]
            speed_s = "—" if speed is None else (
                f"{'≥' if c['speedup_bound'] else ''}{speed:.1f}×")
            paper_speed = "—" if c["paper_speedup"] is None else f"{c['paper_speedup']:.1f}×"
            row = [c["method"], *cols, c["group"], lr, fmt(c["rounds_to_target"], ".0f"),
                   fmt(c["paper"], ".0f"), speed_s, paper_speed,
                   f"{c['best_test_accuracy']:.4f}", _ratio_check(c),
                   f"{c['wall_time_s']:.0f}"]
        else:
            paper_value = fmt(c["paper"], ".1f" if isinstance(c["paper"], float) else "")
            row = [c["method"], *cols, c["group"], lr, f"{c['last_accuracy']:.4f}",
                   f"{c['best_test_accuracy']:.4f}", paper_value,
                   str(c["rounds_run"]), f"{c['wall_time_s']:.0f}"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "(edge) = the chosen learning rate is at the edge of its grid.", ""]
    lines += ["## Learning-rate grids", ""]
    for c in cells:
        pts = ", ".join(
            f"{p['lr']:g} → "
            + (fmt(p["rounds_to_target"], ".0f") if paper.metric == "rounds_to_target"
               else f"{p['last_accuracy']:.4f}")
            + (f" (best acc {p['best_test_accuracy']:.4f})"
               if paper.metric == "rounds_to_target" and p["rounds_to_target"] is None
               else "")
            + (f" (in progress, {p['rounds_run']} rounds)" if p.get("in_progress") else "")
            for p in c["grid"])
        lines.append(f"- {c['method']} {c['name']}: {c['lr_key']} ∈ {{{pts}}}"
                     + (f". {c['note']}" if c["note"] else ""))
    lines.append("")
    return lines


_COLUMN_NAMES = {"local_epochs": "E", "batch_size": "B", "target_accuracy": "target"}


def header_section(paper: Paper, results: dict[str, Any]) -> list[str]:
    """Title, source, the command and the machine it ran on."""
    machine = results.get("machine", {})
    wall = results.get("wall_time_s")
    took = f", {wall / 60:.1f} min" if isinstance(wall, (int, float)) else ""
    state = "written" if results.get("in_progress") else "finished"
    arxiv = f" (arXiv {paper.source['arxiv']})" if paper.source.get("arxiv") else ""
    lines = [f"# {paper.title}", "", f"Paper: {paper.paper}{arxiv}.", ""]
    lines += [
        f"Command: `{results['command']}` ({'quick subset' if results['quick'] else 'full'})"
        f"{took} on {machine.get('cpus', '?')} CPU cores ({machine.get('backend', '?')}, JAX "
        f"{machine.get('jax', '?')}), {state} {results.get('finished', '?')}.", ""]
    if results.get("in_progress"):
        lines += ["**In progress.** Cells marked *in progress* are unfinished runs, read from "
                  "their newest checkpoints (`--report-only`); the command above continues "
                  "them and rewrites this report when they finish.", ""]
    return lines


_RULES = {"left": "---", "right": "---:", "center": ":---:"}


def _columns(specs: list[Any], names: dict[str, Any]) -> list[tuple[str, str, dict, str]]:
    """``(header, value template, bindings, alignment)`` of each column of a table section
    (``[header, template]`` or ``[header, template, alignment]``; ``{for, header, value,
    align}``): the alignment is ``left`` (the default), ``right`` or ``center``."""
    columns: list[tuple[str, str, dict, str]] = []
    for spec in specs:
        if isinstance(spec, list):
            columns.append((render(spec[0], names), spec[1], {}, (spec[2:] or ["left"])[0]))
            continue
        for binding in expand(spec.get("for"), names):
            scope = {**names, **binding}
            columns.append((render(spec["header"], scope), spec["value"], binding,
                            spec.get("align", "left")))
    return columns


def table_lines(spec: dict[str, Any], names: dict[str, Any]) -> list[str]:
    """A markdown table (see the module's docstring)."""
    columns = _columns(spec["columns"], names)
    lines = ["| " + " | ".join(c[0] for c in columns) + " |",
             "|" + "".join(_RULES[c[3]] + "|" for c in columns)]
    unpack = spec.get("as", "row")
    for item in evaluate(spec["rows"], names):
        bound = (dict(zip(unpack, item, strict=True)) if isinstance(unpack, list)
                 else {unpack: item})
        scope = bind(spec.get("let"), {**names, **bound})
        lines.append("| " + " | ".join(render(value, {**scope, **binding})
                                        for _, value, binding, _ in columns) + " |")
    return lines


def _section(paper: Paper, section: Any, results: dict[str, Any]) -> list[str]:
    names = {**results, "paper": paper.__dict__}
    if section == "header":
        return header_section(paper, results)
    if section == "cells":
        return cells_section(paper, results)
    if section == "claims":
        return claim_lines(results.get("claims", [])) + [""]
    if section == "notes":
        return (_note("Notes", paper.notes)
                + _note("The quick subset", paper.quick_notes if results["quick"] else "")
                + _note("The full table", paper.full_time))
    if section == "figures":
        return ["## Figures", ""] + [f"![{n}]({n})" for n in results.get("figures", [])] + [""]
    (kind, value), = section.items()
    if kind == "heading":
        return [f"## {render(value, names)}", ""]
    if kind == "text":
        return [render(value.strip(), names), ""]
    if kind == "bullets":
        return [render(value["text"], bind(value.get("let"), {**names, **b}))
                for b in expand(value.get("for"), names)] + [""]
    if kind == "table":
        return table_lines(value, names) + [""]
    if kind == "repeat":
        return [line for b in expand(value.get("for"), names)
                for part in value["sections"]
                for line in _section(paper, part, bind(value.get("let"), {**results, **b}))]
    raise ValueError(f"paper {paper.name}: unknown report section {section!r}")


def write_report(paper: Paper, results: dict[str, Any], out: Path) -> str:
    """Writes ``out/report.md`` from the paper's ``report`` sections; returns its text."""
    default = (["header", "cells", "notes", "figures"] if paper.kind == "table"
               else ["header", "claims", "notes", "figures"])
    lines: list[str] = []
    for section in paper.report or default:
        lines += _section(paper, section, results)
    text = "\n".join(lines).rstrip("\n") + "\n"
    write_atomic(out / "report.md", text)
    return text
