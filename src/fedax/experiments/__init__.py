"""Experiments: validated configs, building and running one experiment from a config, its
run directory, strict JSON outputs and plots. Both the ``fedax`` command (``cli``) and the
papers' reproductions (``reproduce``) stand on this layer.

The names below load on first use (PEP 562), so that ``fedax.experiments.errors`` (which
the command imports first) loads neither JAX nor the config schema."""

from __future__ import annotations

import importlib

_NAMES = {  # name -> the module that defines it
    "Config": "config", "ConfigError": "errors", "compare_runs": "compare",
    "config_to_dict": "config", "load_config": "config",
    "run_experiment": "run", "validate_config": "config",
}


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"fedax.experiments.{_NAMES[name]}"), name)
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
