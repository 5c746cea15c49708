"""Federated algorithms as ``FederatedAlgorithm(init, round, server_params)``.

``ALGORITHMS`` maps a name to an :class:`AlgorithmSpec`: the algorithm's own options with
their defaults and the server optimizer its name implies, if any. Calling one (or ``make``)
builds the algorithm with uniform keyword arguments:

    alg = make("fedyogi", loss_fn, num_clients=100, client_lr=0.1, server_lr=0.01)
    alg = make("fedavg", loss_fn, num_clients=100, client_lr=0.1,
               server_optimizer="momentum", server_lr=1.0, momentum=0.9)  # = fedavgm

``num_clients`` (the population size) is used by stateful algorithms (SCAFFOLD) and ignored
by the others. The FedOpt names (``fedadagrad``, ``fedadam``, ``fedyogi``, ``fedamsgrad``,
``fedavgm``) are FedAvg with the server optimizer of that name from
``fedax.algorithms.server_optimizers`` (``server_optimizer(name, **hyperparameters)``, one
spec for all); their default server learning rates are in the range of Reddi et al.'s tuned
values (tune them per task).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import optax

from fedax.algorithms.base import (
    ClientMessage,
    CohortBatches,
    FederatedAlgorithm,
    RoundPieces,
    RoundState,
    client_training_keys,
    federated_loss,
    init_state,
    keyless,
)
from fedax.algorithms.fedavg import ServerState, fedavg
from fedax.algorithms.fednova import check_sums as _fednova_check_sums
from fedax.algorithms.fednova import fednova, make_fednova
from fedax.algorithms.fedprox import fedprox, proximal
from fedax.algorithms.fedsgd import fedsgd
from fedax.algorithms.protocol import (
    Reports,
    apply_reports,
    client_half,
    cohort_round,
    compose,
    server_half,
)
from fedax.algorithms.scaffold import ScaffoldServer, scaffold
from fedax.algorithms.scaffold import check_sums as _scaffold_check_sums
from fedax.algorithms.server_optimizers import (
    SERVER_OPTIMIZERS,
    FedAdaptiveState,
    FedAMSGradState,
    ServerOptimizerError,
    fedadagrad,
    fedadam,
    fedamsgrad,
    fedavgm,
    fedyogi,
    resolve_server_optimizer,
    server_learning_rate,
    server_optimizer,
    with_server_learning_rate,
)
from fedax.client import EBStopping, LossFn

AlgorithmFactory = Callable[..., FederatedAlgorithm]
_make_server_optimizer = server_optimizer  # (shadowed by a keyword below)
_UNDECLARED: Any = object()  # a declaration an AlgorithmSpec must make


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
    """A registered algorithm, called as ``spec(loss_fn, *, num_clients, client_lr,
    **options)``.

    Attributes:
      name: the registry name.
      build: ``build(loss_fn, *, num_clients, client_lr, server_optimizer, aggregator,
        **options)``, ``server_optimizer`` an optax transform.
      options: the algorithm's own options (keyword -> default), e.g. FedProx's ``mu``.
      server_optimizer: the server optimizer the name implies (``fedadam``: FedAvg with
        ``adam``), or None: any, ``sgd`` (FedAvg's, η = 1) unless chosen.
      doc: one line: what it is, and the paper.
      exact_sums: *declared, mandatory*: what each client uploads *beside* the aggregated
        update, as exact federated sums (``ClientMessage.sums``: SCAFFOLD's Δc_i, FedNova's
        Σ n_i τ_i and Σ n_i), one phrase each; ``()`` for none. No aggregator clips or
        noises these, so user-level DP and secure aggregation cannot cover them: such an
        algorithm is refused with a private or secure aggregator, from the config and from
        Python alike, and a round whose traced message has sums the declaration denies is
        refused when it is traced (``tests/test_privacy_combinations.py`` checks every
        declaration against the algorithm's own client message).
      client_state: *declared, mandatory*: it keeps per-client state (``RoundPieces.
        client_state``: SCAFFOLD's c_i), which the engine that runs it must keep (the
        simulator's table or store, a real client's disk); buffered asynchronous updates
        carry none, so such an algorithm is refused for ``execution.mode: async``.
      check_sums: ``check_sums(client_lr) -> check(report, payload, steps) -> reason |
        None``, the server's re-check of a report's exact sums from the rest of the report
        (in the algorithm's own module), or None: the server cannot recompute them, and a
        networked run of the algorithm is refused.
      sums_bounded: its exact sums are fixed by the report's checked bounds (n_k and the
        steps: FedNova), so a robust rule on the update still bounds a client's effect; a
        robust aggregator is refused otherwise (SCAFFOLD's c moves by one client's raw Δy).
      example_dp: its local training can run example-level DP-SGD (``example_privacy``).
      local_stopping: its clients can stop their local steps early by the EB criterion
        (``local_stopping``, a ``fedax.client.EBStopping``).
    """

    name: str
    build: Callable[..., FederatedAlgorithm]
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    server_optimizer: str | None = None
    doc: str = ""
    exact_sums: tuple[str, ...] = _UNDECLARED
    client_state: bool = _UNDECLARED
    check_sums: Callable[[float], Callable[..., str | None]] | None = None
    sums_bounded: bool = False
    example_dp: bool = False
    local_stopping: bool = False

    def __post_init__(self) -> None:
        missing = [k for k in ("exact_sums", "client_state")
                   if getattr(self, k) is _UNDECLARED]
        if missing:
            raise ValueError(
                f"algorithm {self.name!r} must declare {' and '.join(missing)} in its "
                "AlgorithmSpec: exact_sums=() or the phrases of what its clients upload as "
                "exact sums beside the update, client_state=True if it keeps per-client state")
        if not isinstance(self.exact_sums, tuple) or not all(
                isinstance(s, str) for s in self.exact_sums):
            raise ValueError(f"algorithm {self.name!r}: exact_sums must be a tuple of "
                             f"phrases, got {self.exact_sums!r}")
        if not isinstance(self.client_state, bool):
            raise ValueError(f"algorithm {self.name!r}: client_state must be True or False, "
                             f"got {self.client_state!r}")
        if (self.check_sums is not None or self.sums_bounded) and not self.exact_sums:
            raise ValueError(f"algorithm {self.name!r} declares no exact_sums, so check_sums "
                             "and sums_bounded do not apply")

    def composition_problem(self, aggregator: Any) -> str | None:
        """Why this algorithm cannot run with ``aggregator`` (a complete ``Aggregator`` or
        None), from the declarations alone, or None."""
        if aggregator is None or not self.exact_sums:
            return None
        if aggregator.private or aggregator.secure is not None:
            able = ", ".join(n for n, s in ALGORITHMS.items() if not s.exact_sums)
            what = "a DP release" if aggregator.private else "secure aggregation"
            return (f"algorithm {self.name!r} uploads {'; '.join(self.exact_sums)} as exact "
                    f"sums beside the update, which {what} does not cover; use one of "
                    f"{able}")
        return None

    def server_optimizer_name(self, requested: str | None = None) -> str:
        """The server optimizer for ``requested`` (a ``SERVER_OPTIMIZERS`` name or None):
        the implied one, else ``requested``, else ``sgd``.

        Raises:
          ValueError: ``requested`` differs from the implied one.
        """
        if self.server_optimizer is None:
            return "sgd" if requested is None else requested
        if requested not in (None, self.server_optimizer):
            raise ValueError(
                f"algorithm {self.name!r} is FedAvg with server optimizer"
                f" {self.server_optimizer!r}, got server optimizer {requested!r}; leave it"
                f" out, or use algorithm 'fedavg' with server optimizer {requested!r}")
        return self.server_optimizer

    def __call__(self, loss_fn: LossFn, *, num_clients: int, client_lr: float,
                 server_optimizer: str | optax.GradientTransformation | None = None,
                 server_lr: Any = None, aggregator: Any = None,
                 example_privacy: tuple[float, float] | None = None,
                 local_stopping: EBStopping | None = None,
                 **options: Any) -> FederatedAlgorithm:
        """Builds the algorithm.

        Args:
          server_optimizer: a ``SERVER_OPTIMIZERS`` name (default: the implied one, or
            ``sgd``), or a ready optax transform (not for the FedOpt names).
          server_lr: its learning rate η (default: the optimizer's).
          aggregator: passed on (default: the algorithm's, the weighted mean).
          example_privacy: ``(l2_clip, noise_multiplier)``: example-level DP-SGD in the
            local steps (FedAvg, FedProx and the FedOpt names only).
          local_stopping: an ``EBStopping`` rule for the clients' local steps (the
            algorithms whose spec says ``local_stopping``).
          **options: the algorithm's own ``options`` and the server optimizer's other
            hyperparameters (``b1``, ``tau``, ``momentum``, ...).

        Raises:
          ValueError: an option that applies to neither, naming it and the allowed ones.
        """
        own = {**self.options, **{k: options.pop(k) for k in list(options) if k in self.options}}
        if server_optimizer is not None and not isinstance(server_optimizer, str):
            if self.server_optimizer is not None:
                raise ValueError(f"algorithm {self.name!r} is FedAvg with server optimizer"
                                 f" {self.server_optimizer!r}; pass its name or hyperparameters,"
                                 " or use algorithm 'fedavg' with this transform")
            extra = [k for k, v in (("server_lr", server_lr), *options.items()) if v is not None]
            if extra:
                raise ValueError(f"algorithm {self.name!r}: {extra[0]!r} does not apply to a"
                                 " server optimizer given as a transform; allowed: "
                                 + ", ".join([*self.options, "aggregator"]))
            transform = server_optimizer
        else:
            name = self.server_optimizer_name(server_optimizer)
            if name not in SERVER_OPTIMIZERS:
                raise ServerOptimizerError("optimizer", f"unknown server optimizer {name!r};"
                                           f" allowed: {', '.join(SERVER_OPTIMIZERS)}")
            hyperparameters = SERVER_OPTIMIZERS[name].hyperparameters
            for key in options:
                if key == "lr" or key not in hyperparameters:
                    allowed = [*self.options, "server_optimizer", "server_lr",
                               *(h for h in hyperparameters if h != "lr"), "aggregator"]
                    raise ValueError(
                        f"algorithm {self.name!r} with server optimizer {name!r} has no option"
                        f" {key!r}; allowed: {', '.join(allowed)}")
            transform = _make_server_optimizer(name, lr=server_lr, **options)
        if example_privacy is not None:
            if not self.example_dp:
                raise ValueError(f"algorithm {self.name!r} has no example-level DP-SGD; use "
                                 "fedavg, fedprox or a FedOpt name, or user-level DP")
            own["example_privacy"] = example_privacy
        if local_stopping is not None:
            if not self.local_stopping:
                able = ", ".join(n for n, s in ALGORITHMS.items() if s.local_stopping)
                raise ValueError(f"algorithm {self.name!r} has no local training to stop "
                                 f"early; use one of {able}")
            own["local_stopping"] = local_stopping
        return self._built(loss_fn, num_clients, client_lr, transform, aggregator, own)

    def _built(self, loss_fn, num_clients, client_lr, transform, aggregator, own):
        """``build`` after the declarations' checks: the aggregator must compose with the
        declared exact sums, a stateful algorithm needs the population size, and the
        pieces must keep per-client state exactly when ``client_state`` says so."""
        problem = self.composition_problem(aggregator)
        if problem is not None:
            raise ValueError(problem)
        if self.client_state and (isinstance(num_clients, bool) or not isinstance(
                num_clients, int) or num_clients < 1):
            raise ValueError(f"algorithm {self.name!r} keeps per-client state and needs "
                             f"num_clients, the population size (a positive int), got "
                             f"{num_clients!r}")
        algorithm = self.build(loss_fn, num_clients=num_clients, client_lr=client_lr,
                               server_optimizer=transform, aggregator=aggregator, **own)
        pieces = algorithm.pieces
        if pieces is not None and (pieces.client_state is not None) != self.client_state:
            raise ValueError(f"algorithm {self.name!r} declares client_state="
                             f"{self.client_state} but its pieces "
                             f"{'keep' if pieces.client_state is not None else 'keep no'} "
                             "per-client state; correct its AlgorithmSpec")
        return algorithm


def _fedavg(loss_fn, *, num_clients, client_lr, server_optimizer, aggregator,
            example_privacy=None, local_stopping=None):
    del num_clients
    return fedavg(loss_fn, optax.sgd(client_lr), server_optimizer, aggregator=aggregator,
                  example_privacy=example_privacy, local_stopping=local_stopping)


def _fedsgd(loss_fn, *, num_clients, client_lr, server_optimizer, aggregator):
    del num_clients
    return fedsgd(loss_fn, client_lr, server_optimizer, aggregator=aggregator)


def _fedprox(loss_fn, *, num_clients, client_lr, server_optimizer, aggregator, mu,
             example_privacy=None, local_stopping=None):
    del num_clients
    return fedprox(loss_fn, optax.sgd(client_lr), mu, server_optimizer, aggregator=aggregator,
                   example_privacy=example_privacy, local_stopping=local_stopping)


def _scaffold(option):
    def build(loss_fn, *, num_clients, client_lr, server_optimizer, aggregator, weighting,
              local_stopping=None):
        return scaffold(loss_fn, client_lr, num_clients, option, server_optimizer, weighting,
                        aggregator=aggregator, local_stopping=local_stopping)

    return build


_REDDI = "Reddi et al. 2021"
_SCAFFOLD_SUMS = ("the control-variate deltas Δc_i (model-sized, from its gradients)",)
_FEDNOVA_SUMS = ("Σ n_i τ_i and Σ n_i (the clients' local steps and data sizes, for τ_eff)",)
_PLAIN: dict[str, Any] = {"exact_sums": (), "client_state": False}  # a FedAvg-like one
ALGORITHMS: dict[str, AlgorithmSpec] = {spec.name: spec for spec in (
    AlgorithmSpec("fedavg", _fedavg, doc="FedAvg (McMahan et al. 2017)", example_dp=True,
                  local_stopping=True, **_PLAIN),
    AlgorithmSpec("fedsgd", _fedsgd, doc="FedSGD, one full-batch gradient a client"
                  " (McMahan et al. 2017)", **_PLAIN),
    AlgorithmSpec("fedprox", _fedprox, {"mu": 0.01}, doc="FedProx, FedAvg with a proximal"
                  " term (μ/2)‖w − w_t‖² (Li et al. 2020)", example_dp=True,
                  local_stopping=True, **_PLAIN),
    AlgorithmSpec("scaffold", _scaffold("II"), {"weighting": "uniform"},
                  doc="SCAFFOLD, Option II (Karimireddy et al. 2020)",
                  exact_sums=_SCAFFOLD_SUMS, client_state=True,
                  check_sums=_scaffold_check_sums, local_stopping=True),
    AlgorithmSpec("scaffold_option1", _scaffold("I"), {"weighting": "uniform"},
                  doc="SCAFFOLD, Option I (Karimireddy et al. 2020)",
                  exact_sums=_SCAFFOLD_SUMS, client_state=True, local_stopping=True),
    AlgorithmSpec("fednova", make_fednova, doc="FedNova, normalized averaging of local"
                  " SGD updates (Wang et al. 2020)", exact_sums=_FEDNOVA_SUMS,
                  client_state=False, check_sums=_fednova_check_sums, sums_bounded=True,
                  local_stopping=True),
    *(AlgorithmSpec(name, _fedavg, server_optimizer=optimizer, doc=doc, example_dp=True,
                    local_stopping=True, **_PLAIN) for name, optimizer, doc in (
        ("fedadagrad", "adagrad", f"FedAdagrad, FedAvg with server Adagrad ({_REDDI})"),
        ("fedadam", "adam", f"FedAdam, FedAvg with server Adam, no bias correction ({_REDDI})"),
        ("fedyogi", "yogi", f"FedYogi, FedAvg with server Yogi ({_REDDI})"),
        ("fedamsgrad", "amsgrad", f"FedAMSGrad, FedAvg with server AMSGrad ({_REDDI})"),
        ("fedavgm", "momentum", "FedAvgM, FedAvg with server momentum (Hsu et al. 2019)"))),
)}
"""Name -> :class:`AlgorithmSpec`, called as ``ALGORITHMS[name](loss_fn, *, num_clients,
client_lr, **options)``."""


def register(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Add ``spec`` to ``ALGORITHMS`` (its declarations were checked when it was made), so
    that ``make`` and a config's ``algorithm`` find it; a name taken already is an error."""
    if not isinstance(spec, AlgorithmSpec):
        raise ValueError(f"register takes an AlgorithmSpec, got {spec!r}")
    if spec.name in ALGORITHMS:
        raise ValueError(f"algorithm {spec.name!r} is registered already; choose another name")
    ALGORITHMS[spec.name] = spec
    return spec


def make(
    name: str, loss_fn: LossFn, num_clients: int, client_lr: float, **options
) -> FederatedAlgorithm:
    """Build the registered algorithm ``name`` (see ``ALGORITHMS``)."""
    try:
        factory = ALGORITHMS[name]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {name!r}; allowed: {', '.join(sorted(ALGORITHMS))}."
        ) from None
    return factory(loss_fn, num_clients=num_clients, client_lr=client_lr, **options)


__all__ = [
    "ALGORITHMS",
    "SERVER_OPTIMIZERS",
    "AlgorithmFactory",
    "AlgorithmSpec",
    "CohortBatches",
    "FedAMSGradState",
    "FedAdaptiveState",
    "ClientMessage",
    "Reports",
    "FederatedAlgorithm",
    "RoundPieces",
    "RoundState",
    "ScaffoldServer",
    "ServerState",
    "apply_reports",
    "client_half",
    "client_training_keys",
    "cohort_round",
    "compose",
    "init_state",
    "keyless",
    "fedadagrad",
    "fedadam",
    "fedamsgrad",
    "fedavg",
    "fedavgm",
    "fednova",
    "fedprox",
    "fedsgd",
    "fedyogi",
    "federated_loss",
    "make",
    "register",
    "make_fednova",
    "proximal",
    "resolve_server_optimizer",
    "scaffold",
    "server_half",
    "server_learning_rate",
    "server_optimizer",
    "ServerOptimizerError",
    "with_server_learning_rate",
]
