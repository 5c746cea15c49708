"""Virtual populations and the O(C) cohort sampler (``fedax.data.virtual_population``), the
host client-state store (``fedax.simulation.client_state``) and the population runner
(``fedax.simulation.population``)."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax.algorithms import compose, fedavg, scaffold
from fedax.data import VirtualPopulation, sample_cohort
from fedax.models import softmax_cross_entropy
from fedax.simulation import Execution
from fedax.simulation.client_state import ClientStateStore
from fedax.simulation.population import run_population

DIM, CLASSES = 5, 3


def loss_fn(params, batch):
    return softmax_cross_entropy(batch.x @ params["w"] + params["b"], batch.y, batch.mask)


def init_params():
    rng = np.random.default_rng(1)
    return {
        "w": jnp.asarray(rng.normal(size=(DIM, CLASSES)) * 0.1, jnp.float32),
        "b": jnp.zeros(CLASSES, jnp.float32),
    }


def small_population(num_clients=12):
    return VirtualPopulation(
        num_clients, 1.0, 1.0, dim=DIM, num_classes=CLASSES, seed=5, max_size=14
    )


def counting(algorithm, num_clients=None):
    """The algorithm with a counter of how often its client update is traced."""
    traces = []

    def client_update(*args):
        traces.append(1)
        return algorithm.pieces.client_update(*args)

    return compose(algorithm.pieces._replace(client_update=client_update), num_clients), traces


# ---- (a) SCAFFOLD with the host store = on-device SCAFFOLD ----------------------------------


@pytest.mark.parametrize("devices,memmap", [(1, False), (2, True)])
def test_scaffold_with_host_store_matches_on_device(tmp_path, devices, memmap):
    population, cohort, rounds, seed = small_population(), 5, 3, 0
    n = population.num_clients
    cohorts = [sample_cohort(np.random.default_rng([seed, t]), n, cohort) for t in range(rounds)]
    # partial cohorts, and some client is sampled twice: its c_i comes back from the store
    assert len(set(itertools.chain(*map(list, cohorts)))) < rounds * cohort < rounds * n
    execution = Execution("vmap", "scan", devices)
    kwargs = dict(
        rounds=rounds,
        cohort_size=cohort,
        local_epochs=2,
        batch_size=4,
        seed=seed,
        execution=execution,
    )

    on_device = scaffold(loss_fn, 0.3, n, server_optimizer=optax.sgd(0.7))
    reference = run_population(on_device, init_params(), population, None, **kwargs)

    store = ClientStateStore(init_params(), n, tmp_path / "c" if memmap else None)
    counted, traces = counting(scaffold(loss_fn, 0.3, n, server_optimizer=optax.sgd(0.7)), n)
    hosted = run_population(counted, init_params(), population, None, client_state=store,
                            **kwargs)
    assert len(traces) == 1  # one compilation for every round
    assert hosted.state.clients is None  # nothing of size N in the algorithm state

    for a, b in zip(
        jax.tree.leaves(reference.state.server.params),
        jax.tree.leaves(hosted.state.server.params), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(
        jax.tree.leaves(reference.state.server.control),
        jax.tree.leaves(hosted.state.server.control), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    everyone = store.gather(np.arange(n))
    for a, b in zip(
        jax.tree.leaves(reference.state.clients),
        jax.tree.leaves(everyone), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    never = np.setdiff1d(np.arange(n), np.concatenate(cohorts))
    assert never.size and not np.any(store.gather(never)["w"])
    assert [r["train_loss"] for r in reference.records] == pytest.approx(
        [r["train_loss"] for r in hosted.records], rel=1e-6
    )


def test_host_store_validation():
    population = small_population()
    kwargs = dict(rounds=1, cohort_size=3, local_epochs=1, batch_size=4,
                  execution=Execution("vmap", "scan", 1))
    store = ClientStateStore(init_params(), population.num_clients)
    stateless = fedavg(loss_fn, optax.sgd(0.1))
    with pytest.raises(ValueError, match="per-client state"):
        run_population(stateless, init_params(), population, None, client_state=store, **kwargs)
    small = ClientStateStore(init_params(), population.num_clients - 1)
    alg = scaffold(loss_fn, 0.1, population.num_clients)
    with pytest.raises(ValueError, match="store has"):
        run_population(alg, init_params(), population, None, client_state=small, **kwargs)


# ---- (b) the store ------------------------------------------------------------------------


def template():
    return {"a": jnp.zeros((2, 3), jnp.float32), "b": jax.ShapeDtypeStruct((), jnp.int32)}


def test_store_gather_scatter_against_numpy():
    rng = np.random.default_rng(0)
    store = ClientStateStore(template(), 10)
    ref_a, ref_b = np.zeros((10, 2, 3), np.float32), np.zeros(10, np.int32)
    assert store.nbytes == ref_a.nbytes + ref_b.nbytes
    for ids in ([7, 2, 5], [2, 9], [0]):
        values = {
            "a": rng.normal(size=(len(ids), 2, 3)).astype(np.float32),
            "b": rng.integers(-5, 5, len(ids)).astype(np.int32),
        }
        store.scatter(np.array(ids), values)
        ref_a[ids], ref_b[ids] = values["a"], values["b"]
        got = store.gather([9, 2, 7, 0, 3])
        np.testing.assert_array_equal(got["a"], ref_a[[9, 2, 7, 0, 3]])
        np.testing.assert_array_equal(got["b"], ref_b[[9, 2, 7, 0, 3]])
    got["a"][:] = 99.0  # gather returns copies
    assert not np.any(store.gather([3])["a"])
    with pytest.raises(ValueError, match="distinct"):
        store.scatter([1, 1], {"a": np.zeros((2, 2, 3)), "b": np.zeros(2)})
    with pytest.raises(ValueError, match="lie in"):
        store.gather([10])
    with pytest.raises(ValueError, match="values leaf"):
        store.scatter([1], {"a": np.zeros((1, 3, 2)), "b": np.zeros(1)})


def test_memmap_store_round_trips(tmp_path):
    store = ClientStateStore(template(), 1000, tmp_path)
    values = {
        "a": np.arange(12, dtype=np.float32).reshape(2, 2, 3),
        "b": np.array([4, -2], np.int32),
    }
    store.scatter([999, 3], values)
    store.flush()
    assert isinstance(store.arrays[0], np.memmap)
    reopened = ClientStateStore(template(), 1000, tmp_path, mode="r+")
    got = reopened.gather([3, 999, 500])
    np.testing.assert_array_equal(got["a"], [values["a"][1], values["a"][0], np.zeros((2, 3))])
    np.testing.assert_array_equal(got["b"], [-2, 4, 0])
    with pytest.raises(ValueError, match="template needs"):
        ClientStateStore(template(), 999, tmp_path, mode="r+")


# ---- (c) the cohort sampler --------------------------------------------------------------


def test_sample_cohort_distinct_in_range_deterministic():
    for n, c in [(10, 3), (1000, 1000), (10**6, 1000)]:
        ids = sample_cohort(np.random.default_rng([7, 1]), n, c)
        assert ids.dtype == np.int64 and len(ids) == c
        assert len(np.unique(ids)) == c and ids.min() >= 0 and ids.max() < n
        assert np.all(np.diff(ids) > 0)  # sorted
        np.testing.assert_array_equal(ids, sample_cohort(np.random.default_rng([7, 1]), n, c))
    assert not np.array_equal(sample_cohort(1, 10**6, 1000), sample_cohort(2, 10**6, 1000))
    # O(C): a population far too large to enumerate
    ids = sample_cohort(0, 10**15, 5)
    assert len(set(ids.tolist())) == 5 and ids.max() < 10**15
    with pytest.raises(ValueError, match="cohort_size"):
        sample_cohort(0, 3, 4)


def test_sample_cohort_is_uniform_over_subsets():
    rng = np.random.default_rng(0)
    draws = 6000
    counts = {}
    for _ in range(draws):
        key = tuple(sample_cohort(rng, 5, 2).tolist())
        counts[key] = counts.get(key, 0) + 1
    assert len(counts) == math.comb(5, 2)
    expected = draws / len(counts)
    chi2 = sum((v - expected) ** 2 / expected for v in counts.values())
    assert chi2 < 27.9  # 9 degrees of freedom, p = 0.001


# ---- (d) the virtual population ----------------------------------------------------------


def test_virtual_client_is_a_pure_function_of_seed_and_id():
    population = VirtualPopulation(10**6, seed=3)  # Synthetic(1, 1): 60 features, 10 classes
    x, y = population.client(123_456)
    assert x.dtype == np.float32 and y.dtype == np.int32
    assert x.shape == (len(y), 60) and 50 <= len(y) <= 200 and y.max() < 10
    again = population.client(123_456)
    np.testing.assert_array_equal(again[0], x)
    np.testing.assert_array_equal(again[1], y)
    # the population size does not enter a client's data; the seed does
    other = VirtualPopulation(200_000, seed=3).client(123_456)
    np.testing.assert_array_equal(other[0], x)
    assert not np.array_equal(VirtualPopulation(10**6, seed=4).client(123_456)[0][:1], x[:1])
    assert population.sizes_of([123_456])[0] == len(y)


def test_virtual_client_data_layout_and_sizes():
    population = VirtualPopulation(1000, seed=0, max_size=120)
    ids = np.array([999, 4, 500, 17])
    sizes = population.sizes_of(ids)
    assert np.all((50 <= sizes) & (sizes <= 120))
    assert sizes.max() == 120  # truncated power law: P(n_k = 120) is about 0.45
    train = population.client_data(ids)  # compact
    fixed = population.client_data(ids, fixed_layout=True)
    test = population.client_data(ids, "test")
    cut = np.floor(0.9 * sizes).astype(np.int64)
    np.testing.assert_array_equal(train.sizes, cut)
    np.testing.assert_array_equal(fixed.sizes, cut)
    np.testing.assert_array_equal(test.sizes, sizes - cut)
    rows = population.capacity("train")
    assert rows == 108 and fixed.x.shape == (4 * rows, 60) and fixed.y.shape == (4 * rows,)
    for j, k in enumerate(ids):
        x, y = population.client(int(k))
        np.testing.assert_array_equal(fixed.x[j * rows : j * rows + cut[j]], x[: cut[j]])
        np.testing.assert_array_equal(fixed.x[fixed.client_indices(j)], x[: cut[j]])
        np.testing.assert_array_equal(train.y[train.client_indices(j)], y[: cut[j]])
        np.testing.assert_array_equal(test.x[test.client_indices(j)], x[cut[j] :])
    assert not np.any(fixed.x[cut[0] : rows])  # padding rows
    fixed_size = VirtualPopulation(50, sizes=7, dim=3)
    assert fixed_size.sizes_of([0, 49]).tolist() == [7, 7]
    assert fixed_size.client(3)[0].shape == (7, 3)
    iid = VirtualPopulation(50, iid=True, seed=1)
    assert iid.client(0)[0].shape[1] == 60
    with pytest.raises(ValueError, match="alpha"):
        VirtualPopulation(10, alpha=-1.0)
    with pytest.raises(IndexError):
        population.client(1000)


# ---- (e) the runner -----------------------------------------------------------------------


def test_population_runner_compiles_once_and_records():
    population = small_population(40)
    alg, traces = counting(fedavg(loss_fn, optax.sgd(0.3)))
    evaluations = []

    def evaluate(params):
        evaluations.append(params)
        return 0.5, 1.0

    history = run_population(
        alg,
        init_params(),
        population,
        evaluate,
        rounds=4,
        cohort_size=6,
        local_epochs=1,
        batch_size=3,
        seed=2,
        eval_every=2,
        execution=Execution("vmap", "scan", 1),
    )
    assert len(traces) == 1  # four different cohorts, one compilation
    assert len(history.round_times) == 4 and all(t > 0 for t in history.round_times)
    assert [r["round"] for r in history.records] == [2, 4] and len(evaluations) == 2
    assert all(math.isfinite(r["train_loss"]) for r in history.records)
    assert history.records[-1]["test_accuracy"] == 0.5
    # the same seed gives the same run; B = inf works too
    again = run_population(
        fedavg(loss_fn, optax.sgd(0.3)),
        init_params(),
        population,
        None,
        rounds=4,
        cohort_size=6,
        local_epochs=1,
        batch_size=3,
        seed=2,
        execution=Execution("vmap", "scan", 1),
    )
    for a, b in zip(
        jax.tree.leaves(history.state.server.params),
        jax.tree.leaves(again.state.server.params), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    full = run_population(
        fedavg(loss_fn, optax.sgd(0.3)),
        init_params(),
        population,
        None,
        rounds=1,
        cohort_size=6,
        local_epochs=2,
        batch_size=math.inf,
        execution=Execution("vmap", "scan", 1),
    )
    assert math.isfinite(full.records[0]["train_loss"])
