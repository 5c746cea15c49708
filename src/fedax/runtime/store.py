"""Files of the runtime: the server's per-round checkpoint and a client's own state.

They are ``fedax.checkpoint`` files, the simulator's format: a header with a SHA-256 of the
msgpack payload, written atomically (a 0600 temporary file, fsynced, renamed; the server's
checkpoint holds its secret), pytrees as ``fedax.checkpoint.encode_state`` leaves decoded
against the structure the reader expects, the last few kept with a fallback to the one
before a damaged newest. Files written before (``b"FEDAXRT\\0"`` frames) still read. What
is the runtime's own is here: PRNG keys travel on the wire as their raw key data
(``raw``, ``raw_template``, ``typed``), and the names ``save`` etc. its callers use.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax

from fedax import checkpoint
from fedax.checkpoint import (  # noqa: F401 (store's names)
    MAGIC,
    OLD_RUNTIME_MAGIC,
    frame,
    is_key,
    kept_paths,
)

save = checkpoint.write_file  # save(path, payload): atomically, mode 0600
load = checkpoint.read_file  # load(path) -> payload; CheckpointError (a ValueError) if bad
encode = checkpoint.encode_state


def raw(tree: Any) -> Any:
    """``tree`` with typed PRNG keys replaced by their key data (for the wire)."""
    return jax.tree.map(lambda a: jax.random.key_data(a) if is_key(a) else a, tree)


def raw_template(template: Any) -> Any:
    """The ``raw`` form of a template of shapes and dtypes."""
    return jax.eval_shape(raw, template)


def typed(tree: Any, template: Any) -> Any:
    """Inverse of ``raw`` against ``template`` (key leaves wrapped again)."""
    return jax.tree.map(
        lambda a, t: jax.random.wrap_key_data(a, impl=checkpoint.key_impl(t))
        if is_key(t) else a, tree, template)


def decode(items: list[dict[str, Any]], template: Any, what: str) -> Any:
    """The pytree ``encode`` stored, in ``template``'s structure (``what`` names it in
    errors)."""
    return checkpoint.decode_state(items, template, what)


def save_kept(paths: list[Path], payload: dict[str, Any]) -> None:
    """``save`` to ``paths[0]`` (``kept_paths``) after shifting the files there one place
    down the list (the oldest falls off): the last ``len(paths)`` versions are kept."""
    checkpoint.rotate(paths)
    save(paths[0], payload)


def load_newest(paths: list[Path]) -> tuple[Path | None, dict[str, Any] | None]:
    """The first of ``paths`` that exists and loads, as ``(path, payload)``; a damaged
    one is logged and the next tried. ``(None, None)`` if none does."""
    log = logging.getLogger("fedax.runtime")
    found = checkpoint.first_readable(
        paths, skipped=lambda err: log.warning("%s; trying the one before it", err))
    return (None, None) if found is None else found
