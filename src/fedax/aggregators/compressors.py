"""Compressors: how one leaf of a client's update is encoded on the client and decoded on
the server (``Compressor``), for ``fedax.aggregators.compression``'s aggregator.

Each works on one leaf x ∈ R^d at a time, flattened:

* ``qsgd(s, bucket_size=512)`` (Alistarh et al., NeurIPS 2017): per bucket v of
  ``bucket_size`` coordinates, a_i = |v_i|/‖v‖₂, ℓ_i = ⌊s·a_i⌋ and
  Q_s(v)_i = ‖v‖₂ · sign(v_i) · ξ_i / s with ξ_i = ℓ_i + 1 with probability s·a_i − ℓ_i,
  else ℓ_i. Unbiased, E Q_s(v) = v, with E‖Q_s(v) − v‖² ≤ min(B/s², √B/s)·‖v‖² per bucket
  of size B. Sent: sign·ξ ∈ {−s..s} in ⌈log₂(2s+1)⌉ bits, and one ``float32`` norm per
  bucket. (The paper's experiments also bucket, with B = 512; its Elias coding is not used.)
* ``rotation(b, block_size=4096, seed=0)`` (Suresh, Yu, Kumar, McMahan, ICML 2017, π_srk):
  rotate by R = (1/√B) H·D (H the Walsh–Hadamard matrix of a block of B = 2^m coordinates, D
  diagonal Rademacher signs), then stochastic k-level quantization with k = 2^b between the
  block's min and max: z ↦ lo + (hi − lo)/(k−1) · c, c = ⌊t⌋ + Bernoulli(t − ⌊t⌋),
  t = (z − lo)(k−1)/(hi − lo). Unbiased; the rotation spreads the mass so that hi − lo is
  O(‖x‖·√(log B / B)) and the MSE of the mean of n clients falls from Θ(d/n) to
  O(log d / n). D is *shared*: drawn from the aggregator's state (a key the server
  broadcasts and advances every round), the same for every client, so the server sums the
  decoded rotated vectors and applies R⁻¹ = D·H/√B once (TFF's ``HadamardTransformFactory``).
  Each leaf is zero-padded to whole blocks; H is applied as a Kronecker product of two small
  Hadamard matrices (H_{2^m} = H_{2^{m₁}} ⊗ H_{2^{m₂}}). Sent: b-bit codes and two
  ``float32`` per block.
* ``top_k(fraction)`` (Stich, Cordonnier, Jaggi, NeurIPS 2018; Karimireddy et al., ICML
  2019): per leaf, the k = ⌈fraction·d⌉ coordinates of largest magnitude (ties: the lower
  index), sent as ``float32`` values and ``int32`` indices. Biased; pair it with error
  feedback (``fedax.algorithms.error_feedback``), which keeps the residual
  e ← p − C(p), p = Δ + e, as per-client state.
* ``cast("float16" | "bfloat16")``: the update in 16 bits (FLSim's half-precision channel);
  ``cast("int8", bucket_size=512)``: round to nearest on a per-bucket scale max|v|/127
  (FLSim's 8-bit scalar quantization channel, per bucket). Deterministic, biased.

``make_compressor`` builds the one a config names (``SCHEMES``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedax.aggregators.dp import _number

# ------------------------------------------------------------------------- bit packing


def codes_per_word(bits: int) -> int:
    """How many ``bits``-bit codes one ``uint32`` word holds (⌊32/bits⌋)."""
    return 32 // bits


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
    """``[n]`` unsigned codes < 2^bits into ``[⌈n/⌊32/bits⌋⌉]`` ``uint32`` words, code j of
    word w in bits [bits·j, bits·(j+1)) (little end first)."""
    per = codes_per_word(bits)
    n = codes.shape[0]
    words = -(-n // per)
    padded = jnp.zeros((words * per,), jnp.uint32).at[:n].set(codes.astype(jnp.uint32))
    shifts = jnp.arange(per, dtype=jnp.uint32) * jnp.uint32(bits)
    return jnp.sum(padded.reshape(words, per) << shifts, axis=1, dtype=jnp.uint32)


def unpack_bits(words: jax.Array, bits: int, n: int) -> jax.Array:
    """The first ``n`` codes of ``pack_bits`` output, as ``uint32``."""
    per = codes_per_word(bits)
    shifts = jnp.arange(per, dtype=jnp.uint32) * jnp.uint32(bits)
    mask = jnp.uint32((1 << bits) - 1)
    return ((words[:, None] >> shifts) & mask).reshape(-1)[:n]


# ---------------------------------------------------------------------------- compressors


class Compressor(NamedTuple):
    """How one leaf is encoded and decoded (see the module docstring).

    Attributes:
      name: e.g. ``"qsgd(s=7)"``.
      encode: ``encode(x [d] float32, shared, key) -> code`` (a dict of arrays), one client,
        one leaf; ``key`` is that client's (None for a deterministic compressor).
      decode: ``decode(code, shared, d) -> [D] float32`` in the *transport domain*, where
        messages are averaged (the rotated, padded vector for ``rotation``; x's own
        coordinates, possibly padded, otherwise). Its L2 norm bounds that of the result.
      unfold: ``unfold(y [D], shared, d) -> [d]``, linear, applied once after the average
        (the inverse rotation; dropping the padding).
      init: ``init() -> shared`` state (``rotation``'s raw key, from its seed; ``()`` otherwise).
      stochastic: encode draws random numbers (needs a key).
      unbiased: E decode∘encode(x) = x.
    """

    name: str
    encode: Callable[[jax.Array, Any, Any], dict[str, jax.Array]]
    decode: Callable[[dict[str, jax.Array], Any, int], jax.Array]
    unfold: Callable[[jax.Array, Any, int], jax.Array]
    init: Callable[[], Any]
    stochastic: bool
    unbiased: bool


def _no_shared() -> tuple:
    return ()


def _crop(y: jax.Array, shared: Any, d: int) -> jax.Array:
    del shared
    return y[:d]


def _buckets(x: jax.Array, bucket_size: int) -> jax.Array:
    """``x [d]`` zero-padded into ``[⌈d/B⌉, B]`` buckets, B = min(bucket_size, d)."""
    d = x.shape[0]
    size = max(1, min(bucket_size, d))
    n = -(-d // size)
    return jnp.zeros((n * size,), x.dtype).at[:d].set(x).reshape(n, size)


def _int_arg(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}.")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value!r}.")
    return int(value)


def _need_key(key: Any, name: str) -> None:
    if key is None:
        raise ValueError(f"{name} draws random numbers and needs a key: run the aggregator "
                         "with a round key (alg.round(state, cohort, key)), not None.")


def qsgd(levels: int, bucket_size: int = 512) -> Compressor:
    """QSGD's unbiased stochastic quantization with s = ``levels`` levels per sign, per
    bucket of ``bucket_size`` coordinates (see the module docstring); ⌈log₂(2s+1)⌉ bits a
    coordinate plus 32 bits a bucket."""
    s = _int_arg("qsgd levels", levels, 1, 2**15)
    bucket_size = _int_arg("qsgd bucket_size", bucket_size, 1)
    bits = max(1, math.ceil(math.log2(2 * s + 1)))

    def encode(x, shared, key):
        del shared
        _need_key(key, "qsgd")
        v = _buckets(x.astype(jnp.float32), bucket_size)
        norm = jnp.sqrt(jnp.sum(v * v, axis=1))
        a = jnp.abs(v) / jnp.where(norm > 0, norm, 1.0)[:, None]
        scaled = jnp.minimum(a * s, float(s))
        low = jnp.floor(scaled)
        u = jax.random.uniform(key, v.shape, jnp.float32)
        xi = low + (u < scaled - low).astype(jnp.float32)
        signed = jnp.where(v < 0, -xi, xi).astype(jnp.int32)
        return {"norm": norm, "codes": pack_bits((signed + s).reshape(-1), bits)}

    def decode(code, shared, d):
        del shared
        n, size = _bucket_shape(d, bucket_size)
        signed = unpack_bits(code["codes"], bits, n * size).astype(jnp.int32) - s
        y = code["norm"][:, None] * (signed.reshape(n, size).astype(jnp.float32) / s)
        return y.reshape(-1)

    return Compressor(f"qsgd(s={s})", encode, decode, _crop, _no_shared, True, True)


def _bucket_shape(d: int, bucket_size: int) -> tuple[int, int]:
    size = max(1, min(bucket_size, d))
    return -(-d // size), size


def hadamard(n: int) -> np.ndarray:
    """The n×n Sylvester Walsh–Hadamard matrix (n a power of 2), entries ±1."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def _block_size(d: int, block_size: int) -> int:
    """min(block_size, the power of 2 at or above d)."""
    return min(block_size, 1 << max(0, (d - 1).bit_length()))


def walsh_hadamard(v: jax.Array) -> jax.Array:
    """(1/√B) H v on each row of ``v [n, B]`` (B = 2^m), as (H₁ ⊗ H₂)/√B: orthonormal and
    symmetric, so it is its own inverse."""
    n, size = v.shape
    m = size.bit_length() - 1
    h1 = jnp.asarray(hadamard(1 << (m // 2)))
    h2 = jnp.asarray(hadamard(1 << (m - m // 2)))
    x = v.reshape(n, h1.shape[0], h2.shape[0])
    out = jnp.einsum("ij,bjk,kl->bil", h1, x, h2, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(n, size) / jnp.sqrt(jnp.float32(size))


def rotation_signs(shared: jax.Array, leaf: int, shape: tuple[int, int]) -> jax.Array:
    """The shared Rademacher diagonal D of leaf number ``leaf``: ±1 ``float32``."""
    key = jax.random.fold_in(jax.random.wrap_key_data(shared), leaf)
    return jax.random.rademacher(key, shape, jnp.float32)


def rotation(bits: int, block_size: int = 4096, seed: int = 0, *,
             rotate: bool = True) -> Compressor:
    """Suresh et al.'s randomized Hadamard rotation + b-bit stochastic quantization (see the
    module docstring); ``seed`` seeds the shared rotation of the first round.
    ``rotate=False`` is their plain stochastic k-level quantization π_sk (the same blocks,
    no rotation), the baseline whose mean-estimation error the rotation improves."""
    b = _int_arg("rotation bits", bits, 1, 16)
    block_size = _int_arg("rotation block_size", block_size, 2)
    if block_size & (block_size - 1):
        raise ValueError(f"rotation block_size must be a power of 2, got {block_size}.")
    seed = _int_arg("rotation seed", seed, 0)
    top = (1 << b) - 1

    def shape(d):
        size = _block_size(d, block_size)
        return -(-d // size), size

    def blocks(x, shared):
        """x zero-padded into blocks, rotated (unless ``rotate`` is False)."""
        n, size = shape(x.shape[0])
        v = jnp.zeros((n * size,), jnp.float32).at[:x.shape[0]].set(x).reshape(n, size)
        if not rotate:
            return v
        return walsh_hadamard(v * rotation_signs(shared["key"], shared["leaf"], (n, size)))

    def encode(x, shared, key):
        _need_key(key, "rotation")
        z = blocks(x.astype(jnp.float32), shared)
        lo, hi = jnp.min(z, axis=1), jnp.max(z, axis=1)
        span = hi - lo
        t = (z - lo[:, None]) * (top / jnp.where(span > 0, span, 1.0))[:, None]
        t = jnp.clip(t, 0.0, float(top))
        low = jnp.floor(t)
        u = jax.random.uniform(key, z.shape, jnp.float32)
        c = jnp.minimum(low + (u < t - low).astype(jnp.float32), float(top))
        return {"lo": lo, "hi": hi, "codes": pack_bits(c.astype(jnp.uint32).reshape(-1), b)}

    def decode(code, shared, d):
        del shared
        n, size = shape(d)
        c = unpack_bits(code["codes"], b, n * size).astype(jnp.float32).reshape(n, size)
        step = (code["hi"] - code["lo"]) / top
        return (code["lo"][:, None] + c * step[:, None]).reshape(-1)

    def unfold(y, shared, d):
        if not rotate:
            return y[:d]
        n, size = shape(d)
        signs = rotation_signs(shared["key"], shared["leaf"], (n, size))
        return (walsh_hadamard(y.reshape(n, size)) * signs).reshape(-1)[:d]

    def init():
        return jax.random.key_data(jax.random.key(seed)) if rotate else ()

    name = f"rotation(b={b})" if rotate else f"stochastic_levels(b={b})"
    return Compressor(name, encode, decode, unfold, init, True, True)


def top_k(fraction: float) -> Compressor:
    """Top-k sparsification per leaf, k = max(1, ⌈fraction·d⌉), ``fraction`` in (0, 1]."""
    fraction = _number("top_k fraction", fraction)
    if not 0 < fraction <= 1:
        raise ValueError(f"top_k fraction must be in (0, 1], got {fraction!r}.")

    def k_of(d):
        return max(1, min(d, math.ceil(fraction * d)))

    def encode(x, shared, key):
        del shared, key
        _, idx = jax.lax.top_k(jnp.abs(x), k_of(x.shape[0]))
        return {"values": x[idx].astype(jnp.float32), "indices": idx.astype(jnp.int32)}

    def decode(code, shared, d):
        del shared
        return jnp.zeros((d,), jnp.float32).at[code["indices"]].set(code["values"])

    return Compressor(f"top_k({fraction:g})", encode, decode, _crop, _no_shared, False, False)


def cast(dtype: Literal["float16", "bfloat16", "int8"], bucket_size: int = 512) -> Compressor:
    """The update cast to 16 bits (``float16``, ``bfloat16``) or to ``int8`` on a
    per-bucket scale max|v|/127 with rounding to nearest (``bucket_size``: int8 only)."""
    if dtype in ("float16", "bfloat16"):
        narrow = jnp.dtype(dtype)

        def encode(x, shared, key):
            del shared, key
            return {"values": x.astype(narrow)}

        def decode(code, shared, d):
            del shared, d
            return code["values"].astype(jnp.float32)

        return Compressor(dtype, encode, decode, _crop, _no_shared, False, False)
    if dtype != "int8":
        raise ValueError(f"cast dtype must be 'float16', 'bfloat16' or 'int8', got {dtype!r}.")
    bucket_size = _int_arg("cast bucket_size", bucket_size, 1)

    def encode8(x, shared, key):
        del shared, key
        v = _buckets(x.astype(jnp.float32), bucket_size)
        scale = jnp.max(jnp.abs(v), axis=1) / 127.0
        q = jnp.round(v / jnp.where(scale > 0, scale, 1.0)[:, None])
        return {"scale": scale, "values": jnp.clip(q, -127, 127).astype(jnp.int8)}

    def decode8(code, shared, d):
        del shared, d
        return (code["values"].astype(jnp.float32) * code["scale"][:, None]).reshape(-1)

    return Compressor("int8", encode8, decode8, _crop, _no_shared, False, False)


Scheme = Literal["none", "qsgd", "rotation", "top_k", "float16", "bfloat16", "int8"]
SCHEMES: tuple[str, ...] = ("none", "qsgd", "rotation", "top_k", "float16", "bfloat16", "int8")
_CASTS: tuple[Literal["float16", "bfloat16", "int8"], ...] = ("float16", "bfloat16", "int8")


def make_compressor(scheme: str, *, levels: int | None = None, bits: int | None = None,
                    fraction: float | None = None, bucket_size: int = 512,
                    block_size: int = 4096, seed: int = 0) -> Compressor | None:
    """The compressor a config names (None for ``"none"``): ``qsgd`` takes ``levels``,
    ``rotation`` ``bits``, ``top_k`` ``fraction``."""
    if scheme == "none":
        return None
    if scheme == "qsgd":
        return qsgd(levels if levels is not None else 1, bucket_size)
    if scheme == "rotation":
        return rotation(bits if bits is not None else 1, block_size, seed)
    if scheme == "top_k":
        return top_k(fraction if fraction is not None else 0.01)
    if scheme in _CASTS:
        return cast(scheme, bucket_size)
    raise ValueError(f"unknown compression scheme {scheme!r}; allowed: {', '.join(SCHEMES)}.")
