"""Private hypergradients (``fedax.hyper.private`` and the private sums, primitives and audit
it builds on): the derivative program of a DP round releases only clipped and noised sums.

* on the jaxpr, every federated sum in the derivative program is private (operand from the
  clip primitive, result only into the noise primitive), and the same check fails for the
  plain hypergradient; the wrapped program releases no unprivatized sum beyond the round's;
* the private backward, value and tangent against NumPy clip-sum + the same key's noise;
* with huge clips and z = 0 the private hypergradient is the plain one;
* ε with and without the learned server learning rate.
"""

import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_accounting import rdp

from fedax import federated as fed
from fedax.aggregators import dp_gaussian
from fedax.algorithms import CohortBatches, fedavg, federated_loss, server_optimizer
from fedax.algorithms.base import client_mean_loss
from fedax.client import Batches
from fedax.hyper import HyperCohort, learned_server_lr_in_state
from fedax.hyper.audit import audit_sums, unprivatized_sums
from fedax.hyper.dp_primitives import dp_clip
from fedax.hyper.private import (
    HoldoutPrivacy,
    extra_releases_per_round,
    private_federated_loss,
    private_learned_server_lr,
)
from fedax.hyper.private_sums import private_broadcast, private_sum, with_private_payload
from fedax.privacy import epsilon

D, K, C, S, B = 3, 2, 4, 2, 3  # features, classes, clients, local steps, batch
HUGE = 1e9


def loss_fn(params, batch):
    logits = batch.x @ params["w"] + params["b"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch.y[:, None], axis=1)[:, 0]
    return jnp.sum(nll * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)


def make_cohort(rng):
    x = rng.normal(size=(C, S, B, D)).astype(np.float32)
    y = rng.integers(0, K, size=(C, S, B)).astype(np.int32)
    mask = np.ones((C, S, B), np.float32)  # equal n_k: the weighted mean is the plain mean
    return CohortBatches(Batches(x, y, mask), mask.sum(axis=(1, 2)), np.arange(C, dtype=np.int32))


def dp_fedavg(z, lr=1.0):
    return fedavg(loss_fn, optax.sgd(0.5), server_optimizer("sgd", lr=lr),
                  aggregator=dp_gaussian(1.0, z, C))


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(D, K)) * 0.3, jnp.float32),
              "b": jnp.zeros(K, jnp.float32)}
    return params, HyperCohort(make_cohort(rng), make_cohort(rng)), make_cohort(rng)


def shapes(sums):
    return sorted(s.shape for s in sums)


def round_jaxpr(wrapper, params, cohort):
    state = wrapper.init(params, jax.random.key(0))
    return jax.make_jaxpr(wrapper.round)(state, cohort, jax.random.key(1))


def np_clip_sum(values, clip):
    """Σ_k v_k · min(1, clip/‖v_k‖) over clients, the norm over every leaf."""
    leaves = [np.asarray(v, np.float64) for v in values]
    norms = np.sqrt(sum((leaf.reshape(leaf.shape[0], -1) ** 2).sum(axis=1) for leaf in leaves))
    factor = np.minimum(1.0, clip / norms)
    return [(leaf * factor.reshape((-1,) + (1,) * (leaf.ndim - 1))).sum(axis=0)
            for leaf in leaves]


def jax_noise(key, shapes_, stddev):
    """The noise a release draws from ``key``: one split per leaf, as dp_gaussian does."""
    keys = jax.random.split(key, len(shapes_))
    return [np.asarray(jax.random.normal(k, s, jnp.float32), np.float64) * stddev
            for k, s in zip(keys, shapes_, strict=True)]


# ------------------------------------------------------------------ (a) the jaxpr audit


def test_reverse_derivative_program_sums_are_private(data):
    """Reverse mode, one DP FedAvg round, hypergradient in the server learning rate: the
    derivative program holds one sum per model leaf, the holdout's transposed broadcast
    (the train cohort is not in the backward pass), and each is clipped and noised with
    z; the plain hypergradient has the same sums unprivatized, so the check fails there."""
    params, cohort, _ = data
    alg = dp_fedavg(z=1.0)
    privacy = HoldoutPrivacy(0.8, C, grad_clip=1.0, loss_clip=5.0)
    private = round_jaxpr(private_learned_server_lr(alg, 1.0, loss_fn, privacy), params, cohort)
    plain = round_jaxpr(learned_server_lr_in_state(alg, 1.0, loss_fn, mode="reverse"), params,
                        cohort)
    model = [(C, K), (C, D, K)]

    derivative = [s for s in audit_sums(private) if s.derivative]
    assert shapes(derivative) == model
    assert all(s.private and s.noise_multiplier == pytest.approx(0.8) for s in derivative)
    assert unprivatized_sums(private) == []

    assert shapes(s for s in audit_sums(plain) if s.derivative) == model
    assert shapes(unprivatized_sums(plain)) == model  # the negative: the check fails


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_wrapper_releases_nothing_unprivatized_beyond_the_round(data, mode):
    """The whole program of a private learned-server-lr round (forward pass, holdout, the
    derivative) has exactly the unprivatized sums of the DP round itself (its metrics);
    dp_gaussian's own sum (clip and noise are the audit's primitives) and every holdout
    sum, value and derivative, are private. The plain wrapper adds unprivatized holdout
    sums."""
    params, cohort, _ = data
    alg = dp_fedavg(z=1.0)
    state = alg.init(params, jax.random.key(0))
    inner = jax.make_jaxpr(alg.round)(state, cohort.train, jax.random.key(1))
    round_only = shapes(unprivatized_sums(inner, derivative_only=False))
    privacy = HoldoutPrivacy(1.0, C, grad_clip=1.0, tangent_clip=0.5, loss_clip=5.0)
    private = round_jaxpr(private_learned_server_lr(alg, 1.0, loss_fn, privacy, mode=mode),
                          params, cohort)
    assert shapes(unprivatized_sums(private, derivative_only=False)) == round_only
    released = [s for s in audit_sums(private) if s.private]
    # the round's DP sum (two leaves), then the holdout's: reverse: the loss value and the
    # gradient (two leaves); forward: value and tangent
    expected = [(C,), (C, K), (C, D, K)] if mode == "reverse" else [(C,), (C,)]
    assert sorted(shapes(released)) == sorted([(C, K), (C, D, K)] + expected)
    assert [s.kind for s in audit_sums(inner) if s.shape in ((C, K), (C, D, K))] == ["dp"] * 2
    plain = round_jaxpr(learned_server_lr_in_state(alg, 1.0, loss_fn, mode=mode), params, cohort)
    assert len(unprivatized_sums(plain, derivative_only=False)) > len(round_only)


def test_forward_mode_tangent_sums_are_private(data):
    """The jvp of the holdout loss: with ``mode="forward"`` every sum (value, tangent) is
    private; the plain federated loss's jvp sums the clients' tangents in the clear."""
    params, _, holdout = data
    privacy = HoldoutPrivacy(1.0, C, tangent_clip=0.5, loss_clip=5.0)
    direction = jax.tree.map(jnp.ones_like, params)
    key = jax.random.key(2)

    def private(p):
        return jax.jvp(lambda q: private_federated_loss(loss_fn, q, holdout, privacy, key,
                                                        mode="forward"), (p,), (direction,))

    def plain(p):
        return jax.jvp(lambda q: federated_loss(loss_fn, q, holdout), (p,), (direction,))

    assert audit_sums(jax.make_jaxpr(private)(params))
    assert unprivatized_sums(jax.make_jaxpr(private)(params), derivative_only=False) == []
    assert unprivatized_sums(jax.make_jaxpr(plain)(params), derivative_only=False)


def test_several_rounds_need_the_private_payload(data):
    """Reverse mode through two DP rounds: the cotangent of x_1 reaches round 2's train
    clients. With a private holdout only, that transposed payload broadcast is an
    unprivatized sum; ``with_private_payload`` makes it private. At huge clips and z = 0
    both give the plain hypergradient."""
    params, cohort, holdout = data
    cohorts = [cohort.train, cohort.holdout]
    keys = jax.random.split(jax.random.key(5), 3)

    def loss(log_lr, privacy, payload):
        alg = dp_fedavg(z=privacy.noise_multiplier, lr=jnp.exp(log_lr))
        if payload:
            alg = with_private_payload(alg, clip=privacy.grad_clip,
                                       noise_multiplier=privacy.noise_multiplier)
        state = alg.init(params, None)
        for t in range(2):  # a fresh key per round
            state, _ = alg.round(state, cohorts[t], keys[t])
        return private_federated_loss(loss_fn, alg.server_params(state), holdout, privacy,
                                      keys[2])

    private = HoldoutPrivacy(1.0, C, grad_clip=1.0, loss_clip=5.0)
    lr = jnp.float32(0.0)
    with_payload = jax.make_jaxpr(jax.grad(lambda u: loss(u, private, True)))(lr)
    without = jax.make_jaxpr(jax.grad(lambda u: loss(u, private, False)))(lr)
    model = [(C, K), (C, D, K)]
    assert unprivatized_sums(with_payload) == []
    assert shapes(s for s in audit_sums(with_payload) if s.derivative) == sorted(model * 2)
    assert shapes(unprivatized_sums(without)) == model

    open_ = HoldoutPrivacy(0.0, C, grad_clip=HUGE, loss_clip=HUGE)

    def plain(log_lr):
        alg = dp_fedavg(z=0.0, lr=jnp.exp(log_lr))
        state = alg.init(params, None)
        for t in range(2):
            state, _ = alg.round(state, cohorts[t], keys[t])
        return federated_loss(loss_fn, alg.server_params(state), holdout)

    expected = jax.jit(jax.grad(plain))(lr)
    got = jax.jit(jax.grad(lambda u: loss(u, open_, True)))(lr)
    np.testing.assert_allclose(got, expected, rtol=2e-5)
    assert abs(float(expected)) > 1e-4


# ------------------------------------------------------------ (b) against NumPy


def test_private_broadcast_backward_is_numpy_clip_sum_noise():
    rng = np.random.default_rng(1)
    n, clip, z = 5, 1.5, 0.7
    ct = {"a": (rng.normal(size=(n, 3, 2)) * 2).astype(np.float32),
          "b": (rng.normal(size=(n, 4)) * 2).astype(np.float32)}
    ct["a"][0] *= 0.01  # client 0 is below the clip, the others above
    ct["b"][0] *= 0.01
    x = {"a": jnp.zeros((3, 2)), "b": jnp.zeros(4)}
    key = jax.random.key(11)
    y, vjp = jax.vjp(lambda v: private_broadcast(v, n, clip=clip, noise_multiplier=z, key=key),
                     x)
    jax.tree.map(np.testing.assert_array_equal, y, fed.broadcast(x, n))
    (got,) = jax.jit(vjp)(ct)
    leaves = [ct["a"], ct["b"]]
    norms = np.sqrt(sum((v.reshape(n, -1).astype(np.float64) ** 2).sum(1) for v in leaves))
    assert norms[0] < clip < norms[1:].min()
    expected = [s + e for s, e in zip(np_clip_sum(leaves, clip),
                                      jax_noise(key, [(3, 2), (4,)], z * clip), strict=True)]
    np.testing.assert_allclose(got["a"], expected[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["b"], expected[1], rtol=1e-5, atol=1e-6)
    # and private_sum is the same release, forward
    again = private_sum(ct, clip=clip, noise_multiplier=z, key=key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), again,
                 got)


def test_non_finite_client_counts_for_nothing():
    values = np.ones((3, 2), np.float32)
    values[1, 0] = np.nan
    np.testing.assert_array_equal(dp_clip(values, 10.0), [[1, 1], [0, 0], [1, 1]])


def test_noise_has_stddev_z_clip():
    """The noise of a release of zeros: mean 0 and standard deviation z·clip (chi-square
    and z tests on 20000 coordinates, each at false-alarm rate 5.7e-7)."""
    z, clip, d = 0.6, 2.5, 20000
    noise = np.asarray(private_sum(jnp.zeros((3, d)), clip=clip, noise_multiplier=z,
                                   key=jax.random.key(4)), np.float64)
    std = z * clip
    dof = noise.size
    mu = 1 - 2 / (9 * dof)
    chi = ((np.sum(noise ** 2) / std ** 2 / dof) ** (1 / 3) - mu) / math.sqrt(2 / (9 * dof))
    assert abs(chi) < 5 and abs(noise.mean() / (std / math.sqrt(dof))) < 5


def test_private_holdout_loss_value_gradient_and_tangent_against_numpy(data):
    """The holdout loss's released value, reverse-mode gradient and forward-mode tangent
    are (Σ_k clip(·_k) + noise(z·clip)) / D_H of the per-client values, each noise from
    its own key (the loss's key split in two: value, derivative)."""
    params, _, holdout = data
    z, denom = 0.9, 3.0
    key = jax.random.key(8)
    value_key, derivative_key = jax.random.split(key)
    per_client, grads = jax.jit(jax.vmap(jax.value_and_grad(
        lambda p, b: client_mean_loss(loss_fn, p, b)), in_axes=(None, 0)))(params,
                                                                           holdout.batches)
    losses = np.asarray(per_client, np.float64)

    # every loss above loss_clip: the value is C·loss_clip + noise, the gradient only noise
    assert losses.min() > 0.6
    clipped = HoldoutPrivacy(z, denom, grad_clip=0.3, loss_clip=0.6)
    value, grad = jax.jit(jax.value_and_grad(
        lambda p: private_federated_loss(loss_fn, p, holdout, clipped, key)))(params)
    np.testing.assert_allclose(value, (C * 0.6 + jax_noise(value_key, [()], z * 0.6)[0]) / denom,
                               rtol=1e-5)
    noise = jax_noise(derivative_key, [(K,), (D, K)], z * 0.3)
    np.testing.assert_allclose(grad["w"], noise[1] / denom, rtol=1e-5, atol=1e-7)

    privacy = HoldoutPrivacy(z, denom, grad_clip=0.3, tangent_clip=1.5, loss_clip=HUGE)
    value, grad = jax.jit(jax.value_and_grad(
        lambda p: private_federated_loss(loss_fn, p, holdout, privacy, key)))(params)
    expected_value = (np_clip_sum([losses[:, None]], HUGE)[0][0]
                      + jax_noise(value_key, [()], z * HUGE)[0]) / denom
    np.testing.assert_allclose(value, expected_value, rtol=1e-4)
    g = [np.asarray(grads["b"]), np.asarray(grads["w"])]  # leaf order: b, w
    expected = [(s + e) / denom for s, e in zip(
        np_clip_sum(g, 0.3), jax_noise(derivative_key, [(K,), (D, K)], z * 0.3), strict=True)]
    np.testing.assert_allclose(grad["b"], expected[0], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grad["w"], expected[1], rtol=1e-4, atol=1e-6)

    rng = np.random.default_rng(3)
    direction = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype), params)
    _, tangent = jax.jit(lambda p: jax.jvp(
        lambda q: private_federated_loss(loss_fn, q, holdout, privacy, key, mode="forward"),
        (p,), (direction,)))(params)
    dots = sum((np.asarray(grads[k]) * np.asarray(direction[k])).reshape(C, -1).sum(1)
               for k in grads)
    assert np.abs(dots).min() < 1.5 < np.abs(dots).max()  # some clipped, some not
    expected_t = (np_clip_sum([dots[:, None]], 1.5)[0][0]
                  + jax_noise(derivative_key, [()], z * 1.5)[0]) / denom
    np.testing.assert_allclose(tangent, expected_t, rtol=1e-4, atol=1e-7)


def test_loss_not_released_sends_nothing_for_the_value(data):
    params, _, holdout = data
    privacy = HoldoutPrivacy(1.0, C, grad_clip=1.0, loss_clip=None, release_loss=False)
    f = jax.value_and_grad(lambda p: private_federated_loss(loss_fn, p, holdout, privacy,
                                                            jax.random.key(0)))
    sums = audit_sums(jax.make_jaxpr(f)(params))
    assert shapes(sums) == [(C, K), (C, D, K)] and all(s.private and s.derivative for s in sums)
    value, _ = f(params)
    assert float(value) == 0.0


# ---------------------------------------------- (c) huge clips, z = 0: the plain one


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_open_private_hypergradient_is_the_plain_one(data, mode):
    params, cohort, _ = data
    alg = dp_fedavg(z=0.0, lr=0.8)
    sgd = optax.sgd(1.0)  # the hyper step is −g: compares the hypergradients themselves
    open_ = HoldoutPrivacy(0.0, C, grad_clip=HUGE, tangent_clip=HUGE, loss_clip=HUGE)
    private = private_learned_server_lr(alg, 0.8, loss_fn, open_, sgd, mode=mode)
    plain = learned_server_lr_in_state(alg, 0.8, loss_fn, sgd, mode=mode)
    key = jax.random.key(3)
    s1, m1 = jax.jit(private.round)(private.init(params, key), cohort, key)
    s2, m2 = jax.jit(plain.round)(plain.init(params, key), cohort, key)
    np.testing.assert_allclose(s1.hparams, s2.hparams, rtol=1e-5)
    np.testing.assert_allclose(m1["hypergradient_norm"], m2["hypergradient_norm"], rtol=1e-4)
    np.testing.assert_allclose(m1["holdout_loss"], m2["holdout_loss"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5),
                 private.server_params(s1), plain.server_params(s2))
    assert abs(float(m2["hypergradient_norm"])) > 1e-3


# ------------------------------------------------------------------------ (d) epsilon


def test_epsilon_with_and_without_the_learned_server_lr():
    q, z, rounds, delta = 0.1, 1.0, 100, 1e-5
    without = epsilon(z, q, rounds, delta)
    k = {mode: extra_releases_per_round(mode) for mode in ("reverse", "forward")}
    assert k == {"reverse": 2, "forward": 2}
    assert extra_releases_per_round("reverse", release_loss=False) == 1
    with_lr = epsilon(z, q, rounds, delta, extra_releases_per_round=k["reverse"])
    gradient_only = epsilon(z, q, rounds, delta, extra_releases_per_round=1)
    assert without < gradient_only < with_lr
    # three Gaussian releases of multiplier z on one sample are one of z/√3
    assert with_lr == pytest.approx(epsilon(z / math.sqrt(3), q, rounds, delta), rel=1e-9)
    # the holdout is its own sample: accounted separately (same q) it costs no more
    for extra, same_sample in ((1, gradient_only), (2, with_lr)):
        holdout = dp_accounting.GaussianDpEvent(z / math.sqrt(extra))
        event = dp_accounting.SelfComposedDpEvent(dp_accounting.ComposedDpEvent([
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)),
            dp_accounting.PoissonSampledDpEvent(q, holdout)]), rounds)
        accountant = rdp.RdpAccountant()
        accountant.compose(event)
        separate = accountant.get_epsilon(delta)
        assert without < separate <= same_sample
    print(f"\nq={q} z={z} T={rounds} delta={delta}: eps without {without:.3f}, "
          f"with learned server lr (gradient + loss, k=2) {with_lr:.3f}, "
          f"gradient only (k=1) {gradient_only:.3f}")


# ---------------------------------------------------------------------------- the API


def test_releases_and_validation():
    assert extra_releases_per_round("forward", hyperparameters=3) == 4
    assert extra_releases_per_round("forward", hyperparameters=3, release_loss=False) == 3
    assert extra_releases_per_round("reverse", private_payload=True) == 3
    with pytest.raises(ValueError, match="forward mode cannot privatize"):
        extra_releases_per_round("forward", private_payload=True)
    with pytest.raises(ValueError, match="mode"):
        extra_releases_per_round("backward")
    with pytest.raises(ValueError, match="loss_clip"):
        HoldoutPrivacy(1.0, 10.0, grad_clip=1.0)
    with pytest.raises(ValueError, match="tangent_clip"):
        HoldoutPrivacy(1.0, 10.0, grad_clip=1.0, loss_clip=1.0).check("forward")
    with pytest.raises(ValueError, match="denominator"):
        HoldoutPrivacy(1.0, 0.0, loss_clip=1.0)
    with pytest.raises(ValueError, match="needs a key"):
        private_broadcast(jnp.zeros(2), 3, clip=1.0, noise_multiplier=1.0, key=None)
    with pytest.raises(TypeError, match="float values"):
        private_broadcast(jnp.zeros(2, jnp.int32), 3, clip=1.0, noise_multiplier=0.0, key=None)
    with pytest.raises(ValueError, match="clip"):
        private_sum(jnp.zeros((3, 2)), clip=0.0, noise_multiplier=1.0, key=jax.random.key(0))
