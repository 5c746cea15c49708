"""An in-process SecAgg+ round: every message goes through its bytes, and is logged.

``run_round`` drives one ``SecAggServer`` and its ``SecAggClient``s the way a transport
would: it serializes every request and reply, parses it on the other side, and records
both in a ``Transcript`` (with sizes and times per client and stage) for tests and
benchmarks. Drop-outs are simulated by clients whose replies never arrive.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from fedax.runtime.secagg.crypto import seeded_rng
from fedax.runtime.secagg.errors import SecAggAbort, SecAggError
from fedax.runtime.secagg.graph import ring_graph
from fedax.runtime.secagg.identity import IdentityKey, Roster
from fedax.runtime.secagg.messages import (
    EncryptedShares,
    KeyDirectory,
    MaskedVector,
    PublicKeys,
    ShareDelivery,
    SurvivorSet,
    SurvivorSignature,
    UnmaskRequest,
    UnmaskShares,
)
from fedax.runtime.secagg.params import SecAggParams
from fedax.runtime.secagg.protocol import SecAggClient, SecAggServer

STAGES = ("setup", "share_keys", "masked_input", "sign", "unmask")
DROPS = ("offline", *STAGES)


@dataclass
class Transcript:
    """Every message of a round, as ``(stage, client, bytes)``: ``sent`` by the server,
    ``received`` by it; the graph, the survivors, the abort reason if any, wall times."""

    graph: dict[int, tuple[int, ...]] = field(default_factory=dict)
    sent: list[tuple[str, int, bytes]] = field(default_factory=list)
    received: list[tuple[str, int, bytes]] = field(default_factory=list)
    survivors: tuple[int, ...] = ()
    aborted: str | None = None
    server_seconds: dict[str, float] = field(default_factory=dict)
    client_seconds: dict[str, dict[int, float]] = field(
        default_factory=lambda: {s: {} for s in STAGES})

    def bytes_per_client(self, direction: str) -> dict[str, dict[int, int]]:
        """Bytes per stage and client, ``"up"`` (client -> server) or ``"down"``."""
        if direction not in ("up", "down"):
            raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
        out: dict[str, dict[int, int]] = {s: {} for s in STAGES}
        for stage, cid, data in self.received if direction == "up" else self.sent:
            out[stage][cid] = out[stage].get(cid, 0) + len(data)
        return out


def _rngs(seed: bytes | int | None) -> tuple[bytes, Callable[[int], Callable[[int], bytes]]]:
    if seed is None:
        return os.urandom(16), lambda cid: os.urandom
    seed = seed if isinstance(seed, bytes) else str(seed).encode()
    return (hashlib.sha256(b"graph" + seed).digest(),
            lambda cid: seeded_rng(seed + cid.to_bytes(8, "big")))


def run_round(inputs: Mapping[int, np.ndarray], params: SecAggParams, *,
              drop: Mapping[str, set[int]] | None = None, seed: bytes | int | None = None,
              identities: Mapping[int, IdentityKey] | None = None
              ) -> tuple[np.ndarray, Transcript]:
    """One SecAgg+ round over ``inputs`` (client id -> uint vector in [0, 2^bits)).

    Args:
        inputs: one vector of ``params.length`` per sampled client.
        params: the round's parameters; ``num_clients`` must be ``len(inputs)``.
        drop: stage -> clients that drop: ``"offline"`` never answer; ``"setup"``,
            ``"share_keys"``, ``"masked_input"``, ``"sign"`` drop after answering that
            stage; ``"unmask"`` drop during it (the reply is lost).
        seed: makes the graph and every client's randomness deterministic (tests only:
            anyone knowing it knows the keys); None draws from ``os.urandom``.
        identities: each client's identity key, for a round with ``params.signers`` > 0
            (the consistency check; the roster is theirs).

    Returns:
        ``(sum of the survivors' inputs mod 2^bits, transcript)``; the survivors are
        ``transcript.survivors``. Raises ``SecAggAbort`` (its ``transcript`` set) instead.
    """
    if len(inputs) != params.num_clients:
        raise ValueError(f"{len(inputs)} inputs for num_clients {params.num_clients}")
    drop = {k: set(v) for k, v in (drop or {}).items()}
    if set(drop) - set(DROPS):
        raise ValueError(f"drop stages must be among {DROPS}, got {sorted(drop)}")
    graph_seed, rng_for = _rngs(seed)
    graph = ring_graph(sorted(inputs), params.num_shares, graph_seed)
    roster = Roster.of(identities) if params.signers and identities is not None else None
    server, log, clients = SecAggServer(params, graph, roster), Transcript(graph), {}
    identity = (identities or {}).get if roster is not None else (lambda cid: None)
    gone = set(drop.get("offline", ()))

    def exchange(stage, cid, request, handle, reply_type):
        """Request -> bytes -> client -> reply -> bytes -> parsed reply (None: dropped)."""
        data = request.to_bytes()
        log.sent.append((stage, cid, data))
        if cid in gone:
            return None
        start = time.perf_counter()
        reply = handle(type(request).from_bytes(data))
        log.client_seconds[stage][cid] = time.perf_counter() - start
        if stage == "unmask" and cid in drop.get("unmask", ()):
            return None
        data = reply.to_bytes()
        log.received.append((stage, cid, data))
        parsed = reply_type.from_bytes(data)
        if getattr(parsed, "cid", getattr(parsed, "src", cid)) != cid:
            raise SecAggError(f"client {cid} sent a message in another client's name")
        return parsed

    def collect(stage, method, replies):
        start = time.perf_counter()
        try:
            return method(replies)
        finally:
            log.server_seconds[stage] = time.perf_counter() - start
            gone.update(drop.get(stage, ()))

    def setup(msg):
        clients[msg.cid] = client = SecAggClient.from_setup(
            msg, rng_for(msg.cid), identity(msg.cid), roster)
        return PublicKeys(msg.cid, *client.setup(), client.key_signature)

    try:
        keys, signatures = {}, {}
        for cid, msg in server.setup_messages().items():
            if (reply := exchange("setup", cid, msg, setup, PublicKeys)) is not None:
                keys[cid], signatures[cid] = (reply.pk1, reply.pk2), reply.signature
        directories = collect("setup", lambda k: server.collect_public_keys(k, signatures),
                              keys)
        sent = {}
        for cid, directory in directories.items():
            request = KeyDirectory(directory, {v: server.key_signatures[v] for v in directory
                                               if v in server.key_signatures})
            reply = exchange("share_keys", cid, request, lambda m, c=cid: (
                EncryptedShares(c, clients[c].share_keys(m.keys, m.signatures))),
                EncryptedShares)
            if reply is not None:
                sent[cid] = reply.shares
        deliveries = collect("share_keys", server.collect_shares, sent)
        masked, blamed = {}, {}
        for cid, shares in deliveries.items():
            reply = exchange("masked_input", cid, ShareDelivery(cid, shares), lambda m, c=cid: (
                MaskedVector(c, params.bits, clients[c].masked_input(inputs[c], m.shares),
                             clients[c].blamed)), MaskedVector)
            if reply is not None:
                masked[cid] = reply.values
                blamed[cid] = reply.blamed
        requests = collect("masked_input", lambda m: server.collect_masked(m, blamed), masked)
        log.survivors = server.survivors
        if params.signers:
            signed = {}
            for cid, sets in server.sign_requests().items():
                reply = exchange("sign", cid, SurvivorSet(*sets), lambda m, c=cid: (
                    SurvivorSignature(c, clients[c].sign_survivors(m.u2, m.u3))),
                    SurvivorSignature)
                if reply is not None:
                    signed[cid] = reply.signature
            requests = collect("sign", server.collect_signatures, signed)
        answers = {}
        for cid, request in requests.items():
            reply = exchange("unmask", cid, UnmaskRequest(*request), lambda m, c=cid: (
                UnmaskShares(c, clients[c].unmask(m.survivors, m.dropped, m.signatures))),
                UnmaskShares)
            if reply is not None:
                answers[cid] = reply.shares
        total = collect("unmask", server.collect_unmask, answers)
    except SecAggAbort as abort:
        abort.transcript, log.aborted = log, abort.reason
        raise
    return total, log
