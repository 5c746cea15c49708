"""A user's own algorithm with per-client state, defined here and registered with one line,
runs in every engine that can carry it, from its declarations alone: the synchronous
simulator and the networked runtime (where it equals the simulator), and it is refused for
the asynchronous engine in the config's one-line form. Nothing in fedax names it.

The algorithm is a FedDyn-like client correction (Acar et al., ICLR 2021, without the
server's h): client i keeps g_i (zeros at first) and minimises
ℓ_i(y) − ⟨g_i, y⟩ + (α/2)‖y − x‖² from the server model x, then g_i ← g_i − α (y_i − x).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from test_runtime import (  # noqa: F401 (pki and parts are that file's fixtures)
    NUM_CLIENTS,
    assert_trees_close,
    make_task,
    networked,
    parts,
    pki,
    simulated,
)

from fedax.algorithms import ALGORITHMS, AlgorithmSpec, ClientMessage, compose, register
from fedax.algorithms.fedavg import model_pieces, stopping_stats
from fedax.client import local_train
from fedax.spec.config import ConfigError, validate_config

ALPHA = 0.5


def _dot(a, b):
    return sum(jnp.vdot(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                               strict=True))


def toy_dyn(loss_fn, *, num_clients, client_lr, server_optimizer, aggregator, alpha=ALPHA):
    def client_update(x, g, batches, num_examples):
        def objective(y, batch):
            gap = jax.tree.map(jnp.subtract, y, x)
            return loss_fn(y, batch) - _dot(g, y) + 0.5 * alpha * _dot(gap, gap)

        result = local_train(objective, x, batches, optax.sgd(client_lr))
        delta = jax.tree.map(jnp.subtract, x, result.params)  # x − y_i
        new_g = jax.tree.map(lambda gi, d: gi + alpha * d, g, delta)
        return ClientMessage(delta, num_examples, stopping_stats(result), client_state=new_g)

    pieces = model_pieces(client_update, server_optimizer, aggregator)._replace(
        client_state=lambda params: jax.tree.map(jnp.zeros_like, params))
    return compose(pieces, num_clients)


@pytest.fixture(scope="module")
def registered():
    spec = register(AlgorithmSpec("toy_dyn", toy_dyn, {"alpha": ALPHA}, doc="a test's own",
                                  exact_sums=(), client_state=True))
    yield spec
    del ALGORITHMS["toy_dyn"]


def test_own_stateful_algorithm_runs_over_the_network_as_in_the_simulator(
        registered, pki, parts, tmp_path):  # noqa: F811 (test_runtime's fixtures)
    rounds = 3
    task = make_task("toy_dyn")
    server = networked(task, pki, parts, tmp_path, rounds)
    expected = simulated(task, parts, rounds)
    assert_trees_close(server.params, expected)
    # the state is the clients' own, and it matters: FedAvg from the same start differs
    assert all((tmp_path / f"client{k}" / "client_state.msgpack").exists()
               for k in range(NUM_CLIENTS))
    fedavg = simulated(make_task("fedavg"), parts, rounds)
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
        jax.tree.leaves(fedavg), jax.tree.leaves(expected), strict=True)) > 1e-4


def test_own_stateful_algorithm_is_refused_for_async_in_one_line(registered):
    base = {"rounds": 2, "dataset": "synthetic", "num_clients": 6, "model": "logistic",
            "algorithm": "toy_dyn", "client_fraction": 0.5, "local_epochs": 1,
            "batch_size": 10, "client_lr": 0.1}
    assert validate_config(base).algorithm == "toy_dyn"  # sync: accepted
    with pytest.raises(ConfigError) as err:
        validate_config({**base, "execution": {"mode": "async"}})
    message = str(err.value)
    assert "\n" not in message and message.startswith("config key 'algorithm'")
    assert "keeps per-client state" in message and "toy_dyn" not in message.split(":")[0]
