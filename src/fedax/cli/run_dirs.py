"""The ``fedax`` command's run directories: where a run goes (``claim_out``: a new
``runs/<config>-<time>``, or ``--out`` under ``--resume``/``--overwrite``), the commands it
suggests (each runs as printed), where an interrupted run stopped, and the directories a
failed command made, removed again (``remove_if_empty``)."""

from __future__ import annotations

import contextlib
import errno
import os
import shlex
import sys
from importlib import resources
from pathlib import Path

from fedax.spec.errors import CommandError, ConfigError


def run_command(args, out: Path | None = None, flag: str | None = None,
                settings: tuple[str, ...] = ()) -> str:
    """The exact ``fedax run CONFIG [--set ...] [--out OUT] [--devices N] [FLAG]`` of this
    command, ``settings`` (``key=value``) replacing its ``--set`` of those keys."""
    keys = {item.partition("=")[0].strip() for item in settings}
    parts = ["fedax", "run", args.config]
    for item in [*(i for i in args.set if i.partition("=")[0].strip() not in keys), *settings]:
        parts += ["--set", item]
    if out is not None:
        parts += ["--out", str(out)]
    if args.devices is not None:
        parts += ["--devices", str(args.devices)]
    return shlex.join([*parts, *([flag] if flag else [])])


def resume_command(args, out: Path, settings: tuple[str, ...] = ()) -> str:
    """The exact ``fedax run ... --out OUT --resume`` that continues this run."""
    return run_command(args, out, "--resume", settings)


def missing_dirs(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first: what
    creating ``path`` creates, and what a failed command removes again if still empty."""
    missing = []
    for p in (path, *path.parents):
        if os.path.lexists(p) or p == Path(p.anchor):
            break
        missing.append(p)
    return missing


def remove_if_empty(directories: list[Path]) -> None:
    """Removes each of ``directories`` (deepest first) while it is empty: a command that
    failed before producing a result leaves no directory it created behind."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:  # not empty (it holds results), or already gone
            if directory.exists():
                return


def _runs_of(parent: Path, name: str) -> list[Path]:
    """The run directories of config ``name`` under ``parent``, newest last."""
    from fedax.experiments.outputs import is_run_dir

    if not parent.is_dir():
        return []
    found = [p for p in parent.iterdir() if p.is_dir() and is_run_dir(p)
             and (p.name == name or p.name.startswith(f"{name}-"))]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def claim_out(args, name: str, config) -> tuple[Path, list[Path]]:
    """The run's directory (``--out``, else a new ``runs/<name>-<time>``) and the
    directories this command creates for it (see ``missing_dirs``). Raises
    ``CommandError`` for a directory holding a run that neither ``--resume`` nor
    ``--overwrite`` may take, and for ``--resume`` without ``--out`` (naming the newest run
    that ``config`` continues, if any). Every command a message suggests runs as printed."""
    from fedax.experiments.outputs import RUN_OUTPUTS, is_run_dir, new_run_dir
    from fedax.experiments.resume import run_progress
    from fedax.simulation.checkpoint import list_checkpoints

    if args.out is None:
        if args.resume:
            runs = _runs_of(Path("runs"), name)
            ours = [run for run in runs if run_progress(config, run) is not None]
            if ours:
                raise CommandError(f"--resume needs --out DIR, the run to continue; the newest "
                                   f"run of {name} that this config continues is {ours[-1]}: "
                                   f"{resume_command(args, ours[-1])}", 2)
            found = (f"no run of {name} in runs/" if not runs else
                     f"no run of {name} in runs/ has a checkpoint that this config continues")
            hint = ("" if config.checkpoint_every else
                    " (add --set checkpoint_every=N to save a checkpoint every N rounds)")
            raise CommandError(f"--resume needs --out DIR, the run to continue ({found}); start "
                               f"a new run with: {run_command(args)}{hint}", 2)
        missing = missing_dirs(Path("runs"))
        out = new_run_dir(Path("runs"), name)
        return out, [out, *missing]
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CommandError(f"--out {out} is a file; --out names a directory (created if "
                           "missing)", 2)
    if not is_run_dir(out):
        return out, missing_dirs(out)
    held = ", ".join(n for n in RUN_OUTPUTS if (out / n).exists())
    replace = run_command(args, out, "--overwrite")
    if args.resume and not list_checkpoints(out / "checkpoints"):
        raise CommandError(f"cannot resume: {out} holds a run ({held}) but no checkpoint in "
                           f"{out / 'checkpoints'}; start it over with: {replace}, or choose "
                           "another --out", 2)
    if not (args.resume or args.overwrite):
        if run_progress(config, out) is not None:
            raise CommandError(f"{out} already holds a run ({held}); continue it with: "
                               f"{resume_command(args, out)}, replace it with: {replace}, or "
                               "choose another --out", 2)
        why = ("" if list_checkpoints(out / "checkpoints")
               else ", having no checkpoint")
        raise CommandError(f"{out} already holds a run ({held}) that this config cannot "
                           f"continue{why}; replace it with: {replace}, or choose another "
                           "--out", 2)
    return out, []


def _last_round(metrics: Path, since: float) -> int | None:
    """The round of the last record in ``metrics`` written at or after ``since``."""
    from fedax.experiments.outputs import read_records

    try:
        if metrics.stat().st_mtime < since:
            return None
        records = read_records(metrics)
    except OSError:
        return None
    return records[-1].get("round") if records else None


def _checkpoint_round(err: BaseException, directory: Path) -> int | None:
    """The newest checkpoint's round: as the runner reports it, else from the file names."""
    if hasattr(err, "checkpoint_round"):
        return err.checkpoint_round
    from fedax.simulation.checkpoint import list_checkpoints

    found = list_checkpoints(directory)
    return found[0][0] if found else None


def where_stopped(err: BaseException, out: Path, since: float,
                  checkpoints: bool) -> tuple[str, int | None]:
    """``(text, checkpoint round or None)`` for a run in ``out`` stopped by ``err``;
    ``checkpoints``: whether files in ``out/checkpoints`` may belong to this run."""
    ckpt = _checkpoint_round(err, out / "checkpoints") if checkpoints else None
    rounds = [r for r in (getattr(err, "rounds_done", getattr(err, "round", None)),
                          _last_round(out / "metrics.jsonl", since), ckpt) if r]
    text = f"stopped after round {max(rounds)}" if rounds else "stopped before its first evaluation"
    return f"{text} in {out}", ckpt


def finish_pending_work() -> None:
    """After Ctrl-C: wait for the round in flight (its clients may be running in worker
    processes), then stop the ``processes`` workers, so nothing runs or prints after the
    command's last line."""
    jax = sys.modules.get("jax")
    try:
        for array in jax.live_arrays() if jax is not None else ():
            with contextlib.suppress(Exception):
                array.block_until_ready()
        processes = sys.modules.get("fedax.simulation.processes")
        if processes is not None:
            processes.close_pools()
    except KeyboardInterrupt:  # a second Ctrl-C: stop waiting
        pass


def os_error_message(err: OSError, out: Path | None = None) -> str:
    """One line naming the path and the fix for a file system error."""
    path = err.filename or out
    reason = (err.strerror or str(err)).lower()
    in_out = out is not None and path is not None and _inside(Path(path), out)
    if err.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        fix = "free some space" + (" or choose another --out" if in_out else "")
    elif err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "choose a writable --out" if in_out else f"check the permissions of {path}"
    elif err.errno in (errno.ENOENT, errno.ENOTDIR, errno.EEXIST, errno.EISDIR):
        fix = ("--out must name a directory (created if missing)" if in_out
               else f"check that {path} exists")
    else:
        fix = "run with --debug for the traceback"
    return f"{reason}: {path}; {fix}" if path else f"{reason}; {fix}"


def _inside(path: Path, directory: Path) -> bool:
    path, directory = Path(os.path.abspath(path)), Path(os.path.abspath(directory))
    return path == directory or directory in path.parents


def resolve_config(name_or_path: str) -> Path:
    """A config file path, or the name of a config bundled with fedax."""
    path = Path(name_or_path)
    if path.exists():
        return path
    bundled = resources.files("fedax") / "configs" / f"{path.stem}.yaml"
    if bundled.is_file():
        return Path(str(bundled))
    names = sorted(p.name[:-5] for p in (resources.files("fedax") / "configs").iterdir()
                   if p.name.endswith(".yaml"))
    raise ConfigError(
        f"config {name_or_path!r} is neither a file nor a bundled config "
        f"(bundled: {', '.join(names)})"
    )
