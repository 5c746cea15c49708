"""User-level DP federated averaging on MNIST split into 1,000 clients: adaptive clipping
against a sweep of fixed clips (Andrew et al.), and accuracy against ε (McMahan et al. 2018).

Both experiments run configs through ``fedax.experiments.run`` (a ``privacy:`` section:
``mechanism: gaussian`` with a fixed clip, or ``mechanism: adaptive``), so every run is an
ordinary resumable run under ``runs/`` with its ``metrics.jsonl`` (ε, and for adaptive runs
the clip C and the unclipped fraction, in every record) and ``summary.json``.

The population: MNIST, pathological non-IID (sorted by label, 2,000 shards of 30, two
shards a client: 1,000 clients × 60 examples), Poisson sampling with q = 0.1 (expected
cohort m = 100, the fixed denominator of the noised average), E = 1, B = 10, client SGD,
server step 1 (FedAvg). ε is dp-accounting's RDP accountant for the Poisson-subsampled
Gaussian (add-or-remove-one client), δ = 1e-5 (= 1/(100 N)); PLD figures beside it.

* ``dp-adaptive-clipping``: per noise level (z calibrated to ε ≈ 1 and 4 after the run's
  rounds, and z = 0), fixed clips {0.1, 0.3, 1, 3} against adaptive clipping to the median
  (γ = 0.5, η_C = 0.2, C⁰ = 0.1, σ_b = m/20, geometric update). The claim: the adaptive clip
  lands within about one accuracy point of the best fixed clip of the sweep.
* ``dp-fedavg-mnist``: DP-FedAvg with a fixed clip at z ∈ {0, 0.3, 0.5, 1, 2}: test accuracy
  against ε, with the ε table (RDP and PLD).

This module runs them and gathers the results; :mod:`fedax.reproduce.dp_paper_report` writes
their reports and figures.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from fedax.reproduce.custom import (
    diverged,
    load_average,
    mean_finite,
    results_header,
    run_config,
    runs_experiment,
)
from fedax.reproduce.dp_paper_report import (
    _population,
    adaptive_figures,
    fedavg_figures,
    write_adaptive_report,
    write_fedavg_report,
)
from fedax.reproduce.framework import CustomExperiment, Experiment, save_results

ANDREW = ("Andrew, Thakkar, McMahan, Ramaswamy, \"Differentially Private Learning with "
          "Adaptive Clipping\", NeurIPS 2021 (arXiv 1905.03871): clipping to a privately "
          "estimated quantile of the update norms (γ = 0.5: the median) instead of a tuned "
          "fixed clip")
MCMAHAN = ("McMahan, Ramage, Talwar, Zhang, \"Learning Differentially Private Recurrent "
           "Language Models\", ICLR 2018 (arXiv 1710.06963): DP-FedAvg, user-level DP by "
           "clipping each client's update and noising the sum")

DELTA = 1e-5
SAMPLING = "poisson"
ACCOUNTANT = "rdp"  # the runs' own accountant; PLD is computed beside it for the report
WITHIN = 0.01  # "within about one accuracy point"

# Every run: MNIST, 1,000 clients × 60 (two label shards each), q = 0.1, E = 1, B = 10.
BASE: dict[str, Any] = {
    "dataset": "mnist", "num_clients": 1000, "partition": "pathological",
    "algorithm": "fedavg", "client_fraction": 0.1, "local_epochs": 1, "batch_size": 10,
    "client_lr": 0.1,
    # One XLA CPU device, as the committed results were run (a split over devices is the
    # same computation with sums in another order, so not bit-identical numbers).
    "execution": {"devices": 1},
}

# Adaptive clipping (Andrew et al.'s recommended settings; TFF's gaussian_adaptive).
ADAPTIVE = {"clip": 0.1, "target_quantile": 0.5, "clip_learning_rate": 0.2}

ADAPTIVE_QUICK = dict(model="logistic", rounds=200, eval_every=5, last_k=8, seeds=(0, 1),
                      epsilons=(1.0, 4.0, None), clips=(0.1, 0.3, 1.0, 3.0), base={})
ADAPTIVE_FULL = dict(model="2nn", rounds=300, eval_every=5, last_k=12, seeds=(0, 1, 2),
                     epsilons=(1.0, 4.0, None), clips=(0.03, 0.1, 0.3, 1.0, 3.0, 10.0),
                     base={})
# z = 2 is beyond the asked-for {0, 0.3, 0.5, 1}: the first z with ε below ~5 here.
FEDAVG_QUICK = dict(model="2nn", rounds=150, eval_every=5, last_k=6, seeds=(0,),
                    noise_multipliers=(0.0, 0.3, 0.5, 1.0, 2.0), clip=0.5, base={})
FEDAVG_FULL = dict(model="2nn", rounds=500, eval_every=5, last_k=20, seeds=(0, 1, 2),
                   noise_multipliers=(0.0, 0.3, 0.5, 1.0, 2.0), clip=0.5, base={})


# ------------------------------------------------------------------------------ runs


def _experiment(name: str, settings: Mapping[str, Any]) -> Experiment:
    """The framework's view of this experiment's runs: the base config and the last-k
    evaluations that score a run (cells are built per run)."""
    base = {**BASE, "model": settings["model"], "rounds": settings["rounds"],
            "eval_every": settings["eval_every"], **settings.get("base", {})}
    return runs_experiment(name, base, settings["last_k"], title=name)


class _Sweep(NamedTuple):
    """Where either experiment starts: its output folder (created), its settings, the
    framework's view of its runs, and when it started (``time.perf_counter()``) with the
    load average then."""

    out: Path
    settings: dict[str, Any]
    experiment: Experiment
    started: float
    load_start: float | None

    @property
    def clients(self) -> int:
        """N, the population."""
        return self.experiment.base["num_clients"]

    @property
    def fraction(self) -> float:
        """q, the Poisson sampling rate."""
        return self.experiment.base["client_fraction"]

    @property
    def rounds(self) -> int:
        """T, the rounds of every run."""
        return self.settings["rounds"]


def _start(name: str, out_dir: Path, settings: Mapping[str, Any]) -> _Sweep:
    """Creates the output folder and starts the clock of experiment ``name``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = dict(settings)
    started, load_start = time.perf_counter(), load_average()
    return _Sweep(out, settings, _experiment(name, settings), started, load_start)


def _results(sweep: _Sweep, title: str, paper: str, *, quick: bool, command: str,
             runs_wall_time_s: float) -> dict[str, Any]:
    """The fields both experiments' ``results.json`` open with (the run time of every run
    in it, reused ones included, is ``runs_wall_time_s``)."""
    experiment = sweep.experiment
    return {
        **results_header(experiment.name, title, paper, quick=quick, command=command,
                         started=sweep.started),
        "runs_wall_time_s": round(runs_wall_time_s, 1),
        "load_average": {"start": sweep.load_start, "end": load_average()},
        "settings": {k: list(v) if isinstance(v, tuple) else v
                     for k, v in sweep.settings.items()},
        "base_config": experiment.base, "population": _population(experiment),
        "delta": DELTA, "sampling": SAMPLING, "accountant": ACCOUNTANT,
    }


def _privacy(mechanism: str, z: float, clip: float | None) -> dict[str, Any]:
    privacy: dict[str, Any] = {"mechanism": mechanism, "noise_multiplier": float(z),
                               "delta": DELTA, "accountant": ACCOUNTANT,
                               "sampling": SAMPLING}
    if mechanism == "adaptive":
        privacy.update(ADAPTIVE)
    else:
        privacy["clip"] = float(clip)
    return privacy


def _run_seeds(experiment: Experiment, name: str, label: str, privacy: dict[str, Any],
               seeds: Sequence[int], out: Path, progress: bool,
               log: Callable[[str], None]) -> dict[str, Any]:
    """One setting over the seeds: each seed's run (reused or resumed when its config
    matches), the mean over seeds of the last-k accuracy, and the mean curves."""
    per_seed = []
    for seed in seeds:
        summary = run_config(experiment, name, label, {"seed": seed, "privacy": privacy},
                             out / "runs" / name / f"seed{seed}", progress=progress)
        records = summary["records"]
        privacy_summary = summary.get("privacy") or {}
        per_seed.append({
            "seed": seed,
            "last_accuracy": summary["last_accuracy"],
            "final_test_accuracy": summary["final_test_accuracy"],
            "best_test_accuracy": summary["best_test_accuracy"],
            "rounds_run": summary["rounds_run"],
            # Not summary["status"]: a z = 0 run records ε = inf, which the strict-JSON
            # records turn into null with the status "diverged".
            "diverged": diverged(summary),
            "epsilon": privacy_summary.get("epsilon"),
            "wall_time_s": summary["wall_time_s"],
            "reused": bool(summary.get("reused")),
            "records": [{k: r.get(k) for k in ("round", "test_accuracy", "epsilon",
                                                "clip_norm", "unclipped_fraction",
                                                "dp_noise_stddev") if k in r}
                        for r in records],
        })
        log(f"   {label:<22} seed {seed}: last-{experiment.last_k} acc "
            f"{summary['last_accuracy']:.4f}, final {summary['final_test_accuracy']:.4f}, "
            f"{summary['wall_time_s']:.0f} s" + (" (reused)" if summary.get("reused") else ""))
    return {"label": label, "privacy": privacy, "accuracy": mean_finite(
        [s["last_accuracy"] for s in per_seed]), "per_seed": per_seed,
        "wall_time_s": round(sum(s["wall_time_s"] for s in per_seed), 1),
        "curve": _mean_curve(per_seed)}


def _mean_curve(per_seed: Sequence[Mapping[str, Any]]) -> dict[str, list]:
    """The rounds every seed evaluated, with the seeds' mean of each recorded value."""
    rounds = sorted(set.intersection(*[{r["round"] for r in s["records"]} for s in per_seed]))
    curve: dict[str, list] = {"round": rounds}
    for key in ("test_accuracy", "clip_norm", "unclipped_fraction", "epsilon"):
        if all(key in r for s in per_seed for r in s["records"]):
            by_round = [{r["round"]: r[key] for r in s["records"]} for s in per_seed]
            curve[key] = [mean_finite([b[t] for b in by_round]) for t in rounds]
    return curve


def epsilons(z: float, rounds: int, q: float, population: int) -> dict[str, Any]:
    """ε after ``rounds`` rounds at noise multiplier z, Poisson sampling, δ = DELTA: RDP
    (what the runs record) and PLD (tighter); inf for z = 0."""
    from fedax.privacy import PrivacyLedger

    out: dict[str, Any] = {}
    for accountant in ("rdp", "pld"):
        ledger = PrivacyLedger(z, q, DELTA, accountant, sampling=SAMPLING,
                               population=population)
        eps = ledger.epsilon_after(rounds)
        out[accountant] = eps if math.isfinite(eps) else None  # strict JSON: null = ∞
        if accountant == "rdp":
            out["accounting"] = ledger.describe()
    return out


def _run_counts(settings_results: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """How many runs the results hold and how many of them an earlier invocation ran."""
    seeds = [x for c in settings_results for x in c["per_seed"]]
    return {"total": len(seeds), "reused": sum(bool(x["reused"]) for x in seeds)}


# ------------------------------------------------------------ dp-adaptive-clipping


ADAPTIVE_TITLE = "Adaptive clipping (γ = 0.5) vs the best fixed clip, DP-FedAvg on MNIST"


def _level_name(target: float | None) -> str:
    return "nonoise" if target is None else f"eps{target:g}"


def _level_label(target: float | None, z: float) -> str:
    return "ε = ∞ (z = 0)" if target is None else f"ε ≈ {target:g} (z = {z:.3g})"


def run_adaptive(out_dir: Path, quick: bool, progress: bool, command: str, *,
                 settings: Mapping[str, Any] | None = None,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """The ``dp-adaptive-clipping`` experiment (``settings``, e.g. ``ADAPTIVE_QUICK``
    with fewer rounds, lets tests run a tiny one)."""
    from fedax.privacy import noise_multiplier_for

    sweep = _start("dp-adaptive-clipping", out_dir,
                   settings or (ADAPTIVE_QUICK if quick else ADAPTIVE_FULL))
    settings, n, q, rounds = sweep.settings, sweep.clients, sweep.fraction, sweep.rounds
    levels = []
    for target in settings["epsilons"]:
        z = 0.0 if target is None else noise_multiplier_for(
            target, q, rounds, DELTA, accountant=ACCOUNTANT, sampling=SAMPLING,
            population=n)
        label = _level_label(target, z)
        log(f"== {label}: {len(settings['clips'])} fixed clips and adaptive, "
            f"{len(settings['seeds'])} seed(s), {rounds} rounds")
        key = _level_name(target)
        fixed = []
        for clip in settings["clips"]:
            fixed.append(dict(clip=clip, **_run_seeds(
                sweep.experiment, f"{key}/clip{clip:g}", f"fixed clip {clip:g}",
                _privacy("gaussian", z, clip), settings["seeds"], sweep.out, progress, log)))
        adaptive = _run_seeds(sweep.experiment, f"{key}/adaptive", "adaptive γ=0.5",
                              _privacy("adaptive", z, None), settings["seeds"], sweep.out,
                              progress, log)
        levels.append(_level_summary(target, z, fixed, adaptive, rounds, q, n,
                                     settings["last_k"]))
        lv = levels[-1]
        log(f"   best fixed clip {lv['best_fixed_clip']:g}: {lv['best_fixed_accuracy']:.4f};"
            f" adaptive {lv['adaptive_accuracy']:.4f} ({lv['difference'] * 100:+.2f} points)")
    runs = [c for lv in levels for c in [*lv["fixed"], lv["adaptive"]]]
    results = {
        **_results(sweep, ADAPTIVE_TITLE, ANDREW, quick=quick, command=command,
                   runs_wall_time_s=sum(c["wall_time_s"] for c in runs)),
        "adaptive": {**ADAPTIVE, "count_stddev": "m/20 (the default)",
                     "update": "geometric"},
        "within": WITHIN, "levels": levels, "runs": _run_counts(runs),
        "claim_held": {lv["key"]: lv["within_one_point"] for lv in levels},
    }
    results["figures"] = adaptive_figures(results, sweep.out)
    write_adaptive_report(results, sweep.out)
    save_results(results, sweep.out)
    return results


def _level_summary(target, z, fixed, adaptive, rounds, q, n, last_k) -> dict[str, Any]:
    best = max(fixed, key=lambda c: c["accuracy"])
    clips = sorted(c["clip"] for c in fixed)
    diff = adaptive["accuracy"] - best["accuracy"]
    def tail_mean(runs, key):  # the mean over the last k evaluations and the seeds
        return mean_finite([v for s in runs["per_seed"]
                            for v in [r.get(key) for r in s["records"][-last_k:]]
                            if v is not None])

    tail = {key: tail_mean(adaptive, key)
            for key in ("clip_norm", "unclipped_fraction", "dp_noise_stddev")}
    z_value = None  # the adaptive clipped sum's own multiplier z_Δ (the count takes a share)
    if z > 0:
        from fedax.privacy import adaptive_clip_noise_multipliers

        z_value = adaptive_clip_noise_multipliers(z, q * n / 20)[0]
    per_seed_diff = []
    for i, s in enumerate(adaptive["per_seed"]):
        per_seed_diff.append({"seed": s["seed"], "adaptive": s["last_accuracy"],
                              "best_fixed": best["per_seed"][i]["last_accuracy"],
                              "difference": s["last_accuracy"]
                              - best["per_seed"][i]["last_accuracy"]})
    return {
        "key": _level_name(target), "label": _level_label(target, z),
        "target_epsilon": target, "noise_multiplier": z,
        "epsilon": epsilons(z, rounds, q, n), "fixed": fixed, "adaptive": adaptive,
        "best_fixed_clip": best["clip"], "best_fixed_accuracy": best["accuracy"],
        "best_at_grid_edge": len(clips) > 1 and best["clip"] in (clips[0], clips[-1]),
        "adaptive_accuracy": adaptive["accuracy"], "difference": diff,
        "within_one_point": bool(diff >= -WITHIN),
        "per_seed_difference": per_seed_diff,
        "adaptive_tail_clip": tail["clip_norm"],
        "adaptive_tail_unclipped_fraction": tail["unclipped_fraction"],
        "adaptive_value_noise_multiplier": z_value,
        # σ per coordinate of the average update: adaptive (z_Δ·C/m, the scored window's
        # mean) and the best fixed clip (z·C/m)
        "adaptive_tail_noise_stddev": tail["dp_noise_stddev"],
        "best_fixed_noise_stddev": tail_mean(best, "dp_noise_stddev"),
    }


ADAPTIVE_CLIPPING = CustomExperiment(
    name="dp-adaptive-clipping",
    title=ADAPTIVE_TITLE,
    run=run_adaptive,
    full_description="MNIST 2NN, 1,000 clients, 300 rounds, 3 seeds: 6 fixed clips vs "
                     "adaptive at ε ≈ 1, 4, ∞",
    quick_description="logistic regression, 200 rounds, 2 seeds, 4 fixed clips vs adaptive "
                      "at ε ≈ 1, 4, ∞ (≤ 12 min on 2 cores)",
)


# ------------------------------------------------------------------ dp-fedavg-mnist


FEDAVG_TITLE = "DP-FedAvg on MNIST with 1,000 clients: accuracy against ε"


def run_fedavg(out_dir: Path, quick: bool, progress: bool, command: str, *,
               settings: Mapping[str, Any] | None = None,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """The ``dp-fedavg-mnist`` experiment (``settings``, e.g. ``FEDAVG_QUICK`` with fewer
    rounds, lets tests run a tiny one)."""
    sweep = _start("dp-fedavg-mnist", out_dir, settings or (FEDAVG_QUICK if quick else FEDAVG_FULL))
    settings, n, q, rounds = sweep.settings, sweep.clients, sweep.fraction, sweep.rounds
    rows = []
    for z in settings["noise_multipliers"]:
        log(f"== z = {z:g}: fixed clip {settings['clip']:g}, {len(settings['seeds'])} "
            f"seed(s), {rounds} rounds")
        row = _run_seeds(sweep.experiment, f"z{z:g}", f"z = {z:g}",
                         _privacy("gaussian", z, settings["clip"]), settings["seeds"], sweep.out,
                         progress, log)
        row.update(noise_multiplier=z, epsilon=epsilons(z, rounds, q, n),
                   noise_stddev=z * settings["clip"] / (q * n),
                   best_test_accuracy=mean_finite([s["best_test_accuracy"]
                                                   for s in row["per_seed"]]))
        rows.append(row)
    base_acc = next((r["accuracy"] for r in rows if r["noise_multiplier"] == 0), None)
    for row in rows:
        row["minus_no_noise"] = None if base_acc is None else row["accuracy"] - base_acc
    results = {
        **_results(sweep, FEDAVG_TITLE, MCMAHAN, quick=quick, command=command,
                   runs_wall_time_s=sum(r["wall_time_s"] for r in rows)),
        "epsilon_table": epsilon_table(settings["noise_multipliers"], rounds, q, n),
        "rows": rows, "runs": _run_counts(rows),
    }
    results["figures"] = fedavg_figures(results, sweep.out)
    write_fedavg_report(results, sweep.out)
    save_results(results, sweep.out)
    return results


def epsilon_table(noise_multipliers: Sequence[float], rounds: int, q: float,
                  population: int) -> list[dict[str, Any]]:
    """ε (RDP and PLD, Poisson sampling, δ = DELTA) of each z after a quarter, half and
    all of the run's rounds."""
    marks = sorted({max(1, rounds // 4), max(1, rounds // 2), rounds})
    return [{"noise_multiplier": z, "rounds": t, **epsilons(z, t, q, population)}
            for z in noise_multipliers if z > 0 for t in marks]


DP_FEDAVG_MNIST = CustomExperiment(
    name="dp-fedavg-mnist",
    title=FEDAVG_TITLE,
    run=run_fedavg,
    full_description="MNIST 2NN, 1,000 clients, fixed clip 0.5, z ∈ {0, 0.3, 0.5, 1, 2}, "
                     "500 rounds, 3 seeds",
    quick_description="150 rounds, seed 0 (≤ 12 min on 2 cores)",
)

__all__ = ["ADAPTIVE_CLIPPING", "DP_FEDAVG_MNIST", "epsilon_table", "epsilons",
           "run_adaptive", "run_fedavg"]
