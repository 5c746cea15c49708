"""``fedax reproduce NAME``: one engine for every paper file.

It reads the paper (:mod:`fedax.reproduce.paper`), runs it (a table's cells with their
learning-rate grids, :mod:`table`; a list of named runs, :mod:`sweep`; or the paper's hook,
whose ``settings(paper, settings)``, when it has one, first completes the subset's settings),
derives the values its file names, checks its claims, draws its figures and writes
``results.json`` and ``report.md`` into the output directory. Runs are reused and resumed,
so the command picks up where it stopped; ``report_only`` runs nothing and rewrites the
report from the runs in the directory (a table paper) or its ``results.json``.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from fedax.io import finite_json, write_json
from fedax.reproduce.claims import check_claims
from fedax.reproduce.expr import evaluate
from fedax.reproduce.paper import Paper, get_paper
from fedax.reproduce.report import draw_figures, figures, write_report
from fedax.reproduce.sweep import run_grids
from fedax.reproduce.table import run_table
from fedax.spec.config import ConfigError


def machine_info() -> dict[str, Any]:
    """The machine a report ran on (platform, Python, JAX, backend, devices, CPUs)."""
    import jax

    return {"platform": platform.platform(), "python": platform.python_version(),
            "jax": jax.__version__, "backend": jax.default_backend(),
            "devices": jax.device_count(), "cpus": os.cpu_count()}


def hook(paper: Paper) -> ModuleType | None:
    """The paper's hook module (``hooks/<name>.py``, or a dotted module path), if any."""
    if paper.hook is None:
        return None
    name = paper.hook if "." in paper.hook else f"fedax.reproduce.hooks.{paper.hook}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        raise ConfigError(f"paper {paper.name}: no hook module {name!r}") from None


def _body(paper: Paper, module: ModuleType | None, out: Path, *, quick: bool, progress: bool,
          log: Callable[[str], None], cells, lrs, report_only: bool) -> dict[str, Any]:
    if paper.kind == "table":
        return run_table(paper, out, quick=quick, progress=progress, log=log, cells=cells,
                         lrs=lrs, report_only=report_only)
    settings = paper.subset(quick)
    if module is not None and hasattr(module, "settings"):  # values computed before the runs
        settings = module.settings(paper, settings)
    if module is not None and hasattr(module, "run"):
        return module.run(paper, settings, out, progress=progress, log=log)
    started = time.perf_counter()
    rows = run_grids(paper, settings, out, progress=progress, log=log)
    return {"settings": settings, "runs": rows,
            "wall_time_s": round(time.perf_counter() - started, 1)}


def finish(paper: Paper, results: dict[str, Any], out: Path,
           module: ModuleType | None = None) -> dict[str, Any]:
    """Derives the paper's values, checks its claims, draws its figures and writes
    ``results.json`` and ``report.md``; returns the results."""
    if module is not None and hasattr(module, "derive"):
        results.update(module.derive(paper, results))
    for key, text in paper.derive.items():
        results[key] = evaluate(text, results)
    if paper.claims:
        results["claims"] = check_claims(paper.claims, results, paper.sources)
    if paper.kind == "table":
        results["figures"] = figures(paper, results["cells"], out, results["target_accuracy"])
    else:
        drawn = (module.figures(paper, results, out)
                 if module is not None and hasattr(module, "figures") else [])
        results["figures"] = drawn + draw_figures(paper, results, out)
    results = finite_json(results)[0]  # NaN and inf are stored (and reported) as null
    write_json(out / "results.json", results, indent=1)
    write_report(paper, results, out)
    return results


def reproduce(name: str | os.PathLike[str] | Paper, out_dir: str | os.PathLike[str], *,
              quick: bool = False, progress: bool = True, command: str | None = None,
              log: Callable[[str], None] = print, cells: Sequence[str] | None = None,
              lrs: Sequence[float] | None = None, report_only: bool = False) -> dict[str, Any]:
    """Runs the paper ``name`` (a shipped name, a paper file, or a :class:`Paper`; its
    ``quick`` subset with ``quick``) into ``out_dir`` and writes its report. ``cells`` and
    ``lrs`` choose a table's cells and replace their grids; ``report_only`` runs nothing."""
    paper = name if isinstance(name, Paper) else get_paper(name)
    if paper.kind != "table" and (cells is not None or lrs is not None):
        raise ConfigError(f"experiment {paper.name} is not a table of cells: --cells and "
                          "--lrs apply to table papers only (see --list)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    module = hook(paper)
    saved = out / "results.json"
    # Results written before fedax.io may hold NaN, which strict JSON refuses.
    stored = json.loads(saved.read_text()) if saved.exists() else None
    from_runs = paper.kind == "table" and ((out / "runs").exists() or stored is None)
    if report_only and not from_runs:
        if stored is None:
            raise ConfigError(f"{out} holds no results.json of {paper.name}: nothing to "
                              "report (run the command without --report-only first)")
        return finish(paper, stored, out, module)
    started = time.perf_counter()
    body = _body(paper, module, out, quick=quick, progress=progress, log=log, cells=cells,
                 lrs=lrs, report_only=report_only)
    kept = stored if report_only and stored else {}
    results = {
        "experiment": paper.name, "title": paper.title, "paper": paper.paper,
        "source": dict(paper.source), "quick": quick,
        "command": kept.get("command") or command
        or f"fedax reproduce {paper.name}" + " --quick" * quick,
        "machine": kept.get("machine") or machine_info(),
        "finished": kept.get("finished") or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        **body,
    }
    results.setdefault("wall_time_s", round(time.perf_counter() - started, 1))
    results["this_invocation_s"] = round(time.perf_counter() - started, 1)
    return finish(paper, results, out, module)
