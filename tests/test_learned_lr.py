"""A learned server learning rate held in the server optimizer's state: against the
closure-built learner of fedax.hyper, the runner's holdout cohorts, and `fedax run` with
`server.lr: learned`."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import TINY_CONFIG, run_fedax

from fedax import data as fdata
from fedax.algorithms import CohortBatches, fedavg, scaffold, server_optimizer
from fedax.client import Batches
from fedax.hyper import HyperCohort, learned_server_lr, learned_server_lr_in_state
from fedax.simulation import Execution, run
from fedax.simulation.sources import HoldoutSource, PartitionSource

D, K, C, S, B = 4, 3, 6, 3, 5


def loss_fn(params, batch):
    logits = batch.x @ params["w"] + params["b"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch.y[:, None], axis=1)[:, 0]
    return jnp.sum(nll * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)


def cohorts(rounds, seed=0):
    rng = np.random.default_rng(seed)
    w_true = rng.normal(size=(D, K))

    def one():
        x = rng.normal(size=(C, S, B, D)).astype(np.float32)
        y = np.argmax(x @ w_true, axis=-1).astype(np.int32)
        mask = np.ones((C, S, B), np.float32)
        return CohortBatches(Batches(x, y, mask), np.full(C, 15.0, np.float32),
                             np.arange(C, dtype=np.int32))

    return [HyperCohort(one(), one()) for _ in range(rounds)]


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_lr_in_state_equals_the_closure_learner(mode):
    """Learning η in the optimizer state is the same computation as building the algorithm
    around a traced η (``learned_server_lr``), round for round."""
    params = {"w": jnp.zeros((D, K), jnp.float32), "b": jnp.zeros(K, jnp.float32)}
    in_state = learned_server_lr_in_state(
        fedavg(loss_fn, optax.sgd(0.1), server_optimizer("sgd", lr=0.2)), 0.2, loss_fn,
        optax.adam(0.1), mode)
    closure = learned_server_lr(lambda lr: fedavg(loss_fn, optax.sgd(0.1), optax.sgd(lr)),
                                0.2, loss_fn, optax.adam(0.1), mode)
    a, b = in_state.init(params, None), closure.init(params, None)
    step_a, step_b = jax.jit(in_state.round), jax.jit(closure.round)
    lrs = []
    for cohort in cohorts(6):
        a, ma = step_a(a, cohort, None)
        b, mb = step_b(b, cohort, None)
        for name in ("server_lr", "holdout_loss", "hypergradient_norm", "train_loss"):
            np.testing.assert_allclose(ma[name], mb[name], rtol=2e-5, err_msg=name)
        lrs.append(float(ma["server_lr"]))
    np.testing.assert_allclose(in_state.server_params(a)["w"], closure.server_params(b)["w"],
                               rtol=2e-5, atol=1e-6)
    assert lrs[-1] > 1.2 * lrs[0]  # it learns (the start is too small)


def test_lr_in_state_needs_an_injected_rate():
    alg = learned_server_lr_in_state(fedavg(loss_fn, optax.sgd(0.1), optax.sgd(1.0)), 1.0,
                                     loss_fn)
    params = {"w": jnp.zeros((D, K)), "b": jnp.zeros(K)}
    with pytest.raises(ValueError, match="server_optimizer"):
        alg.init(params, None)


def test_holdout_source_gives_each_holdout_client_all_its_examples():
    train, _ = fdata.synthetic(0.5, 0.5, num_clients=12, seed=0)
    source = HoldoutSource(PartitionSource(train, 0.25, 1, 10, seed=3), holdout_clients=4)
    data = source.round_data(5, pad_to=2)
    (idx, mask), (num, ids) = data.sharded[1], data.plain[1]
    rng = np.random.default_rng([3, 5, 1])
    assert list(ids) == sorted(rng.choice(12, 4, replace=False))  # drawn apart from training
    for c, k in enumerate(ids):
        own = train.client_indices(int(k))
        assert num[c] == len(own) and mask[c].sum() == len(own)
        assert sorted(idx[c, 0][mask[c, 0] > 0]) == sorted(own)
    # Through the runner: a learner that receives these cohorts runs and records η.
    params = {"w": jnp.zeros((60, 10)), "b": jnp.zeros(10)}

    def logistic_loss(params, batch):
        logits = batch.x @ params["w"] + params["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch.y) @ batch.mask \
            / jnp.maximum(jnp.sum(batch.mask), 1.0)

    alg = learned_server_lr_in_state(
        scaffold(logistic_loss, 0.05, 12, server_optimizer=server_optimizer("sgd", lr=0.5)),
        0.5, logistic_loss)
    history = run(alg, params, source, None, rounds=3, execution=Execution("vmap", "scan", 1))
    assert [r["round"] for r in history.records] == [1, 2, 3]
    assert all(r["server_lr"] > 0 and "holdout_loss" in r for r in history.records)
    assert history.records[0]["server_lr"] == pytest.approx(0.5)
    assert history.records[-1]["server_lr"] != pytest.approx(0.5)


def test_fedax_run_with_a_learned_server_lr(tmp_path):
    config = tmp_path / "learned.yaml"
    config.write_text(TINY_CONFIG.replace("rounds: 2", "rounds: 3") +
                      "server:\n  lr: learned\nlearned_lr:\n  init: 0.5\n  hyper_lr: 0.1\n")
    done = run_fedax("run", str(config), "--out", str(tmp_path / "out"), "--no-progress",
                     cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()]
    lrs = [r["server_lr"] for r in records]
    assert lrs[0] == pytest.approx(0.5) and len(set(lrs)) == 3  # logged, and it moves
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["server_optimizer"]["learned_lr"]["init"] == 0.5
    assert summary["last_record"]["server_lr"] == lrs[-1]
    # learned_lr without server.lr: learned is a one-line error naming the key.
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY_CONFIG + "learned_lr:\n  hyper_lr: 0.1\n")
    failed = run_fedax("run", str(bad), "--out", str(tmp_path / "bad"), cwd=tmp_path)
    assert failed.returncode != 0
    assert len(failed.stderr.strip().splitlines()) == 1
    assert "learned_lr" in failed.stderr and "server.lr: learned" in failed.stderr
