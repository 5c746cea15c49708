"""Per-paper logic beyond config runs: a paper file names its hook (``hook: NAME``), a
module here that the engine calls by name (``run``, ``settings``, ``derive``, ``figures``)."""

__all__: list[str] = []
