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
import time
import traceback
import warnings
from pathlib import Path

from fedax.cli.failures import Interrupts, failure_message, one_line, show_warning
from fedax.cli.run_dirs import (
    claim_out,
    finish_pending_work,
    missing_dirs,
    os_error_message,
    remove_if_empty,
    resolve_config,
    resume_command,
    run_command,
    where_stopped,
)
from fedax.experiments.errors import CommandError, ConfigError

# The paper's rounds to 97% for the 2NN on pathological non-IID MNIST with C = 0.1, E = 1
# (McMahan et al. 2017, Table 1): B = ∞ (FedSGD) 1796 rounds, B = 10 (FedAvg) 664 rounds.
DEMO_RUNS = (
    ("FedSGD", "mnist_2nn_noniid_fedsgd", 1796),
    ("FedAvg", "mnist_2nn_noniid_fedavg", 664),
)


# ------------------------------------------------------------------------------ commands


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _check_processes(args) -> None:
    given = [args.process_id is not None, args.coordinator is not None]
    if any(given) and not all(given):
        raise CommandError("--process-id and --coordinator go together (one process of a "
                           "multi-process run); for N processes on this machine give "
                           "--num-processes N alone", 2)
    if any(given) and args.num_processes is None:
        raise CommandError("--process-id needs --num-processes N (how many processes join)", 2)
    if args.process_id is not None and not 0 <= args.process_id < args.num_processes:
        raise CommandError(f"--process-id must be in 0..{args.num_processes - 1}, got "
                           f"{args.process_id}", 2)


def launch_processes(args) -> int:
    """``fedax run CONFIG --num-processes N``: N processes of this run on this machine, one
    coordinator on loopback. Process 0 writes the run to ``--out``; process i > 0 writes its
    identical copy (its own checkpoints, for ``--resume``) to ``OUT/processes/<i>/`` and its
    messages to ``OUT/processes/<i>.log``."""
    import subprocess

    from fedax.experiments.config import load_config

    config = load_config(resolve_config(args.config), args.set)  # a bad one: no launch
    out, _ = claim_out(args, Path(args.config).stem, config)
    out.mkdir(parents=True, exist_ok=True)
    n, per = args.num_processes, args.devices or 1
    coordinator = f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "FEDAX_DEVICES"}
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = with_collective_patience(
        " ".join([*flags, f"--xla_force_host_platform_device_count={per}"]))
    common = [sys.executable, "-m", "fedax.cli.main", "run", args.config,
              *[f"--set={kv}" for kv in args.set],
              f"--set=execution.devices={n * per}", "--num-processes", str(n),
              "--coordinator", coordinator, *(["--resume"] * args.resume),
              *(["--overwrite"] * args.overwrite), *(["--debug"] * args.debug)]
    (out / "processes").mkdir(exist_ok=True)
    procs, logs = [], []
    for i in range(n):
        where = out if i == 0 else out / "processes" / str(i)
        cmd = [*common, "--process-id", str(i), "--out", str(where)]
        if i == 0:
            procs.append(subprocess.Popen(cmd + ["--no-progress"] * args.no_progress,
                                          env=env))
            continue
        logs.append(out / "processes" / f"{i}.log")
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen(cmd + ["--no-progress"], env=env,
                                          stdout=subprocess.DEVNULL, stderr=log))
    status = 0
    try:
        for i, proc in enumerate(procs):
            code = proc.wait()
            if code and not status:
                status = code
                for other in procs:
                    if other.poll() is None:
                        other.terminate()
                if i > 0:
                    lines = logs[i - 1].read_text().strip().splitlines()
                    last = lines[-1] if lines else f"exit status {code}"
                    print(f"fedax: process {i}: {last} (log: {logs[i - 1]})", file=sys.stderr)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return status


def _run_network(args, config, out, name):
    """``execution.mode: network``: a server and ``network.local_clients`` client
    processes on this machine (``fedax.runtime.launch``); a refused setting or a failed
    round is one line."""
    if args.num_processes and args.num_processes > 1:
        raise CommandError("--num-processes is the simulator's; with execution.mode network "
                           "the clients are processes already (network.local_clients)", 2)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from fedax.runtime.launch import run_network
    from fedax.runtime.rounds import RoundFailed

    try:
        return run_network(config, out, progress=not args.no_progress, resume=args.resume,
                           title=name)
    except (ValueError, PermissionError, RoundFailed) as err:
        raise CommandError(f"execution.mode network: {one_line(err)}", 2) from err


def cmd_run(args) -> int:
    from fedax.experiments.config import load_config
    from fedax.experiments.outputs import dumps, strict_json
    from fedax.experiments.run import run_experiment
    from fedax.simulation.checkpoint import CheckpointError, ResumeError

    _check_processes(args)
    if args.num_processes and args.num_processes > 1 and args.process_id is None:
        return launch_processes(args)
    if args.process_id is not None and args.num_processes > 1:
        from fedax.simulation import distributed

        try:
            distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        except ValueError as err:
            raise CommandError(str(err), 2) from err
    config = load_config(resolve_config(args.config), args.set)
    name = Path(args.config).stem
    out, created = claim_out(args, name, config)
    since = time.time()
    try:
        if config.execution.mode == "network":
            summary = _run_network(args, config, out, name)
        else:
            summary = run_experiment(config, out, progress=not args.no_progress,
                                     resume=args.resume, title=name)
    except BaseException as err:
        remove_if_empty(created)  # only what this command created, if it left nothing there
        if isinstance(err, ResumeError):
            then = (f"continue it with: {resume_command(args, out, err.settings)}, or "
                    if err.settings else "")
            raise CommandError(
                f"cannot resume the run in {out}: {err}; nothing in {out} was changed: "
                f"{then}start over with: {run_command(args, out, '--overwrite')}", 2) from err
        if isinstance(err, CheckpointError):
            raise CommandError(
                f"cannot resume from {out / 'checkpoints'}: {err}; nothing in {out} was "
                "changed: resume with the config and --set values the run started with, or "
                "start over with --overwrite (or another --out)", 2) from err
        if isinstance(err, KeyboardInterrupt):
            finish_pending_work()
            raise CommandError(_interrupted_run(args, config, out, err, since), 130,
                               "interrupted") from err
        if isinstance(err, FloatingPointError):
            raise CommandError(f"{one_line(err)} (records up to it: {out}/metrics.jsonl)"
                               ) from err
        if isinstance(err, OSError):
            raise CommandError(os_error_message(err, out)) from err
        raise
    from fedax.experiments.privacy_plan import console_lines

    shown = {k: summary[k] for k in ("status", "rounds_run", "final_test_accuracy",
                                     "best_test_accuracy", "rounds_to_target", "wall_time_s")}
    if summary.get("privacy"):
        shown["epsilon"] = summary["privacy"]["epsilon"]
    print(dumps(strict_json(shown)[0], indent=2))
    for line in console_lines(summary):
        print(line)
    board = "" if config.execution.mode == "network" else ", tensorboard/"
    print(f"outputs in {out}/ (metrics.jsonl, summary.json, accuracy.png{board})")
    return 0


def _interrupted_run(args, config, out: Path, err: BaseException, since: float) -> str:
    every = config.checkpoint_every
    where, ckpt = where_stopped(err, out, since, checkpoints=bool(every or args.resume))
    if ckpt:
        return (f"{where}, newest checkpoint at round {ckpt}; continue with: "
                f"{resume_command(args, out)}")
    again = run_command(args, out, "--overwrite")
    if every:
        return (f"{where}; no checkpoint yet (one every {every} rounds), so nothing to "
                f"resume: start again with: {again}")
    return (f"{where}; no checkpoint to resume from (the config saves none): start again "
            f"with: {again} (add --set checkpoint_every=N to save one every N rounds)")


def _demo_plan(run_dir: Path, config, overwrite: bool) -> str:
    """What ``fedax demo`` does with a run's directory: ``reuse`` (finished, same config),
    ``resume`` (unfinished, with checkpoints), or ``run``; else ``CommandError``."""
    from fedax.experiments.outputs import finished_summary, is_run_dir
    from fedax.simulation.checkpoint import list_checkpoints

    if overwrite or not is_run_dir(run_dir):
        return "run"
    if finished_summary(run_dir, config) is not None:
        return "reuse"
    if not (run_dir / "summary.json").exists() and list_checkpoints(run_dir / "checkpoints"):
        return "resume"
    what = ("a run of another config" if (run_dir / "summary.json").exists()
            else "an unfinished run without a checkpoint")
    raise CommandError(f"{run_dir} holds {what}; delete it to run it again (finished runs "
                       "are reused), pass --overwrite to rerun all, or choose another --out", 2)


def cmd_demo(args) -> int:
    """FedAvg against FedSGD on pathological non-IID MNIST with the 2NN (Table 1 setting)."""
    from fedax.experiments.outputs import (
        finished_summary,
        fmt_rounds,
        plot_curves,
        read_records,
        write_atomic,
    )
    from fedax.simulation import History

    out = Path(args.out)
    from fedax.experiments.config import load_config

    configs = [load_config(resolve_config(name), args.set) for _, name, _ in DEMO_RUNS]
    plans = [_demo_plan(out / name, config, args.overwrite)
             for (_, name, _), config in zip(DEMO_RUNS, configs, strict=True)]
    rows, curves = [], {}
    for (label, name, paper), config, plan in zip(DEMO_RUNS, configs, plans, strict=True):
        run_dir = out / name
        if plan == "reuse":
            print(f"== {label}: reusing the finished run in {run_dir} (same config; "
                  "--overwrite runs it again)")
            summary = finished_summary(run_dir, config)
        else:
            print(f"== {label}: {name} (E={config.local_epochs}, B={config.batch_size}, "
                  f"client_lr={config.client_lr}, up to {config.rounds} rounds)"
                  + (f", resuming from {run_dir / 'checkpoints'}" if plan == "resume" else ""))
            summary = _demo_run(args, config, run_dir, label, name, plan)
        curves[label] = History(read_records(run_dir / "metrics.jsonl"))
        rows.append((label, config, summary, paper))
    target = rows[0][1].target_accuracy
    plot_curves(curves, out / "accuracy.png", target,
                title="2NN, pathological non-IID MNIST, C = 0.1")
    base = rows[0][2]["rounds_to_target"]
    lines = [
        f"Rounds to {target:.0%} test accuracy, 2NN, pathological non-IID MNIST, C = 0.1",
        "",
        "| method | E | B | client lr | rounds (fedax) | rounds (paper, Table 1) | "
        "speedup (fedax) | speedup (paper) | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, config, summary, paper in rows:
        ours = summary["rounds_to_target"]
        speed = f"{base / ours:.1f}x" if ours and base else "—"
        lines.append(
            f"| {label} | {config.local_epochs} | {config.batch_size} | {config.client_lr} | "
            f"{fmt_rounds(ours)} | {paper} | {speed} | {rows[0][3] / paper:.1f}x | "
            f"{summary['wall_time_s']:.0f} |"
        )
    table = "\n".join(lines)
    write_atomic(out / "table.md", table + "\n")
    print()
    print(table)
    print(f"\nplot: {out / 'accuracy.png'}")
    return 0


def _demo_run(args, config, run_dir: Path, label: str, name: str, plan: str) -> dict:
    from fedax.experiments.outputs import is_run_dir
    from fedax.experiments.run import run_experiment
    from fedax.simulation.checkpoint import CheckpointError

    since = time.time()
    created = missing_dirs(run_dir)
    command = shlex.join(["fedax", "demo", "--out", args.out,
                          *[x for item in args.set for x in ("--set", item)],
                          *(["--devices", str(args.devices)] if args.devices else [])])
    try:
        return run_experiment(config, run_dir, progress=not args.no_progress, label=label,
                              resume=plan == "resume", title=f"{label}: {name}")
    except BaseException as err:
        remove_if_empty(created)
        if isinstance(err, KeyboardInterrupt):
            finish_pending_work()
            where, ckpt = where_stopped(err, run_dir, since, checkpoints=True)
            if ckpt:
                then = f"continue with: {command} (finished runs are reused; this one " \
                       f"resumes from round {ckpt})"
            elif is_run_dir(run_dir):
                then = (f"it has no checkpoint: delete {run_dir}, then continue with: "
                        f"{command} (finished runs are reused)")
            else:
                then = f"continue with: {command} (finished runs are reused)"
            raise CommandError(f"{label} run {where}; {then}", 130, "interrupted") from err
        if isinstance(err, CheckpointError):
            raise CommandError(f"cannot resume {run_dir}: {err}; nothing in it was changed: "
                               f"delete it to run it again, or rerun both with: {command} "
                               "--overwrite", 2) from err
        if isinstance(err, OSError):
            raise CommandError(os_error_message(err, run_dir)) from err
        raise


def cmd_reproduce(args) -> int:
    from fedax.reproduce import EXPERIMENTS, get_experiment, reproduce

    if args.list or not args.name:
        width = max(len(n) for n in EXPERIMENTS)
        for name in sorted(EXPERIMENTS):
            e = EXPERIMENTS[name]
            size = (f" ({len(e.full)} cells; --quick: {len(e.quick)})"
                    if hasattr(e, "full") else "")
            print(f"{name:<{width}}  {e.title}{size}")
        return 0
    try:
        get_experiment(args.name)
    except KeyError as err:
        raise ConfigError(err.args[0]) from None
    out = Path(args.out or f"runs/reproduce/{args.name}" + ("-quick" if args.quick else ""))
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
        results = reproduce(args.name, out, quick=args.quick, progress=not args.no_progress,
                            command=command, cells=cells, lrs=lrs,
                            **({"report_only": True} if args.report_only else {}))
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
        from fedax import __version__

        return __version__
    except ImportError:
        from importlib.metadata import version

        return version("fedax")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fedax", description="Federated learning in JAX.")
    parser.add_argument("--version", action="version", version=f"fedax {_version()}")
    parser.add_argument("--debug", action="store_true",
                        help="on failure, print the traceback too (or set FEDAX_DEBUG=1)")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on failure, print the traceback too (or set FEDAX_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    devices_help = ("shard each cohort over N devices (CPU: the host split into N XLA "
                    "devices; default one per core. GPU: the first N). Results equal one "
                    "device's")
    set_help = ("override a config key (dotted keys for nested sections); KEY=null unsets "
                "it (its default applies); repeatable, and the last --set of a key wins")

    run = sub.add_parser("run", help="run one experiment from a YAML config", parents=[common])
    run.add_argument("config", help="a YAML file, or the name of a bundled config")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=set_help)
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
    run.add_argument("--devices", type=_positive_int, metavar="N", help=devices_help)
    run.add_argument(
        "--num-processes", type=_positive_int, metavar="N",
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

    demo = sub.add_parser("demo", help="FedAvg vs FedSGD, 2NN, non-IID MNIST (Table 1)",
                          parents=[common])
    demo.add_argument("--out", default="runs/demo",
                      help="output directory (default runs/demo); a finished run of the same "
                           "config there is reused, an interrupted one with a checkpoint "
                           "resumed")
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a key in both configs; " + set_help.split("; ")[1])
    demo.add_argument("--overwrite", action="store_true",
                      help="rerun both runs, replacing what --out holds")
    demo.add_argument("--no-progress", action="store_true")
    demo.add_argument("--devices", type=_positive_int, metavar="N", help=devices_help)
    demo.set_defaults(func=cmd_demo)

    rep = sub.add_parser(
        "reproduce", help="run a paper experiment and write a report (--list names them)",
        parents=[common])
    rep.add_argument("name", nargs="?", help="the experiment (see --list)")
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
    rep.add_argument("--devices", type=_positive_int, metavar="N", help=devices_help)
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


def split_host_into_devices(devices: int | None = None) -> None:
    """Before JAX starts: on CPU, expose ``devices`` XLA devices (default one per core), so
    that a cohort can be spread over the cores: one single-threaded client program per
    core is the fastest form on XLA:CPU. A count already in XLA_FLAGS is kept unless
    ``devices`` is given. With ``devices``, the runs also use only that many devices
    (``$FEDAX_DEVICES``; on GPU the first N)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if devices is not None:
        flags = " ".join(f for f in flags.split()
                         if "xla_force_host_platform_device_count" not in f)
        os.environ["FEDAX_DEVICES"] = str(devices)
    if "xla_force_host_platform_device_count" not in flags:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        count = devices if devices is not None else cores
        flags = f"{flags} --xla_force_host_platform_device_count={count}"
    os.environ["XLA_FLAGS"] = with_collective_patience(flags)


# A round's clients differ in size (natural partitions: one Shakespeare role has 100x the
# lines of another), so one host device can reach the round's sum tens of seconds after the
# other. XLA:CPU aborts the process when a device waits more than 40 s for another at a
# collective (it killed a full-data Shakespeare run), and warns after 20 s; fedax allows a
# day and warns after 10 minutes. A value already in XLA_FLAGS is kept.
COLLECTIVE_PATIENCE = {"xla_cpu_collective_call_terminate_timeout_seconds": 86400,
                       "xla_cpu_collective_call_warn_stuck_timeout_seconds": 600}


def with_collective_patience(flags: str) -> str:
    """``flags`` (an XLA_FLAGS string) with :data:`COLLECTIVE_PATIENCE` added where unset."""
    extra = [f"--{name}={value}" for name, value in COLLECTIVE_PATIENCE.items()
             if name not in flags]
    return " ".join([*flags.split(), *extra])


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
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
