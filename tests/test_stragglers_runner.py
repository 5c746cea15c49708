"""Stragglers in the runner: ``run(..., straggler_fraction, drop_stragglers)``.

Checked against the definitions: each round's per-client epochs are
``straggler_epochs(rng, C, E, fraction)`` drawn from the round's rng right after the cohort
is sampled; a straggler's unused steps are padding; with ``drop_stragglers`` the clients that
ran fewer than E epochs have weight 0. FedAvg's result on a tiny logistic problem is compared
with a NumPy computation (full-batch local steps, so the shuffles do not matter).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax.algorithms import CohortBatches, FederatedAlgorithm, fedavg
from fedax.data import ClientData, make_cohort, num_local_steps, sample_clients
from fedax.models import get_model, softmax_cross_entropy
from fedax.simulation import Execution, run
from fedax.simulation.stragglers import straggler_epochs

ONE_DEVICE = Execution("vmap", "scan", 1)
SIZES = (3, 5, 7, 2, 4, 6, 5, 3)


def _index_data() -> ClientData:
    """x is the example's own index (one feature), so a cohort's sums identify its batches."""
    n = sum(SIZES)
    x = np.arange(n, dtype=np.float32)[:, None]
    y = np.zeros(n, np.int32)
    offsets = np.concatenate([[0], np.cumsum(SIZES)]).astype(np.int64)
    return ClientData(x, y, np.arange(n, dtype=np.int64), offsets)


def _recorder(rounds: int, cohort_size: int, traces: list) -> FederatedAlgorithm:
    """Records, per round and client, the real steps, the weight and the sum of x over
    real examples (an id of the exact batches the client received)."""

    def init(params, key):
        del key
        table = lambda: jnp.zeros((rounds, cohort_size), jnp.float32)  # distinct (donated)
        return {"params": params, "steps": table(), "weights": table(), "xsum": table(),
                "round": jnp.zeros((), jnp.int32)}

    def round_fn(state, cohort: CohortBatches, key):
        del key
        traces.append(1)
        mask = cohort.batches.mask
        steps = jnp.sum(jnp.any(mask > 0, axis=-1), axis=-1).astype(jnp.float32)
        xsum = jnp.sum(cohort.batches.x[..., 0] * mask, axis=(1, 2))
        t = state["round"]
        put = lambda table, row: jax.lax.dynamic_update_slice(table, row[None], (t, 0))
        state = {**state, "steps": put(state["steps"], steps),
                 "weights": put(state["weights"], cohort.num_examples),
                 "xsum": put(state["xsum"], xsum), "round": t + 1}
        return state, {"train_loss": jnp.zeros((), jnp.float32)}

    return FederatedAlgorithm(init, round_fn, lambda state: state["params"])


def _record(train, *, rounds=4, fraction=0.5, epochs=4, batch=2, seed=3, **kwargs):
    cohort_size = len(sample_clients(0, train.num_clients, fraction))
    traces: list = []
    history = run(
        _recorder(rounds, cohort_size, traces), jnp.zeros(()), train, lambda p: (0.0, 0.0),
        rounds=rounds, client_fraction=fraction, local_epochs=epochs, batch_size=batch,
        seed=seed, execution=ONE_DEVICE, **kwargs,
    )
    return history.state, len(traces)


def _expected(train, *, rounds=4, fraction=0.5, epochs=4, batch=2, seed=3, stragglers=0.0):
    """Per round: (ids, epochs, cohort) as the runner's documented draw order gives them."""
    steps = num_local_steps(int(train.sizes.max()), epochs, batch)
    out = []
    for t in range(rounds):
        rng = np.random.default_rng([seed, t])
        ids = np.sort(sample_clients(rng, train.num_clients, fraction))  # in id order
        e = epochs
        if stragglers:
            e = straggler_epochs(rng, len(ids), epochs, stragglers)
        # each client's shuffles from its own default_rng([seed, t, k])
        cohort = make_cohort(train, ids, e, batch, rng, num_steps=steps,
                             client_streams=(seed, t))
        out.append((ids, np.broadcast_to(e, ids.shape), cohort))
    return out


def test_straggler_steps_follow_straggler_epochs_and_compile_once():
    train = _index_data()
    state, traces = _record(train, straggler_fraction=0.5)
    assert traces == 1  # fixed shapes: one compilation for all rounds
    expected = _expected(train, stragglers=0.5)
    saw_straggler = False
    for t, (ids, epochs, cohort) in enumerate(expected):
        steps = epochs * np.ceil(train.sizes[ids] / 2)
        np.testing.assert_array_equal(np.asarray(state["steps"][t]), steps)
        np.testing.assert_array_equal(np.asarray(state["weights"][t]), train.sizes[ids])
        xsum = (cohort.idx * cohort.mask).sum(axis=(1, 2))
        np.testing.assert_array_equal(np.asarray(state["xsum"][t]), xsum)
        saw_straggler |= bool(np.any(epochs < 4))
    assert saw_straggler


def test_drop_stragglers_gives_weight_zero_to_partial_work_only():
    train = _index_data()
    state, _ = _record(train, straggler_fraction=0.5, drop_stragglers=True)
    kept, _ = _record(train, straggler_fraction=0.5)
    dropped_any = False
    for t, (ids, epochs, _) in enumerate(_expected(train, stragglers=0.5)):
        want = np.where(epochs < 4, 0, train.sizes[ids])
        np.testing.assert_array_equal(np.asarray(state["weights"][t]), want)
        dropped_any |= bool(np.any(want == 0))
    assert dropped_any
    # Dropping changes the weights only, not the work or the batches.
    np.testing.assert_array_equal(np.asarray(state["steps"]), np.asarray(kept["steps"]))
    np.testing.assert_array_equal(np.asarray(state["xsum"]), np.asarray(kept["xsum"]))


def test_fraction_zero_draws_nothing_and_matches_a_run_without_stragglers():
    train = _index_data()
    default, _ = _record(train)
    zero, _ = _record(train, straggler_fraction=0.0, drop_stragglers=True)
    for key in ("steps", "weights", "xsum"):
        np.testing.assert_array_equal(np.asarray(zero[key]), np.asarray(default[key]))
    # ...and both are the cohorts of the original draw order (no straggler draw in between).
    for t, (ids, _, cohort) in enumerate(_expected(train)):
        np.testing.assert_array_equal(np.asarray(default["xsum"][t]),
                                      (cohort.idx * cohort.mask).sum(axis=(1, 2)))
        np.testing.assert_array_equal(np.asarray(default["steps"][t]),
                                      4 * np.ceil(train.sizes[ids] / 2))


def test_dropping_a_whole_cohort_is_refused():
    train = _index_data()
    with pytest.raises(ValueError, match="drop_stragglers"):
        _record(train, fraction=0.25, straggler_fraction=1.0, drop_stragglers=True)


# --- FedAvg against NumPy: multinomial logistic regression, full-batch local steps --------

DIM, CLASSES, LR, EPOCHS = 3, 3, 0.5, 3


def _logistic_data():
    rng = np.random.default_rng(0)
    sizes = (4, 6, 5, 3, 7, 2)
    n = sum(sizes)
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    y = rng.integers(0, CLASSES, n).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return ClientData(x, y, np.arange(n, dtype=np.int64), offsets)


def _numpy_gd(w, b, x, y, steps):
    """``steps`` full-batch gradient steps of the mean softmax cross-entropy."""
    w, b = w.astype(np.float64), b.astype(np.float64)
    for _ in range(steps):
        logits = x @ w + b
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(y)), y] -= 1.0
        w, b = w - LR * x.T @ p / len(y), b - LR * p.mean(axis=0)
    return w, b


@pytest.mark.parametrize("drop", [False, True])
def test_fedavg_round_with_stragglers_matches_numpy(drop):
    train = _logistic_data()
    model = get_model("logistic", input_dim=DIM, num_classes=CLASSES)
    w0 = np.random.default_rng(1).normal(size=(DIM, CLASSES)).astype(np.float32) * 0.1
    params = {"dense": {"kernel": jnp.asarray(w0), "bias": jnp.zeros(CLASSES)}}

    def loss(p, batch):
        return softmax_cross_entropy(model.apply(p, batch.x), batch.y, batch.mask)

    history = run(
        fedavg(loss, optax.sgd(LR)), params, train, lambda p: (0.0, 0.0), rounds=1,
        client_fraction=4 / 6, local_epochs=EPOCHS, batch_size=math.inf, seed=5,
        execution=ONE_DEVICE, straggler_fraction=0.5, drop_stragglers=drop,
    )
    rng = np.random.default_rng([5, 0])
    ids = np.sort(sample_clients(rng, train.num_clients, 4 / 6))
    epochs = straggler_epochs(rng, len(ids), EPOCHS, 0.5)
    assert np.any(epochs < EPOCHS)  # the seed gives this round a real straggler
    total_w, total_b, total = 0.0, 0.0, 0.0
    for k, e in zip(ids, epochs, strict=True):
        idx = train.client_indices(int(k))
        w, b = _numpy_gd(w0, np.zeros(CLASSES), train.x[idx].astype(np.float64),
                         train.y[idx], int(e))
        weight = 0.0 if drop and e < EPOCHS else float(len(idx))
        total_w, total_b, total = total_w + weight * w, total_b + weight * b, total + weight
    got = history.state.server.params["dense"]
    np.testing.assert_allclose(np.asarray(got["kernel"]), total_w / total, atol=2e-6)
    np.testing.assert_allclose(np.asarray(got["bias"]), total_b / total, atol=2e-6)
