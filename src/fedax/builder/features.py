"""The features a config adds to a round and what they report: simulated attackers
(``attack_plan``), a robust aggregator, and the run totals of compression and attacks."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from fedax.builder.datasets import FederatedData
from fedax.builder.privacy_plan import compressor
from fedax.spec.config import (
    Config,
)


class AttackPlan(NamedTuple):
    """``config.attack`` made concrete: the data the clients train on (the attackers' part
    corrupted for a data-level attack), the update-level adversary (or None), the
    attackers' population ids, and the backdoor's test set (triggered inputs, target
    labels) or None."""

    data: FederatedData
    adversary: Any
    attackers: np.ndarray
    backdoor: tuple[np.ndarray, np.ndarray] | None

    def summary(self) -> dict[str, Any]:
        return {"num_attackers": len(self.attackers),
                "attackers": [int(k) for k in self.attackers]}


def attack_plan(config: Config, data: FederatedData) -> AttackPlan | None:
    """The attack of ``config.attack`` on ``data`` (None without one); attackers are drawn
    with ``attack.seed`` (default: the run's seed)."""
    a = config.attack
    if a is None:
        return None
    import dataclasses

    from fedax import attacks

    train = data.train
    num = train.num_clients
    seed = config.seed if a.seed is None else a.seed
    bad = attacks.choose_attackers(num, float(a.fraction), seed)
    parts = [train.client_indices(k) for k in range(num)]
    adversary, backdoor = None, None
    if a.kind == "label_flip":
        classes = int(max(np.max(train.y), np.max(data.y_test))) + 1
        train = dataclasses.replace(train, y=attacks.flip_labels(train.y, parts, bad, classes))
    elif a.kind == "backdoor":
        target = 0 if a.target is None else a.target
        x, y = attacks.poison_backdoor(train.x, train.y, parts, bad, target,
                                       a.poison_fraction or 0.5, seed)
        train = dataclasses.replace(train, x=x, y=y)
        backdoor = attacks.backdoor_test_set(data.x_test, data.y_test, target)
        if a.scale is not None or a.project is not None:  # boosted (model replacement)
            adversary = attacks.scaled(bad, num, factor=a.scale, project=a.project)
    else:
        options = {"sign_flip": {}, "scaled": {"factor": a.scale, "project": a.project},
                   "gaussian": {"stddev": a.stddev}, "alie": {"z": a.z},
                   "ipm": {"epsilon": a.epsilon}}[a.kind]
        keep_none = {"factor", "project", "z"}  # None means the paper's default there
        adversary = attacks.UPDATE_ATTACKS[a.kind](
            bad, num, **{k: v for k, v in options.items() if v is not None or k in keep_none})
    return AttackPlan(data._replace(train=train), adversary, bad, backdoor)


class RoundTally:
    """Sums of round metrics over the rounds a run goes through: ``on_round`` is a round
    callback; as an evaluation callback it records nothing, but its ``on_resume`` marks a
    resumed run, whose rounds before the checkpoint it has not seen (``total`` is then
    None)."""

    def __init__(self, names: tuple[str, ...]):
        self.sums: dict[str, Any] = dict.fromkeys(names)  # None: no round reported it
        self.resumed = False

    def __call__(self, record: dict[str, Any]) -> None:
        del record

    def on_resume(self, records: list[dict[str, Any]]) -> None:
        del records
        self.resumed = True

    def on_round(self, number: int, metrics: dict[str, Any], data: Any) -> None:
        del number, data
        for name in self.sums:
            if name in metrics:
                self.sums[name] = (self.sums[name] or 0) + np.asarray(metrics[name]).item()

    def total(self, name: str) -> Any:
        """The sum of ``name`` over every round of the run (None: resumed, or not
        reported)."""
        return None if self.resumed else self.sums[name]


TALLIED = ("uplink_bytes", "attackers_in_cohort", "attackers_selected", "local_steps_total")


def compression_summary(config: Config, params: Any, tally: RoundTally) -> dict[str, Any]:
    """``summary.json``'s ``compression``: the scheme, one client's message (its codes,
    and with its ``float32`` weight, as each round's ``uplink_bytes`` counts it per accepted
    client), the uncompressed message (the ``float32`` update and the weight), their ratio,
    and the uplink of every round run."""
    from fedax.aggregators.compression import uplink_sizes

    assert config.compression is not None  # only a run with compression has one
    code = compressor(config)
    sizes = uplink_sizes(code, params)
    return {"scheme": config.compression.scheme, "compressor": code.name,
            "code_bytes_per_client": sizes.code_bytes,
            "bytes_per_client": sizes.client_bytes,
            "uncompressed_bytes_per_client": sizes.uncompressed_bytes,
            "compression_ratio": sizes.ratio,
            # null for a resumed run (the rounds before its checkpoint are not counted)
            "uplink_bytes_total": tally.total("uplink_bytes")}


def feature_summaries(config: Config, params: Any, attack: AttackPlan | None,
                      tally: RoundTally) -> dict[str, Any]:
    """The ``attack``, ``compression`` and ``local_stopping`` entries of ``summary.json``
    (those the config has): the attackers, and over the rounds run the attackers' accepted
    messages (``attackers_in_cohort_total``) and those Krum selected; the compression's
    sizes; the stopping rule and the local steps the clients took in all."""
    out: dict[str, Any] = {}
    rule = config.client.stopping_rule()
    if rule is not None:
        out["local_stopping"] = {
            "rule": config.client.stopping, **rule._asdict(),
            # null for a resumed run (the rounds before its checkpoint are not counted)
            "local_steps_total": tally.total("local_steps_total")}
    if attack is not None:
        out["attack"] = {**attack.summary(),
                         "attackers_in_cohort_total": tally.total("attackers_in_cohort")}
        if tally.sums["attackers_selected"] is not None:
            out["attack"]["attackers_selected_total"] = tally.total("attackers_selected")
    if config.compression is not None:
        out["compression"] = compression_summary(config, params, tally)
    return out


def with_backdoor(evaluate, backdoor):
    """``evaluate`` plus ``backdoor_success``: the accuracy on the triggered test inputs
    labelled with the target (the backdoor's success rate)."""

    def both(params):
        result = evaluate(params)
        if not isinstance(result, dict):
            result = {"test_accuracy": result[0], "test_loss": result[1]}
        return {**result, "backdoor_success": backdoor(params)[0]}

    return both
