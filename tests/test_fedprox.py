"""FedProx and stragglers against an independent NumPy reference.

Reference (Li et al., MLSys 2020): client k starts at w_t and, for each of its E_k epochs and
each minibatch b, takes the local SGD step on h_k(w) = F_k(w) + (μ/2)‖w − w_t‖²,

    w ← w − η (∇F_k(w; b) + μ (w − w_t)),

and the server averages the returned models with weights n_k (the paper's experiments). A
straggler runs E_k < E epochs and its partial model is kept (FedProx); FedAvg drops it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax import federated as fed
from fedax.algorithms import CohortBatches, fedadam, fedavg, fedprox
from fedax.client import Batches
from fedax.data import Cohort
from fedax.simulation.stragglers import drop_stragglers, straggler_epochs

D, K = 5, 3  # features, classes


def loss_fn(params, batch):
    logits = batch.x @ params["w"] + params["b"]
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, batch.y[:, None], axis=1)[:, 0]
    return jnp.sum(nll * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)


def np_grad(w, b, x, y):
    z = x @ w + b
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return x.T @ p / len(y), p.mean(axis=0)


def np_prox_client(w0, b0, x, y, perms, batch_size, lr, mu):
    w, b = w0.copy(), b0.copy()
    for order in perms:  # one permutation per epoch actually run
        for s in range(0, len(order), batch_size):
            idx = order[s : s + batch_size]
            gw, gb = np_grad(w, b, x[idx], y[idx])
            w, b = w - lr * (gw + mu * (w - w0)), b - lr * (gb + mu * (b - b0))
    return w, b


def build_cohort(clients, epochs, batch_size, perms, num_steps):
    """Client k runs epochs[k] epochs, cut into [S, B] batches with masks; the rest is padding."""
    c = len(clients)
    x = np.zeros((c, num_steps, batch_size, D), np.float32)
    y = np.zeros((c, num_steps, batch_size), np.int32)
    m = np.zeros((c, num_steps, batch_size), np.float32)
    for k, (cx, cy) in enumerate(clients):
        step = 0
        for e in range(epochs[k]):
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
    clients = [(rng.normal(size=(n, D)), rng.integers(0, K, size=n)) for n in sizes]
    max_epochs, batch_size = 3, 3
    perms = [[rng.permutation(n) for _ in range(max_epochs)] for n in sizes]
    w0 = rng.normal(size=(D, K)) * 0.1
    b0 = rng.normal(size=K) * 0.1
    num_steps = max_epochs * -(-max(sizes) // batch_size) + 2  # padded steps too
    return clients, sizes, max_epochs, batch_size, perms, w0, b0, num_steps


def as_params(w, b):
    return {"w": jnp.asarray(w, jnp.float32), "b": jnp.asarray(b, jnp.float32)}


@pytest.mark.parametrize("map_strategy", ["vmap", "sequential"])
def test_fedprox_round_with_stragglers_matches_numpy(problem, map_strategy):
    clients, sizes, max_epochs, batch_size, perms, w0, b0, num_steps = problem
    lr, mu = 0.3, 0.7
    epochs = [3, 1, 2]  # clients 1 and 2 are stragglers: FedProx keeps their partial work
    cohort = build_cohort(clients, epochs, batch_size, perms, num_steps)

    ref_w, ref_b = np.zeros_like(w0), np.zeros_like(b0)
    for k, (cx, cy) in enumerate(clients):
        wk, bk = np_prox_client(w0, b0, cx, cy, perms[k][: epochs[k]], batch_size, lr, mu)
        ref_w += sizes[k] / sum(sizes) * wk
        ref_b += sizes[k] / sum(sizes) * bk

    alg = fedprox(loss_fn, optax.sgd(lr), mu)
    with fed.map_strategy(map_strategy):
        state, metrics = jax.jit(alg.round)(alg.init(as_params(w0, b0), None), cohort, None)
    np.testing.assert_allclose(state.server.params["w"], ref_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.server.params["b"], ref_b, rtol=1e-5, atol=1e-6)
    steps = [e * -(-n // batch_size) for e, n in zip(epochs, sizes, strict=True)]
    np.testing.assert_allclose(metrics["local_steps"], np.average(steps, weights=sizes))


def test_fedprox_differs_from_fedavg_when_mu_positive(problem):
    clients, _, max_epochs, batch_size, perms, w0, b0, num_steps = problem
    cohort = build_cohort(clients, [max_epochs] * 3, batch_size, perms, num_steps)
    prox, avg = fedprox(loss_fn, optax.sgd(0.3), 1.0), fedavg(loss_fn, optax.sgd(0.3))
    sp, _ = prox.round(prox.init(as_params(w0, b0), None), cohort, None)
    sa, _ = avg.round(avg.init(as_params(w0, b0), None), cohort, None)
    # the prox term pulls every client towards w_t: a smaller move than FedAvg's
    move = {k: float(jnp.linalg.norm(s.server.params["w"] - w0)) for k, s in (("p", sp), ("a", sa))}
    assert move["p"] < move["a"]


def test_mu_zero_is_fedavg_exactly(problem):
    clients, _, _, batch_size, perms, w0, b0, num_steps = problem
    cohort = build_cohort(clients, [3, 1, 2], batch_size, perms, num_steps)
    client_opt = optax.sgd(0.2, momentum=0.9)
    server_opt = fedadam(0.05)
    prox = fedprox(loss_fn, client_opt, 0.0, server_opt)
    avg = fedavg(loss_fn, client_opt, server_opt)
    sp, sa = prox.init(as_params(w0, b0), None), avg.init(as_params(w0, b0), None)
    for _ in range(2):
        sp, mp = jax.jit(prox.round)(sp, cohort, None)
        sa, ma = jax.jit(avg.round)(sa, cohort, None)
    for a, b in zip(jax.tree.leaves((sp, mp)), jax.tree.leaves((sa, ma)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_fedavg_drops_stragglers(problem):
    """drop_stragglers gives weight 0: FedAvg then equals FedAvg over the others alone."""
    clients, sizes, max_epochs, batch_size, perms, w0, b0, num_steps = problem
    lr = 0.3
    cohort = build_cohort(clients, [3, 1, 3], batch_size, perms, num_steps)
    is_straggler = np.array([False, True, False])
    dropped = drop_stragglers(cohort, is_straggler)
    np.testing.assert_array_equal(dropped.num_examples, [7.0, 0.0, 9.0])
    assert isinstance(dropped, CohortBatches)

    ref_w = np.zeros_like(w0)
    for k in (0, 2):
        cx, cy = clients[k]
        wk, _ = np_prox_client(w0, b0, cx, cy, perms[k], batch_size, lr, 0.0)
        ref_w += sizes[k] / (sizes[0] + sizes[2]) * wk
    alg = fedavg(loss_fn, optax.sgd(lr))
    state, _ = jax.jit(alg.round)(alg.init(as_params(w0, b0), None), dropped, None)
    np.testing.assert_allclose(state.server.params["w"], ref_w, rtol=1e-5, atol=1e-6)

    # traceable on device arrays, inside jit
    def round_dropping(state, cohort, flags):
        return alg.round(state, drop_stragglers(cohort, flags), None)

    cohort_dev = jax.tree.map(jnp.asarray, cohort)
    state2, _ = jax.jit(round_dropping)(
        alg.init(as_params(w0, b0), None), cohort_dev, jnp.asarray(is_straggler)
    )
    np.testing.assert_allclose(state2.server.params["w"], state.server.params["w"],
                               rtol=1e-6, atol=1e-7)


def test_drop_stragglers_on_host_cohort():
    host = Cohort(
        np.arange(3, dtype=np.int32),
        np.zeros((3, 2, 2), np.int32),
        np.ones((3, 2, 2), np.float32),
        np.array([4.0, 5.0, 6.0], np.float32),
    )
    out = drop_stragglers(host, [True, False, True])
    assert isinstance(out, Cohort) and isinstance(out.num_examples, np.ndarray)
    np.testing.assert_array_equal(out.num_examples, [0.0, 5.0, 0.0])
    assert out.num_examples.dtype == np.float32
    np.testing.assert_array_equal(host.num_examples, [4.0, 5.0, 6.0])  # not mutated
    with pytest.raises(ValueError, match="shape"):
        drop_stragglers(host, [True, False])


def test_straggler_epochs():
    e = straggler_epochs(0, 10, 20, 0.0)
    np.testing.assert_array_equal(e, np.full(10, 20))
    assert e.dtype == np.int64

    # determinism; a Generator is advanced
    np.testing.assert_array_equal(straggler_epochs(3, 50, 5, 0.5), straggler_epochs(3, 50, 5, 0.5))
    rng = np.random.default_rng(3)
    a, b = straggler_epochs(rng, 50, 5, 0.5), straggler_epochs(rng, 50, 5, 0.5)
    assert not np.array_equal(a, b)

    # exactly round(f * C) stragglers, each drawing uniformly from {1, ..., E} (E included)
    n, epochs, f = 20_000, 4, 0.9
    e = straggler_epochs(1, n, epochs, f)
    assert e.min() >= 1 and e.max() <= epochs
    num_stragglers = round(f * n)
    counts = np.bincount(e, minlength=epochs + 1)[1:]
    expected = np.full(epochs, num_stragglers / epochs)
    expected[-1] += n - num_stragglers  # non-stragglers run E
    # binomial noise: std ≈ sqrt(18000 · 1/4 · 3/4) ≈ 58; allow 5 sigma
    assert np.all(np.abs(counts - expected) < 300), (counts, expected)

    # with 10 clients and 90% stragglers: 9 stragglers, at most 9 run fewer than E epochs
    for seed in range(20):
        assert np.sum(straggler_epochs(seed, 10, 20, 0.9) < 20) <= 9
    assert np.sum(straggler_epochs(0, 10, 1, 1.0) < 1) == 0  # E = 1: nothing to cut

    for bad in [(0, 5, 0.5), (10, 0, 0.5), (10, 5, 1.5), (10, 5, -0.1)]:
        with pytest.raises(ValueError):
            straggler_epochs(0, *bad)
