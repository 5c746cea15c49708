"""A paper of named runs (``kind: runs``): grids of configs, each run reused or resumed, each
read back as one row.

``runs`` in a paper file is a list of grids::

    - name: "{aggregator}/{attack}-f{fmt(f, 'g')}"
      for: {aggregator: "settings.aggregators", attack: "settings.attacks",
            f: "settings.fractions"}
      config: {robust: "${aggregators[aggregator]}", attack: {kind: "${attack}"}}
      fields: [backdoor_success]      # last-record values copied into the row
      series: [clip_norm]             # every record's values: the row's series.clip_norm

A string ``"${expression}"`` anywhere in ``config`` (or in the paper's ``base``) is replaced
by the expression's value over the subset's ``settings`` (also bound by their own names)
and the grid's variables (a ``last_k`` setting replaces the paper's). Each run's row:
``run`` (its name), the final, best and last-``k`` test accuracy, ``rounds_to_target``,
``diverged``, ``wall_time_s``, ``reused``, the ``fields``, the ``curve`` ([round, test
accuracy] per evaluation) and, for a grid with ``series``, ``series`` (each key's value in
every record, aligned with the curve).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedax.reproduce.claims import expand
from fedax.reproduce.expr import evaluate, render
from fedax.reproduce.paper import Paper
from fedax.reproduce.runs import diverged, run_config


def substitute(node: Any, names: Mapping[str, Any]) -> Any:
    """``node`` with every ``"${expression}"`` string replaced by its value."""
    if isinstance(node, str) and node.startswith("${") and node.endswith("}"):
        return evaluate(node[2:-1], names)
    if isinstance(node, Mapping):
        return {k: substitute(v, names) for k, v in node.items()}
    if isinstance(node, list):
        return [substitute(v, names) for v in node]
    return node


def row(name: str, summary: Mapping[str, Any], fields: list[str],
        series: Sequence[str] = ()) -> dict[str, Any]:
    """A run's row (see the module's docstring)."""
    records = summary["records"]
    last = records[-1] if records else {}
    return {"run": name, "final_test_accuracy": summary.get("final_test_accuracy"),
            "best_test_accuracy": summary.get("best_test_accuracy"),
            "last_accuracy": summary.get("last_accuracy"),
            "rounds_to_target": summary.get("rounds_to_target"),
            **{f: last.get(f) for f in fields},
            "diverged": diverged(summary), "wall_time_s": summary.get("wall_time_s"),
            "reused": bool(summary.get("reused")),
            "curve": [[r["round"], r["test_accuracy"]] for r in records],
            **({"series": {k: [r.get(k) for r in records] for k in series}} if series else {})}


def run_grids(paper: Paper, settings: Mapping[str, Any], out: Path, *, progress: bool,
              log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every run of the paper's grids under ``settings``, in order, as rows."""
    names = {"settings": settings, **settings}
    base = substitute(dict(paper.base), names)
    bound = Paper(**{**paper.__dict__, "base": base,
                     "last_k": settings.get("last_k", paper.last_k)})
    rows = []
    for grid in paper.runs:
        for binding in expand(grid.get("for"), names):
            scope = {**names, **binding}
            name = render(grid["name"], scope)
            summary = run_config(bound, name, name, substitute(grid.get("config", {}), scope),
                                 out / "runs" / name, progress=progress)
            rows.append(row(name, summary, list(grid.get("fields", ())),
                            list(grid.get("series", ()))))
            r = rows[-1]
            log(f"   {name:<40} acc {r['final_test_accuracy'] or float('nan'):.4f}  "
                f"{r['wall_time_s'] or 0:.0f} s" + (" (reused)" if r["reused"] else ""))
    return rows
