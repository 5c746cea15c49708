"""A paper as data: ``papers/<name>.yaml`` read into a :class:`Paper`.

A paper file names its source (``source``: title, arXiv id, the table or figure), the base
config every run starts from, and what runs: ``kind: table`` is a table of :class:`Cell` s
(``cells``, ``quick``: one row each, a method with its config, its learning-rate grid and
the paper's number; the best learning rate per cell is chosen); ``kind: runs`` is a list of
named runs expanded from grids (``runs``, :mod:`fedax.reproduce.sweep`) under the subset's
``settings``; a ``hook`` (a module of :mod:`fedax.reproduce.hooks`, or a dotted path) carries
what a paper needs beyond that (its own runs, derived values, figures). ``claims`` are the
paper's statements as data (:mod:`fedax.reproduce.claims`), ``derive`` names values computed
from the results (expressions, in order), ``report`` the sections of its ``report.md``
(:mod:`fedax.reproduce.report`), and ``notes``/``quick_notes``/``full_time``
its prose. Unknown keys are refused, one line naming the file and the key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedax.spec.config import ConfigError

PAPERS_DIR = Path(__file__).parent / "papers"


@dataclass(frozen=True)
class Cell:
    """One row of a paper's table: a method (``method``, in the column ``group``) with the
    config keys it sets over the base (``config``), the learning rates tried (``lrs``, set at
    ``lr_key``; the best is chosen), the paper's number (``paper``), whether it is the group's
    baseline that speedups are measured against, and a note shown beside it."""

    name: str
    method: str
    group: str
    config: Mapping[str, Any]
    lrs: Sequence[float]
    paper: float | None = None
    baseline: bool = False
    lr_key: str = "client_lr"
    note: str = ""


@dataclass(frozen=True)
class Paper:
    """A reproduction read from a paper file (see the module's docstring)."""

    name: str
    title: str
    paper: str
    kind: str
    base: Mapping[str, Any]
    source: Mapping[str, Any] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)
    cells: Sequence[Cell] = ()
    quick: Sequence[Cell] = ()
    settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    runs: Sequence[Mapping[str, Any]] = ()
    metric: str = "rounds_to_target"
    last_k: int = 10
    columns: Sequence[str] = ("local_epochs", "batch_size")
    hook: str | None = None
    tensorboard: bool = True
    derive: Mapping[str, str] = field(default_factory=dict)
    claims: Sequence[Mapping[str, Any]] = ()
    report: Sequence[Any] = ()
    figures: Sequence[Mapping[str, str]] = ()
    notes: str = ""
    quick_notes: str = ""
    full_time: str = ""
    description: Mapping[str, str] = field(default_factory=dict)
    path: Path | None = None

    def table_cells(self, quick: bool) -> Sequence[Cell]:
        return self.quick if quick else self.cells

    def subset(self, quick: bool) -> dict[str, Any]:
        """The ``settings`` of the quick or the full subset (``common`` keys under both)."""
        return {**self.settings.get("common", {}),
                **self.settings.get("quick" if quick else "full", {})}


_KINDS = ("table", "runs")
_METRICS = ("rounds_to_target", "last_accuracy")
_CELL_KEYS = {f for f in Cell.__dataclass_fields__}
_KEYS = {f for f in Paper.__dataclass_fields__} - {"path"}
_REQUIRED = ("name", "title", "paper", "kind", "base")


def _cell(where: str, raw: Any) -> Cell:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: a cell is a mapping, got {raw!r}")
    unknown = sorted(set(raw) - _CELL_KEYS)
    missing = [k for k in ("name", "method", "group", "config", "lrs") if k not in raw]
    if unknown or missing:
        raise ConfigError(f"{where}: cell {raw.get('name', '?')!r}: "
                          + (f"unknown keys {unknown} (known: {sorted(_CELL_KEYS)})"
                             if unknown else f"missing {missing}"))
    lrs = raw["lrs"]
    if (not isinstance(lrs, Sequence) or not lrs
            or any(not isinstance(x, (int, float)) or not x > 0 for x in lrs)):
        raise ConfigError(f"{where}: cell {raw['name']!r}: lrs must be a list of positive "
                          f"numbers, got {lrs!r}")
    return Cell(**{**raw, "lrs": tuple(float(x) for x in lrs)})


def parse_paper(data: Any, path: Path | None = None) -> Paper:
    """A :class:`Paper` from a paper file's parsed YAML (``path`` names it in errors)."""
    where = str(path) if path else "paper"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: a paper file is a YAML mapping")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: "
                          f"{', '.join(sorted(_KEYS))})")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}")
    if data["kind"] not in _KINDS:
        raise ConfigError(f"{where}: kind must be one of {', '.join(_KINDS)}, got "
                          f"{data['kind']!r}")
    if data.get("metric", "rounds_to_target") not in _METRICS:
        raise ConfigError(f"{where}: metric must be one of {', '.join(_METRICS)}")
    fields = dict(data)
    for key in ("cells", "quick"):
        fields[key] = tuple(_cell(f"{where} {key}", c) for c in data.get(key) or ())
    if data["kind"] == "table" and not fields["cells"]:
        raise ConfigError(f"{where}: a table paper needs cells")
    if data["kind"] == "runs" and not (data.get("runs") or data.get("hook")):
        raise ConfigError(f"{where}: a runs paper needs runs or a hook")
    if "columns" in fields:
        fields["columns"] = tuple(fields["columns"])
    return Paper(**fields, path=path)


def load_paper(path: str | os.PathLike[str]) -> Paper:
    """The paper file at ``path`` (a ConfigError names the file when it is not one)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read paper file {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {str(err).splitlines()[0]}") from None
    return parse_paper(data, path)


def paper_files() -> dict[str, Path]:
    """The papers fedax ships: name → file."""
    return {p.stem: p for p in sorted(PAPERS_DIR.glob("*.yaml"))}


def get_paper(name: str | os.PathLike[str]) -> Paper:
    """A shipped paper by name, or any paper file by its path (``*.yaml``)."""
    if str(name).endswith((".yaml", ".yml")):
        return load_paper(name)
    files = paper_files()
    if str(name) not in files:
        raise KeyError(f"unknown experiment {name!r}; available: {', '.join(sorted(files))}")
    return load_paper(files[str(name)])
