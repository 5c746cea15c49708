"""``ServerConfig``: how a fedax server schedules rounds and what it accepts."""

from __future__ import annotations

import dataclasses
import math

from fedax.runtime import wire


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """How the server schedules rounds and what it accepts.

    Attributes:
      rounds: T, rounds to run.
      cohort_size: K, accepted reports that close a round early.
      over_selection: select ``ceil(K · (1 + over_selection))`` clients (at most those
        alive), e.g. 0.3.
      min_reports: a round closing at its deadline with fewer accepted reports is retried
        (default K).
      min_clients: alive clients needed before a round is opened (default: the
        selection size).
      deadline_s: seconds a round stays open.
      max_attempts: retries of one round before the run stops with an error.
      poll_interval_s: how long an idle client waits between polls (sent to clients)
        when its poll is not held.
      poll_hold_s: how long the server holds an idle client's poll open, waiting for its
        task (long poll; at most 80% of the caller's own deadline), while fewer than half
        of ``max_workers`` polls are held; a client whose poll is held counts as alive.
      max_idle_polls_per_s: the idle polls the server invites per second, all clients
        together: a poll it does not hold is told to come back after
        ``max(poll_interval_s, alive clients / this)`` seconds (at most half of
        ``liveness_s``), so idle clients cost the server a bounded rate however many
        there are.
      liveness_s: a client counts as alive if it polled within this many seconds.
      max_message_bytes: a larger report is refused (``oversized``).
      chunk_bytes: the largest piece of a streamed message (also bounds every gRPC
        message); a client may ask for smaller pieces at Join.
      checkpoint_dir: where the checkpoint (after every round) and ``rounds.jsonl`` go.
      keep_checkpoints: how many checkpoints are kept (the newest and the ones before).
      max_workers: gRPC handler threads (half of them may hold idle polls; a held poll
        waits on a condition and costs no CPU).
      max_concurrent_rpcs: calls beyond this many are refused (``RESOURCE_EXHAUSTED``)
        before they take a thread.
      per_client_calls: open calls one client may have at once.
      max_concurrent_reports: reports read at the same time (bounds the memory reports
        take: about this many times ``max_message_bytes``); others wait up to 10 s.
      report_read_s: a report stream still being read after this long is cancelled.
      max_examples: the most examples (n_k, and the most weight) a report may claim.
    """

    rounds: int
    cohort_size: int
    over_selection: float = 0.0
    min_reports: int | None = None
    min_clients: int | None = None
    deadline_s: float = 60.0
    max_attempts: int = 10
    poll_interval_s: float = 0.5
    poll_hold_s: float = 20.0
    max_idle_polls_per_s: float = 200.0
    liveness_s: float = 30.0
    max_message_bytes: int = 256 << 20
    chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES
    checkpoint_dir: str | None = None
    keep_checkpoints: int = 3
    max_workers: int = 512
    max_concurrent_rpcs: int = 4096
    per_client_calls: int = 4
    max_concurrent_reports: int = 16
    report_read_s: float = 120.0
    max_examples: int = 1_000_000

    def __post_init__(self):
        checks = [("rounds", self.rounds >= 1), ("cohort_size", self.cohort_size >= 1),
                  ("over_selection", self.over_selection >= 0),
                  ("deadline_s", self.deadline_s > 0),
                  ("min_reports", self.min_reports is None
                   or 1 <= self.min_reports <= self.cohort_size),
                  ("chunk_bytes", 1024 <= self.chunk_bytes <= 64 << 20),
                  ("poll_hold_s", self.poll_hold_s >= 0),
                  ("max_idle_polls_per_s", self.max_idle_polls_per_s > 0),
                  ("keep_checkpoints", self.keep_checkpoints >= 1),
                  ("max_workers", self.max_workers >= 2),
                  ("per_client_calls", self.per_client_calls >= 1),
                  ("max_concurrent_reports", self.max_concurrent_reports >= 1),
                  ("report_read_s", self.report_read_s > 0),
                  ("max_examples", self.max_examples >= 1)]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"server setting {name}={getattr(self, name)!r} is out of "
                                 "range; see fedax server --help")

    @property
    def selection_size(self) -> int:
        return math.ceil(self.cohort_size * (1.0 + self.over_selection) - 1e-9)
