"""A broadcast argument of the sequential client map is read once, as its first row: the
model is never copied to every client, and values and derivatives (both modes, vmap, a
device mesh) are those of the row-by-row map, with the derivative's per-client values
still summed by the federated ``sum``."""

import collections
import contextlib

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from fedax import federated as fed

N, D, H = 6, 5, 4


def data():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(N, 3, D)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 2, size=(N, 3)), jnp.int32)
    p = {"w": jnp.asarray(rng.normal(size=(D, H)) * 0.3, jnp.float32),
         "v": jnp.asarray(rng.normal(size=(H,)), jnp.float32)}
    return p, x, y


def client(p, x, y):
    """Two SGD steps on a small tanh model, then the update (what FedAvg sends)."""
    def loss(q):
        logits = jnp.tanh(x @ q["w"]) @ q["v"]
        return jnp.mean((logits - y) ** 2)

    q = p
    for _ in range(2):
        q = jax.tree.map(lambda a, g: a - 0.1 * g, q, jax.grad(loss)(q))
    return jax.tree.map(lambda a, b: a - b, q, p), y.sum()


def round_(p, x, y, copy):
    at_clients = fed.broadcast(p, N)
    if copy:  # the same values, not the broadcast's own arrays: mapped row by row
        at_clients = jax.tree.map(lambda a: a * 1.0, at_clients)
    update, count = fed.map_clients(client, at_clients, x, y)
    return fed.mean(update), fed.sum(count)


def scalar(p, x, y, copy):
    update, _ = round_(p, x, y, copy)
    return jnp.sum(update["w"] ** 2) + jnp.sum(jnp.sin(update["v"]))


def _mesh(devices):
    return jax.make_mesh((devices,), (fed.CLIENTS_AXIS,),
                         axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:devices])


@pytest.mark.parametrize("devices", [1, 2])
def test_values_and_derivatives_equal_the_row_by_row_map(devices):
    p, x, y = data()
    tangent = jax.tree.map(jnp.ones_like, p)
    got = {}
    mesh = jax.set_mesh(_mesh(devices)) if devices > 1 else contextlib.nullcontext()
    with fed.map_strategy("sequential"), mesh:
        for copy in (False, True):
            value = jax.jit(lambda p, c=copy: round_(p, x, y, c))(p)
            grad = jax.jit(jax.grad(lambda p, c=copy: scalar(p, x, y, c)))(p)
            jvp = jax.jit(lambda p, c=copy: jax.jvp(lambda q: scalar(q, x, y, c), (p,),
                                                     (tangent,))[1])(p)
            batched = jax.jit(jax.vmap(lambda s, c=copy: scalar(
                jax.tree.map(lambda a: a * s, p), x, y, c)))(jnp.asarray([0.5, 1.0, 2.0]))
            got[copy] = (value, grad, jvp, batched)
    for a, b in zip(jax.tree.leaves(got[False]), jax.tree.leaves(got[True]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # and against finite differences of the plain map, so neither form is wrong alike
    eps = 1e-3
    with fed.map_strategy("sequential"):
        f = jax.jit(lambda p: scalar(p, x, y, False))
        plus = f(jax.tree.map(lambda a, t: a + eps * t, p, tangent))
        minus = f(jax.tree.map(lambda a, t: a - eps * t, p, tangent))
    np.testing.assert_allclose(got[False][2], (plus - minus) / (2 * eps), rtol=2e-2)


def _counts(jaxpr):
    out = collections.Counter(e.primitive.name for e in jaxpr.eqns)
    for sub in jax.extend.core.subjaxprs(jaxpr):
        out.update(_counts(sub))
    return out


def test_the_derivative_still_sums_clients_with_the_federated_sum():
    p, x, y = data()
    with fed.map_strategy("sequential"):
        counts = {copy: _counts(jax.make_jaxpr(jax.grad(
            lambda p, c=copy: scalar(p, x, y, c)))(p).jaxpr) for copy in (False, True)}
    for name in ("federated_sum", "federated_broadcast"):
        assert counts[False][name] == counts[True][name] > 0, (name, counts)


def test_the_model_is_not_copied_to_every_client():
    """With a model of 2 x 200,000 floats at 64 clients, the row-by-row map holds the
    [64, ...] copy (51 MB); reading the first row holds none of it."""
    big = {"w": jnp.ones((D, 40_000)), "v": jnp.ones((40_000,))}
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(64, 3, D)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 2, size=(64, 3)), jnp.int32)

    def r(p, copy):
        at_clients = fed.broadcast(p, 64)
        if copy:
            at_clients = jax.tree.map(lambda a: a * 1.0, at_clients)
        out = fed.map_clients(lambda q, xx, yy: jnp.sum(jnp.tanh(xx @ q["w"]) @ q["v"]) + yy[0],
                              at_clients, x, y)
        return fed.sum(out)

    copy_bytes = 64 * (D * 40_000 + 40_000) * 4
    with fed.map_strategy("sequential"):
        temp = {copy: jax.jit(lambda p, c=copy: r(p, c)).lower(big).compile()
                .memory_analysis().temp_size_in_bytes for copy in (False, True)}
        values = {copy: jax.jit(lambda p, c=copy: r(p, c))(big) for copy in (False, True)}
    assert temp[True] >= copy_bytes, temp
    assert temp[False] < copy_bytes / 8, temp
    np.testing.assert_allclose(values[False], values[True], rtol=1e-6)


@pytest.mark.slow  # a benchmark's run; the forms' equality is tested above
def test_the_benchmark_compares_the_two_forms(tmp_path):
    """``benchmarks/bench_broadcast_rows.py`` at toy size: both forms of both parts ran, and
    the row-by-row form (the baseline) really holds the model's copy that read-once does
    not (a benchmark whose two forms were one program would show equal memory)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from conftest import _child_env

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_broadcast_rows.py"
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, str(script), "--per-round", "40", "--clients", "200",
                           "--repeats", "1", "--json", str(out)], env=_child_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["part"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"map", "round"}
    for r in rows.values():
        assert r["read once"]["s_median"] > 0 and r["row by row"]["s_median"] > 0
    model_bytes = 199_210 * 4
    assert (rows["map"]["row by row"]["temp_bytes"] - rows["map"]["read once"]["temp_bytes"]
            >= 40 // 4 * model_bytes)  # half a device's block of copies, at least
