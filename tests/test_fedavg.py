"""FedAvg and FedSGD against an independent NumPy implementation of McMahan et al.'s
Algorithm 1 (with erratum 4: the average runs over the sampled clients only)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax import federated as fed
from fedax.algorithms import CohortBatches, fedavg, fedsgd
from fedax.client import Batches, steps_strategy
from fedax.simulation.processes import client_processes

D, K = 5, 3  # features, classes


def loss_fn(params, batch):
    logits = batch.x @ params["w"] + params["b"]
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, batch.y[:, None], axis=1)[:, 0]
    return jnp.sum(nll * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)


# ---- NumPy reference: softmax regression with its closed-form gradient ------------------


def np_grad(w, b, x, y):
    z = x @ w + b
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return x.T @ p / len(y), p.mean(axis=0)


def np_client_update(w, b, x, y, epochs, batch_size, lr, perms):
    """ClientUpdate: for each epoch, for each batch b of size B (last one partial)."""
    for e in range(epochs):
        order = perms[e]
        for s in range(0, len(order), batch_size):
            idx = order[s : s + batch_size]
            gw, gb = np_grad(w, b, x[idx], y[idx])
            w, b = w - lr * gw, b - lr * gb
    return w, b


def make_clients(rng, sizes):
    return [(rng.normal(size=(n, D)), rng.integers(0, K, size=n)) for n in sizes]


def build_cohort(clients, epochs, batch_size, perms, num_steps):
    """Cut each client's epochs into [S, B] batches with masks, as ClientUpdate does."""
    c = len(clients)
    x = np.zeros((c, num_steps, batch_size, D), np.float32)
    y = np.zeros((c, num_steps, batch_size), np.int32)
    m = np.zeros((c, num_steps, batch_size), np.float32)
    for k, (cx, cy) in enumerate(clients):
        step = 0
        for e in range(epochs):
            order = perms[k][e]
            for s in range(0, len(order), batch_size):
                idx = order[s : s + batch_size]
                x[k, step, : len(idx)] = cx[idx]
                y[k, step, : len(idx)] = cy[idx]
                m[k, step, : len(idx)] = 1.0
                step += 1
    n = np.array([len(cy) for _, cy in clients], np.float32)
    return CohortBatches(Batches(x, y, m), n, np.arange(c, dtype=np.int32))


@pytest.fixture
def problem():
    rng = np.random.default_rng(0)
    sizes = [7, 4, 9]
    clients = make_clients(rng, sizes)
    epochs, batch_size = 2, 3
    perms = [[rng.permutation(n) for _ in range(epochs)] for n in sizes]
    w0 = rng.normal(size=(D, K)) * 0.1
    b0 = rng.normal(size=K) * 0.1
    return clients, sizes, epochs, batch_size, perms, w0, b0


def np_fedavg_round(w0, b0, clients, sizes, epochs, batch_size, lr, perms):
    m_t = sum(sizes)
    w_new, b_new = np.zeros_like(w0), np.zeros_like(b0)
    for k, (cx, cy) in enumerate(clients):
        wk, bk = np_client_update(w0, b0, cx, cy, epochs, batch_size, lr, perms[k])
        w_new += sizes[k] / m_t * wk
        b_new += sizes[k] / m_t * bk
    return w_new, b_new


@pytest.mark.parametrize("map_strategy", ["vmap", "sequential", "unroll", "lockstep", "processes"])
@pytest.mark.parametrize("steps", ["scan", "unroll"])
def test_fedavg_round_matches_numpy_algorithm_1(problem, map_strategy, steps):
    """``processes``: blocks of clients in two worker processes (see test_processes.py)."""
    if map_strategy == "processes":
        map_strategy = client_processes(2)
    clients, sizes, epochs, batch_size, perms, w0, b0 = problem
    lr = 0.3
    ref_w, ref_b = np_fedavg_round(w0, b0, clients, sizes, epochs, batch_size, lr, perms)

    num_steps = max(epochs * -(-n // batch_size) for n in sizes) + 2  # padded steps too
    cohort = build_cohort(clients, epochs, batch_size, perms, num_steps)
    alg = fedavg(loss_fn, optax.sgd(lr))
    params = {"w": jnp.asarray(w0, jnp.float32), "b": jnp.asarray(b0, jnp.float32)}
    with fed.map_strategy(map_strategy), steps_strategy(steps):
        state, metrics = jax.jit(alg.round)(alg.init(params, None), cohort, jax.random.key(0))
    np.testing.assert_allclose(state.server.params["w"], ref_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.server.params["b"], ref_b, rtol=1e-5, atol=1e-6)
    # each client took exactly E * ceil(n_k / B) real steps
    expected_steps = np.average([epochs * -(-n // batch_size) for n in sizes], weights=sizes)
    np.testing.assert_allclose(metrics["local_steps"], expected_steps)


def test_padding_a_client_to_more_steps_changes_nothing(problem):
    clients, sizes, epochs, batch_size, perms, w0, b0 = problem
    params = {"w": jnp.asarray(w0, jnp.float32), "b": jnp.asarray(b0, jnp.float32)}
    # momentum makes the optimizer state matter: padded steps must not touch it either
    alg = fedavg(loss_fn, optax.sgd(0.2, momentum=0.9))
    needed = max(epochs * -(-n // batch_size) for n in sizes)
    tight = build_cohort(clients, epochs, batch_size, perms, needed)
    padded = build_cohort(clients, epochs, batch_size, perms, needed + 5)
    s1, _ = alg.round(alg.init(params, None), tight, None)
    s2, _ = alg.round(alg.init(params, None), padded, None)
    for a, b in zip(jax.tree.leaves(s1.server.params),
            jax.tree.leaves(s2.server.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_fedavg_full_batch_one_epoch_equals_fedsgd(problem):
    clients, sizes, _, _, _, w0, b0 = problem
    lr = 0.5
    full = max(sizes)
    perms = [[np.arange(n)] for n in sizes]
    cohort = build_cohort(clients, 1, full, perms, 1)
    params = {"w": jnp.asarray(w0, jnp.float32), "b": jnp.asarray(b0, jnp.float32)}
    server = optax.sgd(0.7, momentum=0.5)  # any server optimizer: both see the same Δ
    avg = fedavg(loss_fn, optax.sgd(lr), server)
    sgd = fedsgd(loss_fn, lr, server)
    sa, sb = avg.init(params, None), sgd.init(params, None)
    for _ in range(3):
        sa, _ = avg.round(sa, cohort, None)
        sb, _ = sgd.round(sb, cohort, None)
    for a, b in zip(jax.tree.leaves(sa.server.params),
            jax.tree.leaves(sb.server.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # and FedSGD is the paper's w - η Σ (n_k/n) ∇F_k(w): check one plain step in NumPy
    sgd1 = fedsgd(loss_fn, lr)
    s, _ = sgd1.round(sgd1.init(params, None), cohort, None)
    pairs = zip(sizes, clients, strict=True)
    gw = sum(n / sum(sizes) * np_grad(w0, b0, cx, cy)[0] for n, (cx, cy) in pairs)
    np.testing.assert_allclose(s.server.params["w"], w0 - lr * gw, rtol=1e-5, atol=1e-6)


def test_round_is_differentiable_in_the_client_learning_rate(problem):
    """d(loss after one round)/d(client lr) through local SGD equals central differences."""
    clients, sizes, epochs, batch_size, perms, w0, b0 = problem
    num_steps = max(epochs * -(-n // batch_size) for n in sizes)
    cohort = build_cohort(clients, epochs, batch_size, perms, num_steps)
    with jax.enable_x64(True):
        cohort64 = jax.tree.map(
            lambda a: jnp.asarray(a, jnp.float64) if a.dtype == np.float32 else a, cohort
        )
        params = {"w": jnp.asarray(w0), "b": jnp.asarray(b0)}
        eval_batch = Batches(
            jnp.asarray(clients[0][0]), jnp.asarray(clients[0][1]), jnp.ones(sizes[0])
        )

        @jax.jit  # one program per derivative, not op by op
        def after_round(lr):
            alg = fedavg(loss_fn, optax.sgd(lr))
            state, _ = alg.round(alg.init(params, None), cohort64, None)
            return loss_fn(state.server.params, eval_batch)

        lr, h = 0.3, 1e-6
        fd = (after_round(lr + h) - after_round(lr - h)) / (2 * h)
        np.testing.assert_allclose(jax.grad(after_round)(lr), fd, rtol=1e-6)
        np.testing.assert_allclose(jax.jvp(after_round, (lr,), (1.0,))[1], fd, rtol=1e-6)
