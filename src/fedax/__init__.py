"""fedax: federated learning in JAX.

The layers are subpackages (``fedax.federated``, ``fedax.data``, ``fedax.models``,
``fedax.client``, ``fedax.aggregators``, ``fedax.privacy``, ``fedax.algorithms``,
``fedax.hyper``, ``fedax.simulation``, ``fedax.spec``, ``fedax.builder``,
``fedax.experiments``); the most used
names are also here: ``fedavg``, ``fedsgd``, ``fedprox``, ``scaffold``, ``get_model``,
``ClientData``, ``make_cohort``, ``cohort_batches``, ``run`` (the simulation runner) and
``run_experiment`` (the one entry point for a config, every ``execution.mode``:
``fedax.run_experiment(fedax.spec.load_config("cfg.yaml"), "runs/x")``).

All of them load on first use (PEP 562 ``__getattr__``): ``import fedax`` imports neither
JAX nor the layers, ``import fedax.data`` does not pull in the simulation, and this module
never runs while a layer is half imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from fedax._version import __version__

_SUBPACKAGES = ("aggregators", "algorithms", "builder", "client", "data", "experiments",
                "federated", "hyper", "models", "privacy", "simulation", "spec")
_NAMES = {  # name -> the subpackage that defines it
    "ClientData": "data",
    "cohort_batches": "simulation",
    "fedavg": "algorithms",
    "fedprox": "algorithms",
    "fedsgd": "algorithms",
    "get_model": "models",
    "make_cohort": "data",
    "run": "simulation",
    "run_experiment": "experiments",
    "scaffold": "algorithms",
}

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ loads these
    from fedax import (
        aggregators,
        algorithms,
        builder,
        client,
        data,
        experiments,
        federated,
        hyper,
        models,
        privacy,
        simulation,
        spec,
    )

    # (from the defining modules: each shares its name with the function it defines)
    from fedax.algorithms.fedavg import fedavg
    from fedax.algorithms.fedprox import fedprox
    from fedax.algorithms.fedsgd import fedsgd
    from fedax.algorithms.scaffold import scaffold
    from fedax.data import ClientData, make_cohort
    from fedax.experiments import run_experiment
    from fedax.models import get_model
    from fedax.simulation import cohort_batches, run

__all__ = [
    "aggregators",
    "privacy",
    "ClientData",
    "__version__",
    "algorithms",
    "builder",
    "client",
    "cohort_batches",
    "data",
    "experiments",
    "federated",
    "fedavg",
    "fedprox",
    "fedsgd",
    "get_model",
    "hyper",
    "make_cohort",
    "models",
    "run",
    "run_experiment",
    "scaffold",
    "simulation",
    "spec",
]


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"fedax.{name}")  # the import binds it here too
    if name in _NAMES:
        value = getattr(importlib.import_module(f"fedax.{_NAMES[name]}"), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'fedax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
