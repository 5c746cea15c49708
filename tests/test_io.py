"""fedax.io: atomic writes, strict JSON and strict msgpack."""

import datetime
import errno
import math
import os
import stat

import msgpack
import numpy as np
import pytest

from fedax import io


def test_write_atomic_replaces_the_file_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "sub" / "f.txt"
    assert io.write_atomic(path, "one") == path
    io.write_atomic(path, b"two")
    assert path.read_bytes() == b"two"
    assert os.listdir(path.parent) == ["f.txt"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("durable", [True, False])
def test_a_failed_rename_keeps_the_previous_file_and_names_the_target(tmp_path, monkeypatch,
                                                                       durable):
    path = tmp_path / "summary.json"
    path.write_text("old")

    def fail(src, dst):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError) as err:
        io.write_atomic(path, "new", durable=durable)
    assert err.value.errno == errno.EIO and err.value.filename == str(path)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["summary.json"]


def test_a_full_disk_mid_write_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    path.write_bytes(b"old")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left") as err:
        io.write_atomic(path, b"new")
    assert err.value.filename == str(path)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["ckpt"]


def test_write_json_refuses_what_json_cannot_hold_and_keeps_the_previous_file(tmp_path):
    path = tmp_path / "summary.json"
    io.write_json(path, {"a": 1})
    for bad in ({"a": math.nan}, {"a": math.inf}, {"a": object()}, {"a": np.int64(1)}):
        with pytest.raises(ValueError, match=f"cannot write {path} as JSON") as err:
            io.write_json(path, bad)
        assert "\n" not in str(err.value)
        assert io.read_json(path) == {"a": 1} and os.listdir(tmp_path) == ["summary.json"]
    assert path.read_text() == '{\n  "a": 1\n}\n'


def test_finite_json_turns_non_finite_floats_into_null():
    clean, bad = io.finite_json({"a": [1.0, np.float32(np.nan)], "b": (math.inf, 2), "c": "x"})
    assert clean == {"a": [1.0, None], "b": [None, 2], "c": "x"} and bad
    assert io.finite_json({"a": np.float64(0.5)}) == ({"a": 0.5}, False)
    assert io.json_text(clean) == '{"a": [1.0, null], "b": [null, 2], "c": "x"}'
    with pytest.raises(ValueError):
        io.json_text({"a": math.nan})


def test_write_json_honours_mode_0600(tmp_path):
    path = tmp_path / "secret.json"
    io.write_json(path, {"k": "v"}, mode=0o600)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    io.write_atomic(path, b"x", mode=0o640)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_read_json_refuses_non_finite_tokens(tmp_path, token):
    path = tmp_path / "s.json"
    path.write_text(f'{{"a": {token}}}')
    with pytest.raises(ValueError, match=f"{path} is not valid JSON") as err:
        io.read_json(path)
    assert "\n" not in str(err.value)


def test_read_json_names_the_file_on_a_parse_error(tmp_path):
    path = tmp_path / "s.json"
    path.write_text('{"a": 1')
    with pytest.raises(ValueError, match=f"{path} is not valid JSON"):
        io.read_json(path)
    with pytest.raises(FileNotFoundError):
        io.read_json(tmp_path / "missing.json")


def test_append_line_and_read_jsonl_skip_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    io.append_line(path, io.json_text({"round": 1}))
    io.append_line(path, io.json_text({"round": 2}), durable=True)
    with path.open("a") as f:
        f.write('{"round": 3')  # a crash mid-append
    assert io.read_jsonl(path) == [{"round": 1}, {"round": 2}]
    with pytest.raises(ValueError, match="newline"):
        io.append_line(path, "a\nb")
    with pytest.raises(OSError) as err:
        io.append_line(tmp_path / "no" / "such.jsonl", "x")
    assert err.value.filename == str(tmp_path / "no" / "such.jsonl")


def test_pack_round_trips_plain_data():
    value = {"a": [1, 2.5, None, True], "b": b"\x00\x01", "c": {"d": "e"}, "f": (1, 2),
             "g": np.float32(0.5), "h": np.int64(7)}
    assert io.unpack(io.pack(value)) == {**value, "f": [1, 2], "g": 0.5, "h": 7}


@pytest.mark.parametrize("bad", [
    {1: "int key"},
    {"a": {b"k": 1}},
    {"a": msgpack.ExtType(5, b"x")},
    {"a": msgpack.Timestamp(1)},
    {"a": datetime.datetime.now(datetime.timezone.utc)},
    {"a": np.zeros(2)},
    {"a": object()},
])
def test_pack_refuses_what_it_should(bad):
    with pytest.raises(TypeError):
        io.pack(bad)


@pytest.mark.parametrize("blob", [
    msgpack.packb({1: 2}, strict_types=False),
    msgpack.packb({"a": msgpack.ExtType(5, b"x")}),
    msgpack.packb({"a": msgpack.Timestamp(1)}),
    msgpack.packb({b"k": 1}, use_bin_type=True),
    b"\xc1",  # never used
    msgpack.packb({"a": 1}) + b"\x01",  # extra data
    msgpack.packb({"a": [1, 2]})[:-1],  # truncated
])
def test_unpack_refuses_what_it_should(blob):
    with pytest.raises(ValueError):
        io.unpack(blob)
