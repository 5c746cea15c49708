"""The experiment spec: the config schema (``Config`` and its sections), reading YAML and
``--set`` overrides, the one-line ``ConfigError``, and the combinations each engine and
aggregator refuses, decided from declared capabilities. It imports no engine: the builder
(``fedax.builder``), the runtime and the driver (``fedax.experiments``) stand on it.

The names below load on first use (PEP 562), so that ``fedax.spec.errors`` (which the
``fedax`` command imports first) loads neither JAX nor the schema."""

from __future__ import annotations

import importlib

_NAMES = {  # name -> the module that defines it
    "Config": "fedax.spec.config", "ConfigError": "fedax.spec.errors",
    "config_to_dict": "fedax.spec.config", "load_config": "fedax.spec.config",
    "validate_config": "fedax.spec.config",
}


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_NAMES)
