"""The server's phases after a round's aggregate (``Server.phases``; ``fedax.runtime.
holdout`` has the math), each a second open round with its own kind of task, its
attempts numbered from ``HOLDOUT_ATTEMPTS`` and its reports checked as any report is
(exact arrays, finite, the bounds re-checked here):

* **holdout** (a learned server learning rate): after round t's reports are aggregated with
  the tangent of the new model in u = log η, ``holdout_clients`` clients get (x_{t+1}, v)
  and report their loss and its JVP, n_k an integer in [0, max_examples]; the
  hyper-optimizer's step sets the next round's η. Not with the simulator's randomness, the
  holdout clients are drawn from the server's secret, apart from the training cohort's.
* **evaluate** (``per_client_eval``): at the rounds ``client_eval(t)`` says, every alive
  client gets x_{t+1} and reports its test sums on its own test data (correct ≤ count,
  loss ≥ 0); the record gets the distribution over clients, as the simulator's.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import numpy as np

from fedax.algorithms.protocol import apply_reports
from fedax.runtime import store, wire
from fedax.runtime.checks import decoded_report
from fedax.runtime.holdout import (
    HOLDOUT_ATTEMPTS,
    LearnedLR,
    differentiated_step,
    eval_report_template,
    holdout_report_template,
    require_lr,
)
from fedax.runtime.rounds import PhaseRound, RoundFailed, select, selection_words

log = logging.getLogger("fedax.runtime.server")


class Phases:
    """A server's holdout and evaluate phases: ``learned`` (a ``LearnedLR``, None when the
    task's server learning rate is fixed), ``aggregate`` (a learned rate's differentiated
    step), ``holdout`` and ``evaluate`` (each an open round of its own), the checks of
    their reports, and the learned rate's part of the checkpoint."""

    def __init__(self, server: Any, built: Any, staged: bool):
        self.server = server
        self.learned: LearnedLR | None = None
        self._tangent: Any = None
        self._layouts = {
            phase: (wire.expected_layout(template), jax.tree.structure(template))
            for phase, template in (("holdout", holdout_report_template()),
                                    ("evaluate", eval_report_template()))}
        if built.learned is None:
            return
        init_lr, hyper_lr, holdout = built.learned
        require_lr(server.state)
        self.learned = LearnedLR.create(init_lr, hyper_lr, holdout)
        pieces = server.pieces

        def step(pieces, state, reports, client_keys, real, key):
            return apply_reports(pieces, state, reports, key, keep=real,
                                 client_keys=client_keys, staged=staged)

        self._learned_step = jax.jit(lambda s, u, r, k, m, key: differentiated_step(
            step, pieces, s, u, r, k, m, key))

    def aggregate(self, state: Any, stacked: Any, keys: Any, real: Any,
                  key: Any) -> tuple[Any, Any]:
        """A round's new state and metrics with the learned rate, keeping the tangent of
        the new model in u = log η for the holdout phase."""
        assert self.learned is not None  # (only with a learned server learning rate)
        new, metrics, self._tangent = self._learned_step(state, self.learned.u, stacked, keys,
                                                         real, key)
        return new, metrics

    def checked(self, r: PhaseRound, env: Any) -> tuple[Any, tuple[str, str] | None]:
        """A holdout or evaluate report decoded and its numbers checked."""
        report, problem = decoded_report(env.tensors, *self._layouts[r.phase])
        if problem is None and r.phase == "holdout":
            n, most = float(report.num_examples), self.server.config.max_examples
            if not (0 <= n <= most and n == int(n)):
                problem = ("bounds", f"num_examples {n:g} is not an integer in [0, {most}]")
        elif problem is None:
            correct, loss, count = (float(v) for v in report)
            if not (count == int(count) and 0 <= correct <= count and loss >= 0):
                problem = ("bounds", f"test sums (correct {correct:g}, loss {loss:g}, count "
                                     f"{count:g}) are not 0 <= correct <= count, loss >= 0")
        return report, problem

    def holdout(self, t: int, state: Any) -> dict[str, float]:
        """Round t's holdout phase on the new ``state``; returns its metrics."""
        learned = self.learned
        assert learned is not None  # (only with a learned server learning rate)
        params = self.server.pieces.server_params(state.server)
        sent = {"payload": {"params": params, "tangent": self._tangent}}
        reports = self._collect(t, "holdout", sent, learned.holdout_clients, b"holdout")
        metrics = learned.step(reports)
        log.info("round %d holdout: loss %.4g, η %.4g -> %.4g", t, metrics["holdout_loss"],
                 metrics["server_lr"], float(np.exp(learned.u)))
        return metrics

    def evaluate(self, t: int, state: Any) -> dict[str, float]:
        """Every alive client's test sums at the new model: the distribution over the
        clients with test data (``fedax.simulation.evaluation.distribution``)."""
        from fedax.simulation.evaluation import ClientScores, distribution

        sent = {"payload": {"params": self.server.pieces.server_params(state.server)}}
        reports = self._collect(t, "evaluate", sent, None, b"evaluate")
        count = np.array([float(r.count) for r in reports])
        safe = np.maximum(count, 1.0)
        scores = ClientScores(np.array([float(r.correct) for r in reports]) / safe,
                              np.array([float(r.loss) for r in reports]) / safe, count)
        return distribution(scores, self.server.client_eval_target)

    def _collect(self, t: int, phase: str, sent: Any, count: int | None,
                 tag: bytes) -> list[Any]:
        """An open round of ``phase`` tasks for ``count`` alive clients (None: all of
        them); returns their reports in client-id order once every one has reported."""
        server, need = self.server, count or 1
        for attempt in range(server.config.max_attempts):
            alive = server._wait_alive(need, f"the {phase} phase's clients")
            if alive is None:
                raise RoundFailed(f"the server stopped during round {t}'s {phase} phase")
            words = ([server._simulator_seed] if server._simulator_seed is not None
                     else selection_words(server._secret + tag))
            # attempt 1 + a: the simulator's holdout stream default_rng([seed, t, 1])
            selected = select(words, t, 1 + attempt, alive, count or len(alive))
            r = server._publish(t, HOLDOUT_ATTEMPTS + attempt, selected,
                                jax.device_get(sent), {}, np.zeros((0,)), phase=phase,
                                target=len(selected))
            closed = server._close(r)
            record, accepted = closed["record"], closed["accepted"]
            if len(accepted) == len(selected):
                return [accepted[c] for c in sorted(accepted)]
            record.update(status="retry", phase=phase,
                          round_s=round(time.monotonic() - r.started, 4))
            server.checkpoints.log_record(record)
        raise RoundFailed(f"round {t}'s {phase} phase did not hear from every client it "
                          f"selected in {server.config.max_attempts} attempts; start more "
                          "clients")

    def checkpoint(self) -> dict[str, Any]:
        """The learned rate's hyper-state, for the server's checkpoint."""
        return {} if self.learned is None else {"hyper": store.encode(self.learned.state())}

    def restore(self, data: dict[str, Any]) -> None:
        if self.learned is not None and "hyper" in data:
            template = jax.eval_shape(self.learned.state)
            self.learned.restore(store.decode(data["hyper"], template, "checkpoint"))
