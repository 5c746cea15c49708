"""Classification losses and metrics, masked for padded examples.

With a 0/1 ``mask`` over examples, a metric is the masked mean
``sum_i mask_i * v_i / max(sum_i mask_i, 1)``: padded examples count for nothing, and an
all-padding batch gives exactly 0 (and a zero gradient), never NaN. Masked-out examples
must still have finite logits (padding inputs with zeros guarantees it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

# Labels and masks: jax arrays, or the host numpy arrays of ``Batches``.
_Array = jax.Array | np.ndarray


def per_example_cross_entropy(logits: jax.Array, labels: _Array) -> jax.Array:
    """``-log softmax(logits)[label]`` per example: ``[..., K]``, ``[...]`` -> ``[...]``."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def masked_mean(values: jax.Array, mask: _Array | None = None) -> jax.Array:
    """``sum(mask * values) / max(sum(mask), 1)``; the plain mean when ``mask`` is None."""
    if mask is None:
        return jnp.mean(values)
    mask = jnp.asarray(mask).astype(values.dtype)
    # where() keeps a masked-out non-finite value out of the sum.
    total = jnp.sum(jnp.where(mask != 0, values, 0) * mask)
    return total / jnp.maximum(jnp.sum(mask), 1)


def softmax_cross_entropy(
    logits: jax.Array, labels: _Array, mask: _Array | None = None
) -> jax.Array:
    """Mean softmax cross-entropy over the (unmasked) examples.

    Args:
        logits: ``[..., K]`` float.
        labels: ``[...]`` integer class ids.
        mask: optional ``[...]`` 0/1 (or bool) weights; 0 marks padding.

    Returns:
        A scalar: ``sum_i m_i * CE_i / max(sum_i m_i, 1)``.
    """
    return masked_mean(per_example_cross_entropy(logits, labels), mask)


def accuracy(logits: jax.Array, labels: _Array, mask: _Array | None = None) -> jax.Array:
    """Fraction of (unmasked) examples with ``argmax(logits) == label``; 0 if none."""
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(logits.dtype)
    return masked_mean(correct, mask)


def _token_weights(labels: _Array, mask: _Array | None, pad_id: int) -> jax.Array:
    """Float weights ``[..., T]``: 1 for a non-pad target of a real (unmasked) sequence."""
    weights = (labels != pad_id).astype(jnp.float32)
    if mask is not None:
        weights = weights * (jnp.asarray(mask) != 0).astype(jnp.float32)[..., None]
    return weights


def token_cross_entropy(
    logits: jax.Array, labels: _Array, mask: _Array | None = None, pad_id: int = 0
) -> jax.Array:
    """Mean next-token cross-entropy over the non-pad targets of the real sequences.

    Args:
        logits: ``[..., T, V]`` float.
        labels: ``[..., T]`` integer token ids; ``pad_id`` marks padding.
        mask: optional ``[...]`` 0/1 (or bool) per sequence; 0 marks a padded sequence.
        pad_id: The padding id, ignored wherever it is the target.

    Returns:
        A scalar: ``sum_t w_t * CE_t / max(sum_t w_t, 1)`` with ``w_t = mask * (label_t !=
        pad_id)``; exactly 0 (zero gradient) when nothing is real.
    """
    return masked_mean(
        per_example_cross_entropy(logits, labels), _token_weights(labels, mask, pad_id)
    )


def token_accuracy(
    logits: jax.Array, labels: _Array, mask: _Array | None = None, pad_id: int = 0
) -> jax.Array:
    """Fraction of non-pad targets of real sequences with ``argmax(logits) == label``.

    The Shakespeare metric of McMahan et al. (next-character accuracy); arguments as in
    :func:`token_cross_entropy`.
    """
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return masked_mean(correct, _token_weights(labels, mask, pad_id))
