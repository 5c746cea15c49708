"""Partitioners: sizes, coverage, McMahan et al.'s shard structure, determinism."""

import numpy as np
import pytest

from fedax.data import iid, load_mnist, pathological, unbalanced

MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


def synthetic_mnist_labels() -> np.ndarray:
    """A label vector with MNIST's real training class counts, in shuffled order."""
    labels = np.repeat(np.arange(10), MNIST_TRAIN_COUNTS)
    return np.random.default_rng(123).permutation(labels)


def real_mnist_labels() -> np.ndarray:
    """The real MNIST training labels (fetched into the cache if needed)."""
    return load_mnist()["y_train"]


@pytest.fixture(params=["synthetic", "real"])
def mnist_labels(request):
    return synthetic_mnist_labels() if request.param == "synthetic" else real_mnist_labels()


def assert_disjoint_cover(parts, n):
    assert all(p.dtype == np.int64 for p in parts)
    everything = np.concatenate(parts)
    assert len(everything) == n
    np.testing.assert_array_equal(np.sort(everything), np.arange(n))


def test_iid_mnist():
    parts = iid(60000, 100, seed=0)
    assert len(parts) == 100 and all(len(p) == 600 for p in parts)
    assert_disjoint_cover(parts, 60000)


def test_iid_uneven_split():
    parts = iid(10, 3, seed=0)
    assert [len(p) for p in parts] == [4, 3, 3]
    assert_disjoint_cover(parts, 10)


def test_pathological_mnist(mnist_labels):
    labels = mnist_labels
    parts = pathological(labels, 100, seed=0)
    assert len(parts) == 100 and all(len(p) == 600 for p in parts)
    assert_disjoint_cover(parts, 60000)

    # Independently: each client's indices are 2 contiguous runs of 300 in stable sorted order.
    order = np.argsort(labels, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    sorted_labels = labels[order]
    shards_seen = []
    num_many_labels = 0
    for p in parts:
        expected_counts = np.zeros(10, np.int64)
        for run in rank[p].reshape(2, 300):
            start = run[0]
            assert start % 300 == 0
            np.testing.assert_array_equal(run, np.arange(start, start + 300))
            shards_seen.append(start // 300)
            expected_counts += np.bincount(sorted_labels[start : start + 300], minlength=10)
        counts = np.bincount(labels[p], minlength=10)
        np.testing.assert_array_equal(counts, expected_counts)
        assert np.count_nonzero(counts) <= 4  # a shard may straddle one label boundary
        num_many_labels += np.count_nonzero(counts) > 2
    assert sorted(shards_seen) == list(range(200))
    # Only shards crossing one of the 9 label boundaries can add a third label.
    assert num_many_labels <= 9


def test_pathological_small_exact():
    labels = np.array([1, 0, 1, 0, 2, 2, 0, 1])
    parts = pathological(labels, 2, shards_per_client=2, seed=1)
    # Stable sort: [1, 3, 6 | 0, 2, 7 | 4, 5] -> shards of 2: [1,3] [6,0] [2,7] [4,5].
    shards = {(1, 3), (6, 0), (2, 7), (4, 5)}
    got = {tuple(s) for p in parts for s in p.reshape(2, 2).tolist()}
    assert got == shards


def test_unbalanced():
    parts = unbalanced(1000, 50, seed=0)
    assert len(parts) == 50
    assert_disjoint_cover(parts, 1000)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 1 and sizes.max() > 2 * sizes.min()
    parts = unbalanced(1000, 50, seed=0, min_size=15, sigma=2.0)
    assert min(len(p) for p in parts) >= 15
    assert_disjoint_cover(parts, 1000)
    assert [len(p) for p in unbalanced(100, 100, seed=3)] == [1] * 100
    assert {len(p) for p in unbalanced(1000, 10, seed=3, sigma=0.0)} == {100}


@pytest.mark.parametrize(
    "make",
    [
        lambda seed: iid(600, 10, seed),
        lambda seed: pathological(synthetic_mnist_labels(), 100, seed=seed),
        lambda seed: unbalanced(600, 10, seed),
    ],
    ids=["iid", "pathological", "unbalanced"],
)
def test_seeded(make):
    a, b, c = make(7), make(7), make(8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    generator_result = make(np.random.default_rng(7))
    assert all(np.array_equal(x, y) for x, y in zip(a, generator_result, strict=True))


def test_errors():
    with pytest.raises(ValueError, match="at least one example"):
        iid(5, 6, seed=0)
    with pytest.raises(ValueError, match="num_clients"):
        iid(5, 0, seed=0)
    with pytest.raises(ValueError, match="do not divide"):
        pathological(np.zeros(1000, int), 3, seed=0)
    with pytest.raises(ValueError, match="shards_per_client"):
        pathological(np.zeros(100, int), 10, shards_per_client=0, seed=0)
    with pytest.raises(ValueError, match="1-D"):
        pathological(np.zeros((10, 2), int), 5, seed=0)
    with pytest.raises(ValueError, match="min_size"):
        unbalanced(100, 10, seed=0, min_size=11)
    with pytest.raises(ValueError, match="at least one example"):
        unbalanced(5, 6, seed=0)
