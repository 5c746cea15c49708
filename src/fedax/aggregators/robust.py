"""Robust reductions: coordinate-wise median and trimmed mean (Yin et al. 2018), Krum and
Multi-Krum (Blanchard et al. 2017), the geometric median (RFA, Pillutla et al. 2022) and norm
bounding (Sun et al. 2019). Sources: docs/references.md, robust aggregation and attacks.

Every reduction here receives the clients' values apart, through ``fed.collect`` (clients ->
server, each client's value kept; the same bytes up as a sum), so ``comm_cost`` stays true
and derivatives stay federated. Each is a complete aggregator, usable alone
(``aggregator=median()``) or after client stages (``chain(clip_norm(S), median())``).

**Who counts.** Only the *real* clients count: weight w_k > 0. Padding clients (n_k = 0) and
clients the server rejected (weight 0, zero values) are never a client of a robust rule:
the median is over the r real clients only, the trim count is ⌊β·r⌋, Krum's n is r. With
static shapes this is done with sentinels (+∞ sorts last and is never read) and masks, so a
round compiles once whatever r is. With r = 0 every rule returns zeros ("no update"), as
``fed.weighted_mean`` does.

**Weights.** Yin et al.'s median and trimmed mean and Krum's selection are unweighted
(Flower's ``aggregate_median``/``aggregate_trimmed_avg``/``aggregate_krum`` ignore
``num_examples`` too): a weight only says whether a client counts. Multi-Krum averages the
m selected vectors *weighted* by w_k (Flower weights by ``num_examples``); Krum (m = 1) is
the selected vector itself. RFA is weighted by definition (α_k = w_k / Σ w). Pass unit
weights (``dp_gaussian``'s ``weighting="uniform"`` does) for the unweighted form.

**Differential privacy.** DP noise calibrated to a clip S assumes a *sum* whose value moves
by at most S when one client changes. A median, trimmed mean, Krum or geometric median of
clipped updates has no such bound (one client can move a median by more than S/m in L2,
and Krum's choice flips from one vector to another), so noising it at z·S is not the
Gaussian mechanism the accountant composes. The order that keeps the bound: clip at the
client, a sum reduction, noise after: ``dp_gaussian`` (norm bounding is its clip).
``private_robust`` builds the valid composition and refuses the others, and the config
layer calls ``check_private_reduction``.

**Diagnostics** (round metrics; names unique across rules, as a round merges them):
Multi-Krum/Krum report ``krum_discarded`` (the real clients not selected, r − min(m, r)),
the trimmed mean ``trimmed_per_end`` (b = ⌊β·r⌋, cut at each end of every coordinate), norm
bounding ``clipped_clients`` (its clip's); the median and the geometric median report
nothing (every real client counts, by rank or by weight). Under ``flagging(flags)`` (a
simulated attack marks its attackers: ``fedax.attacks.attacked``), Krum also reports
``attackers_selected``, the flagged clients among those it selected.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from fedax import federated as fed
from fedax.aggregators.base import Aggregator, chain, no_state
from fedax.aggregators.clipping import clip_norm
from fedax.aggregators.dp import _add_noise, _non_negative, _positive, dp_gaussian
from fedax.aggregators.mean import mean

_HIGHEST = jax.lax.Precision.HIGHEST


# ----------------------------------------------------------------------------- helpers


def _on_server(values: Any, weights: jax.Array) -> tuple[Any, jax.Array, jax.Array, jax.Array]:
    """The clients' values and weights at the server, apart (``fed.collect``), the ``[C]``
    mask of real clients (w > 0) and their count r (int32)."""
    stacked, w = fed.collect((values, weights))
    real = w > 0
    return stacked, w, real, jnp.sum(real.astype(jnp.int32))


def _rows(mask: jax.Array, leaf: jax.Array) -> jax.Array:
    """``[C]`` ``mask`` shaped to broadcast against the ``[C, ...]`` ``leaf``."""
    return mask.reshape(mask.shape + (1,) * (leaf.ndim - 1))


def _sorted_real(leaf: jax.Array, real: jax.Array) -> jax.Array:
    """``leaf [C, ...]`` sorted along the clients axis, non-real clients as +∞ (last)."""
    inf = jnp.asarray(jnp.inf, leaf.dtype)
    return jnp.sort(jnp.where(_rows(real, leaf), leaf, inf), axis=0)


def _select_mean(stacked: Any, coefficients: jax.Array) -> Any:
    """Σ_k c_k x_k / Σ_k c_k over the server-placed ``[C, ...]`` leaves (zeros when every
    c_k is 0); c_k = 0 rows are left out by selection, so an infinite or NaN value there
    cannot leak in."""
    total = jnp.sum(coefficients)
    safe = jnp.where(total > 0, total, 1)

    def one(leaf):
        c = coefficients.astype(leaf.dtype)
        picked = jnp.where(_rows(c > 0, leaf), leaf, jnp.zeros((), leaf.dtype))
        out = jnp.tensordot(c, picked, axes=(0, 0), precision=_HIGHEST) / safe.astype(leaf.dtype)
        return jnp.where(total > 0, out, jnp.zeros((), leaf.dtype))

    return jax.tree.map(one, stacked)


_FLAGS: contextvars.ContextVar[Any] = contextvars.ContextVar("fedax_robust_flags",
                                                             default=None)


@contextlib.contextmanager
def flagging(flags: jax.Array) -> Iterator[None]:
    """Mark clients for the robust reductions' diagnostics while one is traced inside.

    ``flags`` is a client-placed ``[C]`` bool array in the order of the values the
    reduction receives (e.g. which clients of the cohort are simulated attackers). A
    reduction that knows cheaply which clients it kept reports how many of them were
    flagged (Krum: ``attackers_selected``), collecting the flags with ``fed.collect`` (one
    more value up per client: a simulation's diagnostic, which no real client sends).
    Only the trace inside the ``with`` block sees them: wrap the ``reduce`` call itself.
    """
    token = _FLAGS.set(flags)
    try:
        yield
    finally:
        _FLAGS.reset(token)


def _flags_at_server() -> jax.Array | None:
    """The ``flagging`` flags collected at the server (``[C]`` bool), or None."""
    flags = _FLAGS.get()
    return None if flags is None else fed.collect(flags).astype(bool)


def _count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return value


# --------------------------------------------------------------------- median, trimmed mean


def median() -> Aggregator:
    """Coordinate-wise median over the real clients (Yin et al., ICML 2018):
    median_j = med_{k: w_k > 0} x_{k,j}; for an even count r the mean of the two middle
    values (NumPy's ``np.median``). Unweighted (a weight only marks a client as real)."""

    def reduce(values, weights, state, key):
        del state, key
        stacked, _, real, r = _on_server(values, weights)
        lo, hi = jnp.maximum((r - 1) // 2, 0), r // 2

        def one(leaf):
            s = _sorted_real(leaf, real)
            hi_ = jnp.minimum(hi, leaf.shape[0] - 1)
            mid = (s[lo] + s[hi_]) / jnp.asarray(2, leaf.dtype)
            return jnp.where(r > 0, mid, jnp.zeros((), leaf.dtype))

        return jax.tree.map(one, stacked), {}

    return Aggregator(no_state, reduce=reduce)


def trimmed_mean(beta: float) -> Aggregator:
    """Coordinate-wise β-trimmed mean over the real clients (Yin et al., ICML 2018):
    with r real clients and b = ⌊β·r⌋ (scipy's ``trim_mean``, Flower's
    ``FedTrimmedAvg(beta)``), drop the b largest and b smallest values of each coordinate
    and average the r − 2b left: TrMean_j = (1/(r−2b)) Σ_{i=b+1}^{r−b} x_{(i),j}.
    0 ≤ β < 1/2 (so r − 2b ≥ 1); unweighted. Tolerates fewer than b arbitrary clients per
    coordinate end (Yin et al. set β ≥ the Byzantine fraction). Metric ``trimmed_per_end``:
    b (int32), the values cut at each end of every coordinate."""
    beta = _non_negative("trimmed_mean beta", beta)
    if not beta < 0.5:
        raise ValueError(f"trimmed_mean beta must be in [0, 0.5), got {beta!r}.")

    def reduce(values, weights, state, key):
        del state, key
        stacked, _, real, r = _on_server(values, weights)
        num = weights.shape[0]
        # b = ⌊β·r⌋ in Python's float64 for every possible r (float32 β·r can round below
        # an integer), read at r.
        cuts = jnp.asarray([int(math.floor(beta * n)) for n in range(num + 1)], jnp.int32)
        b = cuts[r]
        keep_count = r - 2 * b

        def one(leaf):
            s = _sorted_real(leaf, real)
            i = jnp.arange(num)
            keep = _rows(jnp.logical_and(i >= b, i < r - b), s)
            total = jnp.sum(jnp.where(keep, s, jnp.zeros((), s.dtype)), axis=0)
            out = total / jnp.maximum(keep_count, 1).astype(s.dtype)
            return jnp.where(r > 0, out, jnp.zeros((), s.dtype))

        return jax.tree.map(one, stacked), {"trimmed_per_end": b}

    return Aggregator(no_state, reduce=reduce)


# ------------------------------------------------------------------------------ Krum


def _squared_distances(stacked: Any) -> jax.Array:
    """``[C, C]`` D_ij = ‖x_i − x_j‖² over the flattened pytree (Gram form, O(C²d))."""
    leaves = jax.tree.leaves(stacked)
    num = leaves[0].shape[0]
    mats = [leaf.reshape(num, -1).astype(jnp.float32) for leaf in leaves]
    sq = jnp.sum(mats[0] * mats[0], axis=1)
    gram = jnp.matmul(mats[0], mats[0].T, precision=_HIGHEST)
    for m in mats[1:]:
        sq = sq + jnp.sum(m * m, axis=1)
        gram = gram + jnp.matmul(m, m.T, precision=_HIGHEST)
    return jnp.maximum(sq[:, None] + sq[None, :] - 2 * gram, 0.0)


def krum_scores(stacked: Any, real: jax.Array, byzantine: int) -> jax.Array:
    """Krum's score of every client (Blanchard et al., NeurIPS 2017; Flower's convention):
    score(i) = Σ of the q smallest D_ij over the real j ≠ i, with q = max(1, r − f − 2)
    (at most r − 1), r the real clients; +∞ for a non-real client."""
    num = real.shape[0]
    r = jnp.sum(real.astype(jnp.int32))
    d = _squared_distances(stacked)
    pair = real[:, None] & real[None, :] & ~jnp.eye(num, dtype=bool)
    s = jnp.sort(jnp.where(pair, d, jnp.inf), axis=1)
    q = jnp.minimum(jnp.maximum(r - byzantine - 2, 1), jnp.maximum(r - 1, 0))
    near = jnp.arange(num)[None, :] < q
    score = jnp.sum(jnp.where(near, s, 0.0), axis=1)
    return jnp.where(real, score, jnp.inf)


def multi_krum(byzantine: int, keep: int = 1) -> Aggregator:
    """Multi-Krum(f, m) (Blanchard et al., NeurIPS 2017): the weighted mean (by w_k, as
    Flower's ``aggregate_krum``) of the m real clients with the lowest Krum score
    (``krum_scores``; ties to the lower client index, as ``np.argmin``); m = 1 is Krum, the
    selected vector itself. Fewer than m real clients: all of them. The paper asks for
    2f + 2 < n; with fewer real clients the neighbour count is clamped to [1, r − 1]
    (Flower's ``max(1, n − f − 2)``). Cost O(C²d) for the pairwise distances. Metrics
    (int32): ``krum_discarded``, the real clients not selected (r − min(m, r)); under
    ``flagging``, ``attackers_selected``, the flagged clients among the selected."""
    byzantine = _count("multi_krum byzantine (f)", byzantine, 0)
    keep = _count("multi_krum keep (m)", keep, 1)

    def reduce(values, weights, state, key):
        del state, key
        stacked, w, real, r = _on_server(values, weights)
        score = krum_scores(stacked, real, byzantine)
        order = jnp.argsort(score, stable=True)
        rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
        selected = jnp.logical_and(real, rank < keep)
        coefficients = jnp.where(selected, w, jnp.zeros((), w.dtype))
        chosen = jnp.sum(selected.astype(jnp.int32))
        metrics = {"krum_discarded": r - chosen}
        flags = _flags_at_server()
        if flags is not None:
            metrics["attackers_selected"] = jnp.sum(
                jnp.logical_and(selected, flags).astype(jnp.int32))
        return _select_mean(stacked, coefficients), metrics

    return Aggregator(no_state, reduce=reduce)


def krum(byzantine: int) -> Aggregator:
    """Krum with f Byzantine clients: the real client's vector with the lowest score
    (``multi_krum(f, 1)``)."""
    return multi_krum(byzantine, 1)


# ------------------------------------------------------------------- geometric median


def geometric_median(iterations: int = 4, smoothing: float = 1e-6) -> Aggregator:
    """RFA's weighted geometric median by the smoothed Weiszfeld algorithm (Pillutla,
    Kakade, Harchaoui, IEEE TSP 2022, arXiv 1912.13445): with α_k = w_k/Σ_k w_k, start at
    the weighted mean v⁰ = Σ α_k x_k and iterate T = ``iterations`` times

        β_k = α_k / max(ν, ‖v − x_k‖₂),   v ← Σ_k β_k x_k / Σ_k β_k,

    approximately minimising Σ_k α_k ‖v − x_k‖ (ν = ``smoothing`` keeps each step finite and
    differentiable). Padding and rejected clients have α_k = 0. The paper reports that a few
    iterations suffice [U: its figure not read here]; T is fixed so a round compiles once."""
    iterations = _count("geometric_median iterations", iterations, 0)
    nu = _positive("geometric_median smoothing", smoothing)

    def reduce(values, weights, state, key):
        del state, key
        stacked, w, real, _ = _on_server(values, weights)
        alpha = jnp.where(real, w, jnp.zeros((), w.dtype)).astype(jnp.float32)
        v = _select_mean(stacked, alpha)
        for _ in range(iterations):
            sq = sum(jnp.sum(((leaf - c[None]) ** 2).reshape(leaf.shape[0], -1), axis=1)
                     for leaf, c in zip(jax.tree.leaves(stacked), jax.tree.leaves(v),
                                        strict=True))
            dist = jnp.sqrt(jnp.maximum(sq, nu * nu))  # = max(ν, ‖v − x_k‖), safe gradient
            v = _select_mean(stacked, alpha / dist)
        return v, {}

    return Aggregator(no_state, reduce=reduce)


# -------------------------------------------------------------------------- norm bounding


def norm_bounding(max_norm: float, noise_stddev: float = 0.0) -> Aggregator:
    """Sun et al.'s defence (arXiv 1911.07963): every update clipped to ‖Δ_k‖ ≤ M
    (``clip_norm(M)``, a client stage; in the paper the server clips what arrives, the
    same function), then the weighted mean; with ``noise_stddev`` σ > 0 "weak DP":
    N(0, σ² I) added to the mean (σ far below a formal guarantee's; needs a round key).
    The authors' code clips at 1.0 without noise; third-party notes report a bound of 3
    mitigating their backdoor with little main-task loss [S]."""
    max_norm = _positive("norm_bounding max_norm", max_norm)
    sigma = _non_negative("norm_bounding noise_stddev", noise_stddev)
    parts = [clip_norm(max_norm), mean()]
    if sigma > 0:
        def server(value, stats, state, key):
            del stats
            return _add_noise(key, value, sigma, "norm_bounding (weak DP)"), state, {}

        parts.append(Aggregator(no_state, server=server))
    return chain(*parts)


# -------------------------------------------------------------------- registry, DP rule


ROBUST_RULES: dict[str, Callable[..., Aggregator]] = {
    "median": median,
    "trimmed_mean": trimmed_mean,
    "krum": krum,
    "multi_krum": multi_krum,
    "geometric_median": geometric_median,
    "norm_bounding": norm_bounding,
}
"""Name -> factory of each robust aggregator (the config's ``robust.rule``)."""

# Rules whose reduction is a (weighted) sum of clipped updates: DP's sensitivity bound holds.
SUM_RULES = ("norm_bounding",)


def robust(rule: str, *, clip: float | None = None, **options: Any) -> Aggregator:
    """The robust aggregator ``rule`` (a ``ROBUST_RULES`` name) with its ``options``, after
    a client clip ``clip_norm(clip)`` when ``clip`` is given (the documented order: client
    stages, then the robust reduction). ``norm_bounding`` with a ``clip`` is norm bounding
    at min(clip, max_norm), the same clip, reported once."""
    if rule not in ROBUST_RULES:
        raise ValueError(f"unknown robust rule {rule!r}; allowed: {', '.join(ROBUST_RULES)}.")
    if rule == "norm_bounding" and clip is not None and "max_norm" in options:
        # Clipping to S, then to M, is clipping to min(S, M); two clip stages would both
        # report clipped_clients.
        clip = _positive("robust clip", clip)
        options = {**options, "max_norm": min(clip, _positive(
            "norm_bounding max_norm", options["max_norm"]))}
        return norm_bounding(**options)
    aggregator = ROBUST_RULES[rule](**options)
    return aggregator if clip is None else chain(clip_norm(clip), aggregator)


def check_private_reduction(rule: str) -> None:
    """Raise ValueError, saying why, when the robust ``rule`` cannot carry DP noise.

    DP-FedAvg's noise z·S is calibrated to a sum in which one client moves the value by at
    most S (its clipped update); only a sum reduction keeps that bound (clip at the client,
    sum, noise after). ``norm_bounding`` is that clip: use ``private_robust`` /
    ``dp_gaussian`` with clip M.
    """
    if rule in SUM_RULES:
        return
    if rule not in ROBUST_RULES:
        raise ValueError(f"unknown robust rule {rule!r}; allowed: {', '.join(ROBUST_RULES)}.")
    raise ValueError(
        f"robust rule {rule!r} cannot be combined with DP noise: noise calibrated to the clip "
        "S needs a sum (one client moves it by at most S), and a median/trimmed mean/Krum/"
        "geometric median of clipped updates has no such bound; use norm_bounding (DP's clip "
        "is its norm bound) or drop one of the two.")


def private_robust(rule: str, clip: float, noise_multiplier: float, denominator: float,
                   **dp_options: Any) -> Aggregator:
    """DP noise with a robust rule, in the order that keeps DP's sensitivity bound: for
    ``norm_bounding`` the clip S is the norm bound M and the aggregator is
    ``dp_gaussian(S, z, D)`` (clip at the client, sum, noise after); every other rule
    raises (``check_private_reduction``)."""
    check_private_reduction(rule)
    return dp_gaussian(clip, noise_multiplier, denominator, **dp_options)
