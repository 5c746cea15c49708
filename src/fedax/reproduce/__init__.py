"""``fedax reproduce NAME``: the papers' experiments, run end to end, with a report.

Each paper is a YAML file of ``papers/`` (:mod:`fedax.reproduce.paper`); ``EXPERIMENTS``
maps each name to its :class:`Paper`, and ``reproduce(name, out_dir, quick=...)`` (the one
engine, :mod:`fedax.reproduce.engine`) runs it and writes ``results.json``, ``report.md``
and the figures. A paper file anywhere else runs the same way: ``reproduce("my.yaml", out)``.
"""

from __future__ import annotations

from fedax.reproduce.engine import machine_info, reproduce
from fedax.reproduce.paper import Cell, Paper, get_paper, load_paper, paper_files
from fedax.reproduce.runs import cell_config, run_config, run_one

EXPERIMENTS: dict[str, Paper] = {name: load_paper(path) for name, path in paper_files().items()}

__all__ = ["EXPERIMENTS", "Cell", "Paper", "cell_config", "get_paper",
           "load_paper", "machine_info", "paper_files", "reproduce", "run_config", "run_one"]
