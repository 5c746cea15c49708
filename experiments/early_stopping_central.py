"""The EB criterion's own claim, centrally: stopping by the gradients' evidence, on all the
data, against stopping on a validation set and against a fixed budget.

Mahsereci et al. (2017; docs/references.md, Local training and early stopping) propose
stopping when the evidence-based (EB) criterion of the minibatch gradients turns positive,
so that no data has to be held out. Here, on a small MNIST subset (``--train`` examples,
drawn per seed), for logistic regression and the 2NN, with SGD at batch size ``--batch``:

* **full data**: train on all of it for the budget, evaluating every ``every`` steps the EB
  criterion of the next batch (``fedax.client.eb_criterion``) and the test loss. An
  EB-stopped run is this run up to its first check where the (smoothed) criterion exceeds
  0, so one run gives every EB variant: the paper's form, exponential smoothing β = 0.9,
  and fedax's small-batch calibration (c' = 1 − (B − 3)/(B − 1) · (1 − c)), alone and
  smoothed;
* **validation**: train on 80% and keep the checkpoint with the lowest loss on the other
  20% (the practice the paper replaces; optimistic, as it sees the whole budget);
* **fixed budget**: the full-data run's end; **oracle**: its lowest test loss (not
  attainable without the test set).

Writes ``results.json``, ``central.png`` and ``table.md`` into
``--out``; the committed ``report.md`` reads them.

Usage: python experiments/early_stopping_central.py [--seeds 3] [--train 1000]
    [--batch 50] [--out experiments/results/early-stopping-central]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedax.client import Batches, eb_criterion
from fedax.data.mnist import load_mnist
from fedax.models import get_model, softmax_cross_entropy

# model -> (learning rate, epochs, check every m steps)
SETTINGS = {"logistic": (0.5, 100, 1), "2nn": (0.1, 60, 5)}
VARIANTS = {"EB (paper's form)": (False, 0.0), "EB, β = 0.9": (False, 0.9),
            "EB calibrated": (True, 0.0), "EB calibrated, β = 0.9": (True, 0.9)}


def trajectory(model, params, x, y, x_eval, y_eval, x_test, y_test, *, lr, epochs, batch,
               every, seed, criterion):
    """SGD over shuffled epochs; at every ``every``-th step (and at the end): the step, the
    EB criterion of that step's batch (if ``criterion``), the eval loss and the test loss
    and accuracy, all at the parameters before the step."""

    def loss_fn(p, b):
        return softmax_cross_entropy(model.apply(p, b.x), b.y, b.mask)

    optimizer = optax.sgd(lr)

    @jax.jit
    def step(p, s, bx, by):
        grads = jax.grad(loss_fn)(p, Batches(bx, by, jnp.ones(len(by))))
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    @jax.jit
    def evaluate(p, bx, by, ex, ey):
        value = eb_criterion(loss_fn, p, Batches(bx, by, jnp.ones(len(by)))).value \
            if criterion else jnp.nan
        logits = model.apply(p, x_test)
        test = softmax_cross_entropy(logits, y_test, jnp.ones(len(y_test)))
        acc = jnp.mean(jnp.argmax(logits, -1) == y_test)
        held = softmax_cross_entropy(model.apply(p, ex), ey, jnp.ones(len(ey)))
        return value, held, test, acc

    rng = np.random.default_rng(seed)
    state = optimizer.init(params)
    rows, j, per_epoch = [], 0, len(x) // batch
    for _ in range(epochs):
        order = rng.permutation(len(x))
        for i in range(per_epoch):
            idx = order[i * batch:(i + 1) * batch]
            if j % every == 0:
                rows.append((j, *map(float, evaluate(params, x[idx], y[idx], x_eval, y_eval))))
            params, state = step(params, state, x[idx], y[idx])
            j += 1
    rows.append((j, np.nan, *map(float, evaluate(params, x[:batch], y[:batch], x_eval,
                                                  y_eval)[1:])))
    return np.array(rows)  # [checks, 5]: step, criterion, eval loss, test loss, test acc


def eb_stop(criterion: np.ndarray, batch: int, calibrated: bool, smoothing: float) -> int | None:
    """The first check (an index, never the first one: a run takes its first m steps)
    whose smoothed criterion exceeds 0, or None."""
    c = 1.0 - (batch - 3) / (batch - 1) * (1.0 - criterion) if calibrated else criterion
    smoothed = None
    for i in range(1, len(c)):
        if np.isnan(c[i]):
            continue
        smoothed = c[i] if smoothed is None else smoothing * smoothed + (1 - smoothing) * c[i]
        if smoothed > 0:
            return i
    return None


def one_seed(data, name: str, seed: int, n_train: int, batch: int) -> dict[str, Any]:
    lr, epochs, every = SETTINGS[name]
    rng = np.random.default_rng(1000 + seed)
    idx = rng.permutation(len(data["y_train"]))[:n_train]
    x, y = data["x_train"][idx], data["y_train"][idx]
    model = get_model(name)
    params = model.init(jax.random.key(seed))
    x_test, y_test = jnp.asarray(data["x_test"]), jnp.asarray(data["y_test"])
    common = dict(lr=lr, epochs=epochs, batch=batch, every=every, seed=seed)
    full = trajectory(model, params, x, y, x[:batch], y[:batch], x_test, y_test,
                      criterion=True, **common)
    cut = int(0.8 * n_train)
    val = trajectory(model, params, x[:cut], y[:cut], jnp.asarray(x[cut:]), jnp.asarray(y[cut:]),
                     x_test, y_test, criterion=False, **common)
    steps_per_epoch = n_train // batch
    out: dict[str, Any] = {}

    def at(rows, i, spe):
        step, _, _, test, acc = rows[i]
        return {"epoch": round(step / spe, 2), "steps": int(step), "test_loss": test,
                "test_accuracy": acc}

    for label, (calibrated, beta) in VARIANTS.items():
        i = eb_stop(full[:, 1], batch, calibrated, beta)
        out[label] = {**at(full, len(full) - 1 if i is None else i, steps_per_epoch),
                      "stopped": i is not None}
    best_val = int(np.argmin(val[:, 2]))
    out["validation (80% train)"] = {**at(val, best_val, cut // batch), "stopped": True}
    out["fixed budget"] = {**at(full, len(full) - 1, steps_per_epoch), "stopped": False}
    best_test = int(np.argmin(full[:, 3]))
    out["oracle (min test loss)"] = {**at(full, best_test, steps_per_epoch), "stopped": True}
    curve = {"step": full[:, 0].tolist(), "criterion": full[:, 1].tolist(),
             "test_loss": full[:, 3].tolist(), "val_step": val[:, 0].tolist(),
             "val_loss": val[:, 2].tolist(), "val_test_loss": val[:, 3].tolist()}
    return {"methods": out, "curve": curve, "steps_per_epoch": steps_per_epoch}


def plot(results, path: Path, batch: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.2))
    for ax, (name, seeds) in zip(np.atleast_1d(axes), results.items(), strict=True):
        first = seeds[0]
        c, spe = first["curve"], first["steps_per_epoch"]
        epochs = np.array(c["step"]) / spe
        ax.plot(epochs, c["test_loss"], color="C0", label="test loss (full data)")
        ax.plot(np.array(c["val_step"]) / (0.8 * spe), c["val_test_loss"], color="C1",
                label="test loss (80% train)")
        ax.plot(np.array(c["val_step"]) / (0.8 * spe), c["val_loss"], color="C1", ls=":",
                label="validation loss (20%)")
        for k, (label, m) in enumerate(first["methods"].items()):
            if m["stopped"] and not label.startswith("oracle"):
                ax.axvline(m["epoch"], color=f"C{k + 2}", lw=1, ls="--", label=f"stop: {label}")
        twin = ax.twinx()
        crit = np.array(c["criterion"])
        twin.plot(epochs, crit, color="gray", alpha=0.35, lw=0.6)
        twin.axhline(0.0, color="gray", lw=0.6)
        twin.axhline(-2 / (batch - 3), color="gray", lw=0.6, ls=":")
        twin.set_ylim(-1.5, 0.6)
        twin.set_ylabel("EB criterion (gray; dotted: −2/(B−3))")
        ax.set(xlabel="epoch", ylabel="loss", title=f"{name}, seed 0")
        ax.legend(fontsize=7, loc="upper right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--train", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--models", default="logistic,2nn")
    parser.add_argument("--out", default="experiments/results/early-stopping-central")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = load_mnist()
    data = {k: v.reshape(len(v), -1) if k.startswith("x") else v for k, v in data.items()}
    started = time.time()
    results = {}
    for name in args.models.split(","):
        results[name] = []
        for seed in range(args.seeds):
            t = time.time()
            results[name].append(one_seed(data, name, seed, args.train, args.batch))
            print(f"{name} seed {seed}: {time.time() - t:.0f} s", flush=True)
    plot(results, out / "central.png", args.batch)
    rows = ["| model | method | epoch at stop | test loss at stop | test accuracy at stop "
            "| runs that stopped |", "|---|---|---|---|---|---|"]
    table: dict[str, Any] = {}
    for name, seeds in results.items():
        table[name] = {}
        for label in seeds[0]["methods"]:
            ms = [s["methods"][label] for s in seeds]
            row = {k: (float(np.mean([m[k] for m in ms])), float(np.std([m[k] for m in ms])))
                   for k in ("epoch", "test_loss", "test_accuracy")}
            row["stopped"] = sum(m["stopped"] for m in ms)
            table[name][label] = row
            rows.append(f"| {name} | {label} | {row['epoch'][0]:.1f} ± {row['epoch'][1]:.1f} "
                        f"| {row['test_loss'][0]:.4f} ± {row['test_loss'][1]:.4f} "
                        f"| {row['test_accuracy'][0]:.4f} ± {row['test_accuracy'][1]:.4f} "
                        f"| {row['stopped']}/{len(ms)} |")
    (out / "table.md").write_text("\n".join(rows) + "\n")
    meta = {"experiment": "early-stopping-central", "settings": SETTINGS,
            "train_examples": args.train, "batch": args.batch, "seeds": args.seeds,
            "command": "python experiments/early_stopping_central.py "
                       f"--seeds {args.seeds} --train {args.train} --batch {args.batch}",
            "wall_time_s": round(time.time() - started, 1),
            "machine": f"{platform.machine()}, {jax.default_backend()}, JAX {jax.__version__}"}
    per_seed = {name: [s["methods"] for s in seeds] for name, seeds in results.items()}
    (out / "results.json").write_text(json.dumps(
        {**meta, "summary": table, "per_seed": per_seed}, indent=1) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
