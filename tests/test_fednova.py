"""FedNova against an independent NumPy implementation of Wang et al. (NeurIPS 2020) with
local SGD, on least squares, with clients that take different numbers of local steps.

Reference, per round (params as one flat vector θ = [w, b]):

    for i:  y ← x;  for each of its τ_i minibatches b: y ← y − η_l ∇f_i(y; b)
            d_i = (x − y) / τ_i
    p_i = n_i / Σ n_j,   τ_eff = Σ p_i τ_i,   x ← x − η_g τ_eff Σ p_i d_i
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax import federated as fed
from fedax.algorithms import ALGORITHMS, CohortBatches, fedavg, make
from fedax.algorithms.fednova import fednova, make_fednova
from fedax.client import Batches, steps_strategy

D, B, S = 3, 3, 8  # features, batch size, padded local steps
ROOT = pathlib.Path(__file__).resolve().parents[1]


def loss_fn(params, batch):
    r = batch.x @ params["w"] + params["b"] - batch.y
    return 0.5 * jnp.sum(r * r * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)


# ---- NumPy reference --------------------------------------------------------------------


def np_grad(theta, x, y):
    r = x @ theta[:D] + theta[D] - y
    return np.concatenate([x.T @ r / len(y), [r.mean()]])


def np_fednova_round(x, clients, schedules, lr, lr_g):
    """``schedules[i]``: client i's minibatches (index arrays), τ_i = len(schedules[i])."""
    ds, taus, ns = [], [], []
    for (cx, cy), batches in zip(clients, schedules, strict=True):
        y = x.copy()
        for idx in batches:
            y = y - lr * np_grad(y, cx[idx], cy[idx])
        ds.append((x - y) / len(batches))
        taus.append(len(batches))
        ns.append(len(cy))
    p = np.array(ns) / np.sum(ns)
    tau_eff = p @ np.array(taus)
    return x - lr_g * tau_eff * (p @ np.array(ds)), tau_eff


# ---- cohorts ------------------------------------------------------------------------------


def schedules_for(rng, sizes, epochs):
    """Each client's minibatches: ``epochs[i]`` shuffled passes in batches of B."""
    out = []
    for n, e in zip(sizes, epochs, strict=True):
        orders = [rng.permutation(n) for _ in range(e)]
        out.append([o[s : s + B] for o in orders for s in range(0, n, B)])
    return out


def build_cohort(clients, schedules, pad_clients=1):
    """The cohort of ``schedules`` padded to S steps, plus empty clients (n = 0)."""
    c = len(clients) + pad_clients
    x = np.zeros((c, S, B, D), np.float32)
    y = np.zeros((c, S, B), np.float32)
    m = np.zeros((c, S, B), np.float32)
    n = np.zeros(c, np.float32)
    for k, ((cx, cy), batches) in enumerate(zip(clients, schedules, strict=True)):
        for step, idx in enumerate(batches):
            x[k, step, : len(idx)], y[k, step, : len(idx)] = cx[idx], cy[idx]
            m[k, step, : len(idx)] = 1.0
        n[k] = len(cy)
    return CohortBatches(Batches(x, y, m), n, np.arange(c, dtype=np.int32))


@pytest.fixture
def problem():
    rng = np.random.default_rng(0)
    sizes = [7, 4, 9, 5]
    clients = [(rng.normal(size=(n, D)), rng.normal(size=n)) for n in sizes]
    return rng, sizes, clients, rng.normal(size=D + 1) * 0.5


def to_params(theta):
    return {"w": jnp.asarray(theta[:D], jnp.float32), "b": jnp.asarray(theta[D], jnp.float32)}


def flat(params):
    return np.concatenate([np.asarray(params["w"]), [np.asarray(params["b"])]])


@pytest.mark.parametrize("map_strategy,steps", [("vmap", "scan"), ("sequential", "unroll")])
def test_two_rounds_match_numpy_reference(problem, map_strategy, steps):
    rng, sizes, clients, theta = problem
    lr, lr_g = 0.1, 0.7
    alg = fednova(loss_fn, lr, server_optimizer=optax.sgd(lr_g))
    avg = fedavg(loss_fn, optax.sgd(lr), optax.sgd(lr_g))  # for contrast
    state = alg.init(to_params(theta), None)
    with fed.map_strategy(map_strategy), steps_strategy(steps):
        round_fn, avg_round = jax.jit(alg.round), jax.jit(avg.round)
        for epochs in ([1, 3, 2, 1], [2, 1, 1, 3]):  # τ_i = (3, 6, 6, 2), then (6, 2, 3, 6)
            schedules = schedules_for(rng, sizes, epochs)
            cohort = build_cohort(clients, schedules)
            state, metrics = round_fn(state, cohort, None)
            avg_state, _ = avg_round(avg.init(to_params(theta), None), cohort, None)
            theta, tau_eff = np_fednova_round(theta, clients, schedules, lr, lr_g)
            np.testing.assert_allclose(flat(alg.server_params(state)), theta, rtol=1e-5,
                                       atol=1e-6)
            np.testing.assert_allclose(metrics["local_steps"], tau_eff, rtol=1e-6)
            # FedAvg from the same model differs: the steps are heterogeneous
            assert np.max(np.abs(flat(avg.server_params(avg_state)) - theta)) > 1e-2
    assert int(metrics["rejected_clients"]) == 0


def test_equal_local_steps_is_fedavg(problem):
    rng, sizes, clients, theta = problem
    lr = 0.1
    server = optax.sgd(0.5, momentum=0.9)
    nova, avg = fednova(loss_fn, lr, server), fedavg(loss_fn, optax.sgd(lr), server)
    s_nova, s_avg = nova.init(to_params(theta), None), avg.init(to_params(theta), None)
    nova_round, avg_round = jax.jit(nova.round), jax.jit(avg.round)
    for _ in range(2):
        cohort = build_cohort(clients, schedules_for(rng, sizes, [2, 3, 2, 3]))  # τ_i = 6
        s_nova, m_nova = nova_round(s_nova, cohort, None)
        s_avg, m_avg = avg_round(s_avg, cohort, None)
        for a, b in zip(jax.tree.leaves(nova.server_params(s_nova)),
                        jax.tree.leaves(avg.server_params(s_avg)), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(m_nova["train_loss"], m_avg["train_loss"], rtol=1e-6)


def test_rejected_client_is_left_out_of_tau_eff(problem):
    """A client with a NaN feature is rejected: τ_eff and Σ p_i d_i are over the others."""
    rng, sizes, clients, theta = problem
    schedules = schedules_for(rng, sizes, [1, 3, 2, 1])
    cohort = build_cohort(clients, schedules)
    cohort.batches.x[1, 0, 0, 0] = np.nan
    alg = make_fednova(loss_fn, num_clients=4, client_lr=0.1)
    state, metrics = jax.jit(alg.round)(alg.init(to_params(theta), None), cohort, None)
    keep = [0, 2, 3]
    expected, tau_eff = np_fednova_round(theta, [clients[i] for i in keep],
                                         [schedules[i] for i in keep], 0.1, 1.0)
    np.testing.assert_allclose(flat(alg.server_params(state)), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["local_steps"], tau_eff, rtol=1e-6)
    assert int(metrics["rejected_clients"]) == 1


def test_registry(problem):
    """The registry's ``make("fednova", ...)`` is this module's FedNova."""
    assert "fednova" in ALGORITHMS
    rng, sizes, clients, theta = problem
    cohort = build_cohort(clients, schedules_for(rng, sizes, [1, 3, 2, 1]))

    def one_round(alg):
        state, _ = jax.jit(alg.round)(alg.init(to_params(theta), None), cohort, None)
        return flat(alg.server_params(state))

    made = make("fednova", loss_fn, num_clients=4, client_lr=0.1, server_lr=0.7)
    np.testing.assert_array_equal(one_round(made), one_round(fednova(loss_fn, 0.1,
                                                                     optax.sgd(0.7))))


def python_blocks(markdown):
    return re.findall(r"^```python\n(.*?)^```$", markdown, flags=re.DOTALL | re.MULTILINE)


def test_guide_shows_the_module_verbatim():
    """docs/new-algorithm.md shows fednova.py whole, and excerpts of this file verbatim."""
    blocks = python_blocks((ROOT / "docs" / "new-algorithm.md").read_text())
    module = [b for b in blocks if b.startswith('"""FedNova')]
    assert len(module) == 1, "the guide must show fednova.py in one python block"
    assert module[0] == (ROOT / "src/fedax/algorithms/fednova.py").read_text()
    excerpts = [b for b in blocks if b.startswith(("def ", "@pytest"))]
    assert excerpts and all(b in pathlib.Path(__file__).read_text() for b in excerpts)
