"""The aggregator interface: how the server combines what the clients send.

An aggregator is a pure, stateful, keyed transformation in optax's shape, split where the
placements split:

* ``init(template) -> state``: ``template`` is one client's value (e.g. the model delta's
  shapes), so the state may hold per-coordinate quantities.
* ``client(value, weight, state, key) -> (value, weight, stats)``: *one client's* part,
  run inside ``map_clients`` (in the simulator) or on the client's machine (a networked
  runtime): clipping, quantization, an indicator bit. ``state`` is the server's state as
  broadcast; ``stats`` is a pytree of per-client numbers, summed over the accepted clients
  with a federated sum (one more value up per client) and handed to ``server``.
* ``reduce(values, weights, state, key) -> (value, metrics)``: client-placed to
  server-placed, written with the placement primitives (a weighted mean, a robust mean).
* ``server(value, stats, state, key) -> (value, state, metrics)``: after the reduction, on
  the server: noise, decoding, a state update from the summed ``stats`` (adaptive clipping).

Any of the three may be None (identity / nothing). A *complete* aggregator has a ``reduce``;
``chain`` composes parts (client stages in order, one reduction, server stages in order)
into one complete aggregator, as ``optax.chain`` composes gradient transformations; its state
is the tuple of the parts' states. ``aggregate`` runs a complete aggregator on client-placed
values in one program (the simulator's way); a networked runtime calls ``client`` on each
client and ``reduce``/``server`` on what arrives.

Clients the server rejected (a non-finite update) arrive with weight 0 and zeros for values
(``fedax.algorithms.base``), so no stage ever sees their NaN; a reduction must give a
zero-weight client no influence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedax import federated as fed

# The key is None when the caller passes none (``_split``): a stage that needs randomness
# then fails on it.
ClientFn = Callable[[Any, jax.Array, Any, jax.Array | None], tuple[Any, jax.Array, Any]]
ReduceFn = Callable[[Any, jax.Array, Any, jax.Array | None], tuple[Any, dict[str, jax.Array]]]
ServerFn = Callable[[Any, Any, Any, jax.Array | None], tuple[Any, Any, dict[str, jax.Array]]]
LinearFn = Callable[[Any, jax.Array, Any, jax.Array | None], tuple[Any, dict[str, jax.Array]]]


class Aggregator(NamedTuple):
    """An aggregator (or a part of one, for ``chain``); see the module docstring.

    Attributes:
      init: ``init(template) -> state``.
      client: ``client(value, weight, state, key) -> (value, weight, stats)`` or None.
      reduce: ``reduce(values, weights, state, key) -> (value, metrics)`` or None.
      server: ``server(value, stats, state, key) -> (value, state, metrics)`` or None.
      secure: a ``fedax.federated.SecureSum`` when ``reduce`` is a secure sum of the client
        stage's values (``fedax.aggregators.secure``): a networked runtime then runs the
        SecAgg+ protocol for it, and the server never holds one client's value.
      linear: ``linear(total, weight, state, key) -> (value, metrics)``, or None: ``reduce``
        again, for a reduction that reads the values only through ``total`` = Σ w_k x_k
        over the clients with w_k > 0 (``fedax.federated.weighted_terms``, summed) and
        ``weight`` = Σ w_k. It must equal ``reduce`` on those sums. An engine may then sum
        the clients' terms as they are made (``fedax.federated.map_and_sum``) instead of
        stacking every client's value (``mean``, ``total``).
      private: it declares a DP release (noise of a positive multiplier on clipped values:
        ``dp_gaussian``, ``dp_adaptive_gaussian``, ``adaclip``, ``distributed_dp``); what
        composes with it is decided from this (an algorithm's exact sums beside the update
        are refused), and ``tests/test_privacy_combinations.py`` checks it against the
        audit of the traced round (``fedax.federated.audit_sums``).
    """

    init: Callable[[Any], Any]
    client: ClientFn | None = None
    reduce: ReduceFn | None = None
    server: ServerFn | None = None
    secure: Any = None
    linear: LinearFn | None = None
    private: bool = False


def no_state(template: Any) -> tuple:
    """``init`` of a stateless aggregator."""
    del template
    return ()


def _client_keys(key: jax.Array, num_clients: int) -> jax.Array:
    """``[C, ...]`` raw key data, one independent key per client (``split`` of ``key``)."""
    return jax.random.key_data(jax.random.split(key, num_clients))


def _split(key: jax.Array | None, n: int):
    """``n`` keys from ``key``; without a key (a caller that passes None), None each: a
    stage that needs randomness then fails on its None key."""
    return (None,) * n if key is None else tuple(jax.random.split(key, n))


def _fold(key: jax.Array | None, i: int) -> jax.Array | None:
    return None if key is None else jax.random.fold_in(key, i)


def client_stage(
    aggregator: Aggregator, values: Any, weights: jax.Array, state: Any,
    client_keys: jax.Array | None, keep: jax.Array | None = None,
) -> tuple[Any, jax.Array, Any]:
    """The client stage of ``aggregator`` on client-placed ``values`` with ``weights [C]``:
    inside ``map_clients``, with the state broadcast and client i's key
    ``client_keys[i]`` (raw key data; None: no keys). Returns ``(values, weights,
    stats)`` with ``stats`` summed (``fed.sum``) over the clients where ``keep`` is True
    (default: all); without a client stage, the inputs and None."""
    client = aggregator.client
    if client is None:
        return values, weights, None
    num_clients = weights.shape[0]
    # The state goes down with a broadcast; a stateless aggregator's () has nothing to
    # send (and a placement needs an array leaf), so it is closed over instead.
    stateful = bool(jax.tree.leaves(state))
    at_clients = (fed.broadcast(state, num_clients),) if stateful else ()

    def with_state(client_state):
        return client_state[0] if stateful else state

    if client_keys is None:
        values, weights, stats = fed.map_clients(
            lambda v, w, *s: client(v, w, with_state(s), None),
            values, weights, *at_clients)
    else:
        def one(value, weight, raw_key, *client_state):
            return client(value, weight, with_state(client_state),
                          jax.random.wrap_key_data(raw_key))

        values, weights, stats = fed.map_clients(one, values, weights, client_keys,
                                                 *at_clients)
    if keep is not None:
        stats = jax.tree.map(
            lambda s: jnp.where(keep.reshape(keep.shape + (1,) * (s.ndim - 1)), s,
                                jnp.zeros((), s.dtype)), stats)
    stats = fed.sum(stats) if jax.tree.leaves(stats) else stats
    return values, weights, stats


def reduce_stage(
    aggregator: Aggregator, values: Any, weights: jax.Array | None, stats: Any, state: Any,
    reduce_key: jax.Array | None, server_key: jax.Array | None, *, summed: Any = None,
    reduced: Any = None,
) -> tuple[Any, Any, dict[str, jax.Array]]:
    """The reduction and server stage of ``aggregator`` after its client stage (``stats``:
    the summed client-stage stats). Returns ``(value, state, metrics)``. ``summed``: the
    values were already summed as ``weighted_terms`` (``values`` is then None), and the
    aggregator's ``linear`` reduces that sum instead of ``reduce``. ``reduced``: the
    reduction's value itself, computed elsewhere (a networked secure aggregation's
    protocol); only the server stage runs."""
    metrics: dict[str, jax.Array]
    if reduced is not None:
        value, metrics = reduced, {}
    elif weights is None:
        raise ValueError("reduce_stage needs the clients' weights, or the reduced value.")
    elif summed is None:
        value, metrics = _reduction(aggregator)(values, weights, state, reduce_key)
    elif aggregator.linear is None:
        raise ValueError("this aggregator's reduction needs every client's value: it has no "
                         "linear form to reduce a sum of weighted terms with.")
    else:
        value, metrics = aggregator.linear(summed, fed.sum(weights), state, reduce_key)
    metrics = dict(metrics)
    if aggregator.server is not None:
        value, state, more = aggregator.server(value, stats, state, server_key)
        metrics = _merge(metrics, more)
    return value, state, metrics


def _reduction(aggregator: Aggregator) -> ReduceFn:
    """The ``reduce`` of a complete aggregator; a stage alone has none."""
    if aggregator.reduce is None:
        raise ValueError(
            "this aggregator has no reduction (it is a stage): chain it with one, e.g. "
            "fedax.aggregators.chain(stage, fedax.aggregators.mean())."
        )
    return aggregator.reduce


def round_keys(key: jax.Array | None, num_clients: int):
    """``(client_keys [C] raw or None, reduce_key, server_key)`` of an aggregator from the
    round's ``key``: ``split(key, 3)``, the first split again into one key per client.
    Every engine derives them here (the simulator, FedBuff, the networked server)."""
    client_key, reduce_key, server_key = _split(key, 3)
    client_keys = None if client_key is None else _client_keys(client_key, num_clients)
    return client_keys, reduce_key, server_key


def aggregate(
    aggregator: Aggregator, values: Any, weights: jax.Array, state: Any, key: jax.Array,
    keep: jax.Array | None = None,
) -> tuple[Any, Any, dict[str, jax.Array]]:
    """Run a complete ``aggregator`` on client-placed ``values`` with ``weights [C]``:
    ``client_stage`` with the keys of ``round_keys``, then ``reduce_stage``. Returns
    ``(value, state, metrics)``, ``value`` server-placed.
    """
    _reduction(aggregator)  # a stage alone is refused before anything runs
    client_keys, reduce_key, server_key = round_keys(key, weights.shape[0])
    if aggregator.client is None:
        client_keys = None  # split nothing more than before (same keys downstream)
    values, weights, stats = client_stage(aggregator, values, weights, state, client_keys,
                                          keep)
    return reduce_stage(aggregator, values, weights, stats, state, reduce_key, server_key)


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    clash = set(a) & set(b)
    if clash:
        raise ValueError(f"two aggregator stages report the same metric(s) {sorted(clash)}.")
    return {**a, **b}


def chain(*parts: Aggregator) -> Aggregator:
    """Compose aggregator parts into one complete aggregator.

    Exactly one part has a ``reduce``; parts with a ``client`` stage come before it (they
    act on each client's value in order), parts after it have no ``client`` stage. After the
    reduction every part's ``server`` stage runs in the order given, each with the summed
    ``stats`` of its own client stage. Keys are split per part; the state is a tuple.
    Example: ``chain(clip_norm(1.0), mean())``, "clip each update, then average".
    """
    if not parts:
        raise ValueError("chain needs at least one aggregator part.")
    reducers = [i for i, p in enumerate(parts) if p.reduce is not None]
    if len(reducers) != 1:
        raise ValueError(
            f"chain needs exactly one part with a reduction (e.g. mean()), got {len(reducers)}."
        )
    r = reducers[0]
    late = [i for i, p in enumerate(parts) if p.client is not None and i > r]
    if late:
        raise ValueError(
            f"chain part {late[0]} has a client stage after the reduction (part {r}); put "
            "client stages before it."
        )
    clients = [(i, p.client) for i, p in enumerate(parts) if p.client is not None]
    servers = [(i, p.server) for i, p in enumerate(parts) if p.server is not None]
    part_reduce = _reduction(parts[r])

    def init(template):
        return tuple(p.init(template) for p in parts)

    def client(value, weight, state, key):
        stats = {}
        for i, part_client in clients:
            value, weight, stats[i] = part_client(value, weight, state[i], _fold(key, i))
        return value, weight, stats

    def reduce(values, weights, state, key):
        return part_reduce(values, weights, state[r], _fold(key, r))

    def server(value, stats, state, key):
        state = list(state)
        metrics: dict[str, Any] = {}
        for i, part_server in servers:
            part_stats = None if stats is None else stats.get(i)
            value, state[i], more = part_server(value, part_stats, state[i], _fold(key, i))
            metrics = _merge(metrics, more)
        return value, tuple(state), metrics

    linear = None
    part_linear = parts[r].linear
    if part_linear is not None and not clients:
        def linear(total, weight, state, key):
            return part_linear(total, weight, state[r], _fold(key, r))

    return Aggregator(init, client if clients else None, reduce, server if servers else None,
                      parts[r].secure, linear, any(p.private for p in parts))
