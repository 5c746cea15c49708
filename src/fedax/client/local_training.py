"""Local training on one client: masked optimizer steps over pre-cut batches.

A client's local data for a round arrives as ``Batches`` of shape ``[S, B, ...]`` (steps,
batch) with a mask: client k really takes E·⌈n_k/B⌉ steps (McMahan et al., Algorithm 1,
ClientUpdate); steps beyond that are padding (all-zero mask) and leave the parameters *and*
the optimizer state exactly unchanged, and a partial last batch averages over its real
examples only. So a client padded to more steps returns exactly the update of the unpadded
client, and clients of different sizes share one compiled program.

A client may also stop before its last step: with an ``EBStopping`` rule the evidence-based
criterion (``fedax.client.early_stopping``) is checked every m steps inside the same loop,
and the steps after a stop are skipped as padding is, so a round still compiles once.

How the step loop executes (``lax.scan``, or unrolled into straight-line code, which
XLA:CPU runs much faster for convolutions) is an execution strategy chosen by the runner
with ``steps_strategy``; the result is the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedax import federated as fed
from fedax.client.early_stopping import (
    EBStopping,
    eb_criterion,
    init_stop_state,
    update_stop_state,
)
from fedax.data.byte_coded import ByteCoded

StepsStrategy = Literal["scan", "unroll"]
_STEPS = jax.make_user_context(default_value="scan")  # jit-cache sensitive


class Batches(NamedTuple):
    """One client's local batches (jax or host numpy arrays): ``x [S, B, ...]``,
    ``y [S, B, ...]`` (``[S, B, T]`` for next-token targets), ``mask [S, B]`` (per
    example). ``x`` may be ``ByteCoded``; code that reads it outside ``local_train`` calls
    ``decoded(batches)`` first."""

    x: jax.Array | np.ndarray | ByteCoded
    y: jax.Array | np.ndarray
    mask: jax.Array | np.ndarray

    def client_steps(self) -> jax.Array:
        """``[C]`` real steps (a batch with a real example) of each client of client-placed
        batches (``mask [C, S, B]``): what balances devices and groups clients in lockstep
        (``fedax.federated._lockstep``)."""
        mask = jnp.asarray(self.mask)
        return jnp.sum(jnp.any(mask.reshape(*mask.shape[:2], -1) > 0, axis=-1), axis=-1)


def decoded(batches: Batches) -> Batches:
    """``batches`` with float features (``ByteCoded`` features decoded; others as given)."""
    if isinstance(batches.x, ByteCoded):
        return batches._replace(x=batches.x.decode())
    return batches


LossFn = Callable[[Any, Batches], jax.Array]
"""``loss_fn(params, batch) -> scalar``: masked mean loss over one batch (``[B, ...]``)."""


@contextlib.contextmanager
def steps_strategy(strategy: StepsStrategy) -> Iterator[None]:
    """Run local-step loops traced in this context as ``"scan"`` or ``"unroll"``."""
    if strategy not in ("scan", "unroll"):
        raise ValueError(f"unknown local-steps strategy {strategy!r}; allowed: scan, unroll.")
    with _STEPS(strategy):
        yield


def current_steps_strategy() -> StepsStrategy:
    """The local-steps strategy in effect here: ``"scan"`` or ``"unroll"`` (``steps_strategy``)."""
    return _STEPS.value


class LocalResult(NamedTuple):
    """What ``local_train`` returns: the client's params after its local steps and how it
    got there."""

    params: Any
    loss: jax.Array  # mean training loss over the real steps (before each step's update)
    num_steps: jax.Array  # number of real (unmasked) steps taken
    # with a stopping rule, the client's fedax.client.early_stopping.StopState; else None
    stopping: Any = None


def _masked_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, loss_type):
    """``step(carry, batch, allowed=None)``: one optimizer step on ``batch``, skipped exactly
    (carry unchanged, loss 0) when its mask is all zero or ``allowed`` (a traced bool, e.g.
    "not stopped") is False."""

    def step(carry, batch: Batches, allowed=None):
        valid = jnp.any(batch.mask > 0)
        if allowed is not None:
            valid = jnp.logical_and(valid, allowed)

        def real(carry):
            p, s = carry
            loss, grads = jax.value_and_grad(loss_fn)(p, decoded(batch))
            updates, new_s = optimizer.update(grads, s, p)
            return (optax.apply_updates(p, updates), new_s), loss

        def skip(carry):
            return carry, jnp.zeros(loss_type.shape, loss_type.dtype)

        # A real branch: a client program that runs alone (the sequential strategy) does
        # no work for its padding steps, which matters when client sizes are skewed
        # (Shakespeare: 1 to 600 samples). Under vmap it becomes a select of both; in a
        # lockstep group the whole group skips a step none of its clients has.
        axis = fed.lockstep_axis()
        if axis is None:
            carry, loss = jax.lax.cond(valid, real, skip, carry)
        else:
            def lanes(carry):
                (new, loss) = real(carry)
                new = jax.tree.map(lambda a, b: jnp.where(valid, a, b), new, carry)
                return new, jnp.where(valid, loss, jnp.zeros_like(loss))

            anyone = jax.lax.psum(valid.astype(jnp.int32), axis) > 0
            carry, loss = jax.lax.cond(anyone, lanes, skip, carry)
        return carry, (loss, valid.astype(jnp.float32))

    return step


def local_train(
    loss_fn: LossFn,
    params: Any,
    batches: Batches,
    optimizer: optax.GradientTransformation,
    *,
    stopping: EBStopping | None = None,
) -> LocalResult:
    """Run masked local steps ``w <- w - opt(∇loss(w; b))`` for each batch b in order.

    A step whose batch mask is all zero is skipped exactly (parameters and optimizer state
    are carried through unchanged). The optimizer state starts fresh each round.

    With ``stopping`` (``fedax.client.EBStopping``), the client also stops when the EB
    criterion of ``loss_fn`` says its gradient is noise, checked before steps m, 2m, ...
    (``fedax.client.early_stopping``): the remaining steps are skipped as padding is,
    ``num_steps`` counts the steps taken and ``stopping`` holds the ``StopState``.
    """
    opt_state = optimizer.init(params)
    # Coded features are decoded step by step, so no client's float features are ever
    # held whole (the same CNN step time as float input, alternated on one core:
    # benchmarks/bench_coded_decode.py).
    first = decoded(jax.tree.map(lambda a: a[0], batches))
    loss_type = jax.eval_shape(loss_fn, params, first)
    step = _masked_step(loss_fn, optimizer, loss_type)
    num_steps = batches.mask.shape[0]
    unroll = num_steps if current_steps_strategy() == "unroll" else 1
    if stopping is not None:
        return _stopped_train(loss_fn, step, params, opt_state, batches, stopping)
    (params, _), (losses, valid) = jax.lax.scan(
        step, (params, opt_state), batches, unroll=max(unroll, 1)
    )
    taken = jnp.sum(valid)
    return LocalResult(params, jnp.sum(losses) / jnp.maximum(taken, 1.0), taken)


def _stopped_train(loss_fn, step, params, opt_state, batches: Batches,
                   rule: EBStopping) -> LocalResult:
    """``local_train``'s loop with the EB rule: the S steps cut into ⌈S/m⌉ groups of m (the
    last padded with empty steps); before every group but the first, the criterion on the
    group's first batch at the current parameters (held constant for derivatives)."""
    num_steps = batches.mask.shape[0]
    every = min(rule.every, num_steps)
    groups = -(-num_steps // every)
    extra = groups * every - num_steps

    def cut(a):
        a = jnp.concatenate([a, jnp.zeros((extra, *a.shape[1:]), a.dtype)]) if extra else a
        return a.reshape((groups, every, *a.shape[1:]))

    grouped = jax.tree.map(cut, batches)
    unrolled = current_steps_strategy() == "unroll"

    def group(carry, inputs):
        p, s, stop = carry
        batches_g, g = inputs

        def check(stop):
            batch = decoded(jax.tree.map(lambda a: a[0], batches_g))
            least = 4 if rule.calibrated else 2  # real examples for a defined check
            enough = jnp.logical_and(~stop.stopped, jnp.sum(batch.mask > 0) >= least)
            return jax.lax.cond(
                enough,
                lambda st: update_stop_state(rule, st, eb_criterion(
                    loss_fn, jax.lax.stop_gradient(p), batch, rule.calibrated)),
                lambda st: st, stop)

        # g is the same for every client: the first group costs no check even under vmap.
        stop = jax.lax.cond(g > 0, check, lambda st: st, stop)
        (p, s), out = jax.lax.scan(lambda c, b: step(c, b, ~stop.stopped), (p, s), batches_g,
                                   unroll=every if unrolled else 1)
        return (p, s, stop), out

    (params, _, stop), (losses, valid) = jax.lax.scan(
        group, (params, opt_state, init_stop_state()), (grouped, jnp.arange(groups)),
        unroll=groups if unrolled else 1)
    taken = jnp.sum(valid)
    return LocalResult(params, jnp.sum(losses) / jnp.maximum(taken, 1.0), taken, stop)


def mean_gradient(loss_fn: LossFn, params: Any, batches: Batches) -> Any:
    """The gradient at ``params`` of the client's mean loss over its real examples,
    Σ_s m_s ∇loss(params; b_s) / Σ_s m_s (m_s the real examples of batch s; ``loss_fn`` is
    a masked mean per batch). Padding steps add nothing. One pass, looped as the local
    steps are (``steps_strategy``). SCAFFOLD's Option I control variate."""

    def step(acc, batch: Batches):
        m = jnp.sum(batch.mask)
        g = jax.grad(loss_fn)(params, decoded(batch))
        new = jax.tree.map(lambda a, gi: a + m.astype(gi.dtype) * gi, acc, g)
        return jax.tree.map(lambda n, a: jnp.where(m > 0, n, a), new, acc), m

    zeros = jax.tree.map(jnp.zeros_like, params)
    num_steps = batches.mask.shape[0]
    unroll = num_steps if current_steps_strategy() == "unroll" else 1
    total, ms = jax.lax.scan(step, zeros, batches, unroll=max(unroll, 1))
    count = jnp.maximum(jnp.sum(ms), 1.0)
    return jax.tree.map(lambda t: t / count.astype(t.dtype), total)
