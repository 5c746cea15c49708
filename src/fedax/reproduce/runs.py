"""One run of a paper: its config (the paper's base with a cell's keys), reused when its
directory holds a finished run of the same config, resumed from its newest checkpoint when it
holds an unfinished one (bit-identical to an uninterrupted run), and read back as a summary
with its evaluation records; a run whose model diverged is a miss, not the end of a
reproduction.
"""

from __future__ import annotations

import functools
import json
import math
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedax.io import write_json
from fedax.reproduce.paper import Cell, Paper
from fedax.simulation.checkpoint import CheckpointError
from fedax.spec.config import Config, ConfigError, config_to_dict, validate_config


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(base))
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = json.loads(json.dumps(value)) if isinstance(value, Mapping) else value
    return out


def cell_config(paper: Paper, cell: Cell, lr: float) -> Config:
    """The config of one grid point: the base, the cell's keys, the learning rate."""
    over: Any = float(lr)
    for part in reversed(cell.lr_key.split(".")):  # "server.lr" -> {"server": {"lr": lr}}
        over = {part: over}
    data = _merge(_merge(paper.base, cell.config), over)
    try:
        return validate_config(data)
    except ConfigError as err:
        raise ConfigError(f"experiment {paper.name}, cell {cell.name}: {err}") from None


def lr_dirname(lr: float) -> str:
    return f"lr_{lr:.6g}"


# Config keys that do not change a run's numbers (how often it saves a checkpoint).
_NOT_THE_RUN = ("checkpoint_every",)


def same_config(saved: Any, wanted: dict[str, Any]) -> bool:
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


def _finished(paper: Paper, cell: Cell, lr: float, out: Path, rounds: int | None):
    """``(config, its dict, the finished run's summary with records or None)`` of a grid
    point (``rounds`` replacing the cell's cap when given)."""
    config = cell_config(paper, cell, lr)
    if rounds is not None:
        config = config.model_copy(update={"rounds": rounds})
    wanted = config_to_dict(config)
    summary_path = out / "summary.json"
    if summary_path.exists():
        done = json.loads(summary_path.read_text())
        if same_config(done.get("config"), wanted):
            return config, wanted, _with_records(paper, {**done, "reused": True}, out)
    return config, wanted, None


def run_one(
    paper: Paper, cell: Cell, lr: float, out: Path, *, progress: bool,
    rounds: int | None = None,
) -> dict[str, Any]:
    """Run (or reuse, or resume) one grid point; returns its summary with the records."""
    config, wanted, done = _finished(paper, cell, lr, out, rounds)
    if done is not None:
        return done
    if (out / "summary.json").exists():
        _set_aside(out)  # a finished run of another config: kept, and this one starts
    from fedax.experiments.run import run_experiment

    runner = functools.partial(run_experiment, tensorboard=paper.tensorboard)
    label = f"{cell.method} lr={lr:g}"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="resume: no checkpoint")
        try:
            summary = _diverged_as_miss(runner, config, out, wanted, progress, label)
        except CheckpointError:
            # Checkpoints of another config (e.g. the cell's rounds changed): start over.
            _set_aside(out)
            summary = _diverged_as_miss(runner, config, out, wanted, progress, label)
    return _with_records(paper, summary, out)


def _set_aside(out: Path) -> None:
    """Moves a run of another config to ``replaced/<name>-<time>`` beside it (not deleted)."""
    aside = out.parent / "replaced" / f"{out.name}-{time.strftime('%Y%m%dT%H%M%S')}"
    while aside.exists():
        aside = aside.with_name(aside.name + "+")
    aside.parent.mkdir(parents=True, exist_ok=True)
    out.rename(aside)


def _diverged_as_miss(runner, config, out, wanted, progress, label) -> dict[str, Any]:
    try:
        return runner(config, out, progress=progress, resume=True, label=label)
    except FloatingPointError:
        return _diverged_summary(config, out, wanted)


def _from_records(config: Config, wanted: dict[str, Any], records: list[dict[str, Any]],
                  rounds_run: int, wall: float, **extra: Any) -> dict[str, Any]:
    """A summary read off a run's evaluation records (a run that stopped without one)."""
    from fedax.simulation import rounds_to_target

    accs = [r["test_accuracy"] for r in records] or [0.0]
    target = config.target_accuracy
    reached = (rounds_to_target([r["round"] for r in records], accs, target)
               if records and target is not None else None)
    return {"config": wanted, "rounds_run": rounds_run, "final_test_accuracy": accs[-1],
            "best_test_accuracy": max(accs), "rounds_to_target": reached,
            "wall_time_s": wall, **extra}


def _diverged_summary(config: Config, out: Path, wanted: dict[str, Any]) -> dict[str, Any]:
    """A grid point whose model diverged (a learning rate too large) is a point that did not
    win, not the end of the reproduction: its summary is read from the records it left."""
    records = _read_records(out)
    last: dict[str, Any] = records[-1] if records else {"round": 0, "elapsed_s": 0.0}
    summary = _from_records(config, wanted, records, last["round"], last["elapsed_s"],
                            diverged=True)
    write_json(out / "summary.json", summary)
    return summary


def _read_records(out: Path) -> list[dict[str, Any]]:
    """The evaluation records a run left in ``out/metrics.jsonl``."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def _with_records(paper: Paper, summary: dict[str, Any], out: Path,
                  records: list[dict[str, Any]] | None = None) -> dict:
    """``summary`` with its evaluation records (``out``'s, unless given) and the mean
    accuracy of the last ``paper.last_k`` of them."""
    records = _read_records(out) if records is None else records
    summary = dict(summary)
    summary["records"] = records
    accs = [r["test_accuracy"] for r in records]
    k = min(paper.last_k, len(accs))
    summary["last_accuracy"] = sum(accs[-k:]) / k if k else float("nan")
    return summary


def progress_summary(paper: Paper, cell: Cell, lr: float, out: Path,
                     rounds: int | None = None) -> dict[str, Any] | None:
    """A grid point's summary without running anything: its finished run's, or where its
    unfinished run stands (``"in_progress": True``, from the newest checkpoint of this
    config); None when ``out`` holds neither."""
    from fedax.experiments.resume import run_progress

    config, wanted, done = _finished(paper, cell, lr, out, rounds)
    if done is not None:
        return done
    state = run_progress(config, out)
    if state is None or not state["records"]:
        return None
    records = state["records"]
    summary = _from_records(config, wanted, records, state["round"], state["elapsed_s"],
                            in_progress=True)
    return _with_records(paper, summary, out, records)


def run_config(paper: Paper, name: str, label: str, config: Mapping[str, Any], out: Path,
               *, progress: bool) -> dict[str, Any]:
    """Runs ``config`` over the paper's base at the base's client learning rate into ``out``
    (reused or resumed as :func:`run_one` does); ``name`` and ``label`` name it in messages."""
    lr = paper.base["client_lr"]
    cell = Cell(name=name, method=label, group="", config=config, lrs=(lr,))
    return run_one(paper, cell, lr, out, progress=progress)


def diverged(summary: Mapping[str, Any]) -> bool:
    """Whether a run stopped on a non-finite model or its last test accuracy is not finite."""
    final = summary.get("final_test_accuracy")
    return bool(summary.get("diverged")) or not (
        isinstance(final, (int, float)) and math.isfinite(final))
