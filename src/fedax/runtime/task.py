"""What a networked run computes: the task (the experiment config's task part) and the two
halves of a round built from the algorithm's own ``RoundPieces``.

A ``Task`` is an experiment config (``fedax.spec.config``) without its engine
sections, with what its data say (the population N, one example's shape, the model's
arguments): names and numbers only, validated by the receiver's own schema and looked up
in its registries, never code. The server sends it as JSON when a client joins, and server
and clients build the *same* pieces from it with their own installed fedax through the one
builder (``fedax.builder.build``), as the simulator builds the same config.

The round is ``fedax.algorithms.cohort_round`` cut where the network cuts it
(DESIGN.md, "A round in pieces"):

* ``client_step`` (on each client, jit-compiled): the algorithm's ``client_update`` on the
  client's own batches and per-client state;
* on the server, jit-compiled, over the accepted clients' ``Reports`` stacked on a leading
  clients axis: ``fedax.algorithms.protocol.apply_reports`` (``reweigh``, the aggregator's
  client stage (clipping) on every report, its ``reduce`` and ``server`` stages, the
  federated sum of ``sums`` and the algorithm's ``server_update``), the one server half
  that every engine receiving reports calls.

The aggregator's client stage runs on the server, not on the client: in the trusted-server
model (DP-FedAvg, McMahan et al. 2018) the server may see each update, and a stage run on a
machine the server does not control guarantees nothing (a client could skip its clip).
Between the two halves the server checks every report (``fedax.runtime.server``,
``fedax.runtime.checks``); a rejected report never reaches ``apply_reports``, as
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
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedax.algorithms import ALGORITHMS, RoundPieces, RoundState, init_state
from fedax.algorithms.protocol import Reports, client_half
from fedax.builder.build import build as build_spec
from fedax.client import Batches
from fedax.runtime.security import key_words
from fedax.spec.config import Config, config_to_dict, validate_config

# An experiment config's sections that say how it runs, not what it computes: the task a
# client receives is the config without them (``Task.from_config``).
ENGINE_KEYS = ("execution", "asynchronous", "network")


@dataclasses.dataclass(frozen=True)
class Task:
    """A networked run's task (JSON-able; see ``to_json``): ``Task.from_config``.

    Attributes:
      config: the experiment config's task part: every key of the YAML config but the
        engine sections (``ENGINE_KEYS``): data, model, algorithm and its options, the
        aggregator chain (``privacy``, ``robust``, ``compression``), the schedule. It is
        validated when the task is made, by the server and by every client.
      num_clients: N, the population (SCAFFOLD's c-update divides by it; client ids are
        0..N-1).
      input_shape: one example's feature shape, of ``input_dtype`` (``float32`` features,
        or ``int32`` token ids for the char-LSTM); ``label_shape`` one example's int32
        labels' shape (``[]``: a class; ``[T]``: a token per position). The server checks
        reports against shapes it derives from them.
      model_options: the model's keyword arguments the data set decides
        (``FederatedData.model_kwargs``, e.g. the logistic model's ``input_dim``).
      sequence: the model predicts a token per position (the char-LSTM's loss).
    """

    config: dict[str, Any]
    num_clients: int
    input_shape: list[int] = dataclasses.field(default_factory=lambda: [784])
    model_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    sequence: bool = False
    input_dtype: str = "float32"
    label_shape: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not isinstance(self.config, dict):
            raise ValueError(f"a task's config must be a mapping, got {self.config!r}")
        engine = sorted(set(self.config) & set(ENGINE_KEYS))
        if engine:
            raise ValueError(f"a task's config holds no engine section; remove {engine}")
        if not isinstance(self.num_clients, int) or self.num_clients < 1:
            raise ValueError(f"num_clients must be a positive int, got {self.num_clients!r}")
        object.__setattr__(self, "input_shape", [int(d) for d in self.input_shape])
        object.__setattr__(self, "label_shape", [int(d) for d in self.label_shape])
        if self.input_dtype not in ("float32", "int32"):
            raise ValueError(f"input_dtype must be 'float32' or 'int32', got "
                             f"{self.input_dtype!r}")
        config = self.spec()  # a bad config fails here, naming its key
        _refuse_unprotected_sums(config)

    @classmethod
    def from_config(cls, config: Config, *, num_clients: int, input_shape: list[int],
                    model_options: dict[str, Any], sequence: bool = False,
                    input_dtype: str = "float32",
                    label_shape: list[int] | None = None) -> Task:
        """The task part of an experiment ``Config``, with what its data says: the
        population N, one example's shape and dtype, its labels' shape and the model's
        keyword arguments."""
        data = {k: v for k, v in config_to_dict(config).items() if k not in ENGINE_KEYS}
        return cls(data, num_clients, list(input_shape), dict(model_options), sequence,
                   input_dtype, list(label_shape or []))

    def spec(self) -> Config:
        """The validated ``Config`` (with the default engine sections), validated once:
        the task is frozen, and clients read its numbers every round."""
        cached = self.__dict__.get("_spec")
        if cached is None:
            cached = validate_config(dict(self.config))
            object.__setattr__(self, "_spec", cached)
        return cached

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        for name, default in (("sequence", False), ("input_dtype", "float32"),
                              ("label_shape", [])):
            if data[name] == default:  # absent when default: the task keeps its hash
                del data[name]
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Task:
        try:
            data = json.loads(text)
            if isinstance(data, dict) and "algorithm" in data and "config" not in data:
                raise ValueError("a task.json of an older fedax (algorithm, aggregator "
                                 "kinds); make the setup again with fedax server init DIR "
                                 "--config CONFIG")
            return cls(**data)
        except (ValueError, TypeError) as err:
            raise ValueError(f"not a valid task: {err}") from None

    def sha256(self) -> str:
        """The task's identity (checkpoints and client state are tied to it): its JSON
        without the schedule a resumed run may change (``rounds``, evaluation and
        checkpoint cadence, the target), as the simulator's resume allows; with privacy,
        ``rounds`` stays in (a budget's z depends on it)."""
        data = json.loads(self.to_json())
        schedule = {"eval_every", "checkpoint_every", "target_accuracy", "stop_at_target"}
        if self.config.get("privacy") is None:
            schedule.add("rounds")
        data["config"] = {k: v for k, v in data["config"].items() if k not in schedule}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    # The config's numbers the server's checks use (``fedax.runtime.checks``).
    @property
    def algorithm(self) -> str:
        return self.config["algorithm"]

    @property
    def model(self) -> str:
        return self.config["model"]

    @property
    def seed(self) -> int:
        return int(self.config.get("seed", 0))

    @property
    def client_lr(self) -> float:
        return float(self.spec().client_lr)

    @property
    def local_epochs(self) -> int:
        return int(self.spec().local_epochs)

    @property
    def batch(self) -> float:
        batch = self.spec().batch_size
        return math.inf if math.isinf(batch) else int(batch)


def _refuse_unprotected_sums(config: Config) -> None:
    """An algorithm's exact sums (``AlgorithmSpec.exact_sums``) bypass the aggregator: the
    server must be able to check them (``checks.sums_check``), and no aggregator may
    promise what they break (DP: they are released unnoised, which the config refuses
    already; a robust rule: SCAFFOLD's c is their exact mean, so one client moves it by its
    own Δy/(N·K·η_l), unbounded)."""
    from fedax.runtime.checks import sums_check

    spec = ALGORITHMS[config.algorithm]
    if not spec.exact_sums:
        return
    sums_check(config.algorithm, float(config.client_lr))
    if config.robust is not None and not spec.sums_bounded:
        raise ValueError(f"algorithm {config.algorithm!r} uploads {spec.exact_sums[0]} as an "
                         "exact sum beside the update, which the robust aggregator does not "
                         "protect (its robustness would not hold); use fedavg, fedprox or a "
                         "FedOpt algorithm with it")


class Built(NamedTuple):
    """A task's model, pieces and initial parameters; with ``server.lr: learned``, the
    loss its holdout clients evaluate and ``learned`` = (initial η, the hyper-optimizer's
    learning rate, holdout clients a round)."""

    pieces: RoundPieces
    apply: Any
    params: Any
    loss: Any = None
    learned: tuple[float, float, int] | None = None


def build(task: Task) -> Built:
    """The task's ``RoundPieces``, model apply and initial parameters, from the one builder
    (``fedax.builder.build.build``), as the simulator builds the same config. With
    ``server.lr: learned`` the pieces are the algorithm at its initial η, which the server
    learns by hypergradient descent (``fedax.runtime.holdout``)."""
    from fedax.builder.build import make_loss
    from fedax.builder.privacy_plan import cohort_size
    from fedax.spec.config import resolved_server_optimizer

    config, learned = task.spec(), None
    if config.server.lr == "learned":
        init_lr = float(resolved_server_optimizer(config).hyperparameters["lr"])
        data = {k: v for k, v in task.config.items() if k != "learned_lr"}
        data["server"] = {**data.get("server", {}), "lr": init_lr}
        learned = (init_lr, float(config.learned_lr.hyper_lr),
                   config.learned_lr.holdout_clients or cohort_size(config, task.num_clients))
        config = validate_config(data)
    built = build_spec(config, num_clients=task.num_clients,
                       model_kwargs=task.model_options, sequence=task.sequence)
    if built.algorithm.pieces is None:
        raise ValueError(f"algorithm {task.algorithm!r} is not a composition of round "
                         "pieces; the runtime runs pieces only")
    return Built(built.algorithm.pieces, built.model.apply, built.params,
                 make_loss(built.model.apply, task.sequence), learned)


# --------------------------------------------------------------------- the two halves


def server_state(pieces: RoundPieces, params: Any) -> RoundState:
    """The server's initial state (no per-client table: clients keep their own)."""
    return init_state(pieces, params)


def round_key(key: jax.Array, t: int) -> jax.Array:
    """Round t's key ``fold_in(key, t)`` from the server's secret ``key``."""
    return jax.random.fold_in(key, t)


def key_from_secret(secret: bytes) -> jax.Array:
    """The server's JAX key from its 32-byte secret: the first 8 bytes of SHA-256(secret)
    as threefry key data (JAX's key holds 64 bits; the secret itself keeps 256)."""
    return jax.random.wrap_key_data(jnp.asarray(key_words(secret)), impl="threefry2x32")


def client_step(pieces: RoundPieces, payload: Any, client_state: Any, batches: Batches,
                num_examples: jax.Array, train_key: Any,
                stage: Any = None) -> tuple[Reports, Any]:
    """One client's half of a round; returns its ``Reports`` (one client's, unstacked)
    and its new per-client state.

    ``train_key`` is the client's own training key, raw key data. ``stage``
    (a task that ``encodes``): ``{"aggregator": state, "key": raw key}``, the aggregator's
    state the server broadcast and this client's client-stage key (the simulator's
    ``round_keys`` for its position); the client runs the aggregator's client stage (the
    compressor's encoding) and sends its codes, what crosses the wire."""
    message = client_half(pieces, payload, client_state, batches, num_examples, train_key)
    update, weight = message.update, message.weight
    stage_stats: Any = {}
    if stage is not None:
        stage_fn = pieces.aggregator.client
        assert stage_fn is not None  # (a task that encodes has a client stage)
        update, weight, stage_stats = stage_fn(
            update, weight, stage["aggregator"], jax.random.wrap_key_data(stage["key"]))
    report = Reports(update, jnp.asarray(weight, jnp.float32), dict(message.stats),
                     message.sums, jnp.asarray(num_examples, jnp.float32), dict(stage_stats))
    return report, message.client_state


def encodes(task: Task) -> bool:
    """The task's clients run its aggregator's client stage themselves: a compressed uplink
    (``compression``), whose codes are what crosses the wire. The server decodes after
    validating them; every other client stage (a clip) runs on the server."""
    return task.config.get("compression") is not None


def broadcast(pieces: RoundPieces, state: RoundState, encoded: bool) -> dict[str, Any]:
    """What the server sends every selected client: the algorithm's payload and, for a
    task that ``encodes``, the aggregator's state (rotation's shared key)."""
    sent = {"payload": pieces.payload(state.server)}
    if encoded:
        sent["stage"] = {"aggregator": state.aggregator}
    return sent


def stage_key(key_data: Any) -> list:
    """The ``Tensor`` of one client's client-stage key (raw key data), which the server
    appends to that client's task only (``wire.task_bytes``)."""
    from fedax.runtime import wire

    return wire.encode_tree({"stage": {"key": key_data}})


def payload_template(pieces: RoundPieces, params: Any, encoded: bool = False) -> Any:
    """Shapes and dtypes of what the server sends: the algorithm's payload; with
    ``encoded``, also the ``stage`` a client encodes with (the aggregator's state, shared,
    and the client's own key, which the server puts in that client's task only)."""
    state = jax.eval_shape(lambda p: server_state(pieces, p), params)
    sent = jax.eval_shape(lambda s: {"payload": pieces.payload(s.server)}, state)
    if encoded:
        sent["stage"] = {"aggregator": state.aggregator, "key": key_data_template()}
    return sent


def key_data_template() -> jax.ShapeDtypeStruct:
    """Shape and dtype of one raw PRNG key (``jax.random.key_data``)."""
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))


def report_template(pieces: RoundPieces, params: Any, input_shape: list[int],
                    input_dtype: str = "float32", label_shape: Sequence[int] = (),
                    encoded: bool = False) -> Any:
    """Shapes and dtypes of one client's ``Reports`` (the server checks every report
    against it); independent of the client's batch shapes."""
    sent = payload_template(pieces, params, encoded)
    batches = Batches._make([  # (a template: ShapeDtypeStruct leaves)
        jax.ShapeDtypeStruct((1, 1, *input_shape), jnp.dtype(input_dtype)),
        jax.ShapeDtypeStruct((1, 1, *label_shape), jnp.int32),
        jax.ShapeDtypeStruct((1, 1), jnp.float32)])
    client_state = None
    if pieces.client_state is not None:
        client_state = jax.eval_shape(pieces.client_state, params)
    key = key_data_template()
    report, _ = jax.eval_shape(
        lambda p, c, b, k, s: client_step(pieces, p, c, b, jnp.float32(1.0), k, s),
        sent["payload"], client_state, batches, key, sent.get("stage"))
    return report
