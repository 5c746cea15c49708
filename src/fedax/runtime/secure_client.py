"""A client's side of a secure round (``fedax.runtime.secure_phase`` is the server's).

On a secure training task (kind ``task``, the aggregator declares ``secure``) the client
checks the ``Setup`` it carries (its own id, the task's b and d, and t > k/2: it refuses a
threshold with which a server lying about drop-outs could collect both shares of one
node), trains, runs the aggregator's client stage with the aggregator state sent and its
client-stage key (the server's in a rehearsal; else its own, from its secret, so that
noise it adds is its own), encodes the output with its quantization key k_i for the n
selected (``SecurePlan.encode``) and answers its SecAgg+ public keys. It then answers the
server's ``secagg-keys``, ``secagg-masked``, ``secagg-sign`` and ``secagg-unmask`` requests
for that round and attempt with ``SecAggClient``'s stages. A client given an identity key
and the roster (``ClientConfig.identity``, ``roster``) signs its keys, checks its
neighbours', and takes part only in rounds with the consistency check: it refuses a
``Setup`` without one, whatever the server says. Its update, statistics, sums and n_k never leave
it; the only vector it sends is masked. A request that does not parse, or that the
protocol refuses (e.g. both shares of one neighbour), is refused: logged, recorded in
``Client.rounds`` as ``(round, attempt, False, "secagg refused: ...")`` and left
unanswered, which the server sees as a drop-out.

``SecAggFault`` injects drop-outs for tests (``Client(..., fault=...)``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from fedax.runtime import wire
from fedax.runtime.secagg import (
    EncryptedShares,
    MaskedVector,
    PublicKeys,
    SecAggClient,
    SecAggError,
    Setup,
    SurvivorSignature,
    UnmaskShares,
)
from fedax.runtime.secure_task import (
    KEYS,
    MASKED,
    REQUESTS,
    SECAGG_PATH,
    SECURE_KEY_PATH,
    SIGN,
    STAGE_KEY_PATH,
    pack,
    tensor_bytes,
    unpack,
)
from fedax.runtime.security import key_words

log = logging.getLogger("fedax.runtime.client")
ORDER = ("setup", "share_keys", "masked_input", "sign", "unmask")  # the stages it answers
STAGE_OF = {KEYS: "share_keys", MASKED: "masked_input", SIGN: "sign"}  # request -> stage


@dataclasses.dataclass(frozen=True)
class SecAggFault:
    """Fault injection (tests only): the client drops out of SecAgg+ at ``stage``, as
    ``fedax.runtime.secagg.run_round``'s ``drop`` does: ``offline`` never answers the
    training task; ``setup``, ``share_keys``, ``masked_input`` and ``sign`` answer that
    stage and then go silent; ``unmask`` computes its shares and never sends them. ``attempts``:
    only in these ``(round, attempt)`` pairs (None: in every one)."""

    stage: str
    attempts: frozenset[tuple[int, int]] | None = None

    def __post_init__(self):
        if self.stage not in ("offline", *ORDER):
            raise ValueError(f"a SecAgg fault's stage is one of offline, {', '.join(ORDER)}; "
                             f"got {self.stage!r}")

    def silent(self, stage: str, t: int, attempt: int) -> bool:
        """Whether the client does not send its answer to ``stage`` in (t, attempt)."""
        if self.attempts is not None and (t, attempt) not in self.attempts:
            return False
        last = ORDER.index(self.stage) if self.stage != "offline" else -1
        return ORDER.index(stage) > last or stage == self.stage == "unmask"


class SecureRounds:
    """One client's secure rounds: the protocol of its current (round, attempt)."""

    def __init__(self, client: Any, fault: SecAggFault | None = None):
        self.client, self.fault = client, fault
        self._at: tuple[int, int] | None = None
        self._protocol: SecAggClient | None = None
        self._x: np.ndarray | None = None
        self._refused: tuple[int, int] | None = None  # the (round, attempt) it refused

    def _forget(self) -> None:
        self._at, self._protocol, self._x = None, None, None

    def _silent(self, stage: str, t: int, attempt: int) -> bool:
        if self.fault is None or not self.fault.silent(stage, t, attempt):
            return False
        log.warning("client %d: fault injection: silent from SecAgg stage %s of round %d.%d",
                    self.client.config.client_id, stage, t, attempt)
        self.client.rounds.append((t, attempt, False, f"fault: dropped at {stage}"))
        self._forget()
        return True

    def _refuse(self, t: int, attempt: int, why: str) -> None:
        log.warning("client %d: refused the server's secure-aggregation request in round "
                    "%d.%d: %s", self.client.config.client_id, t, attempt, why)
        self.client.rounds.append((t, attempt, False, f"secagg refused: {why}"))
        self._forget()
        self._refused = (t, attempt)  # asked again (it is still open): it lets it pass

    def _send(self, conn: Any, env: Any, message: Any, last: bool = False) -> bool:
        """``message`` to the server under ``env``'s header; whether it was accepted (a
        refused one, or the last, ends this round's protocol here)."""
        out = wire.Envelope(kind="secagg", client_id=self.client.config.client_id,
                            round=env.round, attempt=env.attempt,
                            model_version=env.model_version, nonce=env.nonce,
                            tensors=[pack(message)])
        reply = self.client._call(conn.submit, out)
        if last or not reply.accepted:
            self.client.rounds.append((int(env.round), int(env.attempt),
                                       bool(reply.accepted), reply.reason))
            self._forget()
        if not reply.accepted:
            log.warning("client %d: secure-aggregation reply for round %d.%d refused: %s",
                        self.client.config.client_id, env.round, env.attempt, reply.reason)
        return bool(reply.accepted)

    def _task(self, b: Any, env: Any) -> tuple[Any, dict[str, Any]]:
        """The typed shared part of a secure task (payload, aggregator state) without its
        client-stage key, and its own arrays by path, strictly."""
        shared = {"payload": b["sent"]["payload"],
                  "stage": {"aggregator": b["sent"]["stage"]["aggregator"]}}
        tensors = list(env.tensors)
        count = len(wire.expected_layout(shared))
        sent = wire.decode_tree(tensors[:count], shared, "task")
        own: dict[str, Any] = {}
        for tensor in tensors[count:]:
            if tensor.path in own or tensor.path not in (STAGE_KEY_PATH, SECURE_KEY_PATH,
                                                         SECAGG_PATH):
                raise wire.WireError("structure", f"task: unexpected array {tensor.path!r}")
            own[tensor.path] = tensor
        if SECURE_KEY_PATH not in own or SECAGG_PATH not in own:
            raise wire.WireError("structure", "task: a secure task has a key and a Setup")
        key = b["key"]
        layout = [(p, np.dtype(key.dtype).name, tuple(key.shape))
                  for p in (STAGE_KEY_PATH, SECURE_KEY_PATH)]
        for (path, dtype, shape) in layout:
            if path in own:
                own[path] = wire.decode_arrays([own[path]], [(path, dtype, shape)], "task")[0]
        return sent, own

    def _stage_key(self, t: int, attempt: int) -> np.ndarray:
        """The client's own client-stage key for (t, attempt), from its secret (never
        sent): SHA-256(secret ‖ "aggregator stage" ‖ t ‖ attempt)'s first 8 bytes."""
        self.client._train_key(t)  # loads (or makes) the secret
        return key_words(self.client._seed + b"aggregator stage"
                         + int(t).to_bytes(8, "little") + int(attempt).to_bytes(8, "little"))

    def train(self, conn: Any, b: Any, env: Any) -> None:
        """A secure training task: train, encode, answer the SecAgg+ public keys."""
        from fedax.runtime import store

        client, plan = self.client, b["secure"]
        cid, t, attempt = client.config.client_id, int(env.round), int(env.attempt)
        self._forget()
        if self._refused == (t, attempt):
            client.stop.wait(min(max(env.deadline_s, 0.05), 1.0))
            return
        try:
            sent, own = self._task(b, env)
            setup = Setup.from_bytes(tensor_bytes(own[SECAGG_PATH]))
            p = setup.params
            if (setup.cid, p.bits, p.length) != (cid, plan.spec.bits, plan.length):
                raise SecAggError(f"a Setup for client {setup.cid}, {p.bits} bits, length "
                                  f"{p.length}; this task's are {cid}, {plan.spec.bits}, "
                                  f"{plan.length}")
            if 2 * p.threshold <= p.num_shares:
                raise SecAggError(f"threshold {p.threshold} is not above half of num_shares "
                                  f"{p.num_shares}")
            if plan.spec.clip is not None:
                plan.spec.levels_for(p.num_clients)
            protocol = SecAggClient.from_setup(setup, identity=client.config.identity,
                                               roster=client.config.roster)
        except (wire.WireError, SecAggError, ValueError) as err:
            return self._refuse(t, attempt, f"the training task: {err}")
        if self._silent("setup", t, attempt):  # offline: it never answers
            return
        stage_key = own.get(STAGE_KEY_PATH)
        raw = {"payload": sent["payload"],
               "stage": {"aggregator": sent["stage"]["aggregator"],
                         "key": self._stage_key(t, attempt) if stage_key is None
                         else stage_key}}
        out = client._train(b, env, store.typed(raw, b["sent_typed"]),
                            b["secure_step"](p.num_clients), own[SECURE_KEY_PATH])
        if out is None:  # not finite: it takes no part (the simulator's weight 0)
            return
        x = plan.flatten(out[1])
        if p.bits < 32 and (x >> p.bits).any():
            return self._refuse(t, attempt, f"its client stage's integers exceed 2^{p.bits}")
        keys = PublicKeys(cid, *protocol.setup(), protocol.key_signature)
        client.secure_input = ((t, attempt), x)  # (tests; never sent)
        if client.config.delay_s > 0:
            client.stop.wait(client.config.delay_s)
        self._at, self._protocol, self._x = (t, attempt), protocol, x
        self._send(conn, env, keys)

    def answer(self, conn: Any, env: Any) -> None:
        """A ``secagg-*`` request: answer it, or wait if this client has no part in it."""
        client = self.client
        t, attempt, kind = int(env.round), int(env.attempt), env.kind
        if self._at != (t, attempt) or self._protocol is None:
            client.stop.wait(min(max(env.deadline_s, 0.05), 1.0))  # not ours: let it pass
            return
        stage = STAGE_OF.get(kind, "unmask")
        if stage != "unmask" and self._silent(stage, t, attempt):
            return
        cid, protocol = client.config.client_id, self._protocol
        reply: EncryptedShares | MaskedVector | SurvivorSignature | UnmaskShares
        try:
            request = unpack(env.tensors, REQUESTS[kind])
            if kind == KEYS:
                reply = EncryptedShares(cid, protocol.share_keys(request.keys,
                                                                 request.signatures))
            elif kind == MASKED:
                if request.dst != cid:
                    raise SecAggError(f"shares addressed to client {request.dst}")
                if self._x is None:  # sent already: the protocol is past this stage
                    raise SecAggError(f"client {cid}: masked_input asked again")
                y = protocol.masked_input(self._x, request.shares)
                reply = MaskedVector(cid, protocol.params.bits, y, protocol.blamed)
                self._x = None
            elif kind == SIGN:
                reply = SurvivorSignature(cid, protocol.sign_survivors(request.u2, request.u3))
            else:
                reply = UnmaskShares(cid, protocol.unmask(request.survivors, request.dropped,
                                                          request.signatures))
        except (wire.WireError, SecAggError, KeyError) as err:
            return self._refuse(t, attempt, f"{kind}: {err}")
        if stage == "unmask" and self._silent(stage, t, attempt):
            return
        self._send(conn, env, reply, last=stage == "unmask")
