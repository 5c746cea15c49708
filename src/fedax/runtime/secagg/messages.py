"""The byte messages of SecAgg+, one per stage and direction.

Every message is ``version: uint8 | tag: uint8`` followed by its fields, big-endian:
integers are ``uint32`` unless noted, a blob is ``uint32 length | bytes``, an id list is
``uint32 count | uint32 ids``, a map is ``uint32 count | (uint32 id | blob)*``.

====================  =========  ====================================================
message               direction  fields
====================  =========  ====================================================
``Setup``             s -> c     params (n, k, t, bits: uint8, d, s, session blob),
                                 cid, neighbour ids, member ids (all n, with s > 0)
``PublicKeys``        c -> s     cid, pk1 (32 bytes), pk2 (32 bytes), signature blob
                                 (Ed25519 over ``key_statement``; empty with s = 0)
``KeyDirectory``      s -> c     count, (id, pk1, pk2)*, map id -> signature
``EncryptedShares``   c -> s     src, map dst -> AES-GCM ciphertext
``ShareDelivery``     s -> c     dst, map src -> AES-GCM ciphertext
``MaskedVector``      c -> s     cid, bits: uint8, d, values (little-endian, 1, 2 or 4
                                 bytes each: the narrowest that holds 2^bits - 1),
                                 blamed ids (neighbours whose shares did not open)
``SurvivorSet``       s -> c     U2 ids, U3 ids (the consistency check, s > 0 only)
``SurvivorSignature`` c -> s     cid, signature blob (over ``survivor_statement``)
``UnmaskRequest``     s -> c     survivor ids, dropped ids, map id -> signature of U3
``UnmaskShares``      c -> s     cid, map id -> Shamir share
====================  =========  ====================================================

``from_bytes`` is strict: a wrong tag or version, a truncated field, trailing bytes, a
repeated id or a value out of range raise ``SecAggError`` with one line naming the message.
The ciphertext of a share message decrypts to ``src | dst | blob b-share | blob sk1-share``
(``ShareBundle``).
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fedax.runtime.secagg.crypto import KEY_BYTES
from fedax.runtime.secagg.errors import SecAggError
from fedax.runtime.secagg.identity import round_digest
from fedax.runtime.secagg.params import SecAggParams

VERSION = 2


class _Reader:
    def __init__(self, data: object, what: str, tag: int):
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise SecAggError(f"malformed {what}: expected bytes, got {type(data).__name__}")
        self.data, self.pos, self.what = bytes(data), 0, what
        version, got = self.unpack(">BB")
        if (version, got) != (VERSION, tag):
            self.fail(f"version {version} tag {got}, expected version {VERSION} tag {tag}")

    def fail(self, why: str):
        raise SecAggError(f"malformed {self.what}: {why}")

    def take(self, n: int) -> bytes:
        if n > len(self.data) - self.pos:
            self.fail("truncated")
        self.pos += n
        return self.data[self.pos - n:self.pos]

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def u32(self) -> int:
        return self.unpack(">I")[0]

    def count(self, item_bytes: int) -> int:
        n = self.u32()
        if n * item_bytes > len(self.data) - self.pos:
            self.fail("truncated")
        return n

    def blob(self) -> bytes:
        return self.take(self.u32())

    def ids(self) -> tuple[int, ...]:
        n = self.count(4)
        ids = struct.unpack(f">{n}I", self.take(4 * n))
        if len(set(ids)) != n:
            self.fail("repeated id")
        return ids

    def blobs(self) -> dict[int, bytes]:
        out: dict[int, bytes] = {}
        for _ in range(self.count(8)):
            key = self.u32()
            if key in out:
                self.fail(f"repeated id {key}")
            out[key] = self.blob()
        return out

    def end(self):
        if self.pos != len(self.data):
            self.fail(f"{len(self.data) - self.pos} trailing bytes")


def _head(tag: int) -> bytes:
    return struct.pack(">BB", VERSION, tag)


def _ids(ids) -> bytes:
    return struct.pack(f">I{len(ids)}I", len(ids), *ids)


def _blob(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _blobs(items: Mapping[int, bytes]) -> bytes:
    return struct.pack(">I", len(items)) + b"".join(
        struct.pack(">I", k) + _blob(v) for k, v in sorted(items.items()))


def _params(p: SecAggParams) -> bytes:
    return (struct.pack(">IIIBII", p.num_clients, p.num_shares, p.threshold, p.bits,
                        p.length, p.signers) + _blob(p.session))


@dataclass(frozen=True)
class Setup:
    """Server -> client: the round's parameters, the client's id and its neighbours, and
    (with a consistency check) the n members, sorted, which ``digest`` binds."""
    TAG = 1
    params: SecAggParams
    cid: int
    neighbours: tuple[int, ...]
    members: tuple[int, ...] = ()

    def to_bytes(self) -> bytes:
        return (_head(self.TAG) + _params(self.params) + struct.pack(">I", self.cid)
                + _ids(self.neighbours) + _ids(self.members))

    def digest(self) -> bytes:
        """The round every signature is bound to: SHA-256 of the parameters (session
        included) and the members, the same for every client of the round."""
        return round_digest(_params(self.params) + _ids(self.members))

    @classmethod
    def from_bytes(cls, data: bytes) -> Setup:
        r = _Reader(data, "Setup", cls.TAG)
        n, k, t, bits, length, signers = r.unpack(">IIIBII")
        session = r.blob()
        try:
            params = SecAggParams(n, k, t, bits, length, session, signers)
        except ValueError as err:
            raise SecAggError(f"malformed Setup: {err}") from None
        cid, neighbours, members = r.u32(), r.ids(), r.ids()
        r.end()
        if signers and (list(members) != sorted(members) or len(members) != n
                        or not {cid, *neighbours} <= set(members)):
            r.fail(f"the members must be the {n} client ids, sorted, this client and its "
                   "neighbours among them")
        return cls(params, cid, neighbours, members)


@dataclass(frozen=True)
class PublicKeys:
    """Client -> server, stage 1: the client's two X25519 public keys, signed (with a
    consistency check) by its identity key."""
    TAG = 2
    cid: int
    pk1: bytes
    pk2: bytes
    signature: bytes = b""

    def to_bytes(self) -> bytes:
        return (_head(self.TAG) + struct.pack(">I", self.cid) + self.pk1 + self.pk2
                + _blob(self.signature))

    @classmethod
    def from_bytes(cls, data: bytes) -> PublicKeys:
        r = _Reader(data, "PublicKeys", cls.TAG)
        out = cls(r.u32(), r.take(KEY_BYTES), r.take(KEY_BYTES), r.blob())
        r.end()
        return out


@dataclass(frozen=True)
class KeyDirectory:
    """Server -> client, stage 2: the public keys of the client and its live neighbours,
    and their signatures (with a consistency check)."""
    TAG = 3
    keys: Mapping[int, tuple[bytes, bytes]]
    signatures: Mapping[int, bytes] = dataclasses.field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return _head(self.TAG) + struct.pack(">I", len(self.keys)) + b"".join(
            struct.pack(">I", v) + pk1 + pk2 for v, (pk1, pk2) in sorted(self.keys.items())
        ) + _blobs(self.signatures)

    @classmethod
    def from_bytes(cls, data: bytes) -> KeyDirectory:
        r = _Reader(data, "KeyDirectory", cls.TAG)
        keys: dict[int, tuple[bytes, bytes]] = {}
        for _ in range(r.count(4 + 2 * KEY_BYTES)):
            v = r.u32()
            if v in keys:
                r.fail(f"repeated id {v}")
            keys[v] = (r.take(KEY_BYTES), r.take(KEY_BYTES))
        signatures = r.blobs()
        r.end()
        return cls(keys, signatures)


@dataclass(frozen=True)
class EncryptedShares:
    """Client -> server, stage 2: one ciphertext per neighbour, for the server to route."""
    TAG = 4
    src: int
    shares: Mapping[int, bytes]

    def to_bytes(self) -> bytes:
        return _head(self.TAG) + struct.pack(">I", self.src) + _blobs(self.shares)

    @classmethod
    def from_bytes(cls, data: bytes) -> EncryptedShares:
        r = _Reader(data, "EncryptedShares", cls.TAG)
        out = cls(r.u32(), r.blobs())
        r.end()
        return out


@dataclass(frozen=True)
class ShareDelivery:
    """Server -> client, stage 3: the ciphertexts addressed to ``dst``, by source."""
    TAG = 5
    dst: int
    shares: Mapping[int, bytes]

    def to_bytes(self) -> bytes:
        return _head(self.TAG) + struct.pack(">I", self.dst) + _blobs(self.shares)

    @classmethod
    def from_bytes(cls, data: bytes) -> ShareDelivery:
        r = _Reader(data, "ShareDelivery", cls.TAG)
        out = cls(r.u32(), r.blobs())
        r.end()
        return out


def _width(bits: int) -> str:
    return "<u1" if bits <= 8 else "<u2" if bits <= 16 else "<u4"


@dataclass(frozen=True)
class MaskedVector:
    """Client -> server, stage 3: y_u, the masked input mod 2^bits, and the neighbours it
    blames (their shares did not open; y_u has no mask with them)."""
    TAG = 6
    cid: int
    bits: int
    values: np.ndarray
    blamed: tuple[int, ...] = ()

    def to_bytes(self) -> bytes:
        values = np.asarray(self.values)
        return (_head(self.TAG) + struct.pack(">IBI", self.cid, self.bits, values.size)
                + values.astype(_width(self.bits)).tobytes() + _ids(self.blamed))

    @classmethod
    def from_bytes(cls, data: bytes) -> MaskedVector:
        r = _Reader(data, "MaskedVector", cls.TAG)
        cid, bits, length = r.unpack(">IBI")
        if not 1 <= bits <= 32:
            r.fail(f"bits {bits} not in [1, 32]")
        dtype = np.dtype(_width(bits))
        values = np.frombuffer(r.take(length * dtype.itemsize), dtype).astype(np.uint32)
        blamed = r.ids()
        r.end()
        if bits < 32 and values.size and int(values.max()) >> bits:
            r.fail(f"a value is not below 2^{bits}")
        return cls(cid, bits, values, blamed)


@dataclass(frozen=True)
class SurvivorSet:
    """Server -> client, the consistency check: U2 (sent shares), U3 (sent masked inputs)."""
    TAG = 10
    u2: tuple[int, ...]
    u3: tuple[int, ...]

    def to_bytes(self) -> bytes:
        return _head(self.TAG) + _ids(self.u2) + _ids(self.u3)

    @classmethod
    def from_bytes(cls, data: bytes) -> SurvivorSet:
        r = _Reader(data, "SurvivorSet", cls.TAG)
        out = cls(r.ids(), r.ids())
        r.end()
        return out


@dataclass(frozen=True)
class SurvivorSignature:
    """Client -> server, the consistency check: its signature on the ``SurvivorSet``."""
    TAG = 11
    cid: int
    signature: bytes

    def to_bytes(self) -> bytes:
        return _head(self.TAG) + struct.pack(">I", self.cid) + _blob(self.signature)

    @classmethod
    def from_bytes(cls, data: bytes) -> SurvivorSignature:
        r = _Reader(data, "SurvivorSignature", cls.TAG)
        out = cls(r.u32(), r.blob())
        r.end()
        return out


@dataclass(frozen=True)
class UnmaskRequest:
    """Server -> client, stage 4: whose b-shares (survivors) and sk1-shares (dropped), and
    (with a consistency check) the survivors' signatures on the ``SurvivorSet``."""
    TAG = 7
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]
    signatures: Mapping[int, bytes] = dataclasses.field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return (_head(self.TAG) + _ids(self.survivors) + _ids(self.dropped)
                + _blobs(self.signatures))

    @classmethod
    def from_bytes(cls, data: bytes) -> UnmaskRequest:
        r = _Reader(data, "UnmaskRequest", cls.TAG)
        out = cls(r.ids(), r.ids(), r.blobs())
        r.end()
        return out


@dataclass(frozen=True)
class UnmaskShares:
    """Client -> server, stage 4: the requested Shamir shares, by the node they belong to."""
    TAG = 8
    cid: int
    shares: Mapping[int, bytes]

    def to_bytes(self) -> bytes:
        return _head(self.TAG) + struct.pack(">I", self.cid) + _blobs(self.shares)

    @classmethod
    def from_bytes(cls, data: bytes) -> UnmaskShares:
        r = _Reader(data, "UnmaskShares", cls.TAG)
        out = cls(r.u32(), r.blobs())
        r.end()
        return out


@dataclass(frozen=True)
class ShareBundle:
    """The plaintext inside one encrypted share message: u's shares of b_u and sk1_u for v."""
    TAG = 9
    src: int
    dst: int
    b_share: bytes
    sk_share: bytes

    def to_bytes(self) -> bytes:
        return (_head(self.TAG) + struct.pack(">II", self.src, self.dst) + _blob(self.b_share)
                + _blob(self.sk_share))

    @classmethod
    def from_bytes(cls, data: bytes) -> ShareBundle:
        r = _Reader(data, "ShareBundle", cls.TAG)
        src, dst = r.unpack(">II")
        out = cls(src, dst, r.blob(), r.blob())
        r.end()
        return out
