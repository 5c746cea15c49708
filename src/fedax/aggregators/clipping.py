"""Per-client L2 norm clipping, a client stage (McMahan et al., ICLR 2018, DP-FedAvg).

Each client scales its update Δ_k to norm at most S:

    Δ_k ← Δ_k · min(1, S / ‖Δ_k‖₂)

(the global L2 norm over every leaf). The client reports one indicator bit, whether it was
clipped, and the server reports their sum as ``clipped_clients``. Chain it before a
reduction: ``chain(clip_norm(S), mean())``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fedax.aggregators.base import Aggregator, no_state


def clip_norm(max_norm: float) -> Aggregator:
    """Clip each client's value to global L2 norm ``max_norm`` (> 0)."""
    if not max_norm > 0:
        raise ValueError(f"clip_norm needs max_norm > 0, got {max_norm!r}.")

    def client(value, weight, state, key):
        del state, key
        norm = optax.tree.norm(value)
        scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-30))
        clipped = jax.tree.map(lambda v: v * scale.astype(v.dtype), value)
        return clipped, weight, {"clipped": (norm > max_norm).astype(jnp.int32)}

    def server(value, stats, state, key):
        del key
        return value, state, {"clipped_clients": stats["clipped"]}

    return Aggregator(no_state, client=client, server=server)
