"""What a networked run computes: the task (algorithm, model, hyperparameters) and the two
halves of a round built from the algorithm's own ``RoundPieces``.

A ``Task`` names a registered algorithm (``fedax.algorithms.ALGORITHMS``) and model
(``fedax.models.get_model``) with plain numbers; server and clients build the *same*
pieces from it with their own installed fedax (``build``). The server sends the task as
JSON when a client joins: names and numbers only, looked up in the registries, never code.

The round is ``fedax.algorithms.cohort_round`` cut where the network cuts it
(DESIGN.md, "A round in pieces"):

* ``client_step`` (on each client, jit-compiled): the algorithm's ``client_update`` on the
  client's own batches and per-client state;
* ``server_step`` (on the server, jit-compiled, over the accepted clients' reports
  stacked on a leading clients axis): ``reweigh``, the aggregator's client stage
  (clipping) on every report, its ``reduce`` and ``server`` stages, the federated
  sum of ``sums`` and the algorithm's ``server_update``.

The aggregator's client stage runs on the server, not on the client: in the trusted-server
model (DP-FedAvg, McMahan et al. 2018) the server may see each update, and a stage run on a
machine the server does not control guarantees nothing (a client could skip its clip).
Between the two halves the server checks every report (``fedax.runtime.server``,
``fedax.runtime.checks``); a rejected report never reaches ``server_step``, as
``accept_finite`` keeps a non-finite client out of the simulated round.

Keys: round t's key is ``fold_in(K, t)`` with K the server's *secret* key (drawn from the
OS, kept in its checkpoint, never sent: a client that knew it could recompute the DP noise
and subtract it), and the aggregator's client-stage key of the i-th selected client is
``split(split(k_t, 3)[0], C)[i]``, as the simulator derives them from ``key(seed)``
(``fedax.simulation.run``, ``fedax.aggregators.aggregate``); a test that gives the server
``K = key(seed)`` gets the simulator's noise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedax.algorithms import ALGORITHMS, RoundPieces, RoundState, init_state
from fedax.algorithms.base import client_half, server_half
from fedax.client import Batches
from fedax.experiments.build import build_named, make_aggregator
from fedax.models import get_model, softmax_cross_entropy
from fedax.runtime.security import key_words

# An experiment config's sections that say how it runs, not what it computes: the task a
# client receives is the config without them (``Task.from_config``).
ENGINE_KEYS = ("execution", "asynchronous", "network")


@dataclasses.dataclass(frozen=True)
class Task:
    """A networked run's algorithm and hyperparameters (JSON-able; see ``to_json``).

    Attributes:
      algorithm: a ``fedax.algorithms.ALGORITHMS`` name (fedavg, fedprox, scaffold, the
        FedOpt names, ...).
      model: a ``fedax.models.MODEL_NAMES`` name; ``model_options`` its keyword arguments
        (``logistic``: ``input_dim``, ``num_classes``).
      num_clients: N, the population (SCAFFOLD's c-update divides by it; client ids are
        0..N-1).
      client_lr, local_epochs, batch_size: the client's η, E and B (``"inf"``: one full
        batch a step).
      seed: initial model ``model.init(key(seed))``, round keys, selection and the clients'
        shuffles.
      input_shape: one example's feature shape (float32; labels are int32 scalars): the
        server checks reports against shapes it derives from it.
      options: the algorithm's other keyword arguments (``mu``, ``server_optimizer``,
        ``server_lr``, ``weighting``, ...).
      aggregator: how the server combines the updates, as ``{"kind": ..., **arguments}``
        (``make_aggregator``: ``mean``, ``clip_norm``, ``dp_gaussian``,
        ``dp_adaptive_gaussian``, ``adaclip``, ``robust``); None: the algorithm's own (the
        weighted mean). Its client stage (clipping) runs on each client, its reduction and
        server stage (noise) on the server.
      config: the experiment config's task part (``fedax run CONFIG`` with
        ``execution.mode: network``; ``Task.from_config``): every key of the YAML config but
        the engine sections (``ENGINE_KEYS``). With it the task is built by
        ``fedax.experiments.build.build``, as the simulator builds the same config, and the
        fields above are the config's own; ``aggregator``, ``options`` and
        ``example_privacy`` are then the config's business (its ``privacy``, ``robust``,
        ``compression`` sections) and must stay unset.
      sequence: the model predicts a token per position (the char-LSTM's loss).
      example_privacy: ``[l2_clip, noise_multiplier]``: each client trains with
        example-level DP-SGD (FedAvg, FedProx, the FedOpt names), its noise drawn from the
        client's own secret key (its seed kept in its ``state_dir``, never sent); None:
        plain local SGD.
    """

    algorithm: str
    model: str
    num_clients: int
    client_lr: float
    local_epochs: int = 1
    batch_size: int | str = 10
    seed: int = 0
    input_shape: list[int] = dataclasses.field(default_factory=lambda: [784])
    model_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    aggregator: dict[str, Any] | None = None
    example_privacy: list[float] | None = None
    config: dict[str, Any] | None = None
    sequence: bool = False

    def __post_init__(self):
        if self.config is not None:
            self._check_config()
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algorithm!r}; allowed: "
                             f"{', '.join(sorted(ALGORITHMS))}")
        if not isinstance(self.num_clients, int) or self.num_clients < 1:
            raise ValueError(f"num_clients must be a positive int, got {self.num_clients!r}")
        object.__setattr__(self, "input_shape", [int(d) for d in self.input_shape])
        if self.batch_size != "inf" and (not isinstance(self.batch_size, int)
                                         or self.batch_size < 1):
            raise ValueError(f"batch_size must be a positive int or 'inf', got "
                             f"{self.batch_size!r}")
        for name in ("aggregator", "example_privacy"):
            if name in self.options:
                raise ValueError(f"give {name!r} as the task's own field, not in options")
        if self.aggregator is not None:
            make_aggregator(self.aggregator)  # a bad spec fails here, naming the fix
        _refuse_unprotected_sums(self.algorithm, self._aggregator_kind(), self.client_lr)
        if self.example_privacy is not None:
            privacy = self.example_privacy
            if (not isinstance(privacy, list | tuple) or len(privacy) != 2
                    or not all(isinstance(v, int | float) and not isinstance(v, bool)
                               for v in privacy)):
                raise ValueError("example_privacy must be [l2_clip, noise_multiplier], got "
                                 f"{privacy!r}")
            object.__setattr__(self, "example_privacy", [float(v) for v in privacy])

    @classmethod
    def from_config(cls, config: Any, *, num_clients: int, input_shape: list[int],
                    model_options: dict[str, Any], sequence: bool = False) -> Task:
        """The task part of an experiment ``Config`` (``fedax.experiments.config``), with
        what its data says: the population N, one example's shape and the model's keyword
        arguments (``FederatedData.model_kwargs``)."""
        from fedax.experiments.config import config_to_dict

        data = {k: v for k, v in config_to_dict(config).items() if k not in ENGINE_KEYS}
        batch = config.batch_size
        return cls(config.algorithm, config.model, num_clients, float(config.client_lr),
                   int(config.local_epochs), "inf" if math.isinf(batch) else int(batch),
                   int(config.seed), list(input_shape), dict(model_options), config=data,
                   sequence=sequence)

    def spec(self) -> Any:
        """The validated ``Config`` of a task made ``from_config`` (with the default
        engine sections)."""
        from fedax.experiments.config import validate_config

        return validate_config(dict(self.config))

    def _check_config(self) -> None:
        if not isinstance(self.config, dict):
            raise ValueError(f"a task's config must be a mapping, got {self.config!r}")
        engine = sorted(set(self.config) & set(ENGINE_KEYS))
        if engine:
            raise ValueError(f"a task's config holds no engine section; remove {engine}")
        given = [n for n in ("aggregator", "example_privacy") if getattr(self, n) is not None]
        if given or self.options:
            raise ValueError(f"a task with a config takes its aggregator, privacy and options "
                             f"from the config; remove {given or sorted(self.options)}")
        config = self.spec()  # a bad config fails here, naming its key
        batch = config.batch_size
        own = {"algorithm": config.algorithm, "model": config.model,
               "client_lr": float(config.client_lr), "local_epochs": config.local_epochs,
               "batch_size": "inf" if math.isinf(batch) else int(batch), "seed": config.seed}
        for name, value in own.items():
            if getattr(self, name) != value:
                raise ValueError(f"task field {name!r} is {getattr(self, name)!r} but its "
                                 f"config says {value!r}; make the task with "
                                 "Task.from_config")
        if config.privacy is not None and config.privacy.level == "example":
            raise ValueError("privacy.level: example is not available over the network yet "
                             "(the server cannot account ε without the clients' n_k); use "
                             "user-level privacy, or the Task's example_privacy")

    def _aggregator_kind(self) -> str | None:
        if self.config is None:
            return None if self.aggregator is None else self.aggregator.get("kind")
        if self.config.get("privacy") is not None:
            return "dp_gaussian"
        return "robust" if self.config.get("robust") is not None else None

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        for name in ("aggregator", "example_privacy", "config"):  # absent when unused, so
            if data[name] is None:  # a task without them keeps its hash (and checkpoints)
                del data[name]
        if not data["sequence"]:
            del data["sequence"]
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Task:
        try:
            data = json.loads(text)
            return cls(**data)
        except (ValueError, TypeError) as err:
            raise ValueError(f"not a valid task: {err}") from None

    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @property
    def batch(self) -> float:
        return math.inf if self.batch_size == "inf" else int(self.batch_size)


# ----------------------------------------------------------------------- aggregators

_DP_KINDS = ("dp_gaussian", "dp_adaptive_gaussian", "adaclip")


def _refuse_unprotected_sums(algorithm: str, kind: str | None, client_lr: float) -> None:
    """An algorithm's exact sums (``AlgorithmSpec.exact_sums``) bypass the aggregator: the
    server must be able to check them (``checks.sums_check``), and no aggregator may
    promise what they break (DP: they are released unnoised; a robust rule: SCAFFOLD's c is
    their exact mean, so one client moves it by its own Δy/(N·K·η_l), unbounded)."""
    from fedax.runtime.checks import sums_check

    spec = ALGORITHMS[algorithm]
    if not spec.exact_sums:
        return
    sums_check(algorithm, client_lr)
    if kind in _DP_KINDS or (kind == "robust" and algorithm.startswith("scaffold")):
        what = "privacy" if kind in _DP_KINDS else "robustness"
        raise ValueError(f"algorithm {algorithm!r} uploads {spec.exact_sums[0]} as an exact "
                         f"sum beside the update, which the {kind!r} aggregator does not "
                         f"protect (its {what} would not hold); use fedavg, fedprox or a "
                         "FedOpt algorithm with it")


class Built(NamedTuple):
    """A task's model, pieces and initial parameters."""

    pieces: RoundPieces
    apply: Any
    params: Any


def build(task: Task) -> Built:
    """The task's ``RoundPieces``, model apply and initial parameters, from the one builder
    (``fedax.experiments.build``): ``build`` for a task made from a config (as the
    simulator builds that config), ``build_named`` for one written by hand (the
    cross-entropy loss, as ``fedax run`` uses)."""
    if task.config is not None:
        from fedax.experiments.build import build as build_spec

        built = build_spec(task.spec(), num_clients=task.num_clients,
                           model_kwargs=task.model_options, sequence=task.sequence)
        algorithm, apply, params = built.algorithm, built.model.apply, built.params
    else:
        model = get_model(task.model, **task.model_options)

        def loss_fn(params, batch: Batches):
            return softmax_cross_entropy(model.apply(params, batch.x), batch.y, batch.mask)

        privacy = None if task.example_privacy is None else tuple(task.example_privacy)
        algorithm = build_named(task.algorithm, loss_fn, num_clients=task.num_clients,
                                client_lr=task.client_lr, aggregator=task.aggregator,
                                example_privacy=privacy, options=task.options)
        apply, params = model.apply, jax.jit(model.init)(jax.random.key(task.seed))
    if algorithm.pieces is None:
        raise ValueError(f"algorithm {task.algorithm!r} is not a composition of round "
                         "pieces (e.g. server.lr: learned); the runtime runs pieces only")
    return Built(algorithm.pieces, apply, params)


# --------------------------------------------------------------------- the two halves


class Report(NamedTuple):
    """What a client sends: its ``ClientMessage`` (the update before any aggregator stage)
    and its n_k for the weighted round statistics."""

    update: Any
    weight: jax.Array
    stats: dict[str, jax.Array]
    sums: Any
    num_examples: jax.Array


def server_state(pieces: RoundPieces, params: Any) -> RoundState:
    """The server's initial state (no per-client table: clients keep their own)."""
    return init_state(pieces, params)


def round_key(key: jax.Array, t: int) -> jax.Array:
    """Round t's key ``fold_in(key, t)`` from the server's secret ``key``."""
    return jax.random.fold_in(key, t)


def key_from_secret(secret: bytes) -> jax.Array:
    """The server's JAX key from its 32-byte secret: the first 8 bytes of SHA-256(secret)
    as threefry key data (JAX's key holds 64 bits; the secret itself keeps 256)."""
    return jax.random.wrap_key_data(key_words(secret), impl="threefry2x32")


def client_step(pieces: RoundPieces, payload: Any, client_state: Any, batches: Batches,
                num_examples: jax.Array, train_key: Any) -> tuple[Report, Any]:
    """One client's half of a round; returns its ``Report`` and its new per-client state.

    ``train_key`` is raw key data (or None when the client update takes no key)."""
    message = client_half(pieces, payload, client_state, batches, num_examples,
                          train_key if pieces.keyed else None)
    report = Report(message.update, jnp.asarray(message.weight, jnp.float32),
                    dict(message.stats), message.sums, jnp.asarray(num_examples, jnp.float32))
    return report, message.client_state


def server_step(pieces: RoundPieces, state: RoundState, reports: Report,
                client_keys: jax.Array, real: jax.Array,
                key: jax.Array) -> tuple[RoundState, dict[str, jax.Array]]:
    """The server's half of round ``state.round`` on the accepted reports (client-placed:
    leading axis C; padding rows, ``real`` False, have weight 0 and zeros), with the
    finite and bounds checks done per report before this call: ``reweigh``, then
    ``fedax.algorithms.server_half``, the function the simulator's round runs, with the
    aggregator's client stage on each report and its key ``client_keys[i]`` (raw key
    data, the i-th selected client's of ``round_keys``)."""
    weights = reports.weight
    if pieces.reweigh is not None:  # before the aggregator, as in ``cohort_round``
        weights = pieces.reweigh(weights, reports.stats)
    new_state, metrics = server_half(pieces, state, reports.update, weights, reports.stats,
                                     reports.sums, reports.num_examples, key, real,
                                     client_keys=client_keys)
    return new_state._replace(clients=None), metrics


def payload_template(pieces: RoundPieces, params: Any) -> Any:
    """Shapes and dtypes of what the server sends: the algorithm's payload."""
    state = jax.eval_shape(lambda p: server_state(pieces, p), params)
    return jax.eval_shape(lambda s: {"payload": pieces.payload(s.server)}, state)


def key_data_template() -> jax.ShapeDtypeStruct:
    """Shape and dtype of one raw PRNG key (``jax.random.key_data``)."""
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))


def report_template(pieces: RoundPieces, params: Any, input_shape: list[int]) -> Any:
    """Shapes and dtypes of one client's ``Report`` (the server checks every report
    against it); independent of the client's batch shapes."""
    sent = payload_template(pieces, params)
    batches = Batches(jax.ShapeDtypeStruct((1, 1, *input_shape), jnp.float32),
                      jax.ShapeDtypeStruct((1, 1), jnp.int32),
                      jax.ShapeDtypeStruct((1, 1), jnp.float32))
    client_state = None
    if pieces.client_state is not None:
        client_state = jax.eval_shape(pieces.client_state, params)
    key = key_data_template()
    report, _ = jax.eval_shape(
        lambda p, c, b, k: client_step(pieces, p, c, b, jnp.float32(1.0), k),
        sent["payload"], client_state, batches, key)
    return report
