"""A networked round's bookkeeping: the open round, the secret selection, the finite check.

``select`` draws a round's clients with NumPy's generator seeded from the server's secret
(``os.urandom``, never sent) and the round id, so no participant can predict who is
selected, and a resumed server (same secret) selects as it would have. A rehearsal that
must reproduce the simulator seeds it with the config's seed instead (``Server(...,
simulator_seed=seed)``): public, so never in a deployment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from fedax.algorithms.protocol import Reports


class PhaseRound(Protocol):
    """What the report checks read of a round (``_checked_report``): its phase and what
    was sent. An ``OpenRound``; the asynchronous server's trips pass their own."""

    phase: str
    payload: Any


@dataclasses.dataclass
class OpenRound:
    """The open round (guarded by the server's lock)."""

    t: int
    attempt: int
    selected: list[int]
    nonces: dict[int, str]
    shared: bytes  # the round's tensors, serialized once
    payload: Any  # what was sent, as NumPy (the bounds checks compare against it)
    client_keys: np.ndarray  # [C] raw keys of the aggregator's client stage (secret)
    model_version: str
    deadline: float
    started: float
    accepted: dict[int, Reports] = dataclasses.field(default_factory=dict)
    rejected: dict[int, str] = dataclasses.field(default_factory=dict)
    closed: bool = False
    phase: str = "train"  # or "holdout", "evaluate", a SecAgg+ stage ("secagg-keys", ...)
    target: int | None = None  # accepted reports that close it (default: the cohort size)
    own: dict[int, list] = dataclasses.field(default_factory=dict)  # tensors for one client

    def late(self, cid: int, t: int, attempt: int, nonce: str) -> bool:
        """A report this (closed) round issued and has not settled: late, not a fault."""
        return ((t, attempt) == (self.t, self.attempt) and self.nonces.get(cid) == nonce
                and cid not in self.accepted and cid not in self.rejected)

    def header_problem(self, cid: int, t: int, attempt: int, version: str,
                       nonce: str) -> tuple[str, str, bool] | None:
        """Why a report headed ``(t, attempt, version, nonce)`` from client ``cid`` is
        refused by this open round, as ``(kind, reason, whether it excludes the client
        from this round)``; None if the header is right."""
        if (t, attempt) != (self.t, self.attempt):
            return ("wrong-round", f"report for round {t}.{attempt}, the open round is "
                    f"{self.t}.{self.attempt}", True)
        if cid not in self.nonces:
            return ("not-selected", f"client {cid} is not selected for round "
                    f"{self.t}.{self.attempt}", False)
        if version != self.model_version:
            return ("model-version", "the report is on another model version than the "
                    "open round's", True)
        if cid in self.accepted or cid in self.rejected:
            return ("replay", f"client {cid} already reported in round "
                    f"{self.t}.{self.attempt}", False)
        if not secrets.compare_digest(nonce.encode(), self.nonces[cid].encode()):
            return "replay", "the report's nonce is not the one issued for this round", True
        return None


class RoundFailed(RuntimeError):
    """A round got fewer than ``min_reports`` accepted reports ``max_attempts`` times."""


def finite(tree: Any) -> bool:
    """Every float leaf of ``tree`` is finite (a new server state must be)."""
    return all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(tree)
               if jnp.issubdtype(jnp.asarray(a).dtype, jnp.inexact))


def selection_words(secret: bytes) -> list[int]:
    """The seed words of the server's selection stream: SHA-256(secret ‖ "selection")."""
    return [int(w) for w in np.frombuffer(hashlib.sha256(secret + b"selection").digest(),
                                          np.uint32)]


def select(words: list[int], t: int, attempt: int, alive: list[int], count: int) -> list[int]:
    """``count`` of the ``alive`` client ids for round t, attempt ``attempt``, in id order,
    drawn without replacement from ``default_rng([*words, t])`` (``[*words, t, attempt]``
    for a retry). With ``words = [seed]`` and every client alive this is the simulator's
    cohort (``fedax.simulation.PartitionSource``: ``sample_clients(default_rng([seed,
    t]), ...)``)."""
    stream = [*words, t] if attempt == 0 else [*words, t, attempt]
    rng = np.random.default_rng(stream)
    return sorted(int(c) for c in rng.choice(np.asarray(alive), size=count, replace=False))
