"""The ``fedbuff`` paper's runs (``papers/fedbuff.yaml``): synchronous FedAvg, FedBuff and
FedAsync on one virtual clock (:mod:`fedax.simulation.asynchronous`), not config runs. Each
is reused when ``runs/seed<s>/<method>.json`` holds a run of the same setting."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fedax.io import write_json
from fedax.reproduce.paper import Paper

# The settings a run depends on (with its method's own setting and its seed).
_SHARED = ("num_clients", "partition", "model", "local_epochs", "batch_size", "client_lr",
           "concurrency", "latency", "client_updates", "eval_every_updates")
_RECORD = ("round", "test_accuracy", "virtual_time", "client_updates", "mean_staleness")


def _load(settings: Mapping[str, Any], seed: int):
    """The partitioned MNIST, the model and its evaluator, and FedAvg at a server learning
    rate, through the experiment config (so data and model are ``fedax run``'s)."""
    import jax

    from fedax.builder.build import build_algorithm
    from fedax.builder.datasets import build_data
    from fedax.models import get_model
    from fedax.simulation import PartitionSource, make_evaluator
    from fedax.spec.config import validate_config

    config = validate_config({
        "seed": seed, "rounds": 1, "dataset": "mnist", "algorithm": "fedavg",
        "client_fraction": settings["concurrency"] / settings["num_clients"],
        **{k: settings[k] for k in ("num_clients", "partition", "model", "local_epochs",
                                    "batch_size", "client_lr")}})
    data = build_data(config)
    model = get_model(config.model, **data.model_kwargs)
    source = PartitionSource(data.train, config.client_fraction, config.local_epochs,
                             config.batch_size, seed=seed)

    def algorithm(server_lr: float):
        server = config.server.model_copy(update={"lr": server_lr})
        return build_algorithm(config.model_copy(update={"server": server}), model.apply)

    return (model.init(jax.random.key(seed)), source,
            make_evaluator(model.apply, data.x_test, data.y_test), algorithm)


# The paper's asynchronous rows: method -> (K, server lr, the run's async settings).
_ASYNC_METHODS = {
    "fedbuff": lambda fa, setting, m, latency, staleness: (
        setting["buffer_size"], setting["server_lr"],
        fa.fedbuff(setting["buffer_size"], m, latency=latency, staleness=staleness,
                   weighting="algorithm")),
    # FedAsync: K = 1, the server mixes with alpha * s(tau)
    "fedasync": lambda fa, setting, m, latency, staleness: (
        1, setting["alpha"], fa.fedasync(m, latency=latency, staleness=staleness)),
}


def _history(method: str, setting: Mapping[str, Any], settings: Mapping[str, Any], seed: int,
             loaded):
    """One method's run: its history of evaluations on the virtual clock."""
    from fedax.simulation import asynchronous as fa
    from fedax.simulation import choose_execution

    params, source, evaluate, algorithm = loaded
    # One device for every method (run_async's), so sync FedAvg runs the same programs.
    common: dict[str, Any] = {"seed": seed,
                              "execution": choose_execution(params=params, devices=1)}
    latency = fa.Latency(**settings["latency"])
    staleness = fa.Staleness("polynomial", settings["staleness_exponent"])
    updates, every, m = (settings["client_updates"], settings["eval_every_updates"],
                         settings["concurrency"])
    if method == "sync":  # C = M clients a round; a round lasts its slowest trip
        return fa.run_synchronous(algorithm(1.0), params, source, evaluate, latency,
                                  rounds=updates // m, eval_every=max(every // m, 1), **common)
    k, lr, config = _ASYNC_METHODS[method](fa, setting, m, latency, staleness)
    return fa.run_async(algorithm(lr), params, source, evaluate, config,
                        server_updates=updates // k, eval_every=max(every // k, 1), **common)


def _run(out: Path, settings: Mapping[str, Any], seed: int, loaded, log, method: str,
         setting: dict[str, Any], name: str = "") -> dict[str, Any]:
    """One run's summary: virtual time and client updates to each target, accuracies, mean
    staleness and the evaluation records."""
    name = f"seed{seed}/{name or method}"
    path = out / "runs" / f"{name}.json"
    key = json.loads(json.dumps({**setting, "seed": seed,
                                 "settings": {k: settings[k] for k in _SHARED}}))
    if path.exists() and (saved := json.loads(path.read_text())).get("key") == key:
        log(f"   {name}: reused")
        return saved["summary"]
    started = time.perf_counter()
    history = _history(method, setting, settings, seed, loaded())
    records = [{k: r.get(k) for k in _RECORD} for r in history.records]
    stale = [r["mean_staleness"] for r in records if r["mean_staleness"] is not None]
    summary = {
        "name": name, "method": method, "setting": setting,
        "to_target": {f"{t:g}": {x: history.to_target(t, x)
                                 for x in ("virtual_time", "client_updates")}
                      for t in settings["targets"]},
        "final_accuracy": records[-1]["test_accuracy"],
        "best_accuracy": max(r["test_accuracy"] for r in records),
        "virtual_time_end": records[-1]["virtual_time"],
        "mean_staleness": sum(stale) / len(stale) if stale else 0.0,
        "wall_time_s": round(time.perf_counter() - started, 1), "records": records}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"key": key, "summary": summary})
    log(f"   {name}: best accuracy {summary['best_accuracy']:.4f}, {summary['wall_time_s']} s")
    return summary


def run(paper: Paper, settings: Mapping[str, Any], out: Path, *, progress: bool,
        log: Callable[[str], None]) -> dict[str, Any]:
    """Every seed's runs: sync FedAvg, FedBuff and FedAsync at each α of its grid."""
    per_seed = []
    for seed in settings["seeds"]:
        loaded = functools.cache(functools.partial(_load, settings, seed))  # once, if needed
        one = functools.partial(_run, out, settings, seed, loaded, log)
        per_seed.append({
            "seed": seed, "sync": one("sync", {}),
            "fedbuff": one("fedbuff", {"buffer_size": settings["buffer_size"],
                                       "server_lr": settings["fedbuff_server_lr"]}),
            "fedasync": [one("fedasync", {"alpha": a}, f"fedasync_a{a:g}")
                         for a in settings["fedasync_alphas"]]})
    runs = [r for s in per_seed for r in (s["sync"], s["fedbuff"], *s["fedasync"])]
    return {"settings": dict(settings), "per_seed": per_seed,
            "wall_time_s": round(sum(r["wall_time_s"] for r in runs), 1)}
