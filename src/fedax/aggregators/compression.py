"""Compressed uplink: each client encodes its update, the server decodes and averages.

``compressed(compressor)`` is a complete aggregator. Its client stage (inside
``map_clients``, or on a real client) encodes every leaf of the client's update into a small
pytree of arrays (integer codes bit-packed into ``uint32`` words, 16-bit floats, top-k
values and ``int32`` indices, per-bucket ``float32`` scales); its reduction moves those codes
to the server with ``fedax.federated.collect`` (each client's message kept apart: codes are
not summable), decodes each client's message and forms the weighted mean (or sum) there. So
``fedax.federated.comm_cost`` prices what really crosses, the compressed bytes (plus each
client's ``float32`` weight). A client with weight 0 (padding, rejected) is left out by
selection, as in ``aggregators.mean``. Every round reports ``uplink_bytes`` (the accepted
clients' messages, codes and weight; ``uplink_metrics``) and ``compression_ratio`` (against
the ``float32`` update and its weight), computed in the round program from the codes' static
shapes, so every engine records them.

Compressors (``fedax.aggregators.compressors``, one leaf at a time): ``qsgd`` (Alistarh
et al. 2017), ``rotation`` (Suresh et al. 2017), ``top_k`` (with error feedback,
``fedax.algorithms.error_feedback``) and ``cast`` (16 bits, or 8 on a per-bucket scale);
this module re-exports them.

Differential privacy. A compressed message can decode to a larger norm than the update it
encodes (QSGD: up to √B times per bucket), so clipping before encoding does not bound a
client's contribution. The order that keeps DP-FedAvg's sensitivity is: clip on the client
(so the code describes a bounded update), encode, and **clip the decoded value again on the
server, before the sum and the noise** (``decoded_clip``): every client then moves the sum by
at most S whatever the compressor. ``dp_compressed`` builds exactly that, with
``dp_gaussian``'s weights, noise and fixed denominator. The reverse order (encode, then clip
on the client) cannot be built: ``chain`` rejects a client stage after this reduction.
Clipping the decoded value makes an unbiased compressor biased where it bites.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from fedax import federated as fed
from fedax.aggregators.base import Aggregator, chain
from fedax.aggregators.compressors import (
    SCHEMES,
    Compressor,
    Scheme,
    cast,
    make_compressor,
    qsgd,
    rotation,
    top_k,
)
from fedax.aggregators.dp import _positive, dp_gaussian

__all__ = [
    "SCHEMES",
    "Compressor",
    "MessageSizes",
    "Scheme",
    "Shape",
    "cast",
    "compressed",
    "decode_tree",
    "dp_compressed",
    "encode_tree",
    "make_compressor",
    "message_bytes",
    "message_sizes",
    "qsgd",
    "rotation",
    "roundtrip",
    "top_k",
    "uplink_metrics",
    "uplink_sizes",
]


# ------------------------------------------------------------------------- the aggregator


class Shape(NamedTuple):
    """A zero-size marker ``[0, *shape]`` of a leaf's dtype: it travels with the codes
    (0 bytes) so that the server knows each leaf's shape without the model."""

    like: jax.Array


def _leaf_shared(shared: Any, i: int) -> Any:
    """The shared state a leaf's encoder sees: ``rotation``'s key and the leaf's number."""
    if not jax.tree.leaves(shared):
        return shared
    return {"key": shared, "leaf": i}


def encode_tree(compressor: Compressor, value: Any, shared: Any, key: Any) -> Any:
    """One client's message: every leaf of ``value`` encoded (leaf i with
    ``fold_in(key, i)``), as ``(code, Shape)`` pairs in ``value``'s tree structure."""
    leaves, treedef = jax.tree.flatten(value)
    out = []
    for i, leaf in enumerate(leaves):
        leaf_key = None if key is None else jax.random.fold_in(key, i)
        code = compressor.encode(jnp.ravel(leaf).astype(jnp.float32), _leaf_shared(shared, i),
                                 leaf_key)
        out.append((code, Shape(jnp.zeros((0, *jnp.shape(leaf)), jnp.result_type(leaf)))))
    return jax.tree.unflatten(treedef, out)


def _is_message(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], Shape)


def _messages(codes: Any) -> tuple[list, Any]:
    return jax.tree.flatten(codes, is_leaf=_is_message)


def decode_tree(compressor: Compressor, codes: Any, shared: Any, weights: jax.Array,
                reduction: Literal["mean", "sum"], decoded_clip: float | None) -> Any:
    """Server side: the weighted mean (or sum) over clients of the decoded messages.

    ``codes`` is the stacked (``[C, ...]``) output of ``encode_tree``, ``weights [C]``.
    Each client's message is decoded into the transport domain; with ``decoded_clip`` S it
    is scaled to global L2 norm at most S there (an upper bound of its norm after
    ``unfold``); then Σ_k w_k y_k (/ Σ_k w_k), zero-weight clients left out by selection,
    and ``unfold`` once per leaf.
    """
    messages, treedef = _messages(codes)
    decoded = []
    for i, (code, shape) in enumerate(messages):
        d = math.prod(shape.like.shape[2:])
        decoded.append(jax.vmap(lambda c, i=i, d=d: compressor.decode(
            c, _leaf_shared(shared, i), d))(code))
    selected = weights > 0
    w = jnp.where(selected, weights, 0).astype(jnp.float32)
    if decoded_clip is not None:
        norm = jnp.sqrt(sum(jnp.sum(y * y, axis=1) for y in decoded))
        w = w * jnp.minimum(1.0, decoded_clip / jnp.maximum(norm, 1e-30))
    if reduction == "mean":
        total = jnp.sum(jnp.where(selected, weights, 0).astype(jnp.float32))
        w = jnp.where(total > 0, w / jnp.where(total > 0, total, 1.0), 0.0)
    out = []
    for i, ((_, shape), y) in enumerate(zip(messages, decoded, strict=True)):
        summed = jnp.sum(jnp.where(selected[:, None], y, 0.0) * w[:, None], axis=0)
        d = math.prod(shape.like.shape[2:])
        flat = compressor.unfold(summed, _leaf_shared(shared, i), d)
        out.append(flat.reshape(shape.like.shape[2:]).astype(shape.like.dtype))
    return jax.tree.unflatten(treedef, out)


def roundtrip(compressor: Compressor, value: Any, shared: Any = (), key: Any = None) -> Any:
    """decode∘encode of one client's ``value`` (what the server recovers from it), leaf by
    leaf, on the client: error feedback's C(p)."""
    codes = encode_tree(compressor, value, shared, key)
    stacked = jax.tree.map(lambda a: a[None], codes)
    return decode_tree(compressor, stacked, shared, jnp.ones((1,), jnp.float32), "sum", None)


def compressed(
    compressor: Compressor,
    *,
    reduction: Literal["mean", "sum"] = "mean",
    decoded_clip: float | None = None,
) -> Aggregator:
    """A complete aggregator: encode on each client, decode and average on the server.

    Args:
      compressor: ``qsgd``, ``rotation``, ``top_k`` or ``cast``.
      reduction: ``"mean"`` (Σ w_k x̂_k / Σ w_k, ``aggregators.mean``'s) or ``"sum"``
        (Σ w_k x̂_k, for a DP server stage that divides by a fixed denominator).
      decoded_clip: S > 0: each decoded message is scaled to L2 norm at most S on the server
        before the reduction (the DP order; see the module docstring).

    Returns:
      an ``Aggregator`` with state ``compressor.init()`` (``rotation``'s shared key, advanced
      every round by the server stage; ``()`` otherwise) and the metrics of
      ``uplink_metrics``: ``uplink_bytes`` (what the accepted clients sent) and
      ``compression_ratio`` (against the float32 update).
    """
    if not isinstance(compressor, Compressor):
        raise ValueError(f"compressed needs a Compressor (qsgd, rotation, top_k, cast), got "
                         f"{compressor!r}.")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"compressed reduction must be 'mean' or 'sum', got {reduction!r}.")
    clip = None if decoded_clip is None else _positive("compressed decoded_clip", decoded_clip)
    shared_key = bool(jax.tree.leaves(jax.eval_shape(compressor.init)))

    def init(template):
        del template
        return compressor.init()

    def client(value, weight, state, key):
        return encode_tree(compressor, value, state, key), weight, {}

    def reduce(codes, weights, state, key):
        del key
        sizes = message_sizes(codes, weights)
        codes, weights = fed.collect((codes, weights))
        return (decode_tree(compressor, codes, state, weights, reduction, clip),
                uplink_metrics(sizes, weights))

    def server(value, stats, state, key):
        del stats, key
        # The next round's rotation: a fresh shared key (the server broadcasts it).
        return value, jax.random.key_data(
            jax.random.fold_in(jax.random.wrap_key_data(state), 1)), {}

    return Aggregator(init, client, reduce, server if shared_key else None)


class MessageSizes(NamedTuple):
    """What one client's message weighs (static: shapes and dtypes only).

    Attributes:
      code_bytes: the encoded update (``message_bytes``).
      weight_bytes: the client's aggregation weight, sent beside it (4 for ``float32``).
      coordinates: d, the update's number of coordinates (every leaf).
    """

    code_bytes: int
    weight_bytes: int
    coordinates: int

    @property
    def client_bytes(self) -> int:
        """One client's uplink: the codes and the weight (what ``comm_cost`` counts)."""
        return self.code_bytes + self.weight_bytes

    @property
    def uncompressed_bytes(self) -> int:
        """The same message uncompressed: the ``float32`` update (4·d) and the weight."""
        return 4 * self.coordinates + self.weight_bytes

    @property
    def ratio(self) -> float:
        """``uncompressed_bytes / client_bytes``: how many times smaller the uplink is."""
        return self.uncompressed_bytes / self.client_bytes


def message_sizes(codes: Any, weights: Any) -> MessageSizes:
    """The ``MessageSizes`` of the client-placed (``[C, ...]``) output of ``encode_tree``
    (or its abstract shapes) and its weights ``[C]``."""
    messages, _ = _messages(codes)
    code_bytes = sum(math.prod(a.shape[1:]) * jnp.dtype(a.dtype).itemsize
                     for code, _ in messages for a in jax.tree.leaves(code))
    coordinates = sum(math.prod(shape.like.shape[2:]) for _, shape in messages)
    return MessageSizes(int(code_bytes), int(jnp.dtype(weights.dtype).itemsize),
                        int(coordinates))


def uplink_metrics(sizes: MessageSizes, weights: jax.Array) -> dict[str, jax.Array]:
    """A compressed round's uplink, from the collected (server-placed) ``weights [C]``:
    ``uplink_bytes``, the accepted clients' (w_k > 0; padding and rejected clients send
    nothing that counts) messages, ``sizes.client_bytes`` each (codes and weight; other
    per-client statistics, e.g. a DP clip bit or the training loss, are not counted), and
    ``compression_ratio``, ``sizes.ratio`` against the ``float32`` update and its weight.
    ``uplink_bytes`` is an ``int32`` where C·(bytes per client) fits one, else a ``float32``
    (exact to 2⁻²⁴ relative)."""
    count = jnp.sum((weights > 0).astype(jnp.int32))
    if weights.shape[0] * sizes.client_bytes < 2**31:
        uplink = count * jnp.int32(sizes.client_bytes)
    else:
        uplink = count.astype(jnp.float32) * jnp.float32(sizes.client_bytes)
    return {"uplink_bytes": uplink,
            "compression_ratio": jnp.asarray(sizes.ratio, jnp.float32)}


def message_bytes(compressor: Compressor, template: Any) -> int:
    """Bytes of one client's encoded message for a value shaped like ``template`` (the
    codes only; ``compressed`` also sends the client's ``float32`` weight)."""
    return uplink_sizes(compressor, template).code_bytes


def uplink_sizes(compressor: Compressor, template: Any) -> MessageSizes:
    """The ``MessageSizes`` of one client's message for a value shaped like ``template``,
    with a ``float32`` weight: what each round's ``uplink_bytes`` counts per accepted
    client."""
    shared = jax.eval_shape(compressor.init)
    key = jax.eval_shape(lambda: jax.random.key(0))
    shape = jax.eval_shape(lambda v, s, k: encode_tree(compressor, v, s, k), template, shared,
                           key)
    stacked = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape), a.dtype), shape)
    return message_sizes(stacked, jax.ShapeDtypeStruct((1,), jnp.float32))


def dp_compressed(
    compressor: Compressor,
    clip: float,
    noise_multiplier: float,
    denominator: float,
    *,
    per_layer: bool = False,
    weighting: Literal["uniform", "capped"] = "uniform",
    example_cap: float | None = None,
) -> Aggregator:
    """DP-FedAvg (``dp_gaussian``) over a compressed uplink, in the order that keeps the
    sensitivity S = ``clip``: clip on the client (and ``dp_gaussian``'s weight w_k ≤ 1),
    encode; on the server decode, clip each decoded message to S again, sum Σ w_k x̂_k, add
    N(0, (z·S)²) and divide by the fixed ``denominator``. Same arguments as ``dp_gaussian``.
    """
    dp = dp_gaussian(clip, noise_multiplier, denominator, per_layer=per_layer,
                     weighting=weighting, example_cap=example_cap)
    return chain(Aggregator(dp.init, dp.client, None, dp.server, private=dp.private),
                 compressed(compressor, reduction="sum", decoded_clip=clip))
