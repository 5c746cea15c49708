"""A round's metrics: the merge of its parts' (a name twice is an error) and the spread
of per-client stats over the cohort (``RoundPieces.spread``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedax import federated as fed


def spread_metrics(stats: dict[str, jax.Array], names: tuple[str, ...],
                   num_examples: jax.Array) -> dict[str, jax.Array]:
    """The spread over the cohort of the client-placed ``[C]`` stats ``names``: for each,
    ``<name>_min``, ``<name>_max`` and ``<name>_total`` (their sum) over the real clients
    (n_k > 0, accepted or not: the work they did; a non-finite value counts as 0) and
    ``<name>_per_client``, the ``[C]`` values at the server (0 for padding clients; the
    TensorBoard logger writes it as a histogram). One ``fed.collect`` of C scalars each."""
    if not names:
        return {}
    values, n = fed.collect(({name: stats[name] for name in names}, num_examples))
    real = n > 0
    out = {}
    for name, v in values.items():
        counted = jnp.logical_and(real, jnp.isfinite(v))
        v = jnp.where(counted, v, jnp.zeros((), v.dtype))
        any_real = jnp.any(counted)
        low = jnp.min(jnp.where(counted, v, jnp.asarray(jnp.inf, v.dtype)))
        high = jnp.max(jnp.where(counted, v, jnp.asarray(-jnp.inf, v.dtype)))
        out[f"{name}_min"] = jnp.where(any_real, low, jnp.zeros((), v.dtype))
        out[f"{name}_max"] = jnp.where(any_real, high, jnp.zeros((), v.dtype))
        out[f"{name}_total"] = jnp.sum(v)
        out[f"{name}_per_client"] = v
    return out


def merge_metrics(*dicts: dict[str, Any]) -> dict[str, Any]:
    """One dict of a round's metrics from its parts; a name reported twice is an error."""
    merged: dict[str, Any] = {}
    for d in dicts:
        clash = set(merged) & set(d)
        if clash:
            raise ValueError(f"a round reports the metric(s) {sorted(clash)} twice.")
        merged.update(d)
    return merged
