"""Rush, Charles, Garrett (FAD, JMLR 2024): the client weights of FedAvg's weighted mean
learned by federated hypergradient descent, on a population where some clients hold
mislabelled data (``papers/fad-client-weights.yaml``: the settings, the claims, the report).

The settings' task with ``fraction`` of its clients mislabelled (``mode``,
``fedax.data.mislabel_clients``); ``methods`` maps each method to where its training
cohorts come from (``train: good``: the mislabelled clients removed, the oracle; all clients
otherwise) and, for a learned one, its holdout clients (``holdout``: ``population`` or
``good``) and objective (``objective``: ``ce`` or ``soft error``): w_k = n_k·exp(θ·φ_k)
(``fedax.hyper.learned_client_weights``, θ from 0 = FedAvg, Adam at ``hyper_lr``). Every
method sees the same training cohorts of its pool. A learned method's records hold θ and the
weight its rule gave the mislabelled clients (:func:`weight_stats`, means over the rounds
since the last record).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import jax
import numpy as np
import optax

from fedax.algorithms import FederatedAlgorithm, fedavg
from fedax.data import ClientData, mislabel_clients
from fedax.hyper import HyperCohort, learned_client_weights, soft_error
from fedax.reproduce.hooks.fad_server_lr import EXECUTION, Task, finite_mean, load_task, tail
from fedax.simulation import make_evaluator
from fedax.simulation import run as run_rounds
from fedax.simulation.sources import HostCohorts

STATS = ("bad_weight_share", "bad_example_share", "bad_norm_weight", "good_norm_weight")


def weight_stats(weights: np.ndarray, ids: np.ndarray, bad: np.ndarray,
                 sizes: np.ndarray) -> dict[str, float]:
    """One round's weights ``[C]`` of clients ``ids``: the bad clients' share of the total
    weight and of the examples, and the mean normalized weight w_k / mean(w) of bad and good
    clients (NaN when the cohort has none of them)."""
    weights = np.asarray(weights, np.float64)
    is_bad = np.isin(ids, bad)
    norm = weights / weights.mean()
    return {
        "bad_weight_share": float(weights[is_bad].sum() / weights.sum()),
        "bad_example_share": float(sizes[is_bad].sum() / sizes.sum()),
        "bad_norm_weight": float(norm[is_bad].mean()) if is_bad.any() else math.nan,
        "good_norm_weight": float(norm[~is_bad].mean()) if (~is_bad).any() else math.nan,
        "num_bad": int(is_bad.sum()),
    }


def _learner(make: Callable[[Any], FederatedAlgorithm], loss_fn,
             hyper_lr: float) -> FederatedAlgorithm:
    """The learned weighting whose rounds also report θ after the round and the weights the
    cohort's clients got (``client_weights``)."""

    def recording(weights_fn):
        seen: list[Any] = []

        def recorded(num_examples, losses):
            seen.append(weights_fn(num_examples, losses))
            return seen[-1]

        algorithm = make(recorded)

        def round_fn(state, cohort, key):
            seen.clear()
            state, metrics = algorithm.round(state, cohort, key)
            return state, dict(metrics, client_weights=seen[-1])

        return FederatedAlgorithm(algorithm.init, round_fn, algorithm.server_params)

    learned = learned_client_weights(recording, loss_fn, optax.adam(hyper_lr))

    def round_fn(state, cohort, key):
        state, metrics = learned.round(state, cohort, key)
        return state, dict(metrics, theta=state.hparams)

    return FederatedAlgorithm(learned.init, round_fn, learned.server_params)


def _summary(name: str, history: list[dict[str, Any]],
             stats: list[dict[str, float]] | None) -> dict[str, Any]:
    """A method's records and their last-20% means; with the ``stats`` of every round (a
    learned method), θ and the window means of the weights (None: no such client)."""
    records, last = [], 0
    for r in history:
        records.append({"round": r["round"], "test_accuracy": float(r["test_accuracy"]),
                        "test_loss": float(r["test_loss"]),
                        "cohort_local_loss": float(r["train_loss"])})
        if stats is not None:
            window = stats[last:r["round"]]
            records[-1].update({k: finite_mean([s[k] for s in window]) for k in STATS})
            records[-1]["theta"] = [float(v) for v in r["theta"]]
        records[-1]["elapsed_s"], last = round(r["elapsed_s"], 2), r["round"]
    summary = {"method": name, "final_test_accuracy": records[-1]["test_accuracy"],
               "tail_test_accuracy": float(np.mean(tail([r["test_accuracy"] for r in records]))),
               "wall_time_s": records[-1]["elapsed_s"], "records": records}
    if stats is not None:
        summary["final_theta"] = records[-1]["theta"]
        summary.update({f"tail_{k}": finite_mean(tail([r[k] for r in records])) for k in STATS})
        summary["mean_bad_weight_share"] = float(np.mean([r[STATS[0]] for r in records]))
    return summary


def run_method(task: Task, bad: np.ndarray, name: str, spec: Mapping[str, Any],
               settings: Mapping[str, Any], *, progress: bool,
               log: Callable[[str], None]) -> dict[str, Any]:
    """One method of the settings (see the module's docstring): its summary and records."""
    seed, m, apply = settings["seed"], task.spec["clients_per_round"], task.model.apply
    loss_fn = task.loss_fn()
    everyone = np.arange(task.train.num_clients)
    good = np.setdiff1d(everyone, bad)
    pool = good if spec.get("train") == "good" else everyone

    def make(client_weights):
        return fedavg(loss_fn, optax.sgd(task.spec["client_lr"]), client_weights=client_weights)

    learned, stats = "holdout" in spec, []
    if learned:
        objective = {"ce": loss_fn, "soft error": soft_error(apply)}[spec["objective"]]
        algorithm = _learner(make, objective, settings["hyper_lr"])
        holdout = good if spec["holdout"] == "good" else everyone

        def cohort(t):
            return HyperCohort(task.cohort(seed, t, pool), task.holdout(seed, t, m, holdout))

        def on_round(number, metrics, data):
            c = data.plain.train
            stats.append(weight_stats(np.asarray(metrics["client_weights"]),
                                      np.asarray(c.client_ids), bad, np.asarray(c.num_examples)))
    else:
        algorithm = make(None)

        def cohort(t):
            return task.cohort(seed, t, pool)

    history = run_rounds(
        algorithm, task.model.init(jax.random.key(seed)), HostCohorts(cohort, len(everyone)),
        make_evaluator(apply, task.x_test, task.y_test), rounds=settings["rounds"],
        eval_every=settings["eval_every"], seed=seed, execution=EXECUTION, progress=progress,
        round_callbacks=[on_round] if learned else [], stop_on_divergence=False)
    summary = _summary(name, history.records, stats if learned else None)
    log(f"   {name:<28} acc {summary['final_test_accuracy']:.4f} (last-20% "
        f"{summary['tail_test_accuracy']:.4f}), {summary['wall_time_s']:.0f} s"
        + (f", θ {summary['final_theta']}, bad weight share (last 20%) "
           f"{summary['tail_bad_weight_share']:.3f}" if learned else ""))
    return summary


def run(paper, settings: Mapping[str, Any], out, *, progress: bool,
        log: Callable[[str], None]) -> dict[str, Any]:
    """Every method of ``settings`` on its task with mislabelled clients."""
    seed = settings["seed"]
    task = load_task(settings["task"], seed)
    train = task.train
    parts = [train.client_indices(k) for k in range(train.num_clients)]
    y, bad = mislabel_clients(train.y, parts, settings["fraction"], [seed, 3], settings["mode"])
    task = replace(task, train=ClientData(train.x, y, train.indices, train.offsets))
    log(f"== {task.spec['title']}: {len(bad)} mislabelled clients, {settings['rounds']} rounds")
    return {"settings": dict(settings), "bad_clients": [int(k) for k in bad],
            "methods": {name: run_method(task, bad, name, spec, settings, progress=progress,
                                         log=log)
                        for name, spec in settings["methods"].items()}}
