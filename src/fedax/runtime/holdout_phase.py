"""The server's holdout phase for a learned server learning rate (``fedax.runtime.holdout``
has the math): a ``Server`` mixin. After round t's reports are aggregated with the tangent
of the new model in u = log η, a second open round of ``holdout_clients`` clients
(attempts numbered from ``HOLDOUT_ATTEMPTS``) sends them (x_{t+1}, v); their reports are
checked (exact arrays, finite, n_k an integer in [0, max_examples]) as any report is, and
the hyper-optimizer's step sets the next round's η. Not with the simulator's randomness,
the holdout clients are drawn from the server's secret, apart from the training cohort's.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import numpy as np

from fedax.runtime import store, wire
from fedax.runtime.checks import decoded_report
from fedax.runtime.holdout import (
    HOLDOUT_ATTEMPTS,
    LearnedLR,
    differentiated_step,
    holdout_report_template,
    holdout_template,
    require_lr,
)
from fedax.runtime.rounds import OpenRound, RoundFailed, select, selection_words
from fedax.runtime.task import server_step

log = logging.getLogger("fedax.runtime.server")


class HoldoutPhase:
    """Mixin of ``fedax.runtime.server.Server``: ``learned`` (a ``LearnedLR``, None when
    the task's server learning rate is fixed) and its holdout phase."""

    learned: LearnedLR | None = None
    _tangent: Any = None

    def _setup_learned(self, built: Any, staged: bool) -> None:
        if built.learned is None:
            return
        init_lr, hyper_lr, holdout = built.learned
        require_lr(self.state)
        self.learned = LearnedLR.create(init_lr, hyper_lr, holdout)
        template = holdout_report_template()
        self._holdout_layout = wire.expected_layout(template)
        self._holdout_treedef = jax.tree.structure(template)
        self._holdout_sent = holdout_template(built.params)
        pieces = self.pieces
        self._learned_step = jax.jit(lambda s, u, r, k, m, key: differentiated_step(
            server_step, pieces, s, u, r, k, m, key, staged))

    def _learned_aggregate(self, state: Any, stacked: Any, keys: Any, real: Any,
                           key: Any) -> tuple[Any, Any]:
        new, metrics, self._tangent = self._learned_step(state, self.learned.u, stacked, keys,
                                                         real, key)
        return new, metrics

    def _checked_report(self, r: OpenRound, env: Any) -> tuple[Any, tuple[str, str] | None]:
        """A report decoded and checked for the open round's phase."""
        if r.phase == "train":
            report, problem = decoded_report(env.tensors, self._report_layout,
                                             self._report_treedef)
            return report, problem or (None if report is None
                                       else self._checks.check(report, r.payload))
        report, problem = decoded_report(env.tensors, self._holdout_layout,
                                         self._holdout_treedef)
        if problem is None:
            n = float(report.num_examples)
            if not (0 <= n <= self.config.max_examples and n == int(n)):
                problem = ("bounds", f"num_examples {n:g} is not an integer in [0, "
                                     f"{self.config.max_examples}]")
        return report, problem

    def _holdout(self, t: int, state: Any) -> dict[str, float]:
        """Round t's holdout phase on the new ``state``; returns its metrics."""
        learned = self.learned
        params = self.pieces.server_params(state.server)
        sent = {"payload": {"params": params, "tangent": self._tangent}}
        for attempt in range(self.config.max_attempts):
            alive = self._wait_alive(learned.holdout_clients)
            if alive is None:
                raise RoundFailed("the server stopped during a holdout phase")
            words = ([self._simulator_seed] if self._simulator_seed is not None
                     else selection_words(self._secret + b"holdout"))
            # attempt 1 + a: the simulator's holdout stream default_rng([seed, t, 1])
            selected = select(words, t, 1 + attempt, alive, learned.holdout_clients)
            r = self._publish(t, HOLDOUT_ATTEMPTS + attempt, selected,
                              jax.device_get(sent), {}, np.zeros((0,)), phase="holdout",
                              target=learned.holdout_clients)
            closed = self._close(r)
            record, accepted = closed["record"], closed["accepted"]
            if len(accepted) == learned.holdout_clients:
                metrics = learned.step([accepted[c] for c in sorted(accepted)])
                log.info("round %d holdout: loss %.4g, η %.4g -> %.4g", t,
                         metrics["holdout_loss"], metrics["server_lr"],
                         float(np.exp(learned.u)))
                return metrics
            record.update(status="retry", phase="holdout",
                          round_s=round(time.monotonic() - r.started, 4))
            self._log(record)
        raise RoundFailed(f"round {t}'s holdout phase got fewer than "
                          f"{learned.holdout_clients} reports in {self.config.max_attempts} "
                          "attempts; start more clients")

    def _learned_checkpoint(self) -> dict[str, Any]:
        return {} if self.learned is None else {"hyper": store.encode(self.learned.state())}

    def _learned_restore(self, data: dict[str, Any]) -> None:
        if self.learned is not None and "hyper" in data:
            template = jax.eval_shape(self.learned.state)
            self.learned.restore(store.decode(data["hyper"], template, "checkpoint"))
