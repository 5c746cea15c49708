"""Aggregators: the pieces against NumPy, and a test-written clip-then-mean inside FedAvg,
FedProx and SCAFFOLD against a NumPy implementation of each algorithm (least squares, so
every local step is a closed form)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax import aggregators as agg
from fedax.algorithms import CohortBatches, fedavg, fedprox, scaffold
from fedax.client import Batches

MAX_NORM = 0.05


def clip_stage(max_norm):
    """A clip stage written here, independent of ``agg.clip_norm``: scale each client's
    value to L2 norm <= max_norm and report one bit per clipped client."""

    def client(value, weight, state, key):
        leaves = jax.tree.leaves(value)
        norm = jnp.sqrt(sum(jnp.sum(leaf ** 2) for leaf in leaves))
        factor = jnp.where(norm > max_norm, max_norm / norm, 1.0)
        return jax.tree.map(lambda v: v * factor, value), weight, {"bit": norm > max_norm}

    def server(value, stats, state, key):
        return value, state + 1, {"clipped": stats["bit"].astype(jnp.int32)}

    return agg.Aggregator(lambda template: jnp.zeros((), jnp.int32), client=client,
                          server=server)


def np_clip(delta, max_norm):
    norm = np.sqrt(sum(np.sum(d ** 2) for d in delta))
    return [d * min(1.0, max_norm / norm) for d in delta], norm > max_norm


# ---- the pieces ------------------------------------------------------------------------


def test_chain_clip_then_mean_equals_numpy():
    rng = np.random.default_rng(0)
    values = {"a": rng.normal(size=(5, 3)).astype(np.float32),
              "b": rng.normal(size=(5, 2, 2)).astype(np.float32)}
    weights = np.array([1.0, 2.0, 0.0, 4.0, 3.0], np.float32)
    aggregator = agg.chain(clip_stage(1.0), agg.mean())
    state = aggregator.init(values)
    value, new_state, metrics = jax.jit(agg.aggregate, static_argnums=0)(
        aggregator, jax.tree.map(jnp.asarray, values), jnp.asarray(weights), state,
        jax.random.key(0))
    clipped, bits = zip(*(np_clip([values["a"][k], values["b"][k]], 1.0) for k in range(5)),
                        strict=True)
    want_a = sum(weights[k] * clipped[k][0] for k in range(5)) / weights.sum()
    want_b = sum(weights[k] * clipped[k][1] for k in range(5)) / weights.sum()
    np.testing.assert_allclose(value["a"], want_a, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(value["b"], want_b, rtol=1e-5, atol=1e-7)
    assert int(metrics["clipped"]) == int(np.sum(bits))  # every client's bit counts
    assert int(new_state[0]) == 1 and new_state[1] == ()


def test_library_clip_norm_and_total():
    values = jnp.asarray([[3.0, 4.0], [0.3, 0.4], [6.0, 8.0]])
    weights = jnp.asarray([1.0, 1.0, 0.0])
    aggregator = agg.chain(agg.clip_norm(1.0), agg.total())
    value, _, metrics = agg.aggregate(aggregator, values, weights, aggregator.init(values),
                                      None)
    np.testing.assert_allclose(value, [0.6 + 0.3, 0.8 + 0.4], rtol=1e-6)
    assert int(metrics["clipped_clients"]) == 2  # the zero-weight client is still counted


def test_chain_rejects_malformed_compositions():
    with pytest.raises(ValueError, match="exactly one part with a reduction"):
        agg.chain(agg.clip_norm(1.0))
    with pytest.raises(ValueError, match="client stage after the reduction"):
        agg.chain(agg.mean(), agg.clip_norm(1.0))
    with pytest.raises(ValueError, match="no reduction"):
        agg.aggregate(agg.clip_norm(1.0), jnp.ones((2, 1)), jnp.ones(2), (), None)
    with pytest.raises(ValueError, match="complete fedax.aggregators.Aggregator"):
        fedavg(lambda p, b: 0.0, optax.sgd(0.1), aggregator=agg.clip_norm(1.0))


def test_keys_are_per_client_and_per_round():
    """A client stage that adds noise from its key: clients get different noise, the same
    key gives the same noise, another key other noise."""

    def noisy(value, weight, state, key):
        return value + jax.random.normal(key, value.shape), weight, {}

    aggregator = agg.chain(agg.Aggregator(agg.no_state, client=noisy), agg.total())
    zeros, ones = jnp.zeros((4, 3)), jnp.asarray([1.0, 0.0, 0.0, 0.0])
    first, _, _ = agg.aggregate(aggregator, zeros, ones, aggregator.init(None),
                                jax.random.key(1))
    second = agg.aggregate(aggregator, zeros, jnp.roll(ones, 1), aggregator.init(None),
                           jax.random.key(1))[0]
    again = agg.aggregate(aggregator, zeros, ones, aggregator.init(None), jax.random.key(1))[0]
    other = agg.aggregate(aggregator, zeros, ones, aggregator.init(None), jax.random.key(2))[0]
    assert not np.allclose(first, second)  # client 0's noise is not client 1's
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, other)


# ---- inside the algorithms, against NumPy ----------------------------------------------

DIM, NUM_CLIENTS, STEPS, BATCH, LR = 3, 6, 3, 4, 0.3


def loss_fn(params, batch: Batches):
    residual = batch.x @ params["w"] - batch.y
    return 0.5 * jnp.sum(batch.mask * residual ** 2) / jnp.maximum(jnp.sum(batch.mask), 1.0)


def np_grad(w, x, y, m):
    return (x.T @ (m * (x @ w - y))) / max(m.sum(), 1.0)


@pytest.fixture(scope="module")
def cohorts():
    """Two rounds of a 4-client cohort of a 6-client population: client 3 of round 0 has
    fewer real steps, and round 1 resamples clients (two of them again)."""
    rng = np.random.default_rng(3)
    out = []
    for ids in ([0, 2, 3, 5], [2, 1, 5, 4]):
        x = rng.normal(size=(4, STEPS, BATCH, DIM)).astype(np.float32)
        y = rng.normal(size=(4, STEPS, BATCH)).astype(np.float32)
        mask = np.ones((4, STEPS, BATCH), np.float32)
        mask[3, 2:] = 0.0
        num = mask.sum(axis=(1, 2))
        out.append((np.array(ids), x, y, mask, num))
    return out


def to_cohort(ids, x, y, mask, num):
    return CohortBatches(Batches(jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask)),
                         jnp.asarray(num), jnp.asarray(ids, jnp.int32))


def np_local(w, x, y, mask, extra):
    """Local SGD over the real steps; ``extra(w)`` is added to each step's gradient."""
    steps = 0
    for s in range(STEPS):
        if mask[s].sum() == 0:
            continue
        w = w - LR * (np_grad(w, x[s], y[s], mask[s]) + extra(w))
        steps += 1
    return w, steps


def np_round(kind, w, cohort, controls, c, mu=0.0):
    ids, xs, ys, masks, num = cohort
    deltas, weights, c_new, clipped = [], [], dict(controls), 0
    for k, cid in enumerate(ids):
        if kind == "scaffold":
            corr = c - controls[cid]
            y_k, steps = np_local(w, xs[k], ys[k], masks[k], lambda v, corr=corr: corr)
            c_new[cid] = controls[cid] - c + (w - y_k) / (steps * LR)
            weights.append(1.0)
        else:
            y_k, _ = np_local(w, xs[k], ys[k], masks[k], lambda v: mu * (v - w))
            weights.append(num[k])
        (delta,), bit = np_clip([w - y_k], MAX_NORM)
        deltas.append(delta)
        clipped += bit
    weights = np.array(weights)
    w_new = w - sum(wt * d for wt, d in zip(weights, deltas, strict=True)) / weights.sum()
    if kind == "scaffold":
        c = c + sum(c_new[cid] - controls[cid] for cid in ids) / NUM_CLIENTS
    return w_new, c_new, c, clipped


@pytest.mark.parametrize("kind", ["fedavg", "fedprox", "scaffold"])
def test_clip_then_mean_inside_algorithms_equals_numpy(cohorts, kind):
    aggregator = agg.chain(clip_stage(MAX_NORM), agg.mean())
    mu = 0.5
    if kind == "fedavg":
        alg = fedavg(loss_fn, optax.sgd(LR), aggregator=aggregator)
    elif kind == "fedprox":
        alg = fedprox(loss_fn, optax.sgd(LR), mu, aggregator=aggregator)
    else:
        alg = scaffold(loss_fn, LR, NUM_CLIENTS, aggregator=aggregator)
    w0 = np.random.default_rng(0).normal(size=DIM).astype(np.float32)
    state = alg.init({"w": jnp.asarray(w0)}, jax.random.key(0))
    w, c = w0.astype(np.float64), np.zeros(DIM)
    controls = {i: np.zeros(DIM) for i in range(NUM_CLIENTS)}
    round_fn = jax.jit(alg.round)
    for t, cohort in enumerate(cohorts):
        state, metrics = round_fn(state, to_cohort(*cohort), jax.random.key(t))
        w, controls, c, clipped = np_round(kind, w, cohort, controls, c,
                                           mu if kind == "fedprox" else 0.0)
        assert clipped > 0  # the clip acts in this test
        assert int(metrics["clipped"]) == clipped
        np.testing.assert_allclose(alg.server_params(state)["w"], w, rtol=1e-5, atol=1e-6)
    assert int(state.aggregator[0]) == 2  # the aggregator's state lives in the state
    if kind == "scaffold":
        np.testing.assert_allclose(state.server.control["w"], c, rtol=1e-4, atol=1e-6)
        table = np.asarray(state.clients["w"])
        for cid in range(NUM_CLIENTS):
            np.testing.assert_allclose(table[cid], controls[cid], rtol=1e-4, atol=1e-5)


def test_rejected_client_never_reaches_the_aggregator(cohorts):
    """A NaN client is zeroed and weighted 0 before any stage sees it: the clip stage (which
    would turn NaN into NaN) and an unnormalised sum stay finite, and it is not counted."""
    ids, x, y, mask, num = cohorts[0]
    x = x.copy()
    x[1, 0, 0, 0] = np.nan
    aggregator = agg.chain(clip_stage(MAX_NORM), agg.total())
    alg = fedavg(loss_fn, optax.sgd(LR), aggregator=aggregator)
    state = alg.init({"w": jnp.ones(DIM)}, None)
    state, metrics = alg.round(state, to_cohort(ids, x, y, mask, num), jax.random.key(0))
    assert int(metrics["rejected_clients"]) == 1
    assert int(metrics["clipped"]) <= 3
    assert np.all(np.isfinite(alg.server_params(state)["w"]))
