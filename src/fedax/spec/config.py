"""The experiment config of ``fedax run CONFIG [--set key=value ...]``: schema and validation.

A config is a YAML mapping; every section forbids unknown keys and types are strict
(``rounds: "10"`` is an error, not 10). All failures raise :class:`ConfigError` with one
line naming the key (dotted for nested sections, e.g. ``server.lr``) and what it allows.

Notation of McMahan et al. (2017): C = ``client_fraction``, E = ``local_epochs``,
B = ``batch_size`` (``inf``: the whole local data set is one batch). FedSGD is FedAvg with
E = 1 and B = inf, so for ``algorithm: fedsgd`` those two keys may be omitted (they are
filled in) or set to exactly those values; anything else is an error. For ``fedavg`` both
are required.

``checkpoint_every: k`` saves a checkpoint every k rounds into ``OUT/checkpoints/`` (0, the
default, saves none); ``fedax run ... --resume`` continues from the newest one.

The algorithm names and their options come from the registry (``fedax.algorithms.ALGORITHMS``),
the ``server:`` section from the server optimizer specs (``SERVER_OPTIMIZERS``): it is one spec,
``optimizer`` (a name), ``lr`` and that optimizer's other hyperparameters, each absent key at
the optimizer's default. A FedOpt algorithm name implies its optimizer (``fedadam``: ``adam``),
so ``server.optimizer`` is then absent or that name; otherwise it defaults to ``sgd`` at
``lr`` 1 (FedAvg). A key the optimizer does not have is an error naming it.
``resolved_server_optimizer(config)`` is the spec with every value filled in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from os import PathLike
from typing import Any, Literal, cast

from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fedax.algorithms import ALGORITHMS
from fedax.algorithms.server_optimizers import ResolvedServerOptimizer
from fedax.spec.aggregation_sections import (
    AttackConfig,
    CompressionConfig,
    PrivacyConfig,
    RobustConfig,
    SecureConfig,
)
from fedax.spec.config_loading import apply_override, read_config_file

# _allowed and _section are read from here by tools/docs_hooks.py (the config keys page).
from fedax.spec.config_messages import _allowed, _one_line, _section  # noqa: F401
from fedax.spec.engines import (
    AsynchronousConfig,
    ExecutionConfig,
    NetworkConfig,
    async_combination,
    network_combination,
)
from fedax.spec.errors import ConfigError
from fedax.spec.sections import (
    BatchSize,
    ClientConfig,
    LearnedLRConfig,
    Number,
    ServerConfig,
    ShakespeareConfig,
    SyntheticConfig,
    _KeyedError,
    _resolve_server,
    _Section,
    algorithm_options_problem,
)
from fedax.spec.secure_rules import secure_combination


class Config(_Section):
    """A validated experiment config (see the module docstring)."""

    seed: int = Field(0, ge=0)
    rounds: int = Field(gt=0)
    dataset: Literal["mnist", "fashion_mnist", "synthetic", "shakespeare"] = "mnist"
    num_clients: int = Field(100, gt=0)
    # natural: the data set's own clients (synthetic's devices; filled in for it)
    partition: Literal["iid", "pathological", "unbalanced", "dirichlet", "similarity",
                       "natural"]
    dirichlet_alpha: Number = Field(0.1, gt=0, allow_inf_nan=False)  # partition: dirichlet
    similarity: Number = Field(0.0, ge=0, le=1)  # partition: similarity (SCAFFOLD's s)
    synthetic: SyntheticConfig = SyntheticConfig()  # dataset: synthetic
    shakespeare: ShakespeareConfig = ShakespeareConfig()  # dataset: shakespeare
    model: Literal["2nn", "cnn", "logistic", "char_lstm"]
    # bfloat16: compute in bfloat16 with float32 master weights (fedax.models.precision)
    precision: Literal["float32", "bfloat16"] = "float32"
    # a name in the registry when the config is validated (fedax.algorithms.ALGORITHMS)
    algorithm: str = Field(description="one of " + ", ".join(repr(n) for n in ALGORITHMS)
                           + ", or a name given to fedax.algorithms.register")
    # FedProx's proximal weight (its registry default); also algorithm_options.mu
    mu: Number = Field(ALGORITHMS["fedprox"].options["mu"], ge=0, allow_inf_nan=False)
    # the algorithm's own options as its registry entry declares them (AlgorithmSpec.options:
    # FedProx's mu, SCAFFOLD's weighting), each of its default's type
    algorithm_options: dict[str, Any] = Field(default_factory=dict)
    client_fraction: Number = Field(gt=0, le=1)
    local_epochs: int = Field(ge=1)
    batch_size: BatchSize = Field(description="an integer >= 1 or inf")
    client_lr: Number = Field(gt=0, allow_inf_nan=False)
    # local training: early stopping of each client's steps (absent: none, E epochs)
    client: ClientConfig = ClientConfig()
    server: ServerConfig = ServerConfig()
    learned_lr: LearnedLRConfig = LearnedLRConfig()  # with server.lr: learned
    privacy: PrivacyConfig | None = None  # user-level DP (absent: none)
    compression: CompressionConfig | None = None  # compressed uplink (absent: none)
    robust: RobustConfig | None = None  # a robust aggregator (absent: the mean)
    secure: SecureConfig | None = None  # secure aggregation (absent: the server sees updates)
    attack: AttackConfig | None = None  # simulated attackers (absent: none)
    # FedProx's stragglers: this fraction of each cohort runs U{1..E} epochs instead of E;
    # with drop_stragglers, those that ran fewer than E get weight 0 (FedAvg's treatment).
    stragglers: Number = Field(0.0, ge=0, le=1)
    drop_stragglers: bool = False
    # Clients whose update is not finite are left out and counted; a round that rejects more
    # than this fraction of its cohort stops the run (fedax.simulation.run).
    max_rejected_fraction: Number = Field(0.5, ge=0, le=1)
    eval_every: int = Field(1, ge=1)
    target_accuracy: Number | None = Field(None, gt=0, le=1)
    stop_at_target: bool = False
    # Also evaluate on each client's own test data (the data set's per-client test split, or
    # the test set dealt by the partition) and record the distribution over clients.
    per_client_eval: bool = False
    checkpoint_every: int = Field(0, ge=0)
    execution: ExecutionConfig = ExecutionConfig()
    asynchronous: AsynchronousConfig = AsynchronousConfig()  # with execution.mode: async
    network: NetworkConfig = NetworkConfig()  # with execution.mode: network

    @model_validator(mode="before")
    @classmethod
    def _fedsgd_defaults(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("algorithm") == "fedsgd":
            data = {"local_epochs": 1, "batch_size": math.inf, **data}
        return data

    @model_validator(mode="before")
    @classmethod
    def _natural_partition(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("dataset") in ("synthetic", "shakespeare"):
            data = {"partition": "natural", **data}
        return data

    @field_validator("partition")
    @classmethod
    def _partition_fits_dataset(cls, value: Any, info: ValidationInfo) -> Any:
        dataset = info.data.get("dataset")
        if dataset == "synthetic" and value != "natural":
            raise ValueError(
                f"must be 'natural' for dataset 'synthetic' (its clients are the generated"
                f" devices; omit the key), got {value!r}"
            )
        if dataset == "shakespeare" and value not in ("natural", "iid"):
            raise ValueError(
                f"must be 'natural' (one client per role) or 'iid' (the balanced IID variant)"
                f" for dataset 'shakespeare', got {value!r}"
            )
        if value == "natural" and dataset not in (None, "synthetic", "shakespeare"):
            raise ValueError(
                f"'natural' needs a data set with its own clients (synthetic, shakespeare),"
                f" got dataset {dataset!r}"
            )
        return value

    @field_validator("algorithm")
    @classmethod
    def _registered_algorithm(cls, value: Any) -> Any:
        if value not in ALGORITHMS:  # the registry now, with algorithms registered since
            raise ValueError("must be one of " + ", ".join(repr(n) for n in ALGORITHMS)
                             + f", got {value!r}")
        return value

    @field_validator("model")
    @classmethod
    def _model_fits_dataset(cls, value: Any, info: ValidationInfo) -> Any:
        if (info.data.get("dataset") == "shakespeare") != (value == "char_lstm"):
            raise ValueError(
                f"dataset 'shakespeare' and model 'char_lstm' go together, got model {value!r}"
                f" for dataset {info.data.get('dataset')!r}"
            )
        if info.data.get("dataset") == "synthetic" and value != "logistic":
            raise ValueError(
                f"must be 'logistic' for dataset 'synthetic' (60 features, not images), got"
                f" {value!r}"
            )
        return value

    @field_validator("local_epochs", "batch_size")
    @classmethod
    def _fedsgd_is_e1_binf(cls, value: Any, info: ValidationInfo) -> Any:
        required = {"local_epochs": 1, "batch_size": math.inf}[cast(str, info.field_name)]
        if info.data.get("algorithm") == "fedsgd" and value != required:
            raise ValueError(
                f"must be {'inf' if required == math.inf else required} for algorithm 'fedsgd',"
                f" got {value!r} (FedSGD is FedAvg with E=1, B=inf: omit the key, or use"
                " algorithm 'fedavg')"
            )
        return value

    @field_validator("server")
    @classmethod
    def _server_fits_algorithm(cls, value: Any, info: ValidationInfo) -> Any:
        if info.data.get("algorithm") is not None:
            _resolve_server(info.data["algorithm"], value)
        return value


    @field_validator("compression")
    @classmethod
    def _compression_with_privacy(cls, value: Any, info: ValidationInfo) -> Any:
        privacy = info.data.get("privacy")
        if value is not None and privacy is not None and privacy.level == "user" \
                and privacy.mechanism != "gaussian":
            raise ValueError(
                f"composes with privacy.mechanism 'gaussian' only (the server clips each "
                f"decoded message to the fixed clip S, which keeps the sensitivity), got "
                f"{privacy.mechanism!r}; use mechanism gaussian or drop compression")
        return value

    @field_validator("robust")
    @classmethod
    def _robust_without_dp(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return value
        privacy = info.data.get("privacy")
        if privacy is not None and privacy.level == "user":
            if value.rule == "norm_bounding":
                raise _KeyedError("robust.rule", "user-level DP already bounds each update's "
                                  "norm (its clip is Sun et al.'s M): set privacy.clip and "
                                  "drop robust")
            raise _KeyedError(
                "robust.rule", f"rule {value.rule!r} cannot carry DP noise: noise calibrated "
                "to the clip needs a sum (one client moves it by at most S), and a "
                "median/trimmed mean/Krum/geometric median has no such bound; drop privacy "
                "or robust")
        if info.data.get("compression") is not None:
            raise ValueError("robust and compression do not compose in a config; drop one")
        return value

    @field_validator("attack")
    @classmethod
    def _attack_fits_dataset(cls, value: Any, info: ValidationInfo) -> Any:
        dataset = info.data.get("dataset")
        if value is not None and value.kind == "backdoor" and dataset not in (
                "mnist", "fashion_mnist"):
            raise ValueError(f"kind 'backdoor' needs an image data set (mnist, "
                             f"fashion_mnist), got dataset {dataset!r}")
        if value is not None and value.kind == "label_flip" and dataset == "shakespeare":
            raise ValueError("kind 'label_flip' needs class labels (mnist, fashion_mnist, "
                             "synthetic), got dataset 'shakespeare'")
        return value

    @field_validator("learned_lr")
    @classmethod
    def _learned_lr_needs_it(cls, value: Any, info: ValidationInfo) -> Any:
        server = info.data.get("server")
        if value != LearnedLRConfig() and server is not None and server.lr != "learned":
            raise ValueError("applies only with server.lr: learned (the server learning rate "
                             "learned by hypergradient)")
        return value

    @model_validator(mode="after")
    def _stopping_fits_algorithm(self) -> Config:
        if self.client.stopping != "none" and not ALGORITHMS[self.algorithm].local_stopping:
            able = ", ".join(n for n, s in ALGORITHMS.items() if s.local_stopping)
            raise _KeyedError("client.stopping", f"algorithm {self.algorithm!r} has no local "
                                                 f"training to stop early; use one of {able}")
        return self

    @model_validator(mode="after")
    def _algorithm_options(self) -> Config:
        refused = algorithm_options_problem(self)
        if refused is not None:
            raise _KeyedError(*refused)
        return self

    @model_validator(mode="after")
    def _async_combination(self) -> Config:
        refused = async_combination(self) or network_combination(self)
        if refused is not None:
            raise _KeyedError(*refused)
        return self

    @model_validator(mode="after")
    def _private_combination(self) -> Config:
        refused = private_combination(self) or secure_combination(self)
        if refused is not None:
            raise _KeyedError(*refused)
        return self


def private_combination(config: Config) -> tuple[str, str] | None:
    """Why ``config``'s combination cannot run under its ``privacy`` section, as ``(key,
    message)``, or None when every upload of its rounds is privatized and counted.

    Decided from what the registries declare, not from a list of names: an algorithm's
    ``exact_sums`` (uploads beside the update that no DP mechanism privatizes) and its
    ``example_dp``; the learned server lr's holdout hypergradient, privatized only at the
    user level, with ``learned_lr.clip``, on a cohort sampled like the train cohort."""
    p, spec = config.privacy, ALGORITHMS[config.algorithm]
    learned = config.server.lr == "learned"
    if p is None:
        if config.learned_lr.clip is not None:
            return ("learned_lr.clip", "applies only with privacy (the bound of one holdout "
                                       "client in the privatized hypergradient); omit it")
        return None
    if p.level == "example":
        if config.client.stopping != "none":
            return ("client.stopping", f"{config.client.stopping!r} with privacy level "
                                       "'example': the stopping criterion reads the raw "
                                       "per-example gradients, a release the example-level "
                                       "epsilon does not count; use level user or drop it")
        if not spec.example_dp:
            able = ", ".join(n for n, s in ALGORITHMS.items() if s.example_dp)
            return ("privacy.level", f"algorithm {config.algorithm!r} has no example-level "
                                     f"DP-SGD in its local training; use one of {able}, or "
                                     "level user")
        if learned:
            return ("server.lr", "'learned' with privacy level 'example': the holdout "
                                 "hypergradient is a release of the holdout clients' data "
                                 "that the example-level epsilon does not count; use level "
                                 "user (it privatizes the hypergradient) or a fixed server.lr")
        return None
    if spec.exact_sums:
        able = ", ".join(n for n, s in ALGORITHMS.items() if not s.exact_sums)
        return ("privacy", f"algorithm {config.algorithm!r} uploads "
                           f"{'; '.join(spec.exact_sums)} as exact sums beside the update, "
                           "which no DP mechanism clips or noises, so epsilon could not "
                           f"cover what the run releases; use one of {able}, or drop privacy")
    if learned and config.learned_lr.clip is None:
        return ("learned_lr.clip", "required with server.lr: learned and privacy: the bound "
                                   "of one holdout client's |dF_k/d log lr| (forward) or "
                                   "gradient norm (reverse) in the privatized hypergradient")
    if learned and p.sampling != "fixed":
        return ("privacy.sampling", "'poisson' with server.lr: learned: the holdout cohort "
                                    "is drawn at fixed size, which Poisson accounting does "
                                    "not cover; use sampling fixed")
    return None


def resolved_server_optimizer(config: Config) -> ResolvedServerOptimizer:
    """The config's server optimizer with every hyperparameter's value, and which of them
    are the optimizer's defaults (not in the config)."""
    return _resolve_server(config.algorithm, config.server, config.learned_lr.init)


def validate_config(data: Any) -> Config:
    """Validates a parsed config (a mapping, e.g. YAML's); raises :class:`ConfigError`."""
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_one_line(e, Config)) from None


def load_config(path: str | PathLike[str], overrides: Iterable[str] = ()) -> Config:
    """Reads a YAML config, applies ``--set key=value`` overrides, and validates it.

    Args:
        path: the YAML file.
        overrides: ``key=value`` strings; dotted keys reach nested sections
            (``server.lr=0.5``); values are parsed as YAML (``3``, ``0.1``, ``inf``,
            ``true``, ``null``). Applied in order: of two for the same key, the last wins.

    Returns:
        The validated :class:`Config`.

    Raises:
        ConfigError: unreadable file, invalid YAML, a key given twice in one mapping,
            malformed or unknown override, or an invalid value; one line naming the key.
    """
    return validate_config(with_overrides(read_config_file(path), overrides))


def with_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of the parsed config ``data`` with ``--set key=value`` overrides applied
    (as :func:`load_config` does); not validated."""
    import copy

    result = copy.deepcopy(dict(data))
    for override in overrides:
        apply_override(result, override, Config)
    return result


def check_against_data(config: Config, client_sizes: Iterable[int]) -> None:
    """Checks the config against the clients' data sizes n_k.

    Raises:
        ConfigError: a finite ``batch_size`` exceeds every client's n_k (no client could
            fill one batch).
    """
    sizes = [int(n) for n in client_sizes]
    if not sizes:
        raise ConfigError("the data has no clients (client_sizes is empty)")
    largest = max(sizes)
    if config.batch_size != math.inf and config.batch_size > largest:
        raise ConfigError(
            f"config key 'batch_size': {config.batch_size} is larger than every client's data"
            f" (max n_k = {largest}); use a value <= {largest} or inf"
        )


# A config as the JSON dict that summary.json and a checkpoint's fingerprint hold:
# a section or key that is off is left out, so an older run's saved config and this dump
# compare equal (its resume, its finished-run check) and a config validates back.
def config_to_dict(config: Config) -> dict[str, Any]:
    """A JSON-serializable dict of ``config``, a ``fedax.spec.config.Config`` (B = inf
    as ``"inf"``); it validates back.
    ``learned_lr`` appears only with ``server.lr: learned`` (it applies only then), and
    ``privacy``, ``compression``, ``robust``, ``secure`` and ``attack`` only when given, and
    ``per_client_eval`` only when on, ``client`` only with early stopping, and
    ``execution.mode`` and ``asynchronous`` only with ``mode: async``, ``network`` only
    with ``mode: network`` (configs written before they existed dump as before)."""
    data = config.model_dump(mode="json")
    if not config.per_client_eval:
        data.pop("per_client_eval")
    if config.client == ClientConfig():
        data.pop("client")
    else:  # only the keys given (an absent key is its default)
        data["client"] = {k: v for k, v in data["client"].items() if v is not None}
    if config.server.lr != "learned":
        data.pop("learned_lr")
    if not config.algorithm_options:
        data.pop("algorithm_options")
    if config.privacy is None:
        data.pop("privacy")
    if config.compression is None:
        data.pop("compression")
    for section in ("robust", "attack", "secure"):
        if getattr(config, section) is None:
            data.pop(section)
    if config.execution.mode == "sync":  # the default engine dumps as before it had a name
        data["execution"].pop("mode")
    if config.execution.mode != "async" and not (config.execution.mode == "network"
                                                 and config.network.asynchronous):
        data.pop("asynchronous")
    if config.execution.mode != "network":
        data.pop("network")
    return data
