"""fedax.checkpoint, the one checkpoint format: the simulator's and the runtime's files are
the same frames, written the same way, and older runtime files still read."""

import hashlib
import logging
import os
import stat

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest

from fedax import checkpoint
from fedax.runtime import store, wire
from fedax.simulation import checkpoint as ckpt


def tree():
    return {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3),
            "count": jnp.asarray(3),  # weakly typed
            "keys": jax.random.split(jax.random.key(7), 4),  # typed PRNG keys
            "n": np.arange(3, dtype=np.int32)}


def same(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        if checkpoint.is_key(x):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_runtime_and_simulator_files_are_one_format(tmp_path):
    path = tmp_path / "server_checkpoint.msgpack"
    store.save(path, {"version": 2, "round": 1, "state": store.encode(tree()),
                      "secret": b"\x01" * 32, "score": np.float32(0.5)})
    blob = path.read_bytes()
    assert blob[:8] == ckpt.MAGIC == store.MAGIC and b"pickle" not in blob
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # it may hold the server's secret
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    data = checkpoint.read_file(path)
    assert data == store.load(path) and data["secret"] == b"\x01" * 32
    assert data["score"] == 0.5
    # Against a template of shapes and dtypes, as the runtime decodes: weak types and keys kept.
    restored = store.decode(data["state"], jax.eval_shape(tree), "checkpoint")
    same(restored, tree())
    assert restored["count"].weak_type and isinstance(restored["n"], np.ndarray)
    # A simulator checkpoint is the same frame and the same leaves.
    sim = ckpt.save_checkpoint(tmp_path / "sim", 3, tree())
    assert checkpoint.read_file(sim)["state"] == data["state"]
    assert stat.S_IMODE(os.stat(sim).st_mode) == 0o600


def test_a_write_is_fsynced_with_its_directory(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    checkpoint.write_file(tmp_path / "f.msgpack", {"a": 1})
    assert synced == [False, True]  # the file, then the directory holding its new name


def test_an_old_runtime_file_still_loads(tmp_path):
    """A file as the runtime wrote it before fedax.checkpoint: ``FEDAXRT\\0 | sha256 |
    body``, its leaves ``{path, dtype, shape, data}`` with keys as raw key data."""
    state = tree()
    items = [{"path": t.path, "dtype": t.dtype, "shape": list(t.shape), "data": t.data}
             for t in wire.encode_tree(store.raw(state))]
    body = msgpack.packb({"version": 2, "round": 4, "state": items}, use_bin_type=True)
    path = tmp_path / "old.msgpack"
    path.write_bytes(b"FEDAXRT\0" + hashlib.sha256(body).digest() + body)
    data = store.load(path)
    assert data["round"] == 4
    same(store.decode(data["state"], jax.eval_shape(lambda: state), "checkpoint"), state)
    path.write_bytes(b"FEDAXRT\0" + hashlib.sha256(body).digest() + body[:-1])
    with pytest.raises(ValueError, match="corrupted: SHA-256 mismatch"):
        store.load(path)


def test_decode_names_what_and_the_leaf(tmp_path):
    encoded = store.encode(tree())
    other = {**tree(), "w": jnp.zeros((3, 2))}
    with pytest.raises(ValueError, match=r"client state leaf \['w'\] is float32\[2, 3\]"):
        store.decode(encoded, other, "client state")
    with pytest.raises(ValueError, match="client state has a malformed state"):
        store.decode({"not": "a list"}, tree(), "client state")
    encoded[0]["data"] = encoded[0]["data"][:-1]
    with pytest.raises(ValueError, match=r"leaf \['count'\] has malformed data"):
        store.decode(encoded, tree(), "client state")


def test_kept_files_rotate_and_a_damaged_newest_falls_back(tmp_path, caplog):
    paths = store.kept_paths(tmp_path / "c.msgpack", 3)
    assert [p.name for p in paths] == ["c.msgpack", "c.msgpack.1", "c.msgpack.2"]
    for r in range(5):
        store.save_kept(paths, {"round": r})
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in paths]
    assert [store.load(p)["round"] for p in paths] == [4, 3, 2]
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in paths)
    blob = bytearray(paths[0].read_bytes())
    blob[-1] ^= 0xFF
    paths[0].write_bytes(bytes(blob))
    with caplog.at_level(logging.WARNING, logger="fedax.runtime"):
        path, data = store.load_newest(paths)
    assert (path, data["round"]) == (paths[1], 3)
    assert "trying the one before it" in caplog.text
    assert store.load_newest([tmp_path / "none"]) == (None, None)
    with pytest.raises(ValueError, match="keep must be >= 1"):
        checkpoint.kept_paths(tmp_path / "c.msgpack", 0)
