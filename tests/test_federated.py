"""Tests for the placement primitives of ``fedax.federated`` and their communication cost.

Every expected value comes from an independent reference: NumPy (float64) implementations,
closed-form derivatives, or central finite differences of the NumPy reference. fedax is
never compared with itself, except where two execution paths of fedax must agree by
contract (forward mode == reverse mode, map strategies, mesh == no mesh).

The matrix follows DrJAX's tests: jit / no jit x forward (jvp, jacfwd) / reverse (grad,
vjp, jacrev) x mesh / no mesh x jaxpr closure (derivatives are again federated programs).

Beware JAX's trace cache: ``map_strategy`` and the mesh are read while tracing, so tests
that compare strategies or meshes build a fresh Python function for every trace.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore
from jax.interpreters import ad
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import fedax.federated as ff

# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------

JITS = ["nojit", "jit"]


def maybe_jit(fn, jit):
    return jax.jit(fn) if jit == "jit" else fn


def assert_tree_allclose(actual, expected, rtol=1e-5, atol=1e-6):
    a_leaves, a_def = jax.tree.flatten(actual)
    e_leaves, e_def = jax.tree.flatten(expected)
    assert a_def == e_def, f"tree structures differ: {a_def} vs {e_def}"
    for a, e in zip(a_leaves, e_leaves, strict=True):
        assert np.shape(a) == np.shape(e), f"shapes differ: {np.shape(a)} vs {np.shape(e)}"
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


def _subjaxprs(value):
    if isinstance(value, jcore.ClosedJaxpr):
        return [value.jaxpr]
    if isinstance(value, jcore.Jaxpr):
        return [value]
    if isinstance(value, (tuple, list)):
        return [j for v in value for j in _subjaxprs(v)]
    return []


def iter_eqns(jaxpr):
    """Every equation of a jaxpr and, recursively, of its sub-jaxprs (jit, scan, cond, ...)."""
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in _subjaxprs(value):
                yield from iter_eqns(sub)


def prim_counts(fn, *args):
    return collections.Counter(e.primitive.name for e in iter_eqns(jax.make_jaxpr(fn)(*args)))


def clients_axis_reductions(fn, *args, n):
    """Non-federated reductions over a leading axis of size n (a leaked aggregation)."""
    bad = []
    for eqn in iter_eqns(jax.make_jaxpr(fn)(*args)):
        if eqn.primitive.name in ("reduce_sum", "reduce_mean"):
            shape = eqn.invars[0].aval.shape
            if shape and shape[0] == n and 0 in tuple(eqn.params["axes"]):
                bad.append(eqn)
    return bad


@pytest.fixture
def x64():
    """float64 for finite differences; restored afterwards."""
    with jax.enable_x64(True):
        yield


def central_fd_jacobian(f, x, h=1e-6):
    """Central finite-difference Jacobian of a NumPy float64 function f: R^k -> R^m."""
    x = np.asarray(x, np.float64)
    cols = []
    for j in range(x.size):
        e = np.zeros_like(x)
        e[j] = h
        cols.append((np.asarray(f(x + e)) - np.asarray(f(x - e))) / (2 * h))
    return np.stack(cols, axis=-1)


def rng_tree(rng, n):
    """A client-placed pytree: leaves of different ranks, including scalars per client."""
    return {
        "scalar": rng.normal(size=(n,)).astype(np.float32),
        "vec": rng.normal(size=(n, 3)).astype(np.float32),
        "nested": {
            "mat": rng.normal(size=(n, 2, 4)).astype(np.float32),
            "t": (rng.normal(size=(n, 1, 2, 3)).astype(np.float32),),
        },
    }


# --------------------------------------------------------------------------------------
# 1. Values and errors
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, jit", [(1, "jit"), (5, "jit"), (5, "nojit")])
def test_broadcast_values(n, jit):
    """Leaves of every rank (scalar to rank 3) and dtype equal np.broadcast_to."""
    leaves = [((), np.float32), ((3,), np.int32), ((2, 3), np.bool_), ((2, 1, 4), np.float32)]
    tree = {
        f"{np.dtype(dtype).name}{shape}": (
            np.arange(int(np.prod(shape))).reshape(shape) - 2
        ).astype(dtype)
        for shape, dtype in leaves
    }
    out = maybe_jit(lambda t: ff.broadcast(t, n), jit)(tree)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for key, x in tree.items():
        assert out[key].dtype == x.dtype, key
        np.testing.assert_array_equal(np.asarray(out[key]), np.broadcast_to(x, (n, *x.shape)))


@pytest.mark.parametrize("jit", JITS)
def test_broadcast_pytree_and_python_scalar(jit):
    tree = {
        "a": np.float32(2.5),
        "b": [np.ones((2, 3), np.float32), np.arange(4.0, dtype=np.float32)],
    }
    out = maybe_jit(lambda t: ff.broadcast(t, 3), jit)(tree)
    expected = jax.tree.map(lambda a: np.broadcast_to(a, (3, *np.shape(a))), tree)
    assert_tree_allclose(out, expected, rtol=0, atol=0)
    # A Python float is placed as float32 (not weakly typed: it now has a concrete shape).
    out = maybe_jit(lambda: ff.broadcast(2.0, 4), jit)()
    assert out.shape == (4,) and out.dtype == jnp.float32
    np.testing.assert_array_equal(out, np.full(4, 2.0))


@pytest.mark.parametrize("n, jit", [(1, "jit"), (7, "jit"), (7, "nojit")])
def test_aggregations_match_numpy(n, jit):
    rng = np.random.default_rng(n)
    tree = rng_tree(rng, n)
    w = rng.uniform(0.1, 3.0, size=(n,)).astype(np.float32)

    aggregate = lambda t, w: (ff.sum(t), ff.mean(t), ff.weighted_mean(t, w))  # noqa: E731
    got_sum, got_mean, got_wmean = maybe_jit(aggregate, jit)(tree, w)

    t64 = jax.tree.map(lambda a: np.asarray(a, np.float64), tree)
    assert_tree_allclose(got_sum, jax.tree.map(lambda a: a.sum(axis=0), t64))
    assert_tree_allclose(got_mean, jax.tree.map(lambda a: a.mean(axis=0), t64))
    assert_tree_allclose(
        got_wmean, jax.tree.map(lambda a: np.average(a, axis=0, weights=w.astype(np.float64)), t64)
    )
    for leaf in jax.tree.leaves((got_sum, got_mean, got_wmean)):
        assert leaf.dtype == jnp.float32


@pytest.mark.parametrize("jit", JITS)
def test_weighted_mean_integer_example_counts(jit):
    """FedAvg weights are example counts n_k (integers); the result is still the float average."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 3)).astype(np.float32)
    counts = np.array([10, 1, 0, 5], np.int32)
    got = maybe_jit(ff.weighted_mean, jit)(x, counts)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, np.average(x, axis=0, weights=counts), rtol=1e-6)


def test_weighted_mean_integer_values_with_fractional_weights():
    """Integer client values (e.g. counts of correct predictions) with float weights.

    np.average([2, 4], weights=[0.5, 1.5]) == 3.5. Demonstrates a bug: weighted_mean casts
    the weights to the dtype of the values, so 0.5 -> 0 and 1.5 -> 1 and the result is 2.
    """
    x = np.array([[2], [4]], np.int32)
    w = np.array([0.5, 1.5], np.float32)
    np.testing.assert_allclose(ff.weighted_mean(x, w), np.average(x, axis=0, weights=w))


@pytest.mark.parametrize("jit", JITS)
def test_sum_of_bool_and_small_int_client_values(jit):
    """Counting flags (bool) and small ints: values as np.sum. Demonstrates a bug: the
    abstract eval keeps the input dtype (bool, int8) while the impl/lowering (jnp.sum)
    promotes to int32, so under jit lowering fails ("Cannot lower jaxpr with verifier
    errors") and eagerly the result's dtype disagrees with the traced aval."""
    flags = np.array([[True, False], [True, True], [False, True]])
    small = np.array([[1, -2], [3, 4], [5, 6]], np.int8)
    total_flags, total_small, mean_flags = maybe_jit(
        lambda f, s: (ff.sum(f), ff.sum(s), ff.mean(f)), jit
    )(flags, small)
    np.testing.assert_array_equal(total_flags, flags.sum(0))
    np.testing.assert_array_equal(total_small, small.sum(0))
    np.testing.assert_allclose(mean_flags, flags.mean(0), rtol=1e-6)


def test_mean_of_integers_is_true_division():
    x = np.array([[1], [2]], np.int32)
    np.testing.assert_allclose(ff.mean(x), [1.5])


@pytest.mark.parametrize(
    "bad_weights",
    [np.ones((4,)), np.ones((3, 1)), np.ones(()), np.ones((1, 3))],
    ids=["too-many", "column", "scalar", "row"],
)
def test_weighted_mean_wrong_weight_shape(bad_weights):
    x = {"a": np.ones((3, 2), np.float32)}
    with pytest.raises(ValueError, match=r"weights must have shape \(3,\)"):
        ff.weighted_mean(x, bad_weights)


@pytest.mark.parametrize("agg", [ff.sum, ff.mean, lambda t: ff.weighted_mean(t, np.ones(3))])
def test_aggregating_a_scalar_leaf_is_an_error(agg):
    tree = {"a": np.ones((3, 2), np.float32), "b": np.float32(1.0)}
    with pytest.raises(ValueError, match="scalar leaf"):
        agg(tree)


def test_leaves_with_different_client_counts():
    tree = {"a": np.ones((3, 2), np.float32), "b": np.ones((4,), np.float32)}
    with pytest.raises(ValueError, match="disagree on the number of clients"):
        ff.sum(tree)
    with pytest.raises(ValueError, match="disagree on the number of clients"):
        ff.map_clients(lambda a, b: a, tree["a"], tree["b"])


def test_aggregating_an_empty_tree():
    with pytest.raises(ValueError, match="at least one array leaf"):
        ff.sum({})


@pytest.mark.parametrize("n", [0, -1, 2.0, "3", None])
def test_broadcast_needs_a_positive_int(n):
    with pytest.raises(ValueError, match="positive int number of clients"):
        ff.broadcast(np.ones(2, np.float32), n)


def test_map_clients_needs_an_argument():
    with pytest.raises(ValueError, match="at least one client-placed argument"):
        ff.map_clients(lambda: 1.0)


def test_sum_primitive_rejects_server_value():
    """The primitive itself, bound on a rank-0 value, raises a TypeError."""
    with pytest.raises(TypeError, match="client-placed"):
        jax.make_jaxpr(ff.sum_p.bind)(jnp.float32(1.0))


@pytest.mark.parametrize("jit", JITS)
def test_map_clients_values(jit):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 3)).astype(np.float32)
    d = {
        "s": rng.normal(size=(5,)).astype(np.float32),
        "m": rng.normal(size=(5, 3, 2)).astype(np.float32),
    }

    def f(xi, di):
        return {"dot": xi @ di["m"], "scaled": xi * di["s"]}

    got = maybe_jit(lambda x, d: ff.map_clients(f, x, d), jit)(x, d)
    expected = {
        "dot": np.einsum("nk,nkj->nj", x, d["m"]),
        "scaled": x * d["s"][:, None],
    }
    assert_tree_allclose(got, expected)


# --------------------------------------------------------------------------------------
# 2. Derivatives: closed forms, central finite differences, forward == reverse
# --------------------------------------------------------------------------------------

N_CLIENTS = 4


class Case:
    """A federated function R^k -> R^m, its NumPy float64 reference and closed-form Jacobian."""

    def __init__(self, name, fed, ref, x0, jac=None):
        self.name, self.fed, self.ref, self.x0, self.jac = name, fed, ref, x0, jac

    def __repr__(self):
        return self.name


def _make_cases():
    rng = np.random.default_rng(42)
    n = N_CLIENTS
    D = rng.normal(size=(n, 3))
    A = rng.normal(size=(n, 6, 3))
    b = rng.normal(size=(n, 6))
    X = rng.normal(size=(n, 3))
    wts = rng.uniform(0.5, 2.0, size=(n,))
    cases = []

    # (a) F(x) = sum_i g(x, d_i), g(x, d) = [sum_j sin(x_j d_j), (x.d)^2 / 2]
    def g(x, d):
        return jnp.stack([jnp.sum(jnp.sin(x * d)), 0.5 * jnp.dot(x, d) ** 2])

    def fed_map(x):
        d = jnp.asarray(D, x.dtype)
        return ff.sum(ff.map_clients(g, ff.broadcast(x, n), d))

    def ref_map(x):
        return np.stack([np.sin(x * D).sum(), 0.5 * ((D @ x) ** 2).sum()])

    def jac_map(x):
        return np.stack([(np.cos(x * D) * D).sum(0), ((D @ x)[:, None] * D).sum(0)])

    cases.append(Case("map-sum", fed_map, ref_map, np.array([0.3, -0.7, 1.1]), jac_map))

    # (b) mean over clients of a least-squares loss l_i(w) = ||A_i w - b_i||^2 / (2 m)
    def lsq(w, a, bb):
        return 0.5 * jnp.mean((a @ w - bb) ** 2)

    def fed_lsq(w):
        a, bb = jnp.asarray(A, w.dtype), jnp.asarray(b, w.dtype)
        return ff.mean(ff.map_clients(lsq, ff.broadcast(w, n), a, bb)).reshape(1)

    def ref_lsq(w):
        return np.array([np.mean([0.5 * np.mean((A[i] @ w - b[i]) ** 2) for i in range(n)])])

    def jac_lsq(w):  # mean of the per-client gradients A_i^T (A_i w - b_i) / m
        grads = [A[i].T @ (A[i] @ w - b[i]) / A.shape[1] for i in range(n)]
        return np.mean(grads, axis=0)[None, :]

    cases.append(Case("mean-lsq", fed_lsq, ref_lsq, np.array([0.5, -1.0, 0.25]), jac_lsq))

    # (c) weighted_mean differentiated in the weights:
    #     d/dw_j [sum_i w_i x_i / sum_i w_i] = (x_j - result) / sum_i w_i
    def fed_wm_w(w):
        return ff.weighted_mean(jnp.asarray(X, w.dtype), w)

    def ref_wm_w(w):
        return np.average(X, axis=0, weights=w)

    def jac_wm_w(w):
        return (X - ref_wm_w(w)).T / w.sum()

    cases.append(Case("wmean-weights", fed_wm_w, ref_wm_w, wts, jac_wm_w))

    # (d) weighted_mean differentiated in the client values: d out_k / d x_{i,k} = w_i / sum w
    def fed_wm_x(xflat):
        return ff.weighted_mean(xflat.reshape(n, 3), jnp.asarray(wts, xflat.dtype))

    def ref_wm_x(xflat):
        return np.average(xflat.reshape(n, 3), axis=0, weights=wts)

    def jac_wm_x(xflat):
        return np.einsum("i,kl->kil", wts / wts.sum(), np.eye(3)).reshape(3, n * 3)

    cases.append(Case("wmean-values", fed_wm_x, ref_wm_x, X.reshape(-1), jac_wm_x))

    # (e) a FedAvg-like round on a pytree model: broadcast, one local gradient step of a
    # tanh regression per client (AD inside map_clients), weighted mean, server tanh.
    Y = rng.normal(size=(n, 6, 2))
    lr = 0.3

    def unflatten(v):
        return {"w": v[:6].reshape(3, 2), "b": v[6:]}

    def local_step(p, a, y):
        def loss(p):
            return 0.5 * jnp.mean(jnp.sum((jnp.tanh(a @ p["w"] + p["b"]) - y) ** 2, -1))

        gr = jax.grad(loss)(p)
        return jax.tree.map(lambda u, v: u - lr * v, p, gr)

    def fed_round(v):
        p = unflatten(v)
        a, y = jnp.asarray(A, v.dtype), jnp.asarray(Y, v.dtype)
        new = ff.map_clients(local_step, ff.broadcast(p, n), a, y)
        avg = ff.weighted_mean(new, jnp.asarray(wts, v.dtype))
        return jnp.tanh(jnp.concatenate([avg["w"].reshape(-1), avg["b"]]))

    def ref_round(v):
        p = unflatten(v)
        news = []
        for i in range(n):
            z = A[i] @ p["w"] + p["b"]
            dz = (np.tanh(z) - Y[i]) * (1 - np.tanh(z) ** 2) / A.shape[1]
            news.append(
                np.concatenate([(p["w"] - lr * A[i].T @ dz).reshape(-1), p["b"] - lr * dz.sum(0)])
            )
        return np.tanh(np.average(news, axis=0, weights=wts))

    cases.append(Case("fedavg-round", fed_round, ref_round, rng.normal(size=8) * 0.5))
    return cases


CASES = _make_cases()
# Eager AD dispatches (and compiles) op by op, about a second per derivative here, so the
# no-jit column of the matrix runs on one case; the other eager tests use small programs.
EAGER_CASES = ("wmean-weights",)
NESTED_CASES = ("map-sum", "wmean-weights")
HEAVY_CASES = ("fedavg-round",)  # compiles slowly: one placement, float64 only
PLACEMENTS = ("nojit", "jit", "jit-nested")


def all_modes(f, x, c, t, placement):
    """Value and derivatives of f at x by every AD mode: full Jacobians by jacrev and jacfwd;
    c^T J by grad (of c . f) and by vjp; J t by jvp. `placement`: eager ("nojit"), under one
    jit ("jit"), or derivatives of a jitted f under an outer jit ("jit-nested": exercises
    the jvp and transpose of the primitives inside a pjit)."""
    if placement == "jit-nested":
        f = jax.jit(f)

    def derivs(x, c, t):
        out = {
            "value": f(x),
            "grad": jax.grad(lambda z: jnp.dot(c, f(z)))(x),
            "vjp": jax.vjp(f, x)[1](c)[0],
            "jvp": jax.jvp(f, (x,), (t,))[1],
        }
        if placement != "nojit":  # eager jacrev/jacfwd are eager vmaps of the above: slow
            out["jacrev"] = jax.jacrev(f)(x)
            out["jacfwd"] = jax.jacfwd(f)(x)
        return out

    if placement != "nojit":
        derivs = jax.jit(derivs)
    return jax.tree.map(np.asarray, derivs(x, c, t))


def _check_modes(got, J, c, t, rtol, atol):
    for mode in ("jacrev", "jacfwd"):
        if mode in got:
            assert got[mode].shape == J.shape, mode
            np.testing.assert_allclose(got[mode], J, rtol=rtol, atol=atol, err_msg=mode)
    np.testing.assert_allclose(got["grad"], c @ J, rtol=rtol, atol=atol, err_msg="grad")
    np.testing.assert_allclose(got["vjp"], c @ J, rtol=rtol, atol=atol, err_msg="vjp")
    np.testing.assert_allclose(got["jvp"], J @ t, rtol=rtol, atol=atol, err_msg="jvp")


def _probe_vectors(case):
    rng = np.random.default_rng(len(case.name))
    m = np.shape(case.ref(case.x0))[0]
    return rng.normal(size=m), rng.normal(size=np.shape(case.x0))


@pytest.mark.parametrize(
    "case, placement",
    [
        pytest.param(case, placement, id=f"{case.name}-{placement}")
        for case in CASES
        for placement in PLACEMENTS
        if placement == "jit"
        or (placement == "nojit" and case.name in EAGER_CASES)
        or (placement == "jit-nested" and case.name in NESTED_CASES)
    ],
)
def test_derivatives_match_finite_differences(x64, case, placement):
    """float64: every mode against central differences of the NumPy reference (and the
    closed form where there is one)."""
    c, t = _probe_vectors(case)
    x = jnp.asarray(case.x0, jnp.float64)
    got = all_modes(case.fed, x, jnp.asarray(c), jnp.asarray(t), placement)
    assert got["value"].dtype == np.float64
    np.testing.assert_allclose(got["value"], case.ref(case.x0), rtol=1e-12, atol=1e-12)
    J_fd = central_fd_jacobian(case.ref, case.x0)
    _check_modes(got, J_fd, c, t, rtol=1e-6, atol=1e-6 * np.abs(J_fd).max())
    if case.jac is not None:
        J = case.jac(case.x0)
        np.testing.assert_allclose(J, J_fd, rtol=1e-6, atol=1e-6 * np.abs(J).max())  # sanity
        _check_modes(got, J, c, t, rtol=1e-10, atol=1e-12)
    # forward mode == reverse mode
    if placement != "nojit":
        np.testing.assert_allclose(got["jacfwd"], got["jacrev"], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(c @ got["jvp"], got["vjp"] @ t, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.name in ("map-sum", "mean-lsq", "wmean-weights")], ids=repr
)
def test_float32_derivatives(case):
    """The default dtype: every mode (jitted) against the closed form (or FD), and
    forward == reverse."""
    c, t = _probe_vectors(case)
    x = jnp.asarray(case.x0, jnp.float32)
    got = all_modes(case.fed, x, jnp.asarray(c, jnp.float32), jnp.asarray(t, jnp.float32), "jit")
    assert all(v.dtype == np.float32 for v in got.values())
    J = case.jac(case.x0) if case.jac is not None else central_fd_jacobian(case.ref, case.x0)
    _check_modes(got, J, c, t, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(J).max()))
    np.testing.assert_allclose(got["jacfwd"], got["jacrev"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit", JITS)
def test_broadcast_and_sum_drjax_tutorial(jit):
    def broadcast_and_sum(x):
        return ff.sum(ff.broadcast(x, 3))

    def everything(x):
        return {
            "value": broadcast_and_sum(x),
            "grad": jax.grad(broadcast_and_sum)(x),
            "jacfwd": jax.jacfwd(broadcast_and_sum)(x),
            "jvp": jax.jvp(broadcast_and_sum, (x,), (1.0,)),
            "vjp": jax.vjp(broadcast_and_sum, x)[1](jnp.float32(1.0))[0],
            # mean instead of sum: derivative 1
            "grad_mean": jax.grad(lambda x: ff.mean(ff.broadcast(x, 3)))(x),
        }

    got = maybe_jit(everything, jit)(2.0)
    assert jax.tree.map(float, got) == {
        "value": 6.0,
        "grad": 3.0,
        "jacfwd": 3.0,
        "jvp": (6.0, 3.0),
        "vjp": 3.0,
        "grad_mean": 1.0,
    }


def test_vjp_with_a_python_scalar_cotangent():
    """Eager vjp with a Python float cotangent (as jax.vjp allows). Demonstrates a bug: the
    transpose of sum binds broadcast_p on a non-array scalar and _broadcast_impl does x[None]
    ("'TypedFloat' object is not subscriptable")."""
    f = lambda x: ff.sum(ff.broadcast(x, 3))  # noqa: E731
    assert float(jax.vjp(f, 2.0)[1](1.0)[0]) == 3.0
    np.testing.assert_array_equal(jax.linear_transpose(ff.sum, jnp.ones((3,)))(1.0)[0], np.ones(3))


def test_primitive_jacobians():
    """d broadcast(x)/dx = stacked identities; d sum(y)/dy = [I, ..., I]; mean = that / n."""
    n = 3
    x = jnp.arange(2.0)
    y = jnp.ones((n, 2))
    eye = np.eye(2)

    def jacobians(x, y):
        b = lambda x: ff.broadcast(x, n)  # noqa: E731
        return [(jac(b)(x), jac(ff.sum)(y), jac(ff.mean)(y)) for jac in (jax.jacrev, jax.jacfwd)]

    for jb, js, jm in jax.jit(jacobians)(x, y):
        np.testing.assert_array_equal(jb, np.stack([eye] * n))
        np.testing.assert_array_equal(js, np.stack([eye] * n, axis=1))
        np.testing.assert_allclose(jm, np.stack([eye] * n, axis=1) / n, rtol=1e-7)


@pytest.mark.parametrize(
    "name, fn, arg, expected",
    [
        ("broadcast", lambda x: ff.broadcast(x, 4), np.float32(1.0), np.ones(4)),
        ("sum", ff.sum, np.ones((4, 1), np.float32), np.ones((1, 4, 1))),
        ("mean", ff.mean, np.ones((4, 1), np.float32), np.full((1, 4, 1), 0.25)),
        (
            "weighted_mean",
            lambda x: ff.weighted_mean(x, jnp.arange(1.0, 5.0)),
            np.ones((4, 1), np.float32),
            np.arange(1.0, 5.0).reshape(1, 4, 1) / 10,
        ),
    ],
)
def test_reverse_mode_with_symbolic_zero_cotangent_under_jit(name, fn, arg, expected):
    """As in DrJAX: ignoring one output of a jitted function transposes a symbolic zero."""

    @jax.jit
    def twice(x):
        return fn(x), fn(x)

    @jax.jit
    def first(x):
        return twice(x)[0]

    rev, fwd = jax.jit(lambda a: (jax.jacrev(first)(a), jax.jacfwd(first)(a)))(arg)
    np.testing.assert_allclose(rev, expected, rtol=1e-6)
    np.testing.assert_allclose(fwd, expected, rtol=1e-6)


@pytest.mark.parametrize("jit", JITS)
def test_unused_broadcast_leaf_has_zero_gradient(jit):
    def f(p):
        c = ff.broadcast(p, 3)
        return ff.sum(ff.map_clients(jnp.sin, c["used"])).sum()

    p = {"used": jnp.array([0.1, 0.2]), "unused": jnp.ones(3)}
    derivatives = (
        [jax.grad(f)] if jit == "nojit" else [jax.jit(jax.grad(f)), jax.jit(jax.jacfwd(f))]
    )
    for d in derivatives:
        g = d(p)
        np.testing.assert_allclose(g["used"], 3 * np.cos([0.1, 0.2]), rtol=1e-6)
        np.testing.assert_array_equal(g["unused"], np.zeros(3))


def test_second_derivative_of_mean_lsq_loss():
    """The derivative program is federated, hence differentiable again:
    Hessian of mean_i ||A_i w - b_i||^2/(2m) is mean_i A_i^T A_i / m."""
    rng = np.random.default_rng(3)
    n, m = 5, 4
    A = rng.normal(size=(n, m, 3)).astype(np.float32)
    b = rng.normal(size=(n, m)).astype(np.float32)

    def loss(w):
        per_client = ff.map_clients(
            lambda w, a, bb: 0.5 * jnp.mean((a @ w - bb) ** 2), ff.broadcast(w, n), A, b
        )
        return ff.mean(per_client)

    @jax.jit
    def hessians(w):
        return (
            jax.jacfwd(jax.jacrev(loss))(w),
            jax.jacrev(jax.jacrev(loss))(w),
            jax.hessian(loss)(w),
        )

    expected = np.mean([A[i].T.astype(np.float64) @ A[i] / m for i in range(n)], axis=0)
    for h in hessians(jnp.array([0.2, -0.1, 0.4])):
        np.testing.assert_allclose(h, expected, rtol=1e-5, atol=1e-6)


def test_gradient_wrt_client_placed_data_is_per_client():
    """d/dD_i of sum_i sin(x . d_i) = cos(x . d_i) x, one row per client."""
    rng = np.random.default_rng(5)
    D = rng.normal(size=(6, 3)).astype(np.float32)
    x = np.array([0.5, -0.2, 0.3], np.float32)

    def f(D):
        return ff.sum(ff.map_clients(lambda xi, di: jnp.sin(xi @ di), ff.broadcast(x, 6), D))

    expected = np.cos(D @ x)[:, None] * x[None, :]
    np.testing.assert_allclose(jax.jit(jax.grad(f))(D), expected, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------
# 3. vmap over the primitives: a batch of independent federated computations
# --------------------------------------------------------------------------------------


def _np_round(x, D, w):
    """Reference for weighted_mean(map_clients(sin(x * d) + x^2), w), one batch element."""
    return np.average(np.sin(x[None] * D) + x[None] ** 2, axis=0, weights=w)


def _fed_round(x, D, w):
    n = D.shape[0]
    per_client = ff.map_clients(lambda xi, di: jnp.sin(xi * di) + xi**2, ff.broadcast(x, n), D)
    return ff.weighted_mean(per_client, w)


@pytest.mark.parametrize("strategy", ["vmap", "sequential", "unroll"])
def test_vmap_of_federated_computation_equals_loop(strategy):
    rng = np.random.default_rng(7)
    B, n = 3, 5
    xs = rng.normal(size=(B, 3)).astype(np.float32)
    Ds = rng.normal(size=(B, n, 3)).astype(np.float32)
    ws = rng.uniform(0.5, 2, size=(B, n)).astype(np.float32)

    def everything(xs, Ds, ws):  # a fresh function: traced under this strategy
        value = jax.vmap(_fed_round)(xs, Ds, ws)
        # per-batch gradients (vmap of grad) and the gradient of the vmapped computation
        per_batch = jax.vmap(jax.grad(lambda x, D, w: _fed_round(x, D, w).sum()))(xs, Ds, ws)
        of_vmap = jax.grad(lambda xs: jax.vmap(_fed_round)(xs, Ds, ws).sum())(xs)
        return value, per_batch, of_vmap

    with ff.map_strategy(strategy):
        value, per_batch, of_vmap = jax.jit(everything)(xs, Ds, ws)
    expected = np.stack([_np_round(xs[i], Ds[i], ws[i]) for i in range(B)])
    np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)
    # d/dx of sum_k avg_i(sin(x_k d_ik) + x_k^2) = avg_i(cos(x_k d_ik) d_ik) + 2 x_k
    expected_g = np.stack(
        [
            np.average(np.cos(xs[i] * Ds[i]) * Ds[i], axis=0, weights=ws[i]) + 2 * xs[i]
            for i in range(B)
        ]
    )
    np.testing.assert_allclose(per_batch, expected_g, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(of_vmap, expected_g, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis, jit", [(0, "jit"), (1, "jit"), (2, "jit"), (1, "nojit")])
def test_vmap_aggregations_over_any_batch_axis(axis, jit):
    """A batch axis at any position of a client-placed input (clients axis stays first)."""
    rng = np.random.default_rng(axis)
    n, B = 4, 3
    logical = rng.normal(size=(B, n, 2, 5)).astype(np.float32)  # [batch, clients, 2, 5]
    physical = np.moveaxis(logical, 0, axis)  # batch axis at position `axis`
    w = rng.uniform(0.5, 2, size=(n,)).astype(np.float32)

    def aggregates(y, w):
        vm = lambda f, *extra: jax.vmap(f, in_axes=(axis, *extra))  # noqa: E731
        # gradient of a vmapped sum: every client gets the cotangent (a broadcast)
        g = jax.grad(lambda y: vm(ff.sum)(y).sum())(y)
        return vm(ff.sum)(y), vm(ff.mean)(y), vm(ff.weighted_mean, None)(y, w), g

    total, mean, wmean, g = maybe_jit(aggregates, jit)(physical, w)
    np.testing.assert_allclose(total, logical.sum(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mean, logical.mean(1), rtol=1e-5, atol=1e-6)
    expected = np.stack([np.average(logical[i], axis=0, weights=w) for i in range(B)])
    np.testing.assert_allclose(wmean, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(g, np.ones_like(physical))


@pytest.mark.parametrize("out_axes", [0, 1])
def test_vmap_broadcast_and_client_placed_input_in_axes_1(out_axes):
    rng = np.random.default_rng(11)
    B, n = 2, 5
    xs = rng.normal(size=(B, 3)).astype(np.float32)
    # Client data stored [clients, batch, ...] and mapped with in_axes=1.
    D = rng.normal(size=(n, B, 3)).astype(np.float32)
    w = rng.uniform(0.5, 2, size=(n,)).astype(np.float32)

    def both(xs, D, w):
        placed = jax.vmap(lambda x: ff.broadcast(x, n), out_axes=out_axes)(xs)
        return placed, jax.vmap(_fed_round, in_axes=(0, 1, None))(xs, D, w)

    placed, got = jax.jit(both)(xs, D, w)
    expected = np.broadcast_to(xs[:, None], (B, n, 3))
    np.testing.assert_array_equal(placed, np.moveaxis(expected, 0, out_axes))
    expected = np.stack([_np_round(xs[i], D[:, i], w) for i in range(B)])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------
# 4. Jaxpr closure: derivatives are written in the placement primitives
# --------------------------------------------------------------------------------------

BCAST, FSUM = "federated_broadcast", "federated_sum"


def test_transpose_of_broadcast_is_sum_and_vice_versa():
    n = 5
    x = jnp.ones((3,))
    y = jnp.ones((n, 3))
    t_b = jax.linear_transpose(lambda x: ff.broadcast(x, n), x)
    t_s = jax.linear_transpose(ff.sum, y)
    counts_b = prim_counts(t_b, y)
    counts_s = prim_counts(t_s, x)
    assert counts_b[FSUM] == 1 and counts_b[BCAST] == 0, counts_b
    assert counts_s[BCAST] == 1 and counts_s[FSUM] == 0, counts_s
    assert not clients_axis_reductions(t_b, y, n=n)
    np.testing.assert_array_equal(t_b(y)[0], np.full(3, n))
    np.testing.assert_array_equal(t_s(x)[0], np.ones((n, 3)))


def _elementwise_federated(k, n, inner_jit=False):
    """F(x) = sum over k leaves of sum(map_clients(g, broadcast(x, n))), g elementwise."""

    def g(leaf):
        return jnp.sin(leaf) * leaf

    def F(xs):
        out = ff.sum(ff.map_clients(lambda t: jax.tree.map(g, t), ff.broadcast(xs, n)))
        return jnp.sum(jnp.stack(jax.tree.leaves(out)))

    return jax.jit(F) if inner_jit else F


@pytest.mark.parametrize("strategy", ["vmap", "sequential", "unroll"])
@pytest.mark.parametrize("inner_jit", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_grad_jaxpr_mirrors_broadcasts_with_sums(k, inner_jit, strategy):
    n = 7
    xs = [jnp.float32(0.1 * (i + 1)) for i in range(k)]  # k scalar leaves -> k broadcasts
    with ff.map_strategy(strategy):
        F = _elementwise_federated(k, n, inner_jit)
        primal = prim_counts(F, xs)
        rev = prim_counts(jax.grad(F), xs)
        leaks = clients_axis_reductions(jax.grad(F), xs, n=n)
    assert primal[BCAST] == k and primal[FSUM] == k, primal
    # reverse pass: each broadcast adds a sum, each sum adds a broadcast
    assert rev[BCAST] == 2 * k and rev[FSUM] == 2 * k, rev
    assert not leaks, f"non-federated reduction over the clients axis: {leaks}"


def test_closure_check_catches_a_non_federated_transpose(monkeypatch):
    """The check above must fail if broadcast's transpose were a plain jnp.sum."""
    original = ad.primitive_transposes[ff.broadcast_p]

    def leaky(ct, x, *, n):
        if type(ct) is ad.Zero:
            return original(ct, x, n=n)
        return [jnp.sum(ct, axis=0)]

    monkeypatch.setitem(ad.primitive_transposes, ff.broadcast_p, leaky)
    n = 7
    F = _elementwise_federated(1, n)
    xs = [jnp.float32(0.3)]
    rev = prim_counts(jax.grad(F), xs)
    assert rev[FSUM] == 1  # only the primal sum is federated
    assert clients_axis_reductions(jax.grad(F), xs, n=n)


@pytest.mark.parametrize("inner_jit", [False, True])
def test_jvp_tangent_goes_through_broadcast_and_sum(inner_jit):
    n = 6
    F = _elementwise_federated(1, n, inner_jit)
    xs = [jnp.float32(0.4)]
    both = prim_counts(lambda x, t: jax.jvp(F, (x,), (t,)), xs, xs)
    assert both[BCAST] == 2 and both[FSUM] == 2, both  # primal and tangent
    # the linear (tangent) program alone
    _, f_lin = jax.linearize(F, xs)
    lin = prim_counts(f_lin, xs)
    assert lin[BCAST] == 1 and lin[FSUM] == 1, lin
    assert not clients_axis_reductions(f_lin, xs, n=n)
    np.testing.assert_allclose(
        f_lin([jnp.float32(1.0)]), n * (np.cos(0.4) * 0.4 + np.sin(0.4)), rtol=1e-5
    )


def test_weighted_mean_weight_derivative_is_federated():
    """Reverse mode in the weights: the cotangent is broadcast back, per-client dot."""
    n = 5
    X = jnp.asarray(np.random.default_rng(0).normal(size=(n, 3)), jnp.float32)
    f = lambda w: ff.weighted_mean(X, w).sum()  # noqa: E731
    w = jnp.ones(n)
    rev = prim_counts(jax.grad(f), w)
    # primal: sum(w) and sum(w x); reverse: one broadcast per primal sum
    assert rev[FSUM] == 2 and rev[BCAST] == 2, rev
    assert not clients_axis_reductions(jax.grad(f), w, n=n)


# --------------------------------------------------------------------------------------
# 5. map_clients execution strategies
# --------------------------------------------------------------------------------------

LOCAL_STEPS, LOCAL_LR = 2, 0.1


def _fresh_local_sgd_program(n):
    """Value and gradient (in the params and the weights) of a FedAvg-like round with a
    local lax.scan of SGD steps. A new function object every call (JAX caches traces per
    function, not per strategy)."""

    def local(p, a, y):
        def body(p, _):
            loss = lambda p: 0.5 * jnp.mean((jnp.tanh(a @ p["w"] + p["b"]) - y) ** 2)  # noqa: E731
            return jax.tree.map(lambda u, v: u - LOCAL_LR * v, p, jax.grad(loss)(p)), None

        return jax.lax.scan(body, p, None, length=LOCAL_STEPS)[0]

    def round_(p, A, Y, w):
        return ff.weighted_mean(ff.map_clients(local, ff.broadcast(p, n), A, Y), w)

    def loss(p, A, Y, w):
        out = round_(p, A, Y, w)
        return jnp.sum(out["w"] ** 2) + jnp.sum(jnp.sin(out["b"]))

    def program(p, A, Y, w):
        return round_(p, A, Y, w), jax.grad(loss, argnums=(0, 3))(p, A, Y, w)

    return program


@pytest.fixture(scope="module")
def sgd_data():
    rng = np.random.default_rng(9)
    n = 4
    p = {
        "w": rng.normal(size=(3, 2)).astype(np.float32),
        "b": rng.normal(size=(2,)).astype(np.float32),
    }
    A = rng.normal(size=(n, 5, 3)).astype(np.float32)
    Y = rng.normal(size=(n, 5, 2)).astype(np.float32)
    w = rng.uniform(1, 4, size=(n,)).astype(np.float32)
    return n, p, A, Y, w


@pytest.fixture(scope="module")
def strategy_results(sgd_data):
    cache = {}

    def results(strategy):
        if strategy not in cache:
            n, p, A, Y, w = sgd_data
            with ff.map_strategy(strategy):
                assert ff.current_map_strategy() == strategy
                cache[strategy] = jax.jit(_fresh_local_sgd_program(n))(p, A, Y, w)
        return cache[strategy]

    return results


@pytest.mark.parametrize("strategy", ["sequential", "unroll", "lockstep"])
def test_strategies_give_identical_values_and_gradients(strategy, strategy_results):
    assert_tree_allclose(strategy_results(strategy), strategy_results("vmap"), rtol=1e-6, atol=1e-6)


def test_vmap_strategy_matches_numpy_round(sgd_data, strategy_results):
    """Anchor the strategy comparison to an independent reference."""
    n, p, A, Y, w = sgd_data
    value, _ = strategy_results("vmap")
    news = []
    for i in range(n):
        W, b = p["w"].astype(np.float64), p["b"].astype(np.float64)
        for _ in range(LOCAL_STEPS):
            z = A[i] @ W + b
            dz = (np.tanh(z) - Y[i]) * (1 - np.tanh(z) ** 2) / z.size
            W, b = W - LOCAL_LR * A[i].T @ dz, b - LOCAL_LR * dz.sum(0)
        news.append((W, b))
    expected = {
        "w": np.average([u for u, _ in news], axis=0, weights=w),
        "b": np.average([v for _, v in news], axis=0, weights=w),
    }
    assert_tree_allclose(value, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "strategy, expected",
    [
        ("vmap", {"scan": 0, "sin": 1}),
        ("sequential", {"scan": 1, "sin": 1}),
        ("unroll", {"scan": 0, "sin": 4}),
    ],
)
def test_strategy_shapes_the_program(strategy, expected):
    n = 4

    def f(x):  # defined here: a fresh function, so no cached trace
        return ff.sum(ff.map_clients(jnp.sin, ff.broadcast(x, n)))

    with ff.map_strategy(strategy):
        counts = prim_counts(f, jnp.ones(3))
    assert {"scan": counts["scan"], "sin": counts["sin"]} == expected, counts


def test_strategy_is_not_ignored_by_an_earlier_trace():
    """A function traced once under 'vmap' and again under 'sequential' must follow the
    strategy in force at the second call. Demonstrates a bug: the strategy lives in a
    contextvar that is not part of JAX's trace-cache key, so make_jaxpr / jax.jit (even a
    new jax.jit wrapper) silently reuse the vmap trace."""
    n = 4

    def f(x):
        return ff.sum(ff.map_clients(jnp.sin, ff.broadcast(x, n)))

    x = jnp.ones(3)
    assert prim_counts(f, x)["scan"] == 0
    with ff.map_strategy("sequential"):
        assert prim_counts(f, x)["scan"] == 1
        assert "while" in jax.jit(f).lower(x).as_text()


def test_unknown_strategy_and_context_restore():
    assert ff.current_map_strategy() == "vmap"
    with pytest.raises(ValueError, match="unknown map strategy 'pmap'"):
        with ff.map_strategy("pmap"):
            pass
    with ff.map_strategy("sequential"):
        with ff.map_strategy("unroll"):
            assert ff.current_map_strategy() == "unroll"
        assert ff.current_map_strategy() == "sequential"
    with pytest.raises(RuntimeError):
        with ff.map_strategy("unroll"):
            raise RuntimeError
    assert ff.current_map_strategy() == "vmap"


# --------------------------------------------------------------------------------------
# 6. Sharding over a device mesh
# --------------------------------------------------------------------------------------

AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def _mesh(axis_type, name="clients"):
    return jax.make_mesh((8,), (name,), axis_types=(AXIS_TYPES[axis_type],))


def _fresh_mesh_program(n, eager=False):
    """Value, reverse mode (grad in the server value and in the client values), forward
    mode (jvp) and vmap of F(x) = weighted_mean_i(sin(x d_i) + x^2 d_i / 2). A new function every
    call. `eager`: only the value (eager ops under a mesh compile one by one: slow)."""

    def per_client(x, d):
        return jnp.sin(x * d) + 0.5 * x**2 * d

    def F(x, D, w):
        return ff.weighted_mean(ff.map_clients(per_client, ff.broadcast(x, n), D), w)

    def program(x, D, w):
        out = {"value": F(x, D, w)}
        if not eager:
            out["dx"] = jax.grad(lambda x: F(x, D, w).sum())(x)
            out["jvp"] = jax.jvp(lambda x: F(x, D, w), (x,), (jnp.ones_like(x),))[1]
            out["dD"] = jax.grad(lambda D: F(x, D, w).sum())(D)
            # a batch of two independent federated computations (vmap x mesh)
            out["vmap"] = jax.vmap(F, in_axes=(0, None, None))(jnp.stack([x, -x]), D, w)
        return out

    return program


def _mesh_reference(x, D, w, eager=False):
    """Closed forms for _fresh_mesh_program (F is elementwise in x, so J 1 = grad)."""
    x, D, w = (np.asarray(a, np.float64) for a in (x, D, w))
    value = np.average(np.sin(x * D) + 0.5 * x**2 * D, axis=0, weights=w)
    if eager:
        return {"value": value}
    dx = np.average(np.cos(x * D) * D + x * D, axis=0, weights=w)
    dD = (w / w.sum())[:, None] * (np.cos(x * D) * x + 0.5 * x**2)
    at_minus_x = np.average(np.sin(-x * D) + 0.5 * x**2 * D, axis=0, weights=w)
    return {"value": value, "dx": dx, "jvp": dx, "dD": dD, "vmap": np.stack([value, at_minus_x])}


def _mesh_data(n):
    """Server value, client values and weights, as jax arrays made outside any mesh."""
    rng = np.random.default_rng(n)
    x = jnp.asarray(rng.normal(size=(3,)), jnp.float32)
    D = jnp.asarray(rng.normal(size=(n, 3)), jnp.float32)
    w = jnp.asarray(rng.uniform(0.5, 2, size=(n,)), jnp.float32)
    return x, D, w


def test_default_mesh_fixture_has_clients_axis(mesh):
    assert mesh.axis_names == ("clients",) and mesh.size == 8
    assert len(jax.devices()) == 8


def test_reference_program_without_mesh():
    x, D, w = _mesh_data(8)
    got = jax.jit(_fresh_mesh_program(8))(x, D, w)
    assert_tree_allclose(got, _mesh_reference(x, D, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
@pytest.mark.parametrize("jit, n", [("jit", 16), ("nojit", 8)])
def test_mesh_gives_same_values_and_derivatives(axis_type, jit, n):
    """Under jax.set_mesh with a 'clients' axis: the same numbers as without a mesh (whose
    program is checked against the same closed forms above). The inputs are jax arrays
    made before entering the mesh, as a runner's would be; eagerly (no jit) that currently
    fails on an Auto mesh: with_sharding_constraint on a SingleDeviceSharding array."""
    x, D, w = _mesh_data(n)
    eager = jit == "nojit"
    with jax.set_mesh(_mesh(axis_type)):
        got = maybe_jit(_fresh_mesh_program(n, eager), jit)(x, D, w)
    assert_tree_allclose(got, _mesh_reference(x, D, w, eager), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [8, 16])
@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_client_placed_values_are_sharded_over_clients(axis_type, n):
    x, D, _ = _mesh_data(n)

    def f(x, D):
        placed = ff.broadcast(x, n)
        mapped = ff.map_clients(lambda a, d: jnp.cos(a * d), placed, D)
        return placed, mapped, ff.sum(mapped)

    with jax.set_mesh(_mesh(axis_type)):
        placed, mapped, total = jax.jit(f)(x, D)
    for out in (placed, mapped):
        assert out.sharding.spec[0] == "clients", out.sharding
        shards = out.addressable_shards
        assert len(shards) == 8
        assert {s.data.shape for s in shards} == {(n // 8, 3)}
        assert len({s.index[0].start for s in shards}) == 8  # 8 distinct blocks of clients
    np.testing.assert_allclose(placed, np.broadcast_to(x, (n, 3)))
    np.testing.assert_allclose(mapped, np.cos(x * D), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(total, np.cos(x * D).sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_comm_cost_is_the_same_under_a_mesh(axis_type):
    """Sharding changes where clients run, not what crosses the placements."""
    x = jnp.ones((3, 4), jnp.float32)

    def f(x):
        return ff.mean(ff.map_clients(jnp.sin, ff.broadcast(x, 16)))

    expected = ff.CommCost(16 * 48, 16 * 48, 1, 1, 0)  # 16 clients x 12 float32, each way
    assert ff.comm_cost(f, x) == expected
    with jax.set_mesh(_mesh(axis_type)):
        assert ff.comm_cost(lambda x: f(x), x) == expected
        assert ff.comm_cost(jax.grad(lambda x: f(x).sum()), x) == expected.scale(2)


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_clients_not_divisible_by_mesh_axis_is_a_clear_error(axis_type):
    """map_clients' helpful error must be reached; on an Explicit mesh broadcast's reshard
    currently fails first with JAX's 'does not evenly divide the dimension size 5'."""
    x, D, w = _mesh_data(5)
    with jax.set_mesh(_mesh(axis_type)):
        with pytest.raises(ValueError, match="cannot be split evenly"):
            jax.jit(_fresh_mesh_program(5))(x, D, w)


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_mesh_without_clients_axis_applies_no_constraint(axis_type):
    n = 5  # not a multiple of 8: nothing may try to shard the clients axis
    x, D, w = _mesh_data(n)
    with jax.set_mesh(_mesh(axis_type, name="data")):
        got = jax.jit(_fresh_mesh_program(n))(x, D, w)
        jaxpr = jax.make_jaxpr(_fresh_mesh_program(n))(x, D, w)
    assert_tree_allclose(got, _mesh_reference(x, D, w), rtol=1e-5, atol=1e-5)
    assert not any(e.primitive.name == "sharding_constraint" for e in iter_eqns(jaxpr))


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_broadcast_of_a_server_value_sharded_over_another_axis(axis_type):
    """A server value sharded over a model axis (e.g. 'data') is placed at 3 clients; its
    own axes keep their sharding and the new clients axis is not partitioned."""
    with jax.set_mesh(_mesh(axis_type, name="data")):
        x = jax.device_put(jnp.arange(16.0), P("data"))
        f = lambda x: ff.sum(ff.map_clients(jnp.sin, ff.broadcast(x, 3)))  # noqa: E731
        out, grad = jax.jit(lambda x: (f(x), jax.grad(lambda x: f(x).sum())(x)))(x)
    np.testing.assert_allclose(out, 3 * np.sin(np.arange(16.0)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad, 3 * np.cos(np.arange(16.0)), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------
# 7. Communication cost
# --------------------------------------------------------------------------------------

N_COST = 5
# A model of 12 + 4 = 16 float32 = 64 bytes; 5 clients.
MODEL_BYTES = (12 + 4) * 4
# Forward round: broadcast the model to 5 clients; upload 5 models; weighted_mean also
# sums the 5 float32 weights (sum_i w_i), i.e. 5 * 4 bytes up.
DOWN = N_COST * MODEL_BYTES  # 320
UP = N_COST * MODEL_BYTES + N_COST * 4  # 320 + 20 = 340


@pytest.fixture(scope="module")
def cost_setup():
    rng = np.random.default_rng(0)
    params = {"w": jnp.ones((3, 4), jnp.float32), "b": jnp.zeros((4,), jnp.float32)}
    X = jnp.asarray(rng.normal(size=(N_COST, 6, 3)), jnp.float32)
    Y = jnp.asarray(rng.normal(size=(N_COST, 6, 4)), jnp.float32)
    wts = jnp.arange(1.0, N_COST + 1.0)

    def local_step(p, x, y):
        g = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2))(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

    def round_(p, w=wts):
        return ff.weighted_mean(ff.map_clients(local_step, ff.broadcast(p, N_COST), X, Y), w)

    def loss(p, w=wts):
        return sum(jnp.sum(v**2) for v in jax.tree.leaves(round_(p, w)))

    return params, wts, round_, loss


def test_comm_cost_forward_round(cost_setup):
    params, _, round_, _ = cost_setup
    cost = ff.comm_cost(round_, params)
    assert cost == ff.CommCost(DOWN, UP, broadcasts=2, aggregations=3, unbounded_loops=0)
    assert (cost.server_to_clients_bytes, cost.clients_to_server_bytes) == (320, 340)
    # jit, a map strategy, or passing the weights as a keyword change nothing
    assert ff.comm_cost(jax.jit(round_), params) == cost
    with ff.map_strategy("sequential"):
        assert ff.comm_cost(lambda p: round_(p), params) == cost
    assert ff.comm_cost(round_, params, w=cost_setup[1]) == cost


def test_comm_cost_reverse_mode(cost_setup):
    params, wts, _, loss = cost_setup
    # Reverse mode w.r.t. the params mirrors the exchange of the params:
    #   down: the primal broadcast (320) + the cotangent of the averaged model, broadcast back
    #         to the clients as the transpose of the two leaf sums (320)  -> 640 = 2 * DOWN
    #   up:   the primal sums (340, incl. the weights) + the per-client model cotangents
    #         summed as the transpose of the broadcast (320)               -> 660
    # The weights are not differentiated, so sum(w) is not mirrored: 660 = 2 * UP - 20.
    cost = ff.comm_cost(jax.grad(loss), params)
    assert cost == ff.CommCost(2 * DOWN, UP + N_COST * MODEL_BYTES, 4, 5, 0)
    assert (cost.server_to_clients_bytes, cost.clients_to_server_bytes) == (640, 660)
    # vjp prices the same
    vjp = lambda p: jax.vjp(lambda q: loss(q), p)[1](jnp.float32(1.0))  # noqa: E731
    assert ff.comm_cost(vjp, params) == cost
    # Differentiating in the weights too mirrors sum(w) as well: the cotangent of sum(w)
    # is broadcast back (5 * 4 bytes more down); now both directions are 660.
    both = ff.comm_cost(jax.grad(loss, argnums=(0, 1)), params, wts)
    assert both == ff.CommCost(2 * DOWN + N_COST * 4, UP + N_COST * MODEL_BYTES, 5, 5, 0)


def test_comm_cost_forward_mode(cost_setup):
    params, _, round_, _ = cost_setup
    # The tangent rides along: one more broadcast of the model down (320) and one more sum
    # of the models up (320); the weights are constants (zero tangent, no extra sum).
    jvp = lambda p, t: jax.jvp(round_, (p,), (t,))  # noqa: E731
    cost = ff.comm_cost(jvp, params, params)
    assert cost == ff.CommCost(2 * DOWN, UP + N_COST * MODEL_BYTES, 4, 5, 0)


def test_comm_cost_scan_of_rounds_and_fori_loop(cost_setup):
    params, _, round_, _ = cost_setup
    three = lambda p: jax.lax.scan(lambda q, _: (round_(q), None), p, None, length=3)[0]  # noqa: E731
    assert ff.comm_cost(three, params) == ff.CommCost(3 * DOWN, 3 * UP, 6, 9, 0)
    fori = lambda p: jax.lax.fori_loop(0, 4, lambda i, q: round_(q), p)  # noqa: E731
    assert ff.comm_cost(fori, params) == ff.CommCost(4 * DOWN, 4 * UP, 8, 12, 0)


def test_comm_cost_while_loop_is_a_flagged_lower_bound(cost_setup):
    params, _, round_, _ = cost_setup

    def until(p, k):
        return jax.lax.while_loop(lambda c: c[0] < k, lambda c: (c[0] + 1, round_(c[1])), (0, p))[1]

    cost = ff.comm_cost(until, params, 3)
    assert cost == ff.CommCost(DOWN, UP, 2, 3, unbounded_loops=1)


def test_comm_cost_cond_counts_the_dearer_branch(cost_setup):
    params, _, round_, _ = cost_setup
    # cheap: 5 clients x 16 bytes (4 float32) down and up; dear: a whole round
    cheap = lambda p: ff.mean(ff.broadcast(p["b"], N_COST))  # noqa: E731
    dear = lambda p: round_(p)["b"]  # noqa: E731
    for branches in ((cheap, dear), (dear, cheap)):
        f = lambda p, i, branches=branches: jax.lax.switch(i, branches, p)  # noqa: E731
        assert ff.comm_cost(f, params, 0) == ff.CommCost(DOWN, UP, 2, 3, 0)
    only_cheap = lambda p, c: jax.lax.cond(c, cheap, lambda p: p["b"], p)  # noqa: E731
    assert ff.comm_cost(only_cheap, params, True) == ff.CommCost(N_COST * 16, N_COST * 16, 1, 1, 0)


def test_comm_cost_vmap_of_rounds_and_dtype(cost_setup):
    params, _, round_, _ = cost_setup
    # 2 independent rounds (vmap) move twice the bytes, in the same number of operations;
    # the weights are closed over (shared by both rounds), so sum(w) is counted once.
    batched = jax.tree.map(lambda a: jnp.stack([a, a]), params)
    cost = ff.comm_cost(jax.vmap(round_), batched)
    assert cost == ff.CommCost(2 * DOWN, 2 * N_COST * MODEL_BYTES + N_COST * 4, 2, 3, 0)
    # bfloat16 values: 2 bytes per number
    x = jnp.ones((3, 4), jnp.bfloat16)
    assert ff.comm_cost(lambda x: ff.sum(ff.broadcast(x, 5)), x) == ff.CommCost(120, 120, 1, 1, 0)


def test_comm_cost_arithmetic():
    a = ff.CommCost(1, 2, 3, 4, 0)
    assert a + a == ff.CommCost(2, 4, 6, 8, 0)
    assert ff.CommCost(1, 2, 3, 4, 1).scale(3) == ff.CommCost(3, 6, 9, 12, 1)


def test_comm_cost_and_the_audit_walk_the_same_sub_programs():
    """comm_cost and audit_sums take an equation's sub-programs from one walker
    (fedax.federated._jaxpr_walk): a sum in a jit, a remat, a custom_vjp, a scan, a while
    loop or a cond branch is seen by both, with the walker's multiplicity."""
    from fedax.federated._jaxpr_walk import sub_jaxprs

    def up(x):
        return ff.sum(ff.broadcast(x, N_COST))

    @jax.custom_vjp
    def custom(x):
        return up(x)

    custom.defvjp(lambda x: (up(x), None), lambda _, g: (g,))

    def program(x, i):
        a = jax.jit(up)(x) + jax.checkpoint(up)(x) + custom(x)
        b = jax.lax.scan(lambda c, _: (c + up(x), None), x, None, length=3)[0]
        c = jax.lax.while_loop(lambda c: c[0] < i, lambda c: (c[0] + 1, up(c[1])), (0, x))[1]
        d = jax.lax.switch(i, [up, lambda x: x, up], x)
        return a + b + c + d

    x = jnp.ones((4,), jnp.float32)
    closed = jax.make_jaxpr(program)(x, 1)
    subs = [s for eqn in closed.jaxpr.eqns for s in sub_jaxprs(eqn)]
    by_primitive = collections.Counter(
        (eqn.primitive.name, s.trips, s.branch) for eqn in closed.jaxpr.eqns
        for s in sub_jaxprs(eqn))
    assert by_primitive[("scan", 3, False)] == 1
    assert by_primitive[("while", None, False)] == 2  # body and condition
    assert by_primitive[("cond", 1, True)] == 3
    assert all(isinstance(s.jaxpr, jcore.Jaxpr) for s in subs)
    # jit, remat, custom_vjp, scan, while, two cond branches: 7 sums in the program
    assert len(ff.audit_sums(closed)) == 7
    cost = ff.comm_cost(program, x, 1)
    # ... of which the scan's runs 3 times and one cond branch runs: 3 + 3 + 1 + 1
    assert cost.aggregations == 8 and cost.broadcasts == 8 and cost.unbounded_loops == 1


def test_cpu_sum_is_a_product_with_ones_and_equals_numpy():
    """On XLA:CPU the federated sum lowers to ``1ᵀ x`` (a reduction over the leading axis of
    a rank-3 array is pathologically slow there; benchmarks/bench_aggregate.py); it must
    still be the sum, for floats of every rank and for integers (which keep the reduce)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 31, 17)).astype(np.float32)
    w = rng.uniform(0.5, 2.0, size=7).astype(np.float32)
    lowered = jax.jit(ff.sum).lower(jnp.asarray(x)).as_text()
    if jax.default_backend() == "cpu":
        assert "dot_general" in lowered
    np.testing.assert_allclose(jax.jit(ff.sum)(x), x.astype(np.float64).sum(0), rtol=1e-5,
                               atol=1e-6)
    expected = (x.astype(np.float64) * w[:, None, None]).sum(0) / w.astype(np.float64).sum()
    np.testing.assert_allclose(jax.jit(ff.weighted_mean)(x, w), expected, rtol=1e-5, atol=1e-6)
    v = rng.normal(size=(7,)).astype(np.float32)
    np.testing.assert_allclose(jax.jit(ff.sum)(v), v.astype(np.float64).sum(), rtol=1e-5)
    k = rng.integers(-5, 5, size=(7, 3, 2)).astype(np.int32)
    np.testing.assert_array_equal(jax.jit(ff.sum)(k), k.sum(0))
    half = x.astype(jnp.bfloat16)
    out = jax.jit(ff.sum)(half)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(half, np.float64).sum(0), rtol=2e-2, atol=2e-2)
