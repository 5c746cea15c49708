"""One entry point that fetches any data set into the verified cache: :func:`fetch_dataset`."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from fedax.data import fashion_mnist, mnist, shakespeare
from fedax.data._cache import LogFn, Source, log_to_stderr


def _fetch_shakespeare(cache_dir, **kwargs) -> Path:
    return shakespeare.fetch_shakespeare(cache_dir, **kwargs).parent


_FETCHERS: dict[str, Callable[..., Path]] = {
    "mnist": mnist.fetch_mnist,
    "fashion_mnist": fashion_mnist.fetch_fashion_mnist,
    "shakespeare": _fetch_shakespeare,
}
DATASET_NAMES = tuple(_FETCHERS)
"""The names :func:`fetch_dataset` accepts."""


def fetch_dataset(
    name: str,
    *,
    cache_dir: str | os.PathLike | None = None,
    sources: Sequence[Source] | None = None,
    checksums: Mapping[str, str] | None = None,
    log: LogFn = log_to_stderr,
) -> Path:
    """Ensures data set ``name``'s verified raw files are in the cache; returns their directory.

    Files already cached and valid are kept without touching any source; the others are
    fetched from the data set's sources in order, one log line per attempt and outcome.

    Args:
      name: One of :data:`DATASET_NAMES`.
      cache_dir: Cache root; default ``$FEDAX_DATA_DIR`` or the user cache directory.
      sources: Overrides the data set's default sources (e.g. a local mirror, or tests).
      checksums: Overrides the data set's pinned SHA-256s (tests).
      log: Called with each progress line; default: print to standard error.

    Returns:
      The directory holding the files, ``<cache>/<data set>/``.

    Raises:
      ValueError: Unknown ``name``.
      DataUnavailableError: A file could not be obtained from any source; the message's first
        line says what to do, the next lines list every source tried with its error.
    """
    fetcher = _FETCHERS.get(name)
    if fetcher is None:
        raise ValueError(f"unknown data set {name!r}; available: {', '.join(DATASET_NAMES)}")
    return fetcher(cache_dir, sources=sources, checksums=checksums, log=log)
