"""Dirichlet(alpha) and SCAFFOLD s-similarity partitions: coverage, sizes, skew, determinism."""

import numpy as np
import pytest

from fedax.data import dirichlet, similarity

MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    """MNIST's training class counts, in shuffled order."""
    return np.random.default_rng(7).permutation(np.repeat(np.arange(10), MNIST_TRAIN_COUNTS))


def assert_disjoint_cover(parts, n):
    assert all(p.dtype == np.int64 and p.ndim == 1 for p in parts)
    everything = np.concatenate(parts)
    assert len(everything) == n
    np.testing.assert_array_equal(np.sort(everything), np.arange(n))


def histograms(labels, parts):
    return np.stack([np.bincount(labels[p], minlength=10) for p in parts]).astype(np.float64)


def max_class_fractions(labels, parts):
    h = histograms(labels, parts)
    h = h[h.sum(axis=1) > 0]
    return h.max(axis=1) / h.sum(axis=1)


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


# --- Dirichlet -------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.1, 1.0, 100.0])
def test_dirichlet_cover_min_size_and_determinism(labels, alpha):
    parts = dirichlet(labels, 100, alpha, seed=0)
    assert len(parts) == 100
    assert_disjoint_cover(parts, len(labels))
    assert min(len(p) for p in parts) >= 10  # default min_size
    for p in parts:  # grouped by class, in sorted label order
        assert np.all(np.diff(labels[p]) >= 0)
    assert_same(parts, dirichlet(labels, 100, alpha, seed=np.random.default_rng(0)))
    other = dirichlet(labels, 100, alpha, seed=1)
    assert any(not np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_dirichlet_large_alpha_is_near_iid(labels):
    parts = dirichlet(labels, 10, 1000.0, seed=0)
    h = histograms(labels, parts)
    global_p = np.array(MNIST_TRAIN_COUNTS) / len(labels)
    assert np.abs(h / h.sum(axis=1, keepdims=True) - global_p).max() < 0.02
    assert max_class_fractions(labels, parts).mean() < 0.2
    np.testing.assert_allclose([len(p) for p in parts], 6000, rtol=0.1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dirichlet_tiny_alpha_is_dominated_by_one_class(labels, seed):
    parts = dirichlet(labels, 100, 0.01, seed=seed, min_size=0)
    assert_disjoint_cover(parts, len(labels))
    assert max_class_fractions(labels, parts).mean() > 0.85
    # Almost every non-empty client holds essentially one or two classes.
    h = histograms(labels, parts)
    h = h[h.sum(axis=1) > 0]
    top2 = np.sort(h, axis=1)[:, -2:].sum(axis=1) / h.sum(axis=1)
    assert np.mean(top2 > 0.95) > 0.9


def test_dirichlet_skew_decreases_with_alpha(labels):
    means = [
        max_class_fractions(labels, dirichlet(labels, 50, a, seed=0, min_size=0)).mean()
        for a in [0.05, 0.5, 5.0, 500.0]
    ]
    assert means == sorted(means, reverse=True)


def test_dirichlet_errors(labels):
    with pytest.raises(ValueError, match="lower min_size or raise alpha"):
        dirichlet(labels, 20, 0.001, seed=0, min_size=10, max_tries=20)
    with pytest.raises(ValueError, match="exceeds"):
        dirichlet(labels[:100], 20, 1.0, seed=0, min_size=10)
    for bad in [0.0, -1.0, float("inf"), float("nan")]:
        with pytest.raises(ValueError, match="alpha"):
            dirichlet(labels, 10, bad, seed=0)
    with pytest.raises(ValueError, match="num_clients"):
        dirichlet(labels, 0, 1.0, seed=0)
    with pytest.raises(ValueError, match="1-D"):
        dirichlet(labels.reshape(-1, 2), 10, 1.0, seed=0)
    with pytest.raises(ValueError, match="max_tries"):
        dirichlet(labels, 10, 1.0, seed=0, max_tries=0)


def test_dirichlet_one_client_and_non_contiguous_labels():
    y = np.array([7, 3, 3, 9, 7, 7, 3, 9])
    (only,) = dirichlet(y, 1, 0.5, seed=0, min_size=1)
    np.testing.assert_array_equal(np.sort(only), np.arange(8))
    parts = dirichlet(y, 3, 5.0, seed=0, min_size=1)
    assert_disjoint_cover(parts, 8)


# --- s-similarity ----------------------------------------------------------------------------


@pytest.mark.parametrize("s", [0.0, 0.1, 0.5, 1.0])
def test_similarity_sizes_cover_determinism(labels, s):
    parts = similarity(labels, 100, s, seed=0)
    assert_disjoint_cover(parts, 60000)
    assert all(len(p) == 600 for p in parts)
    num_iid = round(s * 60000) // 100
    for p in parts:
        # The tail (the client's sorted chunk) is in sorted-label order.
        assert np.all(np.diff(labels[p[num_iid:]]) >= 0)
    assert_same(parts, similarity(labels, 100, s, seed=np.random.default_rng(0)))
    other = similarity(labels, 100, s, seed=1)
    assert any(not np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_similarity_one_is_iid(labels):
    parts = similarity(labels, 100, 1.0, seed=0)
    h = histograms(labels, parts)
    global_p = np.array(MNIST_TRAIN_COUNTS) / len(labels)
    tv = 0.5 * np.abs(h / 600 - global_p).sum(axis=1)
    assert tv.max() < 0.15 and tv.mean() < 0.08
    assert (h > 0).sum(axis=1).min() == 10


def test_similarity_zero_is_sorted_chunks(labels):
    parts = similarity(labels, 100, 0.0, seed=0)
    # Exactly the label histograms of 100 contiguous chunks of the sorted labels, in some order.
    chunks = np.sort(labels).reshape(100, 600)
    expected = sorted(tuple(np.bincount(c, minlength=10)) for c in chunks)
    got = sorted(tuple(np.bincount(labels[p], minlength=10)) for p in parts)
    assert got == expected
    distinct = [len(np.unique(labels[p])) for p in parts]
    boundaries = np.cumsum(MNIST_TRAIN_COUNTS)[:-1]  # 9 class boundaries, none on a multiple of 600
    assert all(b % 600 for b in boundaries)
    assert max(distinct) == 2 and distinct.count(2) == 9 and distinct.count(1) == 91


def test_similarity_ten_percent(labels):
    parts = similarity(labels, 100, 0.1, seed=0)
    h = histograms(labels, parts)
    # 540 sorted examples spanning at most 2 labels, plus 60 IID ones: the top two classes hold
    # at least 540 examples, and most clients see more than 2 labels.
    assert np.sort(h, axis=1)[:, -2:].sum(axis=1).min() >= 540
    assert np.mean((h > 0).sum(axis=1) > 2) > 0.9


def test_similarity_uneven_counts():
    y = np.random.default_rng(0).integers(0, 5, 1003)
    parts = similarity(y, 10, 0.3, seed=0)
    assert_disjoint_cover(parts, 1003)
    sizes = np.array([len(p) for p in parts])
    assert np.all(np.abs(sizes - 100.3) <= 2)


def test_similarity_errors(labels):
    for bad in [-0.1, 1.5, float("nan")]:
        with pytest.raises(ValueError, match="fraction"):
            similarity(labels, 10, bad, seed=0)
    with pytest.raises(ValueError):
        similarity(labels[:5], 10, 0.5, seed=0)
    with pytest.raises(ValueError, match="1-D"):
        similarity(labels.reshape(-1, 2), 10, 0.5, seed=0)
