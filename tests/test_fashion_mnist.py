"""Fashion-MNIST source: Debian-style gzipped files, verified cache, errors. No network."""

import gzip
import hashlib
import os
import struct

import numpy as np
import pytest

from fedax.data import DataUnavailableError, fashion_mnist, load_fashion_mnist, mnist
from fedax.data._cache import Source
from fedax.data._sources import local_gzip_source

NAMES = (mnist.TRAIN_IMAGES, mnist.TRAIN_LABELS, mnist.TEST_IMAGES, mnist.TEST_LABELS)


def idx_u8(array: np.ndarray) -> bytes:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim)
    return header + struct.pack(f">{array.ndim}I", *array.shape) + array.astype(np.uint8).tobytes()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def fake_debian(tmp_path):
    """Tiny Fashion-MNIST-layout IDX files, gzipped in a package-like directory."""
    rng = np.random.default_rng(0)
    files = {
        mnist.TRAIN_IMAGES: idx_u8(rng.integers(0, 256, (20, 28, 28))),
        mnist.TRAIN_LABELS: idx_u8(np.arange(20) % 10),
        mnist.TEST_IMAGES: idx_u8(rng.integers(0, 256, (10, 28, 28))),
        mnist.TEST_LABELS: idx_u8(np.arange(10)[::-1]),
    }
    package = tmp_path / "usr-share-datasets-fashion-mnist"
    package.mkdir()
    for name, data in files.items():
        (package / f"{name}.gz").write_bytes(gzip.compress(data))
    return files, package, {name: sha(data) for name, data in files.items()}


def failing(name, message="boom"):
    def fetch(names):
        raise OSError(message)

    return Source(name, fetch)


def test_load_from_gzipped_package_dir(tmp_path, fake_debian):
    files, package, checksums = fake_debian
    cache = tmp_path / "cache"
    data = load_fashion_mnist(cache, sources=[local_gzip_source(package)], checksums=checksums)
    assert data["x_train"].shape == (20, 28, 28, 1) and data["x_train"].dtype == np.float32
    assert data["x_test"].shape == (10, 28, 28, 1)
    assert data["y_train"].dtype == np.int32 and data["y_test"].dtype == np.int32
    np.testing.assert_array_equal(data["y_test"], np.arange(10)[::-1])
    raw = mnist.parse_idx(files[mnist.TEST_IMAGES])
    np.testing.assert_allclose(data["x_test"][..., 0], raw / 255.0, rtol=1e-6)
    assert 0.0 <= data["x_train"].min() and data["x_train"].max() <= 1.0
    for name, raw_bytes in files.items():  # cached raw (gunzipped), under fashion-mnist/
        assert (cache / "fashion-mnist" / name).read_bytes() == raw_bytes
    assert not (cache / "mnist").exists()
    # Cached and valid: no source is consulted again.
    load_fashion_mnist(cache, sources=[failing("unused")], checksums=checksums)


def test_local_gzip_source_partial_and_missing(tmp_path, fake_debian):
    files, package, checksums = fake_debian
    (package / f"{mnist.TEST_LABELS}.gz").unlink()
    source = local_gzip_source(package)
    got = source.fetch(NAMES)
    assert set(got) == set(NAMES) - {mnist.TEST_LABELS}
    assert got[mnist.TRAIN_LABELS] == files[mnist.TRAIN_LABELS]
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte.gz"):
        source.fetch([mnist.TEST_LABELS])
    with pytest.raises(FileNotFoundError):
        local_gzip_source(tmp_path / "absent").fetch(NAMES)
    # The missing file then comes from the next source.
    rest = tmp_path / "rest"
    rest.mkdir()
    (rest / f"{mnist.TEST_LABELS}.gz").write_bytes(gzip.compress(files[mnist.TEST_LABELS]))
    fashion_mnist.fetch_fashion_mnist(
        tmp_path / "cache",
        sources=[failing("offline"), source, local_gzip_source(rest)],
        checksums=checksums,
    )


def test_tampered_package_file_rejected(tmp_path, fake_debian):
    files, package, checksums = fake_debian
    bad = bytearray(files[mnist.TRAIN_IMAGES])
    bad[500] ^= 0xFF
    (package / f"{mnist.TRAIN_IMAGES}.gz").write_bytes(gzip.compress(bytes(bad)))
    with pytest.raises(DataUnavailableError, match="SHA-256 mismatch"):
        load_fashion_mnist(
            tmp_path / "cache", sources=[local_gzip_source(package)], checksums=checksums
        )
    # Verified files were kept; the bad one was never written.
    cached = tmp_path / "cache" / "fashion-mnist"
    assert sorted(p.name for p in cached.iterdir()) == sorted(set(NAMES) - {mnist.TRAIN_IMAGES})


def test_unavailable_message_suggests_debian_package(tmp_path):
    sources = [local_gzip_source(tmp_path / "no-package"), failing("mirror-x", "unreachable")]
    with pytest.raises(DataUnavailableError) as info:
        load_fashion_mnist(tmp_path / "cache", sources=sources)
    message = str(info.value)
    for text in [
        "apt-get install dataset-fashion-mnist",
        str(fashion_mnist.DEBIAN_DIR),
        str(tmp_path / "no-package"),
        "mirror-x",
        "unreachable",
        str(tmp_path / "cache" / "fashion-mnist"),
        "FEDAX_DATA_DIR",
    ]:
        assert text in message
    for name, digest in fashion_mnist.SHA256.items():
        assert f"{name}  {digest}" in message


def test_default_sources_and_pins():
    names = [s.name for s in fashion_mnist.default_sources()]
    assert names == [f"gzipped files in {fashion_mnist.DEBIAN_DIR}", *fashion_mnist.MIRRORS]
    assert set(fashion_mnist.SHA256) == set(NAMES)
    assert all(len(h) == 64 and int(h, 16) >= 0 for h in fashion_mnist.SHA256.values())
    assert not set(fashion_mnist.SHA256.values()) & set(mnist.SHA256.values())
    for pins in (fashion_mnist.DEBIAN_GZ_SHA256, fashion_mnist.MIRROR_GZ_SHA256):
        assert set(pins) == set(NAMES) and all(len(h) == 64 for h in pins.values())
    assert len(fashion_mnist.CLASSES) == 10


def test_real_fashion_mnist_from_debian_package(tmp_path):
    """The real data set, from the Debian package's files (never the network). CI installs
    the package (.ci/run), so there the test must run; a developer machine without the
    package skips it."""
    if not all((fashion_mnist.DEBIAN_DIR / f"{n}.gz").is_file() for n in NAMES):
        if os.environ.get("CI"):
            pytest.fail(f"{fashion_mnist.DEBIAN_PACKAGE} is not installed, but .ci/run installs it")
        pytest.skip(f"{fashion_mnist.DEBIAN_PACKAGE} not installed")
    debian = fashion_mnist.default_sources()[0]  # the .gz files checked against their pins
    data = load_fashion_mnist(tmp_path, sources=[debian], log=lambda line: None)
    assert data["x_train"].shape == (60000, 28, 28, 1)
    assert data["x_test"].shape == (10000, 28, 28, 1)
    assert data["x_train"].min() == 0.0 and data["x_train"].max() == 1.0
    np.testing.assert_array_equal(np.bincount(data["y_train"]), [6000] * 10)
    np.testing.assert_array_equal(np.bincount(data["y_test"]), [1000] * 10)
