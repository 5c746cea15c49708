"""Server optimizers: one spec, ``server_optimizer(name, **hyperparameters)``, for every optax
transform a federated algorithm applies to its pseudo-gradient.

The server optimizer of FedAvg (FedSGD, FedProx, SCAFFOLD) receives the pseudo-gradient
g_t = x_t − mean_i(x_i) = −Δ_t, the server model minus the mean client model (Reddi et al.'s
Δ_t is the mean client *change*, client − server, hence the sign), and returns the step to
*add* to x_t (``optax.apply_updates``). ``SERVER_OPTIMIZERS`` lists them, each with its
hyperparameters (defaults, allowed ranges) and the paper it comes from:

    sgd       x_{t+1} = x_t + η Δ_t                               FedAvg at η = 1
    momentum  m_t = β m_{t−1} + Δ_t;  x_{t+1} = x_t + η m_t       FedAvgM (Hsu et al. 2019)
    adagrad   v_t = v_{t−1} + Δ_t²                                FedAdagrad
    adam      v_t = β2 v_{t−1} + (1 − β2) Δ_t²                    FedAdam
    yogi      v_t = v_{t−1} − (1 − β2) Δ_t² sign(v_{t−1} − Δ_t²)  FedYogi
    amsgrad   v_t as adam's;  v̂_t = max(v̂_{t−1}, v_t)             FedAMSGrad

The last four (Reddi et al. 2021, Algorithm 2) share m_t = β1 m_{t−1} + (1 − β1) Δ_t and
x_{t+1} = x_t + η m_t / (√v_t + τ) (amsgrad: v̂_t in place of v_t), with m_{−1} = 0 and no
bias correction. The paper requires v_{−1} ≥ τ²; we start at v_{−1} = τ² (the smallest
allowed) unless ``initial_accumulator`` is given (the authors' TFF experiments used Keras
optimizers, whose Adagrad accumulator starts at 0). Since m_t is linear in Δ and v_t depends
on Δ² only, the transform computes m on g = −Δ and returns −η m/(√v + τ), exactly the paper's
step. FedAvgM is heavy-ball momentum without dampening (Keras/TFF ``SGD(momentum)``), i.e.
``optax.sgd(η, β)`` on −Δ_t.

The learning rate η lives in the optimizer state (``optax.inject_hyperparams``):
``server_learning_rate(opt_state)`` reads it, ``with_server_learning_rate`` replaces it, and it
may be given as a (traced) array, e.g. to learn it, or as an optax schedule. The other
hyperparameters are constants of the transform. ``fedadagrad``, ``fedadam``, ``fedyogi``,
``fedamsgrad`` and ``fedavgm`` are the same transforms under their FedOpt names.

How the adaptive ones differ from optax's own ``adam`` / ``yogi`` / ``adagrad`` / ``amsgrad``:

* **bias correction**: optax divides m and v by 1 − β^t (AMSGrad: the max is taken over the
  corrected v); Reddi et al. do not, so early rounds take smaller steps here.
* **where τ enters**: here τ is added to √v (as optax's ``eps``, not ``eps_root``); optax's
  ``adagrad`` instead adds its eps inside the root, g/√(v + eps), and returns 0 where v = 0.
* **initial v**: here τ² (paper); optax ``adam``/``amsgrad`` start at 0, ``yogi`` at 1e-6 (and
  also starts *m* at 1e-6), ``adagrad`` at 0.1.
* **momentum in Adagrad**: FedAdagrad keeps the paper's m_t with β1 (default 0, i.e. plain
  Adagrad, as in the paper's experiments); optax's ``adagrad`` has no momentum.
* **defaults**: τ = 1e-3 (the authors' recommended default), β1 = 0.9, β2 = 0.99 for
  Adam/Yogi/AMSGrad (the paper's; the TFF run scripts used Keras' 0.999); η = 0.01 for
  Adam/Yogi/AMSGrad and 0.1 for Adagrad, in the range of the paper's tuned values (tune η
  per task).

Note also that fedax's FedAvg forms the mean client model with n_k weights, whereas the
paper's Δ_t is the unweighted 1/|S| mean.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

# ---------------------------------------------------------------------------------------
# The transforms (η may be an array: inject_hyperparams passes the state's value).


class FedAdaptiveState(NamedTuple):
    """State of FedAdagrad / FedAdam / FedYogi: first moment m, second moment v."""

    m: Any
    v: Any


class FedAMSGradState(NamedTuple):
    """State of FedAMSGrad: m, v and the running maximum v̂ of v."""

    m: Any
    v: Any
    v_hat: Any


def _fed_adaptive(
    lr: Any,
    b1: float,
    tau: float,
    v0: float,
    second_moment: Callable[[jax.Array, jax.Array], jax.Array],
    amsgrad: bool = False,
) -> optax.GradientTransformation:
    """m/v/x updates of Algorithm 2 on the pseudo-gradient g = −Δ; ``second_moment(v, g²)``."""

    def init(params):
        m = jax.tree.map(jnp.zeros_like, params)
        v = jax.tree.map(lambda p: jnp.full_like(p, v0), params)
        return FedAMSGradState(m, v, v) if amsgrad else FedAdaptiveState(m, v)

    def update(updates, state, params=None):
        del params
        m = jax.tree.map(lambda mm, g: b1 * mm + (1.0 - b1) * g, state.m, updates)
        v = jax.tree.map(lambda vv, g: second_moment(vv, jnp.square(g)), state.v, updates)
        new_state: FedAMSGradState | FedAdaptiveState
        if amsgrad:
            v_hat = jax.tree.map(jnp.maximum, state.v_hat, v)
            new_state, denom = FedAMSGradState(m, v, v_hat), v_hat
        else:
            new_state, denom = FedAdaptiveState(m, v), v
        steps = jax.tree.map(lambda mm, vv: -lr * mm / (jnp.sqrt(vv) + tau), m, denom)
        return steps, new_state

    return optax.GradientTransformation(init, update)


def _sgd(learning_rate):
    return optax.sgd(learning_rate)


def _momentum(learning_rate, momentum, nesterov):
    return optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov)


def _adagrad(learning_rate, b1, tau, initial_accumulator):
    return _fed_adaptive(learning_rate, b1, tau, initial_accumulator, lambda v, g2: v + g2)


def _adam(learning_rate, b1, b2, tau, initial_accumulator):
    return _fed_adaptive(learning_rate, b1, tau, initial_accumulator,
                         lambda v, g2: b2 * v + (1.0 - b2) * g2)


def _yogi(learning_rate, b1, b2, tau, initial_accumulator):
    return _fed_adaptive(learning_rate, b1, tau, initial_accumulator,
                         lambda v, g2: v - (1.0 - b2) * g2 * jnp.sign(v - g2))


def _amsgrad(learning_rate, b1, b2, tau, initial_accumulator):
    return _fed_adaptive(learning_rate, b1, tau, initial_accumulator,
                         lambda v, g2: b2 * v + (1.0 - b2) * g2, amsgrad=True)


# ---------------------------------------------------------------------------------------
# The specs.


class ServerOptimizerError(ValueError):
    """An invalid server optimizer spec; ``key`` is the offending key (a hyperparameter's
    name, or ``"optimizer"`` for an unknown name)."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


class Hyperparameter(NamedTuple):
    """One hyperparameter: its default (a value, or a function of the other resolved values),
    what it is, and its range as pydantic-style bounds (``kind`` float or bool)."""

    default: Any
    doc: str
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    kind: type = float

    def range_text(self) -> str:
        """The bounds in words: "in [0, 1)", "> 0", "" (none)."""
        lo = next(((b, v) for b, v in (("(", self.gt), ("[", self.ge)) if v is not None), None)
        hi = next(((b, v) for b, v in ((")", self.lt), ("]", self.le)) if v is not None), None)
        if lo and hi:
            return f" in {lo[0]}{lo[1]:g}, {hi[1]:g}{hi[0]}"
        if lo:
            return f" {'>' if lo[0] == '(' else '>='} {lo[1]:g}"
        if hi:
            return f" {'<' if hi[0] == ')' else '<='} {hi[1]:g}"
        return ""

    def admits(self, value: float) -> bool:
        """Whether the number ``value`` is finite and within the bounds."""
        return (math.isfinite(value)
                and (self.gt is None or value > self.gt) and (self.ge is None or value >= self.ge)
                and (self.lt is None or value < self.lt) and (self.le is None or value <= self.le))


class ServerOptimizerSpec(NamedTuple):
    """A server optimizer: its update rule, the paper, its hyperparameters (``lr`` first) and
    ``make(learning_rate, **the others)``, the transform."""

    name: str
    rule: str
    reference: str
    hyperparameters: Mapping[str, Hyperparameter]
    make: Callable[..., optax.GradientTransformation]
    check: Callable[[str, Mapping[str, Any]], None] | None = None  # joint constraints


def _tau_squared(values: Mapping[str, Any]) -> Any:
    return values["tau"] ** 2


def _tau_or_accumulator_positive(name: str, values: Mapping[str, Any]) -> None:
    tau, v0 = values["tau"], values["initial_accumulator"]
    if _is_number(tau) and _is_number(v0) and tau == 0 and v0 == 0:
        raise ServerOptimizerError(
            "tau", f"server optimizer {name!r}: tau = 0 needs initial_accumulator > 0"
                   " (else m/(√v + τ) is 0/0 where Δ = 0)")


_REDDI = "Reddi et al. 2021, Adaptive Federated Optimization (ICLR), Algorithm 2"
_LR = "server learning rate η"
_B1 = Hyperparameter(0.9, "first-moment decay β1", ge=0, lt=1)
_B2 = Hyperparameter(0.99, "second-moment decay β2", ge=0, lt=1)
_TAU = Hyperparameter(1e-3, "adaptivity τ, added to √v (smaller: more adaptive)", ge=0)
_V0 = Hyperparameter(_tau_squared, "v_{−1} (and v̂_{−1}); default τ², the least the paper "
                     "allows", ge=0)


def _adaptive(name, rule, make, lr, b1=_B1, with_b2=True):
    hyperparameters = {"lr": Hyperparameter(lr, _LR, gt=0), "b1": b1}
    hyperparameters.update({"b2": _B2} if with_b2 else {})
    hyperparameters.update(tau=_TAU, initial_accumulator=_V0)
    return ServerOptimizerSpec(name, rule, _REDDI, MappingProxyType(hyperparameters), make,
                               _tau_or_accumulator_positive)


SERVER_OPTIMIZERS: Mapping[str, ServerOptimizerSpec] = MappingProxyType({s.name: s for s in (
    ServerOptimizerSpec(
        "sgd", "x ← x + η Δ (η = 1: FedAvg's weighted mean of client models)",
        "McMahan et al. 2017, Communication-Efficient Learning of Deep Networks from "
        "Decentralized Data (AISTATS)",
        MappingProxyType({"lr": Hyperparameter(1.0, _LR, gt=0)}), _sgd),
    ServerOptimizerSpec(
        "momentum", "m ← β m + Δ; x ← x + η m (nesterov: x ← x + η (β m + Δ))",
        "Hsu et al. 2019, Measuring the Effects of Non-Identical Data Distribution for "
        "Federated Visual Classification (FedAvgM)",
        MappingProxyType({
            "lr": Hyperparameter(1.0, _LR, gt=0),
            "momentum": Hyperparameter(0.9, "momentum β (0.9 in Reddi et al. 2021)", ge=0, lt=1),
            "nesterov": Hyperparameter(False, "Nesterov momentum", kind=bool),
        }), _momentum),
    _adaptive("adagrad", "v ← v + Δ²; x ← x + η m/(√v + τ) (FedAdagrad)", _adagrad, 0.1,
              b1=_B1._replace(default=0.0, doc="first-moment decay β1 (0: plain Adagrad, "
                                                "the paper's experiments)"), with_b2=False),
    _adaptive("adam", "v ← β2 v + (1 − β2) Δ²; x ← x + η m/(√v + τ) (FedAdam, no bias "
              "correction)", _adam, 0.01),
    _adaptive("yogi", "v ← v − (1 − β2) Δ² sign(v − Δ²); x ← x + η m/(√v + τ) (FedYogi)",
              _yogi, 0.01),
    _adaptive("amsgrad", "v as adam's, v̂ ← max(v̂, v); x ← x + η m/(√v̂ + τ) (FedAMSGrad)",
              _amsgrad, 0.01),
)})
"""Name -> :class:`ServerOptimizerSpec`: every server optimizer ``server_optimizer`` builds."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_))


def _spec(name: str) -> ServerOptimizerSpec:
    if name not in SERVER_OPTIMIZERS:
        raise ServerOptimizerError(
            "optimizer",
            f"unknown server optimizer {name!r}; allowed: {', '.join(SERVER_OPTIMIZERS)}")
    return SERVER_OPTIMIZERS[name]


def _check_value(name: str, key: str, h: Hyperparameter, value: Any) -> None:
    if h.kind is bool:
        if not isinstance(value, (bool, np.bool_)):
            raise ServerOptimizerError(
                key, f"server optimizer {name!r}: {key} must be true or false, got {value!r}")
        return
    if _is_number(value):
        if not h.admits(float(value)):
            raise ServerOptimizerError(
                key, f"server optimizer {name!r}: {key} must be{h.range_text()}, got {value!r}")
    elif not (isinstance(value, (jax.Array, np.ndarray)) or (key == "lr" and callable(value))):
        raise ServerOptimizerError(
            key, f"server optimizer {name!r}: {key} must be a number{h.range_text()}, got"
                 f" {value!r}")


class ResolvedServerOptimizer(NamedTuple):
    """A server optimizer with every hyperparameter's value, ``defaults`` naming those that
    were not given (the spec's defaults)."""

    name: str
    hyperparameters: Mapping[str, Any]
    defaults: tuple[str, ...]
    reference: str

    def as_dict(self) -> dict[str, Any]:
        """``{"name", <hyperparameters>, "defaults", "reference"}``, e.g. for a summary."""
        return {"name": self.name, **self.hyperparameters, "defaults": list(self.defaults),
                "reference": self.reference}


def resolve_server_optimizer(name: str, **hyperparameters: Any) -> ResolvedServerOptimizer:
    """The named server optimizer with the given hyperparameters (a value of None means not
    given) and the spec's defaults for the others, checked.

    Raises:
      ServerOptimizerError (a ValueError): an unknown name, a hyperparameter the optimizer
        does not have (naming it and the allowed ones), or a value out of its range.
        Numbers are checked; arrays (e.g. a traced learning rate) and, for ``lr``, optax
        schedules are taken as they are.
    """
    spec = _spec(name)
    for key in hyperparameters:
        if key not in spec.hyperparameters:
            raise ServerOptimizerError(
                key, f"server optimizer {name!r} has no hyperparameter {key!r}; allowed: "
                     f"{', '.join(spec.hyperparameters)}")
    given = {k: v for k, v in hyperparameters.items() if v is not None}
    values = {}
    for key, h in spec.hyperparameters.items():
        if key in given:
            _check_value(name, key, h, given[key])
            values[key] = given[key]
        elif not callable(h.default):
            values[key] = h.default
    for key, h in spec.hyperparameters.items():  # defaults derived from the others
        if key not in values:
            values[key] = h.default(values)
    values = {key: values[key] for key in spec.hyperparameters}
    if spec.check is not None:
        spec.check(name, values)
    defaults = tuple(key for key in spec.hyperparameters if key not in given)
    return ResolvedServerOptimizer(name, MappingProxyType(values), defaults, spec.reference)


def server_optimizer(name: str, **hyperparameters: Any) -> optax.GradientTransformation:
    """The server optimizer ``name`` (a key of ``SERVER_OPTIMIZERS``) as an optax transform.

    Args:
      name: ``sgd``, ``momentum``, ``adagrad``, ``adam``, ``yogi`` or ``amsgrad``.
      **hyperparameters: the optimizer's own (``SERVER_OPTIMIZERS[name].hyperparameters``);
        ``lr`` is η. Absent or None: the default.

    Returns:
      ``optax.inject_hyperparams`` of the transform: its state holds η as
      ``opt_state.hyperparams["learning_rate"]`` (see ``server_learning_rate``).

    Raises:
      ServerOptimizerError (a ValueError), e.g. "server optimizer 'sgd' has no
      hyperparameter 'b1'; allowed: lr" (see ``resolve_server_optimizer``).
    """
    resolved = resolve_server_optimizer(name, **hyperparameters)
    others = dict(resolved.hyperparameters)
    lr = others.pop("lr")
    make = SERVER_OPTIMIZERS[name].make
    return optax.inject_hyperparams(lambda learning_rate: make(learning_rate, **others))(
        learning_rate=lr)


def server_learning_rate(opt_state: Any) -> jax.Array | None:
    """η held in the state of a ``server_optimizer(...)`` transform, or None for a state
    that holds none (e.g. a plain ``optax.sgd``'s)."""
    hyperparams = getattr(opt_state, "hyperparams", None)
    return hyperparams.get("learning_rate") if isinstance(hyperparams, Mapping) else None


def with_server_learning_rate(opt_state: Any, learning_rate: Any) -> Any:
    """``opt_state`` with η replaced (cast to the held η's dtype); the next update uses it
    (unless η is a schedule, which sets it each step).

    Raises:
      ValueError: the state holds no learning rate (not built by ``server_optimizer``).
    """
    old = server_learning_rate(opt_state)
    if old is None:
        raise ValueError("this server optimizer state holds no learning rate; build the"
                         " optimizer with fedax.algorithms.server_optimizer(...)")
    hyperparams = {**opt_state.hyperparams,
                   "learning_rate": jnp.asarray(learning_rate, jnp.asarray(old).dtype)}
    return opt_state._replace(hyperparams=hyperparams)


# ---------------------------------------------------------------------------------------
# The FedOpt names.


def fedadagrad(
    lr: float, tau: float = 1e-3, b1: float = 0.0, initial_accumulator: float | None = None
) -> optax.GradientTransformation:
    """FedAdagrad, ``server_optimizer("adagrad", ...)``: v_t = v_{t−1} + Δ_t²;
    x ← x + η m_t/(√v_t + τ).

    Args:
      lr: server learning rate η.
      tau: adaptivity τ (smaller: more adaptive).
      b1: first-moment decay β1 (0: plain Adagrad, the paper's experiments).
      initial_accumulator: v_{−1}; default τ² (the paper requires v_{−1} ≥ τ²).
    """
    return server_optimizer("adagrad", lr=lr, b1=b1, tau=tau,
                            initial_accumulator=initial_accumulator)


def fedadam(
    lr: float,
    b1: float = 0.9,
    b2: float = 0.99,
    tau: float = 1e-3,
    initial_accumulator: float | None = None,
) -> optax.GradientTransformation:
    """FedAdam, ``server_optimizer("adam", ...)``: v_t = β2 v_{t−1} + (1 − β2) Δ_t²; no bias
    correction.

    Args:
      lr: server learning rate η.
      b1: first-moment decay β1.
      b2: second-moment decay β2.
      tau: adaptivity τ.
      initial_accumulator: v_{−1}; default τ².
    """
    return server_optimizer("adam", lr=lr, b1=b1, b2=b2, tau=tau,
                            initial_accumulator=initial_accumulator)


def fedyogi(
    lr: float,
    b1: float = 0.9,
    b2: float = 0.99,
    tau: float = 1e-3,
    initial_accumulator: float | None = None,
) -> optax.GradientTransformation:
    """FedYogi, ``server_optimizer("yogi", ...)``: v_t = v_{t−1} − (1 − β2) Δ_t²
    sign(v_{t−1} − Δ_t²); no bias correction.

    Args:
      lr: server learning rate η.
      b1: first-moment decay β1.
      b2: second-moment decay β2.
      tau: adaptivity τ.
      initial_accumulator: v_{−1}; default τ².
    """
    return server_optimizer("yogi", lr=lr, b1=b1, b2=b2, tau=tau,
                            initial_accumulator=initial_accumulator)


def fedamsgrad(
    lr: float,
    b1: float = 0.9,
    b2: float = 0.99,
    tau: float = 1e-3,
    initial_accumulator: float | None = None,
) -> optax.GradientTransformation:
    """FedAMSGrad, ``server_optimizer("amsgrad", ...)``: FedAdam's v_t, then
    v̂_t = max(v̂_{t−1}, v_t) in the denominator.

    Args:
      lr: server learning rate η.
      b1: first-moment decay β1.
      b2: second-moment decay β2.
      tau: adaptivity τ.
      initial_accumulator: v_{−1} = v̂_{−1}; default τ².
    """
    return server_optimizer("amsgrad", lr=lr, b1=b1, b2=b2, tau=tau,
                            initial_accumulator=initial_accumulator)


def fedavgm(lr: float = 1.0, momentum: float = 0.9) -> optax.GradientTransformation:
    """FedAvgM (Hsu et al. 2019), ``server_optimizer("momentum", ...)``:
    m_t = β m_{t−1} + Δ_t; x ← x + η m_t.

    Heavy-ball momentum without dampening (Keras/TFF ``SGD(momentum)``), which is exactly
    ``optax.sgd(lr, momentum)`` applied to the pseudo-gradient −Δ_t.

    Args:
      lr: server learning rate η (the paper's FedAvgM experiments tune it; 1 is FedAvg's).
      momentum: β (0.9 in Reddi et al.).
    """
    return server_optimizer("momentum", lr=lr, momentum=momentum)
