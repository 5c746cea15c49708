"""Secure summation as placement primitives: what secure aggregation lets the server learn.

Secure aggregation (Bonawitz et al., CCS 2017; SecAgg+, Bell et al., CCS 2020) reveals to
the server only Σ_k y_k mod 2^b of the clients' integer vectors y_k. Floats reach it the
way TFF's ``secure_sum_bitwidth`` and Flower's SecAgg+ take them: each client clips every
coordinate to [−c, c], scales by L/c (L quantization levels per side, step Δ = c/L) and
rounds stochastically, q = ⌊x/Δ + U⌋ with U ~ U[0, 1) from its own key (unbiased:
E[qΔ] = x), and sends q mod 2^b (two's complement). The server decodes the modular sum as a
signed b-bit integer and multiplies by Δ. The sum is exact (no wrap) when n·L ≤ 2^{b−1} − 1,
checked when the program is traced: ``SecureSum.levels_for(n)``. Per coordinate the result
is within n·Δ of Σ_k clip(x_k) (plus float32 rounding of the decoded integer).

Three primitives carry it, each with derivatives that are again secure placements (the
claim of Rush, Charles, Garrett, "Federated Automatic Differentiation", for private
primitives):

======================================  =======================  =========================
primitive                               forward mode (JVP)       reverse mode (transpose)
======================================  =======================  =========================
``secure_sum`` (clients → server)       ``secure_sum`` (tangent) ``broadcast``
``secure_broadcast`` (server → clients) ``secure_broadcast``     ``secure_sum``
``modular_sum`` (integers, mod 2^b)     none (integers)          none
======================================  =======================  =========================

``secure_sum`` is linear for differentiation (the derivative of quantization is taken as
the identity, its unbiased mean; values outside [−c, c] are clipped in the value, not in
the derivative), so a round that aggregates with it can be differentiated in both modes,
and every client → server transfer of the derivative program is again a secure sum when
the server's value reaches the clients by ``secure_broadcast``. ``modular_sum`` is the
protocol's own operation on integers that a client stage produced (distributed DP's noised
integers, ``fedax.aggregators.distributed_dp``). In simulation each primitive computes
exactly what the protocol computes (the same quantization from the same keys, the same
wrap-around); ``fedax.runtime.secagg`` runs the protocol over the network.

Keys: client i quantizes leaf j with ``fold_in(k_i, j)``, k_i = ``split(key, n)[i]``
(``client_key``), on its own machine as here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from fedax.federated._primitives import (
    _broadcast_abstract_eval,
    _constrain_clients,
    _num_clients,
    _sum_abstract_eval,
    _sum_transpose,
)

SECURE_SUM_PRIMITIVE = "federated_secure_sum"
SECURE_BROADCAST_PRIMITIVE = "federated_secure_broadcast"
MODULAR_SUM_PRIMITIVE = "federated_modular_sum"
MAX_AUTO_LEVELS = 2 ** 22  # float32 holds x/Δ exactly below 2^24 (Flower's default range)


@dataclasses.dataclass(frozen=True)
class SecureSum:
    """The declared range of a secure sum.

    Attributes:
      clip: c > 0, each coordinate clipped to [−c, c] before quantization; None: the
        inputs are already integers in [0, 2^b) (``modular_sum``).
      bits: b in [1, 32], the modulus 2^b of the sum.
      levels: L ≥ 1 quantization levels per side (step Δ = c/L); None: the most the
        cohort allows without wrap-around, at most 2^22.
    """

    clip: float | None = None
    bits: int = 32
    levels: int | None = None

    def __post_init__(self):
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) \
                or not 1 <= self.bits <= 32:
            raise ValueError(f"secure sum bits must be a whole number in [1, 32], got "
                             f"{self.bits!r}.")
        if self.clip is not None:
            clip = float(self.clip)
            if not (math.isfinite(clip) and clip > 0):
                raise ValueError(f"secure sum clip must be a finite number > 0, got "
                                 f"{self.clip!r}.")
        if self.levels is not None and (isinstance(self.levels, bool) or not isinstance(
                self.levels, int) or self.levels < 1):
            raise ValueError(f"secure sum levels must be a whole number >= 1, got "
                             f"{self.levels!r}.")
        if self.levels is not None and self.clip is None:
            raise ValueError("secure sum levels need a clip range (clip).")

    def levels_for(self, n: int) -> int:
        """L for a sum over ``n`` clients, checked: n·L ≤ 2^{b−1} − 1 (no wrap-around)."""
        room = 2 ** (self.bits - 1) - 1
        levels = self.levels if self.levels is not None else min(room // max(n, 1),
                                                                  MAX_AUTO_LEVELS)
        if levels < 1 or n * levels > room:
            raise ValueError(
                f"a secure sum of {n} clients with {self.bits} bits wraps around: "
                f"{n} x {levels or 1} quantization levels exceed 2^{self.bits - 1} - 1; "
                f"raise secure.bits (at least {_bits_needed(n, self.levels or 1)}) or "
                f"lower secure.levels.")
        return levels

    def _clip_range(self) -> float:
        """c: the clip range of a secure sum of reals (a ``modular_sum``'s spec has none)."""
        if self.clip is None:
            raise ValueError("a secure sum without a clip range (a modular sum of integers) "
                             "has no quantization step.")
        return float(self.clip)

    def step(self, n: int) -> float:
        """Δ = c/L for ``n`` clients."""
        return self._clip_range() / self.levels_for(n)


def _bits_needed(n: int, levels: int) -> int:
    return int(math.ceil(math.log2(n * levels + 1))) + 1


# ------------------------------------------------------------------ encode / decode


def encode(x: jax.Array, key: jax.Array, *, clip: float, levels: int, bits: int) -> jax.Array:
    """One client's value as b-bit integers: clip to [−c, c], ⌊x·L/c + U⌋ (U from
    ``key``), two's complement mod 2^b, as uint32."""
    x = jnp.asarray(x)
    acc = jnp.promote_types(x.dtype, jnp.float32)
    y = jnp.clip(x.astype(acc), -clip, clip) * jnp.asarray(levels / clip, acc)
    floor = jnp.floor(y)
    up = jax.random.uniform(key, x.shape, acc) < (y - floor)
    q = jnp.clip(floor + up.astype(acc), -levels, levels).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(q, jnp.uint32) & jnp.uint32(_mask(bits))


def decode(total: jax.Array, *, step: float, bits: int, dtype: Any) -> jax.Array:
    """A modular sum (uint32, < 2^b) read as a signed b-bit integer, times Δ."""
    signed = jax.lax.bitcast_convert_type(jnp.asarray(total, jnp.uint32), jnp.int32)
    shift = 32 - bits
    if shift:
        signed = jnp.right_shift(jnp.left_shift(signed, shift), shift)  # sign-extend b bits
    return (signed.astype(jnp.float32) * jnp.float32(step)).astype(dtype)


def _mask(bits: int) -> int:
    return (1 << bits) - 1


def _modular_sum_impl(q, *, bits):
    q = jnp.asarray(q, jnp.uint32)
    return jnp.sum(q, axis=0, dtype=jnp.uint32) & jnp.uint32(_mask(bits))  # wraps mod 2^32


def client_keys(key: jax.Array, n: int) -> jax.Array:
    """``[n, ...]`` raw key data: client i's quantization key k_i = ``split(key, n)[i]``."""
    return jax.random.key_data(jax.random.split(key, n))


def leaf_key(raw_client_key: jax.Array, leaf: int) -> jax.Array:
    """Client key k_i's key for leaf j, ``fold_in(k_i, j)`` (raw key data in, typed out)."""
    return jax.random.fold_in(jax.random.wrap_key_data(raw_client_key), leaf)


def encode_tree(tree: Any, raw_client_key: jax.Array, spec: SecureSum, n: int) -> Any:
    """What client i sends for a ``secure_sum`` over ``n`` clients: every leaf of its value
    encoded (``encode``) with its leaf key. The networked client calls this."""
    levels = spec.levels_for(n)
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [
        encode(leaf, leaf_key(raw_client_key, j), clip=spec._clip_range(), levels=levels,
               bits=spec.bits) for j, leaf in enumerate(leaves)])


def decode_tree(totals: Any, spec: SecureSum, n: int, like: Any) -> Any:
    """The server's value of a ``secure_sum`` from the protocol's modular sums."""
    step = spec.step(n)
    return jax.tree.map(lambda t, a: decode(t, step=step, bits=spec.bits,
                                            dtype=jnp.result_type(a)), totals, like)


# ------------------------------------------------------------------ the primitives

secure_sum_p = Primitive(SECURE_SUM_PRIMITIVE)
secure_broadcast_p = Primitive(SECURE_BROADCAST_PRIMITIVE)
modular_sum_p = Primitive(MODULAR_SUM_PRIMITIVE)


def _secure_sum_impl(x, keys, *, clip, levels, bits):
    x = jnp.asarray(x)
    q = jax.vmap(lambda v, k: encode(v, jax.random.wrap_key_data(k), clip=clip,
                                     levels=levels, bits=bits))(x, keys)
    return decode(_modular_sum_impl(q, bits=bits), step=clip / levels, bits=bits,
                  dtype=x.dtype)


def _secure_sum_abstract_eval(x, keys, **params):
    del params
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{SECURE_SUM_PRIMITIVE} quantizes float values; integers in "
                        "[0, 2^b) go through modular_sum.")
    if keys.ndim < 1 or keys.shape[0] != x.shape[0]:
        raise ValueError(f"{SECURE_SUM_PRIMITIVE} needs one key per client: {x.shape[0]} "
                         f"clients, keys of shape {keys.shape}.")
    return _sum_abstract_eval(x)


def _fold_keys(keys, salt: int):
    return jax.vmap(lambda k: jax.random.key_data(
        jax.random.fold_in(jax.random.wrap_key_data(k), salt)))(keys)


def zero_tangent(value: Any) -> ad.Zero:
    """The symbolic zero tangent of a JVP rule's output ``value`` (``ad.Zero.
    from_primal_value`` is gone from JAX 0.10)."""
    return ad.Zero(value.aval.to_tangent_aval())


def _secure_sum_jvp(primals, tangents, **params):
    (x, keys), (t, _) = primals, tangents
    out = secure_sum_p.bind(x, keys, **params)
    if type(t) is ad.Zero:
        return out, zero_tangent(out)
    # the tangent upload is quantized too, with keys of its own
    return out, secure_sum_p.bind(t, _fold_keys(keys, 1), **params)


def _secure_sum_transpose(ct, x, keys, **params):
    del params
    if type(ct) is ad.Zero:
        return [None, None]
    return [_sum_transpose(ct, x)[0], None]


def _secure_sum_batch(args, dims, **params):
    (x, keys), (dx, dk) = args, dims
    if dk is not None:
        raise NotImplementedError(f"{SECURE_SUM_PRIMITIVE} under vmap with batched keys; "
                                  "map over the values only.")
    return secure_sum_p.bind(jnp.moveaxis(x, dx, 1), keys, **params), 0


def _secure_broadcast_impl(x, keys, *, n, **params):
    del keys, params
    x = jnp.asarray(x)
    return jnp.broadcast_to(x[None], (n, *x.shape))


def _secure_broadcast_abstract_eval(x, keys, *, n, **params):
    del params
    if keys.ndim < 1 or keys.shape[0] != n:
        raise ValueError(f"{SECURE_BROADCAST_PRIMITIVE} needs one key per client: {n} "
                         f"clients, keys of shape {keys.shape}.")
    return _broadcast_abstract_eval(x, n=n)


def _secure_broadcast_jvp(primals, tangents, **params):
    (x, keys), (t, _) = primals, tangents
    out = secure_broadcast_p.bind(x, keys, **params)
    if type(t) is ad.Zero:
        return out, zero_tangent(out)
    return out, secure_broadcast_p.bind(t, keys, **params)


def _secure_broadcast_transpose(ct, x, keys, *, n, **params):
    del x, n
    if type(ct) is ad.Zero:
        return [None, None]
    return [secure_sum_p.bind(ad.instantiate_zeros(ct), keys, **params), None]


def _secure_broadcast_batch(args, dims, *, n, **params):
    (x, keys), (dx, dk) = args, dims
    if dk is not None:
        raise NotImplementedError(f"{SECURE_BROADCAST_PRIMITIVE} under vmap with batched "
                                  "keys; map over the values only.")
    return secure_broadcast_p.bind(jnp.moveaxis(x, dx, 0), keys, n=n, **params), 1


def _modular_sum_abstract_eval(q, *, bits):
    del bits
    if q.dtype != jnp.uint32:
        raise TypeError(f"{MODULAR_SUM_PRIMITIVE} sums uint32 values in [0, 2^b), got "
                        f"{q.dtype}.")
    return _sum_abstract_eval(q)


def _modular_sum_batch(args, dims, *, bits):
    (q,), (d,) = args, dims
    return modular_sum_p.bind(jnp.moveaxis(q, d, 1), bits=bits), 0


def _modular_sum_jvp(primals, tangents, *, bits):
    del tangents
    out = modular_sum_p.bind(*primals, bits=bits)
    return out, zero_tangent(out)


secure_sum_p.def_impl(_secure_sum_impl)
secure_sum_p.def_abstract_eval(_secure_sum_abstract_eval)
mlir.register_lowering(secure_sum_p, mlir.lower_fun(_secure_sum_impl, multiple_results=False))
ad.primitive_jvps[secure_sum_p] = _secure_sum_jvp
ad.primitive_transposes[secure_sum_p] = _secure_sum_transpose
batching.primitive_batchers[secure_sum_p] = _secure_sum_batch

secure_broadcast_p.def_impl(_secure_broadcast_impl)
secure_broadcast_p.def_abstract_eval(_secure_broadcast_abstract_eval)
mlir.register_lowering(secure_broadcast_p,
                       mlir.lower_fun(_secure_broadcast_impl, multiple_results=False))
ad.primitive_jvps[secure_broadcast_p] = _secure_broadcast_jvp
ad.primitive_transposes[secure_broadcast_p] = _secure_broadcast_transpose
batching.primitive_batchers[secure_broadcast_p] = _secure_broadcast_batch

modular_sum_p.def_impl(_modular_sum_impl)
modular_sum_p.def_abstract_eval(_modular_sum_abstract_eval)
mlir.register_lowering(modular_sum_p, mlir.lower_fun(_modular_sum_impl,
                                                     multiple_results=False))
ad.primitive_jvps[modular_sum_p] = _modular_sum_jvp
batching.primitive_batchers[modular_sum_p] = _modular_sum_batch


# ------------------------------------------------------------------ the public API


def _float_spec(spec: SecureSum, what: str) -> float:
    if not isinstance(spec, SecureSum) or spec.clip is None:
        raise ValueError(f"{what} needs a SecureSum with a clip range (clip=c): floats are "
                         "clipped to [-c, c] and quantized; integers go through "
                         "modular_sum.")
    return float(spec.clip)


def _keys_per_leaf(key: jax.Array, n: int, leaves: int) -> list[jax.Array]:
    keys = client_keys(key, n)  # client-placed: laid out as the values are, on a mesh
    return [_constrain_clients(_fold_keys(keys, j)) for j in range(leaves)]


def secure_sum(x: Any, spec: SecureSum, key: jax.Array) -> Any:
    """Clients → server through secure aggregation: Σ_k dequantize(quantize(clip(x_k))).

    ``x`` is client-placed and float; client i quantizes leaf j with ``fold_in(k_i, j)``,
    k_i = ``split(key, n)[i]`` (module docstring). Raises when the cohort's sum could wrap
    (``SecureSum.levels_for``). Reverse-mode derivative: ``broadcast``; forward mode:
    ``secure_sum`` of the tangent."""
    clip = _float_spec(spec, "secure_sum")
    if key is None:
        raise ValueError("secure_sum needs a key (each client's stochastic rounding).")
    n = _num_clients(x)
    levels = spec.levels_for(n)
    leaves, treedef = jax.tree.flatten(x)
    out = [secure_sum_p.bind(jnp.asarray(leaf), k, clip=clip, levels=levels, bits=spec.bits)
           for leaf, k in zip(leaves, _keys_per_leaf(key, n, len(leaves)), strict=True)]
    return jax.tree.unflatten(treedef, out)


def secure_broadcast(x: Any, n: int, spec: SecureSum, key: jax.Array) -> Any:
    """``broadcast(x, n)`` whose reverse-mode derivative is a ``secure_sum`` of the
    clients' cotangents (range ``spec``, keys from ``key`` as in ``secure_sum``): what flows
    back up to the server in a reverse pass goes through secure aggregation."""
    clip = _float_spec(spec, "secure_broadcast")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"secure_broadcast needs a positive int number of clients, got {n!r}.")
    if key is None:
        raise ValueError("secure_broadcast needs a key (the transposed secure sum's rounding).")
    levels = spec.levels_for(n)
    leaves, treedef = jax.tree.flatten(x)
    if not all(jnp.issubdtype(jnp.result_type(a), jnp.floating) for a in leaves):
        raise TypeError("secure_broadcast places float values only; broadcast integers with "
                        "fedax.federated.broadcast.")
    out = [secure_broadcast_p.bind(jnp.asarray(leaf), k, n=n, clip=clip, levels=levels,
                                   bits=spec.bits)
           for leaf, k in zip(leaves, _keys_per_leaf(key, n, len(leaves)), strict=True)]
    return _constrain_clients(jax.tree.unflatten(treedef, out))


def modular_sum(q: Any, bits: int) -> Any:
    """Clients → server through secure aggregation, integers: Σ_k q_k mod 2^b of uint32
    values in [0, 2^b) (what SecAgg reveals; a client stage made the integers)."""
    SecureSum(bits=bits)  # validates bits
    _num_clients(q)

    def one(leaf):
        leaf = jnp.asarray(leaf)
        if leaf.dtype != jnp.uint32:
            raise TypeError(f"modular_sum sums uint32 values in [0, 2^{bits}), got "
                            f"{leaf.dtype}; quantize floats with secure_sum.")
        return modular_sum_p.bind(leaf, bits=bits)

    return jax.tree.map(one, q)


def modular_sum_np(q: np.ndarray, bits: int) -> np.ndarray:
    """NumPy reference of ``modular_sum`` over axis 0 (for checks and the runtime)."""
    return (np.asarray(q, np.uint64).sum(axis=0) % (1 << bits)).astype(np.uint32)


__all__ = [
    "MODULAR_SUM_PRIMITIVE",
    "SECURE_BROADCAST_PRIMITIVE",
    "SECURE_SUM_PRIMITIVE",
    "SecureSum",
    "client_keys",
    "decode",
    "decode_tree",
    "encode",
    "encode_tree",
    "leaf_key",
    "modular_sum",
    "modular_sum_np",
    "secure_broadcast",
    "secure_sum",
]
