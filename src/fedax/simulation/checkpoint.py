"""Checkpoints of a simulation run, for exact resume: what they hold, their names, resuming.

A checkpoint holds everything the runner needs to continue a run bit-identically: the
algorithm state pytree (server and optimizer state, per-client state, PRNG keys, round
counters: any leaves), the evaluation records so far, the elapsed time, the number of
rounds completed, and the run's fingerprint (what must not change between the run and its
resumption). Cohorts and round keys are derived from ``(seed, t)`` and need no saving.

File ``ckpt_<round>.msgpack``, a ``fedax.checkpoint`` file (header with magic, version,
length and SHA-256; atomic writes; the state's leaves as ``fedax.checkpoint.encode_state``
writes them; no pickle) whose payload is a msgpack map::

      version      int, FORMAT_VERSION
      round        int, rounds completed (resume starts at round index ``round``)
      fingerprint  map str -> scalar, identifies the run (compared on resume)
      history      list of the evaluation records (maps) so far
      elapsed_s    float, run time up to this checkpoint
      counters     map str -> int, the runner's running counts (e.g. clients rejected since
                   the last record); absent in older files, read as empty
      state        the state's leaves (``fedax.checkpoint.encode_state``)
      meta         map: fedax and jax versions (informational)

A truncated or corrupted file fails the length or SHA-256 check. The last ``keep``
(default 2) are kept, and :func:`latest_checkpoint` falls back to an older one (with a
:class:`CheckpointWarning`) when the newest does not verify.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

# MAGIC, arrays_sha256 and tree_sha256 lived here before: still importable from here.
from fedax.checkpoint import (  # noqa: F401
    FORMAT_VERSION,
    MAGIC,
    CheckpointError,
    CheckpointWarning,
    arrays_sha256,
    decode_state,
    encode_state,
    first_readable,
    prune,
    read_file,
    tree_sha256,
    write_file,
)
from fedax.io import pack, unpack

_NAME = re.compile(r"ckpt_(\d+)\.msgpack")


class ResumeError(CheckpointError):
    """A run that cannot be continued as asked, though its checkpoint is this run's: a
    schedule shorter than the rounds it has done, or a noise multiplier calibrated to the
    rounds it started with. ``settings`` (``key=value`` strings, possibly empty) are config
    values under which it can be continued."""

    def __init__(self, message: str, settings: Sequence[str] = ()):
        super().__init__(message)
        self.settings = tuple(settings)


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint restored into a template's structure and placement."""

    path: Path
    round: int
    state: Any
    history: list[dict[str, Any]]
    fingerprint: dict[str, Any]
    elapsed_s: float
    counters: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- files


def checkpoint_path(directory: str | os.PathLike[str], round_: int) -> Path:
    return Path(directory) / f"ckpt_{round_}.msgpack"


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(round, path)`` of the checkpoint files in ``directory``, newest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME.fullmatch(path.name)
        if match and path.is_file():
            found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


def save_checkpoint(
    directory: str | os.PathLike[str],
    round_: int,
    state: Any,
    *,
    history: Sequence[Mapping[str, Any]] = (),
    fingerprint: Mapping[str, Any] | None = None,
    elapsed_s: float = 0.0,
    counters: Mapping[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Writes ``ckpt_<round_>.msgpack`` atomically and keeps the newest ``keep`` files.

    Returns:
      The checkpoint's path.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}.")
    from fedax._version import __version__ as fedax_version

    final = write_file(checkpoint_path(directory, round_), {
        "version": FORMAT_VERSION,
        "round": int(round_),
        "fingerprint": dict(fingerprint or {}),
        "history": [dict(r) for r in history],
        "elapsed_s": float(elapsed_s),
        "counters": dict(counters or {}),
        "state": encode_state(state),
        "meta": {"fedax": str(fedax_version), "jax": jax.__version__},
    })
    prune((path for _, path in list_checkpoints(directory)), keep)
    return final


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The verified payload of a checkpoint file (state leaves still encoded).

    Raises:
      CheckpointError: not a fedax checkpoint, another format version, truncated, its
        SHA-256 does not match (corrupted), or not a run checkpoint (missing fields).
    """
    data = read_file(path)
    required = ("version", "round", "fingerprint", "history", "elapsed_s", "state")
    if any(k not in data for k in required):
        raise CheckpointError(f"checkpoint {path} has a malformed payload (missing fields)")
    if data["version"] != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path}: payload version {data['version']}")
    return data


def fingerprint_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Lines ``key: <saved> in the checkpoint, <current> now`` for each differing item."""
    lines = []
    for key in sorted(set(saved) | set(current), key=str):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if a != b or (type(a) is not type(b) and not _same_number(a, b)):
            lines.append(f"{key}: {a!r} in the checkpoint, {b!r} now")
    return lines


def _same_number(a: Any, b: Any) -> bool:
    numbers = (int, float)
    return (isinstance(a, numbers) and isinstance(b, numbers)
            and not isinstance(a, bool) and not isinstance(b, bool) and a == b)


def load_checkpoint(
    path: str | os.PathLike[str],
    template: Any,
    fingerprint: Mapping[str, Any] | None = None,
    *,
    ignore: Collection[str] = (),
) -> Checkpoint:
    """Reads, verifies and restores one checkpoint into ``template``'s structure.

    Args:
      path: the checkpoint file.
      template: a state of the same structure, e.g. a freshly ``init``-ed one (its leaves'
        placement is where the restored leaves go; see :func:`decode_state`).
      fingerprint: when given, the checkpoint's fingerprint must equal it.
      ignore: fingerprint items left out of that comparison (a run's schedule, e.g. its
        number of rounds, which the caller checks itself).

    Raises:
      CheckpointError: the file does not verify, the fingerprint differs (the message
        names the differing items), or the state does not fit the template.
    """
    return _restore(path, read_checkpoint(path), template, fingerprint, ignore)


def _restore(path, data, template, fingerprint, ignore=()) -> Checkpoint:
    if fingerprint is not None:
        # Compare as stored (msgpack turns tuples into lists).
        current = unpack(pack(fingerprint))
        saved = {k: v for k, v in data["fingerprint"].items() if k not in ignore}
        diff = fingerprint_differences(saved, {k: v for k, v in current.items()
                                               if k not in ignore})
        if diff:
            raise CheckpointError(
                f"checkpoint {path} was written by a different run; differences: "
                + "; ".join(diff)
            )
    try:
        state = decode_state(data["state"], template)
    except CheckpointError as err:
        raise CheckpointError(f"checkpoint {path}: {err}") from None
    except (KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint {path} has a malformed state: {err!r}") from None
    return Checkpoint(
        Path(path), int(data["round"]), state, list(data["history"]),
        dict(data["fingerprint"]), float(data["elapsed_s"]), dict(data.get("counters", {})),
    )


def latest_checkpoint(
    directory: str | os.PathLike[str],
    template: Any,
    fingerprint: Mapping[str, Any] | None = None,
    *,
    ignore: Collection[str] = (),
) -> Checkpoint | None:
    """The newest checkpoint in ``directory`` that verifies, restored into ``template``.

    A file that fails verification (truncated, corrupted, unreadable) is skipped with a
    :class:`CheckpointWarning` and the next older one is tried. A verified checkpoint of
    another run (fingerprint, ``ignore``'s items aside) or of another state structure is
    an error, not skipped.

    Returns:
      The checkpoint, or ``None`` when ``directory`` holds no checkpoint files.

    Raises:
      CheckpointError: checkpoint files exist but none verifies, or the newest verified
        one does not belong to this run.
    """
    problems = []

    def skipped(err: CheckpointError) -> None:
        problems.append(str(err))
        warnings.warn(f"skipping a bad checkpoint: {err}", CheckpointWarning, stacklevel=4)

    found = first_readable((path for _, path in list_checkpoints(directory)),
                           read=read_checkpoint, skipped=skipped)
    if found is not None:
        return _restore(*found, template, fingerprint, ignore)
    if problems:
        raise CheckpointError(
            f"no checkpoint in {directory} verifies: " + "; ".join(problems)
        )
    return None


def newest_readable(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The verified payload (state still encoded) of the newest checkpoint in
    ``directory`` that verifies, the one :func:`latest_checkpoint` restores; None when
    none does. Reads only, and warns of nothing."""
    found = first_readable((path for _, path in list_checkpoints(directory)),
                           read=read_checkpoint)
    return None if found is None else found[1]


def remove_checkpoints(directory: str | os.PathLike[str]) -> int:
    """Deletes the checkpoint files (``ckpt_<round>.msgpack``) in ``directory``; returns
    how many."""
    found = list_checkpoints(directory)
    for _, path in found:
        path.unlink()
    return len(found)
