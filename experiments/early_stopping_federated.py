"""Clients that stop by the EB criterion against clients that run a fixed E, in FedAvg.

``--dataset mnist`` (the default): MNIST 2NN, pathological non-IID (100 clients of two
digits, 600 examples each), C = 0.1, B = 10, E = 5 as the cap (300 local steps), client_lr
0.1. ``--dataset shakespeare``: the char-LSTM on a seeded subset of 30 speaking roles of
Shakespeare (``shakespeare.max_clients: 30``, one client per role, 20-character chunks),
C = 0.2 (6 clients a round), B = 10, E = 2 as the cap, client_lr 1.47 (McMahan et al.'s
Figure 3): a small budget that fits a 2-core CPU in minutes, far from the paper's 54%.

Runs of the same rounds through ``fedax.experiments.run_experiment`` (per-client
evaluation on): fixed E; EB stopping in the paper's form (``client.stopping: eb``,
threshold 0, checked every ``--every`` steps); EB with fedax's small-batch calibration
(``stopping_calibrated: true``), alone and (MNIST only) averaged over checks
(``stopping_smoothing: 0.9``). Shakespeare then evaluates the criterion at the fixed-E
run's initial and last models (``criterion_at``: how far its clients were from stopping,
and which parameters carry the sum). It reports, per run, rounds to the target test
accuracy, the client steps spent in all and up to the target, the accuracy (mean of the
last five rounds, and best) and the worst decile of clients' accuracy. MNIST writes
``results.json``, ``table.md`` and ``federated.png`` (seed 0's curves) into ``--out``;
Shakespeare writes ``table-shakespeare.md`` and ``federated-shakespeare.png`` and its part
of ``results.json`` (the key ``"shakespeare"``; each part keeps the other). The committed
``report.md`` reads them. Each setting runs with seeds 0, 1, ... (``--seeds``; the seed
draws the partition or the roles, the cohorts and the initial model).

Usage: python experiments/early_stopping_federated.py [--dataset mnist|shakespeare]
    [--rounds R] [--target ACC] [--every M] [--seeds S]
    [--out experiments/results/early-stopping-federated] [--work DIR]
(defaults per data set: MNIST --rounds 40 --target 0.85 --every 10 --seeds 2; Shakespeare
--rounds 40 --target 0.3 --every 2 --seeds 1)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

from fedax.experiments.run import run_experiment
from fedax.spec.config import validate_config

BASE = {"seed": 0, "dataset": "mnist", "num_clients": 100, "partition": "pathological",
        "model": "2nn", "algorithm": "fedavg", "client_fraction": 0.1, "local_epochs": 5,
        "batch_size": 10, "client_lr": 0.1, "per_client_eval": True,
        "execution": {"devices": 1}}
STEPS_PER_CLIENT = 5 * 60  # E = 5 epochs of 600 examples in batches of 10

# 30 roles of unequal size (seed 0: 2 to 997 chunks of 20 characters), 6 a round.
SHAKESPEARE_BASE = {"seed": 0, "dataset": "shakespeare", "num_clients": 30,
                    "partition": "natural", "model": "char_lstm", "algorithm": "fedavg",
                    "client_fraction": 0.2, "local_epochs": 2, "batch_size": 10,
                    "client_lr": 1.47, "per_client_eval": True,
                    "shakespeare": {"max_clients": 30, "seq_len": 20},
                    "execution": {"devices": 1}}

# dataset -> its base config, the defaults of its options, where its outputs go, its title.
SETTINGS: dict[str, dict[str, Any]] = {
    "mnist": {"base": BASE, "rounds": 40, "target": 0.85, "every": 10, "seeds": 2,
              "suffix": "", "title": "MNIST 2NN pathological non-IID", "runs": 4,
              "diagnose": False},
    # Three runs (no smoothing: at E = 2 and m = 2 most clients have one to three checks a
    # round, too few to average), then the criterion at the fixed-E run's last model.
    "shakespeare": {"base": SHAKESPEARE_BASE, "rounds": 40, "target": 0.3, "every": 2,
                    "seeds": 1, "suffix": "-shakespeare",
                    "title": "Shakespeare char-LSTM, 30 roles", "runs": 3, "diagnose": True},
}


def runs(every: int, epochs: int = 5, report_fixed: bool = False) -> dict[str, dict[str, Any]]:
    """The compared settings, by name: their ``client`` sections. ``report_fixed``: the
    fixed-E run carries a rule that is never checked (one group of all the steps) and never
    fires (threshold 1), so it is the plain run with each round's client steps reported
    (clients of unequal size take unequal steps)."""
    fixed = ({"stopping": "eb", "stopping_every": 10**9, "stopping_threshold": 1}
             if report_fixed else {})
    return {
        f"fixed E={epochs}": fixed,
        "EB (paper's form)": {"stopping": "eb", "stopping_every": every},
        "EB calibrated": {"stopping": "eb", "stopping_every": every,
                          "stopping_calibrated": True},
        "EB calibrated, β = 0.9": {"stopping": "eb", "stopping_every": every,
                                   "stopping_calibrated": True, "stopping_smoothing": 0.9},
    }


def steps_of(record: dict[str, Any], cohort: int) -> float:
    """The client steps of a record's round: the EB runs (and Shakespeare's fixed-E run)
    report them; a fixed-E MNIST client of 600 examples takes 300."""
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


def criterion_at(config: Any, run_dir: Path, batches_per_client: int = 5) -> dict[str, Any]:
    """The EB criterion (both forms) on each client's first ``batches_per_client`` batches
    of B (in data order) at the initial model and at the last checkpoint of ``run_dir`` (a
    run with ``checkpoint_every: rounds``): how far the clients were from stopping."""
    import jax.numpy as jnp
    import numpy as np

    from fedax.builder.datasets import build_data
    from fedax.client import Batches
    from fedax.client.early_stopping import (
        RELATIVE_SPREAD,
        eb_statistics,
        per_example_gradients,
    )
    from fedax.models import get_model
    from fedax.models.losses import token_cross_entropy
    from fedax.simulation.checkpoint import decode_state, list_checkpoints, read_checkpoint

    data = build_data(config)
    model = get_model(config.model, **data.model_kwargs)
    initial = jax.jit(model.init)(jax.random.key(config.seed))
    round_, path = list_checkpoints(run_dir / "checkpoints")[-1]
    prefix = ".server.params"
    final = decode_state([{**leaf, "path": leaf["path"][len(prefix):]}
                          for leaf in read_checkpoint(path)["state"]
                          if leaf["path"].startswith(prefix)], initial)

    def loss_fn(params, batch):
        return token_cross_entropy(model.apply(params, batch.x), batch.y, batch.mask)

    @jax.jit
    def both(params, batch):
        """c in both forms; per leaf, Σ_k B g_k²/Σ̂_k over its informative coordinates and
        their number; the median of B g_k²/Σ̂_k over all informative coordinates (about 1
        where the gradient is noise)."""
        grads = per_example_gradients(loss_fn, params, batch)
        real = batch.mask.astype(jnp.float32)
        count = jnp.sum(real)
        sums, kept, ratios = [], [], []
        for leaf in jax.tree.leaves(grads):
            g = leaf.reshape(leaf.shape[0], -1)
            mean = real @ g / count
            var = real @ jnp.square(g - mean) / (count - 1.0)
            keep = var > jnp.square(RELATIVE_SPREAD * mean)
            ratio = jnp.where(keep, count * jnp.square(mean) / jnp.where(keep, var, 1.0),
                              jnp.nan)
            sums.append(jnp.nansum(ratio))
            kept.append(jnp.sum(keep))
            ratios.append(ratio)
        return (eb_statistics(grads, batch.mask).value,
                eb_statistics(grads, batch.mask, calibrated=True).value,
                jnp.stack(sums), jnp.stack(kept), jnp.nanmedian(jnp.concatenate(ratios)))

    b = config.batch_size
    batches = []
    for k in range(len(data.train.offsets) - 1):
        own = data.train.indices[data.train.offsets[k]:data.train.offsets[k + 1]]
        for j in range(min(batches_per_client, -(-len(own) // b))):
            idx = own[j * b:(j + 1) * b]
            real = len(idx)
            if real < 4:  # too few for the calibrated form (the loop skips them too)
                continue
            pad = np.zeros(b - real, dtype=idx.dtype)
            batches.append(Batches(data.train.x[np.concatenate([idx, pad])],
                                   data.train.y[np.concatenate([idx, pad])],
                                   np.arange(b) < real))
    out: dict[str, Any] = {"round": round_, "batches": len(batches),
                           "batches_per_client": batches_per_client}
    names = [jax.tree_util.keystr(k) for k, _ in
             jax.tree_util.tree_flatten_with_path(initial)[0]]
    for name, params in (("initial", initial), ("final", final)):
        rows = [jax.device_get(both(params, batch)) for batch in batches]
        for j, form in enumerate(("paper", "calibrated")):
            c = np.array([float(r[j]) for r in rows])
            out[f"{name}_{form}"] = {"median": float(np.median(c)), "max": float(c.max()),
                                     "p90": float(np.quantile(c, 0.9)),
                                     "share_above_0": float((c > 0).mean())}
        sums = np.array([r[2] for r in rows], dtype=np.float64)
        shares = (sums / sums.sum(axis=1, keepdims=True)).mean(axis=0)
        kept = np.array([r[3] for r in rows], dtype=np.float64).mean(axis=0)
        out[f"{name}_by_leaf"] = {n: {"share_of_sum": round(float(sh), 4),
                                      "informative_coordinates": round(float(k))}
                                  for n, sh, k in zip(names, shares, kept, strict=True)}
        out[f"{name}_median_coordinate_ratio"] = float(np.median([float(r[4])
                                                                  for r in rows]))
    return out


def plot(results: list[dict[str, Any]], path: Path, target: float, title: str) -> None:
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
    fig.suptitle(title)
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
    parser.add_argument("--dataset", choices=sorted(SETTINGS), default="mnist")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--target", type=float, default=None)
    parser.add_argument("--every", type=int, default=None)
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--out", default="experiments/results/early-stopping-federated")
    parser.add_argument("--work", default=None, help="where the runs go (default: a "
                        "temporary directory; only the report is kept)")
    args = parser.parse_args()
    setting = SETTINGS[args.dataset]
    for key in ("rounds", "target", "every", "seeds"):
        if getattr(args, key) is None:
            setattr(args, key, setting[key])
    base, suffix = setting["base"], setting["suffix"]
    epochs = base["local_epochs"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="eb-federated-"))
    cohort = round(base["client_fraction"] * base["num_clients"])
    started = time.time()
    results = []
    if setting["diagnose"]:  # the last model of each run, for criterion_at
        base = {**base, "checkpoint_every": args.rounds}
    settings = dict(list(runs(args.every, epochs, report_fixed=args.dataset != "mnist")
                         .items())[:setting["runs"]])
    for seed in range(args.seeds):
        for i, (name, client) in enumerate(settings.items()):
            config = validate_config({**base, "seed": seed, "rounds": args.rounds,
                                      "target_accuracy": args.target,
                                      **({"client": client} if client else {})})
            run_dir = work / f"{args.dataset}-seed{seed}-run{i}"
            summary = run_experiment(config, run_dir, progress=False, tensorboard=False)
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text()
                       .splitlines()]
            results.append({**summarize_run(name, summary, records, args.target, cohort),
                            "seed": seed})
            print(f"seed {seed}, {name}: {results[-1]['last5_test_accuracy']:.4f} in "
                  f"{summary['wall_time_s']:.0f} s", flush=True)
    diagnostic = None
    if setting["diagnose"]:
        config = validate_config({**base, "rounds": args.rounds})
        diagnostic = criterion_at(config, work / f"{args.dataset}-seed0-run0")
        print("criterion at the fixed-E run's models:", json.dumps(diagnostic), flush=True)
    plot(results, out / f"federated{suffix}.png", args.target,
         f"FedAvg, {setting['title']}, E = {epochs} cap: fixed E vs EB stopping")
    command = ("python experiments/early_stopping_federated.py "
               + (f"--dataset {args.dataset} " if args.dataset != "mnist" else "")
               + f"--rounds {args.rounds} --target {args.target} --every {args.every} "
               f"--seeds {args.seeds}")
    meta = {"experiment": "early-stopping-federated", "dataset": args.dataset,
            "base_config": base, "rounds": args.rounds, "target_accuracy": args.target,
            "every": args.every, "command": command,
            "wall_time_s": round(time.time() - started, 1),
            "machine": f"{platform.machine()}, {jax.default_backend()}, JAX {jax.__version__}",
            "cpu_count": os.cpu_count()}
    # One results.json for both parts: MNIST at the top level (as first committed),
    # Shakespeare under "shakespeare"; writing one part keeps the other.
    path = out / "results.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    part = {**meta, "runs": results,
            **({"criterion_at_fixed_run": diagnostic} if diagnostic else {})}
    if args.dataset == "mnist":
        merged = {**part, **{k: v for k, v in previous.items() if k in SETTINGS
                             and k != "mnist"}}
    else:
        merged = {**previous, args.dataset: part}
    path.write_text(json.dumps(merged, indent=1) + "\n")
    rows = table(results, args.target)
    (out / f"table{suffix}.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    print(f"wall time {meta['wall_time_s']:.0f} s")


if __name__ == "__main__":
    main()
