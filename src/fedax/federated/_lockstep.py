"""Where and beside whom a client runs: devices balanced by work, clients in lockstep.

Clients of a natural partition differ in local steps by orders of magnitude (Shakespeare's
roles: 1 to 600 samples). Two execution forms of ``map_clients`` use each client's number
of real steps, read from an argument that has a ``client_steps()`` method (a client-placed
``fedax.client.Batches``), and change only where a client runs and beside which clients,
never what it computes or its position in the cohort: outputs come back in cohort order,
so keys, reduction order and results are the plain strategy's.

* **Balanced devices** (on by default over a mesh's ``clients`` axis): the cohort is cut
  into d blocks of equal count whose total steps are close, by dealing the clients,
  heaviest first, to the devices in serpentine order (0, 1, ..., d-1, d-1, ..., 0, ...), a
  greedy longest-processing-time rule under the equal-count constraint. Contiguous blocks
  of a random sample leave one core idle for the difference of two random sums. Moving a
  client copies its inputs and outputs between devices, so clients move only when the
  busiest contiguous block has over 5% more steps than the busiest balanced one
  (``worth_moving``), and a broadcast argument (the model, the same at every client) is
  never moved. The runner decides this on the host from the round's masks
  (``worth_moving_host``, ``decided_moves``) and compiles a program that moves or one that
  does not; a round traced without that decision decides in the program, by a
  ``lax.cond`` per moved argument, which costs copies of what it might move (measured: a
  third of a cross-device round of 1,000 clients; ``benchmarks/bench_fused_sum.py``).
* **Lockstep** (map strategy ``"lockstep"``): the clients sorted by steps, in groups of
  ``width`` run as one vectorized program (``vmap``) one group after another; a local step
  is skipped for the whole group when no client of the group has a real batch left
  (``lockstep_axis``: the masked step asks the group with a ``psum`` over the vmap axis),
  so a group costs its longest client's steps, not the cohort's. This is the form for
  accelerators, where one client's ``[10, 256] x [256, 1024]`` products leave the device
  idle; padding every client to the longest one (plain ``vmap``) costs the cohort's
  largest step count for every client.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

LOCKSTEP_AXIS = "lockstep_clients"
DEFAULT_WIDTH = 16

# jit-cache sensitive contexts: a change retraces.
_AXIS = jax.make_user_context(default_value=None)
_BALANCE = jax.make_user_context(default_value=True)
_WIDTH = jax.make_user_context(default_value=DEFAULT_WIDTH)
_MOVES = jax.make_user_context(default_value=None)


def lockstep_axis() -> str | None:
    """The vmap axis of the lockstep group being traced (None outside one): a per-client
    loop skips a step for the whole group when ``psum(valid, axis) == 0``."""
    return _AXIS.value


@contextlib.contextmanager
def lockstep_width(width: int) -> Iterator[None]:
    """Clients per lockstep group while tracing here (default 16)."""
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"lockstep width must be a positive int, got {width!r}.")
    with _WIDTH(width):
        yield


@contextlib.contextmanager
def balance_devices(on: bool) -> Iterator[None]:
    """Whether ``map_clients`` over a mesh balances the devices' steps (default True);
    False keeps contiguous blocks (to measure what balancing gains)."""
    with _BALANCE(bool(on)):
        yield


def balancing() -> bool:
    return _BALANCE.value


@contextlib.contextmanager
def decided_moves(move: bool | None) -> Iterator[None]:
    """While tracing here, balancing devices moves clients (True) or does not (False)
    without deciding in the program; None (the default) decides in it. The runner passes
    ``worth_moving_host`` of each round's steps, so a run compiles at most two programs,
    each free of the other's copies. Moving changes no number (module docstring)."""
    with _MOVES(None if move is None else bool(move)):
        yield


def moves_decided() -> bool | None:
    return _MOVES.value


def client_steps(xs: Any) -> jax.Array | None:
    """``[C]`` real steps of each client, from the first argument in ``xs`` with a
    ``client_steps()`` method; None when there is none."""
    def has(node):
        return hasattr(node, "client_steps")

    for node in jax.tree.leaves(xs, is_leaf=has):
        if has(node):
            return node.client_steps()
    return None


def balanced_permutation(steps: jax.Array, devices: int) -> jax.Array:
    """``perm [C]``: ``xs[perm]`` cut into ``devices`` contiguous blocks of C/d clients
    has near-equal total steps per block: clients sorted heaviest first are dealt in
    serpentine order, the i-th dealt in round r = i // d goes to device r even ? j : d-1-j
    (j = i % d) at place r of its block."""
    n = steps.shape[0]
    order = jnp.argsort(-steps, stable=True)
    dealt = jnp.arange(n)
    rnd, j = dealt // devices, dealt % devices
    device = jnp.where(rnd % 2 == 0, j, devices - 1 - j)
    slot = device * (n // devices) + rnd
    return jnp.zeros(n, order.dtype).at[slot].set(order)


WORTH_MOVING = 1.05


def worth_moving(steps: jax.Array, perm: jax.Array, devices: int) -> jax.Array:
    """Whether balanced blocks are worth moving clients for (a traced bool): the busiest
    contiguous block has more than ``WORTH_MOVING`` (5%) more steps than the busiest
    balanced one. Below that, the copies of the clients' inputs and outputs between devices
    cost more than the idle time they save (a cross-device round of 1,000 2NN clients of
    2-10 steps: contiguous blocks within 2% of each other, and moving the clients' features
    and updates doubled the round; ``benchmarks/profile_cross_device.py``)."""
    def busiest(s):
        return jnp.max(jnp.sum(s.reshape(devices, -1), axis=1))

    return busiest(steps) > WORTH_MOVING * busiest(jnp.take(steps, perm))


def host_steps(mask: np.ndarray) -> np.ndarray:
    """``[C]`` real steps of each client from host batches' ``mask [C, S, B, ...]`` (what
    ``fedax.client.Batches.client_steps`` computes in the program)."""
    mask = np.asarray(mask)
    return np.sum(np.any(mask.reshape(*mask.shape[:2], -1) > 0, axis=-1), axis=-1)


def worth_moving_host(steps: np.ndarray, devices: int) -> bool:
    """``worth_moving`` of ``balanced_permutation`` on the host (NumPy), for the runner's
    ``decided_moves``: the same serpentine deal, the same 5% rule."""
    steps = np.asarray(steps, np.int64)
    n = steps.shape[0]
    if devices < 2 or n % devices:
        return False
    dealt = np.arange(n)
    rnd, j = dealt // devices, dealt % devices
    device = np.where(rnd % 2 == 0, j, devices - 1 - j)
    ordered = steps[np.argsort(-steps, kind="stable")]
    balanced = np.bincount(device, weights=ordered, minlength=devices).max()
    contiguous = steps.reshape(devices, -1).sum(axis=1).max()
    return bool(contiguous > WORTH_MOVING * balanced)


def inverse(perm: jax.Array) -> jax.Array:
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))


def lockstep_map(f: Callable[..., Any], xs: tuple) -> Any:
    """``out[i] = f(*xs[i])`` with the clients in lockstep groups (module docstring)."""
    leaves = jax.tree.leaves(xs)
    n = leaves[0].shape[0]
    width = min(_WIDTH.value, n)
    steps = client_steps(xs)
    order = jnp.arange(n) if steps is None else jnp.argsort(-steps, stable=True)
    pad = -n % width  # filled with the lightest client again; its outputs are dropped
    if pad:
        order = jnp.concatenate([order, jnp.full((pad,), order[-1], order.dtype)])
    groups = (n + pad) // width
    grouped = jax.tree.map(
        lambda a: jnp.take(a, order, axis=0).reshape(groups, width, *a.shape[1:]), xs)
    with _AXIS(LOCKSTEP_AXIS):
        out = jax.lax.map(lambda g: jax.vmap(f, axis_name=LOCKSTEP_AXIS)(*g), grouped)
    back = inverse(order[:n])
    return jax.tree.map(
        lambda a: jnp.take(a.reshape(groups * width, *a.shape[2:]), back, axis=0), out)
