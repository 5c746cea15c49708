"""The ``summary.json`` of a run, whichever engine ran it: its config, status, accuracy,
rounds to target, the engine (``execution.mode``) and its settings, the server optimizer
with every hyperparameter, the privacy spent; the driver (``fedax.experiments.run``) and
the network engine (``fedax.runtime.launch``) both write it."""

from __future__ import annotations

import math
from typing import Any

from fedax.builder.privacy_plan import PrivacyPlan
from fedax.experiments.outputs import with_status
from fedax.simulation import Execution, History, rounds_to_target
from fedax.spec.config import Config, config_to_dict, resolved_server_optimizer


def summarize(config: Config, records: list[dict[str, Any]], wall: float,
              execution: Execution | dict[str, Any],
              resumed_from: int | None = None, plan: PrivacyPlan | None = None
              ) -> dict[str, Any]:
    """The ``summary.json`` of a run with these evaluation records (possibly none)."""
    history = History([r for r in records if isinstance(r.get("test_accuracy"), (int, float))
                       and math.isfinite(r["test_accuracy"])])
    accs = history.column("test_accuracy")
    target = config.target_accuracy
    reached = history.rounds_to_target(target) if target is not None and accs else None
    per_client = {}
    worst = [r for r in history.records if isinstance(r.get("client_accuracy_worst10"), float)]
    if worst:  # per_client_eval: the target read on the worst decile's curve too
        worst_reached = None if target is None else rounds_to_target(
            [r["round"] for r in worst], [r["client_accuracy_worst10"] for r in worst], target)
        per_client = {
            "final_client_accuracy": {k: v for k, v in worst[-1].items()
                                      if k.startswith("client_accuracy")},
            "rounds_to_target_worst10": None if worst_reached is None
                                        else round(worst_reached, 1)}
    rounds_run = records[-1]["round"] if records else 0
    status = "diverged" if any(with_status(r)["status"] == "diverged" for r in records) \
        else "ok"
    stop = None if plan is None else plan.budget_line(config, rounds_run)
    if stop is not None and status == "ok":
        status = "stopped_by_budget"
    return {
        "config": config_to_dict(config),
        "seed": config.seed,
        "engine": config.execution.mode,  # "sync", "async" or "network": the one that ran
        # "ok", "diverged", or "stopped_by_budget" (privacy.target_epsilon ended the run
        # before config.rounds; stop_reason says when and why)
        "status": status,
        "stop_reason": stop,
        "rounds_run": rounds_run,
        "final_test_accuracy": records[-1]["test_accuracy"] if records else None,
        "best_test_accuracy": max(accs) if accs else None,
        "target_accuracy": target,
        "rounds_to_target": None if reached is None else round(reached, 1),
        "wall_time_s": round(wall, 2),
        "execution": execution._asdict() if hasattr(execution, "_asdict") else execution,
        # name, every hyperparameter, which are defaults (not in the config), the paper
        "server_optimizer": _server_summary(config),
        # the last record: every metric of the last evaluated round (the algorithm's and its
        # aggregator's, a learned η)
        "last_record": records[-1] if records else None,
        "resumed_from_round": resumed_from,
        # ε spent by the rounds run, z, q, the accountant and sampling it assumes
        "privacy": None if plan is None else plan.summary(
            config, rounds_run, records[-1] if records else None),
        **per_client,
    }


def _server_summary(config: Config) -> dict[str, Any]:
    summary = resolved_server_optimizer(config).as_dict()
    if config.server.lr == "learned":  # lr is the initial η; the records hold each round's
        summary["learned_lr"] = config.learned_lr.model_dump()
    return summary
