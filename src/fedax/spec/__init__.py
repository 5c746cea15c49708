"""The experiment spec: the config schema (``Config`` and its sections), reading YAML and
``--set`` overrides, the one-line ``ConfigError``, and the combinations each engine and
aggregator refuses, decided from declared capabilities. It imports no engine: the builder
(``fedax.builder``), the runtime and the driver (``fedax.experiments``) stand on it."""
