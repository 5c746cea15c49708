"""ClientData and cohort batching: step counts, masks, per-epoch coverage, determinism."""

import math

import numpy as np
import pytest

from fedax.data import (
    ClientData,
    bucket_size,
    make_cohort,
    num_local_steps,
    sample_clients,
    unbalanced,
)


def random_data(seed=0, num_examples=400, num_clients=12) -> ClientData:
    parts = unbalanced(num_examples, num_clients, seed, sigma=1.0)
    x = np.arange(num_examples, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    y = np.arange(num_examples) % 10
    return ClientData.from_partition(x, y, parts)


def test_client_data_layout():
    parts = [np.array([5, 1]), np.array([], np.int64), np.array([0, 2, 3])]
    data = ClientData.from_partition(np.zeros((6, 2)), np.zeros(6), parts)
    assert data.num_clients == 3
    np.testing.assert_array_equal(data.sizes, [2, 0, 3])
    assert data.sizes.dtype == np.int64 and data.indices.dtype == np.int64
    np.testing.assert_array_equal(data.offsets, [0, 2, 2, 5])
    for k, p in enumerate(parts):
        np.testing.assert_array_equal(data.client_indices(k), p)
    with pytest.raises(IndexError):
        data.client_indices(3)
    with pytest.raises(ValueError, match=r"\[0, 6\)"):
        ClientData.from_partition(np.zeros((6, 2)), np.zeros(6), [np.array([6])])
    with pytest.raises(ValueError, match="y has"):
        ClientData.from_partition(np.zeros((6, 2)), np.zeros(5), parts)


def check_cohort(data, cohort, client_ids, epochs, batch_size):
    """Checks every property of make_cohort's contract, client by client."""
    c_count, s, b = cohort.idx.shape
    assert cohort.mask.shape == (c_count, s, b)
    assert cohort.idx.dtype == np.int32 and cohort.mask.dtype == np.float32
    assert cohort.client_ids.dtype == np.int32 and cohort.num_examples.dtype == np.float32
    np.testing.assert_array_equal(cohort.client_ids, client_ids)
    full = batch_size is None or batch_size == math.inf
    if full:
        assert b == max(data.sizes[client_ids].max(), 1)
    else:
        assert b == batch_size
    assert set(np.unique(cohort.mask)) <= {0.0, 1.0}
    assert np.all(cohort.idx[cohort.mask == 0] == 0)
    for c, k in enumerate(client_ids):
        n = int(data.sizes[k])
        assert cohort.num_examples[c] == n
        steps = num_local_steps(n, epochs, batch_size)
        assert steps == (epochs * (n > 0) if full else epochs * math.ceil(n / batch_size))
        real = cohort.mask[c].sum(axis=1) > 0
        assert real.sum() == steps and real[:steps].all()  # real steps first, padding after
        assert cohort.mask[c, steps:].sum() == 0
        if n == 0:
            continue
        own = np.sort(data.client_indices(k))
        per_epoch = steps // epochs
        for e in range(epochs):
            m = cohort.mask[c, e * per_epoch : (e + 1) * per_epoch].reshape(-1)
            i = cohort.idx[c, e * per_epoch : (e + 1) * per_epoch].reshape(-1)
            assert m.sum() == n
            # Within an epoch: real entries come first (only the last batch is partial), and
            # each of the client's examples appears exactly once.
            assert m[:n].all() and not m[n:].any()
            np.testing.assert_array_equal(np.sort(i[:n]), own)


@pytest.mark.parametrize("batch_size", [1, 7, 10, 50, 1000, None, math.inf])
@pytest.mark.parametrize("epochs", [1, 3])
def test_cohort_contract(batch_size, epochs):
    data = random_data()
    client_ids = np.array([3, 0, 7, 11, 5])
    cohort = make_cohort(data, client_ids, epochs, batch_size, seed_or_rng=0)
    check_cohort(data, cohort, client_ids, epochs, batch_size)


def test_cohort_with_empty_client_and_fixed_shapes():
    parts = [np.arange(0, 5), np.array([], np.int64), np.arange(5, 25)]
    data = ClientData.from_partition(np.zeros((25, 1)), np.zeros(25), parts)
    ids = np.array([0, 1, 2])
    cohort = make_cohort(data, ids, 2, 4, 0, num_steps=16)
    assert cohort.idx.shape == (3, 16, 4)
    check_cohort(data, cohort, ids, 2, 4)
    full = make_cohort(data, ids, 2, None, 0, full_batch_size=32)
    assert full.idx.shape == (3, 2, 32)
    np.testing.assert_array_equal(full.mask.sum(axis=(1, 2)), [10, 0, 40])


def test_full_batch_steps_hold_all_examples():
    data = random_data(seed=1)
    ids = np.arange(data.num_clients)
    cohort = make_cohort(data, ids, 3, math.inf, seed_or_rng=5)
    assert cohort.idx.shape == (len(ids), 3, data.sizes.max())
    for c, k in enumerate(ids):
        for step in range(3):
            n = int(data.sizes[k])
            np.testing.assert_array_equal(
                np.sort(cohort.idx[c, step, :n]), np.sort(data.client_indices(k))
            )
            assert cohort.mask[c, step].sum() == n


def test_fresh_shuffle_each_epoch():
    data = ClientData.from_partition(np.zeros((200, 1)), np.zeros(200), [np.arange(200)])
    cohort = make_cohort(data, [0], 2, 200, seed_or_rng=0)
    assert not np.array_equal(cohort.idx[0, 0], cohort.idx[0, 1])


def test_cohort_determinism():
    data = random_data()
    ids = np.array([1, 4, 9])
    a = make_cohort(data, ids, 2, 10, seed_or_rng=42)
    b = make_cohort(data, ids, 2, 10, seed_or_rng=np.random.default_rng(42))
    c = make_cohort(data, ids, 2, 10, seed_or_rng=43)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.idx, c.idx)
    # The padding choice does not change the real entries.
    d = make_cohort(data, ids, 2, 10, seed_or_rng=42, num_steps=a.idx.shape[1] + 5)
    np.testing.assert_array_equal(d.idx[:, : a.idx.shape[1]], a.idx)


def test_bucketing():
    assert [bucket_size(n) for n in [1, 5, 8, 9, 10, 11, 16, 17, 33, 60, 1200]] == [
        1,
        5,
        8,
        10,
        10,
        12,
        16,
        20,
        40,
        64,
        1280,
    ]
    for n in range(1, 5000):
        assert n <= bucket_size(n) < 1.25 * n + 1
    assert len({bucket_size(n) for n in range(1025, 2049)}) == 4
    # 600 examples, B = 10, E = 20: 1200 steps, bucketed to 1280 (exact without bucketing).
    data = ClientData.from_partition(np.zeros((600, 1)), np.zeros(600), [np.arange(600)])
    assert make_cohort(data, [0], 20, 10, 0).idx.shape == (1, 1280, 10)
    assert make_cohort(data, [0], 20, 10, 0, bucket=False).idx.shape == (1, 1200, 10)


def test_cohort_errors():
    data = random_data()
    for bad in [0, -1, 2.5, 10.0, True, "10", math.nan, -math.inf]:
        with pytest.raises(ValueError, match="batch_size"):
            make_cohort(data, [0], 1, bad, 0)
        with pytest.raises(ValueError, match="batch_size"):
            num_local_steps(5, 1, bad)
    with pytest.raises(ValueError, match="epochs"):
        make_cohort(data, [0], 0, 10, 0)
    with pytest.raises(ValueError, match="num_steps"):
        make_cohort(data, [0], 1, 1, 0, num_steps=1)
    with pytest.raises(ValueError, match="full_batch_size"):
        make_cohort(data, [0], 1, None, 0, full_batch_size=1)
    with pytest.raises(ValueError, match="full_batch_size"):
        make_cohort(data, [0], 1, 10, 0, full_batch_size=1000)
    with pytest.raises(ValueError, match="client_ids"):
        make_cohort(data, [data.num_clients], 1, 10, 0)
    with pytest.raises(ValueError, match="client_ids"):
        make_cohort(data, [], 1, 10, 0)


def test_num_local_steps():
    assert num_local_steps(600, 1, 10) == 60
    assert num_local_steps(600, 5, 50) == 60
    assert num_local_steps(601, 1, 10) == 61
    assert num_local_steps(5, 2, 10) == 2
    assert num_local_steps(600, 20, None) == 20
    assert num_local_steps(600, 1, math.inf) == 1
    assert num_local_steps(0, 3, 10) == 0


def test_sample_clients():
    for fraction, expected in [(0.1, 10), (0.2, 20), (0.29, 29), (1.0, 100), (0.0, 1), (0.001, 1)]:
        ids = sample_clients(0, 100, fraction)
        assert len(ids) == expected and len(np.unique(ids)) == expected
        assert ids.min() >= 0 and ids.max() < 100
    np.testing.assert_array_equal(sample_clients(3, 100, 0.1), sample_clients(3, 100, 0.1))
    assert not np.array_equal(sample_clients(3, 100, 0.1), sample_clients(4, 100, 0.1))
    rng = np.random.default_rng(0)
    assert not np.array_equal(sample_clients(rng, 100, 0.1), sample_clients(rng, 100, 0.1))
    with pytest.raises(ValueError):
        sample_clients(0, 100, 1.5)
    with pytest.raises(ValueError):
        sample_clients(0, 0, 0.1)


# --- per-client epochs (stragglers) -----------------------------------------------------------


def client_slice(cohort, c):
    """Client c of a cohort, as a one-client cohort."""
    return type(cohort)(*(field[c : c + 1] for field in cohort))


@pytest.mark.parametrize("batch_size", [1, 7, 50, 1000])
def test_per_client_epochs_contract(batch_size):
    data = random_data()
    ids = np.array([3, 0, 7, 11, 5])
    epochs = np.array([1, 3, 2, 1, 4])
    cohort = make_cohort(data, ids, epochs, batch_size, seed_or_rng=0, bucket=False)
    steps = [
        num_local_steps(int(data.sizes[k]), int(e), batch_size)
        for k, e in zip(ids, epochs, strict=True)
    ]
    assert cohort.idx.shape == (5, max(steps), batch_size)
    for c, (k, e) in enumerate(zip(ids, epochs, strict=True)):
        # Client c alone satisfies the full contract with E = epochs[c] ...
        check_cohort(data, client_slice(cohort, c), [k], int(e), batch_size)
        # ... hence takes exactly epochs[c] * ceil(n_k / B) real steps.
        assert (cohort.mask[c].sum(axis=1) > 0).sum() == steps[c]


def test_per_client_epochs_full_batch():
    data = random_data(seed=2)
    ids = np.array([1, 2, 4])
    epochs = [2, 1, 3]
    cohort = make_cohort(data, ids, epochs, None, seed_or_rng=1)
    assert cohort.idx.shape == (3, 3, data.sizes[ids].max())
    for c, (k, e) in enumerate(zip(ids, epochs, strict=True)):
        n = int(data.sizes[k])
        real = cohort.mask[c].sum(axis=1)
        np.testing.assert_array_equal(real, [n] * e + [0] * (3 - e))
        for step in range(e):
            np.testing.assert_array_equal(
                np.sort(cohort.idx[c, step, :n]), np.sort(data.client_indices(k))
            )


def test_uniform_per_client_epochs_equal_int_epochs():
    data = random_data()
    ids = np.array([1, 4, 9, 2])
    for batch_size in [10, None]:
        a = make_cohort(data, ids, 3, batch_size, seed_or_rng=42)
        for epochs in [np.full(4, 3), [3, 3, 3, 3], np.full(4, 3, np.int32), np.int64(3)]:
            b = make_cohort(data, ids, epochs, batch_size, seed_or_rng=42)
            for x, y in zip(a, b, strict=True):
                np.testing.assert_array_equal(x, y)
    b = make_cohort(data, ids, np.array(3), 10, seed_or_rng=42)  # 0-d array: an int
    np.testing.assert_array_equal(b.idx, make_cohort(data, ids, 3, 10, seed_or_rng=42).idx)


def test_per_client_epochs_step_budget_and_randomness():
    data = random_data()
    ids = np.array([6, 2, 8])
    epochs = np.array([2, 5, 1])
    n = data.sizes[ids]
    needed = int((epochs * -(-n // 4)).max())
    cohort = make_cohort(data, ids, epochs, 4, seed_or_rng=9)
    assert cohort.idx.shape[1] == bucket_size(needed)
    assert make_cohort(data, ids, epochs, 4, 9, bucket=False).idx.shape[1] == needed
    with pytest.raises(ValueError, match="num_steps"):
        make_cohort(data, ids, epochs, 4, 9, num_steps=needed - 1)
    # Same stream as int epochs: the first client matches a one-client cohort with its E.
    first = make_cohort(data, ids[:1], int(epochs[0]), 4, seed_or_rng=9, bucket=False)
    steps = first.idx.shape[1]
    np.testing.assert_array_equal(cohort.idx[0, :steps], first.idx[0])
    assert cohort.mask[0, steps:].sum() == 0


def test_per_client_epochs_errors():
    data = random_data()
    ids = [0, 1, 2]
    for bad in [
        [1, 2],  # wrong length
        [1, 0, 2],  # zero epochs
        [1, -1, 2],
        [1.0, 2.0, 3.0],  # not ints
        np.array([True, True, True]),
        np.ones((3, 1), np.int64),
        np.array(0),
    ]:
        with pytest.raises(ValueError, match="epochs"):
            make_cohort(data, ids, bad, 10, 0)
