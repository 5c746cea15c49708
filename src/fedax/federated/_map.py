"""``map_clients``, how it executes (``map_strategy``: vmap, sequential, unroll, lockstep,
or a ``ClientMapper`` such as worker processes; over a ``clients`` mesh, one block per
device, balanced by steps), and ``map_and_sum``, the map whose per-client addends are
summed at the server as they are made. Communication itself is ``_primitives``'."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Literal, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from fedax.federated import _lockstep, _primitives
from fedax.federated._primitives import (
    CLIENTS_AXIS,
    _check_divisible,
    _clients_mesh,
    _constrain_clients,
    _num_clients,
    _place,
)

# --------------------------------------------------------------------------------------
# map_clients and its execution strategy.
# --------------------------------------------------------------------------------------

MapStrategy = Literal["vmap", "sequential", "unroll", "lockstep"]
# A jit-cache-sensitive context: a function traced under one strategy is retraced under
# another, never silently reused.
_MAP_STRATEGY = jax.make_user_context(default_value="vmap")
_MAP_STRATEGIES = ("vmap", "sequential", "unroll", "lockstep")


class ClientMapper(Protocol):
    """An executor for ``map_clients`` outside the built-in strategies (for example
    ``fedax.simulation.processes.ClientProcesses``): ``map_clients(f, xs)`` returns what
    ``jax.lax.map(lambda a: f(*a), xs)`` would, traced inside the calling program."""

    def map_clients(self, f: Callable[..., Any], xs: tuple) -> Any: ...


@contextlib.contextmanager
def map_strategy(strategy: MapStrategy | ClientMapper) -> Iterator[None]:
    """Choose how ``map_clients`` executes while tracing inside this context.

    * ``"vmap"``: vectorized over the clients axis (the fast form on GPUs/TPUs; with a
      ``clients`` mesh axis it is SPMD-partitioned over devices);
    * ``"sequential"``: ``lax.map``, one client after another in a compiled loop (memory
      proportional to one client);
    * ``"unroll"``: one straight-line copy of the client program per client (XLA:CPU runs
      convolutions much faster outside loops);
    * ``"lockstep"``: clients sorted by their real local steps, ``vmap`` over groups of
      similar clients one group after another, each group stopping at its longest client
      (``fedax.federated.lockstep_width``; see ``fedax.federated._lockstep``);
    * a ``ClientMapper`` object: ``map_clients`` is handed to it (the ``processes``
      strategy of ``fedax.simulation`` runs blocks of clients in worker processes).

    All strategies compute the same function; only speed and memory differ. The runner
    picks one per backend and model; algorithms never do. A jitted function captures the
    strategy; tracing caches are keyed on it, so a change of strategy retraces.
    """
    if not hasattr(strategy, "map_clients") and strategy not in _MAP_STRATEGIES:
        raise ValueError(
            f"unknown map strategy {strategy!r}; allowed: {_MAP_STRATEGIES} or an object "
            "with a map_clients(f, xs) method."
        )
    with _MAP_STRATEGY(strategy):
        yield


def current_map_strategy() -> MapStrategy | ClientMapper:
    return _MAP_STRATEGY.value


def _closes_over_tracers(f: Callable[..., Any], xs: tuple) -> bool:
    """Whether ``f`` (traced on one client's arguments) closes over values a derivative
    may perturb: tracers of an outer ``jit``, ``jvp`` or ``grad`` (a client learning rate
    being learned), which ``jax.closure_convert`` would hoist. A ``custom_jvp`` cannot be
    differentiated in what it closes over, so the read-once and fused forms, which are
    ``custom_jvp``s, are used only when this is False; a trace that fails here counts as
    True (the plain form then runs, and fails or not as it would have)."""
    row = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)),
                       xs)
    try:
        _, consts = jax.closure_convert(lambda *args: f(*args), *row)
    except Exception:  # noqa: BLE001 - any failure: take the plain form
        return True
    return bool(consts)


def _sequential(f: Callable[..., Any], xs: tuple, same_rows: tuple[bool, ...] | None) -> Any:
    """``lax.map`` over the clients. An argument made by ``broadcast`` (``same_rows``: one
    flag per leaf of ``xs``) is read once, as its first row, rather than row by row, so
    XLA never builds the ``[n, ...]`` copy of the model (a slice of a broadcast folds to
    its operand). Derivatives take the plain form (a ``custom_jvp`` whose rule is the
    row-by-row map), so in either mode a derivative's per-client values still meet at the
    federated ``sum`` that transposes the ``broadcast``, as the FAD closure and the
    privacy and secure-sum audits require. When ``f`` closes over tracers (which a
    ``custom_jvp`` cannot be differentiated in) the plain form runs
    (``_closes_over_tracers``)."""
    leaves, tree = jax.tree.flatten(xs)

    def plain(*leaves):
        return jax.lax.map(lambda args: f(*args), jax.tree.unflatten(tree, leaves))

    if same_rows is None or len(same_rows) != len(leaves) or not any(same_rows) \
            or all(same_rows) or _closes_over_tracers(f, xs):
        return plain(*leaves)

    @jax.custom_jvp
    def fused(*leaves):
        firsts = [a[0] if same else None for a, same in zip(leaves, same_rows, strict=True)]
        rows = [a for a, same in zip(leaves, same_rows, strict=True) if not same]

        def one(row):
            it = iter(row)
            return f(*jax.tree.unflatten(tree, [a if same else next(it) for a, same in
                                                zip(firsts, same_rows, strict=True)]))

        return jax.lax.map(one, rows)

    @fused.defjvp
    def _(primals, tangents):
        return jax.jvp(plain, primals, tangents)

    return fused(*leaves)


def _map_local(f: Callable[..., Any], xs: tuple, strategy: MapStrategy | ClientMapper,
               same_rows: tuple[bool, ...] | None = None) -> Any:
    if not isinstance(strategy, str):
        return strategy.map_clients(f, xs)
    if strategy == "vmap":
        return jax.vmap(f)(*xs)
    if strategy == "sequential":
        return _sequential(f, xs, same_rows)
    if strategy == "lockstep":
        return _lockstep.lockstep_map(f, xs)
    outs = [f(*jax.tree.map(lambda a, i=i: a[i], xs)) for i in range(_num_clients(xs))]
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *outs)


def map_clients(f: Callable[..., Any], *xs: Any) -> Any:
    """Apply ``f`` to every client: ``out[i] = f(xs[0][i], xs[1][i], ...)``.

    Every argument is client-placed (leading clients axis). Server values must be placed
    with ``broadcast`` first, so that their communication and derivatives are federated.
    Derivatives are per client. Execution follows ``map_strategy``.

    Under a mesh with a ``clients`` axis of size d, the clients are split into d equal
    blocks, one per device (``shard_map``), and each device runs the strategy over its own
    block. The number of clients must then be a multiple of d (the runner pads cohorts with
    empty clients of weight zero). When an argument tells each client's real steps
    (``fedax.client.Batches``), the blocks are balanced by steps, not contiguous: the
    clients move between devices before the map and back after it, so outputs, and all that
    follows, are in cohort order (``fedax.federated.balance_devices``). They move only when
    the contiguous blocks are more than 5% uneven, and broadcast arguments never move.
    """
    if not xs:
        raise ValueError("map_clients needs at least one client-placed argument.")
    n = _num_clients(xs)
    strategy = current_map_strategy()
    mesh = _clients_mesh()
    same_rows = tuple(_primitives.broadcast_source(a) is not None for a in jax.tree.leaves(xs))
    if mesh is None:
        return _map_local(f, xs, strategy, same_rows)
    _check_divisible(n, mesh)
    _refuse_outside_mesh(strategy)
    return _on_mesh(lambda *blocks: _map_local(f, blocks, strategy, same_rows), xs,
                    same_rows, mesh, summed=False)


def _refuse_outside_mesh(strategy: MapStrategy | ClientMapper) -> None:
    if not isinstance(strategy, str):
        raise ValueError(
            f"map strategy {strategy!r} runs clients outside the JAX program and cannot be "
            f"combined with a '{CLIENTS_AXIS}' device mesh; use one device, or a built-in "
            f"strategy {_MAP_STRATEGIES} on the mesh."
        )


def _on_mesh(local: Callable[..., Any], xs: tuple, same_rows: tuple[bool, ...], mesh,
             *, summed: bool) -> Any:
    """``local`` on each device's block of clients (``shard_map``), the blocks balanced by
    steps when that pays (``map_clients``). With ``summed``, ``local`` returns ``(kept,
    total)``, ``total`` already summed over all devices (server-placed): only ``kept``
    returns to cohort order."""
    spec = PartitionSpec(CLIENTS_AXIS)
    sharded = jax.shard_map(local, in_specs=spec,
                            out_specs=(spec, PartitionSpec()) if summed else spec,
                            check_vma=False)
    steps = _lockstep.client_steps(xs) if _lockstep.balancing() else None
    devices = mesh.shape[CLIENTS_AXIS]
    decided = _lockstep.moves_decided()
    if steps is None or devices == 1 or decided is False:
        return sharded(*_constrain_clients(xs))
    steps = _place(steps, mesh, PartitionSpec())
    perm = _lockstep.balanced_permutation(steps, devices)

    def take(a, order):
        return _place(jnp.take(_place(a, mesh, PartitionSpec()), order, axis=0), mesh, spec)

    if decided:
        def move(a, order):
            return take(_place(a, mesh, spec), order)
    else:
        # Moving clients costs copies of their inputs and outputs; it is done only when
        # the contiguous blocks are uneven enough to pay for it (``worth_moving``).
        worth = _lockstep.worth_moving(steps, perm, devices)

        def move(a, order):
            return jax.lax.cond(worth, take, lambda a, order: a, _place(a, mesh, spec),
                                order)

    leaves, tree = jax.tree.flatten(xs)
    # the rows of a broadcast are all the same: nothing to move
    moved = [a if same else move(a, perm) for a, same in zip(leaves, same_rows, strict=True)]
    out = sharded(*jax.tree.unflatten(tree, moved))
    back = _lockstep.inverse(perm)
    if summed:
        kept, total = out
        return jax.tree.map(lambda a: move(a, back), kept), total
    return jax.tree.map(lambda a: move(a, back), out)


# --------------------------------------------------------------------------------------
# map_and_sum: a map whose per-client addends go straight into a federated sum.
# --------------------------------------------------------------------------------------


# A jit-cache-sensitive context, as the map strategy: whether ``map_and_sum`` fuses.
_FUSE_SUMS = jax.make_user_context(default_value=True)


@contextlib.contextmanager
def fuse_sums(on: bool) -> Iterator[None]:
    """Whether ``map_and_sum`` under ``sequential`` sums each client's addend as it is made
    (default True); False stacks the addends and sums them after the map, the definition
    as written (to measure what fusing gains: ``benchmarks/bench_fused_sum.py``)."""
    with _FUSE_SUMS(bool(on)):
        yield


def map_and_sum(f: Callable[..., Any], *xs: Any) -> tuple[Any, Any]:
    """``map_clients`` of ``f``, whose result is a pair ``(kept, addend)`` per client, with
    the addends summed at the server: returns ``(kept, sum(addend))``, by definition

        out = map_clients(f, *xs);  (out[0], sum(out[1]))

    (``kept`` client-placed ``[n, ...]``, the sum server-placed). Under the ``sequential``
    strategy the addends are never stacked: each client's addend goes up as it is made
    (``sum`` of that one client), and the server adds it to its running total in the
    loop's carry, so a round needs one model-sized total instead of ``[n, P]`` updates
    (``benchmarks/bench_fused_sum.py``). Over a ``clients`` mesh each device keeps the
    total of its own block, and the d totals are added once. Other strategies compute the
    definition as written. The sum runs in another order than the stacked one, so the two
    agree to float rounding (README, "The numerical guarantee").

    Derivatives, in either mode, are those of the definition (a ``custom_jvp`` whose rule
    is the stacked program), so a derivative's per-client values still meet at the
    federated ``sum`` and ``broadcast`` that the FAD closure and the privacy and secure
    audits read; only primal rounds run the fused loop. A client function that closes over
    tracers (a hyperparameter being differentiated; a custom_jvp cannot be differentiated
    in what it closes over) takes the stacked form.
    """
    if not xs:
        raise ValueError("map_and_sum needs at least one client-placed argument.")
    n = _num_clients(xs)
    strategy = current_map_strategy()
    mesh = _clients_mesh()
    leaves, tree = jax.tree.flatten(xs)

    def stacked(*leaves):
        kept, addends = _pair(map_clients(f, *jax.tree.unflatten(tree, leaves)))
        return kept, _primitives.sum(addends)

    if strategy != "sequential" or not _FUSE_SUMS.value or _closes_over_tracers(f, xs):
        return stacked(*leaves)
    same_rows = tuple(_primitives.broadcast_source(a) is not None for a in leaves)
    if mesh is not None:
        _check_divisible(n, mesh)

    @jax.custom_jvp
    def fused(*leaves):
        xs = jax.tree.unflatten(tree, leaves)
        if mesh is None:
            return _fused_local(f, xs, same_rows, across=None)
        return _on_mesh(lambda *blocks: _fused_local(f, blocks, same_rows,
                                                     across=CLIENTS_AXIS),
                        xs, same_rows, mesh, summed=True)

    @fused.defjvp
    def _(primals, tangents):
        return jax.jvp(stacked, primals, tangents)

    return fused(*leaves)


def _pair(out: Any) -> tuple[Any, Any]:
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError("map_and_sum's function must return a pair (kept, addend), got "
                        f"{type(out).__name__}.")
    return out


def _fused_local(f: Callable[..., Any], xs: tuple, same_rows: tuple[bool, ...],
                 across: str | None) -> tuple[Any, Any]:
    """One block of clients, one after another (``lax.scan``): each client's ``kept`` is
    stacked, its addend goes up with ``sum`` (one client's share) and joins the running
    total. Broadcast arguments are read once, as in ``_sequential``. ``across``: the mesh
    axis whose devices' totals are then added (``psum``)."""
    leaves, tree = jax.tree.flatten(xs)
    n = _num_clients(xs)
    firsts = [a[0] if same else None for a, same in zip(leaves, same_rows, strict=True)]
    rows = [a for a, same in zip(leaves, same_rows, strict=True) if not same]

    def one(row):
        it = iter(row)
        args = [a if same else next(it) for a, same in zip(firsts, same_rows, strict=True)]
        kept, addend = _pair(f(*jax.tree.unflatten(tree, args)))
        return kept, _primitives.sum(jax.tree.map(lambda a: jnp.asarray(a)[None], addend))

    _, uploaded = jax.eval_shape(one, [a[0] for a in rows])

    def step(total, row):
        kept, up = one(row)
        return jax.tree.map(jnp.add, total, up), kept

    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), uploaded)
    total, kept = jax.lax.scan(step, zeros, rows, length=n)
    if across is not None:
        total = jax.lax.psum(total, across)
    return kept, total
