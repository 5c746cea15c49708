"""fedax's one way to write and read files: atomically, as strict JSON or as msgpack.

:func:`write_atomic` writes a temporary file in the target's directory, fsyncs it, renames
it over the target with ``os.replace`` and fsyncs the directory, so a reader sees the old
file or the whole new one and a crash mid-write leaves the previous file intact. Every file
fedax writes whole (checkpoints, ``summary.json``, a run's records, a cached download)
goes through it; ``mode=0o600`` keeps a secret its owner's from the first byte.

JSON is strict both ways: NaN and Infinity are not JSON, so :func:`json_text` and
:func:`write_json` refuse them (:func:`finite_json` first turns them into null, as the
writers of records do) and :func:`read_json` refuses their tokens. msgpack (:func:`pack`,
:func:`unpack`) is strict too: maps have str keys, and ext types (timestamps included) are
refused, so reading a file builds plain data and runs no code.

This module imports the standard library, NumPy and msgpack, and nothing of fedax.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

__all__ = [
    "append_line",
    "finite_json",
    "json_text",
    "pack",
    "read_json",
    "read_jsonl",
    "unpack",
    "write_atomic",
    "write_json",
]

PathLike = str | os.PathLike[str]


# ----------------------------------------------------------------------------- files


def _fsync_dir(directory: Path) -> None:
    """fsyncs ``directory`` (a rename in it survives a power loss); a no-op where
    directories cannot be opened or synced."""
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


def _naming(err: OSError, path: Path, tmp: Path) -> OSError:
    """``err`` naming ``path`` where it named nothing or the temporary file."""
    if err.errno is not None and err.filename in (None, str(tmp)):
        return OSError(err.errno, err.strerror, str(path))
    return err


def write_atomic(path: PathLike, data: bytes | str, *, mode: int | None = None,
                 durable: bool = True) -> Path:
    """Writes ``data`` (a str as UTF-8) to ``path`` as a whole or not at all; returns the path.

    A temporary file in the target's directory (created with it if missing) is written,
    fsynced, and renamed over ``path``; the directory is fsynced after. ``mode`` (e.g.
    ``0o600``) is the file's mode from its creation on; ``None`` gives the usual ``0o666``
    less the umask. ``durable=False`` skips both fsyncs (still atomic, not power-loss safe).

    Raises:
      OSError: the write failed (the previous file is intact and no temporary file is
        left); it names ``path``.
    """
    path = Path(path)
    blob = data.encode() if isinstance(data, str) else bytes(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        # Created no wider than ``mode`` allows its owner, then given exactly ``mode``.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                     0o666 if mode is None else mode & 0o600)
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(blob)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise _naming(err, path, tmp) from err
        raise
    if durable:
        _fsync_dir(path.parent)
    return path


def append_line(path: PathLike, text: str, *, durable: bool = False) -> Path:
    """Appends ``text`` and a newline to ``path`` (a JSON-lines record file), creating the
    file if needed; ``durable`` fsyncs it. A torn last line is what a crash can leave
    (:func:`read_jsonl` skips it). An OSError names ``path``."""
    path = Path(path)
    if "\n" in text:
        raise ValueError(f"a line for {path} holds a newline")
    try:
        with path.open("a", encoding="utf-8") as f:
            f.write(text + "\n")
            if durable:
                f.flush()
                os.fsync(f.fileno())
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(path)) from err
    return path


# ----------------------------------------------------------------------------- JSON


def finite_json(value: Any) -> tuple[Any, bool]:
    """``value`` with every non-finite float (NaN, inf) replaced by None (NumPy floats as
    Python floats), and whether there was one; dicts, lists and tuples are walked."""
    if isinstance(value, (float, np.floating)):
        return (float(value), False) if math.isfinite(value) else (None, True)
    if isinstance(value, dict):
        items = {k: finite_json(v) for k, v in value.items()}
        return {k: v for k, (v, _) in items.items()}, any(bad for _, bad in items.values())
    if isinstance(value, (list, tuple)):
        items_ = [finite_json(v) for v in value]
        return [v for v, _ in items_], any(bad for _, bad in items_)
    return value, False


def json_text(value: Any, **kwargs: Any) -> str:
    """Strict JSON text of ``value`` (``json.dumps`` keywords apply): a non-finite float
    raises ValueError (clean it with :func:`finite_json` first)."""
    return json.dumps(value, allow_nan=False, **kwargs)


def write_json(path: PathLike, obj: Any, *, indent: int | None = 2,
               mode: int | None = None) -> Path:
    """Writes ``obj`` as strict JSON (and a newline) with :func:`write_atomic`.

    Raises:
      ValueError: ``obj`` holds a value JSON cannot hold (NaN, inf, an object json cannot
        encode); one line naming ``path``, and the previous file is intact.
    """
    try:
        text = json_text(obj, indent=indent)
    except (TypeError, ValueError) as err:
        raise ValueError(f"cannot write {path} as JSON: {err}") from None
    return write_atomic(path, text + "\n", mode=mode)


def _refuse_constant(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")


def _loads(text: str | bytes) -> Any:
    return json.loads(text, parse_constant=_refuse_constant)


def read_json(path: PathLike) -> Any:
    """The strict JSON value in ``path`` (NaN and Infinity tokens are refused).

    Raises:
      ValueError: the file is not strict JSON; one line naming it.
      OSError: the file cannot be read.
    """
    text = Path(path).read_bytes()
    try:
        return _loads(text)
    except ValueError as err:  # json.JSONDecodeError and the refused constants
        raise ValueError(f"{path} is not valid JSON: {err}") from None


def read_jsonl(path: PathLike) -> list[Any]:
    """The values of a JSON-lines file, one per line (strict JSON); a line that does not
    parse (e.g. torn by a crash mid-append) is skipped."""
    values = []
    for line in Path(path).read_text().splitlines():
        try:
            values.append(_loads(line))
        except ValueError:
            continue
    return values


# ----------------------------------------------------------------------------- msgpack


def _default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Mapping):
        return dict(obj)
    raise TypeError(f"cannot pack {type(obj).__name__}")


def _check(value: Any, packing: bool) -> None:
    """Raises unless every map of ``value`` has str keys and nothing is an ext type."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (msgpack.ExtType, msgpack.Timestamp)):  # ExtType is a tuple
            raise (TypeError("cannot pack a msgpack ext type") if packing
                   else ValueError("msgpack data has an ext type"))
        if isinstance(item, Mapping):
            for key, sub in item.items():
                if not isinstance(key, str):
                    what = f"a map key of type {type(key).__name__} (keys are str)"
                    raise (TypeError(f"cannot pack {what}") if packing
                           else ValueError(f"msgpack data has {what}"))
                stack.append(sub)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def pack(obj: Any) -> bytes:
    """``obj`` as msgpack: maps with str keys, bytes as bin, NumPy scalars as Python numbers.

    Raises:
      TypeError: ``obj`` holds something else (a non-str key, an ext type, an object).
    """
    _check(obj, packing=True)
    return msgpack.packb(obj, use_bin_type=True, default=_default, datetime=False)


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack data has an ext type ({code})")


def unpack(blob: bytes) -> Any:
    """The value :func:`pack` packed (bin as bytes, arrays as lists).

    Raises:
      ValueError: ``blob`` is not one msgpack value, or holds a non-str map key or an ext
        type (timestamps included).
    """
    try:
        value = msgpack.unpackb(blob, raw=False, strict_map_key=False, ext_hook=_no_ext,
                                timestamp=0)
    except ValueError:
        raise
    except Exception as err:  # msgpack raises several types for malformed input
        raise ValueError(f"malformed msgpack data: {err}") from None
    _check(value, packing=False)
    return value
