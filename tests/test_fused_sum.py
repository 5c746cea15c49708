"""``fed.map_and_sum`` and the round that sums clients' updates as they are made: the
same function as stacking every update and summing (values to float rounding, both
derivative modes, vmap, a device mesh with and without moved clients), the derivative's
per-client values still summed by the federated ``sum``, no ``[n, P]`` stack in the
compiled program, and the round's rejection of non-finite clients unchanged."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax import federated as fed
from fedax.aggregators import chain, clip_norm, mean, total, trimmed_mean
from fedax.algorithms import CohortBatches, fedavg, scaffold
from fedax.algorithms.protocol import fuses_sums
from fedax.client import Batches
from fedax.federated import _lockstep

N, D, H = 8, 5, 4
SIZES = [1, 30, 4, 17, 2, 9, 25, 0]  # skewed steps; the last an empty (padding) client


def data():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(N, 3, D)), jnp.float32)
    w = jnp.asarray(rng.uniform(0.5, 2.0, size=N), jnp.float32).at[3].set(0.0)
    p = {"w": jnp.asarray(rng.normal(size=(D, H)) * 0.3, jnp.float32),
         "v": jnp.asarray(rng.normal(size=(H,)), jnp.float32)}
    return p, x, w


def client(p, x, w):
    """Two SGD steps of a small tanh model; keeps its loss, sums its weighted update."""
    def loss(q):
        return jnp.mean((jnp.tanh(x @ q["w"]) @ q["v"] - 1.0) ** 2)

    q = p
    for _ in range(2):
        q = jax.tree.map(lambda a, g: a - 0.1 * g, q, jax.grad(loss)(q))
    update = jax.tree.map(jnp.subtract, p, q)
    return loss(q), (fed.weighted_terms(update, w), w)


def round_(p, x, w):
    kept, (terms, weight) = fed.map_and_sum(client, fed.broadcast(p, N), x, w)
    return fed.divide_by_weight(terms, weight), kept


def scalar(p, x, w):
    mean_update, kept = round_(p, x, w)
    return jnp.sum(mean_update["w"] ** 2) + jnp.sum(jnp.sin(mean_update["v"])) + fed.mean(kept)


def numpy_round(p, x, w):
    """The definition, client by client in NumPy (float64): a weighted mean of updates."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    total, weight, losses = {k: 0.0 for k in p}, 0.0, []
    for i in range(N):
        xi = np.asarray(x[i], np.float64)
        q = dict(p)
        for _ in range(2):
            hid = np.tanh(xi @ q["w"])
            err = hid @ q["v"] - 1.0
            g_v = 2 * hid.T @ err / len(err)
            g_w = xi.T @ ((2 * err / len(err))[:, None] * q["v"][None] * (1 - hid ** 2))
            q = {"w": q["w"] - 0.1 * g_w, "v": q["v"] - 0.1 * g_v}
        losses.append(np.mean((np.tanh(xi @ q["w"]) @ q["v"] - 1.0) ** 2))
        if w[i] > 0:
            for k in p:
                total[k] = total[k] + float(w[i]) * (p[k] - q[k])
            weight += float(w[i])
    return {k: v / weight for k, v in total.items()}, np.asarray(losses)


def _mesh(devices):
    return jax.make_mesh((devices,), (fed.CLIENTS_AXIS,),
                         axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:devices])


def test_values_equal_a_numpy_reference():
    p, x, w = data()
    with fed.map_strategy("sequential"):
        (got, losses) = jax.jit(round_)(p, x, w)
    want, want_losses = numpy_round(p, x, np.asarray(w))
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("devices", [1, 2])
def test_fused_equals_stacked_values_and_derivatives(devices):
    p, x, w = data()
    tangent = jax.tree.map(jnp.ones_like, p)
    got = {}
    mesh = jax.set_mesh(_mesh(devices)) if devices > 1 else contextlib.nullcontext()
    with fed.map_strategy("sequential"), mesh:
        for fused in (True, False):
            with fed.fuse_sums(fused):
                value = jax.jit(lambda p: round_(p, x, w))(p)
                grad = jax.jit(jax.grad(lambda p: scalar(p, x, w)))(p)
                jvp = jax.jit(lambda p: jax.jvp(lambda q: scalar(q, x, w), (p,),
                                                (tangent,))[1])(p)
                batched = () if devices > 1 else jax.jit(jax.vmap(lambda s: scalar(
                    jax.tree.map(lambda a: a * s, p), x, w)))(jnp.asarray([0.5, 1.0, 2.0]))
                got[fused] = (value, grad, jvp, batched)
    for a, b in zip(jax.tree.leaves(got[True]), jax.tree.leaves(got[False]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # and the derivative against finite differences, so neither form is wrong alike
    eps = 1e-3
    with fed.map_strategy("sequential"):
        f = jax.jit(lambda p: scalar(p, x, w))
        shifted = [f(jax.tree.map(lambda a, s=s: a + s * eps * jnp.ones_like(a), p))
                   for s in (1, -1)]
    np.testing.assert_allclose(got[True][2], (shifted[0] - shifted[1]) / (2 * eps),
                               rtol=2e-2)


def test_uploads_stay_visible_to_the_audit_and_the_cost():
    """The fused loop sends each client's addend with the federated ``sum`` (one client's
    share): the audit still sees a plain upload and ``comm_cost`` counts the same bytes
    as the stacked form; the derivative's per-client values meet at a federated sum of
    all n clients."""
    p, x, w = data()
    with fed.map_strategy("sequential"):
        audits, costs = {}, {}
        for fused in (True, False):
            with fed.fuse_sums(fused):
                audits[fused] = fed.audit_sums(jax.make_jaxpr(lambda p: round_(p, x, w))(p))
                costs[fused] = fed.comm_cost(lambda p: round_(p, x, w), p)
        grad_audit = fed.audit_sums(jax.make_jaxpr(jax.grad(lambda p: scalar(p, x, w)))(p))
    assert {a.kind for a in audits[True]} == {"plain"}
    assert sorted(a.shape for a in audits[True]) == sorted([(1,), (1, D, H), (1, H)])
    assert sorted(a.shape for a in audits[False]) == sorted([(N,), (N, D, H), (N, H)])
    assert costs[True].clients_to_server_bytes == costs[False].clients_to_server_bytes
    assert costs[True].server_to_clients_bytes == costs[False].server_to_clients_bytes
    # reverse mode transposes the broadcast into a federated sum over all N clients
    assert any(a.derivative and a.shape == (N, D, H) for a in grad_audit)


def test_comm_cost_counts_every_device_of_a_mesh():
    p, x, w = data()
    with fed.map_strategy("sequential"), jax.set_mesh(_mesh(2)):
        costs = {}
        for fused in (True, False):
            with fed.fuse_sums(fused):
                costs[fused] = fed.comm_cost(lambda p: round_(p, x, w), p)
    assert costs[True].clients_to_server_bytes == costs[False].clients_to_server_bytes
    assert costs[True].clients_to_server_bytes == 4 * N * (D * H + H + 1)


def test_the_compiled_round_holds_no_stack_of_updates():
    """n = 64 clients of a 48,000-float model: the stacked form's temporary memory holds
    the [64, P] updates; the fused one holds a running total."""
    n, d, h = 64, 200, 240
    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.normal(size=(d, h)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)

    def one(q, xi):
        update = jax.tree.map(lambda a: a * jnp.tanh(jnp.sum(xi)), q)
        return jnp.sum(xi), (update,)

    def program(p, x):
        return fed.map_and_sum(one, fed.broadcast(p, n), x)

    temp = {}
    with fed.map_strategy("sequential"):
        for fused in (True, False):
            with fed.fuse_sums(fused):
                compiled = jax.jit(lambda p, x: program(p, x)).lower(p, x).compile()
                temp[fused] = compiled.memory_analysis().temp_size_in_bytes
    stack = n * d * h * 4
    assert temp[False] >= stack
    assert temp[True] < stack / 8, temp


def cohort_of(sizes, batch=3, seed=0):
    rng = np.random.default_rng(seed)
    steps = [-(-n // batch) for n in sizes]
    s_max = max(steps) + 1
    c = len(sizes)
    x = rng.normal(size=(c, s_max, batch, D)).astype(np.float32)
    y = rng.integers(0, 3, size=(c, s_max, batch)).astype(np.int32)
    mask = np.zeros((c, s_max, batch), np.float32)
    for k, n in enumerate(sizes):
        mask[k].reshape(-1)[:n] = 1.0
    return CohortBatches(Batches(x, y, mask), np.asarray(sizes, np.float32),
                         np.arange(c, dtype=np.int32))


def loss_fn(params, batch):
    logits = batch.x @ params["w"] + params["b"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch.y[:, None], axis=1)[:, 0]
    return jnp.sum(nll * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)


def params0():
    rng = np.random.default_rng(1)
    return {"w": jnp.asarray(rng.normal(size=(D, 3)) * 0.1, jnp.float32),
            "b": jnp.asarray(rng.normal(size=3) * 0.1, jnp.float32)}


def _rounds(alg, cohort, devices=1, moves=None):
    out = {}
    mesh = jax.set_mesh(_mesh(devices)) if devices > 1 else contextlib.nullcontext()
    with fed.map_strategy("sequential"), mesh, _lockstep.decided_moves(moves):
        for fused in (True, False):
            with fed.fuse_sums(fused):
                state = alg.init(params0(), None)
                for _ in range(2):
                    state, metrics = jax.jit(alg.round)(state, cohort, jax.random.key(0))
                out[fused] = (alg.server_params(state), metrics)
    return out


def _assert_close(out):
    (p1, m1), (p0, m0) = out[True], out[False]
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p0), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert m1.keys() == m0.keys()
    for k in m1:
        np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("name", ["fedavg", "fedavg_momentum", "scaffold"])
def test_fused_round_equals_stacked_round(name):
    cohort = cohort_of(SIZES)
    if name == "scaffold":
        alg = scaffold(loss_fn, client_lr=0.3, num_clients=N)
    else:
        server = optax.sgd(1.0, momentum=0.9 if name == "fedavg_momentum" else None)
        alg = fedavg(loss_fn, optax.sgd(0.3), server)
    assert fuses_sums_under_sequential(alg)
    _assert_close(_rounds(alg, cohort))


def fuses_sums_under_sequential(alg):
    with fed.map_strategy("sequential"):
        return fuses_sums(alg.pieces)


@functools.cache
def _one_device_fedavg():
    return _rounds(fedavg(loss_fn, optax.sgd(0.3)), cohort_of(SIZES))


@pytest.mark.parametrize("moves", [None, True, False])
def test_fused_round_over_a_mesh_equals_one_device(moves):
    """Balanced devices (moves decided in the program, or on the host either way) change no
    number: every form equals one device's round to float rounding."""
    one = _one_device_fedavg()
    mesh = _rounds(fedavg(loss_fn, optax.sgd(0.3)), cohort_of(SIZES), devices=2, moves=moves)
    _assert_close({True: mesh[True], False: one[False]})
    _assert_close({True: mesh[False], False: one[False]})


def test_a_non_finite_client_is_rejected_and_counted_alike():
    cohort = cohort_of(SIZES)
    x = cohort.batches.x.copy()
    x[2, 0, 0, 0] = np.nan
    bad = cohort._replace(batches=cohort.batches._replace(x=x))
    alg = fedavg(loss_fn, optax.sgd(0.3))
    out = _rounds(alg, bad)
    _assert_close(out)
    assert int(out[True][1]["rejected_clients"]) == 1
    for leaf in jax.tree.leaves(out[True][0]):
        assert np.all(np.isfinite(leaf))
    # and the rejected client counts for nothing: the round equals one without it
    without = cohort._replace(num_examples=cohort.num_examples * (np.arange(N) != 2),
                              batches=cohort.batches._replace(
                                  mask=cohort.batches.mask * (np.arange(N) != 2)[:, None,
                                                                                  None]))
    clean = _rounds(alg, without)
    for a, b in zip(jax.tree.leaves(out[True][0]), jax.tree.leaves(clean[True][0]),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_only_linear_aggregators_without_a_client_stage_fuse():
    def pieces(aggregator, **kw):
        return fedavg(loss_fn, optax.sgd(0.1), aggregator=aggregator, **kw).pieces

    with fed.map_strategy("sequential"):
        assert fuses_sums(pieces(mean()))
        assert fuses_sums(pieces(total()))
        assert fuses_sums(pieces(chain(mean())))
        assert not fuses_sums(pieces(chain(clip_norm(1.0), mean())))  # a client stage
        assert not fuses_sums(pieces(trimmed_mean(0.1)))  # needs every client's value
        assert not fuses_sums(pieces(mean(), client_weights=lambda n, loss: n))
    with fed.map_strategy("vmap"):
        assert not fuses_sums(pieces(mean()))


@pytest.mark.parametrize("aggregator", [mean, total])
def test_linear_form_equals_the_reduction(aggregator):
    rng = np.random.default_rng(3)
    values = {"a": jnp.asarray(rng.normal(size=(N, 3, 2)), jnp.float32)}
    weights = jnp.asarray(rng.uniform(0, 2, size=N), jnp.float32).at[1].set(0.0)
    values["a"] = values["a"].at[1].set(jnp.nan)  # a zero-weight client may hold anything
    agg = aggregator()
    reduced, _ = agg.reduce(values, weights, (), None)
    summed = fed.sum(fed.weighted_terms(values, weights))
    linear, _ = agg.linear(summed, fed.sum(weights), (), None)
    w = np.asarray(weights)
    a = np.where(w[:, None, None] > 0, np.asarray(values["a"]), 0.0)
    want = np.einsum("i,ijk->jk", w, a) / (w.sum() if aggregator is mean else 1.0)
    np.testing.assert_allclose(reduced["a"], want, rtol=1e-5)
    np.testing.assert_allclose(linear["a"], want, rtol=1e-5)


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_host_decision_equals_the_programs(devices, seed):
    rng = np.random.default_rng(seed)
    for steps in (rng.integers(1, 12, size=devices * 9),
                  rng.integers(5, 7, size=devices * 9),
                  np.concatenate([np.full(9, 6), np.full(9 * (devices - 1), 5)])):
        steps = steps.astype(np.int32)
        perm = _lockstep.balanced_permutation(jnp.asarray(steps), devices)
        want = bool(_lockstep.worth_moving(jnp.asarray(steps), perm, devices))
        assert _lockstep.worth_moving_host(steps, devices) == want
    mask = np.zeros((4, 3, 2), np.float32)
    mask[0, :2, 0] = 1
    mask[2, 0, 1] = 1
    np.testing.assert_array_equal(_lockstep.host_steps(mask), [2, 0, 1, 0])
    np.testing.assert_array_equal(
        _lockstep.host_steps(mask),
        Batches(mask, mask, jnp.asarray(mask)).client_steps())


def test_a_value_the_clients_close_over_is_differentiable():
    """A client learning rate closed over by the client update (not broadcast), learned by
    differentiating the round: under ``sequential`` both settings give the
    finite-difference derivative (the closure is seen, and the plain forms run). 0.4.0's
    read-once broadcast, a custom_jvp closing over it, raised UnexpectedTracerError.
    (Over an Explicit mesh JAX refuses to differentiate a value closed over by a
    shard_map under every strategy, vmap included: not tested here.)"""
    devices = 1
    cohort = cohort_of(SIZES)
    p0 = params0()
    held_out = Batches(jnp.asarray(cohort.batches.x[1, 0]),
                       jnp.asarray(cohort.batches.y[1, 0]), jnp.ones(3))

    def after_round(lr):
        alg = fedavg(loss_fn, optax.sgd(lr))
        state, _ = alg.round(alg.init(p0, None), cohort, None)
        return loss_fn(state.server.params, held_out)

    mesh = jax.set_mesh(_mesh(devices)) if devices > 1 else contextlib.nullcontext()
    got = {}
    with fed.map_strategy("sequential"), mesh:
        for fused in (True, False):
            with fed.fuse_sums(fused):
                f = jax.jit(after_round)
                h = 1e-2
                fd = (f(0.3 + h) - f(0.3 - h)) / (2 * h)
                grad = jax.jit(jax.grad(after_round))(0.3)
                jvp = jax.jit(lambda lr: jax.jvp(after_round, (lr,), (1.0,))[1])(0.3)
                got[fused] = (grad, jvp, fd)
    for grad, jvp, fd in got.values():
        np.testing.assert_allclose(grad, fd, rtol=2e-3)
        np.testing.assert_allclose(jvp, grad, rtol=1e-5)
    np.testing.assert_allclose(got[True][0], got[False][0], rtol=1e-5)


def test_a_fedavg_round_compiles_without_a_stack_of_updates():
    """The round itself takes the fused form (the client update closes over no tracer):
    64 clients of a 48,240-float model, no [64, P] stack in the compiled program."""
    n, d, k = 64, 200, 240
    rng = np.random.default_rng(0)
    cohort = CohortBatches(
        Batches(rng.normal(size=(n, 2, 3, d)).astype(np.float32),
                rng.integers(0, k, size=(n, 2, 3)).astype(np.int32),
                np.ones((n, 2, 3), np.float32)),
        np.full(n, 6.0, np.float32), np.arange(n, dtype=np.int32))
    p = {"w": jnp.zeros((d, k), jnp.float32), "b": jnp.zeros(k, jnp.float32)}
    alg = fedavg(loss_fn, optax.sgd(0.1))
    temp = {}
    with fed.map_strategy("sequential"):
        state = alg.init(p, None)
        for fused in (True, False):
            with fed.fuse_sums(fused):
                compiled = jax.jit(lambda s, c: alg.round(s, c, None)).lower(
                    state, cohort).compile()
                temp[fused] = compiled.memory_analysis().temp_size_in_bytes
    stack = n * (d * k + k) * 4
    assert temp[False] >= stack
    assert temp[True] < stack / 4, temp


@pytest.mark.slow  # a benchmark's run; the forms' equality is tested above
def test_the_benchmark_compares_the_three_forms(tmp_path):
    """``benchmarks/bench_fused_sum.py`` at toy size: every form of both parts ran, the
    forms' models agree, and the stacked baselines really hold the K updates that the
    fused form does not (a benchmark whose forms were one program would show equal
    memory)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from conftest import _child_env

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_fused_sum.py"
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, str(script), "--per-round", "40", "--clients",
                           "200", "--repeats", "1", "--json", str(out)], env=_child_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["part"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"round", "round_no_steps"}
    stack = 40 // 4 * 199_210 * 4  # half a device's block of updates, at least
    for r in rows.values():
        assert all(r[k]["s_median"] > 0 for k in ("fused", "stacked", "0.4.0"))
        assert r["stacked"]["temp_bytes"] - r["fused"]["temp_bytes"] >= stack
        assert r["max_abs_diff_stacked"] < 1e-5 and r["max_abs_diff_0.4.0"] < 1e-5
