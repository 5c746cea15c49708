"""cohort_batches: a sampled cohort as a round's input, equal to what the runner feeds."""

import jax
import numpy as np
import optax
import pytest

import fedax
from fedax.algorithms import fedavg
from fedax.data import ClientData, make_cohort, num_local_steps, sample_clients, synthetic
from fedax.models import get_model, softmax_cross_entropy
from fedax.simulation import Execution, cohort_batches, run, use_execution
from fedax.simulation.device_data import byte_codes
from fedax.simulation.host import compiler_options

SEED, FRACTION, EPOCHS, BATCH = 3, 0.25, 2, 8


def _byte_valued(seed=0):
    """k / 255 features: the runner holds them as uint8 codes and decodes per step."""
    rng = np.random.default_rng(seed)
    x = (rng.integers(0, 256, (240, 12)).astype(np.float32) / np.float32(255.0))
    y = rng.integers(0, 4, 240).astype(np.int64)
    parts = np.array_split(rng.permutation(240), 12)
    assert byte_codes(x) is not None
    return ClientData.from_partition(x, y, parts), 12, 4


def _synthetic():
    train, _ = synthetic(0.5, 0.5, num_clients=12, dim=10, num_classes=5, seed=1)
    return train, 10, 5


@pytest.mark.parametrize("make_data", [_synthetic, _byte_valued])
def test_one_round_equals_the_runners_first_round(make_data):
    train, dim, classes = make_data()
    model = get_model("logistic", input_dim=dim, num_classes=classes)

    def loss(params, batch):
        return softmax_cross_entropy(model.apply(params, batch.x), batch.y, batch.mask)

    algorithm = fedavg(loss, optax.sgd(0.3))
    params = model.init(jax.random.key(0))
    execution = Execution("sequential", "scan")
    history = run(algorithm, params, train, lambda p: (0.0, 0.0), rounds=1,
                  client_fraction=FRACTION, local_epochs=EPOCHS, batch_size=BATCH, seed=SEED,
                  execution=execution)

    # Round 0 as the runner draws it: cohort from default_rng([seed, 0]) in id order, client
    # k's shuffles from default_rng([seed, 0, k]), S for the largest client, init key
    # fold_in(key(seed), 2**31 - 1), round key fold_in(key(seed), 0);
    # compiled with the runner's XLA options (bit-identical then; plain jit differs in rounding).
    rng = np.random.default_rng([SEED, 0])
    ids = np.sort(sample_clients(rng, train.num_clients, FRACTION))
    steps = num_local_steps(int(train.sizes.max()), EPOCHS, BATCH)
    cohort = make_cohort(train, ids, EPOCHS, BATCH, rng, num_steps=steps,
                         client_streams=(SEED, 0))
    base = jax.random.key(SEED)
    with use_execution(execution):
        state = algorithm.init(params, jax.random.fold_in(base, 0x7FFFFFFF))
        state, metrics = jax.jit(algorithm.round, compiler_options=compiler_options())(
            state, cohort_batches(train, cohort), jax.random.fold_in(base, 0)
        )
    assert np.isfinite(float(metrics["train_loss"]))
    assert np.abs(state.server.params["dense"]["kernel"]).max() > 0  # the round trained
    for got, want in zip(jax.tree.leaves(state.server.params),
            jax.tree.leaves(history.state.server.params),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_it_is_the_numpy_gather_with_the_cohorts_mask_and_weights():
    train, _, _ = _byte_valued()
    cohort = make_cohort(train, np.array([5, 0, 7]), 2, 7, seed_or_rng=0)
    got = cohort_batches(train, cohort)
    assert got.batches.x.shape == (3, *cohort.idx.shape[1:], 12)
    np.testing.assert_array_equal(got.batches.x, train.x[cohort.idx])
    np.testing.assert_array_equal(got.batches.y, train.y[cohort.idx])
    np.testing.assert_array_equal(got.batches.mask, cohort.mask)
    np.testing.assert_array_equal(got.num_examples, [20, 20, 20])
    np.testing.assert_array_equal(got.client_ids, [5, 0, 7])
    dtypes = [got.batches.x.dtype, got.batches.y.dtype, got.batches.mask.dtype,
              got.num_examples.dtype, got.client_ids.dtype]
    assert dtypes == [np.float32, np.int32, np.float32, np.float32, np.int32]


def test_token_ids_stay_integers():
    """Next-token data (x int ids [N, T], as Shakespeare's) keeps integer features."""
    x = np.arange(40, dtype=np.int32).reshape(10, 4)
    train = ClientData.from_partition(x, x + 1, [np.arange(5), np.arange(5, 10)])
    got = cohort_batches(train, make_cohort(train, [1], 1, 2, seed_or_rng=0))
    assert got.batches.x.dtype == np.int32 and got.batches.x.shape[-1] == 4


def test_the_package_exposes_the_api_lazily():
    assert fedax.cohort_batches is cohort_batches and fedax.run is run
    assert fedax.simulation.cohort_batches is cohort_batches
    for name in fedax.__all__:
        assert getattr(fedax, name) is not None, name
    assert set(fedax.__all__) <= set(dir(fedax))
    with pytest.raises(AttributeError):
        fedax.no_such_name  # noqa: B018
