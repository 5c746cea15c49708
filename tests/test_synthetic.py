"""Synthetic(alpha, beta) of FedProx: the generative rule, sizes, split, reproducibility."""

import math

import numpy as np
import pytest

from fedax.data import ClientData, synthetic


def reference(alpha, beta, num_clients, dim, num_classes, seed, iid, sizes, train_fraction):
    """Independent re-implementation of the documented rule and draw order (BLAS matmul)."""
    rng = np.random.default_rng(seed)
    if sizes is None:
        n = rng.lognormal(4.0, 2.0, num_clients).astype(np.int64) + 50
    else:
        n = np.broadcast_to(np.asarray(sizes, np.int64), (num_clients,))
    sd = np.sqrt(np.arange(1, dim + 1, dtype=np.float64) ** -1.2)
    if iid:
        w0 = rng.normal(0, 1, (dim, num_classes))
        b0 = rng.normal(0, 1, num_classes)
        v = np.zeros((num_clients, dim))
    else:
        u = rng.normal(0, alpha, num_clients)
        big_b = rng.normal(0, beta, num_clients)
        v = rng.normal(big_b[:, None], 1, (num_clients, dim))
    out = []
    for k in range(num_clients):
        w, b = (w0, b0) if iid else (rng.normal(u[k], 1, (dim, num_classes)), None)
        if not iid:
            b = rng.normal(u[k], 1, num_classes)
        x = (v[k] + sd * rng.standard_normal((n[k], dim))).astype(np.float32)
        y = np.argmax(x.astype(np.float64) @ w + b, axis=1)
        cut = int(train_fraction * n[k])
        out.append((x[:cut], y[:cut], x[cut:], y[cut:]))
    return n, out


def client_arrays(data: ClientData, k: int):
    idx = data.client_indices(k)
    return data.x[idx], data.y[idx]


def label_histograms(data: ClientData, num_classes=10):
    return np.stack(
        [
            np.bincount(client_arrays(data, k)[1], minlength=num_classes)
            for k in range(data.num_clients)
        ]
    )


@pytest.mark.parametrize("iid", [False, True])
def test_layout_sizes_and_split(iid):
    train, test = synthetic(1.0, 1.0, seed=3, iid=iid)
    assert train.num_clients == test.num_clients == 30
    for data in (train, test):
        assert data.x.dtype == np.float32 and data.x.ndim == 2 and data.x.shape[1] == 60
        assert data.y.dtype == np.int32 and data.y.min() >= 0 and data.y.max() < 10
        np.testing.assert_array_equal(data.indices, np.arange(len(data.y)))
    # Power-law sizes: int(LogNormal(4, 2)) + 50, drawn first from default_rng(seed).
    n = train.sizes + test.sizes
    expected = np.random.default_rng(3).lognormal(4.0, 2.0, 30).astype(np.int64) + 50
    np.testing.assert_array_equal(n, expected)
    assert n.min() >= 50
    # 90/10 per client, as in the authors' generator: train = int(0.9 * n_k).
    np.testing.assert_array_equal(train.sizes, [int(0.9 * m) for m in n])


@pytest.mark.parametrize("iid", [False, True])
def test_matches_documented_rule(iid):
    args = dict(num_clients=7, dim=12, num_classes=5, seed=11, iid=iid)
    train, test = synthetic(0.5, 2.0, **args, sizes=[60, 1, 200, 75, 90, 51, 130])
    n, ref = reference(0.5, 2.0, **args, sizes=[60, 1, 200, 75, 90, 51, 130], train_fraction=0.9)
    np.testing.assert_array_equal(train.sizes + test.sizes, n)
    mismatched = 0
    for k, (x_tr, y_tr, x_te, y_te) in enumerate(ref):
        for data, x, y in [(train, x_tr, y_tr), (test, x_te, y_te)]:
            got_x, got_y = client_arrays(data, k)
            np.testing.assert_array_equal(got_x, x)
            mismatched += int(np.sum(got_y != y))  # BLAS rounding may flip an exact near-tie
    assert mismatched <= 1


def test_bit_reproducible():
    a = synthetic(1.0, 1.0, seed=5)
    b = synthetic(1.0, 1.0, seed=np.random.default_rng(5))
    c = synthetic(1.0, 1.0, seed=6)
    for da, db, dc in zip(a, b, c, strict=True):
        for field in ("x", "y", "indices", "offsets"):
            assert getattr(da, field).tobytes() == getattr(db, field).tobytes()
        assert da.x.tobytes() != dc.x.tobytes()
    assert a[0].x.tobytes() != synthetic(1.0, 1.0, seed=5, iid=True)[0].x.tobytes()


def test_input_distribution():
    # IID: x ~ N(0, diag(j^-1.2)). With 20,000 examples the sample moments are tight.
    train, _ = synthetic(0, 0, num_clients=1, seed=0, iid=True, sizes=20000, train_fraction=1.0)
    x = train.x.astype(np.float64)
    var = np.arange(1, 61) ** -1.2
    np.testing.assert_allclose(x.var(axis=0), var, rtol=0.06)
    assert np.all(np.abs(x.mean(axis=0)) < 5 * np.sqrt(var / len(x)))
    # Heterogeneous: a client's inputs share one mean v_k with spread beta around B_k.
    train, _ = synthetic(0.0, 0.0, num_clients=4, seed=1, sizes=5000, train_fraction=1.0)
    for k in range(4):
        xk = client_arrays(train, k)[0].astype(np.float64)
        np.testing.assert_allclose(xk.var(axis=0), var, rtol=0.1)
        # v_k entries ~ N(B_k, 1) with B_k = 0 when beta = 0: sample mean of v_k ~ N(0, 1/60).
        assert abs(xk.mean(axis=0).mean()) < 5 / np.sqrt(60)


def test_heterogeneity_of_labels():
    """IID: every client's label mix matches the global one; Synthetic(1, 1): far from it."""

    def mean_tv(data):
        h = label_histograms(data).astype(np.float64)
        p = h / h.sum(axis=1, keepdims=True)
        g = h.sum(axis=0) / h.sum()
        return 0.5 * np.abs(p - g).sum(axis=1).mean()

    iid_train, _ = synthetic(0, 0, seed=0, iid=True, sizes=2000)
    het_train, _ = synthetic(1, 1, seed=0, sizes=2000)
    assert mean_tv(iid_train) < 0.05
    assert mean_tv(het_train) > 0.4


def test_sizes_and_fraction_options():
    train, test = synthetic(1, 1, num_clients=3, sizes=100, train_fraction=0.75)
    np.testing.assert_array_equal(train.sizes, [75, 75, 75])
    np.testing.assert_array_equal(test.sizes, [25, 25, 25])
    train, test = synthetic(1, 1, num_clients=3, sizes=np.array([10, 1, 33]), train_fraction=1.0)
    np.testing.assert_array_equal(train.sizes, [10, 1, 33])
    assert test.num_clients == 3 and len(test.y) == 0 and test.x.shape == (0, 60)
    train, _ = synthetic(1, 1, num_clients=2, sizes=[3, 3], train_fraction=0.5)
    np.testing.assert_array_equal(train.sizes, [math.floor(1.5)] * 2)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(alpha=-1.0, beta=1.0),
        dict(alpha=1.0, beta=math.nan),
        dict(alpha=1.0, beta=1.0, num_clients=0),
        dict(alpha=1.0, beta=1.0, dim=0),
        dict(alpha=1.0, beta=1.0, sizes=0),
        dict(alpha=1.0, beta=1.0, sizes=[5, 5]),
        dict(alpha=1.0, beta=1.0, num_clients=2, sizes=[5, 0]),
        dict(alpha=1.0, beta=1.0, num_clients=2, sizes=[5.0, 2.0]),
        dict(alpha=1.0, beta=1.0, train_fraction=0.0),
        dict(alpha=1.0, beta=1.0, train_fraction=1.5),
    ],
)
def test_errors(kwargs):
    with pytest.raises(ValueError):
        synthetic(**kwargs)
