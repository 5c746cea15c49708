"""The cryptography of SecAgg (Bonawitz et al., CCS 2017; Bell et al., CCS 2020).

* key agreement: X25519 (RFC 7748) followed by HKDF-SHA256 (RFC 5869) with the session id
  as salt and a domain-separating ``info`` per use (``MASK_INFO``, ``SHARE_INFO``);
* share encryption: AES-256-GCM, a random 96-bit nonce prepended, the associated data
  binding session, source and destination;
* the mask PRG: the ChaCha20 keystream (RFC 8439) under a 32-byte seed and a fixed nonce
  per purpose, read as little-endian uint32 and reduced mod 2^b with a bit mask (uniform,
  since 2^b divides 2^32). NumPy's generators are never used for masks.

Flower uses SECP384R1, Fernet and a NumPy generator seeded with 32 bits instead
(docs/references.md, secure aggregation).
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedax.runtime.secagg.errors import SecAggError

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
MASK_INFO = b"fedax secagg mask"
SHARE_INFO = b"fedax secagg share enc"
SELF_MASK = b"self mask"  # PRG purposes: the nonce is the purpose, zero-padded
PAIR_MASK = b"pair mask"

Rng = Callable[[int], bytes]
_PROBE = X25519PrivateKey.from_private_bytes(bytes(range(KEY_BYTES)))  # any clamped key will do


def keypair(rng: Rng = os.urandom) -> tuple[bytes, bytes]:
    """A fresh X25519 key pair as raw bytes ``(private, public)``."""
    private = X25519PrivateKey.from_private_bytes(rng(KEY_BYTES))
    return private.private_bytes_raw(), private.public_key().public_bytes_raw()


def public_key(private: bytes) -> bytes:
    """The X25519 public key of raw ``private`` bytes."""
    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes_raw()


def is_public_key(data: object) -> bool:
    """Is ``data`` an X25519 public key that is not of low order (one that would make every
    shared secret all zeros, RFC 7748 section 6.1)?"""
    if not isinstance(data, bytes):  # (cryptography takes bytes only: a TypeError)
        return False
    try:
        _PROBE.exchange(X25519PublicKey.from_public_bytes(data))
    except (TypeError, ValueError):
        return False
    return True


def agree(private: bytes, peer_public: bytes, *, info: bytes, salt: bytes) -> bytes:
    """A 32-byte key both ends derive: HKDF-SHA256(X25519(private, peer_public))."""
    try:
        shared = X25519PrivateKey.from_private_bytes(private).exchange(
            X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as err:  # a wrong length, or a low-order point (an all-zero secret)
        raise SecAggError(f"key agreement refused: {err}") from None
    return HKDF(hashes.SHA256(), KEY_BYTES, salt, info).derive(shared)


def _aad(session: bytes, src: int, dst: int) -> bytes:
    return struct.pack(">H", len(session)) + session + struct.pack(">II", src, dst)


def seal(key: bytes, plaintext: bytes, *, session: bytes, src: int, dst: int,
         rng: Rng = os.urandom) -> bytes:
    """AES-256-GCM encryption of a message from ``src`` to ``dst``: nonce || ciphertext."""
    nonce = rng(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, _aad(session, src, dst))


def unseal(key: bytes, ciphertext: bytes, *, session: bytes, src: int, dst: int) -> bytes:
    """The plaintext of ``seal``; a tampered, misrouted or replayed message -> SecAggError."""
    if len(ciphertext) < NONCE_BYTES + TAG_BYTES:
        raise SecAggError(f"ciphertext from {src} to {dst} is too short")
    try:
        return AESGCM(key).decrypt(ciphertext[:NONCE_BYTES], ciphertext[NONCE_BYTES:],
                                   _aad(session, src, dst))
    except InvalidTag:
        raise SecAggError(f"ciphertext from {src} to {dst} fails authentication") from None


def prg(seed: bytes, length: int, bits: int, purpose: bytes) -> np.ndarray:
    """``length`` uniform values mod 2^bits (uint32) from the ChaCha20 keystream of ``seed``."""
    if len(seed) != KEY_BYTES or len(purpose) > 12:
        raise ValueError("the PRG takes a 32-byte seed and a purpose of at most 12 bytes")
    nonce = bytes(4) + purpose.ljust(12, b"\0")  # 32-bit block counter from 0, then nonce
    stream = Cipher(algorithms.ChaCha20(seed, nonce), None).encryptor().update(bytes(4 * length))
    values = np.frombuffer(stream, dtype="<u4").astype(np.uint32, copy=False)
    return values if bits == 32 else values & np.uint32((1 << bits) - 1)


def seeded_rng(seed: bytes) -> Rng:
    """A deterministic byte source (ChaCha20 under SHA-256(seed)) for reproducible tests.

    Never use it for real keys: anyone who knows ``seed`` knows every key drawn from it.
    """
    encryptor = Cipher(algorithms.ChaCha20(hashlib.sha256(seed).digest(), bytes(16)),
                       None).encryptor()
    return lambda n: encryptor.update(bytes(n))
