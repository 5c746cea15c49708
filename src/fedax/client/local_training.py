"""Local training on one client: masked optimizer steps over pre-cut batches.

A client's local data for a round arrives as ``Batches`` of shape ``[S, B, ...]`` (steps,
batch) with a mask: client k really takes E·⌈n_k/B⌉ steps (McMahan et al., Algorithm 1,
ClientUpdate); steps beyond that are padding (all-zero mask) and leave the parameters *and*
the optimizer state exactly unchanged, and a partial last batch averages over its real
examples only. So a client padded to more steps returns exactly the update of the unpadded
client, and clients of different sizes share one compiled program.

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
import optax

from fedax.data.byte_coded import ByteCoded

StepsStrategy = Literal["scan", "unroll"]
_STEPS = jax.make_user_context(default_value="scan")  # jit-cache sensitive


class Batches(NamedTuple):
    """One client's local batches: ``x [S, B, ...]``, ``y [S, B, ...]`` (``[S, B, T]`` for
    next-token targets), ``mask [S, B]`` (per example). ``x`` may be ``ByteCoded``; code
    that reads it outside ``local_train`` calls ``decoded(batches)`` first."""

    x: jax.Array | ByteCoded
    y: jax.Array
    mask: jax.Array


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
    return _STEPS.value


class LocalResult(NamedTuple):
    params: Any
    loss: jax.Array  # mean training loss over the real steps (before each step's update)
    num_steps: jax.Array  # number of real (unmasked) steps taken


def local_train(
    loss_fn: LossFn,
    params: Any,
    batches: Batches,
    optimizer: optax.GradientTransformation,
) -> LocalResult:
    """Run masked local steps ``w <- w - opt(∇loss(w; b))`` for each batch b in order.

    A step whose batch mask is all zero is skipped exactly (parameters and optimizer state
    are carried through unchanged). The optimizer state starts fresh each round.
    """
    opt_state = optimizer.init(params)
    # Coded features are decoded step by step, so no client's float features are ever
    # held whole (the same CNN step time as float input, alternated on one core:
    # benchmarks/bench_coded_decode.py).
    first = decoded(jax.tree.map(lambda a: a[0], batches))
    loss_type = jax.eval_shape(loss_fn, params, first)

    def step(carry, batch: Batches):
        valid = jnp.any(batch.mask > 0)

        def real(carry):
            p, s = carry
            loss, grads = jax.value_and_grad(loss_fn)(p, decoded(batch))
            updates, new_s = optimizer.update(grads, s, p)
            return (optax.apply_updates(p, updates), new_s), loss

        def skip(carry):
            return carry, jnp.zeros(loss_type.shape, loss_type.dtype)

        # A real branch: a client program that runs alone (the sequential strategy) does
        # no work for its padding steps, which matters when client sizes are skewed
        # (Shakespeare: 1 to 600 samples). Under vmap it becomes a select of both.
        carry, loss = jax.lax.cond(valid, real, skip, carry)
        return carry, (loss, valid.astype(jnp.float32))

    num_steps = batches.mask.shape[0]
    unroll = num_steps if current_steps_strategy() == "unroll" else 1
    (params, _), (losses, valid) = jax.lax.scan(
        step, (params, opt_state), batches, unroll=max(unroll, 1)
    )
    taken = jnp.sum(valid)
    return LocalResult(params, jnp.sum(losses) / jnp.maximum(taken, 1.0), taken)


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
