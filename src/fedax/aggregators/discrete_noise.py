"""Integer noise for distributed DP, exact and in float64: Poisson (a CDF table below
λ = 10, Hörmann's transformed rejection above), Skellam as the difference of two Poissons,
and the discrete Gaussian (Canonne, Kamath, Steinke 2020, Algorithm 3). ``jax.random.
poisson`` computes in float32 whatever the mode, which at λ = 10⁸ puts every sample on a
multiple of 8 (a lattice that reveals the sum's low bits), so fedax samples its own."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

SAMPLER_ITERS = 64  # rejection rounds; an element still unaccepted after them (< 10⁻²⁰) is 0

# --------------------------------------------------------------- samplers (float64)


def _uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """U[0, 1) in float64 with 53 random bits, built from two uint32 words (64-bit random
    bits would be lowered outside the x64 context, as 32-bit ones). Call under x64."""
    words = jax.random.bits(key, (2, *shape), jnp.uint32)
    high = jnp.right_shift(words[0], jnp.uint32(5)).astype(jnp.float64)  # 27 bits
    low = jnp.right_shift(words[1], jnp.uint32(6)).astype(jnp.float64)  # 26 bits
    return (high * 2.0 ** 26 + low) * 2.0 ** -53


def _rejection(propose, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Exact rejection sampling of ``shape`` values: ``propose(key, n) -> (values [n],
    accepted [n])`` draws n independent proposals. The first pass proposes for every
    element; each later pass proposes only for a fixed-size batch of the elements still
    without an accepted value (gathered with ``nonzero``), so the stragglers of a large
    array cost a fraction of a pass each instead of a whole one. Each element keeps its
    first accepted proposal from independent draws: the distribution is the sampler's.
    Elements still unaccepted after ``SAMPLER_ITERS`` passes (probability < 10⁻²⁰) are 0."""
    n = math.prod(shape)
    value, done = propose(jax.random.fold_in(key, 0), n)
    value = jnp.where(done, value, 0.0)
    cap = min(n, max(1024, n // 4))

    def body(carry):
        i, value, done = carry
        (idx,) = jnp.nonzero(~done, size=cap, fill_value=n)
        v, ok = propose(jax.random.fold_in(key, i), cap)
        take = ok & (idx < n)
        value = value.at[jnp.where(take, idx, n)].set(v, mode="drop")
        done = done.at[jnp.where(take, idx, n)].set(True, mode="drop")
        return i + 1, value, done

    def more(carry):
        i, _, done = carry
        return (i < SAMPLER_ITERS) & ~jnp.all(done)

    _, value, _ = jax.lax.while_loop(more, body, (jnp.int64(1), value, done))
    return value.reshape(shape)


def _log_poisson_pmf(k: jax.Array, lam: float) -> jax.Array:
    """log P(Poisson(λ) = k), float64, for k ≥ 0: Loader's saddle-point form for k ≥ 15
    (−½log(2πk) − stirlerr(k) − bd0(k, λ), accurate where k·log λ − lgamma(k+1) cancels),
    the direct form below."""
    kk = jnp.maximum(k, 1.0)
    t = (lam - kk) / kk
    bd0 = kk * (t - jnp.log1p(t))  # k·log(k/λ) + λ − k, ≥ 0
    stirlerr = 1 / (12 * kk) - 1 / (360 * kk ** 3) + 1 / (1260 * kk ** 5)
    large = -0.5 * jnp.log(2 * math.pi * kk) - stirlerr - bd0
    small = jnp.maximum(k, 0.0) * math.log(lam) - lam - jax.lax.lgamma(jnp.maximum(k, 0.0) + 1)
    return jnp.where(k >= 15, large, small)


def _poisson(key: jax.Array, lam: float, shape: tuple[int, ...]) -> jax.Array:
    """Poisson(λ) int64 samples (λ a Python float): inversion of the float64 CDF table for
    λ < 10, Hörmann's transformed rejection (PTRS, 1993) above. Call under x64."""
    if lam <= 0:
        return jnp.zeros(shape, jnp.int64)
    if lam < 10:
        ks = np.arange(int(lam + 40 * math.sqrt(lam) + 40))
        log_pmf = ks * math.log(lam) - lam - np.array([math.lgamma(k + 1) for k in ks])
        cdf = jnp.asarray(np.cumsum(np.exp(log_pmf)), jnp.float64)
        u = _uniform(key, shape)
        return jnp.searchsorted(cdf, u, side="right").astype(jnp.int64)
    b = 0.931 + 2.53 * math.sqrt(lam)
    a = -0.059 + 0.02483 * b
    log_inv_alpha = math.log(1.1239 + 1.1328 / (b - 3.4))
    v_r = 0.9277 - 3.6224 / (b - 2)

    def propose(key, n):
        ku, kv = jax.random.split(key)
        u = _uniform(ku, (n,)) - 0.5
        v = _uniform(kv, (n,))
        us = 0.5 - jnp.abs(u)
        k = jnp.floor((2 * a / us + b) * u + lam + 0.43)
        quick = (us >= 0.07) & (v <= v_r)
        reject = (k < 0) | ((us < 0.013) & (v > us))
        slow = jnp.log(v) + log_inv_alpha - jnp.log(a / (us * us) + b) <= _log_poisson_pmf(k, lam)
        return k, quick | (~reject & slow)

    return _rejection(propose, key, shape).astype(jnp.int64)


def _skellam(key: jax.Array, variance: float, shape: tuple[int, ...]) -> jax.Array:
    """Sk(μ/2, μ/2) = Poisson(μ/2) − Poisson(μ/2), variance μ, int64. Call under x64."""
    k1, k2 = jax.random.split(key)
    return _poisson(k1, variance / 2, shape) - _poisson(k2, variance / 2, shape)


def _discrete_gaussian(key: jax.Array, variance: float, shape: tuple[int, ...]) -> jax.Array:
    """N_ℤ(0, σ²), σ² = ``variance``, int64, by Canonne–Kamath–Steinke's Algorithm 3: a
    discrete Laplace of scale t = ⌊σ⌋ + 1 (a difference of two geometrics ⌊−t·ln U⌋),
    accepted with probability exp(−(|Y| − σ²/t)²/(2σ²)). Call under x64."""
    if variance <= 0:
        return jnp.zeros(shape, jnp.int64)
    t = math.floor(math.sqrt(variance)) + 1

    def propose(key, n):
        k1, k2, k3 = jax.random.split(key, 3)
        g1 = jnp.floor(-t * jnp.log1p(-_uniform(k1, (n,))))
        g2 = jnp.floor(-t * jnp.log1p(-_uniform(k2, (n,))))
        y = g1 - g2
        keep = _uniform(k3, (n,)) < jnp.exp(
            -jnp.square(jnp.abs(y) - variance / t) / (2 * variance))
        return y, keep

    return _rejection(propose, key, shape).astype(jnp.int64)


SAMPLERS = {"skellam": _skellam, "discrete_gaussian": _discrete_gaussian}
