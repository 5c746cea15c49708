"""Fashion-MNIST (Xiao, Rasul and Vollgraf, 2017) from a verified local cache.

Same container and layout as MNIST: four raw IDX files in ``<cache>/fashion-mnist/`` (cache:
``cache_dir`` argument, else ``$FEDAX_DATA_DIR``, else the user cache directory), each pinned by
the SHA-256 of its uncompressed bytes. Missing or corrupt files are fetched from, in order:

1. the Debian/Ubuntu package ``dataset-fashion-mnist`` (gzipped files in
   ``/usr/share/datasets/fashion-mnist/``; install it with
   ``apt-get install dataset-fashion-mnist``);
2. the publisher's public mirrors of the gzipped files.

The Debian package recompresses the files, so its ``.gz`` bytes (and MD5s) differ from the
publisher's; the uncompressed IDX bytes, which are what is pinned here, are identical.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from fedax.data._cache import (
    DataUnavailableError,
    Source,
    ensure_files,
    local_gzip_source,
    resolve_cache_dir,
    url_source,
)
from fedax.data.mnist import (
    TEST_IMAGES,
    TEST_LABELS,
    TRAIN_IMAGES,
    TRAIN_LABELS,
    _images_and_labels,
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
    mirrors = tuple(url_source(url, gzipped=True, timeout=20.0) for url in MIRRORS)
    return (local_gzip_source(DEBIAN_DIR), *mirrors)


def fetch_fashion_mnist(
    cache_dir: str | os.PathLike | None = None,
    *,
    sources: Sequence[Source] | None = None,
    checksums: Mapping[str, str] | None = None,
) -> Path:
    """Ensures the four verified Fashion-MNIST IDX files are in the cache; returns their directory.

    Args:
      cache_dir: Cache root; default ``$FEDAX_DATA_DIR`` or the user cache directory.
      sources: Where to fetch missing files, in order; default :func:`default_sources`.
      checksums: File name -> SHA-256; default :data:`SHA256` (overridable for tests).

    Raises:
      DataUnavailableError: A file could not be obtained from any source; the message lists
        every source tried and how to install the files (``apt-get install
        dataset-fashion-mnist``, or by hand).
    """
    directory = resolve_cache_dir(cache_dir) / SUBDIR
    try:
        return ensure_files(
            directory,
            SHA256 if checksums is None else checksums,
            default_sources() if sources is None else sources,
            dataset="Fashion-MNIST",
        )
    except DataUnavailableError as e:
        raise DataUnavailableError(
            f"{e}\nOn Debian or Ubuntu, `apt-get install {DEBIAN_PACKAGE}` puts the gzipped "
            f"files in {DEBIAN_DIR}/, where they are found automatically."
        ) from e


def load_fashion_mnist(
    cache_dir: str | os.PathLike | None = None,
    *,
    sources: Sequence[Source] | None = None,
    checksums: Mapping[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """Loads Fashion-MNIST, fetching and verifying the raw files first if needed.

    Args:
      cache_dir: Cache root; default ``$FEDAX_DATA_DIR`` or the user cache directory.
      sources: Where to fetch missing files, in order; default :func:`default_sources`.
      checksums: File name -> SHA-256; default :data:`SHA256` (overridable for tests).

    Returns:
      ``x_train`` float32 [60000, 28, 28, 1] in [0, 1], ``y_train`` int32 [60000],
      ``x_test`` float32 [10000, 28, 28, 1], ``y_test`` int32 [10000]; label names are
      :data:`CLASSES`.

    Raises:
      DataUnavailableError: A file could not be obtained from any source.
      ValueError: A verified file is not valid IDX of the expected layout.
    """
    directory = fetch_fashion_mnist(cache_dir, sources=sources, checksums=checksums)
    x_train, y_train = _images_and_labels(directory, TRAIN_IMAGES, TRAIN_LABELS)
    x_test, y_test = _images_and_labels(directory, TEST_IMAGES, TEST_LABELS)
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}
