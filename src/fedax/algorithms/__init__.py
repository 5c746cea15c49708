"""Federated algorithms as ``FederatedAlgorithm(init, round, server_params)``.

``ALGORITHMS`` maps a name to a factory with uniform keyword arguments,
``factory(loss_fn, *, num_clients, client_lr, **options)``, and ``make`` calls one:

    alg = make("fedyogi", loss_fn, num_clients=100, client_lr=0.1, server_lr=0.01)

``num_clients`` (the population size) is used by stateful algorithms (SCAFFOLD) and ignored
by the others; ``options`` are the algorithm's own keyword arguments. Default server
hyperparameters of the FedOpt entries are illustrative (τ = 1e-3, the authors' recommended
default; server learning rates in the range of their tuned values); tune them per task.
"""

from __future__ import annotations

from collections.abc import Callable

import optax

from fedax.algorithms.base import CohortBatches, FederatedAlgorithm, federated_loss
from fedax.algorithms.fedavg import FedAvgState, fedavg
from fedax.algorithms.fedprox import fedprox, proximal
from fedax.algorithms.fedsgd import fedsgd
from fedax.algorithms.scaffold import ScaffoldState, scaffold
from fedax.algorithms.server_optimizers import (
    FedAdaptiveState,
    FedAMSGradState,
    fedadagrad,
    fedadam,
    fedamsgrad,
    fedavgm,
    fedyogi,
)
from fedax.algorithms.stragglers import drop_stragglers, straggler_epochs
from fedax.client import LossFn

AlgorithmFactory = Callable[..., FederatedAlgorithm]


def _fedavg(loss_fn, *, num_clients, client_lr, server_optimizer=None):
    del num_clients
    return fedavg(loss_fn, optax.sgd(client_lr), server_optimizer)


def _fedsgd(loss_fn, *, num_clients, client_lr, server_optimizer=None):
    del num_clients
    return fedsgd(loss_fn, client_lr, server_optimizer)


def _fedprox(loss_fn, *, num_clients, client_lr, mu=0.01, server_optimizer=None):
    del num_clients
    return fedprox(loss_fn, optax.sgd(client_lr), mu, server_optimizer)


def _scaffold(option):
    def factory(loss_fn, *, num_clients, client_lr, server_optimizer=None, weighting="uniform"):
        return scaffold(loss_fn, client_lr, num_clients, option, server_optimizer, weighting)

    factory.__doc__ = f"SCAFFOLD, Option {option}."
    return factory


def _fedopt(make_server_optimizer, default_lr):
    def factory(loss_fn, *, num_clients, client_lr, server_lr=default_lr, **server_options):
        del num_clients
        server = make_server_optimizer(server_lr, **server_options)
        return fedavg(loss_fn, optax.sgd(client_lr), server)

    factory.__doc__ = f"FedAvg with server optimizer {make_server_optimizer.__name__}."
    return factory


ALGORITHMS: dict[str, AlgorithmFactory] = {
    "fedavg": _fedavg,
    "fedsgd": _fedsgd,
    "fedprox": _fedprox,
    "scaffold": _scaffold("II"),
    "scaffold_option1": _scaffold("I"),
    "fedadagrad": _fedopt(fedadagrad, 0.1),
    "fedadam": _fedopt(fedadam, 0.01),
    "fedyogi": _fedopt(fedyogi, 0.01),
    "fedamsgrad": _fedopt(fedamsgrad, 0.01),
    "fedavgm": _fedopt(fedavgm, 1.0),
}
"""Name -> ``factory(loss_fn, *, num_clients, client_lr, **options)``."""


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
    "AlgorithmFactory",
    "CohortBatches",
    "FedAMSGradState",
    "FedAdaptiveState",
    "FedAvgState",
    "FederatedAlgorithm",
    "ScaffoldState",
    "drop_stragglers",
    "fedadagrad",
    "fedadam",
    "fedamsgrad",
    "fedavg",
    "fedavgm",
    "fedprox",
    "fedsgd",
    "fedyogi",
    "federated_loss",
    "make",
    "proximal",
    "scaffold",
    "straggler_epochs",
]
