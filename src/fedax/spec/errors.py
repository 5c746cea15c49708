"""The config error and the command's error, apart from the config schema (which imports
the algorithm registry and with it JAX), so the ``fedax`` command can name them without
loading JAX (``--version``, ``--help``)."""


class ConfigError(ValueError):
    """An invalid config; the message is one line naming the key and what is allowed."""


class CommandError(Exception):
    """A failure the ``fedax`` command explains in one line: ``fedax: <kind>: <message>``
    (here, not in ``fedax.cli.main``, so that ``python -m fedax.cli.main`` and the command
    modules it imports raise and catch one class)."""

    def __init__(self, message: str, status: int = 1, kind: str = "error"):
        super().__init__(message)
        self.status, self.kind = status, kind
