"""Secure summation in simulation: the primitives against a NumPy reference of the
protocol's arithmetic (clip → stochastic rounding → modular sum → decode), the overflow
check, a secure FedAvg round against the plain one within the quantization bound, and
hypergradients through secure rounds whose derivative programs upload only secure sums."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_hyper import K, loss_fn, make_cohort

from fedax import aggregators as agg
from fedax import federated as fed
from fedax.algorithms import fedavg
from fedax.federated import SecureSum
from fedax.federated import secure as sec
from fedax.hyper import hypergradient, loss_after_rounds, secure_loss


def numpy_secure_sum(x, spec, key):
    """The protocol's arithmetic in NumPy; only the uniforms come from JAX's generator
    (client i, leaf 0: U from fold_in(split(key, n)[i], 0))."""
    x = np.asarray(x, np.float64)
    n = x.shape[0]
    levels = spec.levels_for(n)
    raw = jax.random.key_data(jax.random.split(key, n))
    u = np.stack([np.asarray(jax.random.uniform(sec.leaf_key(raw[i], 0), x.shape[1:],
                                                jnp.float32)) for i in range(n)])
    y = np.clip(x, -spec.clip, spec.clip) * np.float32(levels / spec.clip)
    y = y.astype(np.float32).astype(np.float64)
    q = np.floor(y) + (u < (y - np.floor(y)))
    assert np.all(np.abs(q) <= levels)
    modulus = 1 << spec.bits
    encoded = np.mod(q.astype(np.int64), modulus)  # two's complement mod 2^b
    total = encoded.sum(axis=0) % modulus
    signed = np.where(total >= modulus // 2, total - modulus, total)
    return encoded.astype(np.uint32), signed, signed * (spec.clip / levels)


@pytest.mark.parametrize("bits,levels", [(32, None), (16, 1000), (12, 100)])
def test_secure_sum_is_the_protocols_arithmetic(bits, levels):
    x = jax.random.normal(jax.random.key(0), (7, 300)) * 2.0
    spec = SecureSum(clip=3.0, bits=bits, levels=levels)
    key = jax.random.key(5)
    encoded, signed, expected = numpy_secure_sum(x, spec, key)
    raw = jax.random.key_data(jax.random.split(key, 7))
    # what each client sends (the networked client's function) is the reference's integers
    sent = np.stack([np.asarray(sec.encode_tree(x[i], raw[i], spec, 7)) for i in range(7)])
    np.testing.assert_array_equal(sent, encoded)
    total = fed.modular_sum(jnp.asarray(sent), bits)
    np.testing.assert_array_equal(np.asarray(total), np.mod(signed, 1 << bits))
    got = np.asarray(jax.jit(lambda v: fed.secure_sum(v, spec, key))(x))
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6 * spec.step(7))
    # within n·Δ of the sum of the clipped values (the quantization bound)
    exact = np.clip(np.asarray(x, np.float64), -3, 3).sum(0)
    assert np.max(np.abs(got - exact)) <= 7 * spec.step(7) * (1 + 1e-5)
    if bits < 32:
        assert np.max(np.abs(got - exact)) > 0.01 * spec.step(7)  # quantized, really


def test_modular_sum_wraps_around_like_numpy():
    q = np.random.default_rng(0).integers(0, 1 << 10, size=(9, 50)).astype(np.uint32)
    np.testing.assert_array_equal(np.asarray(fed.modular_sum(jnp.asarray(q), 10)),
                                  q.astype(np.int64).sum(0) % 1024)
    np.testing.assert_array_equal(sec.modular_sum_np(q, 10), q.astype(np.int64).sum(0) % 1024)
    with pytest.raises(TypeError, match="uint32"):
        fed.modular_sum(jnp.asarray(q, jnp.int32), 10)


def test_the_jvp_rules_make_symbolic_zero_tangents():
    """A JVP rule's zero tangent for an integer output is made with this JAX's API
    (``ad.Zero.from_primal_value`` is gone from JAX 0.10), eagerly and traced."""
    from jax.interpreters import ad

    from fedax.federated import _secure

    q = jnp.arange(12, dtype=jnp.uint32).reshape(3, 4)
    out, tangent = _secure._modular_sum_jvp((q,), (None,), bits=10)
    assert type(tangent) is ad.Zero and tangent.aval.shape == (4,)
    np.testing.assert_array_equal(out, np.asarray(q).sum(0))
    traced = []
    jax.jit(lambda q: traced.append(_secure._modular_sum_jvp((q,), (None,), bits=10)[1]))(q)
    assert type(traced[0]) is ad.Zero and traced[0].aval.shape == (4,)


def test_too_few_bits_for_the_cohort_is_one_line():
    spec = SecureSum(clip=1.0, bits=8, levels=20)
    with pytest.raises(ValueError, match=r"secure sum of 10 clients with 8 bits wraps.*"
                                         r"at least 9\)"):
        fed.secure_sum(jnp.ones((10, 3)), spec, jax.random.key(0))
    assert SecureSum(clip=1.0, bits=8).levels_for(10) == 12  # auto: 10·12 ≤ 127
    with pytest.raises(ValueError, match="bits must be a whole number in"):
        SecureSum(clip=1.0, bits=33)
    with pytest.raises(ValueError, match="clip range"):
        fed.secure_sum(jnp.ones((2, 3)), SecureSum(bits=8), jax.random.key(0))


def test_secure_sum_derivatives_are_placements():
    x = jax.random.normal(jax.random.key(1), (5, 20))
    spec = SecureSum(clip=4.0, bits=24)
    key = jax.random.key(2)
    ct = jax.random.normal(jax.random.key(3), (20,))
    _, vjp = jax.vjp(lambda v: fed.secure_sum(v, spec, key), x)
    np.testing.assert_allclose(vjp(ct)[0], np.broadcast_to(ct, (5, 20)))  # a broadcast
    t = jax.random.normal(jax.random.key(4), (5, 20))
    _, tangent = jax.jvp(lambda v: fed.secure_sum(v, spec, key), (x,), (t,))
    assert np.max(np.abs(np.asarray(tangent) - np.asarray(t).sum(0))) <= 5 * spec.step(5)
    table = fed.audit_table(jax.make_jaxpr(jax.grad(
        lambda p: jnp.sum(fed.secure_sum(fed.secure_broadcast(p, 5, spec, key) * x, spec,
                                         key) ** 2)))(jnp.ones(20)))
    assert table == {"secure": 1, "derivative secure": 1}


def test_secure_fedavg_round_equals_the_plain_round_within_the_bound():
    rng = np.random.default_rng(0)
    cohort = make_cohort(rng, dtype=np.float32)
    params = {"w": jnp.asarray(rng.normal(size=(4, K)) * 0.3, jnp.float32),
              "b": jnp.zeros(K, jnp.float32)}
    clip, max_weight = 2.0, 20.0
    plain = fedavg(loss_fn, optax.sgd(0.3))
    secure = fedavg(loss_fn, optax.sgd(0.3),
                    aggregator=agg.secure_mean(clip, max_weight, bits=20))
    key = jax.random.key(7)
    p_state, _ = plain.round(plain.init(params, key), cohort, key)
    s_state, metrics = jax.jit(secure.round)(secure.init(params, key), cohort, key)
    n = cohort.num_examples.shape[0]
    step = SecureSum(clip=clip, bits=20).step(n)
    assert float(metrics["secure_step"]) == pytest.approx(step)
    weight = float(np.sum(cohort.num_examples / max_weight))
    for name in params:
        new_p, new_s = np.asarray(p_state.server.params[name]), \
            np.asarray(s_state.server.params[name])
        mean = np.abs(new_p - np.asarray(params[name]))
        # Σ w̃Δ within nΔ, Σ w̃ within nΔ/c: the bound of their quotient
        bound = (n * step + mean * n * step / clip) / (weight - n * step / clip)
        assert np.all(np.abs(new_s - new_p) <= bound * 1.01 + 1e-6)
        assert np.max(np.abs(new_s - new_p)) > 0  # quantized, not the plain path


def _live(closed):
    """The jaxpr without what no output needs (as XLA compiles it: the rounds' unused
    training-loss metrics are plain sums that are never computed)."""
    from jax._src.interpreters import partial_eval as pe

    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    return jaxpr


@pytest.fixture
def rounds():
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        params = {"w": jnp.asarray(rng.normal(size=(4, K)) * 0.3), "b": jnp.zeros(K)}
        cohorts = jax.tree.map(lambda *a: np.stack(a), *[make_cohort(rng) for _ in range(2)])
        yield params, cohorts, make_cohort(rng)


def _make(secure: bool):
    spec = SecureSum(clip=8.0, bits=32)

    def make(h):
        aggregator = agg.secure_mean(spec.clip, 20.0) if secure else None
        return fedavg(loss_fn, optax.sgd(0.4), optax.sgd(h), aggregator=aggregator)

    evaluate = secure_loss(loss_fn, spec, 20.0) if secure else None
    return make, evaluate


@pytest.mark.parametrize("mode", ["reverse", pytest.param("forward", marks=pytest.mark.slow)])
def test_hypergradient_through_secure_rounds(rounds, mode):
    """Through two secure-aggregated FedAvg rounds and a secure holdout loss, the
    hypergradient in the server learning rate equals the plain one within the quantization
    error; every upload of the reverse derivative program is a secure sum, and the plain
    program's are not (the audit's negative)."""
    params, cohorts, holdout = rounds
    key = jax.random.key(3)
    with jax.enable_x64(True):
        h = jnp.float64(0.9)
        make, evaluate = _make(True)
        value, grad = jax.jit(lambda h: hypergradient(
            make, h, params, cohorts, holdout, loss_fn, mode=mode, key=key,
            evaluate=evaluate))(h)
        plain_make, _ = _make(False)
        p_value, p_grad = hypergradient(plain_make, h, params, cohorts, holdout, loss_fn,
                                        mode=mode, key=key)
        # every secure sum is within nΔ of its exact value per coordinate
        bound = 6 * SecureSum(clip=8.0, bits=32).step(6)
        np.testing.assert_allclose(value, p_value, rtol=0, atol=bound)
        np.testing.assert_allclose(grad, p_grad, rtol=0, atol=bound)
        assert abs(float(p_grad)) > 1e-3
        if mode == "reverse":
            program = jax.make_jaxpr(jax.grad(lambda h: hypergradient(
                make, h, params, cohorts, holdout, loss_fn, key=key,
                evaluate=evaluate)[0]))(h)
            derivative = [s for s in fed.audit_sums(program) if s.derivative]
            assert derivative and all(s.kind == "secure" for s in derivative)
            assert fed.unsecured_sums(program) == []
            plain = jax.make_jaxpr(jax.grad(lambda h: hypergradient(
                plain_make, h, params, cohorts, holdout, loss_fn, key=key)[0]))(h)
            assert fed.unsecured_sums(plain)  # the negative: plain sums are flagged
        else:
            def loss(g):
                return loss_after_rounds(make, g, params, cohorts, holdout, loss_fn, key,
                                         evaluate=evaluate)

            primal = _live(jax.make_jaxpr(loss)(h))
            program = _live(jax.make_jaxpr(lambda h: jax.jvp(loss, (h,), (jnp.ones_like(h),)))(h))
            before, after = fed.audit_table(primal), fed.audit_table(program)
            # the uploads that depend on η (the round's two model leaves, in the scanned
            # round's body, and the holdout loss) send their tangents up through secure
            # sums of their own; the weights do not depend on η; no plain upload is added
            assert after["secure"] == before["secure"] + 3
            assert before.get("plain", 0) == 0
            assert after.get("plain", 0) == before.get("plain", 0)
