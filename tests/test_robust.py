"""Robust aggregators against NumPy references written here (docs/references.md, robust aggregation
and attacks): coordinate-wise median and trimmed mean (Yin et al.; NumPy's median, scipy's trim_mean
cut ⌊β·n⌋), Krum and Multi-Krum (Blanchard et al., Flower's convention), RFA's smoothed Weiszfeld
(Pillutla et al.), norm bounding (Sun et al.). Inputs include ties, even and odd counts, and padded
or rejected clients (weight 0) carrying garbage that must never count. Then the tolerance claims on
a convex problem, and the DP composition rule."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedax import aggregators as agg
from fedax import federated as fed

GARBAGE = 1e6  # what a padded/rejected client holds: it must never show in a result


_COMPILED: dict = {}


def run(aggregator, values, weights, key=0, name=None):
    """``aggregate`` jitted; with ``name``, compiled once per name and shape (the real
    count r is a traced value, so every padding pattern of one C reuses the program)."""
    values = jax.tree.map(jnp.asarray, values)
    state = aggregator.init(jax.tree.map(lambda v: v[0], values))
    fn = _COMPILED.get(name) if name else None
    if fn is None:
        fn = jax.jit(lambda v, w, s, k: agg.aggregate(aggregator, v, w, s, k))
        if name:
            _COMPILED[name] = fn
    out, _, metrics = fn(values, jnp.asarray(weights, jnp.float32), state,
                         jax.random.key(key))
    return jax.tree.map(np.asarray, out), metrics


C = 24  # every cohort below is padded to C clients: one compiled program per rule


def cohort(n_real, n_pad=None, d=5, seed=0, ties=False):
    """``{"a": [C, d], "b": [C, 2]}`` values (padding rows interleaved, holding GARBAGE),
    weights (0 for padding) and the real rows; ``n_pad`` defaults to C − n_real."""
    n_pad = C - n_real if n_pad is None else n_pad
    rng = np.random.default_rng(seed)
    c = n_real + n_pad
    a = rng.normal(size=(c, d)).astype(np.float32)
    b = rng.normal(size=(c, 2)).astype(np.float32)
    if ties:  # repeated values, many equal to the median
        a = np.round(a).astype(np.float32)
        b[: c // 2] = b[0]
    pad = np.zeros(c, bool)
    pad[rng.choice(c, n_pad, replace=False)] = True
    a[pad], b[pad] = GARBAGE, -GARBAGE
    weights = np.where(pad, 0.0, rng.integers(1, 5, c)).astype(np.float32)
    return {"a": a, "b": b}, weights, ~pad


def np_trimmed(x, beta):
    n = len(x)
    cut = int(beta * n)  # scipy.stats.trim_mean's lowercut
    s = np.sort(x, axis=0)
    return s[cut:n - cut].mean(axis=0)


REAL_COUNTS = [(1, False), (2, False), (5, False), (6, True), (7, True), (20, False),
               (C, False)]


def test_median_is_numpys_over_the_real_clients():
    for n_real, ties in REAL_COUNTS:  # odd and even counts, ties, padding
        values, weights, real = cohort(n_real, ties=ties, seed=n_real)
        got, _ = run(agg.median(), values, weights, name="median")
        for name in values:
            np.testing.assert_allclose(got[name], np.median(values[name][real], axis=0),
                                       rtol=1e-6, atol=1e-7, err_msg=f"r={n_real}")


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.2, 0.35, 0.49])
def test_trimmed_mean_cuts_floor_beta_r_per_end_of_the_real_clients(beta):
    # beta = 0.35 with r = 20: float32 0.35 * 20 rounds below 7; the cut must still be 7.
    for n_real, ties in REAL_COUNTS:
        values, weights, real = cohort(n_real, ties=ties, seed=n_real)
        got, metrics = run(agg.trimmed_mean(beta), values, weights, name=f"trim{beta}")
        assert set(metrics) == {"trimmed_per_end"}
        assert int(metrics["trimmed_per_end"]) == int(beta * n_real)  # scipy's lowercut
        for name in values:
            np.testing.assert_allclose(got[name], np_trimmed(values[name][real], beta),
                                       rtol=1e-5, atol=1e-6, err_msg=f"r={n_real}")


def test_trimmed_mean_and_median_with_no_real_client_give_zeros():
    values, _, _ = cohort(3)
    for name, rule in (("median", agg.median()), ("trim0.2", agg.trimmed_mean(0.2)),
                       ("krum0", agg.krum(0)), ("rfa", agg.geometric_median())):
        got, _ = run(rule, values, np.zeros(C, np.float32), name=name)
        assert all(np.all(v == 0) for v in got.values())


def np_krum_scores(x, f):
    """Flower's aggregate_krum: D_ij = ‖x_i − x_j‖², score = sum of the
    max(1, n − f − 2) smallest distances to the others."""
    n = len(x)
    d = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    q = max(1, n - f - 2)
    return np.array([np.sort(np.delete(d[i], i))[:q].sum() for i in range(n)])


def flat(values):
    return np.concatenate([values["a"], values["b"]], axis=1).astype(np.float64)


@pytest.mark.parametrize("f,m", [(2, 1), (1, 3), (5, 1)])
@pytest.mark.parametrize("n_real", [3, 8, 9])
def test_krum_and_multi_krum_pick_what_numpy_picks(n_real, f, m):
    values, weights, real = cohort(n_real, 12 - n_real, d=6, seed=n_real + f)
    # two outliers among the real clients, far apart from the rest
    rows = np.flatnonzero(real)
    values["a"][rows[0]] += 8.0
    values["b"][rows[-1]] -= 6.0
    x = flat(values)[real]
    scores = np_krum_scores(x, f)
    chosen = np.argsort(scores, kind="stable")[:m]
    w = weights[real][chosen]
    want = (w[:, None] * x[chosen]).sum(0) / w.sum()
    got, metrics = run(agg.multi_krum(f, m), values, weights, name=f"mk{f},{m}")
    np.testing.assert_allclose(np.concatenate([got["a"], got["b"]]), want, rtol=1e-5,
                               atol=1e-6)
    # the real clients not selected; who they are needs flagging (below)
    assert set(metrics) == {"krum_discarded"}
    assert int(metrics["krum_discarded"]) == n_real - len(chosen)
    placed = {k: jnp.asarray(v) for k, v in values.items()}
    ours = np.asarray(agg.krum_scores(placed, jnp.asarray(real), f))
    np.testing.assert_allclose(ours[real], scores, rtol=1e-4)
    assert np.all(np.isinf(ours[~real]))
    if m == 1:  # Krum is the selected vector itself, whatever its weight
        got1, _ = run(agg.krum(f), values, weights, name=f"mk{f},{m}")
        np.testing.assert_allclose(np.concatenate([got1["a"], got1["b"]]),
                                   x[np.argmin(scores)], rtol=1e-6)


@pytest.mark.parametrize("f,m", [(1, 1), (1, 3)])
def test_krum_under_flagging_counts_the_flagged_clients_it_selected(f, m):
    """Under ``flagging(flags)`` Krum also reports ``attackers_selected``: the flagged
    clients among those NumPy's Krum selects. Three flagged clients send one shared vector
    close to the honest cluster (so Krum picks them); a flagged padding client (weight 0)
    is never counted. The other rules report no attacker diagnostics."""
    from fedax.aggregators.robust import flagging

    values, weights, real = cohort(8, 4, d=6, seed=11)
    rows = np.flatnonzero(real)
    flagged = np.zeros(len(weights), bool)
    flagged[rows[:3]] = True
    flagged[np.flatnonzero(~real)[0]] = True  # padding: flagged, but not a client
    values["a"][rows[:3]] = 0.01
    values["b"][rows[:3]] = 0.01
    x = flat(values)[real]
    chosen = np.argsort(np_krum_scores(x, f), kind="stable")[:m]
    want = int(flagged[real][chosen].sum())

    def program(rule):
        def go(v, w, flags):
            with flagging(flags):
                return agg.aggregate(rule, v, w, (), None)[2]
        return jax.jit(go)

    inputs = (jax.tree.map(jnp.asarray, values), jnp.asarray(weights), jnp.asarray(flagged))
    metrics = program(agg.multi_krum(f, m))(*inputs)
    assert want >= 1  # the shared vector sits in the honest cluster's middle
    assert int(metrics["attackers_selected"]) == want
    assert int(metrics["krum_discarded"]) == 8 - m
    for rule in (agg.median(), agg.trimmed_mean(0.2), agg.geometric_median()):
        assert "attackers_selected" not in program(rule)(*inputs)


def test_norm_bounding_with_a_clip_is_one_clip_at_the_smaller_bound():
    """robust("norm_bounding", clip=S, max_norm=M) clips to min(S, M) once: it used to chain
    two clips, both reporting clipped_clients (a duplicate metric: every round failed)."""
    values, weights, real = cohort(6, 2, seed=4)
    x = flat(values)[real]
    norms = np.linalg.norm(x, axis=1)
    for clip, bound in ((0.3, 0.8), (0.8, 0.3)):
        got, metrics = run(agg.robust("norm_bounding", clip=clip, max_norm=bound), values,
                           weights)
        clipped = x * np.minimum(1.0, 0.3 / norms)[:, None]
        w = weights[real]
        np.testing.assert_allclose(np.concatenate([got["a"], got["b"]]),
                                   (w[:, None] * clipped).sum(0) / w.sum(), rtol=1e-5,
                                   atol=1e-7)
        # padding holds garbage here (clipped too, as clip_norm's bit is every client's)
        assert int(metrics["clipped_clients"]) == int(
            (np.linalg.norm(flat(values), axis=1) > 0.3).sum())


def np_rfa(x, alpha, iterations, nu):
    alpha = alpha / alpha.sum()
    v = (alpha[:, None] * x).sum(0)
    for _ in range(iterations):
        beta = alpha / np.maximum(nu, np.linalg.norm(x - v, axis=1))
        v = (beta[:, None] * x).sum(0) / beta.sum()
    return v


@pytest.mark.parametrize("n_real", [5, 8])
def test_geometric_median_is_smoothed_weiszfeld_weighted(n_real):
    values, weights, real = cohort(n_real, 12 - n_real, seed=3)
    rows = np.flatnonzero(real)
    values["a"][rows[0]] += 50.0  # one outlier
    x = flat(values)[real]
    got, _ = run(agg.geometric_median(iterations=6, smoothing=1e-6), values, weights,
                 name="rfa6")
    got = np.concatenate([got["a"], got["b"]])
    np.testing.assert_allclose(got, np_rfa(x, weights[real], 6, 1e-6), rtol=1e-4, atol=1e-5)
    # it is (nearly) the weighted geometric median: a lower weighted distance sum than the
    # weighted mean, and far from the outlier's pull
    alpha = weights[real] / weights[real].sum()

    def cost(v):
        return (alpha * np.linalg.norm(x - v, axis=1)).sum()

    mean = (alpha[:, None] * x).sum(0)
    assert cost(got) < cost(mean) - 1.0
    assert np.linalg.norm(got - np.median(x, axis=0)) < np.linalg.norm(mean - np.median(x, 0))


def test_norm_bounding_clips_then_weighted_mean_and_weak_dp_noise_is_seeded():
    values, weights, real = cohort(6, 2, seed=4)
    x = flat(values)[real]
    clipped = x * np.minimum(1.0, 0.5 / np.linalg.norm(x, axis=1))[:, None]
    w = weights[real]
    want = (w[:, None] * clipped).sum(0) / w.sum()
    got, metrics = run(agg.norm_bounding(0.5), values, weights)
    np.testing.assert_allclose(np.concatenate([got["a"], got["b"]]), want, rtol=1e-5,
                               atol=1e-7)
    assert int(metrics["clipped_clients"]) >= 1
    noisy1, _ = run(agg.norm_bounding(0.5, noise_stddev=0.01), values, weights, key=7)
    noisy2, _ = run(agg.norm_bounding(0.5, noise_stddev=0.01), values, weights, key=7)
    diff = np.concatenate([noisy1["a"], noisy1["b"]]) - want
    np.testing.assert_array_equal(noisy1["a"], noisy2["a"])
    assert 0 < np.abs(diff).max() < 0.1


def test_clip_then_robust_reduction_in_the_documented_order():
    """chain(clip_norm(S), median()): each client clipped first, then the median of the
    clipped values (not the other way round)."""
    values, weights, real = cohort(7, 2, seed=5)
    x = flat(values)[real]
    clipped = x * np.minimum(1.0, 0.3 / np.linalg.norm(x, axis=1))[:, None]
    for rule, ref in ((agg.median(), lambda c: np.median(c, 0)),
                      (agg.trimmed_mean(0.2), lambda c: np_trimmed(c, 0.2))):
        got, metrics = run(agg.chain(agg.clip_norm(0.3), rule), values, weights)
        np.testing.assert_allclose(np.concatenate([got["a"], got["b"]]), ref(clipped),
                                   rtol=1e-5, atol=1e-7)
        # clip_norm's bit is every client's (padding here holds garbage: clipped too)
        assert int(metrics["clipped_clients"]) == int(
            (np.linalg.norm(flat(values), axis=1) > 0.3).sum())
    via_robust, _ = run(agg.robust("median", clip=0.3), values, weights)
    np.testing.assert_allclose(np.concatenate([via_robust["a"], via_robust["b"]]),
                               np.median(clipped, 0), rtol=1e-5, atol=1e-7)


def test_dp_composition_rule():
    for rule in ("median", "trimmed_mean", "krum", "multi_krum", "geometric_median"):
        with pytest.raises(ValueError, match="cannot be combined with DP noise"):
            agg.private_robust(rule, 1.0, 1.0, 10)
        with pytest.raises(ValueError, match="sum"):
            agg.check_private_reduction(rule)
    # norm bounding + DP is dp_gaussian with clip M: clip at the client, sum, noise after
    values, weights, real = cohort(5, 1, seed=6)
    got, metrics = run(agg.private_robust("norm_bounding", 0.4, 0.0, 5.0), values, weights)
    x = flat(values)[real]
    clipped = x * np.minimum(1.0, 0.4 / np.linalg.norm(x, axis=1))[:, None]
    np.testing.assert_allclose(np.concatenate([got["a"], got["b"]]), clipped.sum(0) / 5.0,
                               rtol=1e-5)
    assert "dp_noise_stddev" in metrics
    with pytest.raises(ValueError, match="allowed"):
        agg.check_private_reduction("mode")


def test_bad_parameters_are_one_line_errors():
    for make, match in ((lambda: agg.trimmed_mean(0.5), r"\[0, 0.5\)"),
                        (lambda: agg.krum(-1), "integer >= 0"),
                        (lambda: agg.multi_krum(1, 0), "integer >= 1"),
                        (lambda: agg.geometric_median(smoothing=0), "> 0"),
                        (lambda: agg.norm_bounding(0), "> 0"),
                        (lambda: agg.robust("mode"), "allowed")):
        with pytest.raises(ValueError, match=match):
            make()


def _prims(fn, *args):
    from jax.extend import core as jcore

    counts = collections.Counter()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            counts[eqn.primitive.name] += 1
            for p in eqn.params.values():
                for sub in (p if isinstance(p, (list, tuple)) else [p]):
                    if isinstance(sub, jcore.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jcore.Jaxpr):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return counts


def test_reductions_receive_the_clients_through_collect_and_cost_a_sums_bytes():
    values, weights, _ = cohort(6, 2)
    values = jax.tree.map(jnp.asarray, values)
    weights = jnp.asarray(weights)
    plain = fed.comm_cost(lambda v, w: agg.aggregate(agg.mean(), v, w, (), None)[0],
                          values, weights)
    rfa = agg.geometric_median()
    for rule in (agg.median(), agg.trimmed_mean(0.1), agg.krum(1), rfa):
        def program(v, w, rule=rule):
            return agg.aggregate(rule, v, w, (), None)[0]

        assert _prims(program, values, weights)["federated_collect"] >= 1
        cost = fed.comm_cost(program, values, weights)
        # the values and weights go up once each, as for the weighted mean
        assert cost.clients_to_server_bytes == plain.clients_to_server_bytes, (
            cost, plain)
        assert cost.server_to_clients_bytes == 0
        # reverse mode stays federated: the cotangent goes down with distribute
        grad = jax.grad(lambda v, w, p=program: sum(jnp.sum(x) for x in
                                                    jax.tree.leaves(p(v, w))))
        assert _prims(grad, values, weights)["federated_distribute"] >= 1
        if rule is rfa:  # the one with a square root: its gradient must stay finite
            g = jax.jit(grad)(values, weights)
            assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(g))


def test_median_and_trimmed_mean_tolerate_arbitrary_minority_on_a_convex_problem():
    """Gradient descent on F(w) = (1/h) Σ_honest ½‖w − c_k‖² (convex), f of n clients
    sending arbitrary vectors each step (±1e4 noise). With f < n/2 the median, and with
    f ≤ ⌊β n⌋ the trimmed mean, lies coordinate-wise within the honest clients' range, so
    the iterate ends inside the honest centres' bounding box (Yin et al.'s tolerance),
    while the plain mean is thrown far out of it."""
    n, f, d, steps = 10, 4, 6, 40
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(n, d)).astype(np.float32)
    honest = np.arange(n) >= f
    lo, hi = centres[honest].min(0), centres[honest].max(0)
    weights = jnp.ones(n)

    mask = jnp.asarray(honest)[:, None]
    rules = (agg.median(), agg.trimmed_mean(0.4), agg.mean(), agg.trimmed_mean(0.2))

    def step(ws, key):  # one step of each rule on the same attack
        grads_of = [w[None] - centres for w in ws]
        bad = 1e4 * jax.random.normal(key, (n, d))
        new, oks = [], []
        for w, grads, rule in zip(ws, grads_of, rules, strict=True):
            grads = jnp.where(mask, grads, bad)
            g, _, _ = agg.aggregate(rule, grads, weights, (), None)
            # the aggregate lies in the honest range of each coordinate's gradient
            g_lo = jnp.min(jnp.where(mask, grads, jnp.inf), 0)
            g_hi = jnp.max(jnp.where(mask, grads, -jnp.inf), 0)
            new.append(w - 0.5 * g)
            oks.append(jnp.all((g >= g_lo - 1e-5) & (g <= g_hi + 1e-5)))
        return tuple(new), jnp.stack(oks)

    start = tuple(jnp.zeros(d) for _ in rules)
    ws, oks = jax.jit(lambda k: jax.lax.scan(step, start, jax.random.split(k, steps)))(
        jax.random.key(1))
    within = np.asarray(oks).all(axis=0)
    for i in (0, 1):  # median; trimmed mean with f = 4 = ⌊0.4·10⌋
        w = np.asarray(ws[i])
        assert within[i]
        assert np.all((w >= lo - 1e-4) & (w <= hi + 1e-4)), (w, lo, hi)
    assert not within[2] and np.abs(np.asarray(ws[2])).max() > 100  # the mean
    assert not within[3]  # f > ⌊β n⌋: the trimmed mean loses the guarantee
