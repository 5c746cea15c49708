"""Clients that stop by the EB criterion against clients that run a fixed E, in FedAvg.

MNIST 2NN, pathological non-IID (100 clients of two digits, 600 examples each), C = 0.1,
B = 10, E = 5 as the cap (300 local steps), client_lr 0.1; four runs of the same rounds
through ``fedax.experiments.run_experiment`` (per-client evaluation on): fixed E; EB
stopping in the paper's form (``client.stopping: eb``, threshold 0, checked every 10
steps); EB with fedax's small-batch calibration (``stopping_calibrated: true``), alone and
averaged over checks (``stopping_smoothing: 0.9``). It reports, per run, rounds to the
target test accuracy, the client steps spent in all and up to the target, the accuracy
(mean of the last five rounds, and best) and the worst decile of clients' accuracy, and
writes ``results.json``, ``table.md`` and ``federated.png`` (seed 0's curves) into
``--out``; the committed ``report.md`` reads them. Each setting runs with seeds 0, 1, ...
(``--seeds``; the seed draws the partition, the cohorts and the initial model).

Shakespeare is not part of it: its data set is not in this machine's cache and cannot be
fetched offline (``fedax data fetch shakespeare``); the report says so.

Usage: python experiments/early_stopping_federated.py [--rounds 40] [--target 0.85]
    [--every 10] [--seeds 2] [--out experiments/results/early-stopping-federated] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

from fedax.experiments.config import validate_config
from fedax.experiments.run import run_experiment

BASE = {"seed": 0, "dataset": "mnist", "num_clients": 100, "partition": "pathological",
        "model": "2nn", "algorithm": "fedavg", "client_fraction": 0.1, "local_epochs": 5,
        "batch_size": 10, "client_lr": 0.1, "per_client_eval": True,
        "execution": {"devices": 1}}
STEPS_PER_CLIENT = 5 * 60  # E = 5 epochs of 600 examples in batches of 10


def runs(every: int) -> dict[str, dict[str, Any]]:
    """The compared settings, by name: their ``client`` sections."""
    return {
        "fixed E=5": {},
        "EB (paper's form)": {"stopping": "eb", "stopping_every": every},
        "EB calibrated": {"stopping": "eb", "stopping_every": every,
                          "stopping_calibrated": True},
        "EB calibrated, β = 0.9": {"stopping": "eb", "stopping_every": every,
                                   "stopping_calibrated": True, "stopping_smoothing": 0.9},
    }


def steps_of(record: dict[str, Any], cohort: int) -> float:
    """The client steps of a record's round: the EB runs report them; a fixed-E client of
    600 examples takes 300."""
    return record.get("local_steps_total", STEPS_PER_CLIENT * cohort)


def summarize_run(name: str, summary: dict[str, Any], records: list[dict[str, Any]],
                  target: float, cohort: int) -> dict[str, Any]:
    steps = [steps_of(r, cohort) for r in records]
    cumulative = [sum(steps[:i + 1]) for i in range(len(steps))]
    reached = summary["rounds_to_target"]
    # the steps spent up to the first evaluated round at or past the target
    at = next((i for i, r in enumerate(records) if r["test_accuracy"] >= target), None)
    tail = records[-5:]  # the curves swing by a few points from round to round
    return {
        "run": name,
        "rounds_to_target": reached,
        "client_steps_total": cumulative[-1],
        "client_steps_to_target": None if at is None else cumulative[at],
        "final_test_accuracy": records[-1]["test_accuracy"],
        "last5_test_accuracy": sum(r["test_accuracy"] for r in tail) / len(tail),
        "best_test_accuracy": summary["best_test_accuracy"],
        "last5_worst10_client_accuracy": sum(r["client_accuracy_worst10"] for r in tail)
        / len(tail),
        "best_worst10_client_accuracy": max(r.get("client_accuracy_worst10", -1)
                                            for r in records),
        "mean_steps_per_client": cumulative[-1] / (cohort * len(records)),
        "stopped_early_mean": (sum(r.get("stopped_early", 0.0) for r in records)
                               / len(records)),
        "wall_time_s": summary["wall_time_s"],
        "curve": [{"round": r["round"], "test_accuracy": r["test_accuracy"],
                   "worst10": r.get("client_accuracy_worst10"), "client_steps": s,
                   "steps_min": r.get("local_steps_min"), "steps_max": r.get("local_steps_max")}
                  for r, s in zip(records, steps, strict=True)],
    }


def plot(results: list[dict[str, Any]], path: Path, target: float) -> None:
    """Seed 0's curves."""
    results = [r for r in results if r["seed"] == 0]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for res in results:
        curve = res["curve"]
        rounds = [c["round"] for c in curve]
        steps = [c["client_steps"] for c in curve]
        cumulative = [sum(steps[:i + 1]) for i in range(len(steps))]
        axes[0].plot(rounds, [c["test_accuracy"] for c in curve], label=res["run"])
        axes[1].plot(cumulative, [c["test_accuracy"] for c in curve], label=res["run"])
        axes[2].plot(rounds, [c["worst10"] for c in curve], label=res["run"])
    for ax in axes[:2]:
        ax.axhline(target, color="gray", lw=0.8, ls="--")
    axes[0].set(xlabel="round", ylabel="test accuracy", title="accuracy by round")
    axes[1].set(xlabel="client steps (cumulative)", ylabel="test accuracy",
                title="accuracy by client compute")
    axes[2].set(xlabel="round", ylabel="worst-10% client accuracy",
                title="worst decile of clients")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("FedAvg, MNIST 2NN pathological non-IID, E = 5 cap: fixed E vs EB stopping")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if isinstance(value, float) and digits == 0:
        return f"{value:,.0f}"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def table(results: list[dict[str, Any]], target: float) -> list[str]:
    """One row per run and seed, then the mean over seeds of each run."""
    head = (f"| run | seed | rounds to {target:.0%} | client steps to {target:.0%} | client "
            "steps, all rounds | steps a client a round | share stopped early | acc, last 5 "
            "rounds | best acc | worst-10% clients, last 5 | worst-10%, best | wall s |")
    rows = [head, "|" + "---|" * 12]
    names = list(dict.fromkeys(r["run"] for r in results))
    seeds = sorted({r["seed"] for r in results})

    def cells(r, seed):
        return [r["run"], seed, fmt(r["rounds_to_target"], 1),
                fmt(r["client_steps_to_target"], 0), fmt(r["client_steps_total"], 0),
                fmt(r["mean_steps_per_client"], 1), fmt(r["stopped_early_mean"], 2),
                fmt(r["last5_test_accuracy"]), fmt(r["best_test_accuracy"]),
                fmt(r["last5_worst10_client_accuracy"], 3),
                fmt(r["best_worst10_client_accuracy"], 3), fmt(r["wall_time_s"], 0)]

    for r in results:
        rows.append("| " + " | ".join(map(str, cells(r, r["seed"]))) + " |")
    if len(seeds) > 1:
        for name in names:
            group = [r for r in results if r["run"] == name]
            mean = {k: (None if any(g[k] is None for g in group)
                        else sum(g[k] for g in group) / len(group))
                    for k in group[0] if isinstance(group[0][k], (int, float, type(None)))
                    and k != "seed"}
            rows.append("| " + " | ".join(map(str, cells({**mean, "run": f"**{name}**"},
                                                        "mean"))) + " |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--out", default="experiments/results/early-stopping-federated")
    parser.add_argument("--work", default=None, help="where the runs go (default: a "
                        "temporary directory; only the report is kept)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="eb-federated-"))
    cohort = round(BASE["client_fraction"] * BASE["num_clients"])
    started = time.time()
    results = []
    for seed in range(args.seeds):
        for i, (name, client) in enumerate(runs(args.every).items()):
            config = validate_config({**BASE, "seed": seed, "rounds": args.rounds,
                                      "target_accuracy": args.target,
                                      **({"client": client} if client else {})})
            run_dir = work / f"seed{seed}-run{i}"
            summary = run_experiment(config, run_dir, progress=False, tensorboard=False)
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text()
                       .splitlines()]
            results.append({**summarize_run(name, summary, records, args.target, cohort),
                            "seed": seed})
            print(f"seed {seed}, {name}: {results[-1]['last5_test_accuracy']:.4f} in "
                  f"{summary['wall_time_s']:.0f} s", flush=True)
    plot(results, out / "federated.png", args.target)
    meta = {"experiment": "early-stopping-federated", "base_config": BASE,
            "rounds": args.rounds, "target_accuracy": args.target, "every": args.every,
            "command": "python experiments/early_stopping_federated.py "
                       f"--rounds {args.rounds} --target {args.target} --every {args.every} "
                       f"--seeds {args.seeds}",
            "wall_time_s": round(time.time() - started, 1),
            "machine": f"{platform.machine()}, {jax.default_backend()}, JAX {jax.__version__}"}
    (out / "results.json").write_text(json.dumps({**meta, "runs": results}, indent=1) + "\n")
    rows = table(results, args.target)
    (out / "table.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
