"""The ``fedax`` command (docs/reference/cli.md): ``fedax.cli.main.main(argv)`` runs it,
``build_parser()`` is its parser; each command's code is a module here (``run``, ``demo``,
``privacy``, ``compare``, ``runtime``; ``processes`` and ``run_dirs`` for ``run``). The
package exports no Python API of its own: the command is its interface."""

__all__: list[str] = []
