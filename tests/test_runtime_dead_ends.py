"""No dead ends in the networked runtime's commands: a failed ``fedax server init`` leaves
the directory as it was (so the corrected command then works), and a client that cannot
reach its server says why within seconds (connection refused, TLS verification failed,
unknown host), one line per retry, then one ``fedax: error: cannot connect to HOST:PORT:
<cause>; <what to do>`` line, exit status 1, and no gRPC C-core log lines.

Servers started here listen on 127.0.0.1 only and stop by themselves (a fixed number of
rounds; ``stop()`` in ``finally``); every client attempt is bounded by ``connect_s`` and
every test asserts its elapsed time."""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from test_runtime import client_config, make_task, run_clients, start_server

from fedax.cli import runtime as runtime_commands
from fedax.cli.main import main
from fedax.runtime import (
    CannotListen,
    Client,
    ClientConfig,
    ClientTLS,
    Registry,
    Server,
    ServerConfig,
    ServerTLS,
    Unreachable,
    listening,
    make_dev_pki,
    server_status,
)
from fedax.runtime.connection import grpc_problem
from fedax.runtime.security import probe, split_address

SRC = str(Path(__file__).resolve().parents[1] / "src")
# A gRPC C-core log line: "I1202 09:36:57.871395 4889 ssl_transport_security.cc:2563] ..."
GRPC_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d|\.cc:\d+\]|WARNING: All log messages")


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (hidden ones too) with its bytes (``None``: a directory)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


# ---------------------------------------------------------------- fedax server init


def test_failed_init_leaves_nothing_and_the_corrected_command_works(tmp_path, capsys):
    """A config the network cannot run is refused before anything is written."""
    out = tmp_path / "deep" / "setup"
    assert main(["server", "init", str(out), "--clients", "2", "--set", "algorithm=nosuch"]) == 2
    assert "config key 'algorithm'" in capsys.readouterr().err
    assert main(["server", "init", str(out), "--set", "stragglers=0.5"]) == 2
    assert "execution.mode network" in capsys.readouterr().err
    assert snapshot(tmp_path) == {}  # no setup, no staging directory, no parents
    assert main(["server", "init", str(out), "--clients", "2"]) == 0
    assert sorted(snapshot(out)) == [
        "ca.pem", "config.yaml", "identities", "identities/0.key", "identities/1.key",
        "registry.json", "roster.json", "server.key", "server.pem", "tokens",
        "tokens/0.token", "tokens/1.token"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep"]
    assert sorted(p.name for p in (tmp_path / "deep").iterdir()) == ["setup"]


def _fail_at_the_last_step(monkeypatch, error):
    def config_text(config, source):
        raise error

    monkeypatch.setattr(runtime_commands, "_config_text", config_text)


def test_failed_init_in_an_existing_directory_and_overwrite(tmp_path, capsys, monkeypatch):
    out = tmp_path / "setup"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)

    # A full disk at the last write (config.yaml): exit 1, and the directory as it was.
    with monkeypatch.context() as m:
        _fail_at_the_last_step(m, OSError(errno.ENOSPC, "No space left on device"))
        assert main(["server", "init", str(out), "--clients", "2"]) == 1
    assert "no space left on device" in capsys.readouterr().err
    assert snapshot(tmp_path) == before
    assert main(["server", "init", str(out), "--clients", "2"]) == 0
    setup = snapshot(tmp_path)
    assert setup["setup/notes.txt"] == b"mine" and "setup/registry.json" in setup

    # --overwrite interrupted (Ctrl-C) at the last step: the old setup, byte for byte.
    with monkeypatch.context() as m:
        _fail_at_the_last_step(m, KeyboardInterrupt())
        assert main(["server", "init", str(out), "--clients", "3", "--overwrite"]) == 130
    assert snapshot(tmp_path) == setup
    # Refused without --overwrite: nothing changes.
    assert main(["server", "init", str(out), "--clients", "3"]) == 2
    assert "already holds a setup; pass --overwrite" in capsys.readouterr().err
    assert snapshot(tmp_path) == setup
    assert main(["server", "init", str(out), "--clients", "3", "--overwrite"]) == 0
    after = snapshot(tmp_path)
    assert after["setup/notes.txt"] == b"mine" and "setup/tokens/2.token" in after
    assert after["setup/ca.pem"] != setup["setup/ca.pem"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["setup"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_init_never_replaces_files_it_did_not_write_without_overwrite(tmp_path, capsys):
    """A ``ca.pem`` already there (no registry: not a setup) is refused, named, and kept."""
    out = tmp_path / "setup"
    out.mkdir()
    (out / "ca.pem").write_text("someone's CA")
    before = snapshot(tmp_path)
    assert main(["server", "init", str(out), "--clients", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"fedax: error: {out} already holds ca.pem; pass --overwrite to "
                       "replace it, or choose another directory")
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------- reaching the server


def _free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_dev_pki(tmp_path_factory.mktemp("pki"), num_clients=2)


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory):
    """Another setup's CA (same subject name, another key)."""
    return make_dev_pki(tmp_path_factory.mktemp("other"), num_clients=1)["ca"]


@pytest.fixture(scope="module")
def server(pki):
    """A real fedax server on 127.0.0.1 (it never starts a round: no client joins)."""
    task = make_task(num_clients=2, input_shape=(4,))
    srv = Server(task, ServerConfig(rounds=1, cohort_size=2, poll_interval_s=0.05),
                 ServerTLS(pki["cert"], pki["key"]), Registry.load(pki["registry"]))
    port = srv.start()
    try:
        yield port
    finally:
        srv.stop()


XY = (np.zeros((4, 4), np.float32), np.zeros(4, np.int32))


def _run_client(address, pki, ca, connect_s, server_name=None):
    config = ClientConfig(address, 0, pki["tokens"][0], ClientTLS(ca, server_name),
                          connect_s=connect_s, reconnect_s=60.0)
    start = time.monotonic()
    with pytest.raises(Unreachable) as err:
        Client(config, *XY).run()
    return str(err.value), time.monotonic() - start


def _retries(caplog, address):
    return [r.getMessage() for r in caplog.records
            if r.name == "fedax.runtime.client" and f"cannot connect to {address}" in
            r.getMessage()]


@pytest.mark.serial
def test_refused_port_is_named_with_retries(pki, caplog):
    caplog.set_level(logging.INFO, logger="fedax.runtime.client")
    address = f"127.0.0.1:{_free_port()}"
    message, elapsed = _run_client(address, pki, pki["ca"], connect_s=3.0)
    assert 2.5 < elapsed < 10.0, elapsed
    assert re.fullmatch(rf"cannot connect to {address}: connection refused, \d tries in 3 s; "
                        r"check that the server runs and listens on port \d+", message), message
    retries = _retries(caplog, address)
    assert len(retries) >= 2 and all(
        re.search(r": connection refused; retrying in [\d.]+ s$", r) for r in retries), retries


@pytest.mark.serial
def test_unknown_host_is_named(pki, caplog):
    caplog.set_level(logging.INFO, logger="fedax.runtime.client")
    message, elapsed = _run_client("no-such-host.invalid:9092", pki, pki["ca"], connect_s=1.5)
    assert elapsed < 20.0, elapsed  # a resolver that does not answer may take a few s
    assert message.startswith("cannot connect to no-such-host.invalid:9092: unknown host "
                              "'no-such-host.invalid'"), message
    assert message.endswith("; check the host name in the server address (--server)")
    assert _retries(caplog, "no-such-host.invalid:9092")


@pytest.mark.serial
def test_wrong_ca_and_wrong_name_fail_at_once(server, pki, other_ca, caplog):
    """A certificate that does not verify is a setup error: no retries, well within the
    (long) connect limit, and the cause is TLS verification, not 'unreachable'."""
    caplog.set_level(logging.INFO, logger="fedax.runtime.client")
    address = f"127.0.0.1:{server}"
    message, elapsed = _run_client(address, pki, other_ca, connect_s=30.0)
    assert elapsed < 5.0, elapsed
    assert message == (
        f"cannot connect to {address}: TLS verification failed: certificate signature "
        f"failure (the server's certificate is not signed by the CA in {other_ca!r}); pass "
        "the CA that signed the server's certificate with --ca (fedax server init writes it "
        "as ca.pem)")
    message, elapsed = _run_client(address, pki, pki["ca"], connect_s=30.0,
                                   server_name="other.example")
    assert elapsed < 5.0, elapsed
    assert message.startswith(f"cannot connect to {address}: TLS verification failed: the "
                              "server's certificate is not valid for 'other.example'; ")
    assert not _retries(caplog, address)
    # The right CA and name pass the same check.
    assert probe(address, ClientTLS(pki["ca"])) is None
    assert probe(f"localhost:{server}", ClientTLS(pki["ca"])) is None
    # fedax server status says the same, once.
    with pytest.raises(Unreachable, match="TLS verification failed: certificate signature"):
        server_status(address, ClientTLS(other_ca))


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "GRPC_VERBOSITY")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _fedax_client(address, ca, pki, tmp_path, *extra):
    data = tmp_path / "client_0.npz"
    np.savez(data, x=XY[0], y=XY[1])
    token = tmp_path / "0.token"
    token.write_text(pki["tokens"][0])
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "fedax.cli.main", "client", "--server", address, "--ca", ca,
         "--id", "0", "--token-file", str(token), "--data", str(data), *extra],
        capture_output=True, text=True, env=_env(), timeout=60)
    return proc, time.monotonic() - start


@pytest.mark.serial
def test_fedax_client_says_why_in_one_line(server, pki, other_ca, tmp_path):
    """The command: one log line per retry, then one error line, exit status 1, and none
    of gRPC's own log lines."""
    address = f"127.0.0.1:{_free_port()}"
    proc, elapsed = _fedax_client(address, pki["ca"], pki, tmp_path, "--connect-s", "2")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and elapsed < 20.0, (elapsed, proc.stderr)
    assert re.fullmatch(rf"fedax: error: cannot connect to {address}: connection refused, "
                        rf"\d tries in 2 s; check that the server runs and listens on port "
                        rf"{address.rsplit(':')[1]}", lines[-1]), lines
    assert len(lines) >= 3 and all(
        re.fullmatch(rf"fedax client 0: \d\d:\d\d:\d\d client 0: cannot connect to {address}: "
                     r"connection refused; retrying in [\d.]+ s", line) for line in lines[:-1]
    ), lines

    address = f"127.0.0.1:{server}"
    proc, elapsed = _fedax_client(address, other_ca, pki, tmp_path)
    assert proc.returncode == 1 and elapsed < 20.0, (elapsed, proc.stderr)
    assert proc.stderr.strip().splitlines() == [
        f"fedax: error: cannot connect to {address}: TLS verification failed: certificate "
        f"signature failure (the server's certificate is not signed by the CA in "
        f"{other_ca!r}); pass the CA that signed the server's certificate with --ca (fedax "
        "server init writes it as ca.pem)"], proc.stderr
    assert not any(GRPC_LINE.search(line) for line in proc.stderr.splitlines())


@pytest.mark.serial
def test_fedax_server_status_says_why(server, pki, other_ca, capsys):
    port = _free_port()
    start = time.monotonic()
    assert main(["server", "status", "--server", f"127.0.0.1:{port}", "--ca", pki["ca"]]) == 1
    assert capsys.readouterr().err.strip() == (
        f"fedax: error: cannot connect to 127.0.0.1:{port}: connection refused; check that "
        f"the server runs and listens on port {port}")
    assert main(["server", "status", "--server", f"localhost:{server}", "--ca", other_ca]) == 1
    assert "TLS verification failed" in capsys.readouterr().err
    assert time.monotonic() - start < 10.0


# ---------------------------------------------------------------- no network


class _RpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_causes_from_grpc_errors():
    """Without a probe (a proxy, a dns:/// target) the cause comes from gRPC's status."""
    unavailable = grpc.StatusCode.UNAVAILABLE
    cases = {
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:9198: "
        "Failed to connect to remote host: Connection refused": ("connection refused", True),
        "errors resolving no-such-host.invalid:9199: [field:hostname lookup error:address "
        "lookup failed for no-such-host.invalid:9199: Domain name not found]":
            ("unknown host", True),
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:9199: Tls "
        "handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1a000064:ECDSA "
        "routines:OPENSSL_internal:BAD_SIGNATURE: certificate signature failure: OK":
            ("TLS verification failed", False),
    }
    for details, (cause, retry) in cases.items():
        got = grpc_problem(_RpcError(unavailable, details), "h:1")
        assert got[0].startswith(cause) and got[2] is retry, got
    got = grpc_problem(_RpcError(grpc.StatusCode.UNIMPLEMENTED, "Method not found"), "h:1")
    assert got[0].startswith("the server there is not a fedax server") and not got[2]


def test_split_address():
    assert split_address("localhost:9092") == ("localhost", 9092)
    assert split_address("[::1]:9092") == ("::1", 9092)
    assert split_address("10.0.0.2:1") == ("10.0.0.2", 1)
    for other in ("dns:///localhost:9092", "unix:/tmp/s", "localhost", "::1", "h:port"):
        assert split_address(other) is None, other


@pytest.mark.serial
def test_a_lost_server_is_named_after_reconnect_s(pki):
    """Once joined, a server that goes away is retried for ``reconnect_s``; then the
    error names the cause the address gives now."""
    address = f"127.0.0.1:{_free_port()}"
    config = ClientConfig(address, 0, "t", ClientTLS(pki["ca"]), reconnect_s=0.3)

    def gone():
        raise _RpcError(grpc.StatusCode.UNAVAILABLE, "Socket closed")

    start = time.monotonic()
    with pytest.raises(Unreachable, match=rf"^cannot connect to {address}: connection refused "
                                          r"\(for 0.3 s\); check that the server runs"):
        Client(config, *XY)._call(gone)
    assert time.monotonic() - start < 5.0


# ---------------------------------------------------------------- a port in use


@pytest.mark.serial
def test_a_second_server_on_a_port_in_use_is_refused(server, pki, monkeypatch):
    """gRPC's SO_REUSEPORT would let a second server share the port (and split the
    clients): fedax turns it off and refuses the second one, in one line."""
    task = make_task(num_clients=2, input_shape=(4,))

    def second():
        return Server(task, ServerConfig(rounds=1, cohort_size=2),
                      ServerTLS(pki["cert"], pki["key"]), Registry.load(pki["registry"]),
                      address=f"127.0.0.1:{server}")

    in_use = (f"cannot listen on 127.0.0.1:{server}: the address is in use (another server "
              "listens there); start this one on another port (fedax server start --port) "
              "or stop the one that listens there")
    other = second()
    with pytest.raises(CannotListen) as err:
        other.start()
    assert str(err.value) == in_use and isinstance(err.value, OSError)
    other.stop()  # never started: nothing to stop, and no error
    # Without the check, gRPC's own bind fails (SO_REUSEPORT is off), in one line too.
    monkeypatch.setattr(listening, "listen_problem", lambda address: None)
    with pytest.raises(CannotListen, match=rf"^cannot listen on 127.0.0.1:{server}: gRPC "
                                           r"could not bind it \(in use"):
        second().start()
    assert probe(f"127.0.0.1:{server}", ClientTLS(pki["ca"])) is None  # the first serves on


@pytest.mark.serial
def test_fedax_server_start_on_a_port_in_use_exits_2_in_one_line(server, pki, tmp_path,
                                                                   capsys):
    task = tmp_path / "task.json"
    task.write_text(make_task(num_clients=2, input_shape=(4,)).to_json())
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "fedax.cli.main", "server", "start", "--task", str(task),
         "--cert", pki["cert"], "--key", pki["key"], "--registry", pki["registry"],
         "--port", str(server), "--rounds", "1", "--cohort-size", "2"],
        capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"fedax: error: cannot listen on 127.0.0.1:{server}: the address is in use (another "
        "server listens there); start this one on another port (fedax server start --port) "
        "or stop the one that listens there"], proc.stderr
    assert time.monotonic() - start < 60.0
    # --config too (in this process: the same one line, status 2).
    setup = tmp_path / "setup"
    assert main(["server", "init", str(setup), "--clients", "2", "--set", "rounds=1"]) == 0
    capsys.readouterr()
    assert main(["server", "start", "--config", str(setup / "config.yaml"), "--port",
                 str(server), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"fedax: error: cannot listen on 127.0.0.1:{server}: the "
                              "address is in use"), err
    assert not any("Traceback" in line for line in err), err


# ---------------------------------------------------------------- waiting for clients


@pytest.mark.serial
def test_the_server_says_what_it_waits_for(tmp_path, caplog, monkeypatch):
    """With 2 of 3 clients up the server logs who is missing and what it needs (and not
    a line per poll); when a round closes short of --min-reports it names the selected
    clients that did not report."""
    pki3 = make_dev_pki(tmp_path / "pki", num_clients=3)
    monkeypatch.setattr(Server, "_waiting_change_s", 0.2)
    caplog.set_level(logging.INFO, logger="fedax.runtime.server")
    task = make_task(num_clients=3, input_shape=(4,))
    xy = [(np.ones((8, 4), np.float32), np.arange(8, dtype=np.int32) % 5)] * 3

    def lines(start, having=""):
        return [m for m in (r.getMessage() for r in caplog.records
                            if r.name == "fedax.runtime.server")
                if m.startswith(start) and having in m]

    def wait_for(start, timeout, having=""):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if lines(start, having):
                return lines(start, having)
            time.sleep(0.05)
        raise AssertionError(f"no {start!r} line in {timeout} s: {caplog.text}")

    server, port = start_server(task, pki3, rounds=1, cohort_size=3, min_reports=3,
                                deadline_s=4.0)
    threads = []
    try:
        threads, _ = run_clients([client_config(pki3, port, k, reconnect_s=1.0)
                                  for k in range(2)], xy)
        waiting = wait_for("waiting: 2 of 3 alive", 30.0)
        assert waiting[0] == ("waiting: 2 of 3 alive, need 3 (--min-clients); not alive: "
                              "client 2"), waiting
        time.sleep(1.0)  # nothing changes: no more lines (the next in 30 s)
        assert len(lines("waiting: 2 of 3")) == 1, lines("waiting:")
        assert len(lines("waiting:")) <= 3, lines("waiting:")
        # Client 2 comes up, takes the round's task and reports only after the deadline.
        more, _ = run_clients([client_config(pki3, port, 2, reconnect_s=1.0,
                                             delay_s=8.0)], xy)
        threads += more
        short = wait_for("round 0 attempt 0: ", 60.0, having=" selected reported")
        assert any(re.fullmatch(r"round 0 attempt 0: [0-2] of 3 selected reported, need 3 "
                                r"\(--min-reports\); missing: clients? [0-9, ]*\b2; retrying",
                                line) for line in short), short
    finally:
        server.stop()
    end = time.monotonic() + 30.0
    for th in threads:
        th.join(max(end - time.monotonic(), 0.0))
    assert not any(th.is_alive() for th in threads), "a client did not stop by itself"
