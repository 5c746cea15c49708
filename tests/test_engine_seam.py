"""The engine seam, public: an engine written outside fedax from ``fedax.algorithms``'
``client_half``, ``client_training_keys``, ``Reports`` and ``apply_reports`` alone (a plain
Python loop over the clients, one at a time, as a transport would) gives the simulator's
round: the same model and the same aggregator state, with DP's clip and noise run by the
server as the simulator runs them."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax import aggregators as agg
from fedax.algorithms import (
    CohortBatches,
    Reports,
    apply_reports,
    client_half,
    client_training_keys,
    fedavg,
    fedprox,
)
from fedax.client import Batches

D, K = 5, 3


def loss_fn(params, batch):
    logits = batch.x @ params["w"] + params["b"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch.y)
    return jnp.sum(losses * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)


def cohort(rng, sizes, steps=3, batch=4):
    """Clients with ``sizes`` examples (0: a padding row), cut into [S, B] batches."""
    c = len(sizes)
    x = rng.normal(size=(c, steps, batch, D)).astype(np.float32)
    y = rng.integers(0, K, size=(c, steps, batch)).astype(np.int32)
    m = np.zeros((c, steps, batch), np.float32)
    for k, n in enumerate(sizes):
        m[k].reshape(-1)[:n] = 1.0
    return CohortBatches(Batches(x, y, m), np.asarray(sizes, np.float32),
                         np.arange(c, dtype=np.int32))


def my_engine(algorithm, state, batches, key):
    """A user's engine: each client trains on its own (here, in turn), the server applies
    what came back."""
    pieces = algorithm.pieces
    train = jax.jit(client_half, static_argnums=0)  # a client's own program
    keys = client_training_keys(key, len(batches.num_examples))
    messages = []
    for i in range(len(batches.num_examples)):  # the transport: one client at a time
        payload = pieces.payload(state.server)  # what the server sends
        mine = jax.tree.map(lambda a, i=i: a[i], batches.batches)
        messages.append(train(pieces, payload, None, mine, batches.num_examples[i], keys[i]))
    sent = jax.tree.map(lambda *xs: jnp.stack(xs), *messages)
    reports = Reports(sent.update, sent.weight, sent.stats, sent.sums, batches.num_examples)
    return jax.jit(apply_reports, static_argnums=0)(pieces, state, reports, key)


@pytest.mark.parametrize("make", [
    lambda: fedavg(loss_fn, optax.sgd(0.3)),
    lambda: fedprox(loss_fn, optax.sgd(0.3), mu=0.5),
    lambda: fedavg(loss_fn, optax.sgd(0.3), aggregator=agg.dp_gaussian(0.05, 1.0, 4)),
], ids=["fedavg", "fedprox", "dp_gaussian"])
def test_an_engine_from_the_public_seam_equals_the_simulators_round(make):
    algorithm = make()
    params = {"w": jnp.zeros((D, K)), "b": jnp.zeros((K,))}
    state = algorithm.init(params, jax.random.key(99))
    rng = np.random.default_rng(0)
    for t in range(2):
        batches, key = cohort(rng, [12, 5, 9, 0]), jax.random.key(t)
        simulated, sim_metrics = jax.jit(algorithm.round)(state, batches, key)
        mine, metrics = my_engine(algorithm, state, batches, key)
        got, want = algorithm.server_params(mine), algorithm.server_params(simulated)
        moved = np.abs(np.asarray(want["w"]) - np.asarray(algorithm.server_params(state)["w"]))
        assert moved.max() > 1e-3  # the round did something
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
        for a, b in zip(jax.tree.leaves(mine.aggregator),
                        jax.tree.leaves(simulated.aggregator), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
        np.testing.assert_allclose(float(metrics["train_loss"]),
                                   float(sim_metrics["train_loss"]), rtol=1e-5)
        state = simulated
