"""Multinomial logistic regression: the convex model of FedProx's and SCAFFOLD's experiments.

``logits = flatten(x) W + b`` with ``W`` ``[input_dim, num_classes]`` and ``b``
``[num_classes]``; trained with the softmax cross-entropy it is multinomial logistic
regression (Li et al. 2020 use it on Synthetic(α, β), MNIST and FEMNIST; Karimireddy et al.
2020 on EMNIST). ``input_dim * num_classes + num_classes`` parameters (7,850 for MNIST).

Initialization: all zeros (the loss is convex, so nothing needs breaking symmetry, and every
seed starts from the same model, as is usual for logistic regression). The papers do not
state theirs.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

from fedax.models.base import Model, Params


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def logistic(input_dim: int = 784, num_classes: int = 10) -> Model:
    """Multinomial logistic regression, ``x [B, ...] -> logits [B, num_classes]``.

    Args:
      input_dim: the number of features per example; ``x`` may have any trailing shape with
        that many elements (e.g. ``[B, 28, 28, 1]`` for 784), it is flattened.
      num_classes: the number of classes.

    Returns:
      A ``Model`` with params ``{"dense": {"kernel": [input_dim, num_classes], "bias":
      [num_classes]}}``, initialized to zeros.
    """
    input_dim = _positive_int(input_dim, "input_dim")
    num_classes = _positive_int(num_classes, "num_classes")

    def init(key: jax.Array) -> Params:
        del key  # zeros: deterministic
        return {"dense": {"kernel": jnp.zeros((input_dim, num_classes), jnp.float32),
                          "bias": jnp.zeros((num_classes,), jnp.float32)}}

    def apply(params: Params, x: jax.Array) -> jax.Array:
        if x.ndim < 1 or math.prod(x.shape[1:]) != input_dim:
            raise ValueError(
                f"expected inputs [B, ...] with {input_dim} features per example, got "
                f"{tuple(x.shape)}"
            )
        kernel = params["dense"]["kernel"]
        h = x.reshape(x.shape[0], input_dim).astype(kernel.dtype)
        return h @ kernel + params["dense"]["bias"]

    return Model(init, apply)
