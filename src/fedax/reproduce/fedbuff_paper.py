"""FedBuff's headline comparison on MNIST: virtual time and client updates to a target
accuracy for FedBuff, FedAsync and synchronous FedAvg on one virtual clock.

Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022
(arXiv 2106.06639): FedBuff reaches a target accuracy faster (in wall-clock time) than
synchronous FL and with fewer client updates than FedAsync (3.3× / 2.5× in the AISTATS
abstract; docs/references.md, asynchronous aggregation). Their experiments are on CelebA,
Sent140 and CIFAR-10; this is the same comparison on MNIST 2NN, pathological non-IID (the
issue's setting).

Every method runs the same FedAvg pieces (client SGD, E = 1, B = 10; the 2NN), the same
client trips (block b of C trips is synchronous round b's cohort) and the same trip
durations (FLSim's half-normal, sd 1, min 0):

* **sync FedAvg**: C clients a round, the round lasts its slowest client's trip;
* **FedBuff**: concurrency M = C, buffer K, s(τ) = 1/√(1 + τ), the buffer's n_k-weighted
  mean, server SGD at η_g;
* **FedAsync**: concurrency M = C, K = 1, mixing x ← (1 − α s(τ)) x + α s(τ) x_i with
  s(τ) = 1/√(1 + τ); α from a small grid (the best, i.e. fewest updates to the target).

A client update is one client trip that reached the server. Virtual time is in units of
the latency model (one unit = the half-normal's sd).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedax.reproduce.custom import results_header
from fedax.reproduce.framework import CustomExperiment, save_results
from fedax.reproduce.report import pyplot, save_png

NGUYEN = ("Nguyen, Malik, Zhan, Yousefpour, Rabbat, Malek, Huba, \"Federated Learning with "
          "Buffered Asynchronous Aggregation\", AISTATS 2022 (arXiv 2106.06639)")
TIE = 1.1  # a ratio within 10% of 1 is reported as a tie (one seed moves it more)
TITLE = "FedBuff vs FedAsync vs synchronous FedAvg on a virtual clock (MNIST 2NN, non-IID)"

QUICK: dict[str, Any] = dict(
    num_clients=100, partition="pathological", model="2nn", local_epochs=1, batch_size=10,
    client_lr=0.1, concurrency=10, buffer_size=10, fedbuff_server_lr=1.0,
    fedasync_alphas=(0.1, 0.3, 0.6), staleness_exponent=0.5,
    latency={"kind": "half_normal", "sd": 1.0, "min": 0.0},
    client_updates=800, eval_every_updates=20, seeds=(0,), targets=(0.85, 0.9),
)
FULL: dict[str, Any] = dict(QUICK, client_updates=3000, seeds=(0, 1, 2),
                            targets=(0.85, 0.9, 0.95), fedasync_alphas=(0.1, 0.2, 0.4, 0.6))


def _load(settings: Mapping[str, Any], seed: int):
    """The partitioned MNIST, the 2NN, its evaluator and the FedAvg algorithm at a server
    learning rate, through the experiment config (so data and model are ``fedax run``'s)."""
    from fedax.experiments.build import build_algorithm
    from fedax.experiments.config import validate_config
    from fedax.experiments.datasets import build_data
    from fedax.models import get_model
    from fedax.simulation import PartitionSource, make_evaluator

    config = validate_config({
        "seed": seed, "rounds": 1, "dataset": "mnist", "num_clients": settings["num_clients"],
        "partition": settings["partition"], "model": settings["model"],
        "algorithm": "fedavg", "client_fraction": settings["concurrency"]
        / settings["num_clients"], "local_epochs": settings["local_epochs"],
        "batch_size": settings["batch_size"], "client_lr": settings["client_lr"]})
    data = build_data(config)
    model = get_model(config.model, **data.model_kwargs)
    import jax

    params = model.init(jax.random.key(seed))
    source = PartitionSource(data.train, config.client_fraction, config.local_epochs,
                             config.batch_size, seed=seed)
    evaluate = make_evaluator(model.apply, data.x_test, data.y_test)

    def algorithm(server_lr: float):
        cfg = config.model_copy(update={"server": config.server.model_copy(
            update={"lr": server_lr})})
        return build_algorithm(cfg, model.apply)

    return params, source, evaluate, algorithm


def _summary(name: str, method: str, setting: Mapping[str, Any], history, targets,
             wall: float) -> dict[str, Any]:
    records = [{k: r.get(k) for k in ("round", "test_accuracy", "virtual_time",
                                      "client_updates", "mean_staleness")}
               for r in history.records]
    return {
        "name": name, "method": method, "setting": dict(setting),
        "to_target": {f"{t:g}": {"virtual_time": history.to_target(t, "virtual_time"),
                                 "client_updates": history.to_target(t, "client_updates")}
                      for t in targets},
        "final_accuracy": records[-1]["test_accuracy"],
        "best_accuracy": max(r["test_accuracy"] for r in records),
        "virtual_time_end": records[-1]["virtual_time"],
        "mean_staleness": (float(np.mean([r["mean_staleness"] for r in records
                                          if r["mean_staleness"] is not None]))
                           if records[0]["mean_staleness"] is not None else 0.0),
        "wall_time_s": round(wall, 1), "records": records,
    }


def _run_method(out: Path, name: str, method: str, setting: dict[str, Any], settings,
                seed: int, loaded, log: Callable[[str], None]) -> dict[str, Any]:
    """One run (reused when ``runs/<name>.json`` holds the same setting)."""
    from fedax.simulation.asynchronous import (
        Latency,
        Staleness,
        fedasync,
        fedbuff,
        run_async,
        run_synchronous,
    )

    path = out / "runs" / f"{name}.json"
    key = {**setting, "seed": seed, "settings": {k: settings[k] for k in (
        "num_clients", "partition", "model", "local_epochs", "batch_size", "client_lr",
        "concurrency", "latency", "client_updates", "eval_every_updates")}}
    key = json.loads(json.dumps(key))
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            log(f"   {name}: reused")
            return saved["summary"]
    from fedax.simulation import choose_execution

    params, source, evaluate, algorithm = loaded
    # One device for every method (run_async's), so sync FedAvg runs the same programs.
    execution = choose_execution(params=params, devices=1)
    latency = Latency(**settings["latency"])
    staleness = Staleness("polynomial", settings["staleness_exponent"])
    updates, every = settings["client_updates"], settings["eval_every_updates"]
    m = settings["concurrency"]
    started = time.perf_counter()
    if method == "sync":
        history = run_synchronous(algorithm(1.0), params, source, evaluate, latency,
                                  rounds=updates // m, seed=seed,
                                  eval_every=max(every // m, 1), execution=execution)
    elif method == "fedbuff":
        k = setting["buffer_size"]
        config = fedbuff(k, m, latency=latency, staleness=staleness, weighting="algorithm")
        history = run_async(algorithm(setting["server_lr"]), params, source, evaluate, config,
                            server_updates=updates // k, seed=seed,
                            eval_every=max(every // k, 1), execution=execution)
    else:
        config = fedasync(m, latency=latency, staleness=staleness)
        history = run_async(algorithm(setting["alpha"]), params, source, evaluate, config,
                            server_updates=updates, seed=seed, eval_every=every,
                            execution=execution)
    summary = _summary(name, method, setting, history, settings["targets"],
                       time.perf_counter() - started)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "summary": summary}) + "\n")
    first = settings["targets"][0]
    hit = summary["to_target"][f"{first:g}"]
    log(f"   {name}: final {summary['final_accuracy']:.4f}, best {summary['best_accuracy']:.4f}"
        f", to {first:g}: time {_fmt(hit['virtual_time'])}, updates "
        f"{_fmt(hit['client_updates'])} ({summary['wall_time_s']:.0f} s)")
    return summary


def _fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _best(runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """The run with the fewest client updates to ``target`` (else the best accuracy)."""
    def score(r):
        hit = r["to_target"][f"{target:g}"]["client_updates"]
        return (math.inf if hit is None else hit, -r["best_accuracy"])

    return min(runs, key=score)


def run_fedbuff(out_dir: Path, quick: bool, progress: bool, command: str, *,
                settings: Mapping[str, Any] | None = None,
                log: Callable[[str], None] = print) -> dict[str, Any]:
    """The ``fedbuff`` experiment (``settings`` lets a test run a tiny one)."""
    del progress
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = dict(settings or (QUICK if quick else FULL))
    started = time.perf_counter()
    headline = settings["targets"][-1]
    per_seed = []
    for seed in settings["seeds"]:
        log(f"== seed {seed}: sync FedAvg, FedBuff (K = {settings['buffer_size']}), FedAsync "
            f"(α ∈ {list(settings['fedasync_alphas'])}), M = C = {settings['concurrency']}, "
            f"{settings['client_updates']} client updates each")
        loaded = _load(settings, seed)
        run = dict(out=out, settings=settings, seed=seed, loaded=loaded, log=log)
        sync = _run_method(name=f"seed{seed}/sync", method="sync", setting={}, **run)
        buff = _run_method(name=f"seed{seed}/fedbuff", method="fedbuff", setting={
            "buffer_size": settings["buffer_size"],
            "server_lr": settings["fedbuff_server_lr"]}, **run)
        asyncs = [_run_method(name=f"seed{seed}/fedasync_a{a:g}", method="fedasync",
                              setting={"alpha": a}, **run)
                  for a in settings["fedasync_alphas"]]
        per_seed.append({"seed": seed, "sync": sync, "fedbuff": buff, "fedasync": asyncs,
                         "fedasync_best": _best(asyncs, headline)["name"]})
    results = {
        **results_header("fedbuff", TITLE, NGUYEN, quick=quick, command=command,
                         started=started),
        "settings": json.loads(json.dumps(settings)), "per_seed": per_seed,
    }
    results["runs_wall_time_s"] = round(sum(
        r["wall_time_s"] for s in per_seed for r in [s["sync"], s["fedbuff"], *s["fedasync"]]),
        1)
    results["comparison"] = _comparison(results)
    results["figures"] = figures(results, out)
    write_report(results, out)
    save_results(results, out)
    return results


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _comparison(results: dict[str, Any]) -> dict[str, Any]:
    """Per target: each method's mean (over seeds) virtual time and client updates to the
    target, FedBuff's speedups, and whether the paper's two claims held."""
    out = {}
    for target in results["settings"]["targets"]:
        t = f"{target:g}"
        rows: dict[str, dict[str, Any]] = {}
        for label in ("sync", "fedbuff", "fedasync"):
            hits = []
            for s in results["per_seed"]:
                run = s[label] if label != "fedasync" else _best(s["fedasync"], target)
                hits.append(run["to_target"][t])
            times = [h["virtual_time"] for h in hits]
            updates = [h["client_updates"] for h in hits]
            rows[label] = {
                "virtual_time": None if None in times else float(np.mean(times)),
                "client_updates": None if None in updates else float(np.mean(updates)),
                "reached": sum(x is not None for x in times), "seeds": len(times)}
        time_speedup = _ratio(rows["sync"]["virtual_time"], rows["fedbuff"]["virtual_time"])
        update_ratio = _ratio(rows["fedasync"]["client_updates"],
                              rows["fedbuff"]["client_updates"])
        faster = (rows["fedbuff"]["virtual_time"] is not None
                  and (rows["sync"]["virtual_time"] is None or time_speedup > 1))
        fewer = (rows["fedbuff"]["client_updates"] is not None
                 and (rows["fedasync"]["client_updates"] is None or update_ratio > 1))
        out[t] = {"methods": rows, "time_speedup_vs_sync": time_speedup,
                  "update_ratio_fedasync_over_fedbuff": update_ratio,
                  "faster_than_sync": bool(faster),
                  "fewer_updates_than_fedasync": bool(fewer)}
    return out


def _verdict(held: bool, ratio: float | None) -> str:
    """'held', 'did not hold', or a tie: a ratio within ``TIE`` of 1 is not a clear win."""
    if ratio is not None and 1 / TIE < ratio < TIE:
        return f"{'held' if held else 'did not hold'}, but within {TIE - 1:.0%}: a tie"
    return "held" if held else "did not hold"


def figures(results: dict[str, Any], out: Path) -> list[str]:
    """``accuracy.png``: the three methods' test accuracy against virtual time and client
    updates (seed 0's runs, FedAsync at its best α); returns the file names."""
    plt = pyplot()

    s = results["per_seed"][0]
    headline = results["settings"]["targets"][-1]
    best = _best(s["fedasync"], headline)
    runs = [("sync FedAvg", s["sync"]), (f"FedBuff K={s['fedbuff']['setting']['buffer_size']}",
                                         s["fedbuff"]),
            (f"FedAsync α={best['setting']['alpha']:g}", best)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, x, label in ((axes[0], "virtual_time", "virtual time (latency units)"),
                         (axes[1], "client_updates", "client updates")):
        for name, run in runs:
            ax.plot([r[x] for r in run["records"]], [r["test_accuracy"] for r in run["records"]],
                    label=name, linewidth=1.2)
        for target in results["settings"]["targets"]:
            ax.axhline(target, color="gray", linestyle=":", linewidth=0.8)
        ax.set(xlabel=label, ylabel="test accuracy")
        ax.set_ylim(0.5, 1.0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{results['title']} (seed {s['seed']})", fontsize=9)
    save_png(fig, out / "accuracy.png")
    return ["accuracy.png"]


def write_report(results: dict[str, Any], out: Path) -> str:
    st, m = results["settings"], results["machine"]
    seeds = ", ".join(str(x) for x in st["seeds"])
    lat = st["latency"]
    lines = [
        f"# {results['title']}", "", f"Paper: {results['paper']}.", "",
        f"Command: `{results['command']}` ({'quick subset' if results['quick'] else 'full'}),"
        f" {results['runs_wall_time_s'] / 60:.1f} min of runs on {m['cpus']} CPU cores "
        f"({m['backend']}, "
        f"JAX {m['jax']}, {m['platform']}), finished {results['finished']}.", "",
        f"Setting: MNIST, {st['partition']} non-IID partition into {st['num_clients']} clients "
        f"(two label shards each), model `{st['model']}`, client SGD lr {st['client_lr']:g}, "
        f"E = {st['local_epochs']}, B = {st['batch_size']}; {st['client_updates']} client "
        f"updates per run, test accuracy (10,000 MNIST test images) every "
        f"{st['eval_every_updates']} client updates; seeds {seeds} (each seed: its own "
        f"partition, initial model, trips and durations). Concurrency M = C = "
        f"{st['concurrency']} for all three. Trip durations: FLSim's `{lat['kind']}` "
        f"(sd {lat['sd']:g}, min {lat['min']:g}), one draw per trip, the same draws for every "
        f"method. FedBuff: K = {st['buffer_size']}, s(τ) = 1/√(1 + τ), server SGD "
        f"η_g = {st['fedbuff_server_lr']:g} on the buffer's n_k-weighted mean. FedAsync: "
        f"K = 1, mixing with α·s(τ), s(τ) = (1 + τ)^(−{st['staleness_exponent']:g}), "
        f"α ∈ {{{', '.join(f'{a:g}' for a in st['fedasync_alphas'])}}} (the best α per target: "
        "fewest updates). Sync FedAvg: C clients a round, server step 1; a round lasts its "
        "slowest trip. To a target = the best-so-far curve's first crossing, interpolated "
        "(McMahan et al.'s reading), on the virtual-time or client-update axis.", "",
    ]
    for target, c in results["comparison"].items():
        rows = c["methods"]
        lines += [f"## Target {float(target):.0%}", "",
                  "| method | virtual time to target | client updates to target | reached |",
                  "|---|---:|---:|---:|"]
        for label, name in (("sync", "sync FedAvg"), ("fedbuff", "FedBuff"),
                            ("fedasync", "FedAsync (best α)")):
            r = rows[label]
            lines.append(f"| {name} | {_fmt(r['virtual_time'])} | "
                         f"{_fmt(r['client_updates'], 0)} | {r['reached']}/{r['seeds']} |")
        sync_ratio = _ratio(rows["sync"]["client_updates"], rows["fedbuff"]["client_updates"])
        faster = _verdict(c["faster_than_sync"], c["time_speedup_vs_sync"])
        fewer = _verdict(c["fewer_updates_than_fedasync"],
                         c["update_ratio_fedasync_over_fedbuff"])
        lines += ["", f"FedBuff reaches {float(target):.0%} "
                  f"{_fmt(c['time_speedup_vs_sync'], 2)}× faster in virtual time than sync "
                  f"FedAvg ({faster}), and needs "
                  f"{_fmt(c['update_ratio_fedasync_over_fedbuff'], 2)}× fewer client updates "
                  f"than FedAsync ({fewer}); sync FedAvg needs {_fmt(sync_ratio, 2)}× "
                  "FedBuff's client updates.", ""]
    lines += ["## Runs", "", "| seed | run | final acc. | best acc. | mean staleness | "
              "virtual time at end | wall s |", "|---|---|---:|---:|---:|---:|---:|"]
    for s in results["per_seed"]:
        for run in [s["sync"], s["fedbuff"], *s["fedasync"]]:
            lines.append(f"| {s['seed']} | {run['name'].split('/')[1]} | "
                         f"{run['final_accuracy']:.4f} | {run['best_accuracy']:.4f} | "
                         f"{run['mean_staleness']:.2f} | {run['virtual_time_end']:.1f} | "
                         f"{run['wall_time_s']:.0f} |")
    lines += ["", "![accuracy against virtual time and client updates](accuracy.png)", "",
              NOTES]
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    return text


NOTES = """## Notes

- The paper's claims (AISTATS abstract): FedBuff is 3.3× more efficient than synchronous FL and up
  to 2.5× more efficient than asynchronous FL (FedAsync). Which metric "efficient" counts was not
  read (docs/references.md, asynchronous aggregation); here the first claim is read on virtual time
  and the second on client updates. At equal concurrency FedBuff and FedAsync run the same trips at
  the same virtual times, so for those two the two axes tell the same story.
- Synchronous FedAvg's disadvantage here is only the wait for the slowest client of each
  round (the maximum of C half-normal durations against their mean); FedBuff's cost is
  staleness, which grows with M/K (the runs table's mean staleness). Per client update,
  synchronous FedAvg (no staleness) is the most efficient of the three; FedBuff trades
  updates for time. Larger concurrency (where FedAsync's staleness is about M), heavier-
  tailed latencies or dropped stragglers change the balance; the paper's own runs use
  CelebA, Sent140 and CIFAR-10 with concurrency up to the thousands, not MNIST 2NN at
  M = 10; this quick run does not test that regime.
- A client may be in two trips at once when two overlapping blocks draw it (clients are
  drawn without replacement within a block of C only).
- FedAsync's clients here train plain local SGD (FLSim's `fed_async_aggregation`), not
  FedAsync's proximal local objective, and its α was tuned on a small grid; FedBuff's η_g
  was not tuned (1.0, FedAvg on the buffer).
- The non-IID 2NN curve oscillates from update to update; a different seed moves the
  crossing points by tens of client updates, so one-seed ratios are rough.
"""


FEDBUFF = CustomExperiment(
    name="fedbuff",
    title=TITLE,
    run=run_fedbuff,
    full_description="MNIST 2NN non-IID, M = C = 10, K = 10, 3,000 client updates a run, "
                     "FedAsync α ∈ {0.1, 0.2, 0.4, 0.6}, 3 seeds",
    quick_description="800 client updates a run, FedAsync α ∈ {0.1, 0.3, 0.6}, seed 0 "
                      "(a few minutes on 2 cores)",
)

__all__ = ["FEDBUFF", "FULL", "QUICK", "run_fedbuff"]
