"""FedAvg with a server learning rate learned by federated hypergradient descent, against
FedAvg with fixed server learning rates (the claim of Rush, Charles, Garrett, "Federated
Automatic Differentiation", JMLR 2024: the learned schedule recovers from poor starting
values and matches or beats the best fixed value).

Each round samples m training clients and, for the learned runs, m fresh holdout clients from
the same population; the hypergradient ∂(holdout loss after the round)/∂ log η is computed in
forward mode (the model's tangent rides along with it) and Adam updates log η.

Usage:
  python experiments/fad_server_lr.py --out experiments/results/fad-server-lr [--quick]
Writes results.json, report.md and accuracy.png / server_lr.png into --out.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedax import data as fdata
from fedax.algorithms import CohortBatches, fedavg
from fedax.client import Batches
from fedax.hyper import HyperCohort, learned_server_lr
from fedax.models import get_model, softmax_cross_entropy
from fedax.models.base import Model
from fedax.simulation import make_evaluator


def logistic_regression(dim: int, classes: int) -> Model:
    def init(key):
        return {"w": jnp.zeros((dim, classes)), "b": jnp.zeros(classes)}

    def apply(params, x):
        return x @ params["w"] + params["b"]

    return Model(init, apply)


def setup(name: str, seed: int):
    if name == "synthetic":
        train, test = fdata.synthetic(1.0, 1.0, num_clients=30, seed=seed)
        model = logistic_regression(train.x.shape[1], 10)
        return dict(train=train, x_test=test.x, y_test=test.y, model=model, fraction=0.34,
                    epochs=1, batch=50, client_lr=0.01)
    arrays = fdata.load_mnist()
    parts = fdata.pathological(arrays["y_train"], 100, 2, seed=seed)
    train = fdata.ClientData.from_partition(arrays["x_train"], arrays["y_train"], parts)
    return dict(train=train, x_test=arrays["x_test"], y_test=arrays["y_test"],
                model=get_model("2nn"), fraction=0.1, epochs=1, batch=10, client_lr=0.1)


def cohort_arrays(train, ids, epochs, batch, rng, steps) -> CohortBatches:
    c = fdata.make_cohort(train, ids, epochs, batch, rng, num_steps=steps)
    return CohortBatches(Batches(train.x[c.idx], train.y[c.idx].astype(np.int32), c.mask),
                         c.num_examples, c.client_ids)


def run_one(setting, label, server_lr, learned, rounds, seed, eval_every, hyper_lr):
    train, model = setting["train"], setting["model"]
    steps = fdata.num_local_steps(int(train.sizes.max()), setting["epochs"], setting["batch"])

    def loss_fn(params, batch):
        return softmax_cross_entropy(model.apply(params, batch.x), batch.y, batch.mask)

    def make(lr):
        return fedavg(loss_fn, optax.sgd(setting["client_lr"]), optax.sgd(lr))

    if learned:
        algorithm = learned_server_lr(make, server_lr, loss_fn, optax.adam(hyper_lr),
                                      mode="forward")
    else:
        algorithm = make(server_lr)
    evaluate = make_evaluator(model.apply, setting["x_test"], setting["y_test"])
    state = algorithm.init(model.init(jax.random.key(seed)), None)
    step = jax.jit(algorithm.round)
    records, start = [], time.perf_counter()
    for t in range(rounds):
        rng = np.random.default_rng([seed, t])  # the same training cohorts for every run
        ids = fdata.sample_clients(rng, train.num_clients, setting["fraction"])
        cohort = cohort_arrays(train, ids, setting["epochs"], setting["batch"], rng, steps)
        used_lr = server_lr
        if learned:
            hrng = np.random.default_rng([seed, t, 1])
            hold_ids = fdata.sample_clients(hrng, train.num_clients, setting["fraction"])
            holdout = cohort_arrays(train, hold_ids, 1, int(train.sizes.max()), hrng, 1)
            state, metrics = step(state, HyperCohort(cohort, holdout), None)
            used_lr = float(metrics["server_lr"])
        else:
            state, metrics = step(state, cohort, None)
        if (t + 1) % eval_every == 0 or t + 1 == rounds:
            acc, loss = evaluate(algorithm.server_params(state))
            records.append({"round": t + 1, "test_accuracy": acc, "test_loss": loss,
                            "server_lr": used_lr, "elapsed_s": time.perf_counter() - start})
    final = records[-1]
    tail = [r["test_accuracy"] for r in records[-max(1, len(records) // 5):]]
    print(f"{label:>28}: final acc {final['test_accuracy']:.4f}, mean of last 20% "
          f"{np.mean(tail):.4f}, server lr {final['server_lr']:.3g}, {final['elapsed_s']:.0f} s")
    return {"label": label, "learned": learned, "initial_server_lr": server_lr,
            "final_test_accuracy": final["test_accuracy"],
            "mean_test_accuracy_last_20pct": float(np.mean(tail)),
            "final_test_loss": final["test_loss"] if math.isfinite(final["test_loss"]) else None,
            "final_server_lr": final["server_lr"], "records": records}


def plot(results, out: Path, dataset: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        rounds = [x["round"] for x in r["records"]]
        style = "-" if r["learned"] else ":"
        ax1.plot(rounds, [x["test_accuracy"] for x in r["records"]], style, label=r["label"])
        ax2.plot(rounds, [x["server_lr"] for x in r["records"]], style, label=r["label"])
    ax1.set(xlabel="round", ylabel="test accuracy", title=f"{dataset}: FedAvg")
    ax2.set(xlabel="round", ylabel="server learning rate", yscale="log")
    ax1.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{dataset}.png", dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="experiments/results/fad-server-lr")
    parser.add_argument("--datasets", default="synthetic,mnist")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hyper-lr", type=float, default=0.1)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = ["# Learned server learning rate by federated hypergradient descent", "",
              "Command: `python experiments/fad_server_lr.py" + (" --quick" if args.quick else "")
              + f" --out {args.out}`", "",
              "FedAvg (client SGD, E = 1) with a fixed server learning rate η from a grid, "
              "against FedAvg whose η is learned online (forward-mode hypergradient of the "
              "loss of m fresh holdout clients after each round; Adam with step "
              f"{args.hyper_lr} on log η), started 10x below and 10x above η = 1.", ""]
    everything = {}
    for dataset in args.datasets.split(","):
        setting = setup(dataset, args.seed)
        rounds = {"synthetic": 150 if args.quick else 400, "mnist": 100 if args.quick else 300}
        rounds, every = rounds[dataset], 5
        print(f"== {dataset}: {rounds} rounds")
        results = []
        for lr in (0.1, 1.0, 3.0, 10.0):
            results.append(run_one(setting, f"fixed η={lr:g}", lr, False, rounds, args.seed,
                                   every, args.hyper_lr))
        for lr in (0.1, 10.0):
            results.append(run_one(setting, f"learned η, from {lr:g}", lr, True, rounds,
                                   args.seed, every, args.hyper_lr))
        plot(results, out, dataset)
        everything[dataset] = results
        fixed = [r for r in results if not r["learned"]]
        best = max(fixed, key=lambda r: r["mean_test_accuracy_last_20pct"])
        report += [f"## {dataset} ({rounds} rounds)", "",
                   "| run | final accuracy | mean accuracy, last 20% of rounds | final η |",
                   "|---|---|---|---|"]
        for r in results:
            report.append(f"| {r['label']} | {r['final_test_accuracy']:.4f} | "
                          f"{r['mean_test_accuracy_last_20pct']:.4f} | "
                          f"{r['final_server_lr']:.3g} |")
        learned = [r for r in results if r["learned"]]
        verdict = all(r["mean_test_accuracy_last_20pct"]
                      >= best["mean_test_accuracy_last_20pct"] - 0.005 for r in learned)
        report += ["", f"Best fixed η: {best['label']} "
                   f"({best['mean_test_accuracy_last_20pct']:.4f}). Learned runs within 0.5 "
                   f"points of it or better: **{'yes' if verdict else 'no'}**.",
                   f"![{dataset}]({dataset}.png)", ""]
    (out / "results.json").write_text(json.dumps(everything, indent=1) + "\n")
    (out / "report.md").write_text("\n".join(report) + "\n")
    print("\n".join(report))


if __name__ == "__main__":
    main()
