"""fedax's checkpoint files: one format and one way to write, read and keep them.

The simulator's checkpoints (``fedax.simulation.checkpoint``, ``ckpt_<round>.msgpack``) and
the runtime's files (``fedax.runtime.store``: the server's checkpoint, a client's state) are
all files of this module; those modules only say what a payload holds and how files are
named. A file (no pickle: reading one runs no code)::

    magic    8 bytes  b"FEDAXCK\\0"
    version  uint32 little-endian, FORMAT_VERSION
    length   uint64 little-endian, payload size in bytes
    sha256   32 bytes, SHA-256 of the payload
    payload  msgpack map with str keys (bytes as msgpack bin), the writer's fields

A pytree in a payload (:func:`encode_state`) is a list of its leaves in
``tree_flatten_with_path`` order, each a map {path, dtype, shape, weak_type, key_impl,
data_dtype, data_shape, data}: ``path`` is ``jax.tree_util.keystr``, ``data`` the
little-endian C-order bytes (for a typed PRNG key array, the bytes of
``jax.random.key_data``; ``key_impl`` names the implementation and ``dtype`` is
``key<impl>``). It is read back against a template of the expected structure
(:func:`decode_state`), never trusted.

:func:`write_file` writes a temporary file of mode 0600 in the target's directory (a
runtime file holds the server's secret), fsyncs it, renames it over the target with
``os.replace`` and fsyncs the directory, so a crash mid-write leaves the previous file intact
and a finished write survives a power loss. :func:`read_file` refuses a file that is not
such a frame, is truncated or does not match its SHA-256 (:class:`CheckpointError`, one
line naming the file). Of the last few files kept (:func:`kept_paths` and :func:`rotate`, or
a writer's own names), :func:`first_readable` returns the newest that reads and falls back
to the one before when it is damaged.

Files of the runtime written before this module (frame ``b"FEDAXRT\\0" | sha256 | payload``,
leaves {path, dtype, shape, data} with typed PRNG keys as their raw key data) still read.

Files are written by ``fedax.io.write_atomic`` and payloads packed by ``fedax.io.pack``
(strict msgpack: str keys, no ext types); ``pack`` is importable from here too. This module
imports JAX, NumPy and ``fedax.io``, and nothing of fedax's layers.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedax.io import pack, unpack, write_atomic

FORMAT_VERSION = 1
MAGIC = b"FEDAXCK\0"
_HEADER = struct.Struct("<8sIQ32s")  # magic, version, payload length, sha256
OLD_RUNTIME_MAGIC = b"FEDAXRT\0"  # runtime files before this module: magic | sha256 | body


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: corrupt, truncated, or not from this run."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (it did not verify) and an older one is used instead."""


# ----------------------------------------------------------------------------- pytrees


def is_key(leaf: Any) -> bool:
    """Whether ``leaf`` (an array or a ``jax.ShapeDtypeStruct``) holds typed PRNG keys."""
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def key_impl(leaf: Any) -> Any:
    """The PRNG implementation of a typed key array or ``jax.ShapeDtypeStruct``."""
    if isinstance(leaf, jax.Array):
        return jax.random.key_impl(leaf)
    found = []
    jax.eval_shape(lambda k: found.append(jax.random.key_impl(k)), leaf)
    return found[0]


def _describe(leaf: Mapping[str, Any]) -> str:
    return f"{leaf['dtype']}{list(leaf['shape'])}"


def encode_state(state: Any) -> list[dict[str, Any]]:
    """The leaves of ``state`` as msgpack-ready maps (see the module docstring)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    encoded = []
    for path, leaf in leaves:
        impl = None
        if is_key(leaf):
            impl = str(jax.random.key_impl(leaf))
            value = np.asarray(jax.random.key_data(leaf))
            dtype_name = f"key<{impl}>"
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
            "key_impl": impl,
            "data_dtype": data.dtype.name,
            "data_shape": list(data.shape),
            "data": data.tobytes(),
        })
    return encoded


def _template_leaf(leaf: Any) -> dict[str, Any]:
    if is_key(leaf):
        return {"dtype": f"key<{key_impl(leaf)}>", "shape": list(leaf.shape)}
    dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
    return {"dtype": np.dtype(dtype).name, "shape": list(np.shape(leaf))}


def _current(leaf: Mapping[str, Any], template: Any) -> Mapping[str, Any]:
    """``leaf`` in this format; a leaf of an older runtime file ({path, dtype, shape, data},
    a typed PRNG key as its raw key data) is read as what it is in ``template``."""
    if "key_impl" in leaf:
        return leaf
    old = {**leaf, "weak_type": False, "key_impl": None, "data_dtype": leaf["dtype"],
           "data_shape": leaf["shape"]}
    if is_key(template):
        impl = str(key_impl(template))
        old.update(dtype=f"key<{impl}>", shape=list(template.shape), key_impl=impl)
    return old


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


def decode_state(encoded: Sequence[Mapping[str, Any]], template: Any,
                 what: str = "checkpoint") -> Any:
    """Rebuilds a state saved by :func:`encode_state` in the structure of ``template``.

    Every leaf must match the template's leaf at the same path in dtype and shape (a PRNG
    key leaf also in implementation). Leaves come back where the template's leaves are:
    a ``jax.Array`` leaf is ``device_put`` to its sharding, a typed key is a key array, a
    weakly typed leaf a weakly typed ``jax.Array``, other leaves are NumPy arrays (the
    template may be ``jax.ShapeDtypeStruct``s).

    Raises:
      CheckpointError: a leaf is missing, extra, differs or is malformed; the message
        starts with ``what`` and names the leaf's path.
    """
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    if not isinstance(encoded, list) or not all(
            isinstance(leaf, dict) and isinstance(leaf.get("path"), str) for leaf in encoded):
        raise CheckpointError(f"{what} has a malformed state (not a list of leaves)")
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
            f"{what} state does not have the structure of this run's state: "
            + "; ".join(parts)
        )
    leaves = []
    for path, (_, tmpl) in zip(expected, paths_leaves, strict=True):
        want = _template_leaf(tmpl)
        try:
            leaf = _current(saved[path], tmpl)
            if leaf["dtype"] != want["dtype"] or list(leaf["shape"]) != want["shape"]:
                raise CheckpointError(
                    f"{what} leaf {path} is {_describe(leaf)}, but this run's state has "
                    f"{_describe(want)} there"
                )
            raw = _array(leaf)
            value: jax.Array | np.ndarray = raw
            if leaf["key_impl"] is not None:
                value = jax.random.wrap_key_data(jnp.asarray(raw), impl=key_impl(tmpl))
                if list(value.shape) != want["shape"]:
                    raise ValueError("key data has the wrong shape")
            elif leaf["weak_type"]:
                value = _weak(jnp.asarray(value))
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{what} leaf {path} has malformed data: {err}") from None
        if isinstance(tmpl, jax.Array):
            value = jax.device_put(value, tmpl.sharding)
        leaves.append(value)
    return jax.tree_util.tree_unflatten(treedef, leaves)


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
        h.update(a.data.cast("B"))
    return h.hexdigest()


# ----------------------------------------------------------------------------- files


def frame(body: bytes) -> bytes:
    """A file's bytes: the header (magic, version, length, SHA-256) and then ``body``."""
    return _HEADER.pack(MAGIC, FORMAT_VERSION, len(body), hashlib.sha256(body).digest()) + body


def write_file(path: str | os.PathLike[str], payload: Mapping[str, Any]) -> Path:
    """Writes ``payload`` (a map of msgpack-able values; pytrees as :func:`encode_state`
    lists) to ``path`` atomically, mode 0600 (see the module docstring); returns the path."""
    return write_atomic(path, frame(pack(dict(payload))), mode=0o600)


def _body(path: Path, blob: bytes) -> bytes:
    """The verified payload bytes of a file's ``blob``."""
    if blob[:8] == OLD_RUNTIME_MAGIC and len(blob) >= 40:  # an older runtime file
        digest, body = blob[8:40], blob[40:]
    else:
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
        body = blob[_HEADER.size:]
        if len(body) != length:
            raise CheckpointError(
                f"checkpoint {path} is truncated: payload of {len(body)} bytes, "
                f"header says {length}"
            )
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError(f"checkpoint {path} is corrupted: SHA-256 mismatch")
    return body


def read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The verified payload of a file :func:`write_file` wrote (pytrees still encoded).

    Raises:
      CheckpointError: unreadable, not a fedax checkpoint, another format version,
        truncated, corrupted (its SHA-256 differs), or its payload is not a msgpack map.
        The SHA-256 is no signature (anyone can frame any body), so a payload is checked
        by its reader.
    """
    path = Path(path)
    try:
        blob = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err.strerror}") from None
    try:
        payload = unpack(_body(path, blob))
    except ValueError as err:  # CheckpointError is one
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"checkpoint {path} has a malformed payload: {err}") from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"checkpoint {path} has a malformed payload (a "
                              f"{type(payload).__name__}, not a map)")
    return payload


# ----------------------------------------------------------------------------- kept files


def kept_paths(path: str | os.PathLike[str], keep: int) -> list[Path]:
    """``path`` and the older copies kept beside it (``path.1``, ``path.2``, ...), newest
    first: the names of the last ``keep`` versions of one file (:func:`rotate`)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}.")
    path = Path(path)
    return [path] + [path.with_name(f"{path.name}.{i}") for i in range(1, keep)]


def rotate(paths: Sequence[Path]) -> None:
    """Moves each existing file of ``paths`` (newest first) one place down the list, the
    oldest falling off, to make room for a new ``paths[0]``."""
    for newer, older in zip(paths[-2::-1], paths[:0:-1], strict=True):
        if newer.exists():
            os.replace(newer, older)


def prune(paths: Iterable[Path], keep: int) -> None:
    """Deletes all but the first ``keep`` of ``paths`` (newest first)."""
    for old in list(paths)[keep:]:
        with contextlib.suppress(OSError):
            old.unlink()


def first_readable(
    paths: Iterable[str | os.PathLike[str]],
    *,
    read: Callable[[Path], dict[str, Any]] = read_file,
    skipped: Callable[[CheckpointError], None] | None = None,
) -> tuple[Path, dict[str, Any]] | None:
    """The first of ``paths`` (newest first) that exists and ``read`` verifies, as
    ``(path, payload)``. One that does not verify (damaged, truncated, unreadable) is given
    to ``skipped`` and the one before it tried; ``None`` when none verifies."""
    for path in map(Path, paths):
        if not path.exists():
            continue
        try:
            return path, read(path)
        except CheckpointError as err:
            if skipped is not None:
                skipped(err)
    return None
