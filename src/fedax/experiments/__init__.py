"""Experiments: the driver that runs one experiment from a config in any engine
(``run_experiment``: sync, async and network; ``network.run_network``), its run directory,
resume, strict JSON outputs, plots and comparisons. It stands on the spec
(``fedax.spec``: the schema, ``load_config``), the builder (``fedax.builder``) and the
engines (``fedax.simulation``, ``fedax.runtime``); both the ``fedax`` command (``cli``) and
the papers' reproductions (``reproduce``) stand on it.

The names below load on first use (PEP 562), so that importing the package loads neither
JAX nor the schema."""

from __future__ import annotations

from fedax._lazy import lazy_getattr

_NAMES = {  # name -> the module that defines it
    "compare_runs": "fedax.experiments.compare", "run_experiment": "fedax.experiments.run",
    "run_network": "fedax.experiments.network",
}

__getattr__ = lazy_getattr(__name__, _NAMES)
__all__ = sorted(_NAMES)
