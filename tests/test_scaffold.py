"""SCAFFOLD against an independent NumPy implementation of Karimireddy et al. (ICML 2020),
Algorithm 1, with a partial cohort and the population's c_i carried across rounds.

Reference, per round with sampled set S of the N clients (params as one flat vector):

    for i in S:  y ← x;  for each minibatch b (K_i of them): y ← y − η_l (∇f_i(y; b) − c_i + c)
                 Option I:  c_i⁺ = ∇f_i(x)  (mean over all of client i's examples)
                 Option II: c_i⁺ = c_i − c + (x − y) / (K_i η_l)
                 Δy_i = y − x,  Δc_i = c_i⁺ − c_i,  c_i ← c_i⁺
    x ← x + η_g (1/|S|) Σ Δy_i,     c ← c + (|S|/N) (1/|S|) Σ Δc_i
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax import federated as fed
from fedax.algorithms import CohortBatches, fedavg, scaffold
from fedax.client import Batches, steps_strategy
from fedax.simulation.processes import client_processes

D, K = 4, 3  # features, classes
N = 4  # population


def loss_fn(params, batch):
    logits = batch.x @ params["w"] + params["b"]
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, batch.y[:, None], axis=1)[:, 0]
    return jnp.sum(nll * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)


# ---- NumPy reference --------------------------------------------------------------------


def unflat(theta):
    return theta[: D * K].reshape(D, K), theta[D * K :]


def np_grad(theta, x, y):
    w, b = unflat(theta)
    z = x @ w + b
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return np.concatenate([(x.T @ p / len(y)).ravel(), p.mean(axis=0)])


def np_scaffold_round(x, c, c_all, ids, clients, perms, batch_size, lr, lr_g, option):
    c_all = c_all.copy()
    dys, dcs = [], []
    for i in ids:
        cx, cy = clients[i]
        y, steps = x.copy(), 0
        for order in perms[i]:
            for s in range(0, len(order), batch_size):
                idx = order[s : s + batch_size]
                y = y - lr * (np_grad(y, cx[idx], cy[idx]) - c_all[i] + c)
                steps += 1
        if option == "I":
            c_plus = np_grad(x, cx, cy)
        else:
            c_plus = c_all[i] - c + (x - y) / (steps * lr)
        dys.append(y - x)
        dcs.append(c_plus - c_all[i])
        c_all[i] = c_plus
    x = x + lr_g * np.mean(dys, axis=0)
    c = c + len(ids) / N * np.mean(dcs, axis=0)
    return x, c, c_all


# ---- cohorts ------------------------------------------------------------------------------


def build_cohort(clients, ids, perms, batch_size, num_steps, pad_clients=0, dtype=np.float32):
    """Cohort of the given client ids (epochs per perms[i]); ``pad_clients`` empty clients
    (all-zero masks, n = 0, id 0) appended, as the runner pads. Features, masks and counts
    in ``dtype``."""
    c = len(ids) + pad_clients
    x = np.zeros((c, num_steps, batch_size, D), dtype)
    y = np.zeros((c, num_steps, batch_size), np.int32)
    m = np.zeros((c, num_steps, batch_size), dtype)
    n = np.zeros(c, dtype)
    for k, i in enumerate(ids):
        cx, cy = clients[i]
        step = 0
        for order in perms[i]:
            for s in range(0, len(order), batch_size):
                idx = order[s : s + batch_size]
                x[k, step, : len(idx)] = cx[idx]
                y[k, step, : len(idx)] = cy[idx]
                m[k, step, : len(idx)] = 1.0
                step += 1
        n[k] = len(cy)
    client_ids = np.zeros(c, np.int32)
    client_ids[: len(ids)] = ids
    return CohortBatches(Batches(x, y, m), n, client_ids)


@pytest.fixture
def problem():
    rng = np.random.default_rng(0)
    sizes = [7, 4, 9, 5]
    clients = [(rng.normal(size=(n, D)), rng.integers(0, K, size=n)) for n in sizes]
    theta0 = rng.normal(size=D * K + K) * 0.1
    return rng, sizes, clients, theta0


def to_params(theta):
    w, b = unflat(theta)
    return {"w": jnp.asarray(w, jnp.float32), "b": jnp.asarray(b, jnp.float32)}


def flat(tree):
    """Flatten {"w": [..., D, K], "b": [..., K]} into [..., D*K + K] (leading axes kept)."""
    w, b = np.asarray(tree["w"]), np.asarray(tree["b"])
    return np.concatenate([w.reshape(*w.shape[:-2], D * K), b], axis=-1)


@pytest.mark.parametrize(
    "option,map_strategy,steps",
    [("II", "vmap", "scan"), ("I", "sequential", "unroll"), ("II", "processes", "scan"),
     ("I", "lockstep", "scan")],
)
def test_two_rounds_partial_cohort_match_numpy_algorithm_1(problem, option, map_strategy, steps):
    """``processes``: stateful clients with the client map in worker processes."""
    if map_strategy == "processes":
        map_strategy = client_processes(2)
    rng, sizes, clients, theta0 = problem
    lr, lr_g, batch_size = 0.2, 0.8, 3
    # round 1: clients 1, 3; round 2: clients 3 (again: its c_i is reused) and 0 (id 0, like
    # the padding clients); client 2 never participates. Epochs differ per client and round.
    rounds = [(np.array([1, 3]), [2, 1]), (np.array([3, 0]), [1, 2])]

    x, c, c_all = theta0.copy(), np.zeros_like(theta0), np.zeros((N, theta0.size))
    alg = scaffold(loss_fn, lr, N, option=option, server_optimizer=optax.sgd(lr_g))
    state = alg.init(to_params(theta0), None)
    with fed.map_strategy(map_strategy), steps_strategy(steps):
        round_fn = jax.jit(alg.round)
        for ids, epochs in rounds:
            perms = {
                i: [rng.permutation(sizes[i]) for _ in range(e)]
                for i, e in zip(ids, epochs, strict=True)
            }
            num_steps = 7  # ≥ 2 epochs · ⌈9/3⌉ + 1 padded step; fixed: one compilation
            x, c, c_all = np_scaffold_round(
                x, c, c_all, ids, clients, perms, batch_size, lr, lr_g, option
            )
            cohort = build_cohort(clients, ids, perms, batch_size, num_steps, pad_clients=2)
            state, metrics = round_fn(state, cohort, None)

            np.testing.assert_allclose(flat(state.server.params), x, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(flat(state.server.control), c, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(flat(state.clients), c_all, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(flat(state.clients)[2], 0.0)  # never sampled
    assert int(state.round) == 2
    # the invariant c = (1/N) Σ_i c_i holds (all zero at init)
    np.testing.assert_allclose(flat(state.server.control), flat(state.clients).mean(0), atol=1e-6)


def test_float64_rounds_equal_numpy_algorithm_1_option_ii(problem):
    """In a float64 run every number of Option II is float64, K_i·η_l included: two rounds
    with a partial cohort equal the float64 NumPy reference to 1e-12 (a float32 K_i·η_l is
    off by ~3e-8 in c_i)."""
    rng, sizes, clients, theta0 = problem
    lr, lr_g, batch_size, num_steps = 0.1, 0.7, 3, 7  # 0.1 and 0.7: not exact in float32
    rounds = [(np.array([1, 3]), [2, 1]), (np.array([3, 0]), [1, 2])]
    x, c, c_all = theta0.copy(), np.zeros_like(theta0), np.zeros((N, theta0.size))
    with jax.enable_x64(True):
        alg = scaffold(loss_fn, lr, N, option="II", server_optimizer=optax.sgd(lr_g))
        w, b = unflat(theta0)
        params = {"w": jnp.asarray(w, jnp.float64), "b": jnp.asarray(b, jnp.float64)}
        state = alg.init(params, None)
        round_fn = jax.jit(alg.round)
        for ids, epochs in rounds:
            perms = {i: [rng.permutation(sizes[i]) for _ in range(e)]
                     for i, e in zip(ids, epochs, strict=True)}
            x, c, c_all = np_scaffold_round(
                x, c, c_all, ids, clients, perms, batch_size, lr, lr_g, "II")
            cohort = build_cohort(clients, ids, perms, batch_size, num_steps, pad_clients=1,
                                  dtype=np.float64)
            state, _ = round_fn(state, cohort, None)

            assert all(leaf.dtype == jnp.float64 for leaf in jax.tree.leaves(
                (state.server.params, state.server.control, state.clients)))
            np.testing.assert_allclose(flat(state.server.params), x, rtol=0, atol=1e-12)
            np.testing.assert_allclose(flat(state.server.control), c, rtol=0, atol=1e-12)
            np.testing.assert_allclose(flat(state.clients), c_all, rtol=0, atol=1e-12)
    assert np.abs(c_all[[0, 1, 3]]).min() > 1e-3  # the c_i compared are not ~0


def test_zero_controls_one_round_is_fedavg_with_plain_mean(problem):
    rng, sizes, clients, theta0 = problem
    lr, batch_size = 0.3, 3
    ids = np.array([2, 0, 1])
    perms = {i: [rng.permutation(sizes[i]) for _ in range(2)] for i in ids}
    cohort = build_cohort(clients, ids, perms, batch_size, 7)
    sc = scaffold(loss_fn, lr, N)  # c = c_i = 0 at init, η_g = 1
    s_sc, m_sc = jax.jit(sc.round)(sc.init(to_params(theta0), None), cohort, None)

    avg = fedavg(loss_fn, optax.sgd(lr))
    avg_round = jax.jit(avg.round)
    plain = cohort._replace(num_examples=np.ones(len(ids), np.float32))
    s_avg, m_avg = avg_round(avg.init(to_params(theta0), None), plain, None)
    for a, b in zip(jax.tree.leaves(s_sc.server.params),
            jax.tree.leaves(s_avg.server.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # same local losses (the drift correction does not change the reported loss)
    s_w, m_w = avg_round(avg.init(to_params(theta0), None), cohort, None)
    np.testing.assert_allclose(m_sc["train_loss"], m_w["train_loss"], rtol=1e-6)

    # and with n_k weighting it is FedAvg's n_k-weighted mean
    scw = scaffold(loss_fn, lr, N, weighting="num_examples")
    s_scw, _ = jax.jit(scw.round)(scw.init(to_params(theta0), None), cohort, None)
    for a, b in zip(jax.tree.leaves(s_scw.server.params),
            jax.tree.leaves(s_w.server.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("sharded", [False, True])
def test_empty_clients_do_not_touch_client_state(problem, mesh, sharded):
    """Padding clients (n = 0, id 0) neither move the model nor overwrite c_0; also with the
    padded cohort split over an 8-device 'clients' mesh, as the runner does."""
    rng, sizes, clients, theta0 = problem
    ids = np.array([1, 2])
    perms = {i: [rng.permutation(sizes[i])] for i in ids}
    alg = scaffold(loss_fn, 0.2, N)
    state = alg.init(to_params(theta0), None)
    # c_0 = 7 marks client 0's row; c ≠ 0 so that a padding client (which would compute
    # Option II's c_0 − c + 0) would write a different value there.
    marker = jax.tree.map(lambda a: a.at[0].set(7.0), state.clients)
    control = jax.tree.map(lambda a: jnp.full_like(a, 0.5), state.server.control)
    state = state._replace(clients=marker, server=state.server._replace(control=control))
    tight, _ = jax.jit(alg.round)(state, build_cohort(clients, ids, perms, 3, 3), None)
    cohort = build_cohort(clients, ids, perms, 3, 5, pad_clients=6)
    with jax.set_mesh(mesh) if sharded else contextlib.nullcontext():
        padded, _ = jax.jit(alg.round)(state, cohort, None)
    np.testing.assert_array_equal(flat(padded.clients)[0], 7.0)
    np.testing.assert_array_equal(flat(padded.clients)[3], 0.0)
    for a, b in zip(jax.tree.leaves(tight), jax.tree.leaves(padded), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# ---- heterogeneous quadratics: SCAFFOLD removes client drift, FedAvg does not ------------

A = np.array([1.0, 4.0])
B = np.array([0.0, 1.0])
X_STAR = float((A * B).sum() / A.sum())  # minimiser of (1/2) Σ_i f_i, f_i = ½ a_i (x − b_i)²


def quad_loss(params, batch):
    a, b = batch.x[..., 0], batch.x[..., 1]
    per_example = 0.5 * a * (params - b) ** 2
    return jnp.sum(per_example * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)


def quad_cohort(local_steps):
    """Each client's exact (full-batch, B = 1) gradient at every one of ``local_steps`` steps."""
    x = np.broadcast_to(np.stack([A, B], -1)[:, None, None, :], (2, local_steps, 1, 2))
    return CohortBatches(
        Batches(
            jnp.asarray(x, jnp.float32),
            jnp.zeros((2, local_steps, 1), jnp.int32),
            jnp.ones((2, local_steps, 1), jnp.float32),
        ),
        jnp.ones(2, jnp.float32),
        jnp.arange(2, dtype=jnp.int32),
    )


def run_rounds(alg, cohort, rounds):
    def body(state, _):
        return alg.round(state, cohort, None)[0], None

    state, _ = jax.jit(lambda s: jax.lax.scan(body, s, None, length=rounds))(
        alg.init(jnp.zeros((), jnp.float32), None)
    )
    return float(alg.server_params(state))


def test_quadratics_scaffold_reaches_optimum_fedavg_is_biased():
    lr, local_steps, rounds = 0.1, 10, 60
    cohort = quad_cohort(local_steps)
    x_fedavg = run_rounds(fedavg(quad_loss, optax.sgd(lr)), cohort, rounds)
    assert abs(x_fedavg - X_STAR) > 1e-2, x_fedavg
    # FedAvg's fixed point: Σ (1 − q_i) b_i / Σ (1 − q_i), q_i = (1 − η a_i)^K
    q = (1 - lr * A) ** local_steps
    np.testing.assert_allclose(x_fedavg, ((1 - q) * B).sum() / (1 - q).sum(), rtol=1e-5)
    for option in ("I", "II"):
        x_scaffold = run_rounds(scaffold(quad_loss, lr, 2, option=option), cohort, rounds)
        assert abs(x_scaffold - X_STAR) < 1e-4, (option, x_scaffold)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="option"):
        scaffold(loss_fn, 0.1, 4, option="III")
    with pytest.raises(ValueError, match="weighting"):
        scaffold(loss_fn, 0.1, 4, weighting="sqrt")
    with pytest.raises(ValueError, match="num_clients"):
        scaffold(loss_fn, 0.1, 0)
