"""FedOpt server optimizers against a NumPy loop of Reddi et al. (ICLR 2021), Algorithm 2.

Reference, in the paper's sign convention (Δ_t = mean client model − server model):

    m_t = β1 m_{t−1} + (1 − β1) Δ_t,   m_{−1} = 0
    v_t = v_{t−1} + Δ_t²                                   (Adagrad)
          β2 v_{t−1} + (1 − β2) Δ_t²                       (Adam, AMSGrad)
          v_{t−1} − (1 − β2) Δ_t² sign(v_{t−1} − Δ_t²)     (Yogi),   v_{−1} = τ²
    v̂_t = max(v̂_{t−1}, v_t)                               (AMSGrad, in place of v)
    x_{t+1} = x_t + η m_t / (√v_t + τ)                     (no bias correction)

FedAvgM: m_t = β m_{t−1} + Δ_t, x_{t+1} = x_t + η m_t. The optax transforms receive the
pseudo-gradient −Δ_t and return the step to add.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax.algorithms import fedadagrad, fedadam, fedamsgrad, fedavgm, fedyogi

STEPS = 7


def np_fedopt(kind, x0, deltas, lr, b1=0.9, b2=0.99, tau=1e-3, v0=None, momentum=0.9):
    x = np.array(x0, np.float64)
    m = np.zeros_like(x)
    v = np.full_like(x, tau**2 if v0 is None else v0)
    v_hat = v.copy()
    for d in deltas:
        if kind == "fedavgm":
            m = momentum * m + d
            x = x + lr * m
            continue
        m = b1 * m + (1 - b1) * d
        if kind == "fedadagrad":
            v = v + d**2
        elif kind == "fedyogi":
            v = v - (1 - b2) * d**2 * np.sign(v - d**2)
        else:  # fedadam, fedamsgrad
            v = b2 * v + (1 - b2) * d**2
        denom = v
        if kind == "fedamsgrad":
            v_hat = np.maximum(v_hat, v)
            denom = v_hat
        x = x + lr * m / (np.sqrt(denom) + tau)
    return x


def run_transform(opt, x0, deltas, jit=True):
    params = {"w": jnp.asarray(x0[:-2].reshape(2, -1)), "b": jnp.asarray(x0[-2:])}
    state = opt.init(params)
    update = jax.jit(opt.update) if jit else opt.update

    def to_tree(v):
        return {"w": jnp.asarray(v[:-2].reshape(2, -1)), "b": jnp.asarray(v[-2:])}

    for d in deltas:
        pseudo_grad = jax.tree.map(jnp.negative, to_tree(d))  # server − client = −Δ_t
        updates, state = update(pseudo_grad, state, params)
        params = optax.apply_updates(params, updates)
    return np.concatenate([np.asarray(params["w"]).ravel(), np.asarray(params["b"])])


def deltas_with_both_yogi_branches(rng, dim):
    """Mixed magnitudes over rounds, so v_{t-1} − Δ_t² takes both signs (and Adam's v both
    grows and shrinks, which exercises AMSGrad's max)."""
    scales = [1.0, 0.01, 3.0, 0.001, 0.5, 0.02, 2.0][:STEPS]
    return [s * rng.normal(size=dim) for s in scales]


CASES = [
    ("fedadagrad", lambda: fedadagrad(0.3, tau=1e-2), {"b1": 0.0, "tau": 1e-2}),
    ("fedadagrad", lambda: fedadagrad(0.3, tau=1e-2, b1=0.5), {"b1": 0.5, "tau": 1e-2}),
    ("fedadam", lambda: fedadam(0.1, b1=0.9, b2=0.99, tau=1e-3), {}),
    ("fedadam", lambda: fedadam(0.1, b1=0.8, b2=0.9, tau=1e-1), {"b1": 0.8, "b2": 0.9, "tau": 0.1}),
    ("fedyogi", lambda: fedyogi(0.1, b1=0.9, b2=0.99, tau=1e-3), {}),
    (
        "fedyogi",
        lambda: fedyogi(0.1, b1=0.7, b2=0.9, tau=1e-2),
        {"b1": 0.7, "b2": 0.9, "tau": 0.01},
    ),
    ("fedamsgrad", lambda: fedamsgrad(0.1, b1=0.9, b2=0.99, tau=1e-3), {}),
    (
        "fedamsgrad",
        lambda: fedamsgrad(0.1, b1=0.5, b2=0.5, tau=1e-2),
        {"b1": 0.5, "b2": 0.5, "tau": 0.01},
    ),
    ("fedavgm", lambda: fedavgm(0.7, momentum=0.9), {"momentum": 0.9}),
    ("fedavgm", lambda: fedavgm(1.0, momentum=0.0), {"momentum": 0.0}),
]


@pytest.mark.parametrize(
    "kind,make,kwargs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_matches_numpy_algorithm_2(kind, make, kwargs):
    rng = np.random.default_rng(0)
    dim = 8
    x0 = rng.normal(size=dim)
    deltas = deltas_with_both_yogi_branches(rng, dim)
    lr = {"fedadagrad": 0.3, "fedavgm": 0.7 if kwargs.get("momentum") else 1.0}.get(kind, 0.1)
    expected = np_fedopt(kind, x0, deltas, lr, **kwargs)
    with jax.enable_x64(True):
        got = run_transform(make(), x0, deltas)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    # float32 too (what the library runs by default), at float32 accuracy
    got32 = run_transform(make(), x0.astype(np.float32), [d.astype(np.float32) for d in deltas])
    np.testing.assert_allclose(got32, expected, rtol=2e-5, atol=2e-5)


def test_yogi_reference_exercises_both_sign_branches():
    rng = np.random.default_rng(0)
    dim = 8
    rng.normal(size=dim)
    deltas = deltas_with_both_yogi_branches(rng, dim)
    b2, v = 0.99, np.full(dim, 1e-6)
    signs = set()
    for d in deltas:
        signs |= set(np.sign(v - d**2).tolist())
        v = v - (1 - b2) * d**2 * np.sign(v - d**2)
    assert {-1.0, 1.0} <= signs


@pytest.mark.parametrize("make", [fedadagrad, fedadam, fedyogi, fedamsgrad])
def test_initial_accumulator_defaults_to_tau_squared_and_can_be_set(make):
    params = {"a": jnp.zeros(3)}
    state = make(0.1, tau=0.02).init(params).inner_state  # (η is injected: outside)
    np.testing.assert_allclose(state.v["a"], np.full(3, 0.02**2), rtol=1e-6)
    np.testing.assert_array_equal(state.m["a"], np.zeros(3))
    state = make(0.1, tau=0.02, initial_accumulator=0.5).init(params).inner_state
    np.testing.assert_array_equal(state.v["a"], np.full(3, 0.5, np.float32))
    with jax.enable_x64(True):
        rng = np.random.default_rng(1)
        x0, deltas = rng.normal(size=6), [rng.normal(size=6) for _ in range(3)]
        kind = make.__name__
        expected = np_fedopt(
            kind, x0, deltas, 0.1, tau=0.02, v0=0.5, b1=0.0 if kind == "fedadagrad" else 0.9
        )
        got = run_transform(make(0.1, tau=0.02, initial_accumulator=0.5), x0, deltas, jit=False)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_no_bias_correction_unlike_optax_adam():
    """First FedAdam step: η (1−β1) Δ / (√(β2 τ² + (1−β2) Δ²) + τ), not optax's ≈ η sign(Δ)."""
    delta = jnp.asarray([0.5, -2.0])
    lr, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    ours, _ = fedadam(lr, b1, b2, tau).update(-delta, fedadam(lr, b1, b2, tau).init(delta), None)
    d = np.asarray(delta, np.float64)
    expected = lr * (1 - b1) * d / (np.sqrt(b2 * tau**2 + (1 - b2) * d**2) + tau)
    np.testing.assert_allclose(ours, expected, rtol=1e-5)
    adam, _ = optax.adam(lr, b1, b2, eps=tau).update(-delta, optax.adam(lr).init(delta))
    assert not np.allclose(ours, adam, rtol=1e-2)


@pytest.mark.parametrize(
    "bad", [dict(tau=-1.0), dict(b1=1.0), dict(b2=-0.1), dict(initial_accumulator=-1.0)]
)
def test_invalid_hyperparameters(bad):
    with pytest.raises(ValueError):
        fedadam(0.1, **bad)
