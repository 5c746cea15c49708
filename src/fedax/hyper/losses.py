"""Holdout losses for hypergradients: objectives other than the training loss.

:func:`soft_error` is ``1 − p_y``, the expected 0-1 loss of the model's predictive
distribution: bounded, and linear in p, so on a population where most labels are right it
is minimized by the confident majority answer (cross-entropy, a proper scoring rule, instead
rewards hedging toward wrong labels). The FAD client-weights experiment
(``fedax.reproduce.hooks.fad_client_weights``) uses it as a holdout objective of
``fedax.hyper.learned_client_weights``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from fedax.models import masked_mean


def soft_error(apply: Callable) -> Callable:
    """The holdout loss ``1 − p_y`` (masked mean over the batch) of model ``apply``."""

    def loss(params, batch):
        p = jax.nn.softmax(apply(params, batch.x).astype(jnp.float32))
        p_y = jnp.take_along_axis(p, batch.y[:, None], axis=-1)[:, 0]
        return masked_mean(1.0 - p_y, batch.mask)

    return loss
