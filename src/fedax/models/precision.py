"""Mixed precision: a model computed in bfloat16 with float32 master weights.

``mixed_precision(model)`` keeps ``init`` (float32 parameters, the weights the optimizer
updates and the server averages) and runs ``apply`` on bfloat16 copies of the parameters
and of floating-point inputs, returning float32 logits::

    apply_bf16(w, x) = float32(apply(bf16(w), bf16(x)))

so the loss, its reduction over the batch, every gradient (the cast's derivative casts the
bfloat16 cotangent back to float32) and the update ``w - lr * g`` stay in float32. Matrix
products take bfloat16 operands; XLA accumulates them in float32 on CPUs with bfloat16
arithmetic (AVX512-BF16, AMX) and GPUs, then rounds the product to bfloat16 (8 bits of
mantissa, about 2-3 significant digits). Integer inputs (token ids) pass unchanged.

This is Micikevicius et al. (2018), "Mixed Precision Training", without loss scaling, which
bfloat16 does not need (it has float32's exponent range). It is opt-in (config
``precision: bfloat16``): it changes the numbers, and it pays on GPUs (bfloat16 tensor
cores). On CPUs XLA:CPU ran it slower than float32 even with AMX-BF16 products
(``benchmarks/bench_precision.py``: a large bfloat16 product ran 2.7x faster, but the
models' small products and the element-wise work in bfloat16 lose more than that).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedax.models.base import Model

PRECISIONS = ("float32", "bfloat16")
"""The compute precisions ``with_precision`` accepts."""


def _to(dtype, tree):
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def mixed_precision(model: Model, compute_dtype=jnp.bfloat16) -> Model:
    """``model`` computed in ``compute_dtype`` with float32 parameters and logits."""

    def apply(params, x):
        logits = model.apply(_to(compute_dtype, params), _to(compute_dtype, jnp.asarray(x)))
        return logits.astype(jnp.float32)

    return Model(model.init, apply)


def with_precision(model: Model, precision: str) -> Model:
    """``model`` itself for ``"float32"``, :func:`mixed_precision` for ``"bfloat16"``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return model if precision == "float32" else mixed_precision(model)
