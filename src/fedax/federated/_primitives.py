"""Placement primitives: the only way values move between the server and the clients.

A *client-placed* value is a pytree whose leaves carry a leading clients axis of size n; a
*server-placed* value is a plain pytree. Two JAX primitives carry all communication:

* ``broadcast``  server -> clients:  x  |->  [x, x, ..., x]       (shape ``(n, *x.shape)``)
* ``sum``        clients -> server: [x_1..x_n]  |->  sum_i x_i

and a second pair, for algorithms that need each client's message apart (a robust median,
decoding compressed updates): ``collect`` (clients -> server, ``[x_1..x_n]`` kept stacked)
and ``distribute`` (server -> clients, row i to client i), each the other's transpose.

Both are linear, and each is the other's transpose (Rush, Charles, Garrett, "Federated
Automatic Differentiation", JMLR 2024; DrJAX ``primitives.py``):

======================  =========================  ============================
primitive               forward mode (JVP)         reverse mode (transpose)
======================  =========================  ============================
broadcast               broadcast(tangent)         sum(cotangent)
sum                     sum(tangent)               broadcast(cotangent)
======================  =========================  ============================

so the derivative of a federated program, in either mode, is again a federated program
written with the same two primitives (the *closure* property). ``mean`` and
``weighted_mean`` are compositions of these and inherit their derivatives, including the
derivative of ``weighted_mean`` in its weights. ``map_clients`` applies a per-client
function along the clients axis; it moves no data between placements.

When the ambient mesh (``jax.set_mesh``) has an axis named ``clients``, client-placed values
are sharding-constrained along it, so a cohort is spread over devices (and hosts) by JAX's
own SPMD partitioner with no change to the program.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec

CLIENTS_AXIS = "clients"

# --------------------------------------------------------------------------------------
# The two communication primitives, defined per array leaf.
# --------------------------------------------------------------------------------------

broadcast_p = Primitive("federated_broadcast")
sum_p = Primitive("federated_sum")


def _broadcast_impl(x, *, n):
    x = jnp.asarray(x)
    return jnp.broadcast_to(x[None], (n, *x.shape))


def _sum_impl(x):
    x = jnp.asarray(x)
    return jnp.sum(x, axis=0, dtype=x.dtype)


def _spec(aval) -> tuple:
    spec = tuple(aval.sharding.spec)
    return spec + (None,) * (aval.ndim - len(spec))


def _broadcast_abstract_eval(x, *, n):
    # The new clients axis starts replicated; ``broadcast`` then shards it when the mesh
    # has a 'clients' axis.
    sharding = x.sharding.update(spec=PartitionSpec(None, *_spec(x)))
    return x.update(shape=(n, *x.shape), weak_type=False, sharding=sharding)


def _sum_abstract_eval(x):
    if x.ndim == 0:
        raise TypeError("federated sum needs a client-placed value (leading clients axis).")
    sharding = x.sharding.update(spec=PartitionSpec(*_spec(x)[1:]))
    return x.update(shape=x.shape[1:], weak_type=False, sharding=sharding)


def _broadcast_transpose(ct, x, *, n):
    del x, n
    return [sum_p.bind(ct)]


def _sum_transpose(ct, x):
    out = broadcast_p.bind(ct, n=x.aval.shape[0])
    # Under an Explicit mesh the cotangent must carry the primal's sharding.
    sharding = x.aval.sharding
    if not sharding.mesh.empty and _spec(out.aval) != _spec(x.aval):
        out = jax.sharding.reshard(out, sharding.spec)
    return [out]


def _broadcast_batch(args, dims, *, n):
    (x,), (d,) = args, dims
    x = jnp.moveaxis(x, d, 0)
    return broadcast_p.bind(x, n=n), 1


def _sum_batch(args, dims):
    (x,), (d,) = args, dims
    x = jnp.moveaxis(x, d, 1)
    return sum_p.bind(x), 0


broadcast_p.def_impl(_broadcast_impl)
broadcast_p.def_abstract_eval(_broadcast_abstract_eval)
mlir.register_lowering(broadcast_p, mlir.lower_fun(_broadcast_impl, multiple_results=False))
ad.deflinear2(broadcast_p, _broadcast_transpose)
batching.primitive_batchers[broadcast_p] = _broadcast_batch

def _sum_as_product(x):
    """``sum`` on XLA:CPU: a product with a vector of ones, ``1ᵀ x``.

    XLA:CPU runs a reduction over the leading axis of a rank-3 array pathologically slowly:
    the weighted sum of ten clients' CNN weights ``[10, 3136, 512]`` took 2.7 s, as a
    matrix-vector product 3 ms (``benchmarks/bench_aggregate.py``). Same sum, float
    rounding aside; integer sums and vectors keep the plain reduction.
    """
    x = jnp.asarray(x)
    if x.ndim < 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        return _sum_impl(x)
    if x.shape[0] == 1:  # one client's share (``map_and_sum``): nothing to add
        return x[0]
    ones = jnp.ones((x.shape[0],), x.dtype)
    acc = jnp.promote_types(x.dtype, jnp.float32)
    out = jax.lax.dot_general(ones, x, (((0,), (0,)), ((), ())), preferred_element_type=acc)
    return out.astype(x.dtype)


sum_p.def_impl(_sum_impl)
sum_p.def_abstract_eval(_sum_abstract_eval)
mlir.register_lowering(sum_p, mlir.lower_fun(_sum_impl, multiple_results=False))
mlir.register_lowering(sum_p, mlir.lower_fun(_sum_as_product, multiple_results=False),
                       platform="cpu")
ad.deflinear2(sum_p, _sum_transpose)
batching.primitive_batchers[sum_p] = _sum_batch


# --------------------------------------------------------------------------------------
# The pair that moves values one client at a time: collect (clients -> server, each
# client's value kept apart) and distribute (server -> clients, row i to client i).
# --------------------------------------------------------------------------------------

collect_p = Primitive("federated_collect")
distribute_p = Primitive("federated_distribute")


def _identity_impl(x):
    return jnp.asarray(x)


def _placement_abstract_eval(x):
    if x.ndim == 0:
        raise TypeError("federated collect/distribute need a leading clients axis.")
    return x.update(weak_type=False)


def _collect_transpose(ct, x):
    del x
    return [distribute_p.bind(ct)]


def _distribute_transpose(ct, x):
    del x
    return [collect_p.bind(ct)]


def _placement_batch(prim):
    def batch(args, dims):
        (x,), (d,) = args, dims
        # keep the clients axis leading; the batch axis goes second
        x = jnp.moveaxis(x, d, 1)
        return prim.bind(x), 1
    return batch


for _prim, _transpose in ((collect_p, _collect_transpose),
                          (distribute_p, _distribute_transpose)):
    _prim.def_impl(_identity_impl)
    _prim.def_abstract_eval(_placement_abstract_eval)
    mlir.register_lowering(_prim, mlir.lower_fun(_identity_impl, multiple_results=False))
    ad.deflinear2(_prim, _transpose)
    batching.primitive_batchers[_prim] = _placement_batch(_prim)


# --------------------------------------------------------------------------------------
# Sharding along the mesh axis 'clients', when there is one.
# --------------------------------------------------------------------------------------


def _clients_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is not None and not mesh.empty and CLIENTS_AXIS in mesh.axis_names:
        return mesh
    return None


def _check_divisible(n: int, mesh) -> None:
    devices = mesh.shape[CLIENTS_AXIS]
    if n % devices:
        raise ValueError(
            f"{n} clients cannot be split evenly over the {devices} devices of mesh axis "
            f"'{CLIENTS_AXIS}'; pad the cohort with empty clients (weight 0) to a multiple "
            f"of {devices}, or use a mesh whose '{CLIENTS_AXIS}' axis divides the cohort."
        )


def _constrain_clients(tree):
    """Shard the leading axis of every leaf over the mesh axis 'clients', if present.

    With an ``Auto`` axis this is a sharding constraint for the partitioner (or a
    ``device_put`` for a concrete array outside ``jit``); with an ``Explicit`` axis (the
    default of ``jax.make_mesh``) the value is resharded.
    """
    mesh = _clients_mesh()
    if mesh is None:
        return tree
    _check_divisible(_num_clients(tree), mesh)
    return _place(tree, mesh, PartitionSpec(CLIENTS_AXIS))


def _place(tree, mesh, spec: PartitionSpec):
    """Every leaf of ``tree`` laid out as ``spec`` on ``mesh``: resharded under an
    ``Explicit`` clients axis, else a sharding constraint (a ``device_put`` outside jit)."""
    if mesh._name_to_type[CLIENTS_AXIS] == jax.sharding.AxisType.Explicit:
        return jax.tree.map(lambda a: jax.sharding.reshard(a, spec), tree)

    def constrain(a):
        if isinstance(a, jax.core.Tracer):
            return jax.lax.with_sharding_constraint(a, spec)
        return jax.device_put(a, jax.sharding.NamedSharding(jax.sharding.get_mesh(), spec))

    return jax.tree.map(constrain, tree)


# --------------------------------------------------------------------------------------
# Public pytree-level API.
# --------------------------------------------------------------------------------------


def _num_clients(tree) -> int:
    leaves = jax.tree.leaves(tree)
    if not leaves:
        raise ValueError("a client-placed value must have at least one array leaf.")
    shapes = [jnp.shape(leaf) for leaf in leaves]
    if any(not shape for shape in shapes):
        raise ValueError(
            "a client-placed value needs a leading clients axis on every leaf; "
            "got a scalar leaf. Use broadcast(x, n) to place a server value at the clients."
        )
    sizes = {shape[0] for shape in shapes}
    if len(sizes) != 1:
        raise ValueError(
            f"client-placed leaves disagree on the number of clients: {sorted(sizes)}. "
            "Every leaf must have the same leading clients axis."
        )
    return sizes.pop()


# The client-placed leaves that ``broadcast`` made, by id, each with the server value it
# was made from (a weak reference to the leaf, so an entry lives no longer than its array or
# tracer). Every row of such a leaf is that value: ``map_clients`` neither moves its rows
# between devices nor reads it row by row, and the ``processes`` strategy sends the server
# value once per worker (``benchmarks/profile_cross_device.py``).
_BROADCAST_LEAVES: dict[int, tuple[weakref.ref, Any]] = {}


def _remember_broadcast(leaf: Any, source: Any) -> Any:
    key = id(leaf)

    def forget(ref, key=key):
        if _BROADCAST_LEAVES.get(key, (None,))[0] is ref:
            del _BROADCAST_LEAVES[key]

    try:
        _BROADCAST_LEAVES[key] = (weakref.ref(leaf, forget), source)
    except TypeError:  # a leaf type without weak references: treated as any other
        pass
    return leaf


def broadcast_source(leaf: Any) -> Any:
    """The server value that ``broadcast`` placed at the clients as ``leaf`` (its every
    row), or None when ``leaf`` was made otherwise."""
    ref, source = _BROADCAST_LEAVES.get(id(leaf), (None, None))
    return source if ref is not None and ref() is leaf else None


def broadcast(x: Any, n: int) -> Any:
    """Server -> clients: place a copy of every leaf of ``x`` at each of ``n`` clients.

    Returns a pytree whose leaves have shape ``(n, *leaf.shape)``. Reverse-mode derivative:
    ``sum``; forward mode: ``broadcast`` of the tangent.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"broadcast needs a positive int number of clients, got {n!r}.")
    sources = jax.tree.map(jnp.asarray, x)
    out = jax.tree.map(lambda a: broadcast_p.bind(a, n=n), sources)
    return jax.tree.map(_remember_broadcast, _constrain_clients(out), sources)


def sum(x: Any) -> Any:  # noqa: A001 - the federated sum; shadows the builtin in this module
    """Clients -> server: sum every leaf over the clients axis.

    Reverse-mode derivative: ``broadcast``; forward mode: ``sum`` of the tangent.
    """
    _num_clients(x)

    def leaf_sum(a):
        a = jnp.asarray(a)
        # promote like jnp.sum: bool and narrow integers accumulate in the default int
        if a.dtype == jnp.bool_ or (
            jnp.issubdtype(a.dtype, jnp.integer) and jnp.iinfo(a.dtype).bits < 32
        ):
            unsigned = jnp.issubdtype(a.dtype, jnp.unsignedinteger)
            a = a.astype(jnp.uint32 if unsigned else jnp.int32)
        return sum_p.bind(a)

    return jax.tree.map(leaf_sum, x)


def collect(x: Any) -> Any:
    """Clients -> server, each client's value kept apart: the server receives the stacked
    ``[n, ...]`` leaves (a robust median, a decoder of compressed messages need every
    message, not their sum). The same bytes go up as for ``sum`` (n shares of one client's
    size). Reverse-mode derivative: ``distribute`` (client i gets row i of the cotangent);
    forward mode: ``collect`` of the tangent. Under a ``clients`` mesh the result is
    replicated, as every server-placed value is.
    """
    _num_clients(x)
    out = jax.tree.map(lambda a: collect_p.bind(jnp.asarray(a)), x)
    return _replicate(out)


def distribute(x: Any) -> Any:
    """Server -> clients, row by row: client i receives row i of every leaf of the
    server-placed ``[n, ...]`` value ``x`` (one client's share each, n shares in all).
    Reverse-mode derivative: ``collect``; forward mode: ``distribute`` of the tangent."""
    _num_clients(x)
    out = jax.tree.map(lambda a: distribute_p.bind(jnp.asarray(a)), x)
    return _constrain_clients(out)


def _replicate(tree):
    """Replicate every leaf over the 'clients' mesh axis, if there is one (a server value)."""
    mesh = _clients_mesh()
    return tree if mesh is None else _place(tree, mesh, PartitionSpec())


def mean(x: Any) -> Any:
    """Clients -> server: unweighted mean over the clients axis, ``sum(x) / n``."""
    n = _num_clients(x)
    return jax.tree.map(lambda s: s / jnp.asarray(n, s.dtype), sum(x))


def weighted_mean(x: Any, weights: jax.Array) -> Any:
    """Clients -> server: ``sum_i w_i x_i / sum_i w_i``.

    ``weights`` is client-placed with shape ``(n,)`` (for FedAvg, ``w_i = n_i``, the number
    of examples of client i). Differentiable in ``x`` and in ``weights`` (learned client
    weighting); both derivatives are again federated sums and broadcasts.

    Edge cases, by definition:

    * a client with ``w_i = 0`` is left out by selection, not multiplied by zero: its value
      may be anything, NaN included (``0 · NaN`` would poison the sum), and contributes
      nothing to the value or to either derivative;
    * when every weight is zero (``sum_i w_i = 0``: nobody to average) the result is zeros,
      i.e. "no update", never ``0/0``;
    * weights must be ``>= 0``; concrete weights are checked (``ValueError``), traced ones
      cannot be and are the caller's contract (a negative total also gives zeros).
    """
    n = _num_clients(x)
    weights = jnp.asarray(weights)
    if weights.shape != (n,):
        raise ValueError(
            f"weighted_mean weights must have shape ({n},) (one per client), "
            f"got {weights.shape}."
        )
    if not isinstance(weights, jax.core.Tracer) and np.any(np.asarray(weights) < 0):
        raise ValueError(
            f"weighted_mean weights must be >= 0, got {np.asarray(weights).tolist()}; a "
            "client that should not count takes weight 0."
        )
    return divide_by_weight(sum(weighted_terms(x, weights)), sum(weights))


def weighted_terms(x: Any, weights: jax.Array) -> Any:
    """The terms of ``weighted_mean``'s numerator: ``w_i x_i`` where ``w_i > 0``, zeros
    (by selection, so a NaN there is gone) elsewhere; integer values become floats. ``x``
    client-placed with ``weights [n]``, or one client's value with its scalar weight."""
    weights = jnp.asarray(weights)
    selected = weights > 0

    def scale(leaf):
        leaf = jnp.asarray(leaf)
        dtype = jnp.promote_types(jnp.result_type(leaf, weights), jnp.float32)
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            leaf = leaf.astype(dtype)  # integer values with fractional weights
        shape = weights.shape + (1,) * (leaf.ndim - weights.ndim)
        w = weights.reshape(shape).astype(leaf.dtype)
        return jnp.where(selected.reshape(shape), leaf, jnp.zeros((), leaf.dtype)) * w

    return jax.tree.map(scale, x)


def divide_by_weight(total: Any, weight: jax.Array) -> Any:
    """``weighted_mean`` from its numerator ``total`` and the summed weights: ``total /
    weight``, or zeros (``total`` itself, which is then zero) when ``weight <= 0``."""
    # sum w_i = 0 makes every numerator term zero: divide by 1 instead of 0.
    divisor = jnp.where(weight > 0, weight, jnp.ones_like(weight))
    return jax.tree.map(lambda s: s / divisor.astype(s.dtype), total)
