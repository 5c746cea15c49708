"""The ``processes`` execution strategy: client blocks in worker processes.

References: the ``sequential`` strategy in this process (``lax.map``), and NumPy for the
padding and ordering checks. The FedAvg and SCAFFOLD NumPy-reference tests also run under
this strategy (test_fedavg.py, test_scaffold.py).
"""

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax import federated as fed
from fedax.algorithms import fedavg, scaffold
from fedax.models import get_model, softmax_cross_entropy
from fedax.simulation import Execution, choose_execution, make_evaluator, run
from fedax.simulation.host import usable_cores
from fedax.simulation.processes import ClientProcesses, client_processes


@pytest.fixture(scope="module")
def pool():
    return client_processes(2)


def client_program(w, x, key, lr):
    """A client program with a traced closed-over value (lr), a PRNG key and a pytree."""

    def f(wc, xc, kc):
        noise = jax.random.normal(kc, xc.shape[-1:])
        h = jnp.tanh(xc @ wc["a"] + noise) * lr
        return {"h": h, "s": jnp.sum(xc, dtype=jnp.float32)}, jnp.int32(xc.shape[0])

    n = x.shape[0]
    return fed.map_clients(f, fed.broadcast(w, n), x, jax.random.split(key, n))


@pytest.mark.parametrize("n", [1, 2, 5, 6])
def test_map_equals_sequential_with_padding_and_closures(pool, n):
    """n = 5 over 2 workers: blocks of 3, the last padded (its padding dropped); n = 1:
    one worker only."""
    rng = np.random.default_rng(n)
    w = {"a": jnp.asarray(rng.normal(size=(3, 3)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(n, 4, 3)), jnp.float32)
    key = jax.random.key(7)
    with fed.map_strategy("sequential"):
        ref = jax.jit(client_program)(w, x, key, 0.5)
    with fed.map_strategy(pool):
        out = jax.jit(client_program)(w, x, key, 0.5)
        other_lr = jax.jit(client_program)(w, x, key, 0.25)  # same program, new value
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(out), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(other_lr[0]["h"], ref[0]["h"] / 2, rtol=1e-6, atol=1e-7)
    # client i's row is client i's output: the per-client sums in NumPy
    np.testing.assert_allclose(out[0]["s"], np.asarray(x).sum(axis=(1, 2)), rtol=1e-5)


def test_broadcast_inputs_travel_once_per_worker(pool):
    """The 1 MiB model that fed.broadcast places at 6 clients reaches each of the 2 workers
    once, as the server value (3 MiB per worker if sent per client); a map whose only input
    is broadcast still runs one client per row."""
    w = jnp.ones(2**18, jnp.float32)
    x = jnp.arange(18, dtype=jnp.float32).reshape(6, 3)

    def program(w, x):
        scaled = fed.map_clients(lambda wc, xc: jnp.sum(wc) * xc, fed.broadcast(w, 6), x)
        only_model = fed.map_clients(lambda wc: jnp.sum(wc[:3]), fed.broadcast(w, 4))
        return scaled, only_model

    with fed.map_strategy(pool):
        scaled = jax.jit(lambda w, x: program(w, x)[0])(w, x)
        in_bytes = pool.last_timing["in_bytes"]
        only_model = jax.jit(lambda w, x: program(w, x)[1])(w, x)
    np.testing.assert_array_equal(scaled, np.asarray(x) * 2**18)
    assert len(in_bytes) == 2 and all(2**20 <= b < 2**20 + 1024 for b in in_bytes), in_bytes
    np.testing.assert_array_equal(only_model, np.full(4, 3.0, np.float32))


def test_not_differentiable_names_the_fix(pool):
    x = jnp.ones((2, 3))

    def loss(scale):
        with fed.map_strategy(pool):
            y = fed.map_clients(lambda s, xc: jnp.sum(xc * s), fed.broadcast(scale, 2), x)
        return jnp.sum(y)

    with pytest.raises(TypeError, match="'processes'.*cannot be differentiated.*sequential"):
        jax.grad(loss)(1.0)


def test_processes_cannot_be_combined_with_a_mesh(pool, mesh):
    x = jnp.ones((8, 3))
    with jax.set_mesh(mesh), fed.map_strategy(pool), pytest.raises(ValueError, match="mesh"):
        fed.map_clients(lambda xc: xc * 2, x)


def test_a_dead_worker_is_reported_and_the_pool_restarts():
    own = ClientProcesses(2)
    try:
        x = jnp.arange(6.0).reshape(3, 2)
        f = jax.jit(lambda x: fed.map_clients(lambda xc: xc * 3.0, x))
        with fed.map_strategy(own):
            np.testing.assert_allclose(f(x), np.asarray(x) * 3.0)
            os.kill(own.pids()[1], signal.SIGKILL)
            with pytest.raises(Exception, match="worker .*exited"):
                jax.block_until_ready(f(x))
            np.testing.assert_allclose(f(x), np.asarray(x) * 3.0)  # fresh workers
    finally:
        own.close()
    assert own.pids() == []


def test_execution_validation_and_choice():
    assert Execution("processes", "scan", 2).mesh() is None
    with pytest.raises(ValueError, match="devices >= 1"):
        Execution("processes", "scan", 0).validate()
    chosen = choose_execution("processes")
    assert chosen.map == "processes" and chosen.devices == len(usable_cores())


def test_default_on_cpu_is_processes_for_convolutional_models_only():
    cnn = get_model("cnn").init(jax.random.key(0))
    dense = get_model("2nn").init(jax.random.key(0))
    multi = len(usable_cores()) > 1
    assert choose_execution(params=cnn).map == ("processes" if multi else "sequential")
    assert choose_execution(params=dense).map == "sequential"
    assert choose_execution().map == "sequential"
    assert choose_execution(devices=1, params=cnn) == Execution("sequential", "scan", 1)
    assert choose_execution(params=cnn, backend="gpu").map == "vmap"


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_runner_rounds_equal_sequential(small_mnist, algorithm):
    """Real MNIST, 2 rounds of 3 of 20 clients (2 workers: blocks of 2, one padded)."""
    train, xt, yt = small_mnist
    model = get_model("2nn")

    def loss(params, batch):
        return softmax_cross_entropy(model.apply(params, batch.x), batch.y, batch.mask)

    def go(execution):
        alg = (fedavg(loss, optax.sgd(0.1)) if algorithm == "fedavg"
               else scaffold(loss, 0.1, train.num_clients))
        return run(alg, model.init(jax.random.key(0)), train,
                   make_evaluator(model.apply, xt, yt, chunk=500), rounds=2,
                   client_fraction=0.15, local_epochs=1, batch_size=10, seed=0, eval_every=1,
                   execution=execution, progress=False)

    ref = go(Execution("sequential", "scan", 1))
    out = go(Execution("processes", "scan", 2))
    for r1, r2 in zip(ref.records, out.records, strict=True):
        assert r1["test_loss"] == pytest.approx(r2["test_loss"], rel=1e-5)
        assert r1["train_loss"] == pytest.approx(r2["train_loss"], rel=1e-5)
    for a, b in zip(jax.tree.leaves(ref.state), jax.tree.leaves(out.state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
