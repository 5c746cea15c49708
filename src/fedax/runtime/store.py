"""Files of the runtime: the server's per-round checkpoint and a client's own state.

One format for both, msgpack (no pickle: loading runs no code)::

    magic  8 bytes b"FEDAXRT\\0" | sha256 32 bytes of the payload | payload (msgpack map)

The payload's ``tree`` is a list of arrays ``{path, dtype, shape, data}`` written and read
with ``fedax.runtime.wire``'s codec, so a file is decoded against the structure the
reader expects, exactly as a message is (typed PRNG keys are stored as their key data).
Writes go to a temporary file that is fsynced and renamed over the final name, so a crash
mid-write leaves the previous file intact. (The simulator's checkpoints,
``fedax.simulation.checkpoint``, are the same idea; the runtime may not import the
simulation layer, DESIGN.md "Layers", so this is its own small copy.)
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import jax
import msgpack
import numpy as np

from fedax.runtime import wire

MAGIC = b"FEDAXRT\0"


def _is_key(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def raw(tree: Any) -> Any:
    """``tree`` with typed PRNG keys replaced by their key data (for the wire and files)."""
    return jax.tree.map(lambda a: jax.random.key_data(a) if _is_key(a) else a, tree)


def raw_template(template: Any) -> Any:
    """The ``raw`` form of a template of shapes and dtypes."""
    return jax.eval_shape(raw, template)


def typed(tree: Any, template: Any) -> Any:
    """Inverse of ``raw`` against ``template`` (key leaves wrapped again)."""
    return jax.tree.map(
        lambda a, t: jax.random.wrap_key_data(a, impl=jax.random.key_impl(t))
        if _is_key(t) else a, tree, template)


def encode(tree: Any) -> list[dict[str, Any]]:
    return [{"path": t.path, "dtype": t.dtype, "shape": list(t.shape), "data": t.data}
            for t in wire.encode_tree(raw(tree))]


def decode(items: list[dict[str, Any]], template: Any, what: str) -> Any:
    tensors = [wire.Tensor(path=i["path"], dtype=i["dtype"], shape=i["shape"],
                           data=i["data"]) for i in items]
    arrays = wire.decode_tree(tensors, raw_template(template), what)
    return typed(jax.tree.map(np.array, arrays), template)


def save(path: str | os.PathLike[str], payload: dict[str, Any]) -> None:
    """Write ``payload`` (msgpack-able; arrays as ``encode`` lists) atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = msgpack.packb(payload, use_bin_type=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + hashlib.sha256(body).digest() + body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The payload of a file ``save`` wrote.

    Raises:
      ValueError: not such a file, truncated or corrupted (the checksum differs).
    """
    data = Path(path).read_bytes()
    head, digest, body = data[:8], data[8:40], data[40:]
    if head != MAGIC or len(digest) != 32:
        raise ValueError(f"{path} is not a fedax runtime file")
    if hashlib.sha256(body).digest() != digest:
        raise ValueError(f"{path} is truncated or corrupted (checksum differs); delete it "
                         "or restore a good copy")
    try:  # the frame's checksum is no signature: anyone can frame any body
        payload = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as err:  # msgpack's errors, and TypeError for unhashable map keys
        raise ValueError(f"{path} does not hold a fedax runtime payload ({err})") from None
    if not isinstance(payload, dict):
        raise ValueError(f"{path} does not hold a fedax runtime payload (a "
                         f"{type(payload).__name__}, not a map)")
    return payload


def kept_paths(path: str | os.PathLike[str], keep: int) -> list[Path]:
    """``path`` and the older copies kept beside it (``path.1``, ``path.2``, ...)."""
    path = Path(path)
    return [path] + [path.with_name(f"{path.name}.{i}") for i in range(1, keep)]


def save_kept(paths: list[Path], payload: dict[str, Any]) -> None:
    """``save`` to ``paths[0]`` after shifting the files there one place down the list
    (the oldest falls off): the last ``len(paths)`` versions are kept."""
    for newer, older in zip(paths[-2::-1], paths[:0:-1], strict=True):
        if newer.exists():
            os.replace(newer, older)
    save(paths[0], payload)


def load_newest(paths: list[Path]) -> tuple[Path | None, dict[str, Any] | None]:
    """The first of ``paths`` that exists and loads, as ``(path, payload)``; a damaged
    one is logged and the next tried. ``(None, None)`` if none does."""
    import logging

    for path in paths:
        if not path.exists():
            continue
        try:
            return path, load(path)
        except ValueError as err:
            logging.getLogger("fedax.runtime").warning("%s; trying the one before it", err)
    return None, None
