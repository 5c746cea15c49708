"""A run directory's outputs: strict JSON records and summaries, written atomically, and
the accuracy figures; which directories hold a run, and a finished run's summary."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedax.algorithms.records import dumps, strict_json
from fedax.io import append_line, read_json, read_jsonl, write_atomic, write_json
from fedax.simulation import (
    History,
)
from fedax.spec.config import (
    Config,
    config_to_dict,
    validate_config,
)

# A directory holding any of these holds a run (``checkpoints`` is a directory).
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "checkpoints")

def with_status(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` as strict JSON data with a ``status``: "diverged" when a value is not
    finite (it becomes null), else "ok" (a status already "diverged" stays so)."""
    clean, bad = strict_json(record)
    diverged = bad or record.get("status") == "diverged"
    return {**clean, "status": "diverged" if diverged else "ok"}


def accuracy_figure(curves: dict[str, History], target: float | None = None,
                    title: str | None = None):
    """The matplotlib figure of test accuracy against communication rounds, one line per
    run: every point shows (the y-axis runs from below the lowest point and the target up
    to 1), rounds are integers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4))
    lows = [] if target is None else [target]
    for label, history in curves.items():
        points = [(r["round"], r["test_accuracy"]) for r in history.records
                  if isinstance(r.get("test_accuracy"), (int, float))
                  and math.isfinite(r["test_accuracy"])]
        ax.plot([p[0] for p in points], [p[1] for p in points], label=label,
                marker="." if len(points) < 30 else None)
        lows += [p[1] for p in points]
    if target is not None:
        ax.axhline(target, color="gray", linestyle="--", linewidth=0.8, label=f"target {target}")
    ax.set_xlabel("communication rounds")
    ax.set_ylabel("test accuracy")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if lows:
        lo = min(lows)
        ax.set_ylim(max(0.0, lo - max(0.02, 0.05 * (1.0 - lo))), 1.0)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def client_distribution_figure(records: list[dict[str, Any]], target: float | None = None,
                               title: str | None = None):
    """The clients' test accuracy over rounds (``per_client_eval`` records): the median,
    the 25-75 and 10-90 percentile bands, the mean of the worst 10% of clients, and the
    global accuracy; every evaluation is a point, rounds are integers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = [r for r in records if all(isinstance(r.get(f"client_accuracy_{k}"), (int, float))
                                      for k in ("p10", "p25", "p50", "p75", "p90", "worst10"))]
    rounds = [r["round"] for r in rows]

    def column(key):
        return [r.get(key) if isinstance(r.get(key), (int, float)) else math.nan for r in rows]

    fig, ax = plt.subplots(figsize=(6.5, 5))
    ax.fill_between(rounds, column("client_accuracy_p10"), column("client_accuracy_p90"),
                    alpha=0.15, color="C0", label="clients, 10th-90th percentile")
    ax.fill_between(rounds, column("client_accuracy_p25"), column("client_accuracy_p75"),
                    alpha=0.3, color="C0", label="clients, 25th-75th percentile")
    marker = "." if len(rows) < 30 else None
    ax.plot(rounds, column("client_accuracy_p50"), color="C0", marker=marker,
            label="median client")
    ax.plot(rounds, column("client_accuracy_worst10"), color="C3", marker=marker,
            label="worst 10% of clients (mean)")
    ax.plot(rounds, column("test_accuracy"), color="k", linestyle="--", linewidth=1,
            label="global test accuracy")
    if target is not None:
        ax.axhline(target, color="gray", linestyle=":", linewidth=0.8, label=f"target {target}")
    ax.set_xlabel("communication rounds")
    ax.set_ylabel("test accuracy on the client's own data")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(max(0.0, min(column("client_accuracy_p10") + [1.0]) - 0.05), 1.0)
    ax.set_title(title or "per-client test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.tight_layout()
    return fig


def plot_client_distribution(records: list[dict[str, Any]], path: Path,
                             target: float | None = None, title: str | None = None) -> None:
    """Writes ``client_distribution_figure(records, target, title)`` as a PNG, atomically."""
    save_figure(client_distribution_figure(records, target, title), path)


def save_figure(fig, path: Path) -> None:
    """Writes a matplotlib figure as a PNG (120 dpi), atomically, and closes it."""
    import io

    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=120)
    finally:
        plt.close(fig)
    write_atomic(path, buffer.getvalue())


def plot_curves(curves: dict[str, History], path: Path, target: float | None = None,
                title: str | None = None) -> None:
    """Writes ``accuracy_figure(curves, target, title)`` as a PNG, atomically."""
    save_figure(accuracy_figure(curves, target, title), path)


class JsonlWriter:
    """Callback: append each evaluation record (as ``with_status``) to a JSON-lines file.

    Nothing is written until the run has a record: ``on_resume`` (a resumed run) rewrites
    the file with the checkpoint's records, else the first record replaces the file, after
    ``on_start()`` (e.g. removing a replaced run's stale outputs). ``records`` are the
    records so far, restored ones included."""

    def __init__(self, path: Path, on_start: Callable[[], None] | None = None):
        self.path = Path(path)
        self.on_start = on_start
        self.records: list[dict[str, Any]] = []
        self.started = False

    def start(self, first: str = "") -> None:
        """Begin the file (once): ``on_start()``, then the file holds ``first`` only."""
        if not self.started:
            if self.on_start is not None:
                self.on_start()
            write_atomic(self.path, first)
            self.started = True

    def __call__(self, record: dict[str, Any]) -> None:
        line = dumps(with_status(record))
        if not self.started:
            self.start(line + "\n")
        else:
            append_line(self.path, line)
        self.records.append(record)

    def on_resume(self, records: list[dict[str, Any]]) -> None:
        """Rewrite the file with the checkpoint's records (drops rounds to be recomputed)."""
        write_atomic(self.path, "".join(dumps(with_status(r)) + "\n" for r in records))
        self.records = list(records)
        self.started = True


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` holds a run's outputs (metrics, summary or checkpoints)."""
    return any((Path(path) / name).exists() for name in RUN_OUTPUTS)


def new_run_dir(parent: Path, name: str, now: float | None = None) -> Path:
    """Creates and returns ``parent/<name>-<YYYYmmdd-HHMMSS>``, or with a suffix ``-2``,
    ``-3``, ... when that is taken (by another run, even one starting at the same time)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    Path(parent).mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        path = Path(parent) / (f"{name}-{stamp}" + (f"-{n}" if n > 1 else ""))
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free run directory name for {name}-{stamp} in {parent}")


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (a torn last line is skipped)."""
    return read_jsonl(path)


def finished_summary(out: Path, config: Config) -> dict[str, Any] | None:
    """The summary of the finished run of ``config`` in ``out`` (its ``summary.json`` holds
    the same config, keys added since at their defaults aside, and its records are there),
    else None."""
    try:
        summary = read_json(Path(out) / "summary.json")
        saved = config_to_dict(validate_config(summary["config"]))
    except (OSError, ValueError, KeyError, TypeError):  # ConfigError is a ValueError
        return None
    if saved != config_to_dict(config) or not (Path(out) / "metrics.jsonl").is_file():
        return None
    return summary


def write_outputs(out: Path, summary: dict[str, Any], records: list[dict[str, Any]],
                  label: str, title: str) -> None:
    """``summary.json`` (strict JSON, a non-finite value null and the status "diverged")
    and ``accuracy.png``, each written atomically."""
    clean, bad = strict_json(summary)
    if bad:
        clean["status"] = "diverged"
    write_json(out / "summary.json", clean)
    if records:
        plot_curves({label: History(list(records))}, out / "accuracy.png",
                    summary["target_accuracy"], title=title)
    if any("client_accuracy_p10" in r for r in records):
        plot_client_distribution(records, out / "client_accuracy.png",
                                 summary["target_accuracy"], title=f"{title}: per client")


def fmt_rounds(value: float | None) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.0f}"
