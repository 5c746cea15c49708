"""Non-finite values never reach an aggregate or a checkpoint.

* ``weighted_mean``: zero-weight clients are left out by selection (a NaN there changes
  nothing), all-zero weights give zeros, negative weights are refused;
* FedAvg, FedSGD and SCAFFOLD leave out a client whose update is not finite, count it in
  ``rejected_clients``, and equal the same round run without that client;
* the runner checks every round inside the compiled program and stops a diverging run
  before a non-finite state is checkpointed; the rejected count survives resume exactly.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax import data as fdata
from fedax import federated as fed
from fedax.algorithms import fedavg, fedsgd, scaffold
from fedax.models import get_model, softmax_cross_entropy
from fedax.simulation import DivergenceError, Execution, cohort_batches, run
from fedax.simulation import checkpoint as ckpt

# ---- weighted_mean edge cases ---------------------------------------------------------


def test_zero_weight_nan_client_is_left_out_of_value_and_derivatives():
    x = np.array([[1.0, 2.0], [np.nan, np.inf], [3.0, 6.0]], np.float32)
    w = np.array([1.0, 0.0, 3.0], np.float32)
    expected = np.average(x[[0, 2]], axis=0, weights=w[[0, 2]])  # NumPy reference
    for fn in (fed.weighted_mean, jax.jit(fed.weighted_mean)):
        np.testing.assert_allclose(fn(jnp.asarray(x), jnp.asarray(w)), expected, rtol=1e-6)
    # derivatives in the values and in the weights stay finite
    gx, gw = jax.grad(lambda a, b: jnp.sum(fed.weighted_mean(a, b)), argnums=(0, 1))(
        jnp.asarray(x), jnp.asarray(w))
    assert np.all(np.isfinite(gx)) and np.all(np.isfinite(gw))
    np.testing.assert_allclose(gx[0], w[0] / w.sum(), rtol=1e-6)
    assert np.all(gx[1] == 0.0)
    # d/dw_2 of sum_k(sum_i w_i x_ik / W) = (sum_k x_2k - sum_k mean_k) / W
    np.testing.assert_allclose(gw[2], (x[2].sum() - expected.sum()) / w.sum(), rtol=1e-5)


@pytest.mark.parametrize("jit", [False, True])
def test_all_zero_weights_give_zeros_not_nan(jit):
    fn = jax.jit(fed.weighted_mean) if jit else fed.weighted_mean
    tree = {"a": jnp.ones((3, 2)), "b": jnp.full((3,), jnp.nan)}
    out = fn(tree, jnp.zeros(3))
    np.testing.assert_array_equal(out["a"], np.zeros(2))
    np.testing.assert_array_equal(out["b"], 0.0)


@pytest.mark.parametrize("weights", [[1.0, -1.0, 0.0], [-1.0, 2.0, 3.0]])
def test_negative_weights_are_refused(weights):
    with pytest.raises(ValueError, match=">= 0"):
        fed.weighted_mean(jnp.ones((3, 2)), jnp.asarray(weights))


# ---- algorithms: a client with non-finite data is rejected and counted ----------------


def _problem(num_clients=4, poisoned=(1,)):
    """Synthetic(0.5, 0.5) with one client's features made NaN; logistic regression."""
    train, _ = fdata.synthetic(0.5, 0.5, num_clients, dim=8, num_classes=3, seed=0,
                               sizes=[30, 40, 25, 35][:num_clients])
    x = train.x.copy()
    for k in poisoned:
        x[train.client_indices(k)] = np.nan
    bad = fdata.ClientData(x, train.y, train.indices, train.offsets)
    model = get_model("logistic", input_dim=8, num_classes=3)
    params = model.init(jax.random.key(0))

    def loss(p, batch):
        return softmax_cross_entropy(model.apply(p, batch.x), batch.y, batch.mask)

    return train, bad, params, loss


def _round(algorithm, params, data, cohort):
    state = algorithm.init(params, jax.random.key(1))
    return jax.jit(algorithm.round)(state, cohort_batches(data, cohort), jax.random.key(2))


@pytest.mark.parametrize("name", ["fedavg", "fedsgd", "scaffold"])
def test_nan_client_is_excluded_and_counted_while_others_are_averaged(name):
    train, bad, params, loss = _problem()
    algorithm = {
        "fedavg": lambda: fedavg(loss, optax.sgd(0.1)),
        "fedsgd": lambda: fedsgd(loss, 0.1),
        "scaffold": lambda: scaffold(loss, 0.1, 4, weighting="num_examples"),
    }[name]()
    batch = math.inf if name == "fedsgd" else 10
    cohort = fdata.make_cohort(bad, np.array([0, 1, 2]), 1, batch, 7)
    with_nan, metrics = _round(algorithm, params, bad, cohort)
    # Reference: the same round with client 1 turned into padding (no examples, weight 0)
    # on the clean data, so the other clients' shuffles and steps are unchanged.
    mask, counts = cohort.mask.copy(), cohort.num_examples.copy()
    mask[1], counts[1] = 0.0, 0.0
    without, ref_metrics = _round(
        algorithm, params, train, cohort._replace(mask=mask, num_examples=counts))
    assert int(metrics["rejected_clients"]) == 1
    assert int(ref_metrics["rejected_clients"]) == 0
    for a, b in zip(jax.tree.leaves(with_nan), jax.tree.leaves(without), strict=True):
        if jnp.issubdtype(a.dtype, jnp.floating):
            assert np.all(np.isfinite(a))
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(metrics["train_loss"], ref_metrics["train_loss"], rtol=1e-5)
    if name == "scaffold":  # the rejected client's own control variate is untouched
        for leaf in jax.tree.leaves(with_nan.clients):
            assert np.all(np.asarray(leaf)[1] == 0.0)


# ---- the runner: per-round checks, no NaN checkpoint, exact resume ---------------------


def _evaluate(params):
    return 0.5, 1.0


def _run(algorithm, params, data, tmp_path=None, **kwargs):
    options = dict(rounds=4, client_fraction=0.5, local_epochs=1, batch_size=10, seed=3,
                   eval_every=2, execution=Execution("sequential", "scan", 1))
    options.update(kwargs)
    if tmp_path is not None:
        options.update(checkpoint_dir=tmp_path, checkpoint_every=1)
    return run(algorithm, params, data, _evaluate, **options)


def test_runner_counts_rejected_clients_per_record_and_resumes_them_exactly(tmp_path):
    _, bad, params, loss = _problem(poisoned=(1, 3))
    algorithm = fedavg(loss, optax.sgd(0.1))
    full = _run(algorithm, params, bad, max_rejected_fraction=1.0)
    counts = [r["rejected_clients"] for r in full.records]
    # Reference: the runner's cohorts (rng [seed, t]) against the poisoned ids
    expected = []
    for t in range(4):
        ids = fdata.sample_clients(np.random.default_rng([3, t]), 4, 0.5)
        expected.append(int(np.isin(ids, [1, 3]).sum()))
    assert counts == [expected[0] + expected[1], expected[2] + expected[3]]
    assert sum(counts) > 0
    for leaf in jax.tree.leaves(full.state.server.params):
        assert np.all(np.isfinite(leaf))
    # Resumed from round 3 (between two records): the count since the last record comes
    # from the checkpoint, and the records equal the uninterrupted run's.
    _run(algorithm, params, bad, tmp_path, max_rejected_fraction=1.0)
    (tmp_path / "ckpt_4.msgpack").unlink()
    resumed = _run(algorithm, params, bad, tmp_path, max_rejected_fraction=1.0, resume=True)
    assert resumed.resumed_from == 3
    strip = lambda rs: [{k: v for k, v in r.items() if k != "elapsed_s"} for r in rs]  # noqa: E731
    assert strip(resumed.records) == strip(full.records)


def test_too_many_rejected_clients_stop_the_run(tmp_path):
    _, bad, params, loss = _problem(poisoned=(0, 1, 2, 3))
    with pytest.raises(DivergenceError, match="round 1: 2 of 2 clients") as err:
        _run(fedavg(loss, optax.sgd(0.1)), params, bad, tmp_path)
    assert err.value.round == 1
    assert ckpt.list_checkpoints(tmp_path) == []


def test_a_diverging_run_stops_before_any_nan_checkpoint_exists(tmp_path):
    """client_lr so large that the model overflows; evaluation only every 4 rounds and a
    checkpoint every round, as in the report (rounds 1-2 had been checkpointed with NaN)."""
    train, _, params, loss = _problem()
    algorithm = fedavg(loss, optax.sgd(1e30), optax.sgd(1e30))
    with pytest.raises(DivergenceError) as err:
        _run(algorithm, params, train, tmp_path, eval_every=4, max_rejected_fraction=1.0)
    assert err.value.round <= 2
    for _, path in ckpt.list_checkpoints(tmp_path):
        for leaf in ckpt.read_checkpoint(path)["state"]:
            values = np.frombuffer(leaf["data"], dtype=leaf["data_dtype"])
            if np.issubdtype(values.dtype, np.floating):
                assert np.all(np.isfinite(values)), path
