"""Error feedback for a compressed uplink: the residual as per-client state.

Mem-SGD (Stich, Cordonnier, Jaggi, NeurIPS 2018) and EF-SGD (Karimireddy, Rebjock, Stich,
Jaggi, ICML 2019) keep what the compressor dropped and add it back next time. In FL the
residual e_k is client k's own state, like SCAFFOLD's c_k (docs/references.md, compressed
communication): each round, for a participating client with update Δ_k,

    p_k = Δ_k + e_k,      q_k = C(p_k),      e_k ← p_k − q_k,

and q_k is what it sends. A client that does not take part keeps its e_k (it goes stale
between visits under partial participation), and so does a padding client (n_k = 0) or one
the server rejects (a non-finite message): ``compose`` never writes their rows.

``error_feedback(algorithm, compressor, num_clients)`` wraps any composed algorithm whose
client update returns an update shaped like the model (every FedAvg-family algorithm and
SCAFFOLD): its per-client state becomes ``(inner state, e_k)``, its client update computes
q_k = decode∘encode(p_k) on the client, and the message's update is q_k. Pair it with
``aggregator=compressed(compressor)`` (same compressor) so that q_k crosses encoded: the
compressors allowed here are deterministic and re-encode their own output exactly
(top-k: q_k has at most k non-zeros; 16-bit casts: q_k is representable), so the server
decodes exactly q_k. A client stage between (DP clipping) acts on q_k; what it removes is not
fed back (the residual is the compression error only).

The residual lives where every per-client state lives: ``round``'s ``[num_clients, ...]``
table (checkpointed with the state), a population runner's host store, or a real client's
disk (``cohort_round``); nothing else about the algorithm changes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedax.aggregators.compression import Compressor, roundtrip
from fedax.algorithms.base import FederatedAlgorithm
from fedax.algorithms.protocol import compose


def error_feedback(algorithm: FederatedAlgorithm, compressor: Compressor,
                   num_clients: int) -> FederatedAlgorithm:
    """``algorithm`` with error feedback on ``compressor`` (see the module docstring).

    Args:
      algorithm: a composed algorithm (``algorithm.pieces`` not None).
      compressor: a deterministic compressor: ``top_k``, ``cast("float16" | "bfloat16")``
        (``cast("int8")`` works, but its re-encoding reproduces q_k only to float rounding).
      num_clients: the population size N (rows of the residual table).

    Returns:
      the wrapped ``FederatedAlgorithm``; its per-client state is ``(inner, residual)``.
    """
    pieces = algorithm.pieces
    if pieces is None:
        raise ValueError("error_feedback needs a composed algorithm (algorithm.pieces is None);"
                         " wrap the plain algorithm, then e.g. the learned server LR.")
    if not isinstance(compressor, Compressor):
        raise ValueError(f"error_feedback needs a Compressor (top_k, cast), got {compressor!r}.")
    if compressor.stochastic:
        raise ValueError(f"error_feedback needs a deterministic compressor (top_k, float16, "
                         f"bfloat16, int8); {compressor.name} is unbiased: use it without.")
    inner_state = pieces.client_state

    def client_state(params):
        inner = None if inner_state is None else inner_state(params)
        return inner, jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)

    def client_update(payload, state, batches, num_examples, key=None):
        inner, residual = state
        message = pieces.client_update(payload, inner, batches, num_examples, key)
        p = jax.tree.map(lambda u, e: u.astype(jnp.float32) + e, message.update, residual)
        q = roundtrip(compressor, p)
        active = num_examples > 0
        new_residual = jax.tree.map(lambda pk, qk, e: jnp.where(active, pk - qk, e),
                                    p, q, residual)
        update = jax.tree.map(lambda qk, u: qk.astype(u.dtype), q, message.update)
        return message._replace(update=update,
                                client_state=(message.client_state, new_residual))

    return compose(pieces._replace(client_state=client_state, client_update=client_update),
                   num_clients, adversary=algorithm.adversary)


def residuals(state: Any) -> Any:
    """The ``[num_clients, ...]`` residual table of an ``error_feedback`` algorithm's state."""
    return state.clients[1]
