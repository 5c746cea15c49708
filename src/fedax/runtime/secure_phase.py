"""A secure round on the server (``Server.secure``): SecAgg+ (``fedax.runtime.secagg``)
for a task whose aggregator declares ``secure``; ``fedax.runtime.secure_task`` has the
encoding both sides share.

Round t, attempt a, with the n clients selected as for any round:

1. **train + setup** (envelope kind ``task``): the payload, the aggregator's state, the
   client's quantization key k_i and its SecAgg+ ``Setup`` (n, k, t, b, d, a fresh 16-byte
   session id and a fresh public graph seed per attempt, its neighbours); in a rehearsal
   with the simulator's keys also its client-stage key (in a deployment the client draws
   its own, so that noise it adds, distributed DP's, is not known to the server). The
   client trains, runs the aggregator's client stage, encodes and answers its two public
   keys (``PublicKeys``); its update, statistics, sums and n_k never leave it.
2. ``secagg-keys``: each live client's key directory; it answers its encrypted shares.
3. ``secagg-masked``: the shares addressed to it; it answers its masked vector.
4. ``secagg-sign`` (with a roster of the clients' identity keys: the consistency check):
   the survivor sets U2 and U3; it answers its signature on them (stage 1's keys were
   signed too, and checked by each neighbour against the roster).
5. ``secagg-unmask``: the survivors and the dropped among its neighbours (and the
   survivors' signatures); it answers its shares of their self-mask seeds and mask keys.
   The server removes the masks and has the sum mod 2^b of the survivors' vectors, and
   nothing else about any of them.

Each stage is an open round of its own kind (fresh single-use nonces, ``deadline_s`` each,
every reply authenticated by the Gate and its header checked before its body is read, as
a report); its replies are parsed strictly (``secagg`` rejections for bytes that do not
parse, as for any refused report) and handed to ``SecAggServer``, whose own refusals are
counted as ``secagg`` rejections too. A client that misses a deadline has dropped. Then the
sum is split into the client stage's leaves and decoded with the n selected, and
``fedax.algorithms.protocol.apply_reduced`` (the simulator's server stage and update) makes the
new state. Too few clients at any stage (fewer than t, or
fewer than ``min_reports``, checked before anything is unmasked) aborts the attempt, which
is retried as a round with too few reports is; the server then holds masked vectors only.
The record says ``secure_survivors``, ``secure_dropped``, ``secure_step`` (Δ, for a float
sum), k and t, the bytes each stage moved, the server's CPU seconds in the protocol, and
that the clients' training statistics are withheld.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from typing import Any

import jax
import numpy as np

from fedax.aggregators.base import round_keys
from fedax.algorithms.protocol import apply_reduced
from fedax.runtime import store, wire
from fedax.runtime.rounds import OpenRound, PhaseRound
from fedax.runtime.secagg import (
    KeyDirectory,
    SecAggAbort,
    SecAggError,
    SecAggParams,
    SecAggServer,
    ShareDelivery,
    SurvivorSet,
    UnmaskRequest,
    ring_graph,
)
from fedax.runtime.secure_task import (
    KEYS,
    MASKED,
    REPLIES,
    SECURE_KEY_PATH,
    SIGN,
    UNMASK,
    pack,
    protocol_shape,
    secure_keys,
    secure_plan,
    sender,
    unpack,
)
from fedax.runtime.task import broadcast, round_key, stage_key

log = logging.getLogger("fedax.runtime.server")
WITHHELD = "withheld: secure aggregation (train_loss and the clients' statistics stay on them)"


class _Stopped(Exception):
    """The server stopped during a secure round."""


@dataclasses.dataclass
class SecureTranscript:
    """One attempt's protocol, kept for inspection (the last two): the ``SecAggServer``
    (its masked vectors; ``result`` only once unmasked), the kind of message each client
    sent at each stage, and the abort reason if it aborted."""

    round: int
    attempt: int
    protocol: SecAggServer
    received: dict[str, dict[int, str]] = dataclasses.field(default_factory=dict)
    aborted: str | None = None


class SecurePhase:
    """A server's secure rounds (module docstring), for a task whose aggregator declares
    ``secure`` (``create``; None for any other): ``open`` a round's training task,
    ``close`` it through the protocol's stages, and the checks of the stages' replies.
    ``transcripts``: the last two attempts' protocols."""

    def __init__(self, server: Any, plan: Any, shape: tuple, rehearsal: bool,
                 roster: Any = None, signers: int | None = None):
        self.server, self.plan, self.spec = server, plan, plan.spec
        self._shape, self._rehearsal = shape, rehearsal
        self.roster, self._signers = roster, signers
        self._steps: dict[int, Any] = {}
        self.transcripts: collections.deque[SecureTranscript] = collections.deque(maxlen=2)

    @classmethod
    def create(cls, server: Any, task: Any, built: Any, rehearsal: bool,
               roster: Any = None) -> SecurePhase | None:
        """The secure phase of ``server`` (None: plain reports). The protocol's shape is
        checked for the selection size (one line if it cannot run); ``rehearsal``: the
        server was given its keys (the simulator's), so its clients may use the
        client-stage keys it derives; ``roster`` (a ``secagg.Roster``): run the
        consistency check, with ``secure.signers`` (default ⌊n/2⌋ + 1) signatures."""
        plan = secure_plan(task, server.pieces, built.params)
        if plan is None:
            return None
        section = task.spec().secure
        shape = (None, None) if section is None else (section.num_shares, section.threshold)
        protocol_shape(server.config.selection_size, *shape)
        if plan.spec.clip is not None:  # the sum of that many must not wrap around
            plan.spec.levels_for(server.config.selection_size)
        signers = None if section is None else section.signers
        if roster is not None:
            cls._signers_for(server.config.selection_size, signers)
        return cls(server, plan, shape, rehearsal, roster, signers)

    @staticmethod
    def _signers_for(n: int, signers: int | None) -> int:
        """The consistency check's s for n selected (one line if it cannot be met)."""
        s = n // 2 + 1 if signers is None else signers
        if not n < 2 * s <= 2 * n:
            raise ValueError(f"secure.signers {s} must be a strict majority of the {n} "
                             f"clients selected a round: in ({n // 2}, {n}]")
        return s

    def open(self, t: int, attempt: int, selected: list[int]) -> OpenRound:
        """The training task of a secure round, each selected client's with its keys and
        its ``Setup``."""
        n, plan = len(selected), self.plan
        k, threshold = protocol_shape(n, *self._shape)
        if plan.spec.clip is not None:
            plan.spec.levels_for(n)
        key = round_key(self.server._key, t)
        stage_keys = np.asarray(round_keys(key, n)[0])
        quantization = secure_keys(key, n)
        signers = 0 if self.roster is None else self._signers_for(n, self._signers)
        params = SecAggParams(n, k, threshold, plan.spec.bits, plan.length, os.urandom(16),
                              signers)
        protocol = SecAggServer(params, ring_graph(selected, k, os.urandom(16)), self.roster)
        setups = protocol.setup_messages()
        own = {}
        for i, cid in enumerate(selected):
            own[cid] = [*(stage_key(stage_keys[i]) if self._rehearsal else ()),
                        *wire.encode_arrays([(SECURE_KEY_PATH, quantization[i])]),
                        pack(setups[cid])]
        self.transcripts.append(SecureTranscript(t, attempt, protocol))
        sent = broadcast(self.server.pieces, self.server.state, True)
        return self.server._publish(t, attempt, selected, store.raw(sent), sent["payload"],
                                    stage_keys, target=n, own=own)

    def _stage(self, r: OpenRound, phase: str, requests: dict[int, Any]) -> dict:
        """One protocol stage as an open round of kind ``phase``, closed."""
        own = {cid: [pack(m)] for cid, m in requests.items()}
        stage = self.server._publish(r.t, r.attempt, sorted(own), {}, {}, np.zeros((0,)),
                                     phase=phase, target=len(own), own=own,
                                     version=r.model_version)
        return self.server._close(stage)

    def close(self, r: OpenRound, need: int) -> tuple | None:
        """Round ``r``'s protocol, from its training task to the new state: ``(record,
        survivors, (state, metrics) or None if it aborted)``; None if the server stopped."""
        transcript = self.transcripts[-1]
        protocol, spec = transcript.protocol, self.spec
        n, logged = len(r.selected), set[int]()
        traffic: dict[str, tuple[int, int]] = {}
        counts = {"rejected": 0, "cpu": 0.0}

        def replies(stage: str, closed: dict) -> dict:
            if self.server._stop.is_set():
                raise _Stopped
            record = closed["record"]
            traffic[stage] = (record["bytes_in"], record["bytes_out"])
            counts["rejected"] += record["rejected"]
            transcript.received[stage] = {c: type(m).__name__
                                          for c, m in closed["accepted"].items()}
            return closed["accepted"]

        def run(method, answers):
            start = time.thread_time()
            try:
                return method(answers)
            finally:
                counts["cpu"] += time.thread_time() - start
                counts["rejected"] += self._rejections(r, protocol, logged)

        def enough(out: dict, what: str) -> dict:
            if len(out) < need:
                raise SecAggAbort(f"{len(out)} clients {what}, fewer than min_reports {need}")
            return out

        first = self.server._close(r)
        result, record = None, first["record"]
        try:
            got = replies("train", first)
            signed = {c: m.signature for c, m in got.items()}
            keys = enough(run(lambda pks: protocol.collect_public_keys(pks, signed),
                              {c: (m.pk1, m.pk2) for c, m in got.items()}), "sent keys")
            sigs = protocol.key_signatures
            got = replies("keys", self._stage(r, KEYS, {
                c: KeyDirectory(d, {v: sigs[v] for v in d if v in sigs})
                for c, d in keys.items()}))
            shares = enough(run(protocol.collect_shares,
                                {c: m.shares for c, m in got.items()}), "shared their keys")
            got = replies("masked", self._stage(
                r, MASKED, {c: ShareDelivery(c, s) for c, s in shares.items()}))
            blamed = {c: m.blamed for c, m in got.items()}
            asks = enough(run(lambda ys: protocol.collect_masked(ys, blamed),
                              {c: m.values for c, m in got.items()}), "sent masked inputs")
            if protocol.params.signers:
                got = replies("sign", self._stage(r, SIGN, {
                    c: SurvivorSet(*q) for c, q in protocol.sign_requests().items()}))
                asks = run(protocol.collect_signatures,
                           {c: m.signature for c, m in got.items()})
            got = replies("unmask", self._stage(
                r, UNMASK, {c: UnmaskRequest(*q) for c, q in asks.items()}))
            total = run(protocol.collect_unmask, {c: m.shares for c, m in got.items()})
            result = self._step(total, n, r.t)
        except _Stopped:
            return None
        except SecAggAbort as abort:
            transcript.aborted = abort.reason
            record.update(status="aborted", secure_abort=abort.reason)
            log.warning("round %d attempt %d: secure aggregation aborted: %s", r.t,
                        r.attempt, abort.reason)
        survivors = protocol.survivors if result is not None else ()
        rejected = counts["rejected"]
        record.update(
            reported=len(survivors), rejected=rejected, unneeded=0,
            dropped=max(n - len(survivors) - rejected, 0),
            bytes_in=sum(v[0] for v in traffic.values()),
            bytes_out=sum(v[1] for v in traffic.values()),
            secure_survivors=len(survivors), secure_dropped=n - len(survivors),
            secure_num_shares=protocol.params.num_shares,
            secure_threshold=protocol.params.threshold,
            secure_signers=protocol.params.signers,
            secure_server_cpu_s=round(counts["cpu"], 4), client_stats=WITHHELD,
            **{f"secure_bytes_{d}_{stage}": v[i] for stage, v in traffic.items()
               for i, d in enumerate(("in", "out"))})
        if spec.clip is not None:
            record["secure_step"] = spec.step(n)
        return record, dict.fromkeys(survivors), result

    def _step(self, total: np.ndarray, n: int, t: int) -> tuple[Any, dict]:
        """The new state from the protocol's sum over the n selected (decoded with n)."""
        step = self._steps.get(n)
        if step is None:
            pieces, plan = self.server.pieces, self.plan
            step = self._steps[n] = jax.jit(lambda state, leaves, key: (
                apply_reduced(pieces, state, plan.decode(leaves, n), key)))
        state, metrics = step(self.server.state, self.plan.split(total),
                              round_key(self.server._key, t))
        return state, {k: float(v) for k, v in metrics.items()}

    def _rejections(self, r: OpenRound, protocol: SecAggServer, logged: set) -> int:
        """Count and log the protocol's new refusals (reason code ``secagg``)."""
        new = {c: why for c, why in protocol.rejected.items() if c not in logged}
        for cid, why in sorted(new.items()):
            logged.add(cid)
            self.server._refusals.warning("report-secagg", "rejected a report from client "
                                          "%d: secagg: %s", cid, why)
            with self.server._lock:
                self.server.rejections.add(r.t, r.attempt, cid, "secagg")
        return len(new)

    def checked(self, r: PhaseRound, env: Any) -> tuple[Any, tuple[str, str] | None]:
        """A reply to stage ``r.phase`` (one of ``REPLIES``) parsed strictly as that
        stage's message, from its sender."""
        try:
            message = unpack(env.tensors, REPLIES[r.phase])
        except wire.WireError as err:
            return None, (err.kind, str(err))
        except SecAggError as err:
            return None, ("secagg", str(err))
        if sender(message) != env.client_id:
            return None, ("sender", "the secure-aggregation message names another sender")
        return message, None
