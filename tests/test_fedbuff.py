"""FedBuff, FedAsync and synchronous FedAvg on the virtual clock
(``fedax.simulation.asynchronous``), against NumPy references written here.

Tiny problems only (logistic regression on synthetic data, a few server updates): the
whole file runs in seconds.
"""

import heapq
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax import data as fdata
from fedax.aggregators import chain, clip_norm, mean
from fedax.algorithms import ClientMessage, fedavg
from fedax.algorithms.fedavg import model_pieces
from fedax.client import decoded
from fedax.models import get_model, softmax_cross_entropy
from fedax.simulation import Execution, PartitionSource, make_evaluator, run
from fedax.simulation.asynchronous import (
    AsyncConfig,
    Latency,
    Staleness,
    fedasync,
    fedbuff,
    run_async,
    run_synchronous,
)

N, D, CLASSES = 12, 5, 3  # clients, features, classes
EXECUTION = Execution("sequential", "scan", 1)


def _problem(nan_client: int | None = None):
    rng = np.random.default_rng(0)
    sizes = rng.integers(6, 15, size=N)
    x = rng.normal(size=(int(sizes.sum()), D)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(D, CLASSES)), axis=1)
    parts = np.split(np.arange(len(y)), np.cumsum(sizes)[:-1])
    if nan_client is not None:
        x[parts[nan_client][0], 0] = np.nan
    return fdata.ClientData.from_partition(x, y, parts)


TRAIN = _problem()
MODEL = get_model("logistic", input_dim=D, num_classes=CLASSES)
PARAMS = MODEL.init(jax.random.key(0))


def loss_fn(params, batch):
    return softmax_cross_entropy(MODEL.apply(params, batch.x), batch.y, batch.mask)


def source(train=TRAIN, cohort=4, seed=0):
    return PartitionSource(train, cohort / N, 1, 5, seed=seed)


def same_records(a, b):
    strip = [{k: v for k, v in r.items() if k != "elapsed_s"} for r in a]
    return strip == [{k: v for k, v in r.items() if k != "elapsed_s"} for r in b]


def same_params(a, b):
    return all(np.array_equal(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                     strict=True))


# ------------------------------------------------------------------- equals FedAvg


def test_k_equal_cohort_no_spread_no_staleness_is_synchronous_fedavg_bit_for_bit():
    algorithm = fedavg(loss_fn, optax.sgd(0.1))
    evaluate = make_evaluator(MODEL.apply, TRAIN.x, TRAIN.y, chunk=64)
    config = AsyncConfig(buffer_size=4, concurrency=4, staleness=Staleness("polynomial", 0.5),
                         latency=Latency("constant", mean=2.5), weighting="algorithm")
    fb = run_async(algorithm, PARAMS, source(), evaluate, config, server_updates=4,
                   execution=EXECUTION, trace=True)
    sync = run(algorithm, PARAMS, source(), evaluate, rounds=4, execution=EXECUTION)
    # The same program on the same cohorts: the same bits (XLA:CPU, one device).
    assert same_params(fb.state.server.params, sync.state.server.params)
    assert [r["test_accuracy"] for r in fb.records] == [r["test_accuracy"] for r in sync.records]
    assert [r["train_loss"] for r in fb.records] == [r["train_loss"] for r in sync.records]
    assert all(r["max_staleness"] == 0 for r in fb.records)
    assert [r["virtual_time"] for r in fb.records] == [2.5, 5.0, 7.5, 10.0]
    # ... and the synchronous clock agrees (every round waits 2.5).
    clocked = run_synchronous(algorithm, PARAMS, source(), None, config.latency, rounds=4,
                              execution=EXECUTION)
    assert [r["virtual_time"] for r in clocked.records] == [2.5, 5.0, 7.5, 10.0]
    assert [r["client_updates"] for r in clocked.records] == [4, 8, 12, 16]
    # every version's clients are the synchronous round's cohort, in order
    cohorts = [source().round_data(t, 1).ids.tolist() for t in range(4)]
    assert [e[1] for e in fb.trace] == sum(cohorts, [])


# ------------------------------------------------------------------ staleness, latency


def test_staleness_weights_against_numpy():
    tau = np.arange(0, 60)
    np.testing.assert_array_equal(Staleness("constant").weights(tau), np.ones(60))
    for a in (0.0, 0.25, 0.5, 1.0):
        np.testing.assert_allclose(Staleness("polynomial", a).weights(tau),
                                   1.0 / (1.0 + tau) ** a, rtol=1e-6)
    np.testing.assert_allclose(Staleness("threshold", cutoff=3, value_after=0.2).weights(tau),
                               np.where(tau <= 3, 1.0, 0.2).astype(np.float32), rtol=0)
    assert float(Staleness("polynomial", 0.5).weights(3)) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="exponent must be in"):
        Staleness("polynomial", 1.5).validate()
    with pytest.raises(ValueError, match="is not one of"):
        Staleness("hinge").validate()


def test_latency_distributions_against_numpy():
    n = np.array([3.0, 10.0, 7.0, 1.0, 5.0])
    for kind, ref in [
        ("constant", lambda g: np.full(5, 2.0)),
        ("half_normal", lambda g: 0.5 + np.abs(g.standard_normal(5)) * 1.5),
        ("uniform", lambda g: g.uniform(0.5, 2 * 2.0 - 0.5, 5)),
        ("exponential", lambda g: g.exponential(2.0, 5)),
        ("per_example_gaussian", lambda g: n * np.maximum(g.normal(2.0, 1.5, 5), 0.5)),
    ]:
        got = Latency(kind, mean=2.0, sd=1.5, min=0.5).durations(np.random.default_rng(7), n)
        np.testing.assert_array_equal(got, ref(np.random.default_rng(7)), err_msg=kind)
    with pytest.raises(ValueError, match="min <= mean"):
        Latency("uniform", mean=1.0, min=2.0).validate()


def reference_schedule(seed, source_seed, cohort, m, k, arrivals, latency):
    """The closed-loop clock, written again: M trips at once; trip j is client j % C of
    block j // C (the block's first draws: ``sample_clients``, in id order), with duration
    min + |N(0, sd²)| from ``default_rng([seed, 0x6C6174, block])``; arrivals at one instant
    go in trip order, every K of them make a server update, and their replacements start at
    that instant on the newest version."""
    def block(b):
        ids = np.sort(fdata.sample_clients(np.random.default_rng([source_seed, b]), N,
                                           cohort / N))
        g = np.random.default_rng([seed, 0x6C6174, b])
        return ids, latency.min + np.abs(g.standard_normal(cohort)) * latency.sd

    def trip(j, now, version):
        ids, dur = block(j // cohort)
        return (now + dur[j % cohort], j, int(ids[j % cohort]), now, version)

    flights = [trip(j, 0.0, 0) for j in range(m)]
    heapq.heapify(flights)
    out, version, buffered, next_trip = [], 0, 0, m
    while len(out) < arrivals:
        now = flights[0][0]
        group = []
        while flights and flights[0][0] == now:
            group.append(heapq.heappop(flights))
        for finish, j, client, start, v in group:  # heap order = (finish, trip)
            out.append((j, client, start, finish, v, version, "buffered"))
            buffered += 1
            if buffered == k:
                version, buffered = version + 1, 0
        for _ in group:
            heapq.heappush(flights, trip(next_trip, now, version))
            next_trip += 1
    return out


@pytest.fixture(scope="module")
def clocked_run():
    config = fedbuff(buffer_size=2, concurrency=5, latency=Latency("half_normal", sd=1.0,
                                                                   min=0.2),
                     staleness=Staleness("polynomial", 0.5))
    history = run_async(fedavg(loss_fn, optax.sgd(0.1)), PARAMS, source(seed=3), None,
                        config, server_updates=12, seed=11, execution=EXECUTION, trace=True)
    return config, history


def test_clock_and_staleness_against_numpy_reimplementation(clocked_run):
    config, history = clocked_run
    assert len(history.trace) == 24  # 12 updates of K = 2, nothing rejected
    expected = reference_schedule(11, 3, 4, 5, 2, 24, config.latency)
    assert history.trace == expected
    assert max(e[5] - e[4] for e in expected) >= 2  # the test does exercise staleness
    taus = np.array([e[5] - e[4] for e in expected])
    # each record: mean/max staleness of its buffer, virtual time of its update
    assert [r["max_staleness"] for r in history.records] == \
        [int(taus[i:i + 2].max()) for i in range(0, 24, 2)]
    assert [r["virtual_time"] for r in history.records] == [e[3] for e in expected[1::2]]
    np.testing.assert_allclose([r["mean_staleness_weight"] for r in history.records],
                               [np.mean(1 / np.sqrt(1 + taus[i:i + 2]))
                                for i in range(0, 24, 2)], rtol=1e-6)


def test_concurrency_limit_is_respected(clocked_run):
    config, history = clocked_run
    starts = np.array([e[2] for e in history.trace])
    finishes = np.array([e[3] for e in history.trace])
    last = finishes.max()
    for t in np.unique(np.concatenate([starts, finishes])):
        if t >= last:
            continue
        # trips training at t: started at or before t, finishing after t (the trace has
        # every trip that finished by `last`; later ones are still in flight)
        in_flight = np.sum((starts <= t) & (finishes > t))
        assert in_flight <= config.concurrency
    assert np.sum(starts == 0.0) == config.concurrency  # M start at once
    # closed loop: every later trip starts exactly when an earlier one finished
    assert set(starts[starts > 0]) <= set(finishes)
    with pytest.raises(ValueError, match="concurrency .* must be >= buffer_size"):
        AsyncConfig(buffer_size=4, concurrency=3).validate()


# ------------------------------------------------------------------ the server's math


def mean_x_pieces(server_optimizer, aggregator=None):
    """A client whose local model is the mean of its features (w_local = x̄_k): its
    update is Δ = w − x̄_k, so the server's math can be checked exactly in NumPy."""

    def client_update(params, client_state, batches, num_examples):
        del client_state
        b = decoded(batches)
        local = jnp.sum(b.x * b.mask[..., None], axis=(0, 1)) / jnp.sum(b.mask)
        return ClientMessage(params - local, num_examples, {})

    return model_pieces(client_update, server_optimizer, aggregator)


def reference_server(trace, w0, eta, k, a, mixing=False, clip=None):
    """FedBuff: Δ̄ = Σ n_k s(τ_k) clip(w_{v_k} − x̄_k) / Σ n_k; FedAsync (K = 1, mixing):
    w ← w − η s(τ)(w − x̄_k)."""
    xbar = {c: TRAIN.x[TRAIN.client_indices(c)].astype(np.float64).mean(0) for c in range(N)}
    n = TRAIN.sizes
    versions, buffer = [np.asarray(w0, np.float64)], []
    for _, client, _, _, v_start, v_now, _ in trace:
        w = versions[-1]
        delta = (w if mixing else versions[v_start]) - xbar[client]
        if clip is not None:
            delta = delta * min(1.0, clip / np.linalg.norm(delta))
        buffer.append((n[client], (1.0 + v_now - v_start) ** -a * delta))
        if len(buffer) == k:
            total = sum(nk for nk, _ in buffer)
            versions.append(w - eta * sum(nk * d for nk, d in buffer) / total)
            buffer = []
    return versions[-1]


@pytest.mark.parametrize("case", ["fedbuff", "fedbuff+clip", "fedasync"])
def test_server_update_against_numpy(case):
    w0 = jnp.full(D, 0.3, jnp.float32)
    clip = 0.4 if case == "fedbuff+clip" else None
    aggregator = chain(clip_norm(clip), mean()) if clip else None
    eta = 0.6
    pieces = mean_x_pieces(optax.sgd(eta), aggregator)
    latency = Latency("exponential", mean=1.0)
    if case == "fedasync":
        config, k, a, updates = fedasync(4, latency=latency), 1, 0.5, 14
    else:
        config = AsyncConfig(3, 5, Staleness("polynomial", 0.7), latency=latency)
        k, a, updates = 3, 0.7, 6
    history = run_async(pieces, w0, source(), None, config, server_updates=updates, seed=5,
                        execution=EXECUTION, trace=True)
    trace = history.trace
    assert max(e[5] - e[4] for e in trace) >= 1  # stale updates were aggregated
    expected = reference_server(trace, w0, eta, k, a, mixing=case == "fedasync", clip=clip)
    np.testing.assert_allclose(history.state.server.params, expected, rtol=2e-5, atol=2e-6)
    if clip:
        assert sum(r["clipped_clients"] for r in history.records) > 0


# ------------------------------------------------------------ determinism and resume


def _small_run(seed, **kwargs):
    config = fedbuff(buffer_size=2, concurrency=4, latency=Latency("half_normal"))
    return run_async(fedavg(loss_fn, optax.sgd(0.1)), PARAMS, source(), None, config,
                     server_updates=6, seed=seed, execution=EXECUTION, eval_every=2,
                     **kwargs)


def test_same_seed_same_numbers_other_seed_differs():
    a, b, c = _small_run(0), _small_run(0), _small_run(1)
    assert same_records(a.records, b.records)
    assert same_params(a.state.server.params, b.state.server.params)
    assert [r["virtual_time"] for r in a.records] != [r["virtual_time"] for r in c.records]
    assert not same_params(a.state.server.params, c.state.server.params)


def test_checkpoint_resume_equals_uninterrupted(tmp_path):
    full = _small_run(2)

    class Stop(Exception):
        pass

    def stop_at_4(record):
        if record["round"] == 4:
            raise Stop

    with pytest.raises(Stop):
        _small_run(2, checkpoint_dir=tmp_path, checkpoint_every=2, callbacks=[stop_at_4])
    resumed = _small_run(2, checkpoint_dir=tmp_path, checkpoint_every=2, resume=True)
    assert resumed.resumed_from == 4
    assert same_records(resumed.records, full.records)
    assert same_params(resumed.state.server.params, full.state.server.params)


# ------------------------------------------------------------------------- non-finite


def test_nonfinite_update_is_excluded_and_counted():
    bad = 7
    train = _problem(nan_client=bad)
    config = fedbuff(buffer_size=2, concurrency=4, latency=Latency("uniform", mean=1.0, min=0.5))
    history = run_async(fedavg(loss_fn, optax.sgd(0.1)), PARAMS, source(train), None, config,
                        server_updates=8, execution=EXECUTION, trace=True,
                        max_rejected_fraction=0.9)
    statuses = {(e[1], e[6]) for e in history.trace}
    trips_of_bad = sum(e[1] == bad for e in history.trace)
    assert trips_of_bad > 0
    assert statuses - {(bad, "nonfinite")} == {(c, "buffered") for c, s in statuses
                                                   if c != bad}
    assert sum(r["rejected_clients"] for r in history.records) == trips_of_bad
    assert history.records[-1]["accepted_updates"] == 2 * 8  # rejected never fill K
    assert history.records[-1]["client_updates"] == 2 * 8 + trips_of_bad
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(history.state))
    assert math.isfinite(history.records[-1]["train_loss"])
