"""The sections of an experiment config (``fedax.experiments.config``): the server
optimizer, the data sets', local training on the clients, the learned server lr, privacy,
compression, robust aggregation and attacks, each a strict pydantic model that forbids
unknown keys, and the value types they share (``Number``, ``BatchSize``); the engine
sections are in ``fedax.experiments.engines``. A validator's error about another key than
its own is a ``_KeyedError`` naming that key (dotted)."""

from __future__ import annotations

import functools
import math
import re
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    create_model,
    model_serializer,
    model_validator,
)

from fedax.algorithms import (
    ALGORITHMS,
    SERVER_OPTIMIZERS,
    ServerOptimizerError,
    resolve_server_optimizer,
)
from fedax.algorithms.server_optimizers import Hyperparameter, ResolvedServerOptimizer
from fedax.client import EBStopping, eb_stopping


class _KeyedError(ValueError):
    """A validator's error about another key than the one it validates (``key``, dotted)."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


_FLOAT_STRING = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _float_from_string(value: Any) -> Any:
    # YAML 1.1 reads `1e-3` (no dot) as a string; accept numeric strings for float keys.
    if isinstance(value, str) and _FLOAT_STRING.fullmatch(value.strip()):
        return float(value)
    return value


Number = Annotated[float, BeforeValidator(_float_from_string)]


def _batch_size(value: Any) -> int | float:
    if isinstance(value, str) and value.strip().lower() in ("inf", ".inf", "infinity"):
        return math.inf
    if isinstance(value, float) and value == math.inf:
        return math.inf
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(f"must be an integer >= 1 or inf, got {value!r}")


BatchSize = Annotated[
    Union[int, float],  # noqa: UP007 (pydantic inspects the annotation)
    PlainValidator(_batch_size),
    PlainSerializer(lambda v: "inf" if v == math.inf else v),
]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _ServerSection(_Section):
    """Written with the keys given only: an absent key is the optimizer's default."""

    @model_serializer(mode="wrap")
    def _given_keys(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


def _server_lr(limits: Hyperparameter, value: Any) -> float | str | None:
    """``server.lr``: a number in its range, or ``"learned"``."""
    if value is None or value == "learned":
        return value
    number = _float_from_string(value)
    if isinstance(number, bool) or not isinstance(number, (int, float)) \
            or not math.isfinite(number):
        raise ValueError(f"must be a number > 0 or 'learned', got {value!r}")
    for bound, ok in (("gt", number > (limits.gt or 0)), ("ge", number >= (limits.ge or 0)),
                      ("lt", number < (limits.lt or math.inf)),
                      ("le", number <= (limits.le or math.inf))):
        if getattr(limits, bound) is not None and not ok:
            sign = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}[bound]
            raise ValueError(f"must be {sign} {getattr(limits, bound)} (or 'learned'), "
                             f"got {number!r}")
    return float(number)


def _server_fields() -> dict[str, Any]:
    """``optimizer`` and every hyperparameter of every server optimizer, each optional."""
    hyperparameters: dict[str, Hyperparameter] = {}  # same range in every optimizer (tested)
    order: list[str] = []  # each optimizer's keys in its order (b2 goes before tau)
    for spec in SERVER_OPTIMIZERS.values():
        keys = list(spec.hyperparameters)
        for i, key in enumerate(keys):
            hyperparameters.setdefault(key, spec.hyperparameters[key])
            if key not in order:
                later = [k for k in keys[i + 1:] if k in order]
                order.insert(order.index(later[0]) if later else len(order), key)
    fields: dict[str, Any] = {
        "optimizer": (Literal[tuple(SERVER_OPTIMIZERS)] | None, None)}
    for key in order:
        h = hyperparameters[key]
        if h.kind is bool:
            fields[key] = (bool | None, None)
        elif key == "lr":  # a number, or "learned" (by hypergradient: see learned_lr)
            fields[key] = (Annotated[Any, PlainValidator(functools.partial(_server_lr, h))],
                           None)
        else:
            fields[key] = (Number | None, Field(None, gt=h.gt, ge=h.ge, lt=h.lt, le=h.le,
                                                allow_inf_nan=False))
    return fields


ServerConfig = create_model(
    "ServerConfig", __base__=_ServerSection, __module__=__name__,
    __doc__="The server optimizer on the pseudo-gradient, one spec: ``optimizer`` (default: "
            "the algorithm's, else sgd), ``lr`` and its hyperparameters (absent: defaults).",
    **_server_fields())


def _resolve_server(algorithm: str, server: BaseModel,
                    learned_init: float | None = None) -> ResolvedServerOptimizer:
    """The server optimizer of ``algorithm`` with ``server``'s keys; a key that does not apply
    raises ``_KeyedError`` naming it (``server.<key>``)."""
    spec = ALGORITHMS[algorithm]
    try:
        name = spec.server_optimizer_name(server.optimizer)
    except ValueError as err:
        raise _KeyedError("server.optimizer", f"{err} (--set server.optimizer=null leaves "
                                              "it out)") from None
    given = {k: v for k, v in server.model_dump().items() if k != "optimizer" and v is not None}
    if given.get("lr") == "learned":
        given.pop("lr")  # resolved at its initial value (learned_lr.init, else the default)
        if learned_init is not None:
            given["lr"] = learned_init
    allowed = ", ".join(["optimizer", *SERVER_OPTIMIZERS[name].hyperparameters])
    for key in given:
        if key not in SERVER_OPTIMIZERS[name].hyperparameters:
            how = (f" (implied by algorithm {algorithm!r})" if spec.server_optimizer else
                   "" if server.optimizer else " (the default; choose one with server.optimizer)")
            raise _KeyedError(f"server.{key}", f"server optimizer {name!r}{how} has no"
                                             f" hyperparameter {key!r}; allowed: {allowed}"
                                             f" (remove it, or --set server.{key}=null)")
    try:
        return resolve_server_optimizer(name, **given)
    except ServerOptimizerError as err:
        raise _KeyedError(f"server.{err.key}", str(err)) from None


class ShakespeareConfig(_Section):
    """The Shakespeare data set of McMahan et al. (2017), ``dataset: shakespeare``: one
    client per speaking role (``partition: natural``) or the balanced IID variant
    (``partition: iid``). ``max_clients`` keeps a seeded random subset of the roles (the full
    1,294 clients are heavy for a CPU); ``sample``: ``chunk`` (non-overlapping 80-character
    windows of a role's text) or ``line`` (one sample per printed line)."""

    max_clients: int | None = Field(None, gt=0)
    sample: Literal["chunk", "line"] = "chunk"
    seq_len: int = Field(80, gt=1)


class SyntheticConfig(_Section):
    """Synthetic(α, β) of Li et al. (FedProx, 2020), ``dataset: synthetic``: α spreads the
    local models, β the local input means (standard deviations); ``iid`` generates the IID
    variant instead (α and β ignored). ``num_clients`` is the number of devices."""

    alpha: Number = Field(1.0, ge=0, allow_inf_nan=False)
    beta: Number = Field(1.0, ge=0, allow_inf_nan=False)
    iid: bool = False


class ClientConfig(_Section):
    """Local training on the clients. ``stopping``: ``none`` (every client runs its E
    epochs) or ``eb``: a client stops its local steps when the evidence-based criterion of
    Mahsereci et al. (2017) says its gradient is noise, from the per-example gradients of
    its batch, with no validation data (``fedax.client.early_stopping``;
    docs/early-stopping.md). E stays the cap. The criterion is checked before every
    ``stopping_every``-th step; the client stops when it exceeds ``stopping_threshold``,
    averaged over checks with weight ``stopping_smoothing`` on the past;
    ``stopping_calibrated`` corrects it for small batches. Each round then reports the steps
    taken (their min, max, total and a per-client histogram) and ``stopped_early``. For the
    algorithms whose clients run local steps (not fedsgd), and not with ``privacy.level:
    example`` (the criterion reads the raw per-example gradients)."""

    # none: E epochs; eb: the evidence-based criterion (fedax.client.early_stopping)
    stopping: Literal["none", "eb"] = "none"
    # check before steps m, 2m, ... (absent: 1, every step)
    stopping_every: int | None = Field(None, ge=1)
    # stop when the criterion exceeds it (absent: 0, the paper's); at most 1, and 1 never
    # stops (the criterion is at most 1): the steps are reported, not cut
    stopping_threshold: Number | None = Field(None, le=1, allow_inf_nan=False)
    # β, the weight of earlier checks in an exponential average (absent: 0, no averaging)
    stopping_smoothing: Number | None = Field(None, ge=0, lt=1)
    # scale the sum by (B-3)/(B-1), which centres the criterion at 0 when the gradient is
    # noise (absent: false, the paper's form, which averages -2/(B-3) there)
    stopping_calibrated: bool | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ClientConfig:
        if self.stopping == "none":
            for key in ("stopping_every", "stopping_threshold", "stopping_smoothing",
                        "stopping_calibrated"):
                if getattr(self, key) is not None:
                    raise _KeyedError(f"client.{key}", "applies with client.stopping: eb only")
        return self

    def stopping_rule(self) -> EBStopping | None:
        """The ``fedax.client.EBStopping`` of this section, or None (``stopping: none``)."""
        if self.stopping == "none":
            return None
        return eb_stopping(
            every=1 if self.stopping_every is None else self.stopping_every,
            threshold=0.0 if self.stopping_threshold is None else self.stopping_threshold,
            smoothing=0.0 if self.stopping_smoothing is None else self.stopping_smoothing,
            calibrated=bool(self.stopping_calibrated))


def algorithm_options_problem(config: Any) -> tuple[str, str] | None:
    """Why ``config.algorithm_options`` does not fit the algorithm's declared options
    (``AlgorithmSpec.options``: name -> default, whose type the value must have), as
    ``(key, message)``, or None. A new option is declared in its algorithm's registry entry
    only; the config learns it from there."""
    declared = ALGORITHMS[config.algorithm].options
    for name, value in config.algorithm_options.items():
        key = f"algorithm_options.{name}"
        if name not in declared:
            allowed = ", ".join(declared) or "none"
            return key, (f"algorithm {config.algorithm!r} has no option {name!r} (its "
                         f"options: {allowed})")
        default = declared[name]
        number = isinstance(default, float) and isinstance(value, int | float)
        if type(value) is not type(default) and not (number and type(value) is not bool):
            return key, (f"must be a {type(default).__name__} like its default "
                         f"{default!r}, got {value!r}")
    if "mu" in config.algorithm_options and "mu" in config.model_fields_set:
        return "mu", "give FedProx's mu once: as algorithm_options.mu (or the older mu)"
    return None


class LearnedLRConfig(_Section):
    """``server.lr: learned``: η is learned by hypergradient descent on a holdout loss
    (``fedax.hyper.learned_server_lr_in_state``): each round, ``holdout_clients`` clients
    drawn independently of the cohort give the loss whose derivative in log η, through the
    whole round (``mode`` forward or reverse), drives Adam at ``hyper_lr`` on log η,
    starting from ``init`` (default: the optimizer's default η)."""

    init: Number | None = Field(None, gt=0, allow_inf_nan=False)
    hyper_lr: Number = Field(0.05, gt=0, allow_inf_nan=False)
    holdout_clients: int | None = Field(None, ge=1)  # default: the cohort size
    mode: Literal["forward", "reverse"] = "forward"
    # With privacy (user level): one holdout client's bound in the privatized hypergradient,
    # |dF_k/d log η| (forward) or ‖∇F_k‖ (reverse) (fedax.hyper.private_learned_server_lr).
    clip: Number | None = Field(None, gt=0, allow_inf_nan=False)


class PrivacyConfig(_Section):
    """User-level DP-FedAvg (McMahan et al. 2018): the aggregator clips each client's update
    and noises the sum (``fedax.aggregators``), and ``fedax.privacy`` reports ε. With
    ``level: example``, each client instead trains with DP-SGD (per-example ``clip`` and
    ``noise_multiplier``, ``fedax.client.dp_local_train``; FedAvg, FedProx, FedOpt) and ε is
    example-level (``fedax.privacy.ExampleLevelLedger``).

    ``mechanism``: ``gaussian`` (a fixed clip ``clip``, flat or ``per_layer``), ``adaptive``
    (Andrew et al.'s quantile-tracking clip from ``clip``, default 0.1, towards
    ``target_quantile`` at ``clip_learning_rate``, the count noised with ``count_stddev``,
    default max(m/20, z): it must exceed z/2, and m/20 alone does not on small cohorts) or
    ``adaclip`` (coordinate-wise, from ``clip``; ``pin_scale: true`` pins
    its scale at ``clip`` so that only the allocation over coordinates adapts, the stable
    choice when d·z²/m > 1), or distributed DP with a ``secure`` section: ``skellam`` or
    ``discrete_gaussian`` noise added by each client to its quantized update before the
    secure sum (Kairouz et al. 2021; Agarwal et al. 2021). ``noise_multiplier`` z,
    or ``target_epsilon`` alone (then z is the smallest that keeps ``rounds`` rounds within
    it); with both, the run stops before the round that would exceed the budget.
    ``sampling``: ``fixed`` (the cohort of ``client_fraction``·N clients, as without DP;
    accounted as sampling without replacement, replace-one neighbours) or ``poisson`` (each
    client joins with probability ``client_fraction``; add-or-remove-one neighbours).
    The denominator of the average is the expected cohort size m.

    Every upload of a round is privatized and counted, or the run is refused here
    (``private_combination``): an algorithm that uploads exact sums beside its update
    (SCAFFOLD, FedNova: their registry's ``exact_sums``) cannot run under user-level DP,
    and ``server.lr: learned`` privatizes its holdout hypergradient (``learned_lr.clip``),
    one more release a round (``fedax.experiments.privacy_plan``)."""

    level: Literal["user", "example"] = "user"
    mechanism: Literal["gaussian", "adaptive", "adaclip", "skellam",
                       "discrete_gaussian"] | None = None
    noise_multiplier: Number | None = Field(None, ge=0, allow_inf_nan=False)
    target_epsilon: Number | None = Field(None, gt=0, allow_inf_nan=False)
    delta: Number = Field(1e-5, gt=0, lt=1)
    clip: Number | None = Field(None, gt=0, allow_inf_nan=False)
    per_layer: bool = False
    pin_scale: bool = False
    target_quantile: Number = Field(0.5, ge=0, le=1)
    clip_learning_rate: Number = Field(0.2, ge=0, allow_inf_nan=False)
    count_stddev: Number | None = Field(None, ge=0, allow_inf_nan=False)
    accountant: Literal["rdp", "pld"] = "rdp"
    sampling: Literal["fixed", "poisson"] = "fixed"

    @model_validator(mode="after")
    def _consistent(self) -> PrivacyConfig:
        if self.level == "example":
            for key in ("mechanism", "count_stddev"):
                if getattr(self, key) is not None:
                    raise _KeyedError(f"privacy.{key}", "applies to level 'user' only (level "
                                                        "'example' is DP-SGD in local training)")
            if self.per_layer or self.sampling != "fixed" or self.accountant != "rdp":
                raise _KeyedError("privacy.level", "level 'example' takes clip, "
                                                   "noise_multiplier, target_epsilon and delta "
                                                   "only (RDP, every round counted)")
            if self.clip is None or self.noise_multiplier is None:
                raise _KeyedError("privacy.clip" if self.clip is None else
                                  "privacy.noise_multiplier",
                                  "level 'example' needs clip (per-example L2 bound) and "
                                  "noise_multiplier")
            return self
        if self.mechanism is None:
            raise _KeyedError("privacy.mechanism", "level 'user' needs a mechanism: gaussian, "
                                                   "adaptive, adaclip, skellam or "
                                                   "discrete_gaussian")
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise _KeyedError("privacy.noise_multiplier", "give noise_multiplier (z >= 0) or "
                                                          "target_epsilon (or both)")
        if self.mechanism in ("gaussian", "skellam", "discrete_gaussian") and self.clip is None:
            raise _KeyedError("privacy.clip", f"mechanism {self.mechanism!r} needs clip (S > 0)")
        if self.per_layer and self.mechanism != "gaussian":
            raise _KeyedError("privacy.per_layer", "applies to mechanism 'gaussian' only")
        if self.pin_scale and (self.mechanism != "adaclip" or self.clip is None):
            raise _KeyedError("privacy.pin_scale", "applies to mechanism 'adaclip' with a "
                                                   "clip (the pinned scale)")
        if self.mechanism != "adaptive":
            for key in ("count_stddev",):
                if getattr(self, key) is not None:
                    raise _KeyedError(f"privacy.{key}", "applies to mechanism 'adaptive' only")
        if self.mechanism == "adaptive" and self.count_stddev is not None \
                and self.noise_multiplier is not None and self.noise_multiplier > 0 \
                and not self.noise_multiplier < 2 * self.count_stddev:
            raise _KeyedError(
                "privacy.count_stddev", f"{self.count_stddev:g} is too small for "
                f"noise_multiplier {self.noise_multiplier:g}: adaptive clipping needs z < "
                f"2*count_stddev (the count's noise must leave budget for the update's); "
                f"set it above {self.noise_multiplier / 2:g} or omit it (default "
                "max(m/20, z))")
        if self.accountant == "pld" and self.sampling == "fixed":
            raise _KeyedError("privacy.accountant", "'pld' needs sampling: poisson "
                                                    "(dp-accounting has no PLD for sampling "
                                                    "without replacement); use 'rdp'")
        return self


class CompressionConfig(_Section):
    """A compressed uplink (``fedax.aggregators.compression``): each client encodes its
    update, the server decodes and averages. ``scheme``: ``qsgd`` (Alistarh et al.; s =
    ``levels`` per sign, ⌈log₂(2s+1)⌉ bits a coordinate, a norm per ``bucket_size``),
    ``rotation`` (Suresh et al.; randomized Hadamard over ``block_size`` blocks + ``bits``-bit
    stochastic quantization), ``top_k`` (the ``fraction`` of largest coordinates per leaf),
    ``float16``, ``bfloat16`` or ``int8`` (per-bucket scale). ``error_feedback`` keeps each
    client's residual as per-client state (deterministic schemes only). With ``privacy``
    (mechanism ``gaussian``) each decoded message is clipped to ``privacy.clip`` again on the
    server before the sum and the noise, which keeps the sensitivity (``dp_compressed``)."""

    scheme: Literal["qsgd", "rotation", "top_k", "float16", "bfloat16", "int8"]
    levels: int | None = Field(None, ge=1, le=2**15)  # qsgd
    bits: int | None = Field(None, ge=1, le=16)  # rotation
    fraction: Number | None = Field(None, gt=0, le=1)  # top_k
    error_feedback: bool = False
    bucket_size: int = Field(512, ge=1)  # qsgd, int8
    block_size: int = Field(4096, ge=2)  # rotation

    @model_validator(mode="after")
    def _consistent(self) -> CompressionConfig:
        needs = {"qsgd": "levels", "rotation": "bits", "top_k": "fraction"}
        for scheme, key in needs.items():
            given = getattr(self, key) is not None
            if self.scheme == scheme and not given:
                raise _KeyedError(f"compression.{key}", f"scheme {scheme!r} needs {key}")
            if self.scheme != scheme and given:
                raise _KeyedError(f"compression.{key}", f"applies to scheme {scheme!r} only")
        if self.error_feedback and self.scheme in ("qsgd", "rotation"):
            raise _KeyedError("compression.error_feedback",
                              f"applies to the deterministic schemes (top_k, float16, "
                              f"bfloat16, int8); {self.scheme!r} is unbiased: omit it")
        if self.block_size & (self.block_size - 1):
            raise _KeyedError("compression.block_size",
                              f"must be a power of 2, got {self.block_size}")
        return self


class SecureConfig(_Section):
    """Secure aggregation (Bonawitz et al. 2017; SecAgg+, Bell et al. 2020): the server
    learns only the sum of the clients' quantized updates (``fedax.aggregators.secure``;
    docs/secure-aggregation.md). Each coordinate is clipped to [−``clip``, ``clip``],
    rounded stochastically to ``levels`` steps per side (default: the most the cohort
    allows without wrap-around, at most 2^22) and summed mod 2^``bits``; a cohort whose sum
    could wrap is refused. Without ``privacy`` it is FedAvg's weighted mean, each weight
    n_k/``max_weight`` capped at 1 (default ``max_weight``: the largest n_k of the data; the
    network engine needs it given). With ``privacy.mechanism: gaussian`` the server noises
    the secure sum (``clip`` defaults to privacy.clip); with ``skellam`` or
    ``discrete_gaussian`` each client noises its own integers (distributed DP), so no party
    sees an unnoised sum. In simulation the primitive's exact arithmetic runs; over the
    network the SecAgg+ protocol (``num_shares`` k, the neighbourhood a client shares its
    secrets with, itself included; ``threshold`` t of them to unmask; defaults:
    min(n, 2⌈log2 n⌉+1), odd, and max(⌊k/2⌋+1, ⌊2k/3⌋): more than half, so that a server
    lying about drop-outs cannot gather both secrets of one client)."""

    bits: int = Field(32, ge=1, le=32)
    clip: Number | None = Field(None, gt=0, allow_inf_nan=False)
    levels: int | None = Field(None, ge=1)
    max_weight: Number | None = Field(None, gt=0, allow_inf_nan=False)
    num_shares: int | None = Field(None, ge=3)
    threshold: int | None = Field(None, ge=2)


class RobustConfig(_Section):
    """A robust aggregator (``fedax.aggregators.robust``; docs/references.md, robust aggregation and
    attacks) instead of the weighted mean: ``rule`` ``median`` or ``trimmed_mean`` (``beta``: ⌊β·n⌋
    cut per end; Yin et al.), ``krum`` (``byzantine`` f) or ``multi_krum`` (f and ``keep`` m;
    Blanchard et al.), ``geometric_median`` (RFA's smoothed Weiszfeld, ``iterations``,
    ``smoothing``; Pillutla et al.) or ``norm_bounding`` (clip to ``norm_bound`` M, then the mean,
    with ``noise_stddev`` the "weak DP" noise; Sun et al.). ``clip``: clip each update to this norm
    first (a client stage before the rule). With ``privacy`` it is an error: DP noise needs a sum
    (see ``fedax.aggregators.check_private_reduction``)."""

    rule: Literal["median", "trimmed_mean", "krum", "multi_krum", "geometric_median",
                  "norm_bounding"]
    beta: Number | None = Field(None, ge=0, lt=0.5)  # trimmed_mean
    byzantine: int | None = Field(None, ge=0)  # krum, multi_krum
    keep: int | None = Field(None, ge=1)  # multi_krum
    norm_bound: Number | None = Field(None, gt=0, allow_inf_nan=False)  # norm_bounding
    noise_stddev: Number | None = Field(None, ge=0, allow_inf_nan=False)  # norm_bounding
    iterations: int | None = Field(None, ge=0)  # geometric_median (default 4)
    smoothing: Number | None = Field(None, gt=0, allow_inf_nan=False)  # geometric_median
    clip: Number | None = Field(None, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _consistent(self) -> RobustConfig:
        needs = {"trimmed_mean": ("beta",), "krum": ("byzantine",),
                 "multi_krum": ("byzantine", "keep"), "norm_bounding": ("norm_bound",)}
        optional = {"noise_stddev": ("norm_bounding",), "iterations": ("geometric_median",),
                    "smoothing": ("geometric_median",)}
        for key in ("beta", "byzantine", "keep", "norm_bound", *optional):
            rules = [r for r, keys in needs.items() if key in keys] or list(optional[key])
            given = getattr(self, key) is not None
            if given and self.rule not in rules:
                raise _KeyedError(f"robust.{key}",
                                  f"applies to rule {' or '.join(map(repr, rules))} only")
            if not given and key in needs.get(self.rule, ()):
                raise _KeyedError(f"robust.{key}", f"rule {self.rule!r} needs {key}")
        return self

    def options(self) -> dict[str, Any]:
        """The rule's keyword arguments for ``fedax.aggregators.robust``."""
        names = {"beta": "beta", "byzantine": "byzantine", "keep": "keep",
                 "norm_bound": "max_norm", "noise_stddev": "noise_stddev",
                 "iterations": "iterations", "smoothing": "smoothing"}
        return {names[k]: getattr(self, k) for k in names if getattr(self, k) is not None}


class AttackConfig(_Section):
    """Simulated attackers (``fedax.attacks``; docs/references.md, robust aggregation and attacks):
    a ``fraction`` of the population, chosen by ``seed`` (default: the run's seed), misbehaves every
    round it is sampled. ``kind``: ``label_flip`` (train on y' = K−1−y), ``backdoor`` (a fraction
    ``poison_fraction`` of their examples carry a 4×4 trigger and label ``target``; with ``scale``,
    the update is boosted by λ after projecting to ``project``; the records get
    ``backdoor_success``), ``sign_flip`` (−μ of the honest updates), ``scaled`` (λ·Δ, ``scale`` λ
    default: clients per round, ``project``), ``gaussian`` (N(0, ``stddev``²)), ``alie`` (μ − zσ,
    ``z`` default Baruch et al.'s z_max) or ``ipm`` (−``epsilon``·μ)."""

    kind: Literal["label_flip", "backdoor", "sign_flip", "scaled", "gaussian", "alie", "ipm"]
    fraction: Number = Field(ge=0, lt=1)
    seed: int | None = None
    scale: Number | None = Field(None, allow_inf_nan=False)  # scaled, backdoor
    project: Number | None = Field(None, gt=0, allow_inf_nan=False)  # scaled, backdoor
    stddev: Number | None = Field(None, ge=0, allow_inf_nan=False)  # gaussian
    z: Number | None = Field(None, allow_inf_nan=False)  # alie
    epsilon: Number | None = Field(None, gt=0, allow_inf_nan=False)  # ipm
    target: int | None = Field(None, ge=0)  # backdoor
    poison_fraction: Number | None = Field(None, gt=0, le=1)  # backdoor

    @model_validator(mode="after")
    def _consistent(self) -> AttackConfig:
        applies = {"scale": ("scaled", "backdoor"), "project": ("scaled", "backdoor"),
                   "stddev": ("gaussian",), "z": ("alie",), "epsilon": ("ipm",),
                   "target": ("backdoor",), "poison_fraction": ("backdoor",)}
        for key, kinds in applies.items():
            if getattr(self, key) is not None and self.kind not in kinds:
                raise _KeyedError(f"attack.{key}",
                                  f"applies to kind {' or '.join(map(repr, kinds))} only")
        return self
