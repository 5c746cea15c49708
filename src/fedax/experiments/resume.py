"""What identifies a run for resuming (its fingerprint), where an unfinished run stands,
and which config keys a resume may change (its schedule: ``rounds`` may grow)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedax.builder.privacy_plan import PrivacyPlan
from fedax.spec.config import (
    Config,
    ShakespeareConfig,
    SyntheticConfig,
    config_to_dict,
)

# Keys added after checkpoints existed: left out of the fingerprint at their defaults, so
# those checkpoints still resume.
_LATER_KEYS = {"synthetic": SyntheticConfig().model_dump(mode="json"),
               "shakespeare": ShakespeareConfig().model_dump(mode="json"),
               "stragglers": 0.0, "drop_stragglers": False, "max_rejected_fraction": 0.5,
               "per_client_eval": False, "precision": "float32"}


def _fingerprint(config: Config) -> dict[str, Any]:
    return {k: v for k, v in config_to_dict(config).items()
            if k != "checkpoint_every" and not (k in _LATER_KEYS and v == _LATER_KEYS[k])}


def _config_items(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The config's items of a checkpoint's fingerprint, by dotted key (``privacy.clip``)."""
    return {k[len("config."):]: v for k, v in fingerprint.items()
            if str(k).startswith("config.")}


def _differ(saved: dict[str, Any], wanted: dict[str, Any], schedule: Any) -> list[str]:
    from fedax.simulation.checkpoint import fingerprint_differences

    def rest(items):
        return {k: v for k, v in items.items() if k not in schedule}

    return fingerprint_differences(rest(saved), rest(wanted))


def run_progress(config: Config, out: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Where an unfinished run of ``config`` in ``out`` stands, read (never changed) from its
    newest readable checkpoint if ``config`` continues it (its fingerprint is ``config``'s,
    ``rounds`` aside when no more than ``config.rounds`` are done and no noise multiplier
    was calibrated to them): ``{"round", "records", "elapsed_s"}``, the records being those
    a resume continues from. None when ``out`` holds no such checkpoint (no run, another
    config's, or checkpoints off)."""
    from fedax.simulation import checkpoint as ckpt
    from fedax.simulation.schedule import flat_items

    data = ckpt.newest_readable(Path(out) / "checkpoints")
    if data is None:
        return None
    calibrated = config.privacy is not None and config.privacy.noise_multiplier is None
    if _differ(_config_items(data["fingerprint"]), dict(flat_items(_fingerprint(config), "")),
               () if calibrated else ("rounds",)) or int(data["round"]) > config.rounds:
        return None
    return {"round": int(data["round"]), "records": list(data["history"]),
            "elapsed_s": float(data["elapsed_s"])}


def resume_schedule(config: Config, out: str | os.PathLike[str],
                    plan: PrivacyPlan | None = None,
                    plan_for: Callable[[Config], PrivacyPlan | None] | None = None,
                    ) -> tuple[str, ...]:
    """The config keys in which ``config`` may differ from the run it resumes in ``out``
    (the newest readable checkpoint's): its schedule. ``rounds`` may grow, the resumed run's
    records being those of an uninterrupted run of the new length; with the noise
    multiplier given, ``privacy.target_epsilon`` may change (with z fixed a budget only
    ends the run) and a z the run had calibrated may now be given
    (``privacy.noise_multiplier``). ``plan`` is ``config``'s privacy plan and
    ``plan_for(config)`` makes one (for the z a run calibrated).

    Raises:
      ResumeError: the checkpoint is of this run (its schedule aside), but the run cannot
        be continued to ``config``'s schedule: it has done more rounds than ``config`` (or
        its budget) allows, or its z was calibrated to another number of rounds. Its
        ``settings`` say under which values it can. Nothing has been changed.
    """
    from fedax.simulation import checkpoint as ckpt
    from fedax.simulation.schedule import flat_items

    schedule = ["rounds"]
    data = ckpt.newest_readable(Path(out) / "checkpoints")
    if data is None:
        return tuple(schedule)
    saved = _config_items(data["fingerprint"])
    wanted = dict(flat_items(_fingerprint(config), ""))
    p = config.privacy
    old_rounds = saved.get("rounds")
    if p is not None and p.noise_multiplier is not None:
        schedule.append("privacy.target_epsilon")
        if saved.get("privacy.noise_multiplier", 0) is None and plan_for is not None \
                and isinstance(old_rounds, int):  # calibrated then, given now
            then = p.model_copy(update={"noise_multiplier": None,
                                        "target_epsilon": saved.get("privacy.target_epsilon")})
            old = plan_for(config.model_copy(update={"rounds": old_rounds, "privacy": then}))
            if old is not None and old.noise_multiplier == p.noise_multiplier:
                schedule.append("privacy.noise_multiplier")
    if _differ(saved, wanted, schedule):
        return tuple(schedule)  # another run's: the runner names the differences
    done = int(data["round"])
    if p is not None and p.noise_multiplier is None and old_rounds != config.rounds \
            and isinstance(old_rounds, int) and plan_for is not None:
        old = plan_for(config.model_copy(update={"rounds": old_rounds}))
        assert old is not None  # config has privacy: it has a plan
        z = old.noise_multiplier
        allows = old.ledger.rounds_within(p.target_epsilon, max_rounds=max(config.rounds, 1))
        raise ckpt.ResumeError(
            f"its noise multiplier z = {z!r} was calibrated to rounds={old_rounds} "
            f"(privacy.target_epsilon={p.target_epsilon:g} without privacy.noise_multiplier), "
            f"and rounds={config.rounds} would change it; to extend the run, fix its z "
            f"(privacy.noise_multiplier={z!r}) and raise or drop the budget (at that z, "
            f"{p.target_epsilon:g} allows {allows} rounds)",
            settings=[f"privacy.noise_multiplier={z!r}", "privacy.target_epsilon=null"])
    if done > config.rounds:
        raise ckpt.ResumeError(f"it has done {done} rounds, more than rounds={config.rounds}",
                               settings=[f"rounds={max(done, old_rounds or 0)}"])
    if plan is not None and done > plan.rounds:
        assert p is not None  # a privacy plan is of config.privacy
        raise ckpt.ResumeError(
            f"it has done {done} rounds, more than privacy.target_epsilon="
            f"{p.target_epsilon:g} allows at noise multiplier {plan.noise_multiplier:g} "
            f"({plan.rounds}); give a budget that allows them")
    return tuple(schedule)
