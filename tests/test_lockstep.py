"""Balanced devices and clients in lockstep (fedax.federated._lockstep): where a client
runs changes, what it computes and its place in the cohort do not."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax import federated as fed
from fedax.algorithms import CohortBatches, fedavg
from fedax.client import Batches
from fedax.federated._lockstep import WORTH_MOVING, balanced_permutation, worth_moving

D, K = 4, 3
SIZES = [1, 30, 4, 17, 2, 9, 25, 0]  # skewed; the last an empty (padding) client


def loss_fn(params, batch):
    logits = batch.x @ params["w"] + params["b"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch.y[:, None], axis=1)[:, 0]
    return jnp.sum(nll * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)


def skewed_cohort(batch_size=3, epochs=1, pad_steps=2):
    rng = np.random.default_rng(0)
    steps = [epochs * -(-n // batch_size) for n in SIZES]
    s_max = max(steps) + pad_steps
    c = len(SIZES)
    x = rng.normal(size=(c, s_max, batch_size, D)).astype(np.float32)
    y = rng.integers(0, K, size=(c, s_max, batch_size)).astype(np.int32)
    mask = np.zeros((c, s_max, batch_size), np.float32)
    for k, n in enumerate(SIZES):
        for e in range(epochs):
            for j in range(n):
                s = e * -(-n // batch_size) + j // batch_size
                mask[k, s, j % batch_size] = 1.0
    cohort = CohortBatches(Batches(x, y, mask), np.asarray(SIZES, np.float32),
                           np.arange(c, dtype=np.int32))
    return cohort, np.asarray(steps)


def params0():
    rng = np.random.default_rng(1)
    return {"w": jnp.asarray(rng.normal(size=(D, K)) * 0.1, jnp.float32),
            "b": jnp.asarray(rng.normal(size=K) * 0.1, jnp.float32)}


def serpentine_blocks(steps, d):
    """NumPy reference of the deal: heaviest first, devices 0..d-1 then d-1..0, ..."""
    order = sorted(range(len(steps)), key=lambda i: (-steps[i], i))
    blocks = [[] for _ in range(d)]
    for i, client in enumerate(order):
        r, j = divmod(i, d)
        blocks[j if r % 2 == 0 else d - 1 - j].append(client)
    return blocks


def test_client_steps_counts_batches_with_a_real_example():
    cohort, steps = skewed_cohort()
    np.testing.assert_array_equal(cohort.batches.client_steps(), steps)


@pytest.mark.parametrize("devices", [2, 3, 8])
@pytest.mark.parametrize("seed", range(5))
def test_balanced_permutation_deals_serpentine_blocks(devices, seed):
    rng = np.random.default_rng(seed)
    steps = np.minimum(rng.pareto(1.2, size=devices * 17) * 5 + 1, 600).astype(np.int32)
    perm = np.asarray(balanced_permutation(jnp.asarray(steps), devices))
    np.testing.assert_array_equal(np.sort(perm), np.arange(len(steps)))
    blocks = perm.reshape(devices, -1)
    reference = serpentine_blocks(steps.tolist(), devices)
    for block, ref in zip(blocks, reference, strict=True):
        assert list(block) == ref
    loads = steps[blocks].sum(axis=1)
    # serpentine dealing: no two devices differ by more than the heaviest client
    assert loads.max() - loads.min() <= steps.max()


def _device_of_each_client(cohort, devices, balanced):
    """Run map_clients over a mesh; each client reports the device that ran it."""
    mesh = jax.make_mesh((devices,), (fed.CLIENTS_AXIS,),
                         axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:devices])

    def where(batches, ids):
        del batches
        return jax.lax.axis_index(fed.CLIENTS_AXIS) + 0 * ids, ids

    with jax.set_mesh(mesh), fed.map_strategy("sequential"), fed.balance_devices(balanced):
        device, ids = jax.jit(lambda b, i: fed.map_clients(where, b, i))(
            cohort.batches, jnp.asarray(cohort.client_ids))
    return np.asarray(device), np.asarray(ids)


@pytest.mark.parametrize("devices", [2, 4])
def test_mesh_balances_devices_and_keeps_cohort_order(devices):
    assert jax.device_count() >= 8
    cohort, steps = skewed_cohort()
    device, ids = _device_of_each_client(cohort, devices, balanced=True)
    np.testing.assert_array_equal(ids, cohort.client_ids)  # outputs in cohort order
    for d, clients in enumerate(serpentine_blocks(steps.tolist(), devices)):
        assert sorted(np.flatnonzero(device == d)) == sorted(clients)
    contiguous, _ = _device_of_each_client(cohort, devices, balanced=False)
    np.testing.assert_array_equal(contiguous, np.repeat(np.arange(devices), len(SIZES) // devices))
    loads = np.bincount(device, weights=steps, minlength=devices)
    plain = np.bincount(contiguous, weights=steps, minlength=devices)
    assert loads.max() < plain.max()  # this cohort is unbalanced in contiguous halves


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_worth_moving_compares_the_busiest_blocks(devices, seed):
    rng = np.random.default_rng(seed)
    steps = rng.integers(1, 12, size=devices * 9).astype(np.int32)
    perm = np.asarray(balanced_permutation(jnp.asarray(steps), devices))
    contiguous = steps.reshape(devices, -1).sum(axis=1).max()
    balanced = steps[perm].reshape(devices, -1).sum(axis=1).max()
    got = bool(worth_moving(jnp.asarray(steps), jnp.asarray(perm), devices))
    assert got == (contiguous > WORTH_MOVING * balanced)
    # a block 10% heavier is worth moving for; an even split never is
    even = np.full(devices * 9, 5, np.int32)
    assert not bool(worth_moving(jnp.asarray(even), balanced_permutation(even, devices),
                                 devices))
    uneven = even.copy()
    uneven[:9] = 6  # the first contiguous block carries 20% more
    assert bool(worth_moving(jnp.asarray(uneven), balanced_permutation(uneven, devices),
                             devices))


def test_nearly_even_blocks_stay_contiguous():
    """Moving clients copies their inputs and outputs between devices: when contiguous
    blocks are already within 5% of the balanced ones, clients stay where they are."""
    cohort, steps = skewed_cohort()
    even_sizes = np.full(len(SIZES), 6.0, np.float32)
    mask = np.zeros_like(cohort.batches.mask)
    mask[:, :2] = 1.0  # every client 2 full steps
    even = cohort._replace(batches=cohort.batches._replace(mask=mask),
                           num_examples=even_sizes)
    device, ids = _device_of_each_client(even, 2, balanced=True)
    np.testing.assert_array_equal(ids, even.client_ids)
    np.testing.assert_array_equal(device, np.repeat(np.arange(2), len(SIZES) // 2))


def test_a_broadcast_argument_is_not_moved_between_devices():
    """Every row of a broadcast is the same value: balancing moves the rows of the other
    arguments, never the model placed at K clients (K copies of it)."""
    cohort, _ = skewed_cohort()
    n = len(SIZES)
    mesh = jax.make_mesh((2,), (fed.CLIENTS_AXIS,),
                         axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:2])

    def trained(p, batches, copy):
        at_clients = fed.broadcast(p, n)
        if copy:  # the same values, but not the broadcast's own arrays
            at_clients = jax.tree.map(lambda a: a + 0.0, at_clients)
        return fed.map_clients(lambda q, b: jnp.sum(b.x @ q["w"]) + q["b"][0], at_clients,
                               batches)

    p = params0()
    with jax.set_mesh(mesh), fed.map_strategy("sequential"):
        counts = {copy: _count(jax.make_jaxpr(lambda p, b, c=copy: trained(p, b, c))(
            p, cohort.batches).jaxpr, "gather") for copy in (False, True)}
        outs = {copy: jax.jit(lambda p, b, c=copy: trained(p, b, c))(p, cohort.batches)
                for copy in (False, True)}
    assert counts[True] - counts[False] == 2, counts  # "w" and "b" moved only as copies
    np.testing.assert_array_equal(outs[False], outs[True])
    expected = [np.sum(cohort.batches.x[i] @ np.asarray(p["w"])) + float(p["b"][0])
                for i in range(n)]
    np.testing.assert_allclose(outs[False], expected, rtol=1e-5, atol=1e-5)


def _round(strategy, width=3, devices=1):
    cohort, _ = skewed_cohort(epochs=2)
    alg = fedavg(loss_fn, optax.sgd(0.3, momentum=0.5))

    def new_params(p):
        state, metrics = alg.round(alg.init(p, None), cohort, jax.random.key(0))
        return state.server.params, metrics["local_steps"]

    mesh = None if devices == 1 else jax.make_mesh(
        (devices,), (fed.CLIENTS_AXIS,), axis_types=(jax.sharding.AxisType.Explicit,),
        devices=jax.devices()[:devices])
    p = params0()
    with fed.map_strategy(strategy), fed.lockstep_width(width):
        if mesh is not None:
            with jax.set_mesh(mesh):
                return jax.jit(new_params)(p), None, None
        value = jax.jit(new_params)(p)
        scalar = lambda q: jnp.sum(new_params(q)[0]["w"] ** 2)  # noqa: E731
        grad = jax.jit(jax.grad(scalar))(p)
        tangent = jax.tree.map(jnp.ones_like, p)
        jvp = jax.jit(lambda q: jax.jvp(scalar, (q,), (tangent,))[1])(p)
    return value, grad, jvp


@pytest.mark.parametrize("width", [1, 3, 8, 16])
def test_lockstep_equals_sequential_values_and_derivatives(width):
    (ref, ref_steps), ref_grad, ref_jvp = _round("sequential")
    (out, steps), grad, jvp = _round("lockstep", width)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(steps, ref_steps)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(jvp, ref_jvp, rtol=1e-4)


@pytest.mark.parametrize("strategy", ["sequential", "lockstep"])
def test_balanced_mesh_round_equals_one_device(strategy):
    (ref, _), _, _ = _round("sequential")
    (out, _), _, _ = _round(strategy, devices=4)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_lockstep_returns_each_client_its_own_output():
    cohort, steps = skewed_cohort()
    with fed.map_strategy("lockstep"), fed.lockstep_width(3):
        out = jax.jit(lambda b, i: fed.map_clients(lambda bb, ii: (ii, bb.client_steps()), b,
                                                   i))(
            jax.tree.map(lambda a: a[:, None], cohort.batches), jnp.asarray(cohort.client_ids))
    np.testing.assert_array_equal(out[0], cohort.client_ids)
    np.testing.assert_array_equal(out[1][:, 0], steps)


def _count(jaxpr, name):
    here = sum(eqn.primitive.name == name for eqn in jaxpr.eqns)
    return here + sum(_count(sub, name) for sub in jax.extend.core.subjaxprs(jaxpr))


def test_a_lockstep_group_skips_steps_none_of_its_clients_has():
    """Under vmap a masked step is a select of both branches (every client pays for the
    longest); in a lockstep group the step is a real branch on the group's psum."""
    cohort, _ = skewed_cohort()
    alg = fedavg(loss_fn, optax.sgd(0.3))
    state = alg.init(params0(), None)
    counts = {}
    for strategy in ("vmap", "lockstep"):
        with fed.map_strategy(strategy):
            jaxpr = jax.make_jaxpr(lambda s: alg.round(s, cohort, None)[0])(state).jaxpr
        counts[strategy] = (_count(jaxpr, "cond"), _count(jaxpr, "psum"))
    assert counts["vmap"] == (0, 0)
    assert counts["lockstep"][0] >= 1 and counts["lockstep"][1] >= 1


def test_bad_width_is_refused():
    with pytest.raises(ValueError, match="lockstep width must be a positive int"):
        with fed.lockstep_width(0):
            pass


def test_worker_processes_get_balanced_blocks_and_the_same_round():
    """``processes`` deals clients to its workers by steps too (8 clients, 2 workers)."""
    from fedax.simulation.processes import client_processes

    (ref, ref_steps), _, _ = _round("sequential")
    cohort, _ = skewed_cohort(epochs=2)
    alg = fedavg(loss_fn, optax.sgd(0.3, momentum=0.5))
    mapper = client_processes(2)
    with fed.map_strategy(mapper):
        state, metrics = jax.jit(lambda p: alg.round(alg.init(p, None), cohort,
                                                     jax.random.key(0)))(params0())
    for a, b in zip(jax.tree.leaves(state.server.params), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["local_steps"], ref_steps)
