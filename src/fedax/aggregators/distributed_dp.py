"""Distributed DP on secure aggregation: the clients add the noise, the server sees only the
noised modular sum (Kairouz, Liu, Steinke, ICML 2021; Agarwal, Kairouz, Liu, NeurIPS 2021;
TFF's ``DistributedDpSumFactory``).

``distributed_dp(C, z, n)`` is a complete aggregator. Each round, on every client k:

1. clip the update to L2 norm C (``fedax.federated.dp_clip``) with DP-FedAvg's uniform
   weights: a client with weight > 0 counts 1, a non-finite update becomes zeros;
2. flatten every leaf into one vector of d coordinates and zero-pad it to d' = 2^⌈log₂ d⌉;
3. rotate: x ↦ (1/√d')·H·D·x, H the Walsh–Hadamard matrix, D random signs drawn from a key in
   the aggregator's state, *shared* by all clients and advanced by the server every round
   (the rotation of ``fedax.aggregators.compressors``), so the sum can be un-rotated once;
4. scale by s and round to integers by conditional randomized rounding: ⌊y⌋ + Bernoulli of
   the fractional part, redrawn (up to ``rounding_tries`` times) until the rounded vector's
   L2 norm is within the bound of ``distributed_dp_params`` (β = ``beta``). If every
   try fails, the client sends y rounded toward zero (its norm is ≤ ‖y‖ ≤ s·C ≤ Δ₂; zeros if
   float error says otherwise) and counts in ``clipped_on_rounding``;
5. add integer noise and reduce mod 2^b, as one primitive, ``federated_dp_local_noise``
   (what the audit recognises, ``fedax.federated.audit_sums``): Skellam noise
   Poisson(μ/2) − Poisson(μ/2) or discrete Gaussian N_ℤ(0, μ) per coordinate with
   μ = (z·C·s)²/n, so that the n expected clients' shares sum to variance (z·C·s)², the
   central noise multiplier z in units of s. A client with weight 0 (padding, or rejected
   by the server) is not a participant: it sends exact zeros and adds no noise.

The reduction is ``fedax.federated.modular_sum`` (secure aggregation's operation; the
aggregator declares ``secure=SecureSum(bits=b)``); the server decodes the sum as a signed
b-bit integer, divides by s, un-rotates, un-pads and divides by the **fixed** denominator n
(``dp_gaussian``'s, with uniform weights: the realised cohort size is not used).

The parameters follow TFF's rules (``distributed_dp_params``, for a d-coordinate update):
k = Φ⁻¹(1 − p/2) standard deviations for the per-coordinate wrap probability
p = ``modclip_prob``; bits must satisfy 2^b ≥ n and 2^{2b} > n k², else ``distributed_dp``
raises a ValueError naming the smallest b that works; the scale solves TFF's
2^b = 2k·sqrt((nC)²/d' + n(γ²/4 + σ²))/γ, γ = 1/s, σ² = (zC)²/n, i.e.
s = sqrt(2^{2b} − n k²)/(2k·sqrt((nC)²/d' + z²C²)), at most 10⁶; each share has variance
(z·C·s)²/n; and the rounding bound is
Δ₂ = s·min(C + γ√d', sqrt(C² + γ²d'/4 + sqrt(2 ln(1/β))·γ·(C + γ√d'/2))) (Kairouz et al.,
§4.1; β = 0: the first, which always holds).

What the privacy rests on (``fedax.privacy.distributed.distributed_epsilon`` accounts it,
for neighbouring rounds that differ in one participant's vector, zeroed while that
participant still adds its share, as Kairouz et al. and TFF):

* **sensitivity**: every client's integer vector has L2 norm ≤ Δ₂ and, being integers,
  L1 norm ≤ min(√d'·Δ₂, Δ₂²). Enforced on the client (the rounding check and its
  fallback), whatever the rounding's luck; the check sums squares pairwise in float32
  (relative error < 2·10⁻⁶), covered by the 10⁻⁵ leeway of ``l2_sensitivity``.
* **the noise shares**: each participant draws its noise from its own key with exact-support
  integer samplers evaluated in float64 (``jax.enable_x64`` inside the primitive; JAX's own
  ``random.poisson`` works in float32 and, for large means, returns multiples of 8, which
  would reveal the low bits of the sum). Residual float64 error in the samplers' acceptance
  tests (≈ 10⁻¹² relative) is not modelled. Back ends without float64 (TPUs) cannot run it.
* **the number of shares**: the accountant assumes n shares. A round where m < n clients
  add noise (dropouts, rejections) has multiplier z·sqrt(m/n): reported every round as
  ``dp_effective_noise_multiplier`` and ``noised_clients``.
* **modular wrap** is post-processing: it cannot weaken privacy, only accuracy. s is chosen
  so that a coordinate of the sum (signal ≤ n·C/√d' per coordinate after the rotation,
  plus noise and rounding) leaves ±2^{b−1} with probability about p under a Gaussian
  approximation. Checked every round as ``modular_wrap_risk``, the same tail probability
  at the spread the decoded sum actually has: erfc(2^{b−1} / (√2·rms)), to compare with
  ``modclip_prob``. A cohort larger than n raises it.
* the shared rotation, s and b are public and data-independent.

Metrics (every round): ``dp_noise_stddev`` (z·C/n, per coordinate of the averaged update),
``dp_effective_noise_multiplier``, ``noised_clients``, ``clipped_clients`` (clipped to C),
``clipped_on_rounding`` and ``modular_wrap_risk``. The three counts travel in a second,
small modular sum beside the update (secure, not noised: diagnostics like
``dp_gaussian``'s ``clipped_clients``, not part of a DP release).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from fedax import federated as fed
from fedax.aggregators.base import Aggregator
from fedax.aggregators.compressors import rotation_signs, walsh_hadamard
from fedax.aggregators.discrete_noise import SAMPLERS
from fedax.aggregators.distributed_dp_params import (
    MECHANISMS,
    DistributedDpParams,
    _clients,
    check_bits,
    distributed_dp_params,
    inflated_l2_bound,
    modclip_stddevs,
    padded_dim,
)
from fedax.aggregators.dp import _non_negative, _positive
from fedax.federated._audit import LOCAL_NOISE_PRIMITIVE
from fedax.federated._secure import zero_tangent

Mechanism = Literal["skellam", "discrete_gaussian"]
MAX_SCALED = 2.0 ** 30  # client coordinates clipped here before rounding (int32 headroom)
COUNTS = ("noised_clients", "clipped_clients", "clipped_on_rounding")


# --------------------------------------------------------------- the marker primitive
#
# federated_dp_local_noise(r, key, participant): one client's integer vector r (int32 [d]),
# its noise key (raw key data) and whether it takes part (bool); out: (r + noise) mod 2^b
# as uint32, zeros for a non-participant. ``batch_ndim`` leading axes index clients (vmap
# adds one); each client draws from its own key.

local_noise_p = Primitive(LOCAL_NOISE_PRIMITIVE)


def _one_client(r, raw_key, participant, *, mechanism, local_variance, bits):
    with jax.enable_x64(True):
        key = jax.random.wrap_key_data(raw_key)
        noise = SAMPLERS[mechanism](key, local_variance, r.shape)
        q = (r.astype(jnp.int64) + noise) & ((1 << bits) - 1)
        return jnp.where(participant, q, 0).astype(jnp.uint32)


def _local_noise_impl(r, key, participant, *, mechanism, local_variance, noise_multiplier,
                      bits, batch_ndim):
    del noise_multiplier  # the audit's record of what the shares sum to
    one = functools.partial(_one_client, mechanism=mechanism,
                            local_variance=local_variance, bits=bits)
    if batch_ndim == 0:
        return one(r, key, participant)
    batch = r.shape[:batch_ndim]
    out = jax.vmap(one)(r.reshape((-1,) + r.shape[batch_ndim:]),
                        key.reshape((-1,) + key.shape[batch_ndim:]), participant.reshape(-1))
    return out.reshape(batch + out.shape[1:])


def _local_noise_abstract_eval(r, key, participant, *, batch_ndim, **params):
    del params
    batch = r.shape[:batch_ndim]
    if r.ndim != batch_ndim + 1 or key.shape[:batch_ndim] != batch or \
            participant.shape != batch:
        raise ValueError(f"{LOCAL_NOISE_PRIMITIVE}: one flat integer vector, key and "
                         f"participation bit per client; got {r.shape}, {key.shape}, "
                         f"{participant.shape} with {batch_ndim} client axes.")
    if r.dtype != jnp.int32 or key.dtype != jnp.uint32 or participant.dtype != jnp.bool_:
        raise TypeError(f"{LOCAL_NOISE_PRIMITIVE} takes int32 values, uint32 raw key data and "
                        f"a bool; got {r.dtype}, {key.dtype}, {participant.dtype}.")
    return r.update(dtype=jnp.dtype(jnp.uint32), weak_type=False)


def _local_noise_batch(args, dims, *, batch_ndim, **params):
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    front = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims, strict=True)]
    return local_noise_p.bind(*front, batch_ndim=batch_ndim + 1, **params), 0


def _local_noise_jvp(primals, tangents, **params):
    del tangents  # integers: nothing to differentiate
    out = local_noise_p.bind(*primals, **params)
    return out, zero_tangent(out)


local_noise_p.def_impl(_local_noise_impl)
local_noise_p.def_abstract_eval(_local_noise_abstract_eval)
mlir.register_lowering(local_noise_p, mlir.lower_fun(_local_noise_impl, multiple_results=False))
batching.primitive_batchers[local_noise_p] = _local_noise_batch
ad.primitive_jvps[local_noise_p] = _local_noise_jvp


def local_noise(r: jax.Array, raw_key: jax.Array, participant: jax.Array, *,
                mechanism: str, local_variance: float, noise_multiplier: float,
                bits: int) -> jax.Array:
    """One client's message (r + noise) mod 2^b (uint32; zeros if not ``participant``),
    through the ``federated_dp_local_noise`` primitive. ``noise_multiplier`` is the z that
    the n shares of variance ``local_variance`` add up to (recorded for the audit)."""
    return local_noise_p.bind(
        jnp.asarray(r, jnp.int32), jnp.asarray(raw_key, jnp.uint32),
        jnp.asarray(participant, jnp.bool_), mechanism=mechanism,
        local_variance=float(local_variance), noise_multiplier=float(noise_multiplier),
        bits=int(bits), batch_ndim=0)


# --------------------------------------------------------------- rounding


def _squared_norm(v: jax.Array) -> jax.Array:
    """Σ v_i² of a float32 vector of power-of-2 length, summed pairwise (relative error at
    most ⌈log₂ d⌉ + 1 units of 2⁻²⁴; the accountant's leeway covers it)."""
    sq = jnp.square(v)
    while sq.shape[0] > 1:
        half = sq.shape[0] // 2
        sq = sq[:half] + sq[half:]
    return sq[0]


def conditional_round(y: jax.Array, key: jax.Array, bound: float,
                      tries: int) -> tuple[jax.Array, jax.Array]:
    """``y`` (float32, power-of-2 length) randomly rounded, ⌊y⌋ + Bernoulli(y − ⌊y⌋), redrawn
    until its L2 norm is ≤ ``bound`` (at most ``tries`` draws); if none is, y rounded toward
    zero (zeros if even that exceeds ``bound``). Returns (int32 vector, fell back)."""
    floor = jnp.floor(y)
    frac = y - floor
    limit = jnp.float32(bound) ** 2

    def attempt(i):
        u = jax.random.uniform(jax.random.fold_in(key, i), y.shape, jnp.float32)
        r = floor + (u < frac).astype(jnp.float32)
        return r, _squared_norm(r) <= limit

    def body(carry):
        i, _, _ = carry
        return (i + 1, *attempt(i))

    def more(carry):
        i, _, ok = carry
        return ~ok & (i < tries)

    _, r, ok = jax.lax.while_loop(more, body, (jnp.int32(1), *attempt(0)))
    toward_zero = jnp.trunc(y)
    fallback = jnp.where(_squared_norm(toward_zero) <= limit, toward_zero, 0.0)
    return jnp.where(ok, r, fallback).astype(jnp.int32), ~ok


# --------------------------------------------------------------- state


@functools.partial(jax.tree_util.register_dataclass, data_fields=["rotation_key"],
                   meta_fields=["template"])
@dataclasses.dataclass(frozen=True)
class DistributedDpState:
    """``distributed_dp``'s state.

    Attributes:
      rotation_key: raw key data of the shared rotation's signs D (the server broadcasts it
        and advances it every round).
      template: static: the update's treedef and each leaf's (shape, dtype), so the server
        can unflatten the decoded sum.
    """

    rotation_key: jax.Array
    template: Any


def _template(tree: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(jnp.shape(a)), jnp.result_type(a).name) for a in leaves)


# --------------------------------------------------------------- the aggregator


def distributed_dp(
    clip: float,
    noise_multiplier: float,
    expected_clients: int,
    *,
    bits: int = 20,
    mechanism: Mechanism = "skellam",
    rotation: Literal["hadamard"] = "hadamard",
    beta: float = math.exp(-0.5),
    modclip_prob: float = 1e-4,
    rounding_tries: int = 20,
    seed: int = 0,
) -> Aggregator:
    """Distributed DP with secure aggregation (see the module docstring).

    Args:
      clip: C > 0, the L2 bound of one client's update.
      noise_multiplier: z ≥ 0, the noise multiplier of the n summed shares relative to C
        (z = 0: no noise, not private; the audit then reports a plain secure sum).
      expected_clients: n ≥ 1, the number of shares the noise is split into and the fixed
        denominator of the average.
      bits: b in [1, 22], the modulus 2^b of the secure sum (2^b ≥ n, 2^{2b} > n k²).
      mechanism: ``"skellam"`` (Agarwal et al.; TFF's default) or ``"discrete_gaussian"``
        (Kairouz et al.).
      rotation: ``"hadamard"``, the randomized Walsh–Hadamard transform (the only one).
      beta: β in [0, 1) of conditional randomized rounding (0: unconditional rounding,
        a looser sensitivity); exp(−1/2) as Kairouz et al. recommend.
      modclip_prob: p in (0, 1), the per-coordinate modular-wrap probability s aims for.
      rounding_tries: the most rounding draws before a client falls back to rounding
        toward zero.
      seed: seeds the shared rotation of the first round.

    Returns:
      a complete ``Aggregator`` with ``secure=SecureSum(bits=b)``, state
      ``DistributedDpState``, and the metrics of the module docstring. Its parameters for
      an update of d coordinates are ``distributed_dp_params(
      clip, noise_multiplier, expected_clients, d, bits=..., mechanism=..., beta=...,
      modclip_prob=...)``, and ``fedax.privacy.distributed.distributed_epsilon`` of them is
      its ε.
    """
    clip = _positive("distributed_dp clip", clip)
    z = _non_negative("distributed_dp noise_multiplier", noise_multiplier)
    if rotation != "hadamard":
        raise ValueError(f"distributed_dp rotation must be 'hadamard', got {rotation!r}.")
    if mechanism not in MECHANISMS:
        raise ValueError(f"distributed_dp mechanism must be one of {MECHANISMS}, got "
                         f"{mechanism!r}.")
    if isinstance(rounding_tries, bool) or not isinstance(rounding_tries, int) \
            or rounding_tries < 1:
        raise ValueError(f"distributed_dp rounding_tries must be a whole number >= 1, got "
                         f"{rounding_tries!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"distributed_dp seed must be a whole number >= 0, got {seed!r}.")
    options = dict(bits=bits, mechanism=mechanism, beta=beta, modclip_prob=modclip_prob)
    distributed_dp_params(clip, z, expected_clients, 1, **options)  # validates b, n, β, p
    n = _clients(expected_clients)
    spec = fed.SecureSum(bits=bits)

    def params_for(dim: int):
        out = distributed_dp_params(clip, z, n, dim, **options)
        if out.scale <= 1:
            warnings.warn(f"distributed_dp scale {out.scale:.3g} <= 1: rounding to integers "
                          f"will dominate the error; raise bits (now {bits}) or lower "
                          f"expected_clients (now {n}).", RuntimeWarning, stacklevel=3)
        return out

    def init(template):
        leaves = jax.tree.leaves(template)
        dim = sum(math.prod(jnp.shape(a)) for a in leaves)
        if not leaves or dim == 0:
            raise ValueError("distributed_dp needs an update with at least one coordinate.")
        params_for(dim)
        return DistributedDpState(jax.random.key_data(jax.random.key(seed)),
                                  _template(template))

    def signs(state, d_pad):
        return rotation_signs(state.rotation_key, 0, (1, d_pad))[0]

    def client(value, weight, state, key):
        if key is None:
            raise ValueError("distributed_dp rounds and noises on the client and needs a key: "
                             "run the aggregator with a round key, not None.")
        leaves = jax.tree.leaves(value)
        dim = sum(a.size for a in leaves)
        p = params_for(dim)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(a.astype(jnp.float32))) for a in leaves))
        participant = weight > 0
        unit = jnp.where(participant, 1, 0).astype(weight.dtype)
        clipped = fed.dp_clip(value, clip, client_placed=False, weights=unit)
        x = jnp.concatenate([a.astype(jnp.float32).ravel() for a in jax.tree.leaves(clipped)])
        x = jnp.pad(x, (0, p.padded_dim - dim))
        y = walsh_hadamard((x * signs(state, p.padded_dim))[None])[0] * jnp.float32(p.scale)
        round_key, noise_key = jax.random.split(key)
        r, fell_back = conditional_round(jnp.clip(y, -MAX_SCALED, MAX_SCALED), round_key,
                                         p.rounding_bound, rounding_tries)
        q = local_noise(r, jax.random.key_data(noise_key), participant,
                        mechanism=mechanism, local_variance=p.local_variance,
                        noise_multiplier=z, bits=bits)
        counts = jnp.stack([participant, participant & jnp.isfinite(norm) & (norm > clip),
                            participant & fell_back]).astype(jnp.uint32)
        return {"noised": q, "counts": counts}, unit, {}

    def reduce(values, weights, state, key):
        del weights, state, key  # zero-weight clients sent zeros
        return fed.modular_sum(values, bits), {}

    def server(value, stats, state, key):
        del stats, key
        treedef, shapes = state.template
        dim = sum(math.prod(shape) for shape, _ in shapes)
        p = params_for(dim)
        total = fed.secure.decode(value["noised"], step=1.0, bits=bits, dtype=jnp.float32)
        y = total / jnp.float32(p.scale)
        x = (walsh_hadamard(y[None])[0] * signs(state, p.padded_dim))[:dim] / jnp.float32(n)
        out, start = [], 0
        for shape, dtype in shapes:
            size = math.prod(shape)
            out.append(x[start:start + size].reshape(shape).astype(dtype))
            start += size
        counts = value["counts"].astype(jnp.int32)
        rms = jnp.sqrt(jnp.mean(jnp.square(total)))
        half_range = jnp.float32(2.0 ** (bits - 1))
        metrics = {
            "dp_noise_stddev": jnp.asarray(z * clip / n, jnp.float32),
            "dp_effective_noise_multiplier":
                z * jnp.sqrt(counts[0].astype(jnp.float32) / n),
            **{name: counts[i] for i, name in enumerate(COUNTS)},
            "modular_wrap_risk": jax.lax.erfc(
                half_range / (jnp.sqrt(jnp.float32(2)) * jnp.maximum(rms, 1e-30))),
        }
        # The next round's rotation: a fresh shared key (the server broadcasts it).
        new_key = jax.random.key_data(
            jax.random.fold_in(jax.random.wrap_key_data(state.rotation_key), 1))
        return (jax.tree.unflatten(treedef, out),
                DistributedDpState(new_key, state.template), metrics)

    return Aggregator(init, client, reduce, server, secure=spec, private=z > 0)


__all__ = [
    "MECHANISMS",
    "DistributedDpParams",
    "DistributedDpState",
    "check_bits",
    "conditional_round",
    "distributed_dp",
    "distributed_dp_params",
    "inflated_l2_bound",
    "local_noise",
    "local_noise_p",
    "modclip_stddevs",
    "padded_dim",
]
