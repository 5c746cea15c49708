"""``fedax run CONFIG``: one experiment into a run directory (new, resumed or replaced; see
``fedax.cli.run_dirs``), in this process, over N processes (``fedax.cli.processes``) or on
the network engine; a failure is one line saying what to do next."""

from __future__ import annotations

import time
from pathlib import Path

from fedax.cli.failures import one_line
from fedax.cli.processes import check_processes, launch_processes
from fedax.cli.run_dirs import (
    claim_out,
    finish_pending_work,
    os_error_message,
    remove_if_empty,
    resolve_config,
    resume_command,
    run_command,
    where_stopped,
)
from fedax.spec.errors import CommandError


def _run_network(args, config, out, name, run_experiment):
    """``execution.mode: network`` (``run_experiment`` starts a server and
    ``network.local_clients`` client processes on this machine, ``fedax.runtime.launch``);
    a refused setting or a failed round is one line."""
    if args.num_processes and args.num_processes > 1:
        raise CommandError("--num-processes is the simulator's; with execution.mode network "
                           "the clients are processes already (network.local_clients)", 2)
    from fedax.runtime.rounds import RoundFailed

    try:
        return run_experiment(config, out, progress=not args.no_progress,
                              resume=args.resume, title=name)
    except (ValueError, PermissionError, RoundFailed) as err:
        raise CommandError(f"execution.mode network: {one_line(err)}", 2) from err


def cmd_run(args) -> int:
    from fedax.experiments.outputs import dumps, strict_json
    from fedax.experiments.run import run_experiment
    from fedax.simulation.checkpoint import CheckpointError, ResumeError
    from fedax.spec.config import load_config

    check_processes(args)
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
            summary = _run_network(args, config, out, name, run_experiment)
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
    from fedax.builder.privacy_plan import console_lines

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
