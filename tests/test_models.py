"""Tests for fedax.models: parameter counts, shapes, conv impls, losses, registry."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedax.models import (
    MODEL_NAMES,
    accuracy,
    cnn,
    conv2d,
    get_model,
    max_pool_2x2,
    mlp_2nn,
    param_count,
    per_example_cross_entropy,
    softmax_cross_entropy,
)


def _images(batch, seed=1):
    return jax.random.uniform(jax.random.key(seed), (batch, 28, 28, 1), jnp.float32)


def _np_conv_same(x, w):
    """Direct-loop reference: stride-1 cross-correlation with TF/XLA 'SAME' padding."""
    b, h, wd, c_in = x.shape
    kh, kw, _, c_out = w.shape
    top, left = (kh - 1) // 2, (kw - 1) // 2
    out = np.zeros((b, h, wd, c_out), np.float64)
    for n, i, j, o in itertools.product(range(b), range(h), range(wd), range(c_out)):
        acc = 0.0
        for di, dj, c in itertools.product(range(kh), range(kw), range(c_in)):
            r, s = i + di - top, j + dj - left
            if 0 <= r < h and 0 <= s < wd:
                acc += x[n, r, s, c] * w[di, dj, c, o]
        out[n, i, j, o] = acc
    return out


@pytest.mark.parametrize(
    ("model", "expected"), [(mlp_2nn(), 199_210), (cnn(), 1_663_370), (cnn("patches"), 1_663_370)]
)
def test_param_counts_match_paper(model, expected):
    params = model.init(jax.random.key(0))
    assert param_count(params) == expected
    leaves = jax.tree_util.tree_leaves(params)
    assert all(leaf.dtype == jnp.float32 for leaf in leaves)
    assert isinstance(params, dict) and all(isinstance(v, dict) for v in params.values())


@pytest.mark.parametrize("name", ["2nn", "cnn"])
def test_output_shapes_and_flat_inputs(name):
    model = get_model(name)
    params = model.init(jax.random.key(0))
    x = _images(3)
    logits = model.apply(params, x)
    assert logits.shape == (3, 10) and logits.dtype == jnp.float32
    np.testing.assert_allclose(model.apply(params, x.reshape(3, 784)), logits, rtol=1e-6)


def test_bad_input_shape_is_a_clear_error():
    model = mlp_2nn()
    with pytest.raises(ValueError, match=r"\[B, 28, 28, 1\]"):
        model.apply(model.init(jax.random.key(0)), jnp.zeros((2, 32, 32, 1)))


@pytest.mark.parametrize("name", ["2nn", "cnn"])
def test_init_is_deterministic_in_the_key(name):
    model = get_model(name)
    a, b, c = (model.init(jax.random.key(k)) for k in (7, 7, 8))
    jax.tree.map(np.testing.assert_array_equal, a, b)
    assert not np.array_equal(a["dense1"]["kernel"], c["dense1"]["kernel"])


def test_init_is_glorot_uniform_with_zero_biases():
    params = cnn().init(jax.random.key(0))
    for name, p in params.items():
        w = np.asarray(p["kernel"])
        receptive = int(np.prod(w.shape[:-2]))
        limit = np.sqrt(6 / (receptive * (w.shape[-2] + w.shape[-1])))
        assert np.abs(w).max() <= limit, name
        # U(-a, a) has std a / sqrt(3); conv1 has only 800 weights, hence the loose bound.
        np.testing.assert_allclose(w.std(), limit / np.sqrt(3), rtol=0.1, err_msg=name)
        assert not np.any(p["bias"]), name


@pytest.mark.parametrize("kernel_hw", [(5, 5), (4, 4), (3, 2)])
@pytest.mark.parametrize("impl", ["lax", "patches", "lax_vjp"])
def test_conv2d_matches_numpy_loops(impl, kernel_hw):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 6, 6, 2)).astype(np.float32)
    w = rng.normal(size=(*kernel_hw, 2, 3)).astype(np.float32)
    got = conv2d(jnp.asarray(x), jnp.asarray(w), impl)
    np.testing.assert_allclose(got, _np_conv_same(x, w), rtol=1e-5, atol=1e-5)


def test_conv2d_rejects_unknown_impl():
    with pytest.raises(ValueError, match="lax, patches, lax_vjp"):
        conv2d(jnp.zeros((1, 4, 4, 1)), jnp.zeros((3, 3, 1, 1)), "fft")
    with pytest.raises(ValueError, match="lax, patches, lax_vjp"):
        cnn(conv_impl="fft")


def test_max_pool_matches_numpy():
    x = np.random.default_rng(0).normal(size=(2, 5, 4, 3)).astype(np.float32)
    expected = np.zeros((2, 2, 2, 3), np.float32)
    for n, i, j, c in itertools.product(range(2), range(2), range(2), range(3)):
        expected[n, i, j, c] = x[n, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2, c].max()
    np.testing.assert_array_equal(max_pool_2x2(jnp.asarray(x)), expected)


def test_cnn_auto_on_cpu_is_patches_then_lax_vjp():
    """On CPU the default CNN computes its one-channel first convolution as one patches
    product and only the second as a (custom-VJP) convolution."""
    assert jax.default_backend() == "cpu"
    params = cnn().init(jax.random.key(0))
    text = str(jax.make_jaxpr(cnn().apply)(params, _images(2)))
    assert text.count("conv_general_dilated") == 1  # conv2's forward only
    assert "custom_vjp_call" in text
    assert "concatenate" in text  # conv1's 25 shifted windows


def test_cnn_conv_impls_agree_values_and_gradients():
    params = cnn().init(jax.random.key(0))
    x = _images(2)

    def run(impl):
        def loss(p, x):
            logits = cnn(impl).apply(p, x)
            return jnp.sum(jnp.sin(logits)), logits

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)

    (_, logits_lax), grads_lax = run("lax")
    for impl in ("patches", "lax_vjp", "auto"):
        (_, logits), grads = run(impl)
        np.testing.assert_allclose(logits_lax, logits, rtol=1e-5, atol=1e-6)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads_lax, grads
        )
    assert all(np.any(g) for g in jax.tree_util.tree_leaves(grads_lax))


def test_jit_matches_eager():
    model = mlp_2nn()
    params = model.init(jax.random.key(0))
    x = _images(4)
    np.testing.assert_allclose(jax.jit(model.apply)(params, x), model.apply(params, x), rtol=1e-6)


def _np_cross_entropy(logits, labels, mask):
    z = logits - logits.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    per_example = -logp[np.arange(len(labels)), labels]
    return per_example, (mask * per_example).sum() / max(mask.sum(), 1.0)


def test_cross_entropy_matches_numpy_with_mask():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 10)).astype(np.float32) * 3
    labels = rng.integers(0, 10, size=6)
    mask = np.array([1, 1, 0, 1, 0, 1], np.float32)
    per_example, expected = _np_cross_entropy(logits, labels, mask)
    np.testing.assert_allclose(per_example_cross_entropy(logits, labels), per_example, rtol=1e-5)
    np.testing.assert_allclose(softmax_cross_entropy(logits, labels, mask), expected, rtol=1e-5)
    np.testing.assert_allclose(
        softmax_cross_entropy(logits, labels, mask.astype(bool)), expected, rtol=1e-5
    )
    np.testing.assert_allclose(softmax_cross_entropy(logits, labels), per_example.mean(), rtol=1e-5)


def test_all_zero_mask_gives_zero_loss_and_zero_gradient():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 10)), jnp.float32)
    labels = jnp.array([0, 3, 9, 1])
    mask = jnp.zeros(4)
    loss, grad = jax.jit(jax.value_and_grad(softmax_cross_entropy))(logits, labels, mask)
    assert float(loss) == 0.0
    assert np.all(np.isfinite(grad)) and not np.any(grad)
    assert float(accuracy(logits, labels, mask)) == 0.0


def test_masked_out_gradients_are_zero():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(3, 10)), jnp.float32)
    grad = jax.jit(jax.grad(softmax_cross_entropy))(
        logits, jnp.array([1, 2, 3]), jnp.array([1.0, 0, 1])
    )
    assert not np.any(grad[1]) and np.any(grad[0]) and np.any(grad[2])


def test_accuracy_with_mask():
    logits = jnp.eye(10)[jnp.array([0, 1, 2, 3])]
    labels = jnp.array([0, 1, 5, 5])
    assert float(accuracy(logits, labels)) == pytest.approx(0.5)
    assert float(accuracy(logits, labels, jnp.array([1, 1, 1, 0]))) == pytest.approx(2 / 3)
    assert float(accuracy(logits, labels, jnp.array([0, 0, 1, 1]))) == 0.0


def test_registry():
    assert MODEL_NAMES == ("2nn", "cnn", "logistic", "char_lstm")
    params = get_model("cnn", conv_impl="patches").init(jax.random.key(0))
    assert param_count(params) == 1_663_370
    with pytest.raises(ValueError, match="'resnet'.*2nn, cnn"):
        get_model("resnet")


@pytest.mark.parametrize("kernel_hw", [(5, 5), (4, 3)])
def test_lax_vjp_gradients_match_finite_differences(kernel_hw):
    """The hand-written reverse rule of conv2d(impl="lax_vjp") against central finite
    differences in float64 NumPy of the NumPy convolution (odd and even kernels)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1, 4, 3, 2))
    w = rng.normal(size=(*kernel_hw, 2, 2))
    g = rng.normal(size=(1, 4, 3, 2))
    dx, dw = jax.vjp(lambda a, b: conv2d(a, b, "lax_vjp"), jnp.asarray(x, jnp.float32),
                     jnp.asarray(w, jnp.float32))[1](jnp.asarray(g, jnp.float32))

    def f(x_, w_):
        return float(np.sum(_np_conv_same(x_, w_) * g))

    def numeric(arr, other, wrt_x):
        out, eps = np.zeros_like(arr), 1e-4
        for i in np.ndindex(arr.shape):
            plus, minus = arr.copy(), arr.copy()
            plus[i] += eps
            minus[i] -= eps
            args = ((plus, other), (minus, other)) if wrt_x else ((other, plus), (other, minus))
            out[i] = (f(*args[0]) - f(*args[1])) / (2 * eps)
        return out

    np.testing.assert_allclose(dx, numeric(x, w, True), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(dw, numeric(w, x, False), rtol=1e-3, atol=1e-3)
