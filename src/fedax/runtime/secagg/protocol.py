"""SecAgg+ (Bell et al., CCS 2020) over SecAgg (Bonawitz et al., CCS 2017): the client and
server state machines, transport-agnostic.

Each sampled client u runs four stages, each answering one server request:

1. ``setup``: two X25519 key pairs, (sk1, pk1) for pairwise masks, (sk2, pk2) for
   encrypting shares; it returns (pk1, pk2).
2. ``share_keys``: given the keys of its live neighbours, it draws the self-mask seed b_u
   and Shamir-shares b_u and sk1_u t-of-(holders), keeps its own share and encrypts the
   others, one per neighbour v, under HKDF(X25519(sk2_u, pk2_v)).
3. ``masked_input``: it decrypts the shares addressed to it and sends
   ``y_u = x_u + PRG(b_u) + sum_{v<u} PRG(s_uv) - sum_{v>u} PRG(s_uv) mod 2^b``, s_uv =
   HKDF(X25519(sk1_u, pk1_v)), over the neighbours whose shares reached it and open; it
   blames the others (their ciphertexts are authenticated under their keys), and the
   server drops each blamed client, so garbage shares cannot make honest clients drop out.
4. ``unmask``: given the survivors and the dropped, it returns its shares of b_v for the
   survivors and of sk1_v for the dropped, never both for one node in a session.

Against a server that lies (``params.signers`` > 0; ``identity`` has the keys): each
client signs its stage-1 keys with its identity key and checks its neighbours' against the
``Roster`` before encrypting to them (so the server cannot put its own keys in their
place), and between stages 3 and 4 signs the survivor sets (U2, U3) the server tells it
(``sign_survivors``, after checking that they match what it saw: it is in U3, the
neighbours in U2 are exactly those whose shares reached it, none it blamed is in U3). It
reveals shares in stage 4 only with ``signers`` valid signatures of U3 members on that same
statement, and only b-shares of U3 members and sk1-shares of U2 − U3 members. As each
honest client signs one statement per round and ``signers`` > n/2, no two honest clients
act on different survivor sets: the server learns the sum over U3 and nothing else
(Bonawitz et al. 2017, §4's ConsistencyCheck; Bell et al. 2020, §5).

The server routes (it cannot decrypt a share), and removes the masks: every survivor's
PRG(b_u), and the pairwise masks survivors share with nodes that dropped before stage 3
(their sk1 recovered from shares, where some survivor masked with them). It aborts
(``SecAggAbort``) rather than go on with fewer than t survivors or fewer than t shares
of any secret it needs, before unmasking anything.
The server's per-stage methods take the replies that arrived (a missing client has
dropped); a reply that breaks the protocol is set aside in ``rejected`` like a drop-out.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import numpy as np

from fedax.runtime.secagg.crypto import (
    KEY_BYTES,
    MASK_INFO,
    PAIR_MASK,
    SELF_MASK,
    SHARE_INFO,
    Rng,
    agree,
    is_public_key,
    keypair,
    prg,
    public_key,
    seal,
    unseal,
)
from fedax.runtime.secagg.errors import SecAggAbort, SecAggError
from fedax.runtime.secagg.graph import MAX_ID
from fedax.runtime.secagg.identity import (
    IdentityKey,
    Roster,
    key_statement,
    survivor_statement,
)
from fedax.runtime.secagg.messages import Setup, ShareBundle
from fedax.runtime.secagg.params import SecAggParams
from fedax.runtime.secagg.shamir import combine, parse, split


def _ids(ids: Iterable[int], what: str) -> tuple[int, ...]:
    out = tuple(ids)
    if len(set(out)) != len(out) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= MAX_ID for i in out):
        raise SecAggError(f"{what} must be distinct integers in [0, {MAX_ID}]")
    return out


def _share_ok(share: bytes, holder: int, params: SecAggParams) -> bool:
    """Is ``share`` a share of a 32-byte secret, at ``holder``'s point, of the round's t?"""
    try:
        x, threshold, length, _ = parse(share)
    except SecAggError:
        return False
    return (x, threshold, length) == (holder + 1, params.threshold, KEY_BYTES)


def _mask_seed(private: bytes, peer_public: bytes, params: SecAggParams) -> bytes:
    return agree(private, peer_public, info=MASK_INFO, salt=params.session)


class SecAggClient:
    """One client's side of a round; the stages run once each, in order (``unmask`` may be
    asked again, and never yields both shares of one node)."""

    def __init__(self, cid: int, params: SecAggParams, neighbours: Iterable[int],
                 rng: Rng = os.urandom, identity: IdentityKey | None = None,
                 roster: Roster | None = None, digest: bytes = b""):
        if not isinstance(params, SecAggParams):
            raise TypeError(f"params must be SecAggParams, got {type(params).__name__}")
        (self.cid,) = _ids([cid], "the client id")
        self.params, self.neighbours = params, tuple(sorted(_ids(neighbours, "neighbours")))
        if cid in self.neighbours or len(self.neighbours) != params.num_shares - 1:
            raise SecAggError(f"client {cid} needs num_shares - 1 = {params.num_shares - 1} "
                              f"neighbours other than itself, got {self.neighbours}")
        self._rng, self._stage = rng, "setup"
        self._shares: dict[int, tuple[bytes, bytes]] = {}  # node -> (its b share, its sk1 share)
        self._revealed: dict[int, str] = {}  # node -> "b" or "sk1", what the server has had
        self.blamed: tuple[int, ...] = ()  # neighbours whose shares did not open (stage 3)
        self._identity, self._roster, self._digest = identity, roster, digest
        if params.signers and (identity is None or roster is None or not digest):
            raise SecAggError(f"client {cid}: a round with a consistency check needs the "
                              "client's identity key, the roster and the round's digest")
        if identity is not None and not params.signers:
            self._refuse("the round has no consistency check (signers 0), and this client "
                         "has an identity key: it takes part only in rounds that check")
        self.key_signature = b""  # its signature on its stage-1 keys (consistency check)

    @classmethod
    def from_setup(cls, message: Setup, rng: Rng = os.urandom,
                   identity: IdentityKey | None = None,
                   roster: Roster | None = None) -> SecAggClient:
        """The client a ``Setup`` message describes; with ``identity`` and ``roster`` it
        requires, and takes part in, the consistency check."""
        return cls(message.cid, message.params, message.neighbours, rng, identity, roster,
                   message.digest())

    def _enter(self, stage: str):
        if self._stage != stage:
            raise SecAggError(f"client {self.cid}: {stage} asked while at {self._stage}")

    def _refuse(self, why: str):
        raise SecAggError(f"client {self.cid} refuses: {why}")

    def setup(self) -> tuple[bytes, bytes]:
        """Stage 1: fresh key pairs; returns ``(pk1, pk2)``."""
        self._enter("setup")
        self._sk1, self._pk1 = keypair(self._rng)
        self._sk2, self._pk2 = keypair(self._rng)
        if self._identity is not None:
            self.key_signature = self._identity.sign(
                key_statement(self._digest, self.cid, self._pk1, self._pk2))
        self._stage = "share_keys"
        return self._pk1, self._pk2

    def share_keys(self, keys: Mapping[int, tuple[bytes, bytes]],
                   signatures: Mapping[int, bytes] | None = None) -> dict[int, bytes]:
        """Stage 2: ``keys`` (its live neighbours' (pk1, pk2), its own optional; with a
        consistency check, each signed in ``signatures``) -> one encrypted ``ShareBundle``
        per neighbour; itself and they hold its shares."""
        self._enter("share_keys")
        keys, p = dict(keys), self.params
        if self._roster is not None:
            for v, (pk1, pk2) in sorted(keys.items()):
                if v != self.cid and not self._roster.verify(
                        v, key_statement(self._digest, v, pk1, pk2),
                        (signatures or {}).get(v, b"")):
                    self._refuse(f"client {v}'s keys are not signed by its identity key in "
                                 "the roster (the server may have put its own in their place)")
        if keys.setdefault(self.cid, (self._pk1, self._pk2)) != (self._pk1, self._pk2):
            self._refuse("the key directory lists other keys as this client's own")
        if set(keys) - set(self.neighbours) - {self.cid}:
            self._refuse(f"keys of non-neighbours {sorted(set(keys) - set(self.neighbours))}")
        flat = [k for pair in keys.values() for k in pair]
        if not all(is_public_key(k) for k in flat):
            self._refuse("a public key in the directory is not a usable X25519 key")
        if len(set(flat)) != len(flat):
            self._refuse("two public keys in the directory are equal")
        if len(keys) < p.threshold:
            self._refuse(f"{len(keys)} share holders (itself included), fewer than the "
                         f"threshold {p.threshold}")
        self._seed = self._rng(KEY_BYTES)
        holders = sorted(keys)
        points = [v + 1 for v in holders]
        b_shares = split(self._seed, points, p.threshold, rng=self._rng)
        sk_shares = split(self._sk1, points, p.threshold, rng=self._rng)
        out = {}
        for v, b_share, sk_share in zip(holders, b_shares, sk_shares, strict=True):
            if v == self.cid:
                self._shares[v] = (b_share, sk_share)
                continue
            key = agree(self._sk2, keys[v][1], info=SHARE_INFO, salt=p.session)
            bundle = ShareBundle(self.cid, v, b_share, sk_share).to_bytes()
            out[v] = seal(key, bundle, session=p.session, src=self.cid, dst=v, rng=self._rng)
        self._keys = {v: pks for v, pks in keys.items() if v != self.cid}
        self._stage = "masked_input"
        return out

    def _input(self, x: np.ndarray) -> np.ndarray:
        x, p = np.asarray(x), self.params
        if x.shape != (p.length,) or not np.issubdtype(x.dtype, np.integer):
            self._refuse(f"the input must be an integer vector of shape ({p.length},), got "
                         f"{x.dtype} {x.shape}")
        if int(x.min()) < 0 or int(x.max()) >= p.modulus:
            self._refuse(f"input values must be in [0, 2^{p.bits})")
        return x.astype(np.uint32)

    def open_shares(self, v: int, ciphertext: bytes) -> tuple[bytes, bytes]:
        """Neighbour ``v``'s (b share, sk1 share) for this client, from its ciphertext;
        ``SecAggError`` if it does not authenticate or holds no shares for this client."""
        p = self.params
        key = agree(self._sk2, self._keys[v][1], info=SHARE_INFO, salt=p.session)
        bundle = ShareBundle.from_bytes(
            unseal(key, ciphertext, session=p.session, src=v, dst=self.cid))
        if (bundle.src, bundle.dst) != (v, self.cid):
            self._refuse(f"a share from {bundle.src} to {bundle.dst} arrived as {v}'s")
        if not all(_share_ok(s, self.cid, p) for s in (bundle.b_share, bundle.sk_share)):
            self._refuse(f"the shares from {v} are not shares for this client")
        return bundle.b_share, bundle.sk_share

    def masked_input(self, x: np.ndarray, received: Mapping[int, bytes]) -> np.ndarray:
        """Stage 3: ``received`` (source -> ciphertext addressed here) -> y_u (uint32),
        masked with each neighbour whose shares open. A neighbour whose shares do not is
        blamed (``self.blamed``, sent beside y_u): the server drops it, so one client that
        sends garbage shares cannot make its honest neighbours drop out."""
        self._enter("masked_input")
        p, y = self.params, self._input(x)
        if set(received) - set(self._keys):
            self._refuse(f"shares from {sorted(set(received) - set(self._keys))}, which are "
                         "not neighbours in the key directory")
        shares, blamed = {}, []
        for v, ciphertext in sorted(received.items()):
            try:
                shares[v] = self.open_shares(v, ciphertext)
            except SecAggError:  # authenticated under v's key: v sent it, or the server
                blamed.append(v)  # broke it; either way no mask with v (the server drops v)
        if len(shares) + 1 < p.threshold:
            self._refuse(f"shares from {len(shares)} neighbours open (blamed: {blamed}); with "
                         f"its own, fewer than the threshold {p.threshold}")
        self.blamed = tuple(blamed)
        y += prg(self._seed, p.length, p.bits, SELF_MASK)
        for v in sorted(shares):
            mask = prg(_mask_seed(self._sk1, self._keys[v][0], p), p.length, p.bits, PAIR_MASK)
            if v < self.cid:
                y += mask
            else:
                y -= mask
        y &= np.uint32(p.modulus - 1)
        self._shares.update(shares)
        self._delivered = frozenset(received)
        del self._seed, self._sk1, self._sk2  # only the shares are needed from here on
        self._stage = "sign" if p.signers else "unmask"
        return y

    def sign_survivors(self, u2: Iterable[int], u3: Iterable[int]) -> bytes:
        """The consistency check: its signature on the survivor sets the server told it,
        once they agree with what it saw (it is in U3 ⊆ U2; its neighbours in U2 are the
        sources of the shares it received; none it blamed is in U3). Once per round."""
        self._enter("sign")
        u2, u3 = set(_ids(u2, "U2")), set(_ids(u3, "U3"))
        if not u3 <= u2 or self.cid not in u3:
            self._refuse("the survivor sets do not have it in U3 ⊆ U2")
        if set(self.neighbours) & u2 != self._delivered:
            self._refuse(f"U2 lists neighbours {sorted(set(self.neighbours) & u2)}, but "
                         f"shares reached it from {sorted(self._delivered)}")
        if set(self.blamed) & u3:
            self._refuse(f"U3 lists {sorted(set(self.blamed) & u3)}, whom it blamed")
        assert self._identity is not None
        self._survivor_sets = (frozenset(u2), frozenset(u3))
        self._statement = survivor_statement(self._digest, u2, u3)
        self._stage = "unmask"
        return self._identity.sign(self._statement)

    def _check_consistency(self, survivors: tuple[int, ...], dropped: tuple[int, ...],
                           signatures: Mapping[int, bytes]) -> None:
        """Stage 4's request against the statement this client signed (``signers``
        signatures of U3 members on it; survivors in U3, dropped in U2 − U3)."""
        assert self._roster is not None
        u2, u3 = self._survivor_sets
        valid = {v for v, sig in signatures.items()
                 if v in u3 and self._roster.verify(v, self._statement, sig)}
        if len(valid) < self.params.signers:
            self._refuse(f"{len(valid)} valid signatures of survivors on the survivor sets "
                         f"it signed, fewer than {self.params.signers} (the server may have "
                         "told other clients another story)")
        if not set(survivors) <= u3 or set(dropped) & u3 or not set(dropped) <= u2:
            self._refuse("the unmask request does not follow the survivor sets it signed")

    def unmask(self, survivors: Iterable[int], dropped: Iterable[int],
               signatures: Mapping[int, bytes] | None = None) -> dict[int, bytes]:
        """Stage 4: shares of b_v for each survivor v and of sk1_v for each dropped v
        (with a consistency check, only as the signed survivor sets allow)."""
        self._enter("unmask")
        survivors, dropped = _ids(survivors, "survivors"), _ids(dropped, "dropped")
        if self.params.signers:
            self._check_consistency(survivors, dropped, signatures or {})
        if set(survivors) & set(dropped):
            self._refuse(f"{sorted(set(survivors) & set(dropped))} listed as survivors and "
                         "as dropped")
        if self.cid in dropped or self.cid not in survivors:
            self._refuse("it sent its masked input, yet is not listed as a survivor")
        if unknown := (set(survivors) | set(dropped)) - set(self._shares):
            self._refuse(f"it holds no shares of {sorted(unknown)} (they never sent any)")
        both = ([v for v in survivors if self._revealed.get(v) == "sk1"]
                + [v for v in dropped if self._revealed.get(v) == "b"])
        if both:
            self._refuse(f"the server already has the other share of {sorted(both)}; a "
                         "client never reveals both shares of one node")
        self._revealed.update(dict.fromkeys(survivors, "b") | dict.fromkeys(dropped, "sk1"))
        return ({v: self._shares[v][0] for v in survivors}
                | {v: self._shares[v][1] for v in dropped})


class SecAggServer:
    """The server's side of a round: ``collect_*`` once per stage, in order; each takes the
    replies that arrived and returns what to send next (per client), or the sum."""

    def __init__(self, params: SecAggParams, neighbours: Mapping[int, Iterable[int]],
                 roster: Roster | None = None):
        if not isinstance(params, SecAggParams):
            raise TypeError(f"params must be SecAggParams, got {type(params).__name__}")
        if bool(params.signers) != (roster is not None):
            raise ValueError("a consistency check (params.signers > 0) needs the roster of "
                             "the clients' identity keys, and a roster needs signers > 0")
        self.params, self.roster = params, roster
        self.neighbours = {u: frozenset(_ids(n, "neighbours")) for u, n in neighbours.items()}
        _ids(self.neighbours, "client ids")
        if len(self.neighbours) != params.num_clients:
            raise ValueError(f"the graph has {len(self.neighbours)} nodes, params.num_clients "
                             f"is {params.num_clients}")
        for u, nbrs in self.neighbours.items():
            if (u in nbrs or len(nbrs) != params.num_shares - 1
                    or any(u not in self.neighbours.get(v, ()) for v in nbrs)):
                raise ValueError(f"node {u}: the graph must be symmetric, with num_shares - 1 "
                                 "neighbours per node (use graph.ring_graph)")
        self.stage = "setup"
        self.aborted: str | None = None  # why, once aborted
        self.result: np.ndarray | None = None  # the sum, once unmasked
        self.rejected: dict[int, str] = {}  # client -> why its reply was set aside
        self.members = tuple(sorted(self.neighbours)) if params.signers else ()
        self.digest = Setup(params, 0, (), self.members).digest()
        self.key_signatures: dict[int, bytes] = {}  # the live clients' (consistency check)
        if roster is not None and (unlisted := set(self.members) - set(roster.keys)):
            raise ValueError(f"clients {sorted(unlisted)} are not in the roster")

    def setup_messages(self) -> dict[int, Setup]:
        """Stage 1 requests: the parameters and each client's neighbours (and the members)."""
        return {u: Setup(self.params, u, tuple(sorted(n)), self.members)
                for u, n in self.neighbours.items()}

    @property
    def survivors(self) -> tuple[int, ...]:
        """The clients whose masked vector is in the sum (after stage 3)."""
        return tuple(sorted(getattr(self, "_u3", ())))

    def _enter(self, stage: str, after: str):
        if self.stage != stage:
            raise SecAggError(f"server: {stage} replies while at {self.stage}")
        self.stage = after

    def _abort(self, reason: str):
        self.stage, self.aborted = "aborted", reason
        raise SecAggAbort(reason)

    def _holders(self, u: int, alive: set[int]) -> set[int]:
        return ({u} | self.neighbours[u]) & alive

    def _prune(self, alive: Iterable[int]) -> set[int]:
        """``alive`` less the nodes with fewer than t share holders in it, repeatedly: a
        node left out shares nothing with anyone, so nobody masks with it."""
        alive = set(alive)
        while short := {u for u in alive if len(self._holders(u, alive)) < self.params.threshold}:
            alive -= short
        return alive

    def collect_public_keys(self, replies: Mapping[int, tuple[bytes, bytes]],
                            signatures: Mapping[int, bytes] | None = None
                            ) -> dict[int, dict[int, tuple[bytes, bytes]]]:
        """Stage 1 replies (client -> (pk1, pk2); with a consistency check, client -> its
        signature on them) -> each live client's key directory (and ``key_signatures``)."""
        self._enter("setup", "share_keys")
        t, signatures = self.params.threshold, signatures or {}
        keys: dict[int, tuple[bytes, bytes]] = {}
        counts: dict[bytes, int] = {}
        for pks in replies.values():
            for k in pks:
                counts[k] = counts.get(k, 0) + 1
        for u, pks in replies.items():
            if u not in self.neighbours:
                self.rejected[u] = "not sampled"
            elif len(pks) != 2 or any(not is_public_key(k) or counts[k] > 1 for k in pks):
                self.rejected[u] = "unusable or duplicated public keys"
            elif self.roster is not None and not self.roster.verify(
                    u, key_statement(self.digest, u, pks[0], pks[1]), signatures.get(u, b"")):
                self.rejected[u] = "public keys not signed by its identity key"
            else:
                keys[u] = (pks[0], pks[1])  # (a tuple, whatever sequence arrived)
        live = self._prune(keys)
        if len(live) < t:
            self._abort(f"{len(live)} clients sent usable keys, fewer than the threshold {t}")
        self._keys = {u: keys[u] for u in live}
        self.key_signatures = {u: signatures[u] for u in live if u in signatures}
        self._directory = {u: {v: keys[v] for v in self._holders(u, live)} for u in live}
        return {u: dict(d) for u, d in self._directory.items()}

    def collect_shares(self, replies: Mapping[int, Mapping[int, bytes]]
                       ) -> dict[int, dict[int, bytes]]:
        """Stage 2 replies (source -> destination -> ciphertext) -> each destination's
        deliveries (source -> ciphertext)."""
        self._enter("share_keys", "masked_input")
        t, sent = self.params.threshold, {}
        for u, cts in replies.items():
            if u not in self._directory:
                self.rejected[u] = "shares from a client not in stage 2"
            elif set(cts) != set(self._directory[u]) - {u}:
                self.rejected[u] = "shares not addressed to exactly its live neighbours"
            elif not all(isinstance(c, bytes) for c in cts.values()):
                self.rejected[u] = "a share that is not bytes"
            else:
                sent[u] = cts
        self._u2 = u2 = self._prune(sent)
        if len(u2) < t:
            self._abort(f"{len(u2)} clients can go on to stage 3, fewer than the threshold {t}")
        return {v: {u: sent[u][v] for u in self.neighbours[v] & u2} for v in u2}

    def collect_masked(self, replies: Mapping[int, np.ndarray],
                       blamed: Mapping[int, Iterable[int]] | None = None
                       ) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Stage 3 replies (client -> y; client -> the neighbours it blames) -> each
        survivor's unmask request (survivors whose b-shares it holds, dropped whose
        sk1-shares it holds). A blamed client is dropped (its y is not summed); its sk1 is
        recovered only if some survivor masked with it."""
        self._enter("masked_input", "sign" if self.params.signers else "unmask")
        masked = self._valid_masked(replies)
        blames = self._blames(masked, blamed or {})
        for v in sorted(set().union(*blames.values()) & set(masked)):
            by = sorted(u for u, b in blames.items() if v in b)
            self.rejected[v] = f"blamed by {by}: shares that do not open"
            del masked[v]
        p, u3 = self.params, set(masked)
        self._masked = masked
        if len(u3) < p.threshold:
            self._abort(f"{len(u3)} survivors, fewer than the threshold {p.threshold}")
        self._u3 = u3
        self._unpaired = {(u, v) for u in u3 for v in blames.get(u, ())}  # no mask between
        self._dropped = {w for w in self._u2 - u3 if self._maskers(w)}
        for u in sorted(u3 | self._dropped):
            held = self._maskers(u) if u in self._dropped else self._holders(u, u3)
            if len(held) < p.threshold:
                self._abort(f"client {u}'s shares are held by {len(held)} survivors, fewer "
                            f"than the threshold {p.threshold}")
        self._requests = {v: (tuple(sorted(self._holders(v, u3))),
                              tuple(sorted(w for w in self.neighbours[v] & self._dropped
                                           if (v, w) not in self._unpaired)))
                          for v in u3}
        return dict(self._requests)

    def survivor_set(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(U2, U3), sorted: what every survivor signs in the consistency check."""
        return tuple(sorted(self._u2)), self.survivors

    def sign_requests(self) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """The consistency check's requests: ``survivor_set`` to every survivor."""
        return dict.fromkeys(self._requests, self.survivor_set())

    def collect_signatures(self, replies: Mapping[int, bytes]
                           ) -> dict[int, tuple[tuple[int, ...], tuple[int, ...], dict]]:
        """The consistency check's replies (survivor -> its signature on ``survivor_set``)
        -> each replier's unmask request, with ``signers`` valid signatures (it verifies
        in id order until it has them, else it aborts; each client verifies them again)."""
        self._enter("sign", "unmask")
        assert self.roster is not None
        statement = survivor_statement(self.digest, *self.survivor_set())
        valid: dict[int, bytes] = {}
        for u, sig in sorted(replies.items()):
            if u not in self._u3:
                self.rejected[u] = "a survivor-set signature from a client not in U3"
            elif len(valid) < self.params.signers:
                if self.roster.verify(u, statement, sig):
                    valid[u] = sig
                else:
                    self.rejected[u] = "a survivor-set signature that does not verify"
        if len(valid) < self.params.signers:
            self._abort(f"{len(valid)} survivors signed the survivor sets, fewer than "
                        f"signers {self.params.signers}")
        self._requests = {u: q for u, q in self._requests.items()
                          if u in replies and u not in self.rejected}
        return {u: (*q, dict(valid)) for u, q in self._requests.items()}

    def _valid_masked(self, replies: Mapping[int, np.ndarray]) -> dict[int, np.ndarray]:
        p, masked = self.params, {}
        for u, y in replies.items():
            y = np.asarray(y)
            if u not in self._u2:
                self.rejected[u] = "a masked vector from a client not in stage 3"
            elif y.shape != (p.length,) or y.dtype != np.uint32 or (
                    p.bits < 32 and (y >> p.bits).any()):
                self.rejected[u] = f"not a uint32 vector of length {p.length} mod 2^{p.bits}"
            else:
                masked[u] = y
        return masked

    def _blames(self, masked: dict[int, np.ndarray], blamed: Mapping[int, Iterable[int]]
                ) -> dict[int, set[int]]:
        """Each sender's blame, if it names only neighbours that sent it shares (else its
        reply is set aside, as malformed)."""
        out = {}
        for u in sorted(masked):
            b = set(_ids(blamed.get(u, ()), "blamed"))
            if b - (self.neighbours[u] & self._u2):
                self.rejected[u] = "blames a client that sent it no shares"
                del masked[u]
            elif b:
                out[u] = b
        return out

    def _maskers(self, w: int) -> set[int]:
        """The survivors whose y has a pairwise mask with w (they opened its shares)."""
        return {u for u in self.neighbours[w] & self._u3 if (u, w) not in self._unpaired}

    def collect_unmask(self, replies: Mapping[int, Mapping[int, bytes]]) -> np.ndarray:
        """Stage 4 replies (client -> node -> share) -> the sum of the survivors' inputs
        mod 2^bits (uint32)."""
        self._enter("unmask", "done")
        p = self.params
        b_shares: dict[int, list[bytes]] = {u: [] for u in self._u3}
        sk_shares: dict[int, list[bytes]] = {w: [] for w in self._dropped}
        for v, shares in replies.items():
            survivors, dropped = self._requests.get(v, ((), ()))
            if v not in self._requests or set(shares) != set(survivors) | set(dropped):
                self.rejected[v] = "shares that were not asked for"
            elif not all(_share_ok(s, v, p) for s in shares.values()):
                self.rejected[v] = "a malformed share, or one not at its own point"
            else:
                for u in survivors:
                    b_shares[u].append(shares[u])
                for w in dropped:
                    sk_shares[w].append(shares[w])
        short = sorted(u for u, s in (b_shares | sk_shares).items() if len(s) < p.threshold)
        if short:
            self._abort(f"fewer than {p.threshold} shares arrived for clients {short}")
        try:
            seeds = {u: combine(s) for u, s in sorted(b_shares.items())}
            keys = {w: combine(s) for w, s in sorted(sk_shares.items())}
        except SecAggError as err:
            self._abort(f"the shares cannot be combined: {err}")
        if wrong := [w for w, sk in keys.items() if public_key(sk) != self._keys[w][0]]:
            self._abort(f"the keys recovered for {wrong} do not match their public keys")
        total = np.zeros(p.length, np.uint32)
        for y in self._masked.values():
            total += y
        for seed in seeds.values():
            total -= prg(seed, p.length, p.bits, SELF_MASK)
        for w, sk in keys.items():
            for u in sorted(self._maskers(w)):
                mask = prg(_mask_seed(sk, self._keys[u][0], p), p.length, p.bits, PAIR_MASK)
                if w < u:  # u added PRG(s_uw) for its smaller neighbour w
                    total -= mask
                else:
                    total += mask
        self.result = total & np.uint32(p.modulus - 1)
        return self.result
