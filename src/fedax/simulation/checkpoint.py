"""Checkpoints of a simulation run, for exact resume: format, atomic writes, verification.

A checkpoint holds everything the runner needs to continue a run bit-identically: the
algorithm state pytree (server and optimizer state, per-client state, PRNG keys, round
counters: any leaves), the evaluation records so far, the elapsed time, the number of
rounds completed, and the run's fingerprint (what must not change between the run and its
resumption). Cohorts and round keys are derived from ``(seed, t)`` and need no saving.

File ``ckpt_<round>.msgpack`` (no pickle: loading a checkpoint runs no code)::

    magic    8 bytes  b"FEDAXCK\\0"
    version  uint32 little-endian, FORMAT_VERSION
    length   uint64 little-endian, payload size in bytes
    sha256   32 bytes, SHA-256 of the payload
    payload  msgpack map:
      version      int, FORMAT_VERSION
      round        int, rounds completed (resume starts at round index ``round``)
      fingerprint  map str -> scalar, identifies the run (compared on resume)
      history      list of the evaluation records (maps) so far
      elapsed_s    float, run time up to this checkpoint
      counters     map str -> int, the runner's running counts (e.g. clients rejected since
                   the last record); absent in older files, read as empty
      state        list of leaves in ``tree_flatten_with_path`` order, each a map
                   {path, dtype, shape, weak_type, key_impl, data}: ``data`` is the
                   little-endian C-order bytes (for a typed PRNG key array, the bytes of
                   ``jax.random.key_data`` and ``key_impl`` names the implementation)
      meta         map: fedax and jax versions (informational)

A truncated or corrupted file fails the length or SHA-256 check. Writes go to a temporary
file in the same directory, are fsynced, and are renamed over the final name with
``os.replace``, so a crash mid-write leaves the previous checkpoints intact; the last
``keep`` (default 2) are kept, and :func:`latest_checkpoint` falls back to an older one
(with a :class:`CheckpointWarning`) when the newest does not verify.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import struct
import tempfile
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import msgpack
import numpy as np

FORMAT_VERSION = 1
MAGIC = b"FEDAXCK\0"
_HEADER = struct.Struct("<8sIQ32s")  # magic, version, payload length, sha256
_NAME = re.compile(r"ckpt_(\d+)\.msgpack")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: corrupt, truncated, or not from this run."""


class ResumeError(CheckpointError):
    """A run that cannot be continued as asked, though its checkpoint is this run's: a
    schedule shorter than the rounds it has done, or a noise multiplier calibrated to the
    rounds it started with. ``settings`` (``key=value`` strings, possibly empty) are config
    values under which it can be continued."""

    def __init__(self, message: str, settings: Sequence[str] = ()):
        super().__init__(message)
        self.settings = tuple(settings)


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (it did not verify) and an older one is used instead."""


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


# ----------------------------------------------------------------------------- pytrees


def _is_key(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _describe(leaf: Any) -> str:
    return f"{leaf['dtype']}{list(leaf['shape'])}"


def encode_state(state: Any) -> list[dict[str, Any]]:
    """The leaves of ``state`` as msgpack-ready maps (see the module docstring)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    encoded = []
    for path, leaf in leaves:
        key_impl = None
        if _is_key(leaf):
            key_impl = str(jax.random.key_impl(leaf))
            value = np.asarray(jax.random.key_data(leaf))
            dtype_name = f"key<{key_impl}>"
        else:
            value = np.asarray(leaf)
            dtype_name = value.dtype.name
        data = np.asarray(value, order="C")
        if data.dtype.byteorder == ">":
            data = data.astype(data.dtype.newbyteorder("<"))
        encoded.append({
            "path": jax.tree_util.keystr(path),
            "dtype": dtype_name,
            "shape": list(np.shape(leaf)),
            "weak_type": bool(getattr(leaf, "weak_type", False)),
            "key_impl": key_impl,
            "data_dtype": data.dtype.name,
            "data_shape": list(data.shape),
            "data": data.tobytes(),
        })
    return encoded


def _template_leaf(leaf: Any) -> dict[str, Any]:
    if _is_key(leaf):
        return {"dtype": f"key<{jax.random.key_impl(leaf)}>", "shape": list(leaf.shape)}
    dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
    return {"dtype": np.dtype(dtype).name, "shape": list(np.shape(leaf))}


def _weak(value: jax.Array) -> jax.Array:
    # JAX has no public constructor for a weakly typed array; weak types take part in
    # type promotion and in the jit cache key, so a restored leaf keeps the saved one.
    from jax._src.lax.lax import _convert_element_type

    return _convert_element_type(value, value.dtype, weak_type=True)


def _array(leaf: Mapping[str, Any]) -> np.ndarray:
    """The NumPy array of an encoded leaf, checking that its bytes fill its shape exactly."""
    if leaf["key_impl"] is None and (
        leaf["data_dtype"] != leaf["dtype"] or list(leaf["data_shape"]) != list(leaf["shape"])
    ):
        raise ValueError("data dtype/shape differ from the leaf's")
    dtype = jnp.dtype(leaf["data_dtype"])
    shape = tuple(int(d) for d in leaf["data_shape"])
    count = int(np.prod(shape, dtype=np.int64))
    if len(leaf["data"]) != count * dtype.itemsize:
        raise ValueError(f"{len(leaf['data'])} bytes for {count} x {dtype.name}")
    value = np.frombuffer(leaf["data"], dtype=dtype.newbyteorder("<"), count=count)
    return value.astype(dtype).reshape(shape)


def decode_state(encoded: Sequence[Mapping[str, Any]], template: Any) -> Any:
    """Rebuilds a state saved by :func:`encode_state` in the structure of ``template``.

    Every leaf must match the template's leaf at the same path in dtype and shape (a PRNG
    key leaf also in implementation). Leaves come back where the template's leaves are:
    a ``jax.Array`` leaf is ``device_put`` to its sharding, other leaves are NumPy arrays.

    Raises:
      CheckpointError: a leaf is missing, extra, or differs; the message names its path.
    """
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    saved = {leaf["path"]: leaf for leaf in encoded}
    expected = [jax.tree_util.keystr(p) for p, _ in paths_leaves]
    missing = [p for p in expected if p not in saved]
    extra = [p for p in saved if p not in set(expected)]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing leaves {missing[:3]}{' ...' if len(missing) > 3 else ''}")
        if extra:
            parts.append(f"unexpected leaves {extra[:3]}{' ...' if len(extra) > 3 else ''}")
        raise CheckpointError(
            "checkpoint state does not have the structure of this run's state: "
            + "; ".join(parts)
        )
    leaves = []
    for path, (_, tmpl) in zip(expected, paths_leaves, strict=True):
        leaf = saved[path]
        want = _template_leaf(tmpl)
        if leaf["dtype"] != want["dtype"] or list(leaf["shape"]) != want["shape"]:
            raise CheckpointError(
                f"checkpoint leaf {path} is {_describe(leaf)}, but this run's state has "
                f"{_describe(want)} there"
            )
        try:
            value = _array(leaf)
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"checkpoint leaf {path} has malformed data: {err}") from None
        if leaf["key_impl"] is not None:
            value = jax.random.wrap_key_data(value, impl=leaf["key_impl"])
            if tuple(value.shape) != tuple(want["shape"]):
                raise CheckpointError(f"checkpoint leaf {path}: key data has the wrong shape")
        elif leaf["weak_type"]:
            value = _weak(jnp.asarray(value))
        if isinstance(tmpl, jax.Array):
            value = jax.device_put(value, tmpl.sharding)
        leaves.append(value)
    return jax.tree_util.tree_unflatten(treedef, leaves)


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


def _default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot store {type(obj).__name__} in a checkpoint")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory file descriptors
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
    from fedax import __version__ as fedax_version

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    payload = msgpack.packb(
        {
            "version": FORMAT_VERSION,
            "round": int(round_),
            "fingerprint": dict(fingerprint or {}),
            "history": [dict(r) for r in history],
            "elapsed_s": float(elapsed_s),
            "counters": dict(counters or {}),
            "state": encode_state(state),
            "meta": {"fedax": str(fedax_version), "jax": jax.__version__},
        },
        use_bin_type=True,
        default=_default,
    )
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), hashlib.sha256(payload).digest())
    final = checkpoint_path(directory, round_)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{final.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)
    for _, old in list_checkpoints(directory)[keep:]:
        with contextlib.suppress(OSError):
            old.unlink()
    return final


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The verified payload of a checkpoint file (state leaves still encoded).

    Raises:
      CheckpointError: not a fedax checkpoint, another format version, truncated, or its
        SHA-256 does not match (corrupted).
    """
    path = Path(path)
    try:
        blob = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err.strerror}") from None
    if len(blob) < _HEADER.size:
        raise CheckpointError(
            f"checkpoint {path} is truncated ({len(blob)} bytes, shorter than its header)"
        )
    magic, version, length, digest = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise CheckpointError(f"{path} is not a fedax checkpoint (bad magic bytes)")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {version}; this fedax reads "
            f"version {FORMAT_VERSION}"
        )
    payload = blob[_HEADER.size:]
    if len(payload) != length:
        raise CheckpointError(
            f"checkpoint {path} is truncated: payload of {len(payload)} bytes, "
            f"header says {length}"
        )
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"checkpoint {path} is corrupted: SHA-256 mismatch")
    try:
        data = msgpack.unpackb(payload, raw=False)
    except Exception as err:  # msgpack raises several types for malformed input
        raise CheckpointError(f"checkpoint {path} has a malformed payload: {err}") from None
    required = ("version", "round", "fingerprint", "history", "elapsed_s", "state")
    if not isinstance(data, dict) or any(k not in data for k in required):
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
        current = msgpack.unpackb(
            msgpack.packb(dict(fingerprint), use_bin_type=True, default=_default), raw=False
        )
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
    found = list_checkpoints(directory)
    problems = []
    for _, path in found:
        try:
            data = read_checkpoint(path)
        except CheckpointError as err:
            problems.append(str(err))
            warnings.warn(f"skipping a bad checkpoint: {err}", CheckpointWarning, stacklevel=2)
            continue
        return _restore(path, data, template, fingerprint, ignore)
    if problems:
        raise CheckpointError(
            f"no checkpoint in {directory} verifies: " + "; ".join(problems)
        )
    return None


def newest_readable(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The verified payload (state still encoded) of the newest checkpoint in
    ``directory`` that verifies, the one :func:`latest_checkpoint` restores; None when
    none does. Reads only, and warns of nothing."""
    for _, path in list_checkpoints(directory):
        try:
            return read_checkpoint(path)
        except CheckpointError:
            continue
    return None


def remove_checkpoints(directory: str | os.PathLike[str]) -> int:
    """Deletes the checkpoint files (``ckpt_<round>.msgpack``) in ``directory``; returns
    how many."""
    found = list_checkpoints(directory)
    for _, path in found:
        path.unlink()
    return len(found)


def tree_sha256(tree: Any) -> str:
    """SHA-256 of a pytree's leaf paths, dtypes, shapes and bytes (a content fingerprint)."""
    h = hashlib.sha256()
    for leaf in encode_state(tree):
        h.update(f"{leaf['path']}|{leaf['dtype']}|{leaf['shape']}|".encode())
        h.update(leaf["data"])
    return h.hexdigest()


def arrays_sha256(*arrays: np.ndarray) -> str:
    """SHA-256 of NumPy arrays' dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.asarray(a, order="C")
        h.update(f"{a.dtype.str}|{a.shape}|".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()
