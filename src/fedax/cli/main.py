"""The ``fedax`` command: ``run``, ``demo``, ``reproduce``, ``data fetch``,
``privacy epsilon`` / ``privacy noise`` (DP accounting with dp-accounting) and the networked
runtime's ``server init|start|status`` and ``client`` (``fedax.cli.runtime``).

Results are never lost: ``run`` writes into a new directory by default
(``runs/<config>-<YYYYmmdd-HHMMSS>``) and refuses a directory that already holds a run
unless ``--resume`` (continue it) or ``--overwrite`` (replace it) says what to do; a refused
resume changes nothing. Every failure ends in one line on stderr,
``fedax: error: <what happened>; <what to do>``, and a non-zero status (2 for a usage,
config or resume error, 1 otherwise, 130 for Ctrl-C); ``--debug`` or ``FEDAX_DEBUG=1``
prints the traceback too.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
import traceback
import warnings
from pathlib import Path

from fedax.cli.failures import Interrupts, failure_message, show_warning
from fedax.cli.options import DEVICES_HELP, SET_HELP, positive_int
from fedax.cli.processes import split_host_into_devices
from fedax.cli.run import cmd_run
from fedax.cli.run_dirs import finish_pending_work, os_error_message
from fedax.spec.errors import CommandError, ConfigError

# ------------------------------------------------------------------------------ commands


def cmd_reproduce(args) -> int:
    from fedax.reproduce import EXPERIMENTS, get_paper, reproduce

    if args.list or not args.name:
        width = max(len(n) for n in EXPERIMENTS)
        for name in sorted(EXPERIMENTS):
            e = EXPERIMENTS[name]
            size = (f" ({len(e.cells)} cells; --quick: {len(e.quick)})"
                    if e.kind == "table" else "")
            print(f"{name:<{width}}  {e.title}{size}")
        return 0
    try:
        paper = get_paper(args.name)  # a shipped paper's name, or a paper file (*.yaml)
    except KeyError as err:
        raise ConfigError(err.args[0]) from None
    out = Path(args.out or f"runs/reproduce/{paper.name}" + ("-quick" if args.quick else ""))
    command = f"fedax reproduce {args.name}" + (" --quick" if args.quick else "")
    cells = lrs = None
    if args.cells is not None:
        cells = [c.strip() for c in args.cells.split(",") if c.strip()]
        command += f" --cells {shlex.quote(args.cells)}"
    if args.lrs is not None:
        try:
            lrs = [float(v) for v in args.lrs.split(",") if v.strip()]
        except ValueError:
            raise ConfigError(f"--lrs {args.lrs!r}: expected comma-separated numbers, "
                              "e.g. --lrs 1.47,3.16") from None
        command += f" --lrs {shlex.quote(args.lrs)}"
    if args.out:
        command += f" --out {shlex.quote(args.out)}"
    try:
        results = reproduce(paper, out, quick=args.quick, progress=not args.no_progress,
                            command=command, cells=cells, lrs=lrs,
                            report_only=args.report_only)
    except KeyboardInterrupt as err:
        finish_pending_work()
        raise CommandError(f"stopped; continue with: {command} (finished runs in {out} are "
                           "reused)", 130, "interrupted") from err
    except OSError as err:
        raise CommandError(os_error_message(err, out)) from err
    print(f"\nreport: {out / 'report.md'} ({results['wall_time_s'] / 60:.1f} min of runs)")
    return 0


def cmd_data_fetch(args) -> int:
    from fedax.data import fetch_dataset

    print(f"{args.name} ready in {fetch_dataset(args.name)}")
    return 0


# ------------------------------------------------------------------------------ parser


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line."""

    def error(self, message: str):
        self.exit(2, f"fedax: error: {message}; see '{self.prog} --help'\n")


def _version() -> str:
    try:
        from fedax._version import __version__

        return __version__
    except ImportError:
        from importlib.metadata import version

        return version("fedax")


def build_parser() -> argparse.ArgumentParser:
    """The ``fedax`` command's parser: each subcommand's ``func`` runs it."""
    parser = _Parser(prog="fedax", description="Federated learning in JAX.")
    parser.add_argument("--version", action="version", version=f"fedax {_version()}")
    parser.add_argument("--debug", action="store_true",
                        help="on failure, print the traceback too (or set FEDAX_DEBUG=1)")
    common = _Parser(add_help=False)  # (a parent: only its arguments are used)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on failure, print the traceback too (or set FEDAX_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run one experiment from a YAML config", parents=[common])
    run.add_argument("config", help="a YAML file, or the name of a bundled config")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    run.add_argument(
        "--out", help="output directory (default: a new runs/<config name>-<YYYYmmdd-HHMMSS>)."
                      " A directory that holds a run is refused without --resume or "
                      "--overwrite")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    again = run.add_mutually_exclusive_group()
    again.add_argument(
        "--resume", action="store_true",
        help="continue the run in --out (required) from its newest valid checkpoint "
             "(OUT/checkpoints/, written every checkpoint_every rounds; set e.g. --set "
             "checkpoint_every=50 when starting the run). Same config and --set values "
             "required, else nothing is changed, except that rounds may grow (--set rounds=N "
             "extends a finished run); the result (metrics.jsonl, final model) is identical "
             "to an uninterrupted run's, elapsed_s aside. An empty or new --out starts from "
             "round 0",
    )
    again.add_argument("--overwrite", action="store_true",
                       help="replace the run in --out (its outputs go at the new run's first "
                            "evaluation)")
    run.add_argument("--devices", type=positive_int, metavar="N", help=DEVICES_HELP)
    run.add_argument(
        "--num-processes", type=positive_int, metavar="N",
        help="spread the run over N processes with JAX's distributed runtime (each with "
             "--devices devices, default 1; the cohort is split over every device of every "
             "process). Alone: starts N processes on this machine. With --process-id and "
             "--coordinator: this process is one of N (one command per host of a cluster)")
    run.add_argument("--process-id", type=int, metavar="I",
                     help="this process's index, 0..N-1 (0 is the primary, whose --out holds "
                          "the run)")
    run.add_argument("--coordinator", metavar="HOST:PORT",
                     help="process 0's address, the same for every process")
    run.set_defaults(func=cmd_run)

    from fedax.cli.demo import add_command as add_demo_command

    add_demo_command(sub, common)  # fedax demo

    rep = sub.add_parser(
        "reproduce", help="run a paper experiment and write a report (--list names them)",
        parents=[common])
    rep.add_argument("name", nargs="?",
                     help="the experiment (see --list), or a paper file (PATH.yaml)")
    rep.add_argument("--list", action="store_true", help="list the experiments")
    rep.add_argument("--quick", action="store_true",
                     help="the documented subset that runs in minutes on a laptop CPU")
    rep.add_argument("--out", help="report directory (default runs/reproduce/NAME[-quick]); "
                                   "rerunning into it reuses and resumes finished runs")
    rep.add_argument("--cells", metavar="NAME,...",
                     help="run only these cells of the table (their names: the run "
                          "directories under OUT/runs, or an unknown name's error lists them)")
    rep.add_argument("--lrs", metavar="LR,...",
                     help="learning rates to run instead of each cell's grid")
    rep.add_argument("--report-only", action="store_true",
                     help="run nothing: write the report from the runs in OUT so far "
                          "(unfinished ones from their newest checkpoints, marked in progress)")
    rep.add_argument("--no-progress", action="store_true", help="no progress bars")
    rep.add_argument("--devices", type=positive_int, metavar="N", help=DEVICES_HELP)
    rep.set_defaults(func=cmd_reproduce)

    data = sub.add_parser("data", help="data set commands", parents=[common])
    data_sub = data.add_subparsers(dest="data_command", required=True)
    fetch = data_sub.add_parser("fetch", help="download and verify a data set into the cache",
                                parents=[common])
    from fedax.data.fetch import DATASET_NAMES

    fetch.add_argument("name", choices=DATASET_NAMES)
    fetch.set_defaults(func=cmd_data_fetch)

    from fedax.cli.privacy import add_command as add_privacy_command

    add_privacy_command(sub, common)  # fedax privacy epsilon|noise
    from fedax.cli.runtime import add_commands as add_runtime_commands

    add_runtime_commands(sub, common)  # fedax server init|start|status, fedax client
    from fedax.cli.compare import add_command as add_compare_command

    add_compare_command(sub, common)  # fedax compare RUN_DIR...
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs ``fedax ARGV...`` (default: ``sys.argv[1:]``); returns the exit status, a failure
    printed as one line on stderr (with ``--debug``, the traceback too)."""
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("FEDAX_DEBUG", "") not in ("", "0")
    split_host_into_devices(getattr(args, "devices", None))
    interrupts = Interrupts()
    # Only where Ctrl-C raises KeyboardInterrupt now (not if ignored, nor off the main thread).
    handle = (threading.current_thread() is threading.main_thread()
              and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if handle:
        signal.signal(signal.SIGINT, interrupts)
    with warnings.catch_warnings():
        if not debug:
            warnings.showwarning = show_warning
        try:
            return args.func(args)
        except (Exception, KeyboardInterrupt) as err:
            if debug:
                traceback.print_exc()
            if isinstance(err, KeyboardInterrupt):
                finish_pending_work()
            message, status = failure_message(err)
            print(message, file=sys.stderr)
            return status
        finally:
            interrupts.cancel()
            if handle:
                signal.signal(signal.SIGINT, signal.default_int_handler)


if __name__ == "__main__":
    sys.exit(main())
