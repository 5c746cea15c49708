"""Per-paper logic beyond config runs, called by name from a paper file (``hook: NAME``)."""

__all__: list[str] = []
