"""The character LSTM (parameter counts, NumPy reference, derivatives) and the token losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedax.models import (
    char_lstm,
    char_lstm_param_count,
    get_model,
    param_count,
    token_accuracy,
    token_cross_entropy,
)


def _count(v, e=8, h=256, layers=2, peephole=False):
    """Embedding V*E; per layer the fused gates 4H * (inputs + H + 1), plus 3H peepholes;
    softmax layer H*V + V."""
    lstm = sum(4 * h * ((e if k == 0 else h) + h + 1) for k in range(layers))
    return v * e + lstm + (3 * h * layers if peephole else 0) + h * v + v


@pytest.mark.parametrize(
    ("vocab", "peephole", "expected"),
    [(258, True, 866_578), (258, False, 865_042), (98, False, 822_642), (98, True, 824_178)],
)
def test_parameter_count(vocab, peephole, expected):
    params = jax.eval_shape(char_lstm(vocab, peephole=peephole).init, jax.random.key(0))
    assert param_count(params) == expected == _count(vocab, peephole=peephole)
    assert char_lstm_param_count(vocab, peephole=peephole) == expected


def test_parameter_count_other_sizes():
    model = char_lstm(11, embed_dim=3, hidden=5, layers=3, peephole=True)
    params = jax.eval_shape(model.init, jax.random.key(0))
    assert param_count(params) == _count(11, 3, 5, 3, True)
    assert char_lstm_param_count(11, 3, 5, 3, True) == _count(11, 3, 5, 3, True)


def test_paper_count_needs_peepholes_and_258_characters():
    assert _count(258, peephole=True) == 866_578  # McMahan et al.: 866,578 parameters
    assert all(_count(v) != 866_578 for v in range(1, 400))


def _numpy_lstm(params, x, layers, peephole):
    """The LSTM recurrence step by step in float64 NumPy (gates i, f, g, o)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)

    def sigmoid(z):
        return 1 / (1 + np.exp(-z))

    h_in = p["embed"][np.asarray(x)]  # [B, T, E]
    batch, steps = x.shape
    for k in range(layers):
        cell = p[f"lstm_{k}"]
        hidden = cell["w_h"].shape[0]
        h, c = np.zeros((batch, hidden)), np.zeros((batch, hidden))
        out = np.zeros((batch, steps, hidden))
        for t in range(steps):
            z = h_in[:, t] @ cell["w_x"] + h @ cell["w_h"] + cell["b"]
            zi, zf, zg, zo = (z[:, j * hidden : (j + 1) * hidden] for j in range(4))
            if peephole:
                zi = zi + cell["peephole"][0] * c
                zf = zf + cell["peephole"][1] * c
            c = sigmoid(zf) * c + sigmoid(zi) * np.tanh(zg)
            if peephole:
                zo = zo + cell["peephole"][2] * c
            h = sigmoid(zo) * np.tanh(c)
            out[:, t] = h
        h_in = out
    return h_in @ p["out"]["kernel"] + p["out"]["bias"]


def _naive_apply(params, x, layers):
    """The same recurrence as a plain ``lax.scan`` of jax ops (autodiff, no custom rule)."""
    h_in = jnp.swapaxes(params["embed"][x], 0, 1)  # [T, B, E]
    for k in range(layers):
        cell = params[f"lstm_{k}"]
        peep = cell.get("peephole")

        def step(carry, x_t, cell=cell, peep=peep):
            h, c = carry
            z = x_t @ cell["w_x"] + h @ cell["w_h"] + cell["b"]
            zi, zf, zg, zo = jnp.split(z, 4, axis=-1)
            if peep is not None:
                zi, zf = zi + peep[0] * c, zf + peep[1] * c
            c = jax.nn.sigmoid(zf) * c + jax.nn.sigmoid(zi) * jnp.tanh(zg)
            if peep is not None:
                zo = zo + peep[2] * c
            h = jax.nn.sigmoid(zo) * jnp.tanh(c)
            return (h, c), h

        zeros = jnp.zeros((x.shape[0], cell["w_h"].shape[0]))
        _, h_in = jax.lax.scan(step, (zeros, zeros), h_in)
    return jnp.swapaxes(h_in, 0, 1) @ params["out"]["kernel"] + params["out"]["bias"]


def _tiny(peephole, layers=2, seed=0):
    model = char_lstm(7, embed_dim=3, hidden=4, layers=layers, peephole=peephole)
    params = model.init(jax.random.key(seed))
    if peephole:  # non-zero peepholes, so that they are exercised
        for k in range(layers):
            key = jax.random.key(100 + k)
            params[f"lstm_{k}"]["peephole"] = 0.5 * jax.random.normal(key, (3, 4))
    x = jax.random.randint(jax.random.key(seed + 1), (2, 5), 0, 7)
    return model, params, x


def _close(a, b, tol):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=tol, atol=tol), a, b)


@pytest.mark.parametrize("peephole", [False, True])
@pytest.mark.parametrize("layers", [1, 2])
def test_forward_matches_numpy(peephole, layers):
    model, params, x = _tiny(peephole, layers)
    logits = jax.jit(model.apply)(params, x)
    assert logits.shape == (2, 5, 7) and logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, _numpy_lstm(params, x, layers, peephole), atol=1e-5)
    # Each sequence is independent: one row alone gives the same logits.
    np.testing.assert_allclose(model.apply(params, x[1:]), logits[1:], atol=1e-6)


@pytest.mark.parametrize("peephole", [False, True])
def test_derivatives_match_plain_autodiff(peephole):
    """The custom JVP rule (fast reverse mode) against autodiff of the plain recurrence, in
    reverse mode, forward mode and forward-over-reverse (as fedax.hyper uses)."""
    model, params, x = _tiny(peephole)
    y = jax.random.randint(jax.random.key(9), x.shape, 1, 7)

    def fast(p):
        return token_cross_entropy(model.apply(p, x), y)

    def naive(p):
        return token_cross_entropy(_naive_apply(p, x, 2), y)

    @jax.jit
    def derivatives(p, t):
        out = []
        for f in (fast, naive):
            value, grad = jax.value_and_grad(f)(p)
            _, directional = jax.jvp(f, (p,), (t,))
            _, hvp = jax.jvp(jax.grad(f), (p,), (t,))
            out.append((value, grad, directional, hvp))
        return out

    tangent = jax.tree.map(lambda a: jax.random.normal(jax.random.key(3), a.shape), params)
    got, expected = derivatives(params, tangent)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-6)
    _close(got[1], expected[1], 1e-5)
    np.testing.assert_allclose(got[2], expected[2], rtol=1e-4, atol=1e-6)
    _close(got[3], expected[3], 1e-4)


@pytest.mark.parametrize("peephole", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_float64_forward_and_derivatives_match_references(peephole):
    """In float64 the fused-gate cell and the custom derivative rule agree with the NumPy
    recurrence (forward) and with autodiff of the plain scan (gradient, directional
    derivative, Hessian-vector product) to rounding, not merely to float32 tolerance: they
    compute the same function, only regrouped (sigmoid(v) = (1 + tanh(v/2)) / 2)."""
    with jax.enable_x64(True):
        model, params, x = _tiny(peephole)
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
        np.testing.assert_allclose(model.apply(params, x), _numpy_lstm(params, x, 2, peephole),
                                   rtol=1e-12, atol=1e-13)
        y = jax.random.randint(jax.random.key(9), x.shape, 1, 7)

        def fast(p):
            return token_cross_entropy(model.apply(p, x), y)

        def naive(p):
            return token_cross_entropy(_naive_apply(p, x, 2), y)

        tangent = jax.tree.map(lambda a: jax.random.normal(jax.random.key(3), a.shape, a.dtype),
                               params)

        def derivatives(loss):  # one program: the gradient is the primal of the HVP's jvp
            def all_three(p):
                gradient, hvp = jax.jvp(jax.grad(loss), (p,), (tangent,))
                return gradient, jax.jvp(loss, (p,), (tangent,))[1], hvp
            return jax.jit(all_three)(params)

        got, expected = derivatives(fast), derivatives(naive)
        jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-10, atol=1e-12),
                     got, expected)


def test_paper_sized_step_matches_plain_autodiff_in_float32():
    """The Shakespeare model's shapes (98 symbols, E = 8, two layers; H = 64 and T = 40 to
    stay fast): loss and gradient of the fast LSTM equal autodiff of the plain scan to
    float32 tolerance."""
    model = char_lstm(98, hidden=64)
    params = model.init(jax.random.key(1))
    x = jax.random.randint(jax.random.key(2), (10, 40), 1, 98)
    y = jax.random.randint(jax.random.key(3), (10, 40), 1, 98)
    fast = jax.jit(jax.value_and_grad(lambda p: token_cross_entropy(model.apply(p, x), y)))
    naive = jax.jit(jax.value_and_grad(
        lambda p: token_cross_entropy(_naive_apply(p, x, 2), y)))
    (v1, g1), (v2, g2) = fast(params), naive(params)
    np.testing.assert_allclose(v1, v2, rtol=1e-6)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=2e-4, atol=2e-6), g1, g2)


def test_vmap_over_clients_with_their_own_params():
    model, params, x = _tiny(False)
    y = jax.random.randint(jax.random.key(9), x.shape, 1, 7)
    stacked = jax.tree.map(lambda a: jnp.stack([a, 0.5 * a, -a]), params)
    xs = jnp.stack([x, x[::-1], x])

    def loss(p, xb):
        return token_cross_entropy(model.apply(p, xb), y)

    grads = jax.jit(jax.vmap(jax.grad(loss)))(stacked, xs)
    one_by_one = jax.jit(lambda p, xb: jax.lax.map(lambda a: jax.grad(loss)(*a), (p, xb)))
    _close(grads, one_by_one(stacked, xs), 1e-5)


def test_init():
    shapes = jax.eval_shape(get_model("char_lstm", vocab_size=98).init, jax.random.key(0))
    assert shapes["embed"].shape == (98, 8) and shapes["out"]["kernel"].shape == (256, 98)
    assert shapes["lstm_0"]["w_x"].shape == (8, 1024)
    assert shapes["lstm_1"]["w_x"].shape == shapes["lstm_1"]["w_h"].shape == (256, 1024)
    assert "peephole" not in shapes["lstm_0"]

    init = jax.jit(char_lstm(98, hidden=16, peephole=True).init)
    a, b, c = (init(jax.random.key(k)) for k in (1, 1, 2))
    jax.tree.map(np.testing.assert_array_equal, a, b)
    assert not np.array_equal(a["lstm_0"]["w_x"], c["lstm_0"]["w_x"])
    assert float(jnp.abs(a["embed"]).max()) <= 0.05
    expected_bias = np.r_[np.zeros(16), np.ones(16), np.zeros(32)]  # forget gate: 1
    for k in range(2):
        np.testing.assert_array_equal(a[f"lstm_{k}"]["b"], expected_bias)
        np.testing.assert_array_equal(a[f"lstm_{k}"]["peephole"], np.zeros((3, 16)))
        w_h = np.asarray(a[f"lstm_{k}"]["w_h"])
        np.testing.assert_allclose(w_h @ w_h.T, np.eye(16), atol=1e-5)  # orthogonal
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(a))


def test_bad_arguments():
    model = char_lstm(7, hidden=4)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        model.apply(model.init(jax.random.key(0)), jnp.zeros((5,), jnp.int32))
    with pytest.raises(ValueError, match="hidden"):
        char_lstm(7, hidden=0)


# --- Token losses ----------------------------------------------------------------------------


def _token_reference(logits, labels, mask, pad_id):
    logits, labels = np.asarray(logits, np.float64), np.asarray(labels)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    correct = logits.argmax(-1) == labels
    w = (labels != pad_id).astype(np.float64)
    if mask is not None:
        w = w * np.asarray(mask, np.float64)[..., None]
    denominator = max(w.sum(), 1.0)
    return (w * nll).sum() / denominator, (w * correct).sum() / denominator


@pytest.mark.parametrize("pad_id", [0, 3])
def test_token_losses_ignore_padding_and_masked_sequences(pad_id):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 6, 5)).astype(np.float32)  # [C, B, T, V]
    labels = rng.integers(0, 5, size=(2, 3, 6))
    labels[0, 1, 3:] = pad_id
    labels[1, 2, :] = pad_id
    mask = np.array([[1, 1, 0], [1, 0, 1]], np.float32)
    for m in (mask, None, mask.astype(bool)):
        ce, acc = _token_reference(logits, labels, m, pad_id)
        got_ce = token_cross_entropy(jnp.asarray(logits), jnp.asarray(labels), m, pad_id=pad_id)
        got_acc = token_accuracy(jnp.asarray(logits), jnp.asarray(labels), m, pad_id=pad_id)
        np.testing.assert_allclose(got_ce, ce, rtol=1e-5)
        np.testing.assert_allclose(got_acc, acc, rtol=1e-6)
    # Padded positions and masked sequences have no influence, even with huge logits there.
    wild = logits.copy()
    wild[0, 1, 3:] = 1e4
    wild[0, 2] = -1e4
    for fn in (token_cross_entropy, token_accuracy):
        np.testing.assert_allclose(
            fn(jnp.asarray(wild), jnp.asarray(labels), mask, pad_id=pad_id),
            fn(jnp.asarray(logits), jnp.asarray(labels), mask, pad_id=pad_id),
            rtol=1e-6,
        )


def test_token_losses_with_nothing_real_are_zero_with_zero_gradient():
    logits = jnp.ones((2, 4, 5))
    labels = jnp.zeros((2, 4), jnp.int32)  # all padding
    assert float(token_cross_entropy(logits, labels)) == 0.0
    assert float(token_accuracy(logits, labels)) == 0.0
    real = labels.at[:, 0].set(2)
    grad = jax.grad(token_cross_entropy)(logits, real, jnp.zeros(2))
    np.testing.assert_array_equal(grad, np.zeros((2, 4, 5)))


def test_token_accuracy_by_hand():
    # Two sequences of 3 targets; argmax predicts class 1 everywhere.
    logits = jnp.zeros((2, 3, 4)).at[..., 1].set(1.0)
    labels = jnp.array([[1, 2, 0], [1, 1, 3]])
    assert float(token_accuracy(logits, labels)) == pytest.approx(3 / 5)  # 5 non-pad targets
    assert float(token_accuracy(logits, labels, jnp.array([1, 0]))) == pytest.approx(1 / 2)
