"""How a run uses the machine: ``fedax run CONFIG --num-processes N`` as N processes on
this machine (:func:`launch_processes`), the checks of the multi-process flags, and, before
JAX starts, the host's CPU split into XLA devices with patient collectives
(:func:`split_host_into_devices`, :func:`with_collective_patience`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from fedax.cli.run_dirs import claim_out, resolve_config
from fedax.spec.errors import CommandError


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_processes(args) -> None:
    """Refuses an incomplete or inconsistent set of the multi-process flags."""
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

    from fedax.spec.config import load_config

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
