"""Update-level attacks: what the attackers send instead of their honest update.

Each factory returns an adversary for ``attacked(algorithm, adversary)``, whose round runs it:
``adversary(updates, weights, client_ids, key) -> (updates, weights)`` on the client-placed
messages, after the clients trained and before the server sees anything. It is written with
the placement primitives: whether a client attacks is a per-client lookup of its population
id (``map_clients``); an omniscient attack reads the honest clients' coordinate-wise mean μ
and standard deviation σ at the server (``fed.weighted_mean`` over the honest real clients)
and gets its vector back to the attackers with ``fed.broadcast``. Attackers keep their
weights (they report their n_k as honest clients do); padding clients (weight 0) never attack,
whatever their id. Notation and parameters: ByzFL, Baruch et al., Xie et al., Sun et al.
(docs/references.md, robust aggregation and attacks). The updates are FedAvg's Δ_k = w_t − w_k, a
pseudo-gradient, so the gradient attacks apply to them unchanged.

* ``sign_flip()``: −μ (ByzFL ``SignFlipping``); ``mode="own"``: −Δ_k.
* ``scaled(λ)``: λ·Δ_k, boosted (Sun et al.'s model replacement: λ = clients per round, the
  default, after projecting Δ_k to norm ≤ ``project``).
* ``gaussian(σ)``: N(μ₀, σ² I) (ByzFL defaults μ₀ = 0, σ = 1), a fresh draw per attacker.
* ``alie(z)``: "a little is enough" (Baruch et al., NeurIPS 2019): μ − z·σ, by default with
  the paper's z_max = Φ⁻¹((n − s)/n), s = ⌊n/2 + 1⌋ − f, n the cohort's real clients and f
  its attackers (``alie_z``).
* ``ipm(ε)``: inner-product manipulation (Xie et al., UAI 2019): −ε·μ.

σ is the unbiased standard deviation (ddof = 1, ``torch.std``'s, as the third-party ALIE
implementations use); with fewer than two honest clients it is 0.

Each adversary carries its attackers' population ids as its ``attackers`` attribute (sorted
int64), from which ``attacked`` marks them in every round's diagnostics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.scipy.special import ndtri

from fedax import federated as fed
from fedax.attacks.selection import attacker_table

Adversary = Callable[[Any, jax.Array, jax.Array, jax.Array], tuple[Any, jax.Array]]
"""``adversary(updates, weights, client_ids, key) -> (updates, weights)``: the cohort's
client-placed updates and weights after local training, as the server would see them
(``fedax.algorithms.cohort_round``'s ``adversary``); it carries its attackers' population
ids as ``attackers``."""


def alie_z(n: Any, f: Any) -> Any:
    """Baruch et al.'s z_max = Φ⁻¹((n − s)/n) with s = ⌊n/2 + 1⌋ − f (n workers, f of them
    Byzantine); the probability is clipped to [1/2, 1 − 1e-6] so the value stays finite
    (it exceeds 1 − 1e-6 only when f > n/2). Works on ints and on traced arrays."""
    n = jnp.asarray(n, jnp.float32)
    s = jnp.floor(n / 2 + 1) - jnp.asarray(f, jnp.float32)
    p = jnp.clip((n - s) / jnp.maximum(n, 1), 0.5, 1 - 1e-6)
    return ndtri(p)


def _carrying(adversary: Adversary, attackers: np.ndarray) -> Adversary:
    """``adversary`` with its attackers' ids as its ``attackers`` attribute."""
    cast(Any, adversary).attackers = np.sort(np.asarray(attackers, np.int64))  # a fn attr
    return adversary


def _rows(mask, leaf):
    return mask.reshape(mask.shape + (1,) * (leaf.ndim - 1))


class _Cohort:
    """Who is who in this round's cohort (client-placed masks) and the server's counts."""

    def __init__(self, table: np.ndarray, weights: jax.Array, client_ids: jax.Array):
        on_device = jnp.asarray(table)
        size = on_device.shape[0]

        def flags(i, w):
            attacker = jnp.logical_and(on_device[jnp.clip(i, 0, size - 1)], w > 0)
            return attacker, jnp.logical_and(~attacker, w > 0)

        self.attacker, self.honest = fed.map_clients(flags, client_ids, weights)
        self.num_clients = weights.shape[0]

    def count(self, mask: jax.Array) -> jax.Array:
        return fed.sum(mask.astype(jnp.int32))


def _honest_mean(updates: Any, cohort: _Cohort) -> Any:
    return fed.weighted_mean(updates, cohort.honest.astype(jnp.float32))


def _honest_std(updates: Any, cohort: _Cohort, mu: Any) -> Any:
    """The honest clients' coordinate-wise unbiased std (two passes: μ goes down, each
    client's squared deviation comes up)."""
    at = fed.broadcast(mu, cohort.num_clients)
    sq = fed.map_clients(lambda x, m: jax.tree.map(lambda a, b: (a - b) ** 2, x, m),
                         updates, at)
    h = cohort.count(cohort.honest).astype(jnp.float32)
    var = fed.weighted_mean(sq, cohort.honest.astype(jnp.float32))
    factor = jnp.where(h > 1, h / jnp.maximum(h - 1, 1), 0.0)
    return jax.tree.map(lambda v: jnp.sqrt(v * factor.astype(v.dtype)), var)


def _replace(updates: Any, cohort: _Cohort, malicious: Any) -> Any:
    """Each attacker's update replaced by the server-computed ``malicious`` vector, sent
    down with a broadcast."""
    at = fed.broadcast(malicious, cohort.num_clients)

    def one(x, bad, is_attacker):
        return jax.tree.map(lambda a, b: jnp.where(is_attacker, b.astype(a.dtype), a), x, bad)

    return fed.map_clients(one, updates, at, cohort.attacker)


def _omniscient(attackers: np.ndarray, num_clients: int,
                vector: Callable[[Any, _Cohort], Any]) -> Adversary:
    table = attacker_table(attackers, num_clients)

    def adversary(updates, weights, client_ids, key):
        del key
        cohort = _Cohort(table, weights, client_ids)
        return _replace(updates, cohort, vector(updates, cohort)), weights

    return _carrying(adversary, attackers)


def sign_flip(attackers: np.ndarray, num_clients: int, mode: str = "mean") -> Adversary:
    """Attackers send −μ (``mode="mean"``, ByzFL's ``SignFlipping``) or −Δ_k (``"own"``)."""
    if mode == "mean":
        return _omniscient(attackers, num_clients,
                           lambda u, c: jax.tree.map(jnp.negative, _honest_mean(u, c)))
    if mode != "own":
        raise ValueError(f"sign_flip mode must be 'mean' or 'own', got {mode!r}.")
    return scaled(attackers, num_clients, factor=-1.0)


def ipm(attackers: np.ndarray, num_clients: int, epsilon: float = 0.1) -> Adversary:
    """Inner-product manipulation (Xie, Koyejo, Gupta, UAI 2019): attackers send −ε·μ.
    A small ε (0.1) keeps the attack vectors close to the honest ones, which breaks the
    median and Krum; a large one breaks the mean [S: the paper's ε values were not read;
    ByzFL's default is τ = 2]."""
    if not epsilon > 0:
        raise ValueError(f"ipm epsilon must be > 0, got {epsilon!r}.")
    return _omniscient(attackers, num_clients, lambda u, c: jax.tree.map(
        lambda m: -epsilon * m, _honest_mean(u, c)))


def alie(attackers: np.ndarray, num_clients: int, z: float | None = None) -> Adversary:
    """"A little is enough" (Baruch, Baruch, Goldberg, NeurIPS 2019): attackers send
    μ − z·σ; ``z=None``: the paper's z_max from the cohort's real clients n and attackers f
    (``alie_z``), computed each round at the server."""

    def vector(updates, cohort):
        mu = _honest_mean(updates, cohort)
        sigma = _honest_std(updates, cohort, mu)
        if z is None:
            zz = alie_z(cohort.count(jnp.logical_or(cohort.attacker, cohort.honest)),
                        cohort.count(cohort.attacker))
        else:
            zz = jnp.asarray(z, jnp.float32)
        return jax.tree.map(lambda m, s: m - zz.astype(m.dtype) * s, mu, sigma)

    return _omniscient(attackers, num_clients, vector)


def scaled(attackers: np.ndarray, num_clients: int, factor: float | None = None,
           project: float | None = None) -> Adversary:
    """Attackers send λ·Δ_k (their own update), first projected to ‖Δ_k‖ ≤ ``project`` when
    given (Sun et al.'s ``ClientProjectBoost``); ``factor=None``: λ = the number of real
    clients in the cohort (Sun et al.'s boost, clients per round)."""
    table = attacker_table(attackers, num_clients)
    if project is not None and not project > 0:
        raise ValueError(f"scaled project must be > 0, got {project!r}.")

    def adversary(updates, weights, client_ids, key):
        del key
        cohort = _Cohort(table, weights, client_ids)
        if factor is None:
            lam = fed.broadcast(cohort.count(jnp.logical_or(cohort.attacker, cohort.honest))
                                .astype(jnp.float32), cohort.num_clients)
        else:
            lam = jnp.full((cohort.num_clients,), factor, jnp.float32)

        def client(x, is_attacker, lam_k):
            bad = x
            if project is not None:
                norm = optax.tree.norm(x)
                shrink = jnp.minimum(1.0, project / jnp.maximum(norm, 1e-30))
                bad = jax.tree.map(lambda a: a * shrink.astype(a.dtype), bad)
            return jax.tree.map(
                lambda a, b: jnp.where(is_attacker, b * lam_k.astype(b.dtype), a), x, bad)

        return fed.map_clients(client, updates, cohort.attacker, lam), weights

    return _carrying(adversary, attackers)


def gaussian(attackers: np.ndarray, num_clients: int, stddev: float = 1.0,
             mean: float = 0.0) -> Adversary:
    """Attackers send N(mean, stddev² I), each its own draw from the round's adversary key
    (ByzFL's ``Gaussian``, defaults mean 0, stddev 1)."""
    table = attacker_table(attackers, num_clients)
    if not stddev >= 0:
        raise ValueError(f"gaussian stddev must be >= 0, got {stddev!r}.")

    def adversary(updates, weights, client_ids, key):
        if key is None:
            raise ValueError("the gaussian attack draws noise: give the round a key, not None.")
        cohort = _Cohort(table, weights, client_ids)
        raw = jax.random.key_data(jax.random.split(key, cohort.num_clients))

        def client(x, is_attacker, k):
            leaves, treedef = jax.tree.flatten(x)
            keys = jax.random.split(jax.random.wrap_key_data(k), len(leaves))
            noise = [mean + stddev * jax.random.normal(kk, leaf.shape, leaf.dtype)
                     for kk, leaf in zip(keys, leaves, strict=True)]
            return jax.tree.map(lambda a, b: jnp.where(is_attacker, b, a), x,
                                jax.tree.unflatten(treedef, noise))

        return fed.map_clients(client, updates, cohort.attacker, raw), weights

    return _carrying(adversary, attackers)


UPDATE_ATTACKS: dict[str, Callable[..., Adversary]] = {
    "sign_flip": sign_flip,
    "scaled": scaled,
    "gaussian": gaussian,
    "alie": alie,
    "ipm": ipm,
}
"""Name -> ``factory(attackers, num_clients, **parameters)`` of each update-level attack."""
