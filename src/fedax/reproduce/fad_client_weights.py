"""Rush, Charles, Garrett (FAD, JMLR 2024): client weights of FedAvg's weighted mean learned by
federated hypergradient descent, on a population where some clients hold mislabelled data.

MNIST, IID partition (100 clients × 600), a fraction of the clients (30% by default) with
their labels mapped through a client-specific derangement of the classes (every label is
wrong, consistently within the client: a client whose annotator confused the classes;
``fedax.data.mislabel_clients``).
The FedAvg variants see the same training cohorts (m = 10 clients a round, E = 1, B = 10,
client SGD), multinomial logistic regression:

* **n_k**: plain FedAvg, w_k = n_k;
* **learned**: ``fedax.hyper.learned_client_weights``, w_k = n_k · exp(θ · φ_k) with
  φ_k = (log n_k − log 600, ℓ_k − 1), ℓ_k the client's mean local training loss this round;
  θ starts at 0 (= plain FedAvg) and descends the reverse-mode hypergradient of a holdout
  objective on m fresh clients after the round (Adam on θ). Three holdouts (``LEARNED``):
  cross-entropy on clients from the whole population, mislabelled ones included (the
  library's default; the server does not know who is bad); the soft error 1 − p_y
  (``fedax.hyper.soft_error``) on the same clients; cross-entropy on trusted clients (drawn
  from the good ones);
* **oracle**: FedAvg over the good clients only (the bad ones removed from the population).

Reported: test accuracy, the learned θ, and the weight the learned rule gives the
mislabelled clients: their share of the cohort's total weight against their share of its
examples, and the mean normalized weight w_k / mean_cohort(w) of bad and good clients.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from fedax.algorithms import FederatedAlgorithm, fedavg
from fedax.data import mislabel_clients
from fedax.hyper import HyperCohort, learned_client_weights, soft_error
from fedax.reproduce.custom import load_average, results_header
from fedax.reproduce.fad_server_lr import (
    EXECUTION,
    TAIL,
    Task,
    cohort_batches,
    holdout_batches,
    logistic_model,
    sample,
)
from fedax.reproduce.fad_server_lr_report import header_lines
from fedax.reproduce.framework import CustomExperiment, save_results
from fedax.reproduce.report import notes_sections, pyplot, save_png, save_report
from fedax.simulation import run as run_rounds
from fedax.simulation.sources import HostCohorts

PAPER = ("Rush, Charles, Garrett, \"Federated Automatic Differentiation\", JMLR 25(357), "
         "2024 (arXiv 2301.07806): \"using FAD to learn weighting schemes for computing "
         "weighted averages across clients\" (abstract)")
# The learned methods: (where the holdout clients come from, the holdout objective).
# "population" is the whole contaminated population (the server does not know who is bad);
# "good" is a server that knows a few trusted clients. "ce" is the training loss
# (cross-entropy, the library's default); "soft error" is 1 − p_y, the expected 0-1 loss of
# the model's predictive distribution: bounded, and linear in p, so on a population where
# most labels are right it is minimized by the confident majority answer (cross-entropy, a
# proper scoring rule, instead rewards hedging toward the wrong labels).
LEARNED = {
    "learned (CE holdout)": ("population", "ce"),
    "learned (soft-error holdout)": ("population", "soft error"),
    "learned (trusted CE holdout)": ("good", "ce"),
}
METHODS = ("n_k", *LEARNED, "oracle")


_MODE_TEXT = {"permute": "permuted (a derangement of the classes per client)",
              "random": "replaced by random other classes"}


def load_task(seed: int = 0, fraction: float = 0.3, mode: str = "permute"):
    """MNIST IID (100 × 600) with ``fraction`` of the clients mislabelled: ``(task, bad)``."""
    from fedax import data as fdata

    arrays = fdata.load_mnist()
    parts = fdata.iid(len(arrays["y_train"]), 100, seed)
    y, bad = mislabel_clients(arrays["y_train"], parts, fraction, [seed, 3], mode)
    train = fdata.ClientData.from_partition(arrays["x_train"], y, parts)
    task = Task("mnist-mislabelled", "MNIST IID, mislabelled clients", train,
                arrays["x_test"], arrays["y_test"], logistic_model(784), clients_per_round=10,
                epochs=1, batch=10, client_lr=0.03,
                note=f"100 clients × 600 (IID), {len(bad)} of them ({fraction:.0%}) with "
                     f"labels {_MODE_TEXT[mode]}; 10 clients a round, E = 1, B = 10, client "
                     "SGD lr 0.03")
    return task, bad


def _with_theta(algorithm: FederatedAlgorithm) -> FederatedAlgorithm:
    """A hypergradient learner whose rounds also report θ after the round."""

    def round_fn(state, cohort, key):
        state, metrics = algorithm.round(state, cohort, key)
        return state, dict(metrics, theta=state.hparams)

    return FederatedAlgorithm(algorithm.init, round_fn, algorithm.server_params)


def _recording(make: Callable[[Any], FederatedAlgorithm]):
    """``make`` whose rounds also report the weights of the cohort's clients."""

    def make_recorded(weights_fn):
        seen = []

        def recorded(num_examples, losses):
            w = weights_fn(num_examples, losses)
            seen.append(w)
            return w

        algorithm = make(recorded)

        def round_fn(state, cohort, key):
            seen.clear()
            state, metrics = algorithm.round(state, cohort, key)
            return state, dict(metrics, client_weights=seen[-1])

        return FederatedAlgorithm(algorithm.init, round_fn, algorithm.server_params)

    return make_recorded


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


def run_methods(task: Task, bad: np.ndarray, *, rounds: int, eval_every: int, seed: int,
                hyper_lr: float, progress: bool, methods: tuple[str, ...] = METHODS,
                log: Callable[[str], None] = print) -> dict[str, Any]:
    from fedax.models import softmax_cross_entropy
    from fedax.simulation import make_evaluator

    apply = task.model.apply

    def loss_fn(params, batch):
        return softmax_cross_entropy(apply(params, batch.x), batch.y, batch.mask)

    def make(client_weights):
        return fedavg(loss_fn, optax.sgd(task.client_lr), client_weights=client_weights)

    evaluate = make_evaluator(apply, task.x_test, task.y_test)
    params0 = task.model.init(jax.random.key(seed))
    everyone = np.arange(task.train.num_clients)
    good = np.setdiff1d(everyone, bad)
    holdout_losses = {"ce": loss_fn, "soft error": soft_error(apply)}
    plain = make(None)
    m = task.clients_per_round

    def cohort(t, pool):
        rng = np.random.default_rng([seed, t])
        ids = sample(rng, pool, m)
        return cohort_batches(task.train, ids, task.epochs, task.batch, rng, task.steps)

    results = {}
    for method in methods:
        is_learned = method in LEARNED
        pool = good if method == "oracle" else everyone
        if is_learned:
            holdout_from, objective = LEARNED[method]
            algorithm = _with_theta(learned_client_weights(
                _recording(make), holdout_losses[objective], optax.adam(hyper_lr)))
            holdout_pool = good if holdout_from == "good" else everyone

            def make_cohort(t, pool=pool, holdout_pool=holdout_pool):
                hrng = np.random.default_rng([seed, t, 1])
                holdout = holdout_batches(task.train, sample(hrng, holdout_pool, m))
                return HyperCohort(cohort(t, pool), holdout)
        else:
            algorithm = plain

            def make_cohort(t, pool=pool):
                return cohort(t, pool)

        window: list[tuple] = []

        def on_round(number, metrics, data, window=window, is_learned=is_learned):
            if is_learned:
                train = data.plain.train
                window.append((train.client_ids, train.num_examples,
                               metrics["client_weights"]))

        records: list[dict[str, Any]] = []

        def on_record(record, window=window, is_learned=is_learned, method=method,
                      records=records):
            out = {"round": record["round"], "test_accuracy": float(record["test_accuracy"]),
                   "test_loss": float(record["test_loss"]),
                   "cohort_local_loss": float(record["train_loss"])}
            if is_learned:
                stats = [weight_stats(np.asarray(w), np.asarray(ids), bad, np.asarray(n))
                         for ids, n, w in window]
                for key in ("bad_weight_share", "bad_example_share"):
                    out[key] = float(np.mean([s[key] for s in stats]))
                for key in ("bad_norm_weight", "good_norm_weight"):
                    values = [s[key] for s in stats if not math.isnan(s[key])]
                    out[key] = float(np.mean(values)) if values else None
                out["theta"] = [float(v) for v in record["theta"]]
                window.clear()
            out["elapsed_s"] = round(record["elapsed_s"], 2)
            records.append(out)
            if progress:
                log(f"     {method} round {out['round']}: test acc {out['test_accuracy']:.4f}"
                    + (f", bad weight share {out['bad_weight_share']:.3f}, θ "
                       f"{out['theta']}" if is_learned else ""))

        run_rounds(algorithm, params0, HostCohorts(make_cohort, task.train.num_clients), evaluate,
            rounds=rounds, eval_every=eval_every, seed=seed, execution=EXECUTION,
            callbacks=[on_record], round_callbacks=[on_round], stop_on_divergence=False)
        tail = records[-max(1, math.ceil(TAIL * len(records))):]
        summary = {"method": method, "final_test_accuracy": records[-1]["test_accuracy"],
                   "tail_test_accuracy": float(np.mean([r["test_accuracy"] for r in tail])),
                   "wall_time_s": records[-1]["elapsed_s"], "records": records}
        if is_learned:
            summary["holdout_from"], summary["holdout_objective"] = LEARNED[method]
            summary["final_theta"] = records[-1]["theta"]
            for key in ("bad_weight_share", "bad_example_share", "bad_norm_weight",
                        "good_norm_weight"):
                values = [r[key] for r in tail if r[key] is not None]
                summary[f"tail_{key}"] = float(np.mean(values)) if values else None
            values = [r["bad_weight_share"] for r in records]
            summary["mean_bad_weight_share"] = float(np.mean(values))
        log(f"   {method:<28} acc {summary['final_test_accuracy']:.4f} (last-20% "
            f"{summary['tail_test_accuracy']:.4f}), {summary['wall_time_s']:.0f} s"
            + (f", θ {summary['final_theta']}, bad weight share (last 20%) "
               f"{summary['tail_bad_weight_share']:.3f} vs example share "
               f"{summary['tail_bad_example_share']:.3f}" if is_learned else ""))
        results[method] = summary
    return results


def figure(results: dict[str, Any], out: Path) -> str:
    """``client_weights.png``: test accuracy, the bad clients' weight share and the learned
    θ₂ over rounds; returns the file name."""
    plt = pyplot()

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (method, r) in enumerate(results["methods"].items()):
        rounds = [x["round"] for x in r["records"]]
        ax1.plot(rounds, [x["test_accuracy"] for x in r["records"]], color=colors[i],
                 label=method)
        if method in LEARNED:
            ax2.plot(rounds, [x["bad_weight_share"] for x in r["records"]], color=colors[i],
                     label=method)
            ax3.plot(rounds, [x["theta"][1] for x in r["records"]], color=colors[i],
                     label=method)
            share = [x["bad_example_share"] for x in r["records"]]
    ax2.plot(rounds, share, ":", color="gray", label="their share of examples (n_k weighting)")
    accs = [x["test_accuracy"] for r in results["methods"].values() for x in r["records"]]
    lo = sorted(accs)[len(accs) // 10]
    ax1.set_ylim(max(0.0, lo - 0.03), min(1.0, max(accs) + 0.01))
    ax1.set(xlabel="round", ylabel="test accuracy", title=results["task"]["title"])
    ax2.set(xlabel="round", ylabel="share of the cohort's total weight",
            title="weight of the mislabelled clients (window means)")
    ax3.set(xlabel="round", title="learned θ₂ (local-loss feature)")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    name = "client_weights.png"
    save_png(fig, out / name)
    return name


def _opt(value) -> str:
    return "—" if value is None else f"{value:.3f}"


def write_report(results: dict[str, Any], out: Path) -> str:
    """``report.md`` of ``fad-client-weights``; returns its text."""
    methods = results["methods"]
    verdicts = results["verdict"]
    lines = header_lines(results)
    lines += [DESCRIPTION.strip(), "", f"Setting: {results['task']['note']}; seed "
              f"{results['seed']}; {results['rounds']} rounds, test accuracy every "
              f"{results['eval_every']} rounds; Adam {results['hyper_lr']:g} on θ.", "",
              "| method | holdout clients | holdout objective | final test acc | "
              "last-20% test acc | vs n_k | vs oracle | wall s |",
              "|---|---|---|---|---|---|---|---|"]
    for method, r in methods.items():
        where, objective = LEARNED.get(method, ("—", "—"))
        where = {"population": "all (contaminated)", "good": "good only (trusted)"}.get(
            where, where)
        lines.append(
            f"| {method} | {where} | {objective} | {r['final_test_accuracy']:.4f} | "
            f"{r['tail_test_accuracy']:.4f} | "
            f"{r['tail_test_accuracy'] - methods['n_k']['tail_test_accuracy']:+.4f} | "
            f"{r['tail_test_accuracy'] - methods['oracle']['tail_test_accuracy']:+.4f} | "
            f"{r['wall_time_s']:.0f} |")
    lines += [
        "", "The learned weights, as means over the rounds of the last 20% of evaluations "
        "(whole run in parentheses). Normalized weight = w_k / the cohort's mean w (1 for "
        "every client under n_k weighting here, all n_k being 600). *Down-weights* = the "
        "mislabelled clients get less than half their share of the examples.", "",
        "| method | final θ (log-size, local-loss) | bad clients' weight share | their "
        "example share | normalized weight, bad | normalized weight, good | down-weights |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, r in methods.items():
        if method not in LEARNED:
            continue
        theta = r["final_theta"]
        lines.append(
            f"| {method} | ({theta[0]:+.3f}, {theta[1]:+.3f}) | "
            f"{r['tail_bad_weight_share']:.3f} ({r['mean_bad_weight_share']:.3f}) | "
            f"{r['tail_bad_example_share']:.3f} | {_opt(r['tail_bad_norm_weight'])} | "
            f"{_opt(r['tail_good_norm_weight'])} | "
            f"{'yes' if verdicts[method]['down_weights'] else 'no'} |")
    lines += ["", "![client weights](client_weights.png)", ""]
    lines += notes_sections(NOTES)
    return save_report(lines, out)


DESCRIPTION = """
FedAvg with client weights learned by federated hypergradient descent
(`fedax.hyper.learned_client_weights`: w_k = n_k·exp(θ·φ_k), φ_k = (log n_k − log 600,
ℓ_k − 1), ℓ_k the client's mean local training loss this round; θ starts at 0, i.e. plain
FedAvg) against plain n_k weighting and an oracle that drops the mislabelled clients. The
hypergradient (reverse mode) is that of a holdout objective on m fresh clients after the
round. Three learned versions differ only in the holdout: the library default
(cross-entropy on clients from the whole, contaminated population: the server never learns
who is bad), the soft error 1 − p_y on the same clients (chosen a priori, see the notes),
and cross-entropy on trusted clients (drawn from the good ones, as if the server knew a few
trusted clients). Test accuracy selects nothing.
"""

NOTES = """
- Why the soft error: on a holdout where 30% of the clients' labels are wrong,
  cross-entropy (a proper scoring rule) is minimized by a calibrated, hedging model, so
  mixing in the mislabelled clients' updates (which lower the confidence on the true class)
  can *lower* the holdout cross-entropy and its hypergradient need not push their weight
  down. The expected 0-1 loss of the predictive distribution, 1 − p_y, is linear in p: on a
  population where most labels of each input are right it is minimized by the confident
  majority answer, and it is bounded, so no single mislabelled holdout example dominates.
  This was decided from that argument and a development run on another seed (1), judged by
  the learned weights of the bad clients (a training-side quantity), not by test accuracy.
- All n_k are 600 (IID partition), so the log-size feature is constant (0) and θ₁ gets no
  gradient; the local-loss feature carries the signal. A bad client's local loss is high
  because the server model, trained mostly by good clients, disagrees with its labels.
- One seed (0). The training cohorts of round t are the same for n_k and the learned
  methods (the oracle draws its cohorts from the good clients only, with the same
  generator); the two contaminated-holdout methods see the same holdout clients.
- Wall times were measured while other long experiments ran on the same 2-core machine
  (see the load average above); they are inflated.
"""


def verdict(methods: dict[str, Any]) -> dict[str, Any]:
    """Per learned method: down-weights the bad clients (less than half their example share
    over the last 20%), and its last-20% test accuracy minus n_k's and the oracle's."""
    out = {}
    for method, r in methods.items():
        if method not in LEARNED:
            continue
        out[method] = {
            "down_weights": r["tail_bad_weight_share"] < 0.5 * r["tail_bad_example_share"],
            "minus_n_k": r["tail_test_accuracy"] - methods["n_k"]["tail_test_accuracy"],
            "minus_oracle": r["tail_test_accuracy"] - methods["oracle"]["tail_test_accuracy"],
        }
    return out


FULL = dict(rounds=300, eval_every=5)
QUICK = dict(rounds=150, eval_every=5)
TITLE = "FAD: learned client weights with mislabelled clients (FedAvg, MNIST)"


def run(out_dir: Path, quick: bool, progress: bool, command: str, *, seed: int = 0,
        fraction: float = 0.3, mode: str = "permute", hyper_lr: float = 0.05,
        settings: dict[str, Any] | None = None, task_loader=None,
        methods: tuple[str, ...] = METHODS,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """The ``fad-client-weights`` experiment (``task_loader(seed, fraction, mode) -> (task,
    bad)``, ``settings`` and ``methods``, which must include n_k and oracle, let tests run a
    tiny one)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = settings or (QUICK if quick else FULL)
    started, load_start = time.perf_counter(), load_average()
    task, bad = (task_loader or load_task)(seed, fraction, mode)
    log(f"== {task.title}: {len(bad)} bad clients, {settings['rounds']} rounds")
    methods = run_methods(task, bad, seed=seed, hyper_lr=hyper_lr, progress=progress, log=log,
                          methods=methods, **settings)
    results = {
        **results_header("fad-client-weights", TITLE, PAPER, quick=quick, command=command,
                         started=started),
        "load_average": {"start": load_start, "end": load_average()},
        "seed": seed, "fraction": fraction, "mode": mode, "hyper_lr": hyper_lr,
        "bad_clients": [int(k) for k in bad], **settings,
        "task": {"name": task.name, "title": task.title, "note": task.note},
        "methods": methods, "verdict": verdict(methods),
    }
    results["figures"] = [figure(results, out)]
    write_report(results, out)
    save_results(results, out)
    return results


CLIENT_WEIGHTS = CustomExperiment(
    name="fad-client-weights",
    title=TITLE,
    run=run,
    full_description="MNIST IID with 30% mislabelled clients, 300 rounds: n_k vs three "
                     "learned weightings vs oracle",
    quick_description="150 rounds (≤ 5 min on 2 cores)",
)

__all__ = ["CLIENT_WEIGHTS", "run", "weight_stats"]
