"""The experiment spec: the config schema (``Config`` and its sections), reading YAML and
``--set`` overrides, the one-line ``ConfigError``, and the combinations each engine and
aggregator refuses, decided from declared capabilities. It imports no engine: the builder
(``fedax.builder``), the runtime and the driver (``fedax.experiments``) stand on it.

The names below load on first use (PEP 562), so that ``fedax.spec.errors`` (which the
``fedax`` command imports first) loads neither JAX nor the schema."""

from __future__ import annotations

from fedax._lazy import lazy_getattr

_NAMES = {  # name -> the module that defines it
    "Config": "fedax.spec.config", "ConfigError": "fedax.spec.errors",
    "config_to_dict": "fedax.spec.config", "load_config": "fedax.spec.config",
    "validate_config": "fedax.spec.config",
}

__getattr__ = lazy_getattr(__name__, _NAMES)
__all__ = sorted(_NAMES)
