"""The model interface: a pair of pure functions over a params pytree."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

Params = Any
"""A model's parameters: a pytree (plain nested dicts) of float32 arrays."""


class Model(NamedTuple):
    """A model as two pure functions.

    Attributes:
        init: ``init(key) -> params``; deterministic in ``key``.
        apply: ``apply(params, x) -> logits``; ``x`` has a leading batch axis.
    """

    init: Callable[[jax.Array], Params]
    apply: Callable[[Params, jax.Array], jax.Array]


def param_count(params: Params) -> int:
    """Number of scalars in a params pytree (the sum of its leaves' sizes)."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(params))
