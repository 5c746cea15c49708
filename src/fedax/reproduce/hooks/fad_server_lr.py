"""Rush, Charles, Garrett, "Federated Automatic Differentiation" (JMLR 2024): FedAvg whose
server learning rate η is learned online by federated hypergradient descent, against fixed η
(``papers/fad-server-lr.yaml``: the settings, the claims and the report).

Per task of the settings: fixed η over its grid; η* is the grid's lowest mean global training
loss over the last 20% of evaluations (test accuracy selects nothing). Each variant then
learns η from the lattice points 0.1·η* and 10·η*, beside fixed η at those starts: Adam on
log η descends the hypergradient of the holdout loss after the round, the tangent d x / d log η
carried across rounds with decay γ (``fedax.hyper.learned_server_lr_carried``; γ = 0 is the
one-round hypergradient). A variant's score is its mean last-20% training loss over both
starts; the lowest is *selected*. The runs of a seed see the same training cohorts (common
random numbers); holdout clients are drawn apart from them. :class:`Task` serves
``fad_client_weights`` too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import jax
import numpy as np
import optax

from fedax.algorithms import CohortBatches, fedavg
from fedax.client import Batches
from fedax.hyper import HyperCohort, learned_server_lr_carried
from fedax.simulation import Execution, make_evaluator
from fedax.simulation import run as run_rounds
from fedax.simulation.sources import HostCohorts

EXECUTION = Execution("vmap", "scan", 1)  # clients vectorized, local steps scanned
TAIL = 0.2  # the "last-20%" values: means over the last 20% of evaluations
TRAIN_EVAL_EXAMPLES = 10_000  # the training objective is measured on at most this many


def sample(rng: np.random.Generator, pool: np.ndarray, m: int) -> np.ndarray:
    """``m`` distinct clients of ``pool``, uniformly."""
    return np.asarray(pool)[rng.choice(len(pool), size=m, replace=False)]


def tail(values: list[Any]) -> list[Any]:
    """The last 20% of ``values`` (at least one)."""
    return values[-max(1, math.ceil(TAIL * len(values))):]


def finite_mean(values: list[Any]) -> float | None:
    """The mean of the values that are numbers (None and NaN left out; None if none is)."""
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.mean(kept)) if kept else None


@dataclass(eq=False)
class Task:
    """A task of the settings (``data``: the keys of a fedax config that name the data set
    and its partition; ``clients_per_round``, ``epochs``, ``batch``, ``client_lr``: FedAvg's
    m, E, B and client SGD rate) with its data and multinomial logistic regression."""

    spec: Mapping[str, Any]
    train: Any  # fedax.data.ClientData
    x_test: np.ndarray
    y_test: np.ndarray
    model: Any

    def loss_fn(self) -> Callable[[Any, Batches], Any]:
        from fedax.models import softmax_cross_entropy

        apply = self.model.apply
        return lambda params, b: softmax_cross_entropy(apply(params, b.x), b.y, b.mask)

    def _pool(self, pool: np.ndarray | None) -> np.ndarray:
        return np.arange(self.train.num_clients) if pool is None else pool

    def cohort(self, seed: int, t: int, pool: np.ndarray | None = None) -> CohortBatches:
        """Round t's training cohort from ``pool`` (all clients by default), the same in
        every run of ``seed``."""
        from fedax.data import make_cohort, num_local_steps

        s, train = self.spec, self.train
        rng = np.random.default_rng([seed, t])
        ids = sample(rng, self._pool(pool), s["clients_per_round"])
        steps = num_local_steps(int(train.sizes.max()), s["epochs"], s["batch"])
        c = make_cohort(train, ids, s["epochs"], s["batch"], rng, num_steps=steps)
        # host arrays (CohortBatches types its counts jax.Array; the jitted round takes both)
        return CohortBatches(Batches(train.x[c.idx], train.y[c.idx].astype(np.int32), c.mask),
                             cast(jax.Array, c.num_examples), cast(jax.Array, c.client_ids))

    def holdout(self, seed: int, t: int, clients: int,
                pool: np.ndarray | None = None) -> CohortBatches:
        """Round t's ``clients`` holdout clients from ``pool``, drawn apart from its cohort,
        each with all its examples in one batch of the largest client's size."""
        train = self.train
        ids = sample(np.random.default_rng([seed, t, 1]), self._pool(pool), clients)
        idx = np.zeros((len(ids), 1, int(train.sizes.max())), np.int32)
        mask = np.zeros(idx.shape, np.float32)
        for c, k in enumerate(ids):
            own = train.client_indices(int(k))
            idx[c, 0, :len(own)], mask[c, 0, :len(own)] = own, 1.0
        return CohortBatches(Batches(train.x[idx], train.y[idx].astype(np.int32), mask),
                             cast(jax.Array, train.sizes[ids].astype(np.float32)),
                             cast(jax.Array, np.asarray(ids, np.int32)))


def load_task(spec: Mapping[str, Any], seed: int) -> Task:
    """The task ``spec`` (see :class:`Task`), its data built as a fedax config's."""
    from fedax.builder.datasets import build_data
    from fedax.models import get_model
    from fedax.spec.config import validate_config

    data = build_data(validate_config({
        "rounds": 1, "model": "logistic", "algorithm": "fedavg", "client_fraction": 1.0,
        "local_epochs": 1, "batch_size": 1, "client_lr": 1.0, **spec["data"], "seed": seed}))
    return Task(spec, data.train, data.x_test, data.y_test,
                get_model("logistic", **data.model_kwargs))


def lattice(k: int) -> float:
    """The k-th point of the grid of server learning rates, 10^(k/2) to three digits."""
    return float(f"{10 ** (k / 2):.3g}")


def _finite(value: Any) -> float | None:
    return float(value) if math.isfinite(float(value)) else None


def _records(history: list[dict[str, Any]], lrs: list[float], *,
             learned: bool) -> list[dict[str, Any]]:
    """A run's records: its evaluations, η after the round and, learned, η's geometric mean
    over the rounds since the previous record (``lrs``: η of every round)."""
    records, last = [], 0
    for r in history:
        records.append({k: r[k] for k in ("round", "test_accuracy", "test_loss",
                                          "train_loss", "train_accuracy")})
        records[-1]["server_lr"] = lrs[r["round"] - 1]
        if learned:
            window = np.asarray(lrs[last:r["round"]], np.float64)
            records[-1]["server_lr_geomean"] = float(np.exp(np.mean(np.log(window))))
        records[-1]["elapsed_s"], last = round(r["elapsed_s"], 2), r["round"]
    return records


def runner(task: Task, seed: int, *, progress: bool, log: Callable[[str], None]):
    """``run(label, lr, variant=None)``: one run of ``task`` at fixed η = ``lr``, or learning
    η from ``lr`` with ``variant`` (``hyper_lr``, ``decay``, ``holdout_factor``), recorded
    to the end even when it diverges; returns its summary with its records."""
    loss_fn, apply, train = task.loss_fn(), task.model.apply, task.train
    evaluate_test = make_evaluator(apply, task.x_test, task.y_test)
    chosen = train.indices
    if len(chosen) > TRAIN_EVAL_EXAMPLES:  # the training objective on a fixed random subset
        chosen = np.sort(np.random.default_rng([seed, 7]).choice(
            chosen, TRAIN_EVAL_EXAMPLES, replace=False))
    evaluate_train = make_evaluator(apply, train.x[chosen], train.y[chosen])

    def evaluate(params) -> dict[str, Any]:
        (acc, loss), (train_acc, train_loss) = evaluate_test(params), evaluate_train(params)
        return {"test_accuracy": float(acc), "test_loss": _finite(loss),
                "train_loss": _finite(train_loss), "train_accuracy": float(train_acc)}

    def make(lr):
        return fedavg(loss_fn, optax.sgd(task.spec["client_lr"]), optax.sgd(lr))

    params0 = task.model.init(jax.random.key(seed))

    def run(label: str, lr: float, variant: Mapping[str, Any] | None = None) -> dict:
        if variant is None:
            algorithm, lrs = make(lr), [lr] * task.spec["rounds"]

            def cohort(t):
                return task.cohort(seed, t)
        else:
            algorithm, lrs = learned_server_lr_carried(
                make, lr, loss_fn, optax.adam(variant["hyper_lr"]), variant["decay"]), []
            clients = variant["holdout_factor"] * task.spec["clients_per_round"]

            def cohort(t):
                return HyperCohort(task.cohort(seed, t), task.holdout(seed, t, clients))
        history = run_rounds(
            algorithm, params0, HostCohorts(cohort, train.num_clients), evaluate,
            rounds=task.spec["rounds"], eval_every=task.spec["eval_every"], seed=seed,
            execution=EXECUTION, progress=progress, stop_on_divergence=False,
            round_callbacks=[] if variant is None else
            [lambda n, metrics, d: lrs.append(float(metrics["server_lr"]))])
        records = _records(history.records, lrs, learned=variant is not None)
        losses = tail([r["train_loss"] for r in records])
        result = {
            "final_test_accuracy": records[-1]["test_accuracy"],
            "tail_test_accuracy": float(np.mean(tail([r["test_accuracy"] for r in records]))),
            "tail_train_loss": math.inf if None in losses else float(np.mean(losses)),
            "final_server_lr": records[-1]["server_lr"], "rounds": records[-1]["round"],
            "label": label, "learned": variant is not None, "initial_server_lr": lr,
            "variant": None if variant is None else variant["name"], "records": records,
            "wall_time_s": records[-1]["elapsed_s"]}
        log(f"   {label:<40} acc {result['final_test_accuracy']:.4f} (last-20% "
            f"{result['tail_test_accuracy']:.4f}), train loss {result['tail_train_loss']:.4f},"
            f" η {result['final_server_lr']:.3g}, {result['wall_time_s']:.0f} s")
        return result

    return run


def run_task(spec: Mapping[str, Any], variants: list[Mapping[str, Any]], seed: int, *,
             progress: bool, log: Callable[[str], None]) -> dict[str, Any]:
    """One task's fixed grid, η*, and every variant learned from 0.1·η* and 10·η*."""
    run = runner(load_task(spec, seed), seed, progress=progress, log=log)
    grid = list(spec["grid"])
    log(f"== {spec['title']}: {spec['rounds']} rounds, grid {', '.join(f'{v:g}' for v in grid)}")
    fixed = {lr: run(f"fixed η={lr:g}", lr) for lr in grid}
    best = min(fixed, key=lambda lr: (fixed[lr]["tail_train_loss"], -lr))
    starts = [lattice(round(2 * math.log10(best * f))) for f in (0.1, 10.0)]
    fixed.update({lr: run(f"fixed η={lr:g}", lr) for lr in starts if lr not in fixed})
    learned = [run(f"learned ({v['name']}) from {lr:g}", lr, v) for v in variants
               for lr in starts]
    scores = {v["name"]: float(np.mean([r["tail_train_loss"] for r in learned
                                        if r["variant"] == v["name"]])) for v in variants}
    return {"task": spec["task"], "title": spec["title"], "note": spec["note"],
            "rounds": spec["rounds"], "eval_every": spec["eval_every"], "seed": seed,
            "grid": grid, "best_fixed_lr": best,
            "best_fixed_lr_by_test": max(grid, key=lambda lr: fixed[lr]["tail_test_accuracy"]),
            "starts": starts, "variant_scores": scores,
            "selected_variant": min(scores, key=scores.__getitem__),
            "fixed": [fixed[lr] for lr in sorted(fixed)], "learned": learned}


def run(paper, settings: Mapping[str, Any], out, *, progress: bool,
        log: Callable[[str], None]) -> dict[str, Any]:
    """Every task of ``settings`` (``seed``, ``tasks``, ``variants``)."""
    return {"settings": dict(settings),
            "tasks": [run_task(spec, settings["variants"], settings["seed"], progress=progress,
                               log=log) for spec in settings["tasks"]]}
