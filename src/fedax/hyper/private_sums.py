"""Private sums: clients → server releases clipped per client and noised, one Gaussian
release of multiplier z each (see ``fedax.hyper.private`` for which sums a hypergradient
adds and what privatizing them costs).

* :func:`private_sum`: Σ_k clip(v_k) + N(0, (z·clip)²), the forward release;
* :func:`private_broadcast`: ``fed.broadcast`` whose reverse-mode derivative (the
  transposed broadcast, a sum of per-client cotangents) is a :func:`private_sum`: +1
  release per privatized broadcast per round;
* :func:`privatize_payload` and :func:`with_private_payload`: the same for a round's
  payload (the train cohort, multi-round hypergradients), the clip on each client inside
  ``map_clients`` and the noise on the server.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedax import federated as fed
from fedax.aggregators.dp import _non_negative, _positive
from fedax.algorithms import FederatedAlgorithm, RoundPieces, compose
from fedax.federated import dp_clip, dp_noise


def _check_key(what: str, noise_multiplier: float, key) -> None:
    if key is None and noise_multiplier > 0:
        raise ValueError(f"{what} adds noise and needs a key (noise_multiplier > 0).")


def private_sum(values: Any, *, clip: float, noise_multiplier: float,
                key: jax.Array | None) -> Any:
    """Clients → server, privatized: Σ_k clip(v_k) + N(0, (z·clip)²) per coordinate.

    ``values`` is client-placed (a client that should not count must be zeros). The sum
    has sensitivity ``clip`` under adding or removing one client, so it is one Gaussian
    release of multiplier z. z = 0 adds no noise (not private; ``key`` may be None).
    Differentiable in ``values`` (the noise has derivative zero).
    """
    clip = _positive("private_sum clip", clip)
    z = _non_negative("private_sum noise_multiplier", noise_multiplier)
    _check_key("private_sum", z, key)
    total = fed.sum(dp_clip(values, clip))
    return total if key is None else dp_noise(total, z * clip, key)


def private_broadcast(x: Any, n: int, *, clip: float, noise_multiplier: float,
                      key: jax.Array | None) -> Any:
    """``fed.broadcast(x, n)`` whose reverse-mode derivative is a private sum.

    The backward pass receives one cotangent per client; it clips each to L2 norm
    ``clip``, sums them with ``fed.sum`` and adds N(0, (z·clip)²) from ``key``
    (:func:`private_sum`): one Gaussian release of multiplier z instead of the plain
    transposed broadcast. Reverse mode only (a ``custom_vjp``): forward-mode tangents go
    server → client and need no privacy. ``x`` must be float-valued.
    """
    clip = _positive("private_broadcast clip", clip)
    z = _non_negative("private_broadcast noise_multiplier", noise_multiplier)
    _check_key("private_broadcast", z, key)
    if not all(jnp.issubdtype(jnp.result_type(a), jnp.inexact) for a in jax.tree.leaves(x)):
        raise TypeError("private_broadcast places float values only (an integer value has "
                        "no cotangent); broadcast it with fedax.federated.broadcast.")

    @jax.custom_vjp
    def place(x, key):
        del key
        return fed.broadcast(x, n)

    def forward(x, key):
        return fed.broadcast(x, n), key

    def backward(key, cotangent):
        return private_sum(cotangent, clip=clip, noise_multiplier=z, key=key), None

    place.defvjp(forward, backward)
    return place(x, key)


def _noise_on_the_way_back(tree: Any, stddev: float, key: jax.Array | None) -> Any:
    """Identity (server side) whose backward pass adds N(0, stddev²) to the cotangent."""

    @jax.custom_vjp
    def identity(tree, key):
        del key
        return tree

    def forward(tree, key):
        return tree, key

    def backward(key, cotangent):
        return (cotangent if key is None else dp_noise(cotangent, stddev, key)), None

    identity.defvjp(forward, backward)
    return identity(tree, key)


def _clip_on_the_way_back(tree: Any, clip: float) -> Any:
    """Identity (one client, inside ``map_clients``) whose backward pass clips the
    cotangent to L2 norm ``clip``."""

    @jax.custom_vjp
    def identity(tree):
        return tree

    def backward(_, cotangent):
        return (dp_clip(cotangent, clip, client_placed=False),)

    identity.defvjp(lambda tree: (tree, None), backward)
    return identity(tree)


def privatize_payload(pieces: RoundPieces, *, clip: float, noise_multiplier: float,
                      key: jax.Array | None) -> RoundPieces:
    """``pieces`` whose payload broadcast transposes into a private sum (reverse mode).

    The round is unchanged; in its derivative, each client clips its cotangent w.r.t. the
    payload to ``clip`` (inside ``map_clients``), the transposed broadcast sums the
    clipped cotangents, and the server adds N(0, (z·clip)²) from ``key`` (use a fresh key
    per round; see :func:`with_private_payload`). +1 release per round on the train cohort.
    Reverse mode only.
    """
    clip = _positive("privatize_payload clip", clip)
    z = _non_negative("privatize_payload noise_multiplier", noise_multiplier)
    _check_key("privatize_payload", z, key)

    def payload(server):
        return _noise_on_the_way_back(pieces.payload(server), z * clip, key)

    def client_update(payload, *rest):  # rest: state, batches, n_k and the client's key
        return pieces.client_update(_clip_on_the_way_back(payload, clip), *rest)

    return pieces._replace(payload=payload, client_update=client_update)


def with_private_payload(algorithm: FederatedAlgorithm, *, clip: float,
                         noise_multiplier: float) -> FederatedAlgorithm:
    """``algorithm`` (composed of ``RoundPieces``) whose rounds privatize the payload's
    transposed broadcast (:func:`privatize_payload`), each round with its own key split from
    the round key; the round's other key is the algorithm's. For hypergradients through
    several rounds (reverse mode), where the cotangent of x_t reaches the train clients.
    Give every round its own key (``fedax.hyper.loss_after_rounds`` passes one key to every
    round: it would repeat the noise)."""
    if algorithm.pieces is None:
        raise ValueError("with_private_payload needs an algorithm composed of RoundPieces "
                         "(algorithm.pieces is None).")
    pieces = algorithm.pieces
    _positive("with_private_payload clip", clip)
    _non_negative("with_private_payload noise_multiplier", noise_multiplier)

    def round_fn(state, cohort, key):
        round_key, payload_key = jax.random.split(key)
        private = privatize_payload(pieces, clip=clip, noise_multiplier=noise_multiplier,
                                    key=payload_key)
        table = None if state.clients is None else jax.tree.leaves(state.clients)[0].shape[0]
        return compose(private, table, adversary=algorithm.adversary).round(
            state, cohort, round_key)

    return algorithm._replace(round=round_fn)


__all__ = ["private_broadcast", "private_sum", "privatize_payload", "with_private_payload"]
