"""A run's schedule: when it evaluates, records, saves a checkpoint and stops, how it
resumes, and when it has diverged. Both simulated engines drive their steps through one
``Schedule`` (the round runner, ``fedax.simulation.run``, where a step is a round, and
FedBuff's virtual clock, ``fedax.simulation.asynchronous.run_async``, where it is a server
update), so that a record, a checkpoint, a resume and a divergence mean the same in both.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fedax.simulation import checkpoint as ckpt
from fedax.simulation.history import Callback, DivergenceError, round_metrics


def flat_items(tree: Mapping[str, Any], prefix: str):
    """``(dotted key, leaf)`` of a nested mapping, each key starting with ``prefix``."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from flat_items(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def run_identity(init_params: Any, execution: Any, source: Any,
                 fingerprint: Mapping[str, Any] | None, **arguments: Any) -> dict[str, Any]:
    """What identifies a run for resuming (every engine's checkpoints hold it): its
    arguments, the execution strategy (others give close but not bit-identical numbers),
    SHA-256 of the initial params, the cohort source's own items (for a data set, SHA-256
    of the training data), plus the caller's ``fingerprint`` items (prefixed ``config.``,
    nested keys dotted)."""
    items: dict[str, Any] = dict(arguments)
    items.update(source.identity())
    items.update({f"execution.{k}": v for k, v in execution._asdict().items()})
    items["init_params.sha256"] = ckpt.tree_sha256(init_params)
    for key, value in flat_items(fingerprint or {}, "config."):
        items[key] = value
    return items


def check_schedule(eval_every: int, checkpoint_every: int, resume: bool,
                   checkpoint_dir: Any) -> None:
    """The evaluation and checkpoint settings every runner takes (``ValueError`` naming the
    bad one)."""
    if eval_every < 1:
        raise ValueError(f"eval_every must be >= 1, got {eval_every}.")
    if checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}.")
    if (checkpoint_every or resume) and checkpoint_dir is None:
        raise ValueError("checkpoint_every > 0 and resume=True need a checkpoint_dir.")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When a run of ``steps`` steps (rounds, or server updates) records, saves and stops.

    Attributes:
      steps: T. A resumed run may have more steps than the run it continues (not fewer
        than its checkpoint has done: ``ResumeError``).
      eval_every: record (and evaluate) after every k-th step and after the last one.
      target_accuracy: the accuracy ``rounds_to_target`` is read against.
      stop_at_target: end the run at the first record that reaches the target.
      checkpoint_dir: where checkpoints ``ckpt_<step>.msgpack`` go (the last two kept).
      checkpoint_every: save after every k-th step and after the last one (and at an early
        stop); 0 saves none. A fresh run that saves checkpoints first deletes old ones.
      resume: continue from the newest checkpoint in ``checkpoint_dir`` that verifies (a bad
        newer one is skipped with a ``CheckpointWarning``); with none there, start from step
        0 with a warning. It must be the same run's (``CheckpointError`` names what differs).
      max_rejected_fraction: a step in which more than this fraction of the clients' updates
        were not finite (they are left out and counted) stops the run with
        ``DivergenceError``, as does a server model that is not finite; either way before
        that step is saved.
      stop_on_divergence: False records a diverged run to the end instead (a sweep).
      record_fields: ``record_fields(step) -> dict`` of more values for that step's record
        (e.g. the ε spent), added before it is saved or passed on.
      step_name: what a step is called in messages (``round``, ``server update``).
    """

    steps: int
    eval_every: int = 1
    target_accuracy: float | None = None
    stop_at_target: bool = False
    checkpoint_dir: str | os.PathLike[str] | None = None
    checkpoint_every: int = 0
    resume: bool = False
    max_rejected_fraction: float = 0.5
    stop_on_divergence: bool = True
    record_fields: Callable[[int], Mapping[str, Any]] | None = None
    step_name: str = "round"

    def __post_init__(self):
        if self.steps < 1:
            name = "rounds" if self.step_name == "round" else "server_updates"
            raise ValueError(f"{name} must be >= 1, got {self.steps}.")
        check_schedule(self.eval_every, self.checkpoint_every, self.resume,
                       self.checkpoint_dir)
        if not 0.0 <= self.max_rejected_fraction <= 1.0:
            raise ValueError(f"max_rejected_fraction must be in [0, 1], got "
                             f"{self.max_rejected_fraction}.")

    # ------------------------------------------------------------------ when

    def records_at(self, step: int) -> bool:
        """Whether step ``step`` (1-based: steps done) is recorded."""
        return step % self.eval_every == 0 or step == self.steps

    def saves_at(self, step: int) -> bool:
        """Whether a checkpoint is due after step ``step`` (the last one too)."""
        return bool(self.checkpoint_every) and (step % self.checkpoint_every == 0
                                                or step == self.steps)

    def reached(self, record: Mapping[str, Any]) -> bool:
        """Whether ``record`` ends the run at its target (``stop_at_target``)."""
        return (self.stop_at_target and self.target_accuracy is not None
                and record.get("test_accuracy", -math.inf) >= self.target_accuracy)

    # ------------------------------------------------------------------ records

    def record(self, step: int, evaluation: Mapping[str, Any], metrics: Mapping[str, Any],
               fields: Mapping[str, Any], elapsed_s: float) -> dict[str, Any]:
        """Step ``step``'s record: its ``evaluation``, ``train_loss``, the engine's own
        ``fields``, every other metric of the step (``round_metrics``), ``record_fields``
        and ``elapsed_s``."""
        record: dict[str, Any] = {"round": step, **evaluation}
        if "train_loss" in metrics:
            record.setdefault("train_loss", float(metrics["train_loss"]))
        record.update(fields)
        for name, value in round_metrics(metrics).items():
            record.setdefault(name, value)
        if self.record_fields is not None:
            record.update(self.record_fields(step))
        record["elapsed_s"] = elapsed_s
        return record

    # ------------------------------------------------------------------ divergence

    def check_step(self, step: int, metrics: Mapping[str, Any], rejected: int, of: int,
                   updates: str = "clients sent non-finite updates",
                   fix: str = "lower client_lr, or check those clients' data") -> None:
        """``DivergenceError`` (with ``stop_on_divergence``) where step ``step``'s server
        model is not finite or more than ``max_rejected_fraction`` of its ``of`` updates
        were rejected as not finite."""
        if not self.stop_on_divergence:
            return
        if not bool(metrics["server_finite"]):
            raise DivergenceError(
                f"{self.step_name} {step}: the server model is no longer finite (NaN or "
                "inf); lower client_lr or server.lr", step)
        if rejected > self.max_rejected_fraction * of:
            raise DivergenceError(
                f"{self.step_name} {step}: {rejected} of {of} {updates}, more than "
                f"max_rejected_fraction={self.max_rejected_fraction}; {fix}", step)

    # ------------------------------------------------------------------ checkpoints

    def restore(self, template: Any, identity: Mapping[str, Any] | None,
                ignore: Sequence[str] = ()) -> ckpt.Checkpoint | None:
        """With ``resume``, the newest checkpoint restored into ``template`` (its structure
        and placement); None (with a warning) where there is none. A fresh run that saves
        checkpoints first removes the old ones."""
        if not self.resume:
            if self.checkpoint_every and self.checkpoint_dir is not None:
                ckpt.remove_checkpoints(self.checkpoint_dir)
            return None
        assert self.checkpoint_dir is not None  # (__post_init__)
        restored = ckpt.latest_checkpoint(self.checkpoint_dir, template, identity,
                                          ignore=ignore)
        if restored is None:
            warnings.warn(f"resume: no checkpoint in {self.checkpoint_dir}; starting from "
                          f"{self.step_name} 0", ckpt.CheckpointWarning, stacklevel=3)
            return None
        if restored.round > self.steps:
            plural = "rounds" if self.step_name == "round" else "server updates"
            raise ckpt.ResumeError(
                f"checkpoint {restored.path} is of {self.step_name} {restored.round}, after "
                f"this run's last {self.step_name} {self.steps}: a resumed run cannot have "
                f"fewer {plural} than it has done")
        return restored

    def save(self, step: int, state: Any, records: Sequence[Mapping[str, Any]],
             identity: Mapping[str, Any] | None, elapsed_s: float,
             counters: Mapping[str, Any] | None = None) -> None:
        """Checkpoint ``state`` after step ``step`` with the records so far."""
        assert self.checkpoint_dir is not None  # (__post_init__: checkpoint_every needs it)
        ckpt.save_checkpoint(self.checkpoint_dir, step, state, history=list(records),
                             fingerprint=identity, elapsed_s=elapsed_s, counters=counters)


def notify_resume(callbacks: Sequence[Callback], records: Sequence[Mapping[str, Any]]
                  ) -> None:
    """Each callback's ``on_resume`` (where it has one) with the restored records."""
    for callback in callbacks:
        on_resume = getattr(callback, "on_resume", None)
        if on_resume is not None:
            on_resume(list(records))


__all__ = ["Schedule", "check_schedule", "flat_items", "notify_resume", "run_identity"]
