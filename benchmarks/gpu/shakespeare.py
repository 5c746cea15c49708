"""Shakespeare's FedAvg and FedSGD cells (``fedax reproduce fedavg-shakespeare``), continued
for as long as a time budget allows; one JSON rewritten after every round.

    python benchmarks/gpu/shakespeare.py --work /tmp/w --budget 150 --json shakespeare.json
    python benchmarks/gpu/shakespeare.py --smoke --work /tmp/w --json shakespeare.json

For each cell of ``--cells`` (default: ``fedavg-e5-b10-natural``, then
``fedsgd-e1-binf-natural``; ``fedavg-e5-b10-natural-line`` can be added) at lr 1.47 (the
paper's Figure 3 rate, that of the committed runs), in that order, each given an equal share
of the budget still left when it starts:

1. Its committed run, ``experiments/results/fedavg-shakespeare/runs/<cell>/lr_1.47``
   (``metrics.jsonl`` and the newest checkpoint), is copied into ``WORK/<cell>/lr_1.47``;
   nothing is ever written under ``experiments/``. A cell without a committed run (FedSGD's:
   none was run) starts from round 0 there.
2. The committed checkpoints were written on a 2-core CPU by ``sequential:scan:2``, by a
   fedax whose clients still drew their batches from one cohort-wide stream (before each
   client had its own, ``shuffles: per-client``). fedax resumes a run only with the execution
   strategy, the initial model and the shuffle streams it started with (another strategy's
   rounds agree to float rounding, not bit for bit; an initial model made on another backend
   can differ in its last bits; other streams draw other batches), so it refuses these
   checkpoints on any machine. The copies are therefore *adopted*: their fingerprint's
   execution items (``execution.*``, ``config.execution.*``), ``init_params.sha256`` and
   ``shuffles`` are rewritten to this run's before it restores them; every other item (the
   training data's SHA-256, the config) must still match, or fedax refuses. The JSON lists
   every rewritten item. The continued rounds are a continuation of the committed model on
   other hardware with today's batch streams, not the bit-exact continuation a resume is.
3. The cell runs through ``fedax.experiments.run.run_experiment`` (as ``fedax reproduce``
   runs it; no TensorBoard files) with ``resume=True`` and a checkpoint after every round
   (``checkpoint_every`` is not part of a run's identity). Before building each round's
   cohort the driver checks the clock: when the next round (as long as the longest round
   after the first so far) would end past the cell's share, it stops the run there; every
   finished round is checkpointed by then.
4. A cell whose default execution runs out of device memory (FedSGD's full-batch clients,
   vmapped over 129 clients on a GPU) is run again with ``execution.strategy: sequential``
   (clients one after another), if time is left; the JSON keeps both attempts.

The JSON holds, per cell: the committed checkpoint's round, the round it resumed from, the
adoption, the execution, each round's seconds (the first includes compiling) and training
loss, the new evaluation records (test accuracy and loss every 5th round), and why it
stopped. ``--smoke``: a CPU check at toy sizes: each committed FedAvg checkpoint is copied,
adopted and restored on the full data with no round run, and FedSGD and FedAvg run 2 rounds
each from scratch on 10 roles, 2 clients a round, E = 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))
import common  # noqa: E402

PAPER = "fedavg-shakespeare"
COMMITTED = REPO / "experiments" / "results" / PAPER / "runs"
# The FedAvg cell furthest along (chunks, round 70) and FedSGD; `--cells` adds the line
# cell (fedavg-e5-b10-natural-line, round 40) where there is time for a third compilation.
CELLS = ("fedavg-e5-b10-natural", "fedsgd-e1-binf-natural")
LR = 1.47


class OutOfTime(Exception):
    """The cell's share of the budget would be exceeded by its next round."""


class CellRun:
    """One attempt at a cell: its clock, its rounds, its records; written out by ``save``."""

    def __init__(self, name: str, deadline: float, save):
        self.name = name
        self.deadline = deadline
        self.save = save
        self.info: dict[str, Any] = {"cell": name, "rounds": [], "new_records": []}
        self.run_started = time.perf_counter()
        self.last_settled: float | None = None
        self.first_round: int | None = None

    # fedax.simulation.run's round callback: after every round, with its metrics
    def on_round(self, number: int, metrics: dict[str, Any], data) -> None:
        now = time.perf_counter()
        since = self.last_settled if self.last_settled is not None else self.run_started
        self.last_settled = now
        loss = metrics.get("train_loss")
        self.info["rounds"].append({
            "round": int(number), "seconds": now - since,
            "train_loss": None if loss is None else float(loss),
            "clients": int(getattr(data, "real", 0) or 0) or None})
        self.save()

    # fedax.simulation.run's record callback: each evaluation record
    def on_record(self, record: dict[str, Any]) -> None:
        self.info["new_records"].append(
            {k: v for k, v in record.items() if isinstance(v, (int, float, str, type(None)))})
        self.save()

    def check_time(self, t: int) -> None:
        """Called before round ``t``'s cohort is built: stop if it would not fit."""
        if self.first_round is None:
            self.first_round = t
            self.info["resumed_from"] = t
            return
        # the longest round after the first (which includes compiling); none known yet: go
        # on while the share lasts (a round past it at most)
        estimate = max([r["seconds"] for r in self.info["rounds"][1:]], default=0.0)
        if time.perf_counter() + estimate > self.deadline:
            raise OutOfTime(f"round {t + 1} (about {estimate:.1f} s) would end past the "
                            "cell's share of the budget")


class DeadlineSource:
    """A cohort source that asks the clock before each round (delegates everything else)."""

    def __init__(self, source, cell: CellRun):
        self._source = source
        self._cell = cell

    def round_data(self, t, pad_to):
        self._cell.check_time(t)
        return self._source.round_data(t, pad_to)

    def __getattr__(self, name):
        return getattr(self._source, name)


def adopt_checkpoints(directory: Path, current: dict[str, Any]) -> list[dict[str, Any]]:
    """Rewrite the items of ``current`` (how the run executes: the execution strategy, the
    initial model's hash, the shuffle streams) into the fingerprint of every checkpoint in
    ``directory`` that differs in them; returns what changed, per file."""
    from fedax.checkpoint import read_file, write_file
    from fedax.simulation.checkpoint import list_checkpoints

    changed = []
    for _, path in list_checkpoints(directory):
        payload = read_file(path)
        fingerprint = payload["fingerprint"]
        diff = {k: {"was": fingerprint.get(k), "now": v} for k, v in current.items()
                if fingerprint.get(k) != v}
        if diff:
            fingerprint.update(current)
            write_file(path, payload)
            changed.append({"file": path.name, "round": int(payload["round"]), "items": diff})
    return changed


def patched_run(original, cell: CellRun):
    """``fedax.simulation.run`` as ``run_experiment`` calls it, with the clock's source, the
    cell's callbacks, and its checkpoints adopted to this machine's execution first."""

    def run(algorithm, init_params, source, evaluate, **kwargs):
        from fedax.simulation.checkpoint import tree_sha256
        from fedax.simulation.runner import flat_items

        execution = kwargs["execution"]
        current = {f"execution.{k}": v for k, v in execution._asdict().items()}
        current["init_params.sha256"] = tree_sha256(init_params)
        current.update((k, v) for k, v in flat_items(kwargs.get("fingerprint") or {}, "config.")
                       if k.startswith("config.execution."))
        shuffles = source.identity().get("shuffles")
        if shuffles is not None:
            current["shuffles"] = shuffles
        cell.info["execution"] = execution._asdict()
        if kwargs.get("resume") and kwargs.get("checkpoint_dir"):
            cell.info["adopted"] = adopt_checkpoints(Path(kwargs["checkpoint_dir"]), current)
        kwargs["round_callbacks"] = [*kwargs.get("round_callbacks", ()), cell.on_round]
        kwargs["callbacks"] = [*kwargs.get("callbacks", ()), cell.on_record]
        cell.run_started = time.perf_counter()
        cell.save()
        return original(algorithm, init_params, DeadlineSource(source, cell), evaluate,
                        **kwargs)

    return run


def committed_round(cell: str) -> int | None:
    from fedax.simulation.checkpoint import list_checkpoints

    found = list_checkpoints(COMMITTED / cell / lr_dir() / "checkpoints")
    return max(r for r, _ in found) if found else None


def lr_dir() -> str:
    from fedax.reproduce.runs import lr_dirname

    return lr_dirname(LR)


def cell_config(name: str, smoke: bool, fresh_smoke: bool, sequential: bool):
    """The cell's config at ``LR`` (a checkpoint after every round), with the smoke's toy
    sizes when ``fresh_smoke`` and clients one after another when ``sequential``."""
    from fedax.reproduce.paper import get_paper
    from fedax.reproduce.runs import cell_config as paper_cell_config
    from fedax.spec.config import config_to_dict, validate_config

    paper = get_paper(PAPER)
    cell = next((c for c in paper.cells if c.name == name), None)
    if cell is None:
        raise SystemExit(f"unknown cell {name!r}; cells: {', '.join(c.name for c in paper.cells)}")
    data = config_to_dict(paper_cell_config(paper, cell, LR))
    data["checkpoint_every"] = 1
    if fresh_smoke:
        data.update(rounds=2, eval_every=1, client_fraction=0.2, local_epochs=1)
        data["shakespeare"] = {**data["shakespeare"], "max_clients": 10}
    if sequential:
        data["execution"] = {**data["execution"], "strategy": "sequential"}
    return validate_config(data)


def run_cell(name: str, work: Path, deadline: float, smoke: bool, save_all, results: list,
             sequential: bool = False) -> dict[str, Any]:
    import fedax.experiments.run as experiment_run

    committed = committed_round(name)
    restore_only = smoke and committed is not None  # smoke: restore the committed run only
    fresh_smoke = smoke and committed is None
    cell = CellRun(name, deadline, save_all)
    results.append(cell.info)
    info = cell.info
    info.update(lr=LR, committed_checkpoint_round=committed, smoke=smoke,
                strategy="sequential" if sequential else "auto")
    out = work / (f"smoke-{name}" if fresh_smoke else name) / lr_dir()
    if out.exists():
        shutil.rmtree(out)
    if committed is not None:
        src = COMMITTED / name / lr_dir()
        shutil.copytree(src, out)
        info["copied_from"] = str(src.relative_to(REPO))
    out.mkdir(parents=True, exist_ok=True)
    info["run_dir"] = str(out)
    config = cell_config(name, smoke, fresh_smoke, sequential)
    if restore_only:
        config = config.model_copy(update={"rounds": committed})
    info["config"] = {k: v for k, v in config.model_dump(mode="json").items()
                      if k in ("algorithm", "partition", "local_epochs", "batch_size",
                               "client_fraction", "client_lr", "rounds", "eval_every",
                               "shakespeare", "execution", "seed")}
    original = experiment_run.run
    experiment_run.run = patched_run(original, cell)
    started = time.perf_counter()
    try:
        summary = experiment_run.run_experiment(config, out, progress=False, resume=True,
                                                tensorboard=False, label=name)
        info["status"] = "finished" if not restore_only else "restored (smoke: no round run)"
        info["resumed_from"] = summary.get("resumed_from_round", info.get("resumed_from"))
        info["final_record"] = summary.get("last_record")
    except OutOfTime as err:
        info["status"] = f"stopped at the time limit: {err}"
    except Exception as err:  # recorded, and the next cell still runs
        info["status"] = "error"
        info["error"] = f"{type(err).__name__}: {str(err)[:2000]}"
        info["traceback"] = traceback.format_exc()[-4000:]
    finally:
        experiment_run.run = original
    info["wall_s"] = time.perf_counter() - started
    if info.get("resumed_from") is None and committed is None and info["rounds"]:
        info["resumed_from"] = 0
    seconds = [r["seconds"] for r in info["rounds"]]
    info["rounds_run"] = len(seconds)
    info["last_round"] = info["rounds"][-1]["round"] if seconds else info.get("resumed_from")
    if seconds:
        info["first_round_s"] = seconds[0]  # includes compiling the round
    if len(seconds) > 1:
        rest = sorted(seconds[1:])
        info["s_per_round_median"] = rest[len(rest) // 2] if len(rest) % 2 else \
            (rest[len(rest) // 2 - 1] + rest[len(rest) // 2]) / 2
    save_all()
    if info["status"] == "error" and not sequential and out_of_memory_text(info) \
            and time.perf_counter() + 30 < deadline:
        info["retried_sequential"] = True
        return run_cell(name, work, deadline, smoke, save_all, results, sequential=True)
    return info


def out_of_memory_text(info: dict[str, Any]) -> bool:
    text = info.get("error", "")
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, help="where the cells' run directories go")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds for all cells")
    parser.add_argument("--cells", default=None, help="comma-separated cell names")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU")
    parser.add_argument("--json", required=True, help="the record, rewritten every round")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    deadline = started + args.budget
    cells = args.cells.split(",") if args.cells else list(CELLS)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    import jax

    results: list[dict[str, Any]] = []
    record: dict[str, Any] = {
        "part": "shakespeare", "paper": PAPER, "lr": LR, "budget_s": args.budget,
        "smoke": args.smoke, "cells": results, "device": common.jax_device_info(),
        "matmul_precision": str(jax.config.jax_default_matmul_precision),
        "versions": common.versions("jax", "jaxlib", "optax"), "date": common.now_iso(),
    }

    def save_all():
        record["wall_s"] = time.perf_counter() - started
        record["device_memory"] = common.jax_device_memory()
        common.write_json(args.json, record)

    save_all()
    for i, name in enumerate(cells):
        left = deadline - time.perf_counter()
        if left <= 0:
            results.append({"cell": name, "status": "not run: no time left"})
            continue
        share = left / (len(cells) - i)
        run_cell(name, work, time.perf_counter() + share, args.smoke, save_all, results)
        print(json.dumps({k: results[-1].get(k) for k in (
            "cell", "status", "resumed_from", "last_round", "rounds_run", "first_round_s",
            "s_per_round_median")}), flush=True)
    save_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
