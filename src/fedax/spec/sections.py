"""The sections of an experiment config (``fedax.spec.config``): the server
optimizer, the data sets', local training on the clients and the learned server lr, each a
strict pydantic model that forbids unknown keys, and the value types they share
(``Number``, ``BatchSize``); the sections of what the server aggregates (privacy,
compression, secure and robust aggregation, attacks) are in
``fedax.spec.aggregation_sections``, the engine sections in
``fedax.spec.engines``. A validator's error about another key than its own is a
``_KeyedError`` naming that key (dotted)."""

from __future__ import annotations

import functools
import math
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

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


if TYPE_CHECKING:  # what the type checker knows of the model create_model builds below
    # (named apart: tools/docs_hooks.py reads a "class ServerConfig" in this source as the
    # model's, and the generated config page has the built model's fields)

    class _ServerConfigStub(_ServerSection):
        optimizer: str | None = None
        lr: float | str | None = None  # a number, or "learned"

        def __getattr__(self, name: str) -> Any: ...  # the other hyperparameters

    ServerConfig = _ServerConfigStub
else:
    ServerConfig = create_model(
        "ServerConfig", __base__=_ServerSection, __module__=__name__,
        __doc__="The server optimizer on the pseudo-gradient, one spec: ``optimizer`` "
                "(default: the algorithm's, else sgd), ``lr`` and its hyperparameters "
                "(absent: defaults).",
        **_server_fields())


def _resolve_server(algorithm: str, server: ServerConfig,
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
