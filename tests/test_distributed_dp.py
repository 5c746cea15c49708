"""Distributed DP on secure aggregation (``fedax.aggregators.distributed_dp``) and its
accountant (``fedax.privacy.distributed``), against independent references:

* the pipeline against a NumPy float64 clip / rotate / scale, the rounding error bound
  √d'/s, and the lead's NumPy modular sum;
* the noise samplers against the exact pmfs (SciPy's Skellam, the normalised discrete
  Gaussian) by chi-square, the summed noise's variance against the accountant's (z·C·s)²,
  and its low bits against uniform (JAX's float32 ``random.poisson`` fails that one);
* the RDP bounds against exact Rényi divergences computed numerically from the pmfs
  (1-D Skellam; the convolved sum of discrete Gaussians), dp-accounting's Gaussian as the
  n = 1 case and as the fine-quantization limit;
* TFF's documented numbers: k ≈ 3.9 standard deviations at modclip_prob = 1e-4
  (``DistributedDpSumFactory`` docstring) and its scale rule
  2^b = 2k·sqrt(ρ/d·(nC)² + n(γ²/4 + σ²))/γ (``_heuristic_scale_factor`` docstring).

No printed ε for given parameters was found in the papers' or TFF's public text, so the
ε checks are the exact-divergence and limit checks above. Statistical tests use fixed
seeds; each states its false-alarm rate.
"""

import math
import sys
from pathlib import Path

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_accounting import rdp
from scipy import stats

from fedax import aggregators as agg
from fedax import federated as fed
from fedax.aggregators import base as agg_base
from fedax.aggregators.compressors import hadamard, rotation_signs
from fedax.aggregators.distributed_dp import (
    DistributedDpState,
    conditional_round,
    distributed_dp,
    distributed_dp_params,
    inflated_l2_bound,
    local_noise,
    modclip_stddevs,
)
from fedax.algorithms import fedavg
from fedax.privacy import distributed as pd

sys.path.insert(0, str(Path(__file__).parent))
from test_dp_aggregators import loss_fn, make_cohort  # noqa: E402

run = jax.jit(agg.aggregate, static_argnums=0)


def updates(rng, clients=5):
    return {"a": (rng.normal(size=(clients, 3, 5)) * 0.6).astype(np.float32),
            "b": (rng.normal(size=(clients, 7)) * 0.6).astype(np.float32)}


def flat(tree):
    return np.concatenate([np.asarray(tree["a"]).reshape(tree["a"].shape[0], -1),
                           np.asarray(tree["b"]).reshape(tree["b"].shape[0], -1)], axis=1)


# ---- parameters (TFF's rules) ------------------------------------------------------------


def test_parameters_follow_tffs_rules():
    # TFF's modclip_prob docstring: 1e-4 is "roughly 3.9 standard deviations".
    assert modclip_stddevs(1e-4) == pytest.approx(3.8906, abs=1e-4)
    c, z, n, dim, b = 0.1, 0.5, 100, 99, 16  # TFF's test factory (dim 99 pads to 128)
    p = distributed_dp_params(c, z, n, dim, bits=b)
    assert p.padded_dim == 128
    gamma, sigma2 = 1 / p.scale, (z * c) ** 2 / n
    k = p.k_stddevs
    # _heuristic_scale_factor's defining equation, rho = 1.
    assert 2.0 ** b == pytest.approx(
        2 * k * math.sqrt((n * c) ** 2 / p.padded_dim + n * (gamma ** 2 / 4 + sigma2)) / gamma,
        rel=1e-12)
    assert p.central_variance == pytest.approx((z * c * p.scale) ** 2, rel=1e-12)
    assert p.l2_sensitivity == pytest.approx(
        p.scale * inflated_l2_bound(c, gamma, p.beta, 128) * (1 + 1e-5), rel=1e-12)
    assert p.l1_sensitivity == pytest.approx(
        min(math.sqrt(128) * p.l2_sensitivity, p.l2_sensitivity ** 2))
    # beta = 0: the deterministic bound C + γ√d.
    assert inflated_l2_bound(1.0, 0.1, 0.0, 100) == pytest.approx(2.0)
    # The scale is capped at 1e6 (TFF's MAX_SCALE_FACTOR).
    assert distributed_dp_params(1.0, 0.0, 1, 4, bits=22).scale == 1e6


def test_bits_too_small_names_the_fix():
    with pytest.raises(ValueError, match=r"bits=8 is too small for 1000 .*at least 10"):
        distributed_dp(1.0, 1.0, 1000, bits=8)
    # 2^3 >= 5 clients, but 2^6 <= 5·k²: the wrap condition needs 4 bits.
    with pytest.raises(ValueError, match=r"bits=3 is too small .*at least 4"):
        distributed_dp(1.0, 1.0, 5, bits=3)
    distributed_dp(1.0, 1.0, 5, bits=4)
    with pytest.raises(ValueError, match=r"bits must be in \[1, 22\]"):
        distributed_dp(1.0, 1.0, 5, bits=23)
    with pytest.raises(ValueError, match="mechanism must be one of"):
        distributed_dp(1.0, 1.0, 5, mechanism="gaussian")
    with pytest.raises(ValueError, match="rotation must be 'hadamard'"):
        distributed_dp(1.0, 1.0, 5, rotation="dft")
    with pytest.raises(ValueError, match="beta must be in"):
        distributed_dp(1.0, 1.0, 5, beta=1.0)
    with pytest.raises(ValueError, match="modclip_prob must be in"):
        distributed_dp(1.0, 1.0, 5, modclip_prob=0.0)
    with pytest.raises(ValueError, match="expected_clients must be a whole number"):
        distributed_dp(1.0, 1.0, 12.5)
    distributed_dp(1.0, 1.0, 12.0)  # an integral float (a config's q·N) is fine
    ddp = distributed_dp(1.0, 1.0, 5)
    with pytest.raises(ValueError, match="needs a key"):
        agg.aggregate(ddp, jnp.ones((2, 3)), jnp.ones(2), ddp.init(jnp.ones(3)), None)


# ---- the pipeline ------------------------------------------------------------------------


def test_round_trip_without_noise_is_the_clipped_mean():
    """z = 0: the decoded average equals Σ_k clip(Δ_k)/n over the participants within the
    rounding bound ‖Σ_k e_k‖₂/(s·n) ≤ √d'/s (|e_ki| < 1; the rotation is orthonormal);
    a zero-weight client is left out, a non-finite one sends zeros but counts."""
    clip, n = 1.0, 4
    rng = np.random.default_rng(0)
    values = updates(rng)
    values["b"][3, 0] = np.nan
    weights = jnp.asarray([2.0, 1.0, 0.0, 5.0, 1.0])
    ddp = distributed_dp(clip, 0.0, n, bits=16)
    state = ddp.init(jax.tree.map(lambda v: v[0], values))
    out, new_state, metrics = run(ddp, values, weights, state, jax.random.key(3))

    x = flat(values).astype(np.float64)
    norms = np.linalg.norm(x, axis=1)
    keep = (np.asarray(weights) > 0) & np.isfinite(norms)
    want = (x[keep] * np.minimum(1, clip / norms[keep])[:, None]).sum(axis=0) / n
    got = flat(jax.tree.map(lambda v: v[None], out))[0]
    p = distributed_dp_params(clip, 0.0, n, 22, bits=16)
    assert np.linalg.norm(got - want) <= math.sqrt(p.padded_dim) / p.scale
    assert out["a"].shape == (3, 5) and out["a"].dtype == jnp.float32
    assert int(metrics["noised_clients"]) == 4  # weight > 0, the NaN client included
    assert int(metrics["clipped_clients"]) == int(np.sum(keep & (norms > clip)))
    assert int(metrics["clipped_on_rounding"]) == 0
    assert float(metrics["dp_noise_stddev"]) == 0.0
    assert not np.array_equal(new_state.rotation_key, state.rotation_key)


def test_client_messages_and_their_modular_sum_against_numpy():
    """Each client's message is s·(1/√d')·H·D·clip(x) rounded (|error| < 1) mod 2^b, the
    reduction is the lead's NumPy modular sum of the messages, and weight-0 clients send
    zeros."""
    bits, clip, n = 12, 1.0, 5
    rng = np.random.default_rng(1)
    values = updates(rng)
    weights = jnp.asarray([1.0, 1.0, 0.0, 1.0, 3.0])
    ddp = distributed_dp(clip, 0.0, n, bits=bits, beta=0.0)
    state = ddp.init(jax.tree.map(lambda v: v[0], values))
    keys, _, _ = agg_base.round_keys(jax.random.key(0), 5)
    messages, _, _ = jax.jit(agg_base.client_stage, static_argnums=0)(ddp, values, weights, state,
                                                                 keys)
    q = np.asarray(messages["noised"])
    assert q.dtype == np.uint32 and q.shape == (5, 32) and np.all(q < 2 ** bits)

    p = distributed_dp_params(clip, 0.0, n, 22, bits=bits, beta=0.0)
    x = flat(values).astype(np.float64)
    x = x * np.minimum(1, clip / np.linalg.norm(x, axis=1))[:, None]
    x = np.pad(x, ((0, 0), (0, 10)))
    d = np.asarray(rotation_signs(state.rotation_key, 0, (1, 32)))[0]
    y = p.scale * (x * d) @ hadamard(32).astype(np.float64) / math.sqrt(32)
    signed = np.where(q >= 2 ** (bits - 1), q.astype(np.int64) - 2 ** bits, q)
    live = np.asarray(weights) > 0
    assert np.all(np.abs(signed[live] - y[live]) < 1 + 1e-3)
    assert np.all(q[~live] == 0)

    total = fed.modular_sum(messages, bits)
    np.testing.assert_array_equal(total["noised"], fed.secure.modular_sum_np(q, bits))
    np.testing.assert_array_equal(total["counts"], [4, 4, 0])


def test_conditional_rounding_retries_then_falls_back_toward_zero():
    y = jnp.asarray([0.5, -1.5, 2.25, 0.0], jnp.float32)
    key = jax.random.key(0)
    r, fell_back = conditional_round(y, key, bound=10.0, tries=5)
    assert not bool(fell_back) and np.all(np.abs(np.asarray(r) - np.asarray(y)) < 1)
    # Below ‖⌊y⌋‖ no rounding passes: y rounded toward zero is [0, -1, 2, 0], norm √5.
    r, fell_back = conditional_round(y, key, bound=math.sqrt(5.0), tries=5)
    assert bool(fell_back)
    np.testing.assert_array_equal(r, [0, -1, 2, 0])
    r, fell_back = conditional_round(y, key, bound=1.0, tries=5)
    assert bool(fell_back) and not np.any(np.asarray(r))


# ---- the noise ---------------------------------------------------------------------------


def summed_noise(mechanism, local_variance, clients, dim, seed=0):
    """The decoded (signed 22-bit) modular sum of ``clients`` noise shares on zeros."""
    keys = jax.random.key_data(jax.random.split(jax.random.key(seed), clients))

    @jax.jit
    def go(keys):
        q = jax.vmap(lambda k: local_noise(
            jnp.zeros(dim, jnp.int32), k, True, mechanism=mechanism,
            local_variance=local_variance, noise_multiplier=1.0, bits=22))(keys)
        return fed.secure.decode(fed.modular_sum(q, 22), step=1.0, bits=22, dtype=jnp.float32)

    return np.asarray(go(keys), np.float64)


@pytest.mark.parametrize("mechanism,local_variance", [
    ("skellam", 6.0),  # Poisson(3): the inverse-CDF branch
    ("skellam", 2e4),  # Poisson(1e4): transformed rejection
    ("discrete_gaussian", 300.0),
])
def test_summed_noise_has_the_accountants_variance(mechanism, local_variance):
    """Four shares on 2^16 coordinates: the sample variance is within 5% of
    n·local_variance = (z·C·s)²/n·n (a 5% error is 9 standard errors of the estimate), and
    the sum's residues mod 8 are uniform within 5% each (4.8 standard errors): no lattice."""
    noise = summed_noise(mechanism, local_variance, 4, 1 << 16)
    assert abs(noise.mean()) < 5 * math.sqrt(4 * local_variance / noise.size)
    assert noise.var() == pytest.approx(4 * local_variance, rel=0.05)
    residues = np.bincount(np.mod(noise.astype(np.int64), 8), minlength=8) / noise.size
    np.testing.assert_allclose(residues, 1 / 8, rtol=0.05)


def test_large_skellam_shares_keep_their_low_bits():
    """λ = 5·10⁸ per Poisson, where JAX's float32 sampler returns multiples of 8 or more:
    the float64 sampler's variance and residues mod 8 (2^14 coordinates, two shares)."""
    noise = summed_noise("skellam", 1e9, 2, 1 << 14, seed=1)
    assert noise.var() == pytest.approx(2e9, rel=0.1)  # 0.1 is 9 standard errors
    residues = np.bincount(np.mod(noise.astype(np.int64), 8), minlength=8) / noise.size
    np.testing.assert_allclose(residues, 1 / 8, rtol=0.1)  # 3.7 standard errors


def chi_square(samples, pmf, support):
    """Pearson's statistic over ``support`` plus one bin for the rest (expected counts ≥ 5)."""
    counts = np.array([np.sum(samples == k) for k in support] + [0.0])
    counts[-1] = samples.size - counts[:-1].sum()
    expected = np.append(pmf, max(1 - pmf.sum(), 0)) * samples.size
    keep = expected >= 5
    return float(np.sum((counts[keep] - expected[keep]) ** 2 / expected[keep])), int(keep.sum())


@pytest.mark.parametrize("mechanism,variance", [
    ("skellam", 4.0),  # Poisson(2): inverse CDF
    ("skellam", 21.0),  # Poisson(10.5): transformed rejection at its smallest mean
    ("skellam", 60.0),
    ("discrete_gaussian", 0.5),  # t = 1
    ("discrete_gaussian", 2.25),
])
def test_one_share_has_the_exact_pmf(mechanism, variance):
    """2^16 draws of one share against the exact pmf (SciPy's Skellam; the discrete
    Gaussian normalised numerically): chi-square below its 1 − 10⁻⁶ quantile."""
    samples = summed_noise(mechanism, variance, 1, 1 << 16, seed=2)
    support = np.arange(-int(8 * math.sqrt(variance)) - 2, int(8 * math.sqrt(variance)) + 3)
    if mechanism == "skellam":
        pmf = stats.skellam.pmf(support, variance / 2, variance / 2)
    else:
        wide = np.arange(-200, 201)
        norm = np.exp(-wide ** 2 / (2 * variance)).sum()
        pmf = np.exp(-support ** 2 / (2 * variance)) / norm
    statistic, bins = chi_square(samples, pmf, support)
    assert statistic < stats.chi2.ppf(1 - 1e-6, bins - 1), (statistic, bins)


# ---- the audit inside FedAvg -------------------------------------------------------------


def test_fedavg_round_is_audited_as_secure_dp():
    """The update's upload in a FedAvg round is one modular sum of the local-noise
    primitive's output: kind "secure+dp" with multiplier z; the counts go by a secure sum;
    the only plain sums are FedAvg's scalars. A rejected (NaN) client gives exactly the round
    of a client without data, and z = 0 is a plain secure sum."""
    start = {"w": jnp.asarray([0.5, -0.2, 0.1])}
    alg = fedavg(loss_fn, optax.sgd(0.2), aggregator=distributed_dp(0.3, 1.5, 4, bits=16))
    state = alg.init(start, None)
    transfers = fed.audit_sums(jax.make_jaxpr(alg.round)(state, make_cohort(),
                                                         jax.random.key(0)))
    private = [t for t in transfers if t.kind == "secure+dp"]
    assert [(t.primitive, t.shape, t.noise_multiplier) for t in private] == [
        ("federated_modular_sum", (5, 4), 1.5)]
    assert [t.shape for t in transfers if t.kind == "secure"] == [(5, 3)]
    assert all(t.shape == (5,) for t in transfers if t.kind == "plain")

    round_fn = jax.jit(alg.round)
    rejected, metrics = round_fn(state, make_cohort(nan_client=2), jax.random.key(1))
    empty, _ = round_fn(state, make_cohort(empty_client=2), jax.random.key(1))
    np.testing.assert_array_equal(rejected.server.params["w"], empty.server.params["w"])
    assert int(metrics["noised_clients"]) == 4
    assert float(metrics["dp_effective_noise_multiplier"]) == pytest.approx(1.5)

    plain = fedavg(loss_fn, optax.sgd(0.2), aggregator=distributed_dp(0.3, 0.0, 4, bits=16))
    kinds = {t.kind for t in fed.audit_sums(jax.make_jaxpr(plain.round)(
        plain.init(start, None), make_cohort(), jax.random.key(0)))}
    assert "secure+dp" not in kinds and "secure" in kinds


def test_state_is_static_about_the_template():
    ddp = distributed_dp(1.0, 1.0, 4)
    state = ddp.init({"a": jnp.zeros((2, 3), jnp.bfloat16), "b": jnp.zeros(5)})
    assert isinstance(state, DistributedDpState)
    assert jax.tree.leaves(state) == [state.rotation_key]
    with pytest.raises(ValueError, match="at least one coordinate"):
        ddp.init({"a": jnp.zeros((0,))})


# ---- the accountant ----------------------------------------------------------------------


def renyi(p, q, alpha):
    """D_α(P‖Q) of two pmfs on the same support (log-space)."""
    ok = (p > 0) & (q > 0)
    terms = alpha * np.log(p[ok]) + (1 - alpha) * np.log(q[ok])
    return float(np.logaddexp.reduce(terms) / (alpha - 1))


@pytest.mark.parametrize("mu,shift,slack", [(10.0, 1, 1.5), (40.0, 3, 1.25), (400.0, 5, 1.02)])
def test_skellam_rdp_bounds_the_exact_divergence(mu, shift, slack):
    """The bound is ≥ the exact D_α(Sk(μ/2, μ/2) + Δ ‖ Sk(μ/2, μ/2)) (both orders of the
    pair; Δ₁ = Δ₂ = Δ in one dimension) and tightens as μ grows: within 50% at μ = 10,
    2% at μ = 400 (orders 2 to 16)."""
    support = np.arange(-int(40 * math.sqrt(mu)) - 50, int(40 * math.sqrt(mu)) + 50)
    p = stats.skellam.pmf(support, mu / 2, mu / 2)
    q = stats.skellam.pmf(support - shift, mu / 2, mu / 2)
    orders = [2, 3, 5, 8, 16]
    bound = pd.skellam_rdp(orders, l1_sensitivity=shift, l2_sensitivity=shift, variance=mu)
    for a, b in zip(orders, bound, strict=True):
        exact = max(renyi(p, q, a), renyi(q, p, a))
        assert exact <= b <= slack * exact, (a, exact, b)


@pytest.mark.parametrize("clients,sigma", [(2, 0.6), (3, 0.8), (4, 1.0)])
def test_discrete_gaussian_sum_rdp_bounds_the_exact_divergence(clients, sigma):
    """The sum of n discrete Gaussians N_ℤ(0, σ²) (convolved numerically) shifted by 1: the
    bound of Kairouz et al. is ≥ the exact Rényi divergence (d = 1, Δ₁ = Δ₂ = 1)."""
    wide = np.arange(-60, 61)
    one = np.exp(-wide ** 2 / (2 * sigma ** 2))
    one /= one.sum()
    total = one
    for _ in range(clients - 1):
        total = np.convolve(total, one)
    orders = [2, 3, 4, 8, 16, 32]
    bound = pd.discrete_gaussian_rdp(orders, l1_sensitivity=1, l2_sensitivity=1,
                                     local_stddev=sigma, num_clients=clients, dim=1)
    p, q = total[1:], total[:-1]
    for a, b in zip(orders, bound, strict=True):
        assert max(renyi(p, q, a), renyi(q, p, a)) <= b, a
    with pytest.raises(ValueError, match="local stddev >= 1/2"):
        pd.discrete_gaussian_rdp([2], l1_sensitivity=1, l2_sensitivity=1, local_stddev=0.4,
                                 num_clients=2, dim=1)


def gaussian_rdp(z):
    accountant = rdp.RdpAccountant(orders=list(pd.ORDERS))
    accountant.compose(dp_accounting.GaussianDpEvent(z))
    return accountant.rdp


def test_one_discrete_gaussian_is_dp_accountings_gaussian():
    """n = 1: τ = 0 and the bound is the discrete Gaussian's ½(Δ/σ)²-zCDP, which
    dp-accounting's GaussianDpEvent(σ/Δ) gives at every order."""
    curve = pd.discrete_gaussian_rdp(pd.ORDERS, l1_sensitivity=30.0, l2_sensitivity=3.0,
                                     local_stddev=7.5, num_clients=1, dim=100)
    np.testing.assert_allclose(curve, gaussian_rdp(7.5 / 3.0), rtol=1e-12)


@pytest.mark.parametrize("mechanism", ["skellam", "discrete_gaussian"])
def test_fine_quantization_approaches_the_central_gaussian(mechanism):
    """22 bits, 10 clients, 1024 coordinates (s·C ≈ 5·10⁵ ≫ √d): ε of 100 rounds at
    δ = 1e-5 is at least the Gaussian's with the same z and within 0.1% of it; at 10 bits
    on 2^16 coordinates the rounding's inflation of Δ₂ costs visibly more."""
    delta, rounds, z = 1e-5, 100, 1.0
    accountant = rdp.RdpAccountant(orders=list(pd.ORDERS))
    accountant.compose(dp_accounting.GaussianDpEvent(z), rounds)
    central = accountant.get_epsilon(delta)
    fine = pd.distributed_epsilon(
        distributed_dp_params(1.0, z, 10, 1024, bits=22, mechanism=mechanism), rounds, delta)
    assert central <= fine <= central * 1.001
    coarse = pd.distributed_epsilon(
        distributed_dp_params(1.0, z, 10, 1 << 16, bits=10, mechanism=mechanism), rounds,
        delta)
    assert coarse > central * 1.05


def test_epsilon_composes_over_rounds():
    p = distributed_dp_params(1.0, 0.8, 50, 5000, bits=18)
    eps = [pd.distributed_epsilon(p, t, 1e-6) for t in (0, 1, 10, 100)]
    assert eps[0] == 0 and eps[1] < eps[2] < eps[3]
    orders, curve = pd.round_rdp(p)
    assert eps[3] == pytest.approx(rdp.compute_epsilon(orders, 100 * curve, 1e-6)[0])
    assert pd.distributed_epsilon(distributed_dp_params(1.0, 0.0, 50, 5000), 1,
                                  1e-6) == math.inf
