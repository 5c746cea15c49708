"""The DP aggregators (``dp_gaussian``, ``dp_adaptive_gaussian``, ``adaclip``) against independent
references: NumPy re-implementations of the papers' formulas (docs/references.md, differential
privacy), the sensitivity bound, a chi-square test of the noise scale, the analytic quantile of a
known norm distribution, and one DP round inside FedAvg under every execution strategy.

Statistical tests use fixed seeds; each states its false-alarm rate (the probability that
a correct implementation fails it on a random seed)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax import aggregators as agg
from fedax import federated as fed
from fedax.algorithms import CohortBatches, fedavg
from fedax.client import Batches

run = jax.jit(agg.aggregate, static_argnums=0)

# |Z| <= 5 for a standard normal: two-sided false-alarm probability 5.7e-7.
Z_BOUND = 5.0


def chi2_z(sum_sq_over_var: float, dof: int) -> float:
    """The Wilson-Hilferty normal score of a chi-square(dof) statistic (accurate to well
    below 1e-3 in Z for dof >= 1000)."""
    mu = 1 - 2 / (9 * dof)
    return ((sum_sq_over_var / dof) ** (1 / 3) - mu) / math.sqrt(2 / (9 * dof))


def assert_gaussian(samples: np.ndarray, std: float):
    """Mean-zero N(0, std²): the sample variance through a chi-square(n) test and the
    mean through a z-test, each at false-alarm rate 5.7e-7."""
    x = np.asarray(samples, np.float64).ravel()
    n = x.size
    z_var = chi2_z(float(np.sum(x ** 2)) / std ** 2, n)
    z_mean = float(np.mean(x)) / (std / math.sqrt(n))
    assert abs(z_var) < Z_BOUND, (z_var, np.std(x), std)
    assert abs(z_mean) < Z_BOUND, z_mean


def client_values(rng, num_clients, scale=1.0):
    return {"a": (scale * rng.normal(size=(num_clients, 3, 4))).astype(np.float32),
            "b": (scale * rng.normal(size=(num_clients, 5))).astype(np.float32)}


def as_leaves(values, k):
    return [np.asarray(values["a"][k], np.float64), np.asarray(values["b"][k], np.float64)]


def np_dp_gaussian(values, weights, clip, denominator, per_layer, cap=None):
    """DP-FedAvg's f̃_f (McMahan et al. 2018) without noise: Σ_k w_k ClipFn(Δ_k, S) / D
    over w_k > 0."""
    total = [np.zeros(values["a"].shape[1:]), np.zeros(values["b"].shape[1:])]
    clipped = 0
    d = sum(leaf.size for leaf in as_leaves(values, 0))
    for k, n_k in enumerate(weights):
        if n_k <= 0:
            continue
        leaves = as_leaves(values, k)
        if per_layer:
            out, hit = [], False
            for leaf in leaves:
                bound = clip * math.sqrt(leaf.size / d)
                norm = np.linalg.norm(leaf)
                out.append(leaf * min(1.0, bound / norm))
                hit |= norm > bound
        else:
            norm = math.sqrt(sum(np.sum(leaf ** 2) for leaf in leaves))
            out, hit = [leaf * min(1.0, clip / norm) for leaf in leaves], norm > clip
        w = 1.0 if cap is None else min(n_k / cap, 1.0)
        total = [t + w * o for t, o in zip(total, out, strict=True)]
        clipped += int(hit)
    return [t / denominator for t in total], clipped


def tree_list(tree):
    return [np.asarray(tree["a"], np.float64), np.asarray(tree["b"], np.float64)]


def norm_of(leaves):
    return math.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in leaves))


# ---- dp_gaussian ----------------------------------------------------------------------


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("cap", [None, 3.0])
def test_dp_gaussian_matches_numpy_and_bounds_sensitivity(per_layer, cap):
    """Without noise the aggregate is NumPy's f̃_f; one adversarial client (a huge update)
    moves it by exactly S/D against leaving it out (add/remove), and by at most 2S/D against
    an honest update in its place (replace-one)."""
    clip, denominator = 4.0, 8.0
    rng = np.random.default_rng(0)
    values = client_values(rng, 6)
    weights = np.array([2.0, 5.0, 1.0, 0.0, 4.0, 3.0], np.float32)
    kw = {} if cap is None else {"weighting": "capped", "example_cap": cap}
    aggregator = agg.dp_gaussian(clip, 0.0, denominator, per_layer=per_layer, **kw)

    def aggregate(vals, wts):
        out, _, metrics = run(aggregator, jax.tree.map(jnp.asarray, vals), jnp.asarray(wts),
                              aggregator.init(vals), None)
        return tree_list(out), metrics

    honest, metrics = aggregate(values, weights)
    want, clipped = np_dp_gaussian(values, weights, clip, denominator, per_layer, cap)
    for got, ref in zip(honest, want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)
    assert 0 < clipped < 5  # some clients clipped, some not
    assert int(metrics["clipped_clients"]) == clipped
    np.testing.assert_allclose(float(metrics["dp_noise_stddev"]), 0.0)

    adversary = 1 if cap is None else 4  # capped: n_k = 4 ≥ ŵ, so w_k = 1 (the worst case)
    attacked = jax.tree.map(np.copy, values)
    attacked["a"][adversary] = 1e6 * rng.normal(size=(3, 4))
    attacked["b"][adversary] = 1e6 * rng.normal(size=5)
    removed = weights.copy()
    removed[adversary] = 0.0
    bound = clip / denominator
    with_adversary, _ = aggregate(attacked, weights)
    without, _ = aggregate(values, removed)
    diff = [a - b for a, b in zip(with_adversary, without, strict=True)]
    np.testing.assert_allclose(norm_of(diff), bound, rtol=1e-5)
    if per_layer:  # every leaf moves by exactly its own S_j / D
        for leaf, s_j in zip(diff, agg.per_layer_clips(values, clip), strict=True):
            np.testing.assert_allclose(np.linalg.norm(leaf), s_j / denominator, rtol=1e-5)
    replaced = [a - b for a, b in zip(with_adversary, honest, strict=True)]
    assert norm_of(replaced) <= 2 * bound * (1 + 1e-6)


def test_per_layer_clips_allocation():
    template = {"w": jnp.zeros((10, 30)), "b": jnp.zeros(30), "c": jnp.zeros(())}
    clips = agg.per_layer_clips(template, 2.0)
    d = 331
    sizes = [30, 1, 300]  # jax.tree.leaves order: "b", "c", "w"
    np.testing.assert_allclose(clips, [2.0 * math.sqrt(s / d) for s in sizes])
    np.testing.assert_allclose(math.sqrt(sum(c ** 2 for c in clips)), 2.0)


@pytest.mark.parametrize("per_layer", [False, True])
def test_dp_gaussian_noise_has_the_configured_std(per_layer):
    clip, z, denominator = 0.7, 1.3, 5.0
    values = {"a": jnp.zeros((3, 400, 200)), "b": jnp.zeros((3, 20_000))}
    aggregator = agg.dp_gaussian(clip, z, denominator, per_layer=per_layer)
    out, _, metrics = run(aggregator, values, jnp.ones(3), (), jax.random.key(11))
    sigma = z * clip / denominator
    np.testing.assert_allclose(float(metrics["dp_noise_stddev"]), sigma, rtol=1e-6)
    assert_gaussian(np.concatenate([np.ravel(out["a"]), np.ravel(out["b"])]), sigma)
    assert_gaussian(np.ravel(out["b"]), sigma)  # every leaf gets the full z·S noise


def test_dp_gaussian_keys_and_rejected_clients():
    """Same key, same noise; another key, other noise; a zero-weight client (zeroed, as a
    rejected one arrives, or holding anything) changes neither value nor metrics."""
    rng = np.random.default_rng(1)
    values = client_values(rng, 4)
    weights = jnp.asarray([1.0, 2.0, 1.0, 3.0])
    aggregator = agg.dp_gaussian(1.0, 1.0, 4.0)
    first, _, m1 = run(aggregator, values, weights, (), jax.random.key(3))
    again, _, _ = run(aggregator, values, weights, (), jax.random.key(3))
    other, _, _ = run(aggregator, values, weights, (), jax.random.key(4))
    for leaf in ("a", "b"):
        np.testing.assert_array_equal(first[leaf], again[leaf])
        assert not np.allclose(first[leaf], other[leaf])
    padded = {"a": np.concatenate([values["a"], np.zeros((1, 3, 4), np.float32),
                                   np.full((1, 3, 4), 1e6, np.float32)]),
              "b": np.concatenate([values["b"], np.zeros((1, 5), np.float32),
                                   np.full((1, 5), 1e6, np.float32)])}
    more, _, m2 = run(aggregator, padded, jnp.concatenate([weights, jnp.zeros(2)]), (),
                      jax.random.key(3))
    for leaf in ("a", "b"):
        np.testing.assert_allclose(more[leaf], first[leaf], rtol=1e-6, atol=1e-7)
    assert int(m2["clipped_clients"]) == int(m1["clipped_clients"])


def test_dp_gaussian_validates_its_arguments():
    with pytest.raises(ValueError, match="clip must be > 0"):
        agg.dp_gaussian(0.0, 1.0, 10)
    with pytest.raises(ValueError, match="noise_multiplier must be >= 0"):
        agg.dp_gaussian(1.0, -1.0, 10)
    with pytest.raises(ValueError, match="denominator must be > 0"):
        agg.dp_gaussian(1.0, 1.0, 0)
    with pytest.raises(ValueError, match="finite"):
        agg.dp_gaussian(float("nan"), 1.0, 10)
    with pytest.raises(ValueError, match="'uniform' or 'capped'"):
        agg.dp_gaussian(1.0, 1.0, 10, weighting="n_k")
    with pytest.raises(ValueError, match="needs example_cap"):
        agg.dp_gaussian(1.0, 1.0, 10, weighting="capped")
    with pytest.raises(ValueError, match="capped' only"):
        agg.dp_gaussian(1.0, 1.0, 10, example_cap=5.0)
    with pytest.raises(ValueError, match="needs a key"):
        agg.aggregate(agg.dp_gaussian(1.0, 1.0, 10), jnp.ones((2, 3)), jnp.ones(2), (), None)


# ---- adaptive clipping -----------------------------------------------------------------


@pytest.mark.parametrize("z,sigma_b", [(0.5, 1.0), (1.0, 5.0), (1.2, 0.9), (3.0, 100.0)])
def test_split_noise_multiplier_composes_to_z(z, sigma_b):
    z_value = agg.split_noise_multiplier(z, sigma_b)
    np.testing.assert_allclose((z_value ** -2 + (2 * sigma_b) ** -2) ** -0.5, z, rtol=1e-12)
    assert z_value > z


def test_split_noise_multiplier_edges():
    assert agg.split_noise_multiplier(0.0, 0.0) == 0.0
    assert agg.split_noise_multiplier(0.0, 3.0) == 0.0
    with pytest.raises(ValueError, match="must be < 2"):
        agg.split_noise_multiplier(1.0, 0.5)
    with pytest.raises(ValueError, match="must be < 2"):
        agg.split_noise_multiplier(1.0, 0.0)
    with pytest.warns(UserWarning, match="at least twice"):
        agg.split_noise_multiplier(1.0, 0.55)
    with pytest.raises(ValueError, match="no guarantee"):
        agg.dp_adaptive_gaussian(0.0, 100, clipped_count_stddev=1.0)
    with pytest.raises(ValueError, match="must be < 2"):
        agg.dp_adaptive_gaussian(1.0, 10)  # default σ_b = m/20 = 0.5: z ≥ 2σ_b
    with pytest.raises(ValueError, match=r"target_quantile must be in \[0, 1\]"):
        agg.dp_adaptive_gaussian(0.0, 10, target_quantile=1.5)
    with pytest.raises(ValueError, match="initial_clip must be > 0"):
        agg.dp_adaptive_gaussian(0.0, 10, initial_clip=0.0)


def np_adaptive_round(values, weights, clip, m, gamma, eta, geometric=True):
    """Adaptive clipping (Andrew et al. 2021) without noise: clipped sum / m, b̄, the clip
    update."""
    total = [np.zeros(values["a"].shape[1:]), np.zeros(values["b"].shape[1:])]
    below = 0.0
    for k, w in enumerate(weights):
        if w <= 0:
            continue
        leaves = as_leaves(values, k)
        norm = norm_of(leaves)
        below += float(norm <= clip) - 0.5
        total = [t + leaf * min(1.0, clip / norm) for t, leaf in zip(total, leaves, strict=True)]
    b = min(max(below / m + 0.5, 0.0), 1.0)
    new = clip * math.exp(-eta * (b - gamma)) if geometric else max(0.0, clip - eta * (b - gamma))
    return [t / m for t in total], b, new


@pytest.mark.parametrize("geometric", [True, False])
def test_adaptive_round_matches_numpy(geometric):
    rng = np.random.default_rng(2)
    values = client_values(rng, 7, scale=0.3)
    weights = np.array([1.0, 3.0, 0.0, 2.0, 1.0, 5.0, 1.0], np.float32)
    aggregator = agg.dp_adaptive_gaussian(0.0, 10, initial_clip=0.8, target_quantile=0.7,
                                          learning_rate=0.3, geometric=geometric)
    state = aggregator.init(values)
    clip = 0.8
    for _ in range(4):
        out, state, metrics = run(aggregator, values, jnp.asarray(weights), state, None)
        want, b, new = np_adaptive_round(values, weights, clip, 10, 0.7, 0.3, geometric)
        for got, ref in zip(tree_list(out), want, strict=True):
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(float(metrics["clip_norm"]), clip, rtol=1e-6)
        np.testing.assert_allclose(float(metrics["unclipped_fraction"]), b, rtol=1e-6)
        np.testing.assert_allclose(float(state.clip), new, rtol=1e-5)
        clip = new


@pytest.mark.parametrize("gamma,geometric", [(0.5, True), (0.8, True), (0.3, False)])
def test_adaptive_clip_converges_to_the_quantile(gamma, geometric):
    """z = 0, σ_b = 0: norms ~ Uniform(0, 2) (fresh each round, 500 clients) drive C from
    0.1 to their γ-quantile 2γ; the last 100 of 400 rounds stay within 5% of it."""
    num, dim, rounds = 500, 3, 400
    aggregator = agg.dp_adaptive_gaussian(0.0, num, geometric=geometric,
                                          target_quantile=gamma, clipped_count_stddev=0.0)

    def one_round(state, key):
        k_dir, k_norm = jax.random.split(key)
        direction = jax.random.normal(k_dir, (num, dim))
        direction /= jnp.linalg.norm(direction, axis=1, keepdims=True)
        norms = jax.random.uniform(k_norm, (num, 1), minval=0.0, maxval=2.0)
        _, state, metrics = agg.aggregate(aggregator, direction * norms, jnp.ones(num),
                                          state, None)
        return state, metrics["clip_norm"]

    state = aggregator.init(jnp.zeros(dim))
    keys = jax.random.split(jax.random.key(5), rounds)
    _, clips = jax.jit(lambda s, k: jax.lax.scan(one_round, s, k))(state, keys)
    clips = np.asarray(clips)
    assert clips[0] == np.float32(0.1)
    tail = clips[-100:]
    np.testing.assert_allclose(tail, 2 * gamma, rtol=0.05)


def test_adaptive_noise_scales_and_rejected_clients():
    """Over 4000 keys: the value's noise has std z_Δ·C/m (z_Δ from the split), b̄'s noise
    std σ_b/m; a zero-weight client (zeroed: norm 0 ≤ C would count as unclipped) changes
    nothing; the key decides the noise."""
    m, z, sigma_b, c0 = 100.0, 1.0, 5.0, 0.3
    aggregator = agg.dp_adaptive_gaussian(z, m, initial_clip=c0)  # default σ_b = m/20 = 5
    z_value = agg.split_noise_multiplier(z, sigma_b)
    # 50 clients with norm 0.1 (unclipped) and 50 with norm 1 (clipped): b̄ = 0.5 + noise.
    direction = np.full(8, 1 / math.sqrt(8), np.float32)
    rows = jnp.asarray(np.concatenate([np.tile(0.1 * direction, (50, 1)),
                                       np.tile(direction, (50, 1))]))
    state = aggregator.init(rows[0])
    noiseless = (50 * 0.1 + 50 * c0) * direction / m
    values, metrics = jax.jit(jax.vmap(
        lambda key: run(aggregator, rows, jnp.ones(100), state, key)[::2]))(
        jax.random.split(jax.random.key(9), 4000))
    np.testing.assert_allclose(metrics["dp_noise_stddev"], z_value * c0 / m, rtol=1e-6)
    np.testing.assert_allclose(metrics["clip_norm"], c0, rtol=1e-6)
    assert_gaussian(np.asarray(values) - noiseless, z_value * c0 / m)
    assert_gaussian(np.asarray(metrics["unclipped_fraction"]) - 0.5, sigma_b / m)

    first = run(aggregator, rows, jnp.ones(100), state, jax.random.key(1))
    padded = jnp.concatenate([rows, jnp.zeros((3, 8)), jnp.full((1, 8), 1e6)])
    more = run(aggregator, padded, jnp.concatenate([jnp.ones(100), jnp.zeros(4)]), state,
               jax.random.key(1))
    np.testing.assert_allclose(more[0], first[0], rtol=1e-6)
    np.testing.assert_allclose(more[1].clip, first[1].clip, rtol=1e-6)
    np.testing.assert_allclose(more[2]["unclipped_fraction"], first[2]["unclipped_fraction"],
                               rtol=1e-6)
    again = run(aggregator, rows, jnp.ones(100), state, jax.random.key(1))
    other = run(aggregator, rows, jnp.ones(100), state, jax.random.key(2))
    np.testing.assert_array_equal(again[0], first[0])
    assert not np.allclose(other[0], first[0])


# ---- AdaCliP ---------------------------------------------------------------------------


class NpAdaClip:
    """AdaCliP (Pichapati et al. 2019), federated form, written out in NumPy (float64): the scale
    b_i = s_i^{1/4}(Σ_j s_j^{1/2})^{1/2}, whitening, unit clip, sum, noise, fixed
    denominator D, un-scaling, and the moment updates with v estimated per client (×D) and
    the noise variance of ĝ, b²(z/D)², subtracted."""

    def __init__(self, sizes, s0_clip, z, denominator, beta1, beta2, h1, h2):
        self.d = sum(sizes)
        self.m = np.zeros(self.d)
        self.s = np.full(self.d, s0_clip ** 2 / self.d)
        self.z, self.D, self.b1, self.b2, self.h1, self.h2 = (
            z, denominator, beta1, beta2, h1, h2)

    def scale(self):
        return self.s ** 0.25 * math.sqrt(np.sum(np.sqrt(self.s)))

    def clipped_sum(self, updates, weights):
        b, total, clipped = self.scale(), np.zeros(self.d), 0
        for delta, w in zip(updates, weights, strict=True):
            if w <= 0:
                continue
            white = (delta - self.m) / b
            norm = np.linalg.norm(white)
            total += white / max(1.0, norm)
            clipped += int(norm > 1.0)
        return total, clipped

    def finish(self, noised_sum):
        b = self.scale()
        g = b * noised_sum / self.D + self.m
        sigma = self.z / self.D
        v = np.clip(self.D * ((g - self.m) ** 2 - b ** 2 * sigma ** 2), self.h1, self.h2)
        self.m = self.b1 * self.m + (1 - self.b1) * g
        self.s = self.b2 * self.s + (1 - self.b2) * v
        return g


def flat(tree):
    return np.concatenate([np.ravel(np.asarray(leaf, np.float64))
                           for leaf in jax.tree.leaves(tree)])


def test_adaclip_without_noise_matches_numpy():
    """Six rounds, 6 clients (one zero-weight), D = 8: coordinates with very different
    spreads, so b adapts per coordinate; the value, the clipped count and the state."""
    rng = np.random.default_rng(4)
    shapes = {"a": (3, 4), "b": (5,)}  # leaves order: a, b
    sizes = [12, 5]
    spread = np.concatenate([np.full(12, 0.02), np.linspace(0.001, 0.3, 5)])
    center = rng.normal(size=17) * 0.02
    kw = dict(initial_clip=0.3, beta1=0.5, beta2=0.6, h1=1e-10, h2=1e4)
    aggregator = agg.adaclip(0.0, 8.0, **kw)
    ref = NpAdaClip(sizes, 0.3, 0.0, 8.0, 0.5, 0.6, 1e-10, 1e4)
    state = aggregator.init({k: jnp.zeros(s) for k, s in shapes.items()})
    weights = np.array([1.0, 2.0, 0.0, 1.0, 7.0, 1.0], np.float32)
    counts = []
    for _ in range(6):
        flat_updates = (center + spread * rng.normal(size=(6, 17))).astype(np.float32)
        values = {"a": flat_updates[:, :12].reshape(6, 3, 4), "b": flat_updates[:, 12:]}
        out, state, metrics = run(aggregator, values, jnp.asarray(weights), state, None)
        total, clipped = ref.clipped_sum(flat_updates.astype(np.float64), weights)
        want = ref.finish(total)
        np.testing.assert_allclose(flat(out), want, rtol=2e-4, atol=1e-6)
        np.testing.assert_allclose(flat(state.mean), ref.m, rtol=2e-4, atol=1e-6)
        np.testing.assert_allclose(flat(state.variance), ref.s, rtol=2e-4, atol=1e-10)
        assert int(metrics["clipped_clients"]) == clipped
        counts.append(clipped)
    assert 0 < sum(counts) < 5 * 6  # the clip acts, and not on everyone
    # b adapted: the widest coordinate's scale is now far above the narrowest one's
    b = flat(agg.adaclip_scale(state.variance))
    assert b[16] > 2 * b[12]


def test_adaclip_first_round_is_flat_clipping():
    """s⁰ = S⁰²/d makes b⁰ = S⁰ everywhere: round one is dp_gaussian(S⁰, 0, D)."""
    rng = np.random.default_rng(6)
    values = client_values(rng, 5, scale=0.1)
    weights = jnp.asarray([1.0, 1.0, 0.0, 1.0, 1.0])
    ada = agg.adaclip(0.0, 6.0, initial_clip=0.25)
    state = ada.init(jax.tree.map(lambda v: v[0], values))
    np.testing.assert_allclose(flat(agg.adaclip_scale(state.variance)), 0.25, rtol=1e-6)
    got, _, _ = run(ada, values, weights, state, None)
    want, _, _ = run(agg.dp_gaussian(0.25, 0.0, 6.0), values, weights, (), None)
    np.testing.assert_allclose(flat(got), flat(want), rtol=1e-5, atol=1e-7)


def test_adaclip_noise_scale_and_state_update():
    """With z > 0 the value minus the noiseless NumPy value is b ⊙ N(0, z²)/D (chi-square
    test on the whitened residual); the state update from that noised ĝ matches NumPy; the
    key decides the noise; a zero-weight client counts for nothing."""
    rng = np.random.default_rng(7)
    dim, z, denominator = 40_000, 0.9, 4.0
    ada = agg.adaclip(z, denominator, initial_clip=0.5, beta1=0.6, beta2=0.7)
    with pytest.warns(RuntimeWarning, match=r"d·z²/D = 8.1e\+03 > 1 .*clip_budget=S"):
        ada.init(jnp.zeros(dim))  # 40,000 coordinates under z = 0.9, D = 4: the bad regime
    ref = NpAdaClip([dim], 0.5, z, denominator, 0.6, 0.7, 1e-12, 1e12)
    # a non-uniform state, so b differs per coordinate
    ref.m = (0.01 * rng.normal(size=dim))
    ref.s = np.abs(rng.normal(size=dim)) * 1e-5 + 1e-7
    state = agg.AdaClipState(jnp.asarray(ref.m, jnp.float32), jnp.asarray(ref.s, jnp.float32))
    updates = (ref.m + 0.003 * rng.normal(size=(3, dim))).astype(np.float32)
    weights = np.array([1.0, 1.0, 1.0], np.float32)
    out, new_state, metrics = run(ada, updates, jnp.asarray(weights), state, jax.random.key(2))
    total, _ = ref.clipped_sum(updates.astype(np.float64), weights)
    b = ref.scale()
    residual = (np.asarray(out, np.float64) - (b * total / denominator + ref.m)) / b
    assert_gaussian(residual, z / denominator)
    np.testing.assert_allclose(float(metrics["dp_noise_stddev"]),
                               z / denominator * math.sqrt(np.mean(b ** 2)), rtol=1e-4)
    noised_sum = (np.asarray(out, np.float64) - ref.m) / b * denominator
    ref.finish(noised_sum)
    np.testing.assert_allclose(np.asarray(new_state.mean), ref.m, rtol=1e-4, atol=1e-8)
    np.testing.assert_allclose(np.asarray(new_state.variance), ref.s, rtol=1e-3, atol=1e-12)

    again = run(ada, updates, jnp.asarray(weights), state, jax.random.key(2))[0]
    other = run(ada, updates, jnp.asarray(weights), state, jax.random.key(3))[0]
    np.testing.assert_array_equal(again, out)
    assert not np.allclose(other, out)
    padded = np.concatenate([updates, np.zeros((1, dim), np.float32),
                             np.full((1, dim), 1e6, np.float32)])
    more = run(ada, padded, jnp.asarray([1.0, 1.0, 1.0, 0.0, 0.0]), state,
               jax.random.key(2))
    np.testing.assert_allclose(more[0], out, rtol=1e-5, atol=1e-8)
    assert int(more[2]["clipped_clients"]) == int(metrics["clipped_clients"])


def test_adaclip_clip_budget_pins_the_scale_and_keeps_a_noised_run_bounded():
    """b_i = S s_i^{1/4}/sqrt(mean √s) against NumPy; a flat s gives b = S (round one equals
    dp_gaussian(S, z, D) under the same key); and in the regime d·z²/D ≫ 1 the paper's scale
    grows geometrically over noised rounds while the pinned one stays at S."""
    rng = np.random.default_rng(11)
    s = {"a": np.abs(rng.normal(size=(3, 4))) + 1e-3, "b": np.abs(rng.normal(size=5)) + 1e-3}
    got = flat(agg.adaclip_scale(jax.tree.map(jnp.asarray, s), 0.7))
    all_s = np.concatenate([s["a"].ravel(), s["b"]])
    np.testing.assert_allclose(got, 0.7 * all_s ** 0.25 / np.sqrt(np.mean(np.sqrt(all_s))),
                               rtol=1e-5)
    values = client_values(rng, 4, scale=0.2)
    weights = jnp.asarray([1.0, 1.0, 1.0, 0.0])
    pinned = agg.adaclip(1.0, 5.0, initial_clip=0.05, clip_budget=0.3)
    state = pinned.init(jax.tree.map(lambda v: v[0], values))
    np.testing.assert_allclose(flat(agg.adaclip_scale(state.variance, 0.3)), 0.3, rtol=1e-6)
    key = jax.random.key(4)
    got, _, _ = run(pinned, values, weights, state, key)
    want, _, _ = run(agg.dp_gaussian(0.3, 1.0, 5.0), values, weights, (), key)
    np.testing.assert_allclose(flat(got), flat(want), rtol=1e-4, atol=1e-6)

    dim, clients = 2000, 10  # d·z²/D = 200
    mu = 1e-3 * rng.normal(size=dim)
    spread = 1e-3 * np.exp(rng.normal(size=dim))

    def error_after(aggregator, rounds=25):
        """‖aggregate − μ‖ of the last round."""
        state = aggregator.init(jnp.zeros(dim))
        step = jax.jit(lambda v, st, k: agg.aggregate(aggregator, v, jnp.ones(clients), st, k))
        for t in range(rounds):
            updates = jnp.asarray(mu + spread * rng.normal(size=(clients, dim)), jnp.float32)
            out, state, _ = step(updates, state, jax.random.fold_in(key, t))
        return float(np.linalg.norm(np.asarray(out) - mu))

    flat_noise = 1.0 * 0.1 / clients * math.sqrt(dim)  # z·S/D·√d: flat clipping at S = 0.1
    with pytest.warns(RuntimeWarning, match="clip scale will grow"):
        paper = agg.adaclip(1.0, clients)  # b⁰ = 0.1 too
        assert error_after(paper) > 100 * flat_noise  # the documented divergence
    assert error_after(agg.adaclip(1.0, clients, clip_budget=0.1)) < 1.5 * flat_noise


def test_adaclip_validates_its_arguments():
    with pytest.raises(ValueError, match="beta1 must be in"):
        agg.adaclip(1.0, 10, beta1=1.0)
    with pytest.raises(ValueError, match="h2 >= h1"):
        agg.adaclip(1.0, 10, h1=1.0, h2=0.5)
    with pytest.raises(ValueError, match="expected_clients must be > 0"):
        agg.adaclip(1.0, 0)
    ada = agg.adaclip(1.0, 10)
    with pytest.raises(ValueError, match="needs a key"):
        agg.aggregate(ada, jnp.ones((2, 3)), jnp.ones(2), ada.init(jnp.ones(3)), None)


# ---- inside FedAvg ---------------------------------------------------------------------

DIM, STEPS, BATCH = 3, 2, 4


def loss_fn(params, batch: Batches):
    residual = batch.x @ params["w"] - batch.y
    return 0.5 * jnp.sum(batch.mask * residual ** 2) / jnp.maximum(jnp.sum(batch.mask), 1.0)


def make_cohort(nan_client=None, empty_client=None):
    rng = np.random.default_rng(10)
    x = rng.normal(size=(5, STEPS, BATCH, DIM)).astype(np.float32)
    y = rng.normal(size=(5, STEPS, BATCH)).astype(np.float32)
    mask = np.ones((5, STEPS, BATCH), np.float32)
    if nan_client is not None:
        x[nan_client, 0, 0, 0] = np.nan
    if empty_client is not None:
        mask[empty_client] = 0.0
    num = mask.sum(axis=(1, 2))
    return CohortBatches(Batches(jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask)),
                         jnp.asarray(num), jnp.arange(5, dtype=jnp.int32))


AGGREGATORS = {
    "gaussian": lambda: agg.dp_gaussian(0.3, 1.0, 4.0, per_layer=True, weighting="capped",
                                        example_cap=6.0),
    "adaptive": lambda: agg.dp_adaptive_gaussian(0.5, 5.0, clipped_count_stddev=1.0),
    "adaclip": lambda: agg.adaclip(1.0, 5.0),
}


@pytest.mark.parametrize("name", sorted(AGGREGATORS))
def test_dp_round_inside_fedavg(name):
    """Two DP rounds in FedAvg: bit-identical for the same seed, other noise for another,
    equal under the vmap, sequential and unroll strategies; a rejected (NaN) client gives
    exactly the rounds where that client had no data."""
    alg = fedavg(loss_fn, optax.sgd(0.2), aggregator=AGGREGATORS[name]())
    start = alg.init({"w": jnp.asarray([0.5, -0.2, 0.1])}, None)

    def two_rounds(round_fn, data, seed=0):
        state, metrics = start, []
        for t in range(2):
            state, m = round_fn(state, data, jax.random.key(seed + t))
            metrics.append(m)
        return state, metrics

    cohort = make_cohort()
    results = {}
    for strategy in ("vmap", "sequential", "unroll"):
        with fed.map_strategy(strategy):
            round_fn = jax.jit(alg.round)  # traced (at the first call) under this strategy
            results[strategy] = two_rounds(round_fn, cohort)
            if strategy == "vmap":
                same = two_rounds(round_fn, cohort)
                other = two_rounds(round_fn, cohort, seed=5)
                rejected = two_rounds(round_fn, make_cohort(nan_client=2))
                empty = two_rounds(round_fn, make_cohort(empty_client=2))

    state, metrics = results["vmap"]
    for a, b in zip(jax.tree.leaves(results["vmap"]), jax.tree.leaves(same), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.allclose(other[0].server.params["w"], state.server.params["w"])
    for strategy in ("sequential", "unroll"):
        for a, b in zip(jax.tree.leaves(results[strategy]), jax.tree.leaves(results["vmap"]),
                        strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    assert int(rejected[1][0]["rejected_clients"]) == 1
    np.testing.assert_array_equal(rejected[0].server.params["w"], empty[0].server.params["w"])
    for a, b in zip(jax.tree.leaves(rejected[0].aggregator),
                    jax.tree.leaves(empty[0].aggregator), strict=True):
        np.testing.assert_array_equal(a, b)
    for key in metrics[0]:
        if key not in ("rejected_clients", "train_loss", "local_steps"):
            np.testing.assert_array_equal(rejected[1][1][key], empty[1][1][key])


def test_dp_compressed_applies_capped_weights_once():
    """DP over a compressed uplink with capped weights: Σ_k min(n_k/ŵ, 1)·clip_S(Δ_k) / D,
    each weight once (dp_gaussian's clip carries it; the compressed sum must not repeat it)."""
    rng = np.random.default_rng(3)
    deltas = rng.normal(size=(5, 16)).astype(np.float32)
    n = np.array([1.0, 2.0, 4.0, 8.0, 0.0], np.float32)
    aggregator = agg.dp_compressed(agg.cast("float16"), 1.0, 0.0, 7.0, weighting="capped",
                                   example_cap=4.0)
    value, _, _ = agg.aggregate(aggregator, jnp.asarray(deltas), jnp.asarray(n),
                                aggregator.init(jnp.zeros(16)), jax.random.key(0))
    norms = np.linalg.norm(deltas, axis=1, keepdims=True)
    clipped = deltas * np.minimum(1.0, 1.0 / norms)
    expected = (np.minimum(n / 4.0, 1.0)[:, None] * clipped).sum(0) / 7.0
    np.testing.assert_allclose(np.asarray(value), expected, rtol=2e-3, atol=1e-3)
