"""Fashion-MNIST (Xiao, Rasul and Vollgraf, 2017) from a verified local cache.

Same container and layout as MNIST: four raw IDX files in ``<cache>/fashion-mnist/`` (cache:
``cache_dir`` argument, else ``$FEDAX_DATA_DIR``, else the user cache directory), each pinned by
the SHA-256 of its uncompressed bytes. Missing or corrupt files are fetched from, in order:

1. the Debian/Ubuntu package ``dataset-fashion-mnist`` (gzipped files in
   ``/usr/share/datasets/fashion-mnist/``; install it with
   ``apt-get install dataset-fashion-mnist``);
2. the publisher's public mirrors of the gzipped files.

The Debian package recompresses the files, so its ``.gz`` bytes (and MD5s) differ from the
publisher's; the uncompressed IDX bytes (:data:`SHA256`) are identical. Each source's ``.gz``
files are pinned too (:data:`DEBIAN_GZ_SHA256`, :data:`MIRROR_GZ_SHA256`) and checked before
they are decompressed. Each attempt is logged as it happens.
"""

from __future__ import annotations

import os
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
from fedax.data._sources import local_gzip_source, url_source
from fedax.data.mnist import (
    MAX_SIZE,
    TEST_IMAGES,
    TEST_LABELS,
    TRAIN_IMAGES,
    TRAIN_LABELS,
    read_idx_splits,
)

# SHA-256 of the raw (gunzipped) IDX files. Checked against the files of Debian's
# dataset-fashion-mnist 0.0~git20200523.55506a9-1, which decompress to the publisher's data
# (60,000 + 10,000 images; 6,000 train and 1,000 test images per class).
SHA256 = {
    TRAIN_IMAGES: "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    TRAIN_LABELS: "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    TEST_IMAGES: "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    TEST_LABELS: "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}

# SHA-256 of the .gz files of Debian's dataset-fashion-mnist 0.0~git20200523.55506a9-1,
# computed from the installed package. A rebuilt package may recompress them (new values).
DEBIAN_GZ_SHA256 = {
    TRAIN_IMAGES: "b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7",
    TRAIN_LABELS: "0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056",
    TEST_IMAGES: "cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa",
    TEST_LABELS: "8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05",
}
# SHA-256 of the publisher's .gz files, which both mirrors serve (their MD5s are those of the
# publisher's README). The labels' values were computed from the files in the publisher's git
# repository; its image files were not at hand, so theirs are those of public checksum lists
# (which agree with each other and with the computed label values).
MIRROR_GZ_SHA256 = {
    TRAIN_IMAGES: "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
    TRAIN_LABELS: "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
    TEST_IMAGES: "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
    TEST_LABELS: "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
}

DEBIAN_PACKAGE = "dataset-fashion-mnist"
DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
MIRRORS = (
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "https://github.com/zalandoresearch/fashion-mnist/raw/master/data/fashion/",
)

SUBDIR = "fashion-mnist"

CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)


def default_sources() -> tuple[Source, ...]:
    """The Debian package's files, then the public mirrors (gzipped files), in the order tried."""
    debian = local_gzip_source(DEBIAN_DIR, gz_sha256=DEBIAN_GZ_SHA256, max_size=MAX_SIZE)
    mirrors = tuple(
        url_source(url, gz_sha256=MIRROR_GZ_SHA256, max_size=MAX_SIZE) for url in MIRRORS
    )
    return (debian, *mirrors)


def fetch_fashion_mnist(
    cache_dir: str | os.PathLike | None = None,
    *,
    sources: Sequence[Source] | None = None,
    checksums: Mapping[str, str] | None = None,
    log: LogFn = log_to_stderr,
) -> Path:
    """Ensures the four verified Fashion-MNIST IDX files are in the cache; returns their directory.

    Args:
      cache_dir: Cache root; default ``$FEDAX_DATA_DIR`` or the user cache directory.
      sources: Where to fetch missing files, in order; default :func:`default_sources`.
      checksums: File name -> SHA-256; default :data:`SHA256` (overridable for tests).
      log: Called with one line per source tried and its outcome; default: standard error.

    Raises:
      DataUnavailableError: A file could not be obtained from any source; the message lists
        every source tried and how to install the files (``apt-get install
        dataset-fashion-mnist``, or by hand).
    """
    return ensure_files(
        resolve_cache_dir(cache_dir) / SUBDIR,
        SHA256 if checksums is None else checksums,
        default_sources() if sources is None else sources,
        dataset="fashion_mnist",
        hint=f"On Debian or Ubuntu, `apt-get install {DEBIAN_PACKAGE}` puts the gzipped files "
        f"in {DEBIAN_DIR}/, where they are found automatically.",
        log=log,
    )


def load_fashion_mnist(
    cache_dir: str | os.PathLike | None = None,
    *,
    sources: Sequence[Source] | None = None,
    checksums: Mapping[str, str] | None = None,
    log: LogFn = log_to_stderr,
) -> dict[str, np.ndarray]:
    """Loads Fashion-MNIST, fetching and verifying the raw files first if needed.

    Args:
      cache_dir: Cache root; default ``$FEDAX_DATA_DIR`` or the user cache directory.
      sources: Where to fetch missing files, in order; default :func:`default_sources`.
      checksums: File name -> SHA-256; default :data:`SHA256` (overridable for tests).
      log: Called with one line per source tried while fetching; default: standard error.

    Returns:
      ``x_train`` float32 [60000, 28, 28, 1] in [0, 1], ``y_train`` int32 [60000],
      ``x_test`` float32 [10000, 28, 28, 1], ``y_test`` int32 [10000]; label names are
      :data:`CLASSES`.

    Raises:
      DataUnavailableError: A file could not be obtained from any source.
      ValueError: A verified file is not valid IDX of the expected layout.
    """
    directory = fetch_fashion_mnist(cache_dir, sources=sources, checksums=checksums, log=log)
    return read_idx_splits(directory)
