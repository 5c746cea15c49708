"""Mixed precision (``fedax.models.precision``): float32 is untouched; bfloat16 computes in
bfloat16 and keeps float32 parameters, logits, gradients and updates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedax.models import char_lstm, mixed_precision, mlp_2nn, softmax_cross_entropy, with_precision
from fedax.models.losses import token_cross_entropy
from fedax.spec.config import ConfigError, validate_config


def test_float32_is_the_model_itself():
    model = mlp_2nn()
    assert with_precision(model, "float32") is model
    with pytest.raises(ValueError, match="precision must be one of"):
        with_precision(model, "float16")


def _rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def test_bfloat16_2nn_close_to_float32_with_float32_weights_and_gradients():
    model = mlp_2nn()
    mixed = mixed_precision(model)
    params = model.init(jax.random.key(0))
    x = jax.random.uniform(jax.random.key(1), (16, 28, 28, 1))
    y = jax.random.randint(jax.random.key(2), (16,), 0, 10)
    logits = jax.jit(mixed.apply)(params, x)
    assert logits.dtype == jnp.float32
    reference = jax.jit(model.apply)(params, x)
    assert 0 < _rel(logits, reference) < 2e-2  # bfloat16 rounding: not exact, but close

    # The bf16 product really ran: its rounding differs from float32's.
    def loss(m):
        return lambda p: softmax_cross_entropy(m.apply(p, x), y)

    grads = jax.jit(jax.grad(loss(mixed)))(params)
    expected = jax.jit(jax.grad(loss(model)))(params)
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        assert g.dtype == jnp.float32
        assert _rel(g, e) < 0.1  # ~5% measured: bf16 activations and products
    stepped = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(stepped))


def test_bfloat16_lstm_takes_int_ids_and_tracks_float32():
    model = char_lstm(11, embed_dim=4, hidden=8)
    params = jax.jit(model.init)(jax.random.key(0))
    x = jax.random.randint(jax.random.key(1), (3, 7), 0, 11)
    y = jax.random.randint(jax.random.key(2), (3, 7), 1, 11)
    mixed = mixed_precision(model)
    got, expected = jax.jit(mixed.apply)(params, x), jax.jit(model.apply)(params, x)
    np.testing.assert_allclose(got, expected, atol=3e-2)
    np.testing.assert_allclose(token_cross_entropy(got, y), token_cross_entropy(expected, y),
                               rtol=1e-2)


def test_config_key():
    base = {"seed": 0, "rounds": 1, "model": "2nn", "algorithm": "fedavg", "partition": "iid",
            "client_fraction": 0.1,
            "local_epochs": 1, "batch_size": 10, "client_lr": 0.1}
    assert validate_config(base).precision == "float32"
    assert validate_config({**base, "precision": "bfloat16"}).precision == "bfloat16"
    with pytest.raises(ConfigError, match="precision"):
        validate_config({**base, "precision": "fp8"})


def test_checkpoints_made_before_the_key_existed_still_resume():
    """A float32 run's checkpoint fingerprint has no ``precision`` (so checkpoints written
    before the key existed still match); a bfloat16 run's does (it is another run)."""
    from fedax.experiments.resume import _fingerprint

    base = {"seed": 0, "rounds": 1, "model": "2nn", "algorithm": "fedavg", "partition": "iid",
            "client_fraction": 0.1, "local_epochs": 1, "batch_size": 10, "client_lr": 0.1}
    assert "precision" not in _fingerprint(validate_config(base))
    assert _fingerprint(validate_config({**base, "precision": "bfloat16"}))["precision"] == \
        "bfloat16"
