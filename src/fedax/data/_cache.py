"""Cache directory and verified fetching of raw data files.

A data set lives in ``<cache>/<name>/`` as plain files, each pinned by the SHA-256 of its raw
bytes. :func:`ensure_files` checks the cache, fetches whatever is missing or corrupt from an
ordered list of :class:`Source` objects, verifies every file before it is written (atomically),
says what it tries as it tries it (one line per source, through ``log``), and raises
:class:`DataUnavailableError` describing every attempt when no source delivers.

Compressed bytes from outside are checked before anything decompresses them: a source built
with pinned SHA-256s of the compressed files verifies those first, and every decompression is
bounded (:func:`gunzip`, :func:`read_tar_members`), so a decompression bomb is refused with
:class:`DecompressionBombError`. Network sources fail fast: a few seconds without an answer
and the next source is tried.

Nothing here is specific to one data set: MNIST, Fashion-MNIST or Shakespeare sources are built
from ``fedax.data._sources`` (``url_source``, ``npm_source``, ``directory_source`` and
``local_gzip_source``). Files are written with ``fedax.io.write_atomic``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import tarfile
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import platformdirs

from fedax.io import write_atomic

ENV_VAR = "FEDAX_DATA_DIR"
URL_TIMEOUT = 5.0
"""Seconds a URL source waits to connect, or for the next bytes, before giving up."""
MAX_FILE_SIZE = 1 << 28
"""Default bound, in bytes, on one downloaded or decompressed file (256 MiB)."""

LogFn = Callable[[str], None]
FetchFn = Callable[[Sequence[str]], Mapping[str, bytes]]


class DataUnavailableError(RuntimeError):
    """No source could deliver a verified copy of the requested data files."""


class ChecksumError(ValueError):
    """Bytes did not match their pinned SHA-256."""


class DecompressionBombError(ValueError):
    """Compressed data would expand past its bound; nothing past the bound was produced."""


def log_to_stderr(line: str) -> None:
    """The default ``log``: one line to standard error, flushed at once."""
    print(line, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Source:
    """A place data files can be fetched from.

    Attributes:
      name: Human-readable description, used in logs and error messages.
      fetch: Called with the file names still needed; returns raw bytes for those it could get
        (possibly a subset) and raises when it can get none. The caller verifies every file.
    """

    name: str
    fetch: FetchFn


def resolve_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Returns the cache root: ``cache_dir``, else ``$FEDAX_DATA_DIR``, else the user cache."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_cache_dir("fedax"))


def sha256_bytes(data: bytes) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike, chunk_size: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_size):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(name: str, data: bytes, expected: str) -> None:
    """Raises :class:`ChecksumError` unless ``data`` has the SHA-256 ``expected``."""
    actual = sha256_bytes(data)
    if actual != expected:
        raise ChecksumError(
            f"{name}: SHA-256 mismatch ({len(data)} bytes, got {actual}, expected {expected})"
        )


def find_invalid(directory: Path, checksums: Mapping[str, str]) -> list[str]:
    """Names in ``checksums`` whose file in ``directory`` is absent or fails its SHA-256.

    A present but corrupt file is reported with a warning (it will be replaced, never used).
    """
    invalid = []
    for name, expected in checksums.items():
        path = directory / name
        if not path.is_file():
            invalid.append(name)
            continue
        actual = sha256_file(path)
        if actual != expected:
            warnings.warn(
                f"Cached file {path} is corrupt (SHA-256 {actual}, expected {expected}); "
                "it will be re-fetched.",
                RuntimeWarning,
                stacklevel=3,
            )
            invalid.append(name)
    return invalid


def ensure_files(
    directory: str | os.PathLike,
    checksums: Mapping[str, str],
    sources: Sequence[Source],
    *,
    dataset: str = "data",
    hint: str = "",
    log: LogFn = log_to_stderr,
) -> Path:
    """Makes ``directory`` hold a verified copy of every file in ``checksums``.

    Files already present with the right SHA-256 are kept (and nothing is logged). The others
    are requested from each source in turn (only those still missing); each returned file is
    verified and written atomically, and a file failing verification is discarded. Each
    attempt is logged as it happens: ``fedax: <dataset>: trying <source>``, then ``... ok``
    or ``... failed: <reason>``.

    Args:
      directory: Where the files live, e.g. ``resolve_cache_dir() / "mnist"``.
      checksums: File name -> hex SHA-256 of its raw bytes.
      sources: Tried in order until every file is present.
      dataset: Name used in log lines and messages.
      hint: Extra advice for the error message (e.g. a package that provides the files).
      log: Called with each progress line; default :func:`log_to_stderr`.

    Returns:
      ``directory`` as a ``Path``.

    Raises:
      DataUnavailableError: Some files could not be obtained from any source. The message's
        first line says what to do; the next lines list every source with its error and the
        SHA-256 of each file.
    """
    directory = Path(directory)
    missing = find_invalid(directory, checksums)
    errors: list[tuple[str, str]] = []
    for source in sources:
        if not missing:
            break
        log(f"fedax: {dataset}: trying {source.name}")
        try:
            fetched = source.fetch(tuple(missing))
        except Exception as e:  # Any failure means: record it, try the next source.
            errors.append((source.name, _reason(e)))
            log(f"fedax: {dataset}: {source.name} failed: {errors[-1][1]}")
            continue
        problems, wanted = [], len(missing)
        for name in list(missing):
            if name not in fetched:
                problems.append(f"{name}: not provided")
                continue
            try:
                verify_sha256(name, fetched[name], checksums[name])
            except ChecksumError as e:
                problems.append(str(e))
                continue
            write_atomic(directory / name, fetched[name])
            missing.remove(name)
        got = wanted - len(missing)
        if problems:
            errors.append((source.name, "; ".join(problems)))
            log(
                f"fedax: {dataset}: {source.name} failed for {len(problems)} of {wanted} file(s)"
                f" ({got} ok): {'; '.join(problems)}"
            )
        else:
            log(f"fedax: {dataset}: {source.name} ok ({got} file(s))")
    if missing:
        raise DataUnavailableError(
            _unavailable_message(dataset, directory, checksums, missing, errors, hint)
        )
    return directory


def _reason(error: Exception) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())


def _unavailable_message(
    dataset: str,
    directory: Path,
    checksums: Mapping[str, str],
    missing: Sequence[str],
    errors: Sequence[tuple[str, str]],
    hint: str,
) -> str:
    lines = [
        f"{dataset}: could not obtain {len(missing)} of {len(checksums)} file(s) from "
        f"{len(errors)} source(s); check the network, or put the raw files in {directory}/ "
        f"(or set {ENV_VAR}=<dir> and put them in <dir>/{directory.name}/).",
        "Sources tried:",
    ]
    lines += [f"  - {name}: {error}" for name, error in errors] or ["  (none)"]
    if hint:
        lines.append(hint)
    lines.append("Raw (uncompressed) files and their SHA-256:")
    lines += [
        f"  {name}  {digest}" + ("  (missing)" if name in missing else "")
        for name, digest in checksums.items()
    ]
    return "\n".join(lines)


# --- Bounded decompression -------------------------------------------------------------------


def gunzip(data: bytes, max_size: int = MAX_FILE_SIZE, *, name: str = "<bytes>") -> bytes:
    """Decompresses gzip ``data`` (one or more members), producing at most ``max_size`` bytes.

    Raises:
      DecompressionBombError: The output would exceed ``max_size`` bytes.
      ValueError: ``data`` is not complete gzip data.
    """
    out = bytearray()
    rest = data
    while rest:
        decompressor = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            out += decompressor.decompress(rest, max_size + 1 - len(out))
        except zlib.error as e:
            raise ValueError(f"{name}: not valid gzip data ({e})") from None
        if len(out) > max_size:
            raise DecompressionBombError(
                f"{name}: decompresses to more than {max_size} bytes; refused"
            )
        if not decompressor.eof:
            raise ValueError(f"{name}: truncated gzip data")
        rest = decompressor.unused_data
    return bytes(out)


def read_tar_members(
    path: str | os.PathLike, members: Mapping[str, str], *, max_size: int = MAX_FILE_SIZE
) -> dict[str, bytes]:
    """Reads chosen regular-file members of a tar archive into memory, in one pass.

    Nothing is written to disk, so member paths cannot escape anywhere; links, devices and
    every member not named in ``members`` are ignored. Verify the archive's own SHA-256 before
    calling this on downloaded bytes; ``max_size`` still bounds what it decompresses.

    Args:
      path: The archive (any compression ``tarfile`` understands).
      members: Result key -> exact member path in the archive.
      max_size: Bound on the archive's uncompressed size, in bytes.

    Returns:
      Key -> bytes for the members found as regular files (first occurrence wins).

    Raises:
      DecompressionBombError: The uncompressed archive extends past ``max_size`` bytes.
    """
    wanted = {member: key for key, member in members.items()}
    out: dict[str, bytes] = {}
    with tarfile.open(path, "r:*") as archive:
        while (info := archive.next()) is not None:
            # offset: where the next header starts, i.e. the bytes taken up so far.
            if archive.offset > max_size:
                raise DecompressionBombError(
                    f"{Path(path).name}: uncompressed archive exceeds {max_size} bytes; refused"
                )
            key = wanted.get(info.name)
            if key is None or key in out or not info.isreg():
                continue
            f = archive.extractfile(info)
            if f is not None:
                out[key] = f.read()
                if len(out) == len(wanted):
                    break
    return out
