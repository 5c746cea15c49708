"""``collect`` and ``distribute``: the placement pair that moves each client's value apart.

References: NumPy (the values are the identity on data, only the placement changes), the
closed-form derivative of a coordinate-wise median (the gradient goes to the median client
only), central finite differences, and the transpose pairing of DrJAX's broadcast/sum
applied to the new pair (each is the other's transpose, so derivatives stay federated).
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore
from jax.sharding import AxisType

import fedax.federated as ff

COLLECT, DISTRIBUTE = "federated_collect", "federated_distribute"


def _eqns(jaxpr):
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            subs = value if isinstance(value, (tuple, list)) else [value]
            for sub in subs:
                if isinstance(sub, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                    yield from _eqns(sub)


def _counts(fn, *args):
    return collections.Counter(e.primitive.name for e in _eqns(jax.make_jaxpr(fn)(*args)))


def _median_program(x, D):
    """F(x) = Σ_j median_i (x_j · d_ij)²: broadcast, per-client work, collect, a median."""
    n = D.shape[0]
    per_client = ff.map_clients(lambda a, d: (a * d) ** 2, ff.broadcast(x, n), D)
    return jnp.sum(jnp.median(ff.collect(per_client), axis=0))


def _np_median_program(x, D):
    return np.sum(np.median((x[None] * D) ** 2, axis=0))


def _data(n=5, d=4, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(d,)).astype(np.float32),
            rng.normal(size=(n, d)).astype(np.float32))


def test_values_are_the_clients_rows_and_distribute_inverts_collect():
    _, D = _data()
    tree = {"a": D, "b": (D[:, :2] * 3,)}
    got = jax.jit(ff.collect)(tree)
    np.testing.assert_array_equal(got["a"], D)
    np.testing.assert_array_equal(got["b"][0], D[:, :2] * 3)
    back = jax.jit(lambda t: ff.distribute(ff.collect(t)))(tree)
    np.testing.assert_array_equal(back["a"], D)
    with pytest.raises(ValueError, match="leading clients axis"):
        ff.collect({"a": D, "s": jnp.float32(1.0)})


def test_each_is_the_others_transpose():
    _, D = _data()
    t_c = jax.linear_transpose(ff.collect, jnp.asarray(D))
    t_d = jax.linear_transpose(ff.distribute, jnp.asarray(D))
    counts_c, counts_d = _counts(t_c, D), _counts(t_d, D)
    assert counts_c[DISTRIBUTE] == 1 and counts_c[COLLECT] == 0, counts_c
    assert counts_d[COLLECT] == 1 and counts_d[DISTRIBUTE] == 0, counts_d
    np.testing.assert_array_equal(t_c(D)[0], D)


def test_reverse_mode_through_a_median_is_federated_and_matches_closed_form():
    x, D = _data(n=5)
    g = jax.jit(jax.grad(_median_program, argnums=(0, 1)))(x, D)
    # closed form: only the median client (odd n) of each coordinate gets a gradient
    sq = (x[None] * D) ** 2
    med = np.argsort(sq, axis=0)[2]
    dx = np.array([2 * x[j] * D[med[j], j] ** 2 for j in range(4)])
    dD = np.zeros_like(D)
    for j in range(4):
        dD[med[j], j] = 2 * x[j] ** 2 * D[med[j], j]
    np.testing.assert_allclose(g[0], dx, rtol=1e-5)
    np.testing.assert_allclose(g[1], dD, rtol=1e-5, atol=1e-7)
    rev = _counts(jax.grad(_median_program), x, D)
    # the reverse pass sends the cotangent down row by row and sums the broadcast's
    assert rev[COLLECT] == 1 and rev[DISTRIBUTE] == 1, rev
    assert rev["federated_sum"] == 1 and rev["federated_broadcast"] == 1, rev


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def test_forward_mode_matches_finite_differences(x64):
    x, D = (a.astype(np.float64) for a in _data(n=7, seed=3))
    t = np.random.default_rng(9).normal(size=x.shape)
    _, tangent = jax.jvp(lambda a: _median_program(a, D), (x,), (t,))
    h = 1e-6
    fd = (_np_median_program(x + h * t, D) - _np_median_program(x - h * t, D)) / (2 * h)
    np.testing.assert_allclose(tangent, fd, rtol=1e-6)
    lin = _counts(lambda a, b: jax.jvp(lambda u: _median_program(u, D), (a,), (b,)), x, t)
    assert lin[COLLECT] == 2, lin  # the primal's and the tangent's


def test_vmap_over_a_batch_axis_keeps_the_clients_axis_leading():
    _, D = _data(n=3)
    batch = np.stack([D, 2 * D])  # [2, 3, 4]: batch axis first
    got = jax.vmap(lambda d: jnp.median(ff.collect(d), axis=0))(batch)
    np.testing.assert_allclose(got, np.median(batch, axis=1), rtol=1e-6)
    got1 = jax.vmap(lambda d: ff.distribute(d) * 1.0, in_axes=1, out_axes=1)(
        np.moveaxis(batch, 0, 1))
    np.testing.assert_array_equal(got1, np.moveaxis(batch, 0, 1))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_under_a_clients_mesh_values_and_gradients_match(axis_type):
    x, D = _data(n=16, seed=5)
    expected = (_np_median_program(x, D),
                jax.jit(jax.grad(_median_program))(x, D))

    def program(a, d):  # a fresh function: the mesh is read while tracing
        return _median_program(a, d)

    with jax.set_mesh(jax.make_mesh((8,), ("clients",), axis_types=(axis_type,))):
        value, grad = jax.jit(jax.value_and_grad(program))(x, D)
        collected = jax.jit(lambda d: ff.collect(ff.map_clients(lambda r: r * 2, d)))(
            jnp.asarray(D))
    np.testing.assert_allclose(value, expected[0], rtol=1e-5)
    np.testing.assert_allclose(grad, expected[1], rtol=1e-5)
    assert all(s is None for s in collected.sharding.spec), collected.sharding  # replicated
    np.testing.assert_allclose(collected, 2 * D)


def test_comm_cost_counts_each_clients_share():
    x, D = _data(n=5, d=4)
    cost = ff.comm_cost(_median_program, x, D)
    assert cost.server_to_clients_bytes == 5 * 4 * 4  # the broadcast of x
    assert cost.clients_to_server_bytes == 5 * 4 * 4  # every client's 4 floats, apart
    assert (cost.broadcasts, cost.aggregations) == (1, 1)
    back = ff.comm_cost(lambda d: ff.distribute(d), jnp.zeros((5, 3), jnp.int8))
    assert back.server_to_clients_bytes == 15 and back.broadcasts == 1
    grad_cost = ff.comm_cost(jax.grad(_median_program), x, D)
    assert grad_cost.server_to_clients_bytes == 2 * 5 * 4 * 4  # + the cotangent's rows
    assert grad_cost.clients_to_server_bytes == 2 * 5 * 4 * 4  # + the broadcast's sum


def test_the_privacy_audit_sees_a_collect_as_an_unprivatized_upload():
    from fedax.hyper.audit import unprivatized_sums

    x, D = _data()
    found = unprivatized_sums(jax.make_jaxpr(_median_program)(x, D), derivative_only=False)
    assert [s.shape for s in found] == [(5, 4)]
