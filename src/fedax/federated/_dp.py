"""The clip and the noise of a DP release as JAX primitives: ``dp_clip`` and ``dp_noise``.

They are marker primitives that *are* the operations (``federated_dp_clip``: each client's
pytree scaled to L2 norm ≤ clip; ``federated_dp_noise``: add N(0, stddev²) from a key), so
that the audit (``fedax.federated.audit``) can recognise a private sum by dataflow in a jaxpr: a
``federated_sum`` whose operand comes out of ``federated_dp_clip`` and whose result goes
nowhere but into ``federated_dp_noise``. They batch under ``vmap``, and their JVPs are the
clip's Jacobian and a noise with tangent zero (its key is fixed).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

CLIP_PRIMITIVE = "federated_dp_clip"
NOISE_PRIMITIVE = "federated_dp_noise"

# ----------------------------------------------------------------- the marker primitives
#
# Both take a flat list of array leaves. ``batch_ndim`` leading axes index independent
# groups (clients; vmap adds one more): the clip norm is taken per group over all leaves
# and the remaining axes; the noise is drawn for one group and shared along those axes
# (what an unbatched key gives under vmap).

dp_clip_p = Primitive(CLIP_PRIMITIVE)
dp_clip_p.multiple_results = True
dp_noise_p = Primitive(NOISE_PRIMITIVE)
dp_noise_p.multiple_results = True


def _clip_impl(*operands, clip, batch_ndim, bounds, weighted):
    """Per group: every leaf scaled to the global L2 norm ``clip`` (or leaf j alone to
    ``bounds[j]``: per-layer clipping), times the group's weight clamped to [0, 1] when
    ``weighted`` (the last operand); a group with a non-finite norm or a weight <= 0
    becomes zeros."""
    leaves = [jnp.asarray(a) for a in (operands[:-1] if weighted else operands)]
    batch = leaves[0].shape[:batch_ndim]
    acc = jnp.promote_types(jnp.result_type(*leaves), jnp.float32)
    squares = [jnp.sum(jnp.square(a.astype(acc)), axis=tuple(range(batch_ndim, a.ndim)))
               for a in leaves]
    norm = jnp.sqrt(functools.reduce(jnp.add, squares))
    finite = jnp.isfinite(norm)  # a non-finite client counts for nothing (by selection)
    if bounds is None:
        factors = [jnp.minimum(1.0, clip / jnp.maximum(norm, 1e-30))] * len(leaves)
    else:
        factors = [jnp.minimum(1.0, b / jnp.maximum(jnp.sqrt(sq), 1e-30))
                   for b, sq in zip(bounds, squares, strict=True)]
    if weighted:
        weight = jnp.asarray(operands[-1]).astype(acc)
        finite = jnp.logical_and(finite, weight > 0)
        factors = [f * jnp.clip(weight, 0.0, 1.0) for f in factors]

    def scale(a, factor):
        shape = batch + (1,) * (a.ndim - batch_ndim)
        scaled = a * factor.reshape(shape).astype(a.dtype)
        return jnp.where(finite.reshape(shape), scaled, jnp.zeros((), a.dtype))

    return [scale(a, f) for a, f in zip(leaves, factors, strict=True)]


def _clip_abstract_eval(*avals, clip, batch_ndim, bounds, weighted):
    del clip
    leaves = avals[:-1] if weighted else avals
    batches = {tuple(a.shape[:batch_ndim]) for a in avals}
    if len(batches) != 1 or any(a.ndim < batch_ndim for a in avals) or (
            weighted and avals[-1].ndim != batch_ndim):
        raise ValueError(f"{CLIP_PRIMITIVE}: leaves disagree on the {batch_ndim} leading "
                         f"(client) axes: {sorted(batches)}.")
    if bounds is not None and len(bounds) != len(leaves):
        raise ValueError(f"{CLIP_PRIMITIVE}: {len(bounds)} per-leaf bounds for "
                         f"{len(leaves)} leaves.")
    if not all(jnp.issubdtype(a.dtype, jnp.inexact) for a in leaves):
        raise TypeError(f"{CLIP_PRIMITIVE} clips float values only.")
    return list(leaves)


def _to_front(args, dims):
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    return [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims, strict=True)]


def _clip_batch(args, dims, *, batch_ndim, **params):
    out = dp_clip_p.bind(*_to_front(args, dims), batch_ndim=batch_ndim + 1, **params)
    return out, [0] * len(out)


def _clip_jvp(primals, tangents, **params):
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    out = dp_clip_p.bind(*primals, **params)
    _, tangent_out = jax.jvp(functools.partial(_clip_impl, **params),
                             tuple(primals), tuple(tangents))
    return out, list(tangent_out)


def _noise_impl(*operands, stddev, batch_ndim):
    *leaves, key = operands
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, a in zip(keys, leaves, strict=True):
        a = jnp.asarray(a)
        dtype = jnp.result_type(a)
        noise = jax.random.normal(k, a.shape[batch_ndim:], dtype) * jnp.asarray(stddev, dtype)
        out.append(a + noise)
    return out


def _noise_abstract_eval(*avals, stddev, batch_ndim):
    del stddev, batch_ndim
    *values, _ = avals
    if not all(jnp.issubdtype(a.dtype, jnp.inexact) for a in values):
        raise TypeError(f"{NOISE_PRIMITIVE} noises float values only.")
    return list(values)


def _noise_batch(args, dims, *, stddev, batch_ndim):
    if dims[-1] is not None:
        raise NotImplementedError(
            f"{NOISE_PRIMITIVE} under vmap with a batched key; map over the values only.")
    values = _to_front(args[:-1], dims[:-1])
    out = dp_noise_p.bind(*values, args[-1], stddev=stddev, batch_ndim=batch_ndim + 1)
    return out, [0] * len(out)


def _noise_jvp(primals, tangents, *, stddev, batch_ndim):
    out = dp_noise_p.bind(*primals, stddev=stddev, batch_ndim=batch_ndim)
    return out, [ad.instantiate_zeros(t) for t in tangents[:-1]]  # noise: tangent zero


dp_clip_p.def_impl(_clip_impl)
dp_clip_p.def_abstract_eval(_clip_abstract_eval)
mlir.register_lowering(dp_clip_p, mlir.lower_fun(_clip_impl, multiple_results=True))
batching.primitive_batchers[dp_clip_p] = _clip_batch
ad.primitive_jvps[dp_clip_p] = _clip_jvp

dp_noise_p.def_impl(_noise_impl)
dp_noise_p.def_abstract_eval(_noise_abstract_eval)
mlir.register_lowering(dp_noise_p, mlir.lower_fun(_noise_impl, multiple_results=True))
batching.primitive_batchers[dp_noise_p] = _noise_batch
ad.primitive_jvps[dp_noise_p] = _noise_jvp


def dp_clip(tree: Any, clip: float, *, client_placed: bool = True, weights: Any = None,
            per_layer: bool = False) -> Any:
    """Each client's value scaled to L2 norm at most ``clip`` (the global norm over every
    leaf, as ``dp_gaussian``'s flat clip); a client with a non-finite norm becomes zeros.
    ``client_placed``: leaves have a leading clients axis; otherwise ``tree`` is one
    client's value (inside ``map_clients``).

    ``weights`` (one per client, or a scalar for one client): the clipped value times
    ``clip(w, 0, 1)``, zeros where w <= 0, so one client still moves a sum by at most
    ``clip`` (DP-FedAvg's capped weights). ``per_layer``: leaf j is clipped alone to
    clip·sqrt(d_j/d) (TFF's allocation; the whole value keeps norm <= clip)."""
    clip = _positive("dp_clip clip", clip)
    leaves, treedef = jax.tree.flatten(tree)
    bounds = None
    if per_layer:
        sizes = [math.prod(jnp.shape(leaf)[1 if client_placed else 0:]) for leaf in leaves]
        if not sum(sizes):
            raise ValueError("per-layer clipping needs a value with at least one coordinate.")
        bounds = tuple(clip * math.sqrt(d / sum(sizes)) for d in sizes)
    operands = leaves if weights is None else [*leaves, jnp.asarray(weights)]
    out = dp_clip_p.bind(*operands, clip=clip, batch_ndim=1 if client_placed else 0,
                         bounds=bounds, weighted=weights is not None)
    return jax.tree.unflatten(treedef, out)


def dp_noise(tree: Any, stddev: float, key: jax.Array) -> Any:
    """``tree`` (server-placed) plus N(0, stddev²) on every coordinate, drawn from ``key``
    as ``dp_gaussian`` draws its noise (one split per leaf)."""
    stddev = _non_negative("dp_noise stddev", stddev)
    if key is None:
        raise ValueError("dp_noise needs a key (the noise of a DP release).")
    leaves, treedef = jax.tree.flatten(tree)
    out = dp_noise_p.bind(*leaves, key, stddev=stddev, batch_ndim=0)
    return jax.tree.unflatten(treedef, out)


def _number(name: str, value: Any) -> float:
    """``value`` as a finite Python float, or a ValueError naming ``name`` (the DP
    aggregators' validation too: ``fedax.aggregators.dp`` imports these)."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}.") from None
    if isinstance(value, bool) or not math.isfinite(out):
        raise ValueError(f"{name} must be a finite number, got {value!r}.")
    return out


def _positive(name: str, value: Any) -> float:
    out = _number(name, value)
    if not out > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}.")
    return out


def _non_negative(name: str, value: Any) -> float:
    out = _number(name, value)
    if out < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}.")
    return out


__all__ = ["CLIP_PRIMITIVE", "NOISE_PRIMITIVE", "dp_clip", "dp_noise"]
