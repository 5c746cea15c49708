"""Compressed uplink (``fedax.aggregators.compression``) and error feedback
(``fedax.algorithms.error_feedback``), against NumPy written here.

NumPy references (the same random draws as the implementation: leaf i of a client's message
uses ``fold_in(key, i)``; its uniforms are ``uniform(that key, [buckets, bucket])``; the
rotation's signs are ``rademacher(fold_in(shared key, i), [blocks, block])``):

    QSGD:      a = |v|/‖v‖ per bucket, ℓ = ⌊s a⌋, ξ = ℓ + [u < s a − ℓ], Q = ‖v‖ sign(v) ξ / s
    rotation:  z = (D v) H/√B per block, t = (z − lo)(2^b − 1)/(hi − lo), c = ⌊t⌋ + [u < t − ⌊t⌋],
               back = D (lo + c (hi − lo)/(2^b − 1)) H/√B
    top-k:     the k largest |p_i| (stable argsort of −|p|), k = ⌈fraction d⌉
    EF:        p = Δ + e;  q = top_k(p);  e ← p − q   (participating, accepted clients only)
"""

from __future__ import annotations

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.linalg

from fedax import federated as fed
from fedax.aggregators import (
    aggregate,
    cast,
    chain,
    clip_norm,
    compressed,
    dp_compressed,
    mean,
    message_bytes,
    qsgd,
    rotation,
    roundtrip,
    top_k,
)
from fedax.aggregators.compression import MessageSizes, uplink_metrics, uplink_sizes
from fedax.aggregators.compressors import pack_bits, unpack_bits, walsh_hadamard
from fedax.algorithms import ClientMessage, CohortBatches, compose, fedavg
from fedax.algorithms.error_feedback import error_feedback, residuals
from fedax.algorithms.fedavg import model_pieces
from fedax.client import Batches

TREE = {"b": jnp.linspace(-1.0, 0.7, 5, dtype=jnp.float32),
        "w": jax.random.normal(jax.random.key(3), (9, 7), jnp.float32)}
SIZES = {"b": 5, "w": 63}  # flatten order: "b" (leaf 0), "w" (leaf 1)
# One instance each, so that compiled programs are shared between tests.
COMPRESSORS = (qsgd(3, bucket_size=16), rotation(2, block_size=16), top_k(0.3),
               cast("float16"), cast("bfloat16"), cast("int8", bucket_size=16))


_roundtrip = jax.jit(roundtrip, static_argnums=0)  # (eager dispatch is slow)


@functools.cache
def _aggregated(comp):
    """``aggregate(compressed(comp), values, weights, state, key)`` (value, state, metrics),
    jitted once."""
    return jax.jit(lambda v, w, s, k: aggregate(compressed(comp), v, w, s, k))


def _leaf_uniforms(key, i, shape):
    return np.asarray(jax.random.uniform(jax.random.fold_in(key, i), shape, jnp.float32))


def _np_qsgd(x, s, bucket, u):
    d = x.size
    size = min(bucket, d)
    n = -(-d // size)
    v = np.zeros(n * size, np.float32)
    v[:d] = x.ravel()
    v = v.reshape(n, size)
    norm = np.sqrt((v.astype(np.float64) ** 2).sum(1))
    a = np.abs(v) / np.where(norm > 0, norm, 1)[:, None]
    scaled = np.minimum(a * s, s)
    low = np.floor(scaled)
    xi = low + (u < scaled - low)
    return (norm[:, None] * np.sign(v) * xi / s).ravel()[:d].reshape(x.shape)


def _np_rotation(x, bits, block, shared, i, u, rotate=True):
    d = x.size
    size = min(block, 1 << (d - 1).bit_length())
    n = -(-d // size)
    v = np.zeros(n * size)
    v[:d] = x.ravel()
    v = v.reshape(n, size)
    key = jax.random.fold_in(jax.random.wrap_key_data(shared), i)
    signs = np.asarray(jax.random.rademacher(key, (n, size), jnp.float32))
    h = scipy.linalg.hadamard(size) / math.sqrt(size)
    if not rotate:  # Suresh et al.'s π_sk: the same quantization, no rotation
        signs, h = np.ones_like(signs), np.eye(size)
    z = (v * signs) @ h
    lo, hi = z.min(1, keepdims=True), z.max(1, keepdims=True)
    top = 2**bits - 1
    t = np.clip((z - lo) * top / np.where(hi > lo, hi - lo, 1), 0, top)
    c = np.minimum(np.floor(t) + (u < t - np.floor(t)), top)
    back = ((lo + c * (hi - lo) / top) @ h) * signs
    return back.ravel()[:d].reshape(x.shape)


def _np_top_k(p, fraction):
    flat = p.ravel()
    k = max(1, math.ceil(fraction * flat.size))
    idx = np.argsort(-np.abs(flat), kind="stable")[:k]
    q = np.zeros_like(flat)
    q[idx] = flat[idx]
    return q.reshape(p.shape)


# --------------------------------------------------------------------- encode ∘ decode


def test_bit_packing_matches_numpy():
    rng = np.random.default_rng(0)
    for bits in (1, 3, 4, 7, 8):
        codes = rng.integers(0, 2**bits, 50).astype(np.uint32)
        per = 32 // bits
        padded = np.zeros(-(-50 // per) * per, np.uint64)
        padded[:50] = codes
        words = (padded.reshape(-1, per) << (bits * np.arange(per, dtype=np.uint64))).sum(1)
        packed, back = jax.jit(lambda c, bits=bits: (
            pack_bits(c, bits), unpack_bits(pack_bits(c, bits), bits, 50)))(jnp.asarray(codes))
        np.testing.assert_array_equal(np.asarray(packed), words.astype(np.uint32))
        np.testing.assert_array_equal(np.asarray(back), codes)


def test_walsh_hadamard_is_the_normalised_hadamard_matrix():
    rng = np.random.default_rng(1)
    for size in (2, 8, 32, 256):
        v = rng.normal(size=(3, size)).astype(np.float32)
        want = v @ scipy.linalg.hadamard(size) / math.sqrt(size)
        np.testing.assert_allclose(np.asarray(walsh_hadamard(jnp.asarray(v))), want,
                                   rtol=1e-5, atol=1e-5)


def test_qsgd_and_rotation_match_numpy_with_the_same_draws():
    key = jax.random.key(11)
    got = _roundtrip(COMPRESSORS[0], TREE, (), key)  # qsgd(3, bucket_size=16)
    for i, name in enumerate(sorted(TREE)):
        d = SIZES[name]
        size = min(16, d)
        u = _leaf_uniforms(key, i, (-(-d // size), size))
        want = _np_qsgd(np.asarray(TREE[name]), 3, 16, u)
        np.testing.assert_allclose(np.asarray(got[name]), want, rtol=1e-5, atol=1e-6)

    comp = COMPRESSORS[1]  # rotation(2, block_size=16)
    shared = comp.init()
    got = _roundtrip(comp, TREE, shared, key)
    for i, name in enumerate(sorted(TREE)):
        d = SIZES[name]
        size = min(16, 1 << (d - 1).bit_length())
        u = _leaf_uniforms(key, i, (-(-d // size), size))
        want = _np_rotation(np.asarray(TREE[name], np.float64), 2, 16, shared, i, u)
        np.testing.assert_allclose(np.asarray(got[name]), want, rtol=1e-4, atol=1e-5)
    got = _roundtrip(rotation(2, block_size=16, rotate=False), TREE, (), key)
    for i, name in enumerate(sorted(TREE)):
        d = SIZES[name]
        size = min(16, 1 << (d - 1).bit_length())
        u = _leaf_uniforms(key, i, (-(-d // size), size))
        want = _np_rotation(np.asarray(TREE[name], np.float64), 2, 16, shared, i, u, False)
        np.testing.assert_allclose(np.asarray(got[name]), want, rtol=1e-4, atol=1e-5)


def test_top_k_and_casts_match_numpy():
    got = _roundtrip(COMPRESSORS[2], TREE)  # top_k(0.3)
    tied = {"b": jnp.asarray([1.0, -1.0, 1.0, 0.5, -1.0]), "w": TREE["w"]}  # ties: lower index
    got_tied = _roundtrip(top_k(0.4), tied)
    for name in TREE:
        np.testing.assert_array_equal(np.asarray(got[name]),
                                      _np_top_k(np.asarray(TREE[name]), 0.3))
    np.testing.assert_array_equal(np.asarray(got_tied["b"]), [1.0, -1.0, 0, 0, 0])
    import ml_dtypes

    for dtype, np_dtype in (("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)):
        got = _roundtrip(cast(dtype), TREE)
        for name in TREE:
            want = np.asarray(TREE[name]).astype(np_dtype).astype(np.float32)
            np.testing.assert_array_equal(np.asarray(got[name]), want)
    got = _roundtrip(cast("int8", bucket_size=16), TREE)
    for name in TREE:
        x = np.asarray(TREE[name]).ravel()
        size = min(16, x.size)
        v = np.zeros(-(-x.size // size) * size, np.float32)
        v[:x.size] = x
        v = v.reshape(-1, size)
        scale = np.abs(v).max(1, keepdims=True) / np.float32(127)
        want = (np.clip(np.round(v / scale), -127, 127) * scale).ravel()[:x.size]
        np.testing.assert_allclose(np.asarray(got[name]).ravel(), want, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------- unbiasedness


def _draws(comp, n):
    keys = jax.random.split(jax.random.key(0), n)

    def one(k):  # the rotation's shared key varies with the draw too
        shared = comp.init()
        if jax.tree.leaves(shared):
            shared = jax.random.key_data(jax.random.fold_in(k, 99))
        flat, _ = jax.flatten_util.ravel_pytree(roundtrip(comp, TREE, shared, k))
        return flat

    return np.asarray(jax.jit(jax.vmap(one))(keys), np.float64)


def _bias_within(draws, x, sigmas=5.0):
    """|mean − x| ≤ sigmas·σ/√N on every coordinate (σ: the draws' standard deviation)."""
    n = draws.shape[0]
    err = np.abs(draws.mean(0) - x)
    return bool(np.all(err <= sigmas * draws.std(0) / math.sqrt(n) + 1e-6))


def test_qsgd_and_rotation_are_unbiased_over_many_seeds():
    """E decode(encode(x)) = x: over N = 4000 draws every coordinate's mean lies within
    5σ/√N of x (68 coordinates: a false alarm has probability < 1e-4). A biased compressor
    fails the same check (top-k, below), so the check bites. QSGD's variance bound holds
    too: E‖Q(v) − v‖² ≤ min(B/s², √B/s)‖v‖² per bucket of B, so ≤ that bound for B = 16
    times ‖x‖² over all buckets (every bucket here has at most 16 coordinates)."""
    x, _ = jax.flatten_util.ravel_pytree(TREE)
    x = np.asarray(x, np.float64)
    for comp in (qsgd(1, bucket_size=16), rotation(2, block_size=16)):
        draws = _draws(comp, 4000)
        assert _bias_within(draws, x), comp.name
        assert draws.std(0).max() > 0  # it is random
        if comp.name.startswith("qsgd"):
            mse = np.mean(np.sum((draws - x) ** 2, axis=1))
            assert mse <= min(16 / 1**2, math.sqrt(16) / 1) * np.sum(x**2)
    biased = np.asarray(jax.flatten_util.ravel_pytree(_roundtrip(COMPRESSORS[2], TREE))[0])
    assert not _bias_within(np.stack([biased, biased + 1e-3]), x)


# --------------------------------------------------------------------------- the aggregator



def _clients(seed, scale=1.0):
    keys = jax.random.split(jax.random.key(seed), 2)
    return {"b": scale * jax.random.normal(keys[0], (3, 5)),
            "w": scale * jax.random.normal(keys[1], (3, 9, 7))}


def test_compressed_mean_equals_the_decoded_weighted_mean_and_ignores_zero_weights():
    """Σ_k w_k C_k(x_k) / Σ_k w_k with each client's own key; the weight-0 client (padding
    or rejected) contributes nothing: any values there give the same bits."""
    values = _clients(0)
    weights = jnp.asarray([2.0, 1.0, 0.0])
    key = jax.random.key(7)
    client_keys = jax.random.split(jax.random.split(key, 3)[0], 3)  # aggregate's per-client
    other = jax.tree.map(lambda a: a.at[2].set(1e6), values)  # a wild padding row
    # stochastic with a shared state and a linear unfold after the sum; deterministic
    # (QSGD's decode is checked against NumPy above; the aggregation path is the same)
    for comp in COMPRESSORS[1:3]:
        state = compressed(comp).init(TREE)
        run = _aggregated(comp)
        got, new_state, _ = run(values, weights, state, key)
        wild, _, _ = run(other, weights, state, key)
        np.testing.assert_array_equal(
            np.asarray(jax.flatten_util.ravel_pytree(wild)[0]),
            np.asarray(jax.flatten_util.ravel_pytree(got)[0]))
        decoded = [_roundtrip(comp, jax.tree.map(lambda a, k=k: a[k], values), state,
                              client_keys[k]) for k in range(2)]
        want = jax.tree.map(lambda a, b: (2 * a + b) / 3, *decoded)
        for name in TREE:
            np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]),
                                       rtol=1e-5, atol=1e-5, err_msg=comp.name)
        nothing, _, _ = run(values, jnp.zeros(3), state, key)
        assert all(not np.any(np.asarray(leaf)) for leaf in jax.tree.leaves(nothing))
        if jax.tree.leaves(state):  # rotation: the shared key advances every round
            assert not np.array_equal(np.asarray(new_state), np.asarray(state))


def _expected_bytes(comp_name):
    """One message's bytes for TREE ("b": 5, "w": 63 coordinates), by hand."""
    def words(n, bits):
        return 4 * -(-n // (32 // bits))

    return {
        # QSGD s=3 (3 bits: 10 codes a word), buckets of 16: b = 1×5, w = 4×16
        "qsgd(s=3)": (4 + words(5, 3)) + (4 * 4 + words(64, 3)),
        # rotation b=2, blocks of 16: b = 1×8 (lo, hi + codes), w = 4×16
        "rotation(b=2)": (8 + words(8, 2)) + (4 * 8 + words(64, 2)),
        # top-k 30%: k = 2 and 19, float32 value + int32 index each
        "top_k(0.3)": 8 * 2 + 8 * 19,
        "float16": 2 * 68, "bfloat16": 2 * 68,
        # int8, buckets of 16: a float32 scale per bucket + 1 byte a coordinate (+ padding)
        "int8": (4 + 5) + (4 * 4 + 64),
    }[comp_name]


def test_comm_cost_counts_the_compressed_bytes():
    """The uplink of a compressed aggregation is C × (message + 4-byte weight), the message
    counted by hand; in a whole FedAvg round, swapping mean() for compressed() changes the
    uplink by exactly that minus the float32 update's C × (4d + 4)."""
    values, weights = _clients(0), jnp.asarray([2.0, 1.0, 0.0])
    key = jax.random.key(0)
    for comp in COMPRESSORS:
        agg = compressed(comp)
        state = agg.init(TREE)
        cost = fed.comm_cost(lambda v, w, agg=agg, state=state: aggregate(
            agg, v, w, state, key), values, weights)
        assert message_bytes(comp, TREE) == _expected_bytes(comp.name), comp.name
        assert cost.clients_to_server_bytes == 3 * (_expected_bytes(comp.name) + 4), comp.name
        # the rotation's shared key goes down: 8 bytes a client; nothing else
        assert cost.server_to_clients_bytes == (24 if jax.tree.leaves(state) else 0)

    def loss(params, batch):
        logits = batch.x.reshape(batch.x.shape[0], -1)[:, :5] @ params["w"][:5, :5] + params["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch.y).mean()

    cohort = CohortBatches(Batches(jnp.ones((3, 1, 2, 5)), jnp.zeros((3, 1, 2), jnp.int32),
                                   jnp.ones((3, 1, 2))), jnp.asarray([2.0, 1.0, 0.0]),
                           jnp.arange(3, dtype=jnp.int32))
    costs = {}
    for name, agg in (("mean", mean()), ("qsgd", compressed(COMPRESSORS[0]))):
        alg = fedavg(loss, optax.sgd(0.1), aggregator=agg)
        state = alg.init(TREE, key)
        costs[name] = fed.comm_cost(lambda s, c, alg=alg: alg.round(s, c, key), state,
                                    cohort).clients_to_server_bytes
    assert costs["qsgd"] - costs["mean"] == 3 * (_expected_bytes("qsgd(s=3)") + 4) \
        - 3 * (4 * 68 + 4)


def test_every_round_reports_its_uplink_bytes_and_compression_ratio():
    """``uplink_bytes`` = the accepted clients (w > 0) × (message + 4-byte weight), the
    message counted by hand; ``compression_ratio`` = (4·68 + 4) / (message + 4), the float32
    update and weight over the compressed ones; the same with DP (``dp_compressed``, whose
    weights are 1 per real client)."""
    values, key = _clients(0), jax.random.key(0)
    for comp in COMPRESSORS:
        per_client = _expected_bytes(comp.name) + 4
        assert uplink_sizes(comp, TREE) == MessageSizes(_expected_bytes(comp.name), 4, 68)
        assert uplink_sizes(comp, TREE).client_bytes == per_client
        state = compressed(comp).init(TREE)
        for weights in ([2.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 5.0, 3.0]):
            _, _, metrics = _aggregated(comp)(values, jnp.asarray(weights), state, key)
            assert set(metrics) == {"uplink_bytes", "compression_ratio"}
            assert metrics["uplink_bytes"].dtype == jnp.int32
            accepted = int(np.sum(np.asarray(weights) > 0))
            assert int(metrics["uplink_bytes"]) == accepted * per_client, comp.name
            assert float(metrics["compression_ratio"]) == pytest.approx(
                (4 * 68 + 4) / per_client, rel=1e-6)
    private = dp_compressed(COMPRESSORS[0], 1.0, 0.0, 2.0)
    _, _, metrics = jax.jit(lambda v, w: aggregate(private, v, w, private.init(TREE), key))(
        values, jnp.asarray([5.0, 0.0, 2.0]))
    assert int(metrics["uplink_bytes"]) == 2 * (_expected_bytes("qsgd(s=3)") + 4)
    assert {"clipped_clients", "dp_noise_stddev", "compression_ratio"} <= set(metrics)
    # past int32: a float32 (a 2 GiB message from each of 8 clients)
    big = uplink_metrics(MessageSizes(2**31, 4, 2**31), jnp.ones(8))
    assert big["uplink_bytes"].dtype == jnp.float32
    assert float(big["uplink_bytes"]) == pytest.approx(8 * (2**31 + 4), rel=1e-6)
    assert float(big["compression_ratio"]) == pytest.approx((2**33 + 4) / (2**31 + 4))


def test_determinism_same_key_same_message_other_key_other():
    values, weights = _clients(1), jnp.asarray([1.0, 1.0, 1.0])
    comp = COMPRESSORS[1]  # rotation: the clients' keys and the shared key
    state = compressed(comp).init(TREE)
    a, b, c = (_aggregated(comp)(values, weights, state, jax.random.key(k))[0]
               for k in (1, 1, 2))
    assert np.array_equal(np.asarray(a["w"]), np.asarray(b["w"]))
    assert not np.array_equal(np.asarray(a["w"]), np.asarray(c["w"]))
    with pytest.raises(ValueError, match="needs a key"):
        jax.eval_shape(lambda: aggregate(compressed(comp), values, weights, state, None))


# ---------------------------------------------------------------------------- DP ordering


def test_dp_compressed_clips_the_decoded_value_keeping_the_sensitivity():
    """QSGD at s = 1 decodes a norm-1 update to a norm up to √B: clipping before encoding
    alone does not bound a client's share, clipping the decoded value does."""
    one = {"w": jnp.full((1, 64), 1 / 8.0)}  # norm 1, one client
    key = jax.random.key(4)
    comp = qsgd(1, bucket_size=64)
    private = dp_compressed(comp, 1.0, 0.0, 1.0)
    loose = chain(clip_norm(1.0), compressed(comp, reduction="sum"))
    norms = jax.jit(lambda x: [optax.tree.norm(aggregate(a, x, jnp.ones(1), a.init(x), key)[0])
                               for a in (private, loose)])(one)
    assert float(norms[0]) <= 1.0 + 1e-5
    assert float(norms[1]) > 1.5  # without the server clip: far beyond S
    with pytest.raises(ValueError, match="client stage after the reduction"):
        chain(compressed(comp), clip_norm(1.0))  # encode, then clip: not buildable


def test_bad_arguments_are_one_line_errors():
    for build, match in ((lambda: qsgd(0), "qsgd levels must be in"),
                         (lambda: rotation(2, block_size=48), "power of 2"),
                         (lambda: top_k(1.5), r"top_k fraction must be in \(0, 1\]"),
                         (lambda: cast("int4"), "cast dtype must be"),
                         (lambda: compressed(top_k(0.1), reduction="median"), "'mean' or"),
                         (lambda: error_feedback(fedavg(None, optax.sgd(0.1)), qsgd(1), 4),
                          "deterministic compressor")):
        with pytest.raises(ValueError, match=match) as err:
            build()
        assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- error feedback


def _toy_error_feedback(fraction):
    """A client update that ignores the model: Δ_k = the client's single example x (20
    numbers), weight n_k. FedAvg's server step applies the aggregate."""

    def client_update(params, client_state, batches, num_examples):
        del client_state
        delta = {"w": batches.x[0, 0].reshape(4, 5) * jnp.ones_like(params["w"])}
        return ClientMessage(delta, num_examples, {})

    pieces = model_pieces(client_update, optax.sgd(1.0),
                          compressed(top_k(fraction)))
    return error_feedback(compose(pieces), top_k(fraction), num_clients=6)


def test_error_feedback_residual_is_carried_exactly():
    """Three rounds against a NumPy loop; round 2 has a padding client (id 0, n = 0) and
    round 3 a rejected one (id 5, NaN): their residuals stay as they were."""
    alg = _toy_error_feedback(0.2)
    state = alg.init({"w": jnp.zeros((4, 5))}, jax.random.key(0))
    rng = np.random.default_rng(0)
    rounds = [([0, 1, 2], [3.0, 1.0, 2.0]), ([1, 3, 0], [2.0, 4.0, 0.0]),
              ([0, 1, 5], [1.0, 1.0, 5.0])]
    e = np.zeros((6, 20), np.float32)
    model = np.zeros(20, np.float32)
    step = jax.jit(alg.round)
    for t, (ids, n) in enumerate(rounds):
        x = rng.normal(size=(3, 20)).astype(np.float32)
        if t == 2:
            x[2, 3] = np.nan
        cohort = CohortBatches(Batches(jnp.asarray(x)[:, None, None, :],
                                       jnp.zeros((3, 1, 1), jnp.int32), jnp.ones((3, 1, 1))),
                               jnp.asarray(n), jnp.asarray(ids, jnp.int32))
        state, metrics = step(state, cohort, jax.random.key(t))
        total, agg = 0.0, np.zeros(20, np.float32)
        accepted = [k for k in range(3) if n[k] > 0 and np.all(np.isfinite(x[k]))]
        # top-k of 20 at 0.2: 4 float32 values and 4 int32 indices, and the weight
        assert int(metrics["uplink_bytes"]) == len(accepted) * (4 * 8 + 4)
        assert float(metrics["compression_ratio"]) == pytest.approx((4 * 20 + 4) / 36)
        for k, (i, nk) in enumerate(zip(ids, n, strict=True)):
            if nk == 0 or not np.all(np.isfinite(x[k])):
                continue
            p = x[k] + e[i]
            q = _np_top_k(p, 0.2)
            e[i] = p - q
            agg += nk * q
            total += nk
        model -= agg / total
        np.testing.assert_array_equal(np.asarray(residuals(state)["w"]).reshape(6, 20), e)
        np.testing.assert_allclose(np.asarray(state.server.params["w"]).ravel(), model,
                                   rtol=1e-6, atol=1e-6)
    assert int(metrics["rejected_clients"]) == 1
    assert np.any(e[0] != 0) and not np.any(e[4])  # carried over; never seen


def test_compressed_run_with_error_feedback_resumes_bit_identically(small_mnist, tmp_path):
    """A killed and resumed run (checkpoint every 2 rounds) equals the uninterrupted one:
    records, model and every client's residual."""
    from fedax.models import get_model, softmax_cross_entropy
    from fedax.simulation import make_evaluator, run

    train, x_test, y_test = small_mnist
    model = get_model("logistic")
    evaluate = make_evaluator(model.apply, x_test[:500], y_test[:500], chunk=500)

    def loss(params, batch):
        return softmax_cross_entropy(model.apply(params, batch.x), batch.y, batch.mask)

    class Killed(Exception):
        pass

    def go(directory, kill_after=None, resume=False):
        def kill(record):
            if record["round"] == kill_after:
                raise Killed

        alg = error_feedback(fedavg(loss, optax.sgd(0.1), aggregator=compressed(top_k(0.05))),
                             top_k(0.05), train.num_clients)
        return run(alg, model.init(jax.random.key(0)), train, evaluate, rounds=4,
                   client_fraction=0.2, local_epochs=1, batch_size=50, seed=0,
                   callbacks=[kill], checkpoint_dir=directory, checkpoint_every=2,
                   resume=resume)

    full = go(tmp_path / "full")
    with pytest.raises(Killed):
        go(tmp_path / "run", kill_after=3)
    resumed = go(tmp_path / "run", resume=True)
    assert resumed.resumed_from == 2

    def strip(h):
        return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in h.records]

    assert strip(resumed) == strip(full)
    assert full.records[-1]["test_accuracy"] > 0.5
    table = np.asarray(residuals(full.state)["dense"]["kernel"])
    assert np.count_nonzero(np.any(table != 0, axis=(1, 2))) >= 4  # residuals were kept
    for a, b in zip(jax.tree.leaves(full.state), jax.tree.leaves(resumed.state), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


# ------------------------------------------------------------------------------- config


def test_config_compression_section_validates_and_wires():
    from fedax.builder.build import build_algorithm, privacy_aggregator
    from fedax.builder.privacy_plan import privacy_plan
    from fedax.models import get_model
    from fedax.spec.config import ConfigError, config_to_dict, validate_config

    base = dict(rounds=1, partition="iid", model="logistic", algorithm="fedavg",
                client_fraction=0.1, local_epochs=1, batch_size=10, client_lr=0.1)
    assert "compression" not in config_to_dict(validate_config(base))
    for section, match in (
            ({"scheme": "qsgd"}, "'compression.levels': scheme 'qsgd' needs levels"),
            ({"scheme": "top_k", "fraction": 0.1, "levels": 2},
             "'compression.levels': applies to scheme 'qsgd' only"),
            ({"scheme": "rotation", "bits": 2, "error_feedback": True},
             "'compression.error_feedback'"),
            ({"scheme": "rotation", "bits": 2, "block_size": 48}, "power of 2"),
            ({"scheme": "top_k", "fraction": 0}, "'compression.fraction'"),
            ({"scheme": "gzip"}, "'compression.scheme'")):
        with pytest.raises(ConfigError, match=match) as err:
            validate_config({**base, "compression": section})
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="'compression'.*'gaussian' only"):
        validate_config({**base, "privacy": {"mechanism": "adaptive", "noise_multiplier": 1.0},
                         "compression": {"scheme": "float16"}})

    # error feedback: the residual table is per-client state
    config = validate_config({**base, "compression": {"scheme": "top_k", "fraction": 0.01,
                                                      "error_feedback": True}})
    model = get_model("logistic")
    params = model.init(jax.random.key(0))
    state = build_algorithm(config, model.apply, num_clients=4).init(params, jax.random.key(0))
    assert residuals(state)["dense"]["kernel"].shape == (4, 784, 10)
    # DP + compression: the DP aggregator sends the compressed message
    config = validate_config({**base, "compression": {"scheme": "qsgd", "levels": 1},
                              "privacy": {"mechanism": "gaussian", "clip": 1.0,
                                          "noise_multiplier": 1.0}})
    dp = privacy_aggregator(config, privacy_plan(config, 100))
    updates = jax.tree.map(lambda p: jnp.ones((2, *p.shape)), params)
    cost = fed.comm_cost(lambda u: aggregate(dp, u, jnp.ones(2), dp.init(params),
                                             jax.random.key(0)), updates)
    assert cost.clients_to_server_bytes == 2 * (message_bytes(qsgd(1), params) + 4) + 2 * 4


def _claims(rows, improvement=2.0):
    from fedax.reproduce import EXPERIMENTS
    from fedax.reproduce.claims import check_claims

    paper = EXPERIMENTS["compression"]
    results = {"rows": [{"label": label, "accuracy": acc} for label, acc in rows],
               "mean_estimation": [{"bits": 2, "plain": 1.0, "rotated": 1.0 / improvement,
                                    "improvement": improvement}]}
    return {c["claim"]: c["held"] for c in check_claims(paper.claims, results, paper.sources)}


def test_compression_paper_claims_read_the_numbers():
    """The paper file's claims (``papers/compression.yaml``): held or not by their stated
    criteria (fake rows); a scheme without a row is not claimed."""
    rows = [("float32 (none)", 0.96), ("float16", 0.959), ("QSGD s=7", 0.94),
            ("top-k 1%", 0.93), ("top-k 1% + EF", 0.955)]
    assert _claims(rows) == {
        "16-bit casts cost no accuracy (float16)": True,
        "QSGD at 4 bits a coordinate matches float32 (QSGD s=7)": False,  # −2 points
        "top-k 1% without error feedback loses accuracy (> 1 point below float32)": True,
        "error feedback recovers top-k 1% (better than without, within 1 point of float32)":
            True,
        "the random rotation lowers the error of the mean at 2 bit(s)": True}
    rows[-1] = ("top-k 1% + EF", 0.92)  # worse than without: not recovered
    held = _claims(rows, improvement=0.5)
    assert not held["error feedback recovers top-k 1% (better than without, within 1 point "
                    "of float32)"]
    assert not held["the random rotation lowers the error of the mean at 2 bit(s)"]


def test_compression_paper_message_bytes():
    """The report's bytes: the float32 update (4 × 199,210) and a weight, or the code's."""
    from fedax.reproduce.hooks.compression import message_bytes as paper_bytes

    assert paper_bytes(None) == 4 * 199_210 + 4
    assert paper_bytes({"scheme": "float16"}) == 2 * 199_210 + 4
    assert paper_bytes({"scheme": "top_k", "fraction": 0.01, "error_feedback": True}) == \
        paper_bytes({"scheme": "top_k", "fraction": 0.01})


@pytest.mark.slow
def test_compression_paper_runs_end_to_end(tmp_path):
    """A tiny ``compression`` paper through the engine: its grid's configs, each scheme's row
    (accuracy over the subset's last_k evaluations, bytes, ratios), the mean-estimation
    table, the claims and the report; a second invocation reuses every run."""
    from dataclasses import replace

    from fedax.reproduce import EXPERIMENTS, reproduce
    from fedax.reproduce.expr import slug

    schemes = [["float32 (none)", None], ["QSGD s=1", {"scheme": "qsgd", "levels": 1}],
               ["top-k 1% + EF", {"scheme": "top_k", "fraction": 0.01,
                                  "error_feedback": True}]]
    tiny = {"num_clients": 10, "client_fraction": 0.5, "rounds": 3, "eval_every": 1,
            "last_k": 2, "seeds": [0], "target": 0.5, "schemes": schemes,
            "mean_estimation": {"dim": 1024, "clients": 4, "trials": 2, "bits": [2]}}
    paper = replace(EXPERIMENTS["compression"], settings={"quick": tiny})
    logs: list[str] = []
    results = reproduce(paper, tmp_path, quick=True, progress=False, log=logs.append)
    runs = {r["run"]: r for r in results["runs"]}
    assert list(runs) == ["float32-none/seed0", "qsgd-s-1/seed0", "top-k-1-ef/seed0"]
    configs = {name: json.loads((tmp_path / "runs" / name / "summary.json").read_text())[
        "config"] for name in runs}
    assert "compression" not in configs["float32-none/seed0"]
    assert configs["qsgd-s-1/seed0"]["compression"]["levels"] == 1
    assert configs["top-k-1-ef/seed0"]["compression"]["error_feedback"] is True
    assert {c["rounds"] for c in configs.values()} == {3}
    rows = {r["label"]: r for r in results["rows"]}
    plain = rows["float32 (none)"]
    assert plain["message_bytes"] == 4 * 199_210 + 4 and plain["bits_per_coordinate"] > 32
    assert plain["rounds_to_target"] == runs["float32-none/seed0"]["rounds_to_target"] < 3
    for label, row in rows.items():
        run = runs[f"{slug(label)}/seed0"]
        assert row["accuracy"] == pytest.approx(np.mean([a for _, a in run["curve"][-2:]]))
        assert row["minus_uncompressed"] == pytest.approx(row["accuracy"] - plain["accuracy"])
        assert row["compression_ratio"] == pytest.approx(
            plain["message_bytes"] / row["message_bytes"])
        reached = run["rounds_to_target"]
        assert row["uplink_bytes_to_target"] == (
            None if reached is None else pytest.approx(reached * 5 * row["message_bytes"]))
    assert 1.9 < rows["QSGD s=1"]["bits_per_coordinate"] < 2.2
    assert [m["bits"] for m in results["mean_estimation"]] == [2]
    assert results["mean_estimation"][0]["improvement"] > 1
    claimed = [c["claim"] for c in results["claims"]]
    assert claimed == ["the random rotation lowers the error of the mean at 2 bit(s)"]
    report = (tmp_path / "report.md").read_text()
    assert (f"| QSGD s=1 | {rows['QSGD s=1']['bits_per_coordinate']:.3g} | "
            f"{rows['QSGD s=1']['compression_ratio']:.1f}× | "
            f"{rows['QSGD s=1']['accuracy']:.4f} |") in report
    assert (tmp_path / "accuracy_vs_bits.png").stat().st_size > 1000
    logs.clear()
    reproduce(paper, tmp_path, quick=True, progress=False, log=logs.append)
    assert sum("(reused)" in line for line in logs) == 3
