"""The multinomial logistic-regression model against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedax.models import MODEL_NAMES, get_model, param_count, softmax_cross_entropy


def _random_params(rng, dim, classes):
    return {"dense": {"kernel": jnp.asarray(rng.normal(size=(dim, classes)), jnp.float32),
                      "bias": jnp.asarray(rng.normal(size=classes), jnp.float32)}}


def test_registered_with_zero_init_and_the_expected_size():
    assert "logistic" in MODEL_NAMES
    model = get_model("logistic")  # MNIST defaults: 784 -> 10
    params = model.init(jax.random.key(0))
    assert param_count(params) == 784 * 10 + 10
    assert all(not np.any(np.asarray(leaf)) for leaf in jax.tree.leaves(params))
    small = get_model("logistic", input_dim=60, num_classes=10).init(jax.random.key(1))
    assert small["dense"]["kernel"].shape == (60, 10) and small["dense"]["bias"].shape == (10,)


def test_apply_is_flatten_matmul_plus_bias():
    rng = np.random.default_rng(0)
    model = get_model("logistic", input_dim=12, num_classes=5)
    params = _random_params(rng, 12, 5)
    x = rng.normal(size=(7, 2, 3, 2)).astype(np.float32)  # 12 features, flattened
    want = x.reshape(7, 12).astype(np.float64) @ np.asarray(params["dense"]["kernel"],
                                                           np.float64)
    want += np.asarray(params["dense"]["bias"])
    np.testing.assert_allclose(np.asarray(model.apply(params, jnp.asarray(x))), want,
                               rtol=1e-5, atol=1e-5)


def test_cross_entropy_gradient_matches_the_numpy_formula():
    rng = np.random.default_rng(1)
    dim, classes, n = 6, 4, 9
    model = get_model("logistic", input_dim=dim, num_classes=classes)
    params = _random_params(rng, dim, classes)
    x = rng.normal(size=(n, dim)).astype(np.float32)
    y = rng.integers(0, classes, n).astype(np.int32)
    mask = np.ones(n, np.float32)
    mask[-2:] = 0.0  # masked examples count for nothing

    def loss(p):
        return softmax_cross_entropy(model.apply(p, jnp.asarray(x)), jnp.asarray(y),
                                     jnp.asarray(mask))

    value, grads = jax.value_and_grad(loss)(params)
    w, b = np.asarray(params["dense"]["kernel"], np.float64), np.asarray(params["dense"]["bias"])
    logits = x.astype(np.float64) @ w + b
    logp = logits - logits.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    real = mask.astype(bool)
    np.testing.assert_allclose(float(value), -logp[real, y[real]].mean(), rtol=1e-5)
    residual = np.exp(logp)
    residual[np.arange(n), y] -= 1.0
    residual *= mask[:, None] / mask.sum()
    np.testing.assert_allclose(np.asarray(grads["dense"]["kernel"]), x.T @ residual,
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grads["dense"]["bias"]), residual.sum(0),
                               rtol=1e-4, atol=1e-6)


def test_bad_shapes_and_sizes_are_errors():
    model = get_model("logistic", input_dim=60, num_classes=10)
    params = model.init(jax.random.key(0))
    with pytest.raises(ValueError, match="60 features"):
        model.apply(params, jnp.zeros((3, 784)))
    with pytest.raises(ValueError, match="input_dim"):
        get_model("logistic", input_dim=0)
    with pytest.raises(ValueError, match="num_classes"):
        get_model("logistic", num_classes=2.5)
