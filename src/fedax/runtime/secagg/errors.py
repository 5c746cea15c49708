"""The two failures of secure aggregation: a refused message and an aborted round."""

from __future__ import annotations


class SecAggError(ValueError):
    """A message or request that SecAgg refuses: malformed bytes, a share that fails
    authentication, or a request a client must not answer (e.g. both shares of one node)."""


class SecAggAbort(RuntimeError):
    """The round cannot finish without weakening privacy (too few survivors or shares).

    The server then holds masked vectors only; ``transcript`` is set by ``run_round``.
    """

    def __init__(self, reason: str, transcript: object = None):
        super().__init__(reason)
        self.reason = reason
        self.transcript = transcript
