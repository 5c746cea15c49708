"""The training set on the device: exact 8-bit codes and per-device gathers."""

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from fedax import data as fdata
from fedax.algorithms import fedavg
from fedax.models import get_model, softmax_cross_entropy
from fedax.simulation import Execution, run
from fedax.simulation import device_data as dd
from fedax.simulation import sources as sources_module


@pytest.fixture(scope="module")
def mnist_small():
    arrays = fdata.load_mnist()
    return arrays["x_train"][:1200], arrays["y_train"][:1200]


def test_mnist_pixels_are_exact_byte_codes(mnist_small):
    x, _ = mnist_small
    codes = dd.byte_codes(x)
    assert codes is not None and codes.dtype == np.uint8 and codes.shape == x.shape
    # Independent reference: the loader's own scaling of the raw bytes, element by element.
    np.testing.assert_array_equal(codes.astype(np.float32) / np.float32(255.0), x)
    assert codes.max() == 255 and codes.min() == 0


@pytest.mark.parametrize(
    "name, transform",
    [
        ("normalized", lambda x: (x - 0.1307) / 0.3081),
        ("off by one ulp", lambda x: np.nextafter(x, np.float32(2.0))),
        ("nan", lambda x: np.where(np.arange(x.size).reshape(x.shape) == 7, np.nan, x)),
        ("above one", lambda x: x * np.float32(1.5)),
        ("float64", lambda x: x.astype(np.float64)),
    ],
)
def test_data_that_is_not_exactly_k_over_255_stays_float(mnist_small, name, transform):
    x = transform(mnist_small[0][:50])
    assert dd.byte_codes(x) is None, name
    features = dd.put_features(x)
    assert features.table is None
    assert features.values.dtype == jax.dtypes.canonicalize_dtype(x.dtype)


def test_a_single_bad_element_in_a_later_chunk_is_caught(monkeypatch, mnist_small):
    monkeypatch.setattr(dd, "_CHECK_CHUNK", 1000)  # many chunks
    x = mnist_small[0][:100].copy()
    x.reshape(-1)[-3] = np.float32(0.5)  # 127.5 / 255: not a code
    assert dd.byte_codes(x) is None


def test_gather_decodes_exactly_and_respects_a_clients_sharding(mnist_small):
    x, _ = mnist_small
    idx = np.random.default_rng(0).integers(0, len(x), (4, 3, 5)).astype(np.int32)
    features = dd.put_features(x)
    got = jax.jit(lambda v, i: dd.cohort_features(v, features.table, i).decode())(
        features.values, idx)
    np.testing.assert_array_equal(np.asarray(got), x[idx])  # NumPy reference
    assert got.dtype == np.float32

    mesh = jax.make_mesh((4,), ("clients",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        values = dd.put_features(x, NamedSharding(mesh, PartitionSpec())).values
        sharded_idx = jax.device_put(idx, NamedSharding(mesh, PartitionSpec("clients")))
        got = jax.jit(lambda v, i: dd.cohort_features(
            v, features.table, i, PartitionSpec("clients")).codes)(values, sharded_idx)
    assert got.sharding.spec[0] == "clients"
    # each device holds only its own client's examples
    assert {s.data.shape for s in got.addressable_shards} == {(1, 3, 5, 28, 28, 1)}
    np.testing.assert_array_equal(np.asarray(got) / np.float32(255), x[idx])


@pytest.mark.parametrize("devices", [1, 2])
def test_runs_on_codes_equal_runs_on_floats_bit_for_bit(monkeypatch, mnist_small, devices):
    x, y = mnist_small
    train = fdata.ClientData.from_partition(x, y, fdata.iid(len(y), 8, seed=0))
    model = get_model("2nn")

    def loss(params, batch):
        return softmax_cross_entropy(model.apply(params, batch.x), batch.y, batch.mask)

    def once():
        history = run(
            fedavg(loss, optax.sgd(0.1)), model.init(jax.random.key(0)), train,
            lambda p: (0.0, 0.0), rounds=2, client_fraction=0.5, local_epochs=1,
            batch_size=10, seed=3, execution=Execution("sequential", "scan", devices),
        )
        return history.state.server.params, history.records[-1]["train_loss"]

    compact_params, compact_loss = once()
    monkeypatch.setattr(sources_module, "put_features",
                        functools.partial(dd.put_features, compact=False))
    float_params, float_loss = once()
    assert compact_loss == float_loss
    for a, b in zip(jax.tree.leaves(compact_params), jax.tree.leaves(float_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_coded_cohorts_decode_per_step_to_the_float_values(mnist_small):
    """A cohort's ``ByteCoded`` features: the local-training result and the federated loss
    equal those on the float features bit for bit (the loss only ever sees floats)."""
    from fedax.algorithms import CohortBatches, federated_loss
    from fedax.client import Batches, decoded, local_train
    from fedax.data import ByteCoded

    x, y = mnist_small
    features = dd.put_features(x)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(y), size=(2, 3, 5)).astype(np.int32)  # clients, steps, batch
    coded = dd.cohort_features(features.values, features.table, idx)
    assert isinstance(coded, ByteCoded) and coded.codes.dtype == np.uint8
    np.testing.assert_array_equal(coded.decode(), x[idx])  # NumPy reference
    mask = np.ones(idx.shape, np.float32)
    batches = Batches(coded, y[idx].astype(np.int32), mask)
    floats = Batches(x[idx], y[idx].astype(np.int32), mask)
    assert decoded(floats) is floats
    model = get_model("2nn")
    params = model.init(jax.random.key(0))

    def loss(p, b):
        assert b.x.dtype == np.float32  # the loss never sees codes
        return softmax_cross_entropy(model.apply(p, b.x), b.y, b.mask)

    def train(b):
        return jax.vmap(lambda bb: local_train(loss, params, bb, optax.sgd(0.1)))(b)

    for a, b in zip(jax.tree.leaves(jax.jit(train)(batches)),
                    jax.tree.leaves(jax.jit(train)(floats)), strict=True):
        np.testing.assert_array_equal(a, b)
    cohort = lambda b: CohortBatches(b, np.array([15.0, 10.0], np.float32), np.arange(2))
    fl = jax.jit(federated_loss, static_argnums=0)
    np.testing.assert_array_equal(fl(loss, params, cohort(batches)),
                                  fl(loss, params, cohort(floats)))
    # data that is not codes stays float
    plain = dd.cohort_features(jax.numpy.asarray(x), None, idx)
    np.testing.assert_array_equal(plain, x[idx])
