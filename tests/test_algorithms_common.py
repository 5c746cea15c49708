"""Invariants every registered algorithm must satisfy (one tiny softmax-regression cohort):

* the round jit-compiles and one round gives finite state and metrics;
* it is deterministic: the same inputs give bit-identical outputs;
* padding the cohort with EMPTY clients (all-zero masks, n = 0, id 0), as the runner does to
  split a cohort over devices, gives the same state (per-client state included: padding
  must not overwrite client 0's, who is also a real member of this cohort);
* ``jax.grad`` of a loss after one round with respect to the initial params is finite.

Each algorithm's numerics are checked against NumPy in its own test file.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedax.algorithms import ALGORITHMS, CohortBatches, FederatedAlgorithm, make
from fedax.client import Batches

D, K = 3, 2  # features, classes
POPULATION = 5
IDS = [3, 0, 4]
SIZES = [5, 2, 4]
BATCH, STEPS, PAD = 2, 4, 3


def loss_fn(params, batch):
    logits = batch.x @ params["w"] + params["b"]
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, batch.y[:, None], axis=1)[:, 0]
    return jnp.sum(nll * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)


def make_cohort(pad_clients):
    """One epoch of minibatches of B = 2 per client, padded to S = 4 steps; ``pad_clients``
    empty clients appended (id 0, n = 0, all-zero masks: real clients never are)."""
    rng = np.random.default_rng(0)
    c = len(IDS) + pad_clients
    x = np.zeros((c, STEPS, BATCH, D), np.float32)
    y = np.zeros((c, STEPS, BATCH), np.int32)
    m = np.zeros((c, STEPS, BATCH), np.float32)
    for k, n in enumerate(SIZES):
        flat_x = rng.normal(size=(n, D)).astype(np.float32)
        flat_y = rng.integers(0, K, size=n)
        for i in range(n):
            x[k, i // BATCH, i % BATCH] = flat_x[i]
            y[k, i // BATCH, i % BATCH] = flat_y[i]
            m[k, i // BATCH, i % BATCH] = 1.0
    n = np.zeros(c, np.float32)
    n[: len(IDS)] = SIZES
    ids = np.zeros(c, np.int32)
    ids[: len(IDS)] = IDS
    return CohortBatches(Batches(x, y, m), n, ids)


def initial_params():
    rng = np.random.default_rng(1)
    return {
        "w": jnp.asarray(rng.normal(size=(D, K)) * 0.3, jnp.float32),
        "b": jnp.asarray(rng.normal(size=K) * 0.1, jnp.float32),
    }


EVAL = Batches(
    jnp.asarray(np.random.default_rng(2).normal(size=(6, D)), jnp.float32),
    jnp.asarray([0, 1, 1, 0, 1, 0], jnp.int32),
    jnp.ones(6, jnp.float32),
)


def test_registry_covers_the_algorithms():
    expected = {"fedavg", "fedsgd", "fedprox", "scaffold"}
    expected |= {"fedadagrad", "fedadam", "fedyogi", "fedavgm", "fedamsgrad"}
    assert expected <= set(ALGORITHMS)
    with pytest.raises(ValueError, match="unknown algorithm"):
        make("fednope", loss_fn, POPULATION, 0.1)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_round_invariants(name):
    alg = make(name, loss_fn, num_clients=POPULATION, client_lr=0.2)
    assert isinstance(alg, FederatedAlgorithm)
    key = jax.random.key(0)
    tight, padded = make_cohort(0), make_cohort(PAD)

    def loss_after_round(params):
        state, metrics = alg.round(alg.init(params, key), tight, key)
        return loss_fn(alg.server_params(state), EVAL), (state, metrics)

    # One compiled program per algorithm (compiling is most of this test's time; LLVM's
    # optimization level does not change what is checked). The tight round is the forward
    # pass of the gradient.
    @functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
    def everything(params):
        (_, tight_out), grads = jax.value_and_grad(loss_after_round, has_aux=True)(params)
        return tight_out, alg.round(alg.init(params, key), padded, key), grads

    params = initial_params()
    (state, metrics), (state_pad, metrics_pad), grads = everything(params)
    (state2, metrics2), _, grads2 = everything(params)

    outputs = jax.tree.leaves((state, metrics, grads))
    assert all(np.all(np.isfinite(a)) for a in outputs if jnp.issubdtype(a.dtype, jnp.inexact))
    # the round did something
    assert not np.allclose(alg.server_params(state)["w"], params["w"])
    assert any(np.any(g != 0) for g in jax.tree.leaves(grads))
    # deterministic: bit-identical
    for a, b in zip(outputs, jax.tree.leaves((state2, metrics2, grads2)), strict=True):
        np.testing.assert_array_equal(a, b)
    # empty padding clients change nothing (up to float summation order)
    same = jax.tree.leaves((state, metrics)), jax.tree.leaves((state_pad, metrics_pad))
    for a, b in zip(*same, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
