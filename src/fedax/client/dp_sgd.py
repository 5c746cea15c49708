"""Example-level DP-SGD in local training (Abadi et al., CCS 2016, Algorithm 1): a client
trains privately on its own device, the record-level setting.

Each real local step replaces the batch gradient by

    g̃ = ( Σ_{i real} clip(∇ℓ_i(w), C) + N(0, (z·C)² I) ) / B,
    clip(g, C) = g · min(1, C / ‖g‖₂)   (‖·‖₂ the global L2 norm over every leaf)

and hands g̃ to the client optimizer, as ``local_train`` hands it the plain gradient:

* ``ℓ_i`` is the *per-example loss*: ``loss_fn`` on a batch of one, the example's own
  ``x[None]``, ``y[None]``, ``mask[None]``. ``loss_fn`` must therefore be a masked mean of
  per-example terms (no batch statistics); each sequence of a next-token batch is one
  example, its loss the mean over its own tokens.
* Masks are 0/1. A masked (padding) example contributes nothing to the sum and is not
  counted in the loss; a non-finite per-example gradient is zeroed before clipping (as
  jax-privacy's ``nan_safe``), so no single example can make the update non-finite.
* The denominator is the batch's *configured* size B (``mask.shape[-1]``), never the
  number of real examples: DP-SGD's fixed denominator (Abadi et al. 2016, "lot size"), so
  one example moves g̃ by at most C/B whatever the rest of the batch is. A partial last
  batch of m < B real examples is therefore scaled by m/B relative to ``local_train``.
* Noise: step s (its position in ``[0, S)``) draws from ``fold_in(key, s)``, leaf j of the
  parameter pytree (flatten order) from ``split(fold_in(key, s), num_leaves)[j]`` with
  ``jax.random.normal``. With z = 0 the noise is exactly zero (no privacy: a test mode).
* A padding step (all-zero mask) is skipped exactly, as in ``local_train``: parameters and
  optimizer state unchanged, no noise. Keys are folded by step position, so no real step's
  key depends on how many padding steps follow: a client padded to more steps returns
  bit-identically the update of the unpadded client.

Privacy: each real step is a Gaussian mechanism on the sum of clipped gradients with noise
multiplier z (L2 sensitivity C for adding or removing one example, 2C for replacing one).
Which (ε, δ) follows depends on how batches are formed (Abadi et al.'s amplification
assumes Poisson sampling; fedax cuts shuffled epochs), and accounting is not done here.
``key`` must be the client's own secret randomness: whoever knows it can subtract the
noise. The returned mean training loss is not privatized.

The step loop executes as ``local_train``'s does (``steps_strategy``: scan or unroll; under
``vmap`` the padding branch becomes a select). Everything is plain JAX, so the result can be
differentiated in forward and reverse mode like ``local_train``'s.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedax.client.local_training import (
    Batches,
    LocalResult,
    LossFn,
    current_steps_strategy,
    decoded,
)


def _check(l2_clip: float | jax.Array, noise_multiplier: float | jax.Array) -> None:
    if isinstance(l2_clip, numbers.Real) and not l2_clip > 0:
        raise ValueError(f"DP-SGD needs l2_clip > 0, got {l2_clip!r}.")
    if isinstance(noise_multiplier, numbers.Real) and not noise_multiplier >= 0:
        raise ValueError(f"DP-SGD needs noise_multiplier >= 0, got {noise_multiplier!r}.")


def _tree_normal(key: jax.Array, tree: Any) -> Any:
    """Standard normal noise shaped like ``tree``: leaf j from ``split(key, n)[j]``."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    noise = [jax.random.normal(k, jnp.shape(x), jnp.result_type(x))
             for k, x in zip(keys, leaves, strict=True)]
    return jax.tree.unflatten(treedef, noise)


def dp_gradient(
    loss_fn: LossFn,
    params: Any,
    batch: Batches,
    *,
    l2_clip: float | jax.Array,
    noise_multiplier: float | jax.Array,
    key: jax.Array,
) -> tuple[jax.Array, Any]:
    """One batch's DP-SGD gradient ``(Σ_real clip(∇ℓ_i, C) + N(0, (zC)²)) / B``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, a masked mean; ``ℓ_i`` is it on a
        batch of one (see the module docstring).
      params: the parameters w.
      batch: one batch ``[B, ...]`` with float features (``decoded``) and a 0/1 mask.
      l2_clip: C > 0, the bound on each example's gradient norm.
      noise_multiplier: z ≥ 0; the noise on the sum has standard deviation z·C.
      key: the noise key, used as is (``dp_local_train`` folds in the step).

    Returns:
      ``(loss, grad)``: the mean per-example loss over the real examples (0 if none) and
      the privatized gradient, shaped like ``params``.
    """
    _check(l2_clip, noise_multiplier)
    size = batch.mask.shape[0]

    def example_loss(p, example):
        return loss_fn(p, jax.tree.map(lambda a: a[None], example))

    losses, grads = jax.vmap(jax.value_and_grad(example_loss), in_axes=(None, 0))(
        params, batch
    )
    grads = jax.tree.map(lambda g: jnp.where(jnp.isfinite(g), g, 0), grads)
    sq = sum(jnp.sum(jnp.square(g).reshape(size, -1), axis=1) for g in jax.tree.leaves(grads))
    # Zero norms (padding examples) never reach sqrt or the division: their derivative
    # would be inf · 0 = NaN in reverse mode.
    nonzero = sq > 0
    norms = jnp.sqrt(jnp.where(nonzero, sq, 1.0))
    real = batch.mask > 0
    scale = jnp.where(nonzero, jnp.minimum(1.0, l2_clip / norms), 1.0)
    weights = jnp.where(real, scale, 0.0)
    total = jax.tree.map(lambda g: jnp.tensordot(weights.astype(g.dtype), g, axes=1), grads)
    std = noise_multiplier * l2_clip
    noise = _tree_normal(key, total)
    total = jax.tree.map(lambda t, n: t + (std * n).astype(t.dtype), total, noise)
    grad = jax.tree.map(lambda t: t / size, total)
    count = jnp.sum(real)
    loss = jnp.sum(jnp.where(real, losses, 0)) / jnp.maximum(count, 1).astype(losses.dtype)
    return loss, grad


def dp_local_train(
    loss_fn: LossFn,
    params: Any,
    batches: Batches,
    optimizer: optax.GradientTransformation,
    *,
    l2_clip: float | jax.Array,
    noise_multiplier: float | jax.Array,
    key: jax.Array,
) -> LocalResult:
    """``local_train`` with DP-SGD gradients: masked local steps
    ``w <- w - opt(dp_gradient(w; b_s, fold_in(key, s)))`` for each batch ``b_s`` in order.

    Args:
      loss_fn, params, batches, optimizer: as for ``local_train``; the optimizer state
        starts fresh, and padding steps are skipped exactly (no noise either).
      l2_clip: C > 0, each example's gradient is clipped to global L2 norm C.
      noise_multiplier: z ≥ 0; each real step adds N(0, (zC)²) to the clipped sum before
        dividing by the configured batch size B.
      key: the client's own secret noise key; step s uses ``fold_in(key, s)``.

    Returns:
      ``LocalResult(params, loss, num_steps)``: loss is the mean over real steps of each
      step's mean per-example loss (before its update), num_steps the real steps taken.
    """
    _check(l2_clip, noise_multiplier)
    opt_state = optimizer.init(params)
    first = decoded(jax.tree.map(lambda a: a[0], batches))
    loss_type = jax.eval_shape(loss_fn, params, first)

    def step(carry, inputs):
        batch, s = inputs
        valid = jnp.any(batch.mask > 0)

        def real(carry):
            p, st = carry
            loss, grads = dp_gradient(
                loss_fn, p, decoded(batch), l2_clip=l2_clip,
                noise_multiplier=noise_multiplier, key=jax.random.fold_in(key, s),
            )
            updates, new_st = optimizer.update(grads, st, p)
            return (optax.apply_updates(p, updates), new_st), loss.astype(loss_type.dtype)

        def skip(carry):
            return carry, jnp.zeros(loss_type.shape, loss_type.dtype)

        carry, loss = jax.lax.cond(valid, real, skip, carry)
        return carry, (loss, valid.astype(jnp.float32))

    num_steps = batches.mask.shape[0]
    unroll = num_steps if current_steps_strategy() == "unroll" else 1
    (params, _), (losses, valid) = jax.lax.scan(
        step, (params, opt_state), (batches, jnp.arange(num_steps)), unroll=max(unroll, 1)
    )
    taken = jnp.sum(valid)
    return LocalResult(params, jnp.sum(losses) / jnp.maximum(taken, 1.0), taken)
