"""The config error, apart from the config schema (which imports the algorithm registry and
with it JAX), so the ``fedax`` command can name it without loading JAX (``--version``,
``--help``)."""


class ConfigError(ValueError):
    """An invalid config; the message is one line naming the key and what is allowed."""
