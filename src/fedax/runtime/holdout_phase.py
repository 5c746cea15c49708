"""The server's phases after a round's aggregate (a ``Server`` mixin; ``fedax.runtime.
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
from fedax.runtime.server_base import ServerBase

log = logging.getLogger("fedax.runtime.server")


class HoldoutPhase(ServerBase):
    """Mixin of ``fedax.runtime.server.Server``: ``learned`` (a ``LearnedLR``, None when
    the task's server learning rate is fixed) and its holdout phase."""

    learned: LearnedLR | None = None
    _tangent: Any = None
    # per_client_eval: whether to evaluate on the clients after round t (t rounds done),
    # and the accuracy ``client_accuracy_above_target`` counts against
    client_eval: Any = None
    client_eval_target: float | None = None

    def _setup_phases(self, built: Any, staged: bool) -> None:
        self._phase_layouts = {
            phase: (wire.expected_layout(template), jax.tree.structure(template))
            for phase, template in (("holdout", holdout_report_template()),
                                    ("evaluate", eval_report_template()))}
        if built.learned is None:
            return
        init_lr, hyper_lr, holdout = built.learned
        require_lr(self.state)
        self.learned = LearnedLR.create(init_lr, hyper_lr, holdout)
        pieces = self.pieces

        def step(pieces, state, reports, client_keys, real, key):
            return apply_reports(pieces, state, reports, key, keep=real,
                                 client_keys=client_keys, staged=staged)

        self._learned_step = jax.jit(lambda s, u, r, k, m, key: differentiated_step(
            step, pieces, s, u, r, k, m, key))

    def _learned_aggregate(self, state: Any, stacked: Any, keys: Any, real: Any,
                           key: Any) -> tuple[Any, Any]:
        assert self.learned is not None  # (only with a learned server learning rate)
        new, metrics, self._tangent = self._learned_step(state, self.learned.u, stacked, keys,
                                                         real, key)
        return new, metrics

    def _checked_report(self, r: PhaseRound, env: Any) -> tuple[Any, tuple[str, str] | None]:
        """A report decoded and checked for the open round's phase."""
        if r.phase == "train":
            report, problem = decoded_report(env.tensors, self._report_layout,
                                             self._report_treedef)
            return report, problem or (None if report is None
                                       else self._checks.check(report, r.payload))
        report, problem = decoded_report(env.tensors, *self._phase_layouts[r.phase])
        if problem is None and r.phase == "holdout":
            n = float(report.num_examples)
            if not (0 <= n <= self.config.max_examples and n == int(n)):
                problem = ("bounds", f"num_examples {n:g} is not an integer in [0, "
                                     f"{self.config.max_examples}]")
        elif problem is None:
            correct, loss, count = (float(v) for v in report)
            if not (count == int(count) and 0 <= correct <= count and loss >= 0):
                problem = ("bounds", f"test sums (correct {correct:g}, loss {loss:g}, count "
                                     f"{count:g}) are not 0 <= correct <= count, loss >= 0")
        return report, problem

    def _holdout(self, t: int, state: Any) -> dict[str, float]:
        """Round t's holdout phase on the new ``state``; returns its metrics."""
        learned = self.learned
        assert learned is not None  # (only with a learned server learning rate)
        params = self.pieces.server_params(state.server)
        sent = {"payload": {"params": params, "tangent": self._tangent}}
        reports = self._collect(t, "holdout", sent, learned.holdout_clients, b"holdout")
        metrics = learned.step(reports)
        log.info("round %d holdout: loss %.4g, η %.4g -> %.4g", t, metrics["holdout_loss"],
                 metrics["server_lr"], float(np.exp(learned.u)))
        return metrics

    def _client_eval(self, t: int, state: Any) -> dict[str, float]:
        """Every alive client's test sums at the new model: the distribution over the
        clients with test data (``fedax.simulation.evaluation.distribution``)."""
        from fedax.simulation.evaluation import ClientScores, distribution

        sent = {"payload": {"params": self.pieces.server_params(state.server)}}
        reports = self._collect(t, "evaluate", sent, None, b"evaluate")
        count = np.array([float(r.count) for r in reports])
        safe = np.maximum(count, 1.0)
        scores = ClientScores(np.array([float(r.correct) for r in reports]) / safe,
                              np.array([float(r.loss) for r in reports]) / safe, count)
        return distribution(scores, self.client_eval_target)

    def _collect(self, t: int, phase: str, sent: Any, count: int | None,
                 tag: bytes) -> list[Any]:
        """An open round of ``phase`` tasks for ``count`` alive clients (None: all of
        them); returns their reports in client-id order once every one has reported."""
        need = count or 1
        for attempt in range(self.config.max_attempts):
            alive = self._wait_alive(need, f"the {phase} phase's clients")
            if alive is None:
                raise RoundFailed(f"the server stopped during round {t}'s {phase} phase")
            words = ([self._simulator_seed] if self._simulator_seed is not None
                     else selection_words(self._secret + tag))
            # attempt 1 + a: the simulator's holdout stream default_rng([seed, t, 1])
            selected = select(words, t, 1 + attempt, alive, count or len(alive))
            r = self._publish(t, HOLDOUT_ATTEMPTS + attempt, selected,
                              jax.device_get(sent), {}, np.zeros((0,)), phase=phase,
                              target=len(selected))
            closed = self._close(r)
            record, accepted = closed["record"], closed["accepted"]
            if len(accepted) == len(selected):
                return [accepted[c] for c in sorted(accepted)]
            record.update(status="retry", phase=phase,
                          round_s=round(time.monotonic() - r.started, 4))
            self._log(record)
        raise RoundFailed(f"round {t}'s {phase} phase did not hear from every client it "
                          f"selected in {self.config.max_attempts} attempts; start more "
                          "clients")

    def _learned_checkpoint(self) -> dict[str, Any]:
        return {} if self.learned is None else {"hyper": store.encode(self.learned.state())}

    def _learned_restore(self, data: dict[str, Any]) -> None:
        if self.learned is not None and "hyper" in data:
            template = jax.eval_shape(self.learned.state)
            self.learned.restore(store.decode(data["hyper"], template, "checkpoint"))
