"""Shamir t-of-n secret sharing of byte strings over a prime field (Shamir, CACM 1979).

A secret is cut into chunks of ``(p.bit_length() - 1) // 8`` bytes, each below the prime
``p``; every chunk is the constant term of its own random polynomial of degree ``t - 1``
(coefficients uniform in ``[0, p)``, rejection-sampled from ``rng``), and a share is the
values of all those polynomials at one nonzero point ``x``. SecAgg evaluates at
``x = client id + 1`` (Bonawitz et al., CCS 2017). ``combine`` interpolates at 0 (Lagrange)
from any ``t`` shares and checks every further share lies on the same polynomials.

The default field is GF(2^127 - 1), a Mersenne prime: 15 secret bytes per 16-byte element,
so a 32-byte secret gives a 56-byte share. A share is self-describing::

    x: uint32 | threshold: uint16 | secret length: uint16 | chunk values: 16 bytes each
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Sequence

from fedax.runtime.secagg.errors import SecAggError

PRIME = 2**127 - 1
_HEADER = struct.Struct(">IHH")


def _sizes(prime: int) -> tuple[int, int]:
    """(secret bytes per chunk, bytes per field element) for ``prime``."""
    chunk = (prime.bit_length() - 1) // 8
    if chunk < 1:
        raise ValueError(f"prime {prime} is too small: use a prime above 256")
    return chunk, (prime.bit_length() + 7) // 8


def _uniform(prime: int, rng: Callable[[int], bytes]) -> int:
    """A uniform element of GF(prime), by rejection sampling."""
    nbytes, mask = (prime.bit_length() + 7) // 8, (1 << prime.bit_length()) - 1
    while True:
        value = int.from_bytes(rng(nbytes), "big") & mask
        if value < prime:
            return value


def _evaluate(coefficients: Sequence[int], x: int, prime: int) -> int:
    value = 0
    for c in reversed(coefficients):
        value = (value * x + c) % prime
    return value


def split(secret: bytes, points: Sequence[int], threshold: int, *,
          rng: Callable[[int], bytes] = os.urandom, prime: int = PRIME) -> list[bytes]:
    """Shares of ``secret``, one per evaluation point; any ``threshold`` of them recover it."""
    chunk, elem = _sizes(prime)
    if not isinstance(secret, bytes) or not 1 <= len(secret) < 2**16:
        raise ValueError("secret must be 1 to 65535 bytes")
    if not 2 <= threshold <= len(points) or threshold >= 2**16:
        raise ValueError(f"threshold {threshold} must be in [2, number of points "
                         f"{len(points)}] (and below 65536)")
    if len(set(points)) != len(points) or any(not 1 <= x < min(prime, 2**32) for x in points):
        raise ValueError("points must be distinct integers in [1, min(prime, 2**32))")
    polys = [[int.from_bytes(secret[i:i + chunk], "big")]
             + [_uniform(prime, rng) for _ in range(threshold - 1)]
             for i in range(0, len(secret), chunk)]
    return [_HEADER.pack(x, threshold, len(secret))
            + b"".join(_evaluate(p, x, prime).to_bytes(elem, "big") for p in polys)
            for x in points]


def parse(share: bytes, *, prime: int = PRIME) -> tuple[int, int, int, list[int]]:
    """``(x, threshold, secret length, chunk values)`` of a share; malformed -> SecAggError."""
    chunk, elem = _sizes(prime)
    if not isinstance(share, bytes) or len(share) < _HEADER.size:
        raise SecAggError("malformed share: shorter than its header")
    x, threshold, length = _HEADER.unpack_from(share)
    nchunks = -(-length // chunk)
    if len(share) != _HEADER.size + nchunks * elem or x == 0 or threshold < 2 or length == 0:
        raise SecAggError("malformed share: header and size disagree")
    body = share[_HEADER.size:]
    values = [int.from_bytes(body[i:i + elem], "big") for i in range(0, len(body), elem)]
    if any(v >= prime for v in values):
        raise SecAggError("malformed share: a value is not in the field")
    return x, threshold, length, values


def _weights(xs: Sequence[int], z: int, prime: int) -> list[int]:
    """Lagrange basis values at ``z`` for the nodes ``xs``."""
    weights = []
    for j, xj in enumerate(xs):
        num, den = 1, 1
        for m, xm in enumerate(xs):
            if m != j:
                num, den = num * (z - xm) % prime, den * (xj - xm) % prime
        weights.append(num * pow(den, -1, prime) % prime)
    return weights


def combine(shares: Iterable[bytes], *, prime: int = PRIME) -> bytes:
    """The secret behind ``shares`` (at least its threshold, distinct points, consistent)."""
    chunk, _ = _sizes(prime)
    parsed = [parse(s, prime=prime) for s in shares]
    if not parsed:
        raise SecAggError("no shares to combine")
    _, threshold, length, _ = parsed[0]
    if any((t, n) != (threshold, length) for _, t, n, _ in parsed):
        raise SecAggError("shares of different secrets (threshold or length differ)")
    if len({p[0] for p in parsed}) != len(parsed):
        raise SecAggError("two shares at the same point")
    if len(parsed) < threshold:
        raise SecAggError(f"{len(parsed)} shares, fewer than the threshold {threshold}")
    base, extra = parsed[:threshold], parsed[threshold:]
    xs = [p[0] for p in base]
    at_zero = _weights(xs, 0, prime)
    checks = [(p[3], _weights(xs, p[0], prime)) for p in extra]
    out = bytearray()
    for i in range(len(base[0][3])):
        ys = [p[3][i] for p in base]
        for values, w in checks:
            if sum(a * y for a, y in zip(w, ys, strict=True)) % prime != values[i]:
                raise SecAggError("shares disagree: one of them is corrupted")
        size = min(chunk, length - i * chunk)
        value = sum(a * y for a, y in zip(at_zero, ys, strict=True)) % prime
        if value >= 256**size:
            raise SecAggError("shares disagree: the recovered chunk is out of range")
        out += value.to_bytes(size, "big")
    return bytes(out)
