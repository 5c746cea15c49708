"""``fedax compare RUN_DIR...``: several runs' curves in one figure, and a markdown table of
their rounds to target, each row naming its run's setting (algorithm, DP, compression, robust
rule) and a DP run's ε and δ (``fedax.experiments.compare``)."""

from __future__ import annotations

import argparse

from fedax.spec.errors import ConfigError


def cmd_compare(args) -> int:
    """Usage errors are ``ConfigError`` (one line, exit status 2), as in ``fedax run``."""
    from fedax.experiments.compare import compare_runs

    if args.target is not None and not 0 < args.target <= 1:
        raise ConfigError(f"--target must be in (0, 1], got {args.target}")
    try:
        table = compare_runs(args.runs, args.out, target=args.target, metric=args.metric,
                             title=args.title)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"{err}; give run directories written by fedax run") from err
    print(table, end="")
    print(f"figure and table in {args.out}/ (compare.png, compare.md)")
    return 0


def add_command(sub, common: argparse.ArgumentParser) -> None:
    """Adds ``fedax compare`` to the ``fedax`` command's subparsers."""
    compare = sub.add_parser(
        "compare", parents=[common],
        help="several runs' curves in one figure, with their rounds to target, settings and "
             "(DP runs) epsilon")
    compare.add_argument("runs", nargs="+", metavar="RUN_DIR",
                         help="run directories (each with metrics.jsonl)")
    compare.add_argument("--target", type=float, metavar="ACC",
                         help="the accuracy to read rounds to (default: the runs' shared "
                              "target_accuracy, if any)")
    compare.add_argument("--metric", default="test_accuracy",
                         help="the curve to compare (default test_accuracy; e.g. "
                              "client_accuracy_worst10 for runs with per_client_eval)")
    compare.add_argument("--title", help="the figure's title")
    compare.add_argument("--out", default="runs/compare",
                         help="where compare.png and compare.md go (default runs/compare)")
    compare.set_defaults(func=cmd_compare)
