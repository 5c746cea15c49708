"""Experiments: the driver that runs one experiment from a config in any engine
(``run_experiment``: sync, async and network; ``network.run_network``), its run directory,
resume, strict JSON outputs, plots and comparisons. It stands on the spec
(``fedax.spec``: the schema, ``load_config``), the builder (``fedax.builder``) and the
engines (``fedax.simulation``, ``fedax.runtime``); both the ``fedax`` command (``cli``) and
the papers' reproductions (``reproduce``) stand on it.

The names below load on first use (PEP 562), so that importing the package loads neither
JAX nor the schema."""

from __future__ import annotations

import importlib

_NAMES = {  # name -> the module that defines it
    "compare_runs": "fedax.experiments.compare", "run_experiment": "fedax.experiments.run",
    "run_network": "fedax.experiments.network",
}


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_NAMES)
