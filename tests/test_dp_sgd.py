"""Example-level DP-SGD local training (``fedax.client.dp_local_train``) against a NumPy
per-example clip-and-noise loop: softmax regression with hand-written per-example
gradients, the noise drawn here from the same JAX keys (the documented scheme), plus a
statistical test of the noise's distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax.client import (
    Batches,
    ByteCoded,
    dp_gradient,
    dp_local_train,
    local_train,
    steps_strategy,
)

D, K = 5, 3  # features, classes


def loss_fn(params, batch):
    logits = batch.x @ params["w"] + params["b"]
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, batch.y[:, None], axis=1)[:, 0]
    return jnp.sum(nll * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.normal(size=(D, K)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=K), jnp.float32)}


def make_batches(seed=1, steps=4, size=6, real_steps=3, last_real=4, scale=3.0):
    """``steps`` batches of ``size``; steps beyond ``real_steps`` are padding, the last real
    batch has ``last_real`` examples, and example 1 of step 0 is masked out too."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, size, D)).astype(np.float32) * scale
    y = rng.integers(0, K, size=(steps, size)).astype(np.int32)
    mask = np.zeros((steps, size), np.float32)
    mask[:real_steps] = 1.0
    mask[real_steps - 1, last_real:] = 0.0
    mask[0, 1] = 0.0
    return Batches(jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask))


def zip_leaves(a, b):
    return zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)


# ---- NumPy reference ---------------------------------------------------------------------


def np_example_grad(w, b, x, y):
    """Softmax regression on one example: (dL/dw, dL/db, L) with L = −log softmax(z)[y]."""
    z = x @ w + b
    p = np.exp(z - z.max())
    p /= p.sum()
    loss = -np.log(p[y])
    p[y] -= 1.0
    return np.outer(x, p), p, loss


def np_noise(key, step):
    """The documented noise of step ``step``: leaf j of the flattened params (b, then w)
    from ``split(fold_in(key, step), 2)[j]``."""
    kb, kw = jax.random.split(jax.random.fold_in(key, step), 2)
    return (np.asarray(jax.random.normal(kw, (D, K)), np.float64),
            np.asarray(jax.random.normal(kb, (K,)), np.float64))


def np_dp_train(params, batches, lr, clip, z, key):
    w = np.asarray(params["w"], np.float64)
    b = np.asarray(params["b"], np.float64)
    x, y, mask = (np.asarray(a) for a in batches)
    steps, size = mask.shape
    losses, clipped = [], 0
    for s in range(steps):
        if not mask[s].any():
            continue
        gw, gb, step_losses = np.zeros_like(w), np.zeros_like(b), []
        for i in range(size):
            if mask[s, i] == 0:
                continue
            ew, eb, loss = np_example_grad(w, b, x[s, i].astype(np.float64), y[s, i])
            norm = np.sqrt(np.sum(ew**2) + np.sum(eb**2))
            clipped += norm > clip
            factor = min(1.0, clip / norm)
            gw += factor * ew
            gb += factor * eb
            step_losses.append(loss)
        if z:
            nw, nb = np_noise(key, s)
            gw += z * clip * nw
            gb += z * clip * nb
        w = w - lr * gw / size  # the configured batch size, also for the partial batch
        b = b - lr * gb / size
        losses.append(np.mean(step_losses))
    return w, b, np.mean(losses), len(losses), clipped


@jax.jit
def _train(params, batches, key, clip, z, lr):
    return dp_local_train(loss_fn, params, batches, optax.sgd(lr), l2_clip=clip,
                          noise_multiplier=z, key=key)


@jax.jit
def _grad(batch, key, clip, z):
    return dp_gradient(loss_fn, make_params(), batch, l2_clip=clip, noise_multiplier=z,
                       key=key)


def run(batches, *, clip, z, key, lr=0.5):
    """SGD DP local training, compiled once per batch shape (C, z, lr traced)."""
    return _train(make_params(), batches, key, clip, z, lr)


@pytest.mark.parametrize("z", [0.0, 1.3])
def test_matches_numpy_per_example_clip_and_noise(z):
    batches, key = make_batches(), jax.random.key(7)
    clip = 1.0
    w, b, loss, steps, clipped = np_dp_train(make_params(), batches, 0.5, clip, z, key)
    assert 0 < clipped < int(np.sum(batches.mask))  # some examples clipped, some not
    out = run(batches, clip=clip, z=z, key=key)
    np.testing.assert_allclose(out.params["w"], w, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(out.params["b"], b, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(out.loss, loss, rtol=1e-5)
    assert int(out.num_steps) == steps == 3


def test_masked_examples_and_padding_steps_contribute_nothing():
    batches, key = make_batches(), jax.random.key(3)
    ref = run(batches, clip=1.0, z=0.8, key=key)
    rng = np.random.default_rng(9)
    junk = np.asarray(batches.mask) == 0  # masked examples and the padding step
    x = np.where(junk[..., None], rng.normal(size=batches.x.shape) * 100, batches.x)
    y = np.where(junk, rng.integers(0, K, size=batches.y.shape), batches.y)
    changed = Batches(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.int32), batches.mask)
    out = run(changed, clip=1.0, z=0.8, key=key)
    for a, b in zip_leaves(out, ref):
        np.testing.assert_array_equal(a, b)
    # More padding steps: the same update, bit for bit (keys fold the step position).
    pad = jax.tree.map(lambda a: jnp.concatenate([a, jnp.zeros_like(a[:3])]), changed)
    longer = run(pad, clip=1.0, z=0.8, key=key)
    for a, b in zip_leaves(longer, ref):
        np.testing.assert_array_equal(a, b)


def test_same_key_same_result_other_key_other_noise():
    batches = make_batches()
    a = run(batches, clip=1.0, z=1.0, key=jax.random.key(5))
    b = run(batches, clip=1.0, z=1.0, key=jax.random.key(5))
    c = run(batches, clip=1.0, z=1.0, key=jax.random.key(6))
    np.testing.assert_array_equal(a.params["w"], b.params["w"])
    assert not np.allclose(a.params["w"], c.params["w"])


def test_huge_clip_without_noise_is_local_train():
    batches = make_batches(last_real=6)  # full real batches: B is the real count
    batches = batches._replace(mask=batches.mask.at[0, 1].set(1.0))
    plain = jax.jit(lambda p, bt: local_train(loss_fn, p, bt, optax.sgd(0.5)))(
        make_params(), batches)
    dp = run(batches, clip=1e6, z=0.0, key=jax.random.key(0))
    for a, b in zip_leaves(dp, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_unroll_and_vmap_equal_scan_alone():
    """Two clients vmapped (the padding branch becomes a select) with the steps unrolled
    equal each client run alone with ``lax.scan``."""
    batches, other = make_batches(), make_batches(seed=2, real_steps=2, last_real=2)
    keys = [jax.random.key(11), jax.random.key(12)]
    alone = [run(batches, clip=1.0, z=1.0, key=keys[0]), run(other, clip=1.0, z=1.0,
                                                             key=keys[1])]
    both = jax.tree.map(lambda *a: jnp.stack(a), batches, other)
    f = jax.vmap(lambda bt, k: dp_local_train(loss_fn, make_params(), bt, optax.sgd(0.5),
                                              l2_clip=1.0, noise_multiplier=1.0, key=k))
    with steps_strategy("unroll"):
        out = jax.jit(f)(both, jnp.stack(keys))
    for i, single in enumerate(alone):
        for a, b in zip_leaves(out, single):
            np.testing.assert_allclose(a[i], b, rtol=1e-5, atol=1e-6)


def test_noise_is_gaussian_with_std_z_clip_over_batch_size():
    """dp_gradient(z) − dp_gradient(0) = z·C·n / B with n ~ N(0, I). Over 100 keys × 18
    coordinates, the standardized mean and the chi-square statistic (normal approximation)
    each stay within ±3.29: a false alarm probability of 1e-3 each, 2e-3 for the test
    (fixed seeds, so the outcome is reproducible)."""
    batch = jax.tree.map(lambda a: a[0], make_batches())
    z, clip, size = 1.7, 0.5, 6

    def flat(key, noise):
        g = _grad(batch, key, clip, noise)[1]
        return np.concatenate([g["b"], np.ravel(g["w"])]).astype(np.float64)

    exact = flat(jax.random.key(0), 0.0)
    n = np.stack([flat(k, z) - exact for k in jax.random.split(jax.random.key(2024), 100)])
    n *= size / (z * clip)
    count = n.size
    assert abs(n.mean() * np.sqrt(count)) < 3.29
    assert abs((np.sum(n**2) - count) / np.sqrt(2 * count)) < 3.29
    # Different keys, different draws.
    assert np.abs(np.corrcoef(n[0], n[1])[0, 1]) < 0.9


def test_dp_gradient_is_nan_safe_and_counts_only_real_examples():
    batch = jax.tree.map(lambda a: a[0], make_batches())
    key = jax.random.key(0)
    # A real example with a non-finite gradient counts as a zero gradient...
    loss, grad = _grad(batch._replace(x=batch.x.at[2].set(jnp.nan)), key, 1.0, 0.5)
    # ... and a masked one contributes nothing to the gradient nor to the mean loss.
    want_loss, want = _grad(batch._replace(mask=batch.mask.at[2].set(0.0)), key, 1.0, 0.5)
    for a, b in zip_leaves(grad, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    w, b = (np.asarray(make_params()[k], np.float64) for k in ("w", "b"))
    real = [i for i in range(6) if i not in (1, 2)]
    expect = np.mean([np_example_grad(w, b, np.float64(batch.x[i]), int(batch.y[i]))[2]
                      for i in real])
    np.testing.assert_allclose(want_loss, expect, rtol=1e-5)
    assert np.isnan(loss)  # the training loss is reported as is (not privatized)


def test_byte_coded_features_are_decoded_per_step():
    batches = make_batches()
    codes = jnp.asarray(np.random.default_rng(4).integers(0, 256, size=batches.x.shape),
                        jnp.uint8)
    key = jax.random.key(1)
    a = run(batches._replace(x=ByteCoded(codes)), clip=0.3, z=1.0, key=key)
    b = run(batches._replace(x=ByteCoded(codes).decode()), clip=0.3, z=1.0, key=key)
    for u, v in zip_leaves(a, b):
        np.testing.assert_array_equal(u, v)


def test_forward_and_reverse_derivatives_agree():
    """Plain JAX: derivatives of the DP gradient exist in both modes and are finite with
    padding examples in the batch (zero norms never reach sqrt)."""
    batch = jax.tree.map(lambda a: a[0], make_batches())  # example 1 is masked out
    rng = np.random.default_rng(5)
    u, v = ({k: jnp.asarray(rng.normal(size=x.shape), jnp.float32)
             for k, x in make_params().items()} for _ in range(2))

    def h(p):
        _, g = dp_gradient(loss_fn, p, batch, l2_clip=0.5, noise_multiplier=1.0,
                           key=jax.random.key(0))
        return sum(jnp.vdot(g[k], u[k]) for k in g)

    forward, reverse = jax.jit(lambda p: (jax.jvp(h, (p,), (v,))[1], jax.grad(h)(p)))(
        make_params())
    reverse = sum(jnp.vdot(reverse[k], v[k]) for k in v)
    assert np.isfinite(forward) and abs(float(forward)) > 1e-3
    np.testing.assert_allclose(forward, reverse, rtol=1e-4)


def test_invalid_settings():
    batches = make_batches()
    with pytest.raises(ValueError, match="l2_clip > 0"):
        dp_local_train(loss_fn, make_params(), batches, optax.sgd(0.1), l2_clip=0.0,
                       noise_multiplier=1.0, key=jax.random.key(0))
    with pytest.raises(ValueError, match="noise_multiplier >= 0"):
        dp_local_train(loss_fn, make_params(), batches, optax.sgd(0.1), l2_clip=1.0,
                       noise_multiplier=-1.0, key=jax.random.key(0))
