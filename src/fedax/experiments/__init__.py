"""Experiments: validated configs, building and running one experiment from a config, its
run directory, strict JSON outputs and plots. Both the ``fedax`` command (``cli``) and the
papers' reproductions (``reproduce``) stand on this layer.

The names below load on first use (PEP 562), so that ``fedax.spec.errors`` (which
the command imports first) loads neither JAX nor the config schema."""

from __future__ import annotations

import importlib

_NAMES = {  # name -> the module that defines it
    "Config": "fedax.spec.config", "ConfigError": "fedax.spec.errors",
    "compare_runs": "fedax.experiments.compare", "config_to_dict": "fedax.spec.config",
    "load_config": "fedax.spec.config", "run_experiment": "fedax.experiments.run",
    "validate_config": "fedax.spec.config",
}


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'fedax.experiments' has no attribute {name!r}")


__all__ = [
    "Config",
    "ConfigError",
    "compare_runs",
    "config_to_dict",
    "load_config",
    "run_experiment",
    "validate_config",
]
