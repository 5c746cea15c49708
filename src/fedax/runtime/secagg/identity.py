"""Client identity keys for SecAgg+ against a malicious server (Bonawitz et al., CCS 2017,
§4 "active adversaries"; Bell et al., CCS 2020, §5).

Every public key a client sees is relayed by the server, so without a trust anchor a lying
server could substitute its own keys, or tell different clients different stories about
who dropped out. The anchor is a ``Roster``: each client's Ed25519 verification key,
distributed to every client outside the server (as the TLS CA is). Each client keeps its
``IdentityKey`` (the signing key, never sent) and signs, under the round's digest (its
parameters and members, so that every signer agrees on n and the session):

* ``key_statement``: its two X25519 public keys (stage 1), checked by its neighbours
  before they encrypt anything to it;
* ``survivor_statement``: the survivor sets U2 (sent shares) and U3 (sent masked
  inputs) the server told it (the consistency check). A client reveals shares only once
  it holds ``params.signers`` valid signatures by members of U3 on the very statement it
  signed; with ``signers > (n + c) / 2`` two honest clients can never be shown two
  different statements, even by a server colluding with c clients, since each honest
  client signs one statement per session.

Ed25519 is RFC 8032 (``cryptography``); a signature is 64 bytes, a key 32.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

SIGNATURE_BYTES = 64
KEY_STATEMENT = b"fedax secagg keys v1"
SURVIVOR_STATEMENT = b"fedax secagg survivors v1"


def _ids(ids: Iterable[int]) -> bytes:
    ids = sorted(ids)
    return struct.pack(f">I{len(ids)}I", len(ids), *ids)


def key_statement(digest: bytes, cid: int, pk1: bytes, pk2: bytes) -> bytes:
    """What client ``cid`` signs in stage 1: its X25519 public keys in this round."""
    return KEY_STATEMENT + digest + struct.pack(">I", cid) + pk1 + pk2


def survivor_statement(digest: bytes, u2: Iterable[int], u3: Iterable[int]) -> bytes:
    """What a survivor signs before stage 4: the round, U2 and U3 (sorted)."""
    return SURVIVOR_STATEMENT + digest + _ids(u2) + _ids(u3)


def round_digest(encoded_setup_fields: bytes) -> bytes:
    """SHA-256 of the round's public parameters and members (``Setup.digest``)."""
    return hashlib.sha256(b"fedax secagg round v1" + encoded_setup_fields).digest()


class IdentityKey:
    """A client's Ed25519 signing key (``generate``, ``load``, ``save``; ``public``)."""

    def __init__(self, private: Ed25519PrivateKey):
        self._private = private
        self.public = private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @classmethod
    def generate(cls) -> IdentityKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> IdentityKey:
        """A key from 32 bytes (tests and rehearsals only: anyone with the seed signs)."""
        return cls(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(seed).digest()))

    @classmethod
    def load(cls, path: str | os.PathLike) -> IdentityKey:
        """The key in a PEM file ``save`` wrote; one line if it is not one."""
        try:
            key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as err:
            raise ValueError(f"identity key {path}: not a readable PEM private key ({err})"
                             ) from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"identity key {path}: not an Ed25519 key")
        return cls(key)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the key as PEM, readable by its owner only."""
        pem = self._private.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)

    def sign(self, message: bytes) -> bytes:
        return self._private.sign(message)


class Roster:
    """Client id -> Ed25519 verification key: the trust anchor, from outside the server."""

    def __init__(self, keys: Mapping[int, bytes]):
        for cid, key in keys.items():
            if isinstance(cid, bool) or not isinstance(cid, int) or cid < 0:
                raise ValueError(f"roster: client id {cid!r} is not a non-negative int")
            if not isinstance(key, bytes) or len(key) != 32:
                raise ValueError(f"roster: client {cid}'s key is not 32 bytes")
        self._keys = {cid: Ed25519PublicKey.from_public_bytes(k) for cid, k in keys.items()}
        self.keys = dict(keys)

    def __contains__(self, cid: object) -> bool:
        return cid in self._keys

    @classmethod
    def of(cls, identities: Mapping[int, IdentityKey]) -> Roster:
        return cls({cid: key.public for cid, key in identities.items()})

    def verify(self, cid: int, message: bytes, signature: bytes) -> bool:
        """Whether ``signature`` is client ``cid``'s on ``message`` (False if unlisted)."""
        key = self._keys.get(cid)
        if key is None or not isinstance(signature, bytes) or len(signature) != 64:
            return False
        try:
            key.verify(signature, message)
        except InvalidSignature:
            return False
        return True

    def save(self, path: str | os.PathLike) -> None:
        """JSON ``{"ed25519": {"<id>": "<hex key>", ...}}``."""
        Path(path).write_text(json.dumps(
            {"ed25519": {str(c): k.hex() for c, k in sorted(self.keys.items())}}, indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Roster:
        """The roster ``save`` wrote; one line naming what is wrong otherwise."""
        try:
            entries = json.loads(Path(path).read_text())["ed25519"]
            return cls({int(c): bytes.fromhex(k) for c, k in entries.items()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"roster {path}: expected JSON {{\"ed25519\": {{\"<client id>\": "
                             f"\"<64 hex digits>\"}}}} ({type(err).__name__}: {err})") from None
