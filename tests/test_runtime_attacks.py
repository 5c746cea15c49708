"""A deployment that trusts no participant: each attack of issue 29, on loopback.

The attackers are registered clients (or unauthenticated peers) that send anything the
protocol allows; the honest participants are light stubs with fixed, known reports, so
every aggregate has a NumPy reference written here. Every server runs a fixed number of
rounds or is stopped by the test; every wait has a timeout. docs/deployment.md's threat
model names the test behind each guarantee."""

from __future__ import annotations

import json
import os
import stat
import threading
import time

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_runtime import NUM_CLIENTS, make_task, start_server

from fedax.runtime import ClientTLS, Connection, Server, ServerConfig, wire
from fedax.runtime.client import load_or_make_secret, train_key
from fedax.runtime.gate import Rejections
from fedax.runtime.security import metadata
from fedax.runtime.server import CHECKPOINT

pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    from fedax.runtime import make_dev_pki

    return make_dev_pki(tmp_path_factory.mktemp("pki"), num_clients=12)


class Stub(threading.Thread):
    """A client that answers each task with ``make(env, template, payload_tensors)`` (a
    ``Report``, or None to stay silent) until the server says done or ``stop`` is set."""

    def __init__(self, cid, pki, port, template, make, stop, **conn):
        super().__init__(daemon=True)
        self.conn = Connection(f"127.0.0.1:{port}", ClientTLS(pki["ca"]), cid,
                               pki["tokens"][cid], timeout_s=10.0, **conn)
        self.cid, self.template, self.make, self.stop = cid, template, make, stop
        self.replies, self.tasks = [], []

    def run(self):
        try:
            self.conn.join()
            while not self.stop.is_set():
                env = self.conn.poll()
                if env.kind == "done":
                    return
                if env.kind != "task":
                    self.stop.wait(env.retry_after_s)
                    continue
                self.tasks.append(env)
                report = self.make(env, self.template)
                if report is None:
                    self.stop.wait(0.05)
                    continue
                out = wire.Envelope(kind="update", client_id=self.cid, round=env.round,
                                    attempt=env.attempt, model_version=env.model_version,
                                    nonce=env.nonce, tensors=wire.encode_tree(report))
                self.replies.append(self.conn.submit(out))
        except grpc.RpcError:
            if not self.stop.is_set():
                raise
        finally:
            self.conn.close()


def _report(template, update, weight, n, steps=2.0, sums=None):
    """A report of ``template``'s structure with the update ``update`` (one array per
    leaf, or a float for every entry)."""
    leaves, treedef = jax.tree.flatten(template.update)
    if not isinstance(update, list):
        update = [np.full(a.shape, update, a.dtype) for a in leaves]
    stats = {k: np.zeros(v.shape, v.dtype) for k, v in template.stats.items()}
    if "local_steps" in stats:
        stats["local_steps"] = np.float32(steps)
    if sums is None:
        sums = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), template.sums)
    return template._replace(update=treedef.unflatten(update), weight=np.float32(weight),
                             num_examples=np.float32(n), stats=stats, sums=sums)


def _honest_updates(template, k):
    rng = np.random.default_rng(100 + k)
    return [rng.normal(0, 0.1, a.shape).astype(a.dtype)
            for a in jax.tree.leaves(template.update)]


def _run(task, pki, makers, rounds=1, key=None, **config):
    """A server (its own secret key unless ``key``) and one stub per maker; returns the
    stopped server and the stubs."""
    config.setdefault("cohort_size", len(makers))
    server, port = start_server(task, pki, key=key, rounds=rounds, deadline_s=10.0,
                                **config)
    stop = threading.Event()
    stubs = [Stub(cid, pki, port, server.report_template, make, stop)
             for cid, make in makers.items()]
    try:
        for s in stubs:
            s.start()
        assert server.wait(30.0)
    finally:
        stop.set()
        server.stop()
        for s in stubs:
            s.join(10.0)
    return server, stubs


def _await_task(conn, tries=100):
    """Poll until the server hands ``conn``'s client its task (bounded); the task."""
    for _ in range(tries):
        env = conn.poll()
        if env.kind == "task":
            return env
        time.sleep(0.05)
    raise AssertionError(f"client {conn.client_id} got no task in {tries} polls")


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(a)) for a in jax.tree.leaves(tree)])


# --------------------------------------------------------------- secret randomness


def test_dp_noise_is_not_predictable_from_what_clients_see(pki, tmp_path):
    """A participant knows the task (seed included) and every report: with the server
    keyed from its seed (the old design) it predicts the noised model exactly; with the
    server's own secret the prediction misses by the noise itself."""
    clip, z, m = 0.05, 1.0, 3
    task = make_task(client_fraction=m / NUM_CLIENTS,  # the DP denominator m = 3
                     privacy={"mechanism": "gaussian", "clip": clip, "noise_multiplier": z})
    assert "key" not in json.loads(task.to_json()) and "secret" not in task.to_json()

    def honest(k):
        return lambda env, t: _report(t, _honest_updates(t, k), 10, 10)

    makers = {k: honest(k) for k in range(m)}
    predicted, _ = _run(task, pki, makers, key=jax.random.key(task.seed))
    actual, _ = _run(task, pki, makers, checkpoint_dir=str(tmp_path / "ckpt"))
    sigma = z * clip / m  # per-coordinate noise std of the mean
    miss = _flat(predicted.params) - _flat(actual.params)
    rms = float(np.sqrt(np.mean(miss ** 2)))
    assert rms > 0.8 * sigma, (rms, sigma)  # two independent noises: about √2·σ
    assert rms < 3 * sigma
    # the secret lives in the checkpoint, readable by the server's owner only
    path = tmp_path / "ckpt" / CHECKPOINT
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    # and a resumed server keeps it (same secret -> same key)
    resumed = Server(task, ServerConfig(rounds=2, cohort_size=m,
                                        checkpoint_dir=str(tmp_path / "ckpt")),
                     actual.tls, actual.registry, resume=True)
    assert resumed._secret == actual._secret and resumed.rounds_done == 1


def test_client_secret_is_256_bits_atomic_and_private(tmp_path):
    path = tmp_path / "state" / "client_seed"
    secret = load_or_make_secret(path)
    assert len(secret) == 32 and path.read_text() == secret.hex()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_or_make_secret(path) == secret  # kept, not redrawn
    assert not [p for p in path.parent.iterdir() if p.name != "client_seed"]  # no temp left
    assert not np.array_equal(train_key(secret, 0), train_key(secret, 1))
    path.write_text("1234")  # the old 32-bit form
    with pytest.raises(ValueError, match="256-bit secret"):
        load_or_make_secret(path)


def test_dev_pki_secrets_are_private_and_its_files_whole(pki):
    """``make_dev_pki`` writes through ``fedax.io``: the server key and every token are the
    owner's only (0600), the registry is the JSON it always was, no temporary file is left."""
    from pathlib import Path

    from fedax.runtime import Registry

    directory = Path(pki["key"]).parent
    tokens = directory / "tokens"
    assert stat.S_IMODE(os.stat(pki["key"]).st_mode) == 0o600
    for k, token in pki["tokens"].items():
        assert (tokens / f"{k}.token").read_text() == token
        assert stat.S_IMODE(os.stat(tokens / f"{k}.token").st_mode) == 0o600
    clients = Registry.load(pki["registry"]).clients
    data = {"clients": {str(k): {"sha256": h, "revoked": r} for k, (h, r) in clients.items()}}
    assert Path(pki["registry"]).read_text() == json.dumps(data, indent=1) + "\n"
    assert sorted(clients) == sorted(pki["tokens"])
    assert not [p.name for p in directory.rglob(".*")]


# ------------------------------------------------------------------ bounds re-checked


@pytest.mark.parametrize("weight", [-1e9, 3e38])
def test_weights_out_of_range_are_rejected_and_the_model_is_the_honest_clients(weight, pki):
    task = make_task()
    honest = [0, 1]
    makers = {k: (lambda env, t, k=k: _report(t, _honest_updates(t, k), 10 + k, 10 + k))
              for k in honest}
    makers[5] = lambda env, t: _report(t, 0.5, weight, 10)
    server, stubs = _run(task, pki, makers, cohort_size=3, min_reports=2)
    refused = stubs[-1].replies
    assert refused and not refused[0].accepted and refused[0].reason.startswith("bounds")
    assert [(e["client"], e["kind"]) for e in server.rejections] == [(5, "bounds")]
    template = server.report_template
    w = np.array([10.0, 11.0])
    mean = sum(wi * _flat(_honest_updates(template, k))
               for wi, k in zip(w, honest, strict=True)) / w.sum()
    initial = _flat(Server(task, ServerConfig(rounds=1, cohort_size=1), server.tls,
                           server.registry).params)
    new = _flat(server.params)
    assert np.all(np.isfinite(new))
    np.testing.assert_allclose(new, initial - mean, rtol=1e-5, atol=1e-6)


def test_a_clip_violating_update_is_clipped_by_the_server(pki):
    """Norm bounding at 0.1 (clip, then the mean): a client that skips its clip (100 per
    entry) is clipped by the server; the aggregate is the NumPy mean of the clipped updates
    (it moved parameters by 33 when clients clipped themselves)."""
    clip = 0.1
    task = make_task(robust={"rule": "norm_bounding", "norm_bound": clip})
    updates = {0: None, 1: None, 7: 100.0}
    makers = {k: (lambda env, t, k=k: _report(
        t, _honest_updates(t, k) if updates[k] is None else updates[k], 10, 10))
        for k in updates}
    server, stubs = _run(task, pki, makers)
    assert all(r.accepted for s in stubs for r in s.replies)
    template = server.report_template
    rows = []
    for k, u in updates.items():
        size = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(template.update))
        flat = _flat(_honest_updates(template, k)) if u is None else np.full(size, u)
        rows.append(flat * min(1.0, clip / np.linalg.norm(flat)))
    initial = _flat(Server(task, ServerConfig(rounds=1, cohort_size=1), server.tls,
                           server.registry).params)
    moved = initial - _flat(server.params)
    np.testing.assert_allclose(moved, np.mean(rows, axis=0), rtol=1e-5, atol=1e-7)
    assert np.abs(moved).max() < clip


def test_oversized_scaffold_sums_are_rejected(pki):
    """SCAFFOLD: Δc_i must be −c + Δy_i/(K_i η_l) for the report's own update; sums of 1e6
    are refused and c is the honest clients' (1/N) Σ Δc_i."""
    task = make_task("scaffold")
    steps, lr = 2.0, task.client_lr

    def honest(k):
        def make(env, t):
            u = _honest_updates(t, k)
            dc = jax.tree.structure(t.sums).unflatten([a / (steps * lr) for a in u])
            return _report(t, u, 1, 10, steps, dc)  # c = 0 in round 0
        return make

    makers = {0: honest(0), 1: honest(1)}
    makers[4] = lambda env, t: _report(t, _honest_updates(t, 4), 1, 10, steps,
                                       jax.tree.map(lambda a: np.full(a.shape, 1e6, a.dtype),
                                                    t.sums))
    server, stubs = _run(task, pki, makers, cohort_size=3, min_reports=2)
    reply = stubs[-1].replies[0]
    assert not reply.accepted and reply.reason.startswith("bounds: SCAFFOLD control delta")
    template = server.report_template
    expected = sum(_flat(_honest_updates(template, k)) / (steps * lr) for k in (0, 1))
    control = _flat(server.state.server.control)
    np.testing.assert_allclose(control, expected / NUM_CLIENTS, rtol=1e-5, atol=1e-7)
    assert np.abs(control).max() < 10


def test_combinations_the_server_cannot_protect_are_refused():
    with pytest.raises(ValueError, match="does not protect"):
        make_task("scaffold", robust={"rule": "median"})
    with pytest.raises(ValueError, match="as exact sums beside the update"):
        make_task("fednova", privacy={"mechanism": "gaussian", "clip": 1.0,
                                      "noise_multiplier": 1.0})
    with pytest.raises(ValueError, match="cannot check"):
        make_task("scaffold_option1")
    make_task("fednova", robust={"rule": "median"})  # n, τ bounded


def test_a_non_finite_aggregate_is_discarded(pki, monkeypatch):
    """If the new state is not finite (a bound the checks missed), it never replaces the
    old one: the round is retried."""
    real = Server._aggregate
    calls = []

    def poisoned(self, r, accepted):
        new, metrics = real(self, r, accepted)
        calls.append(1)
        if len(calls) == 1:
            new = new._replace(server=jax.tree.map(lambda a: a * jnp.inf, new.server))
        return new, metrics

    monkeypatch.setattr(Server, "_aggregate", poisoned)
    task = make_task()
    makers = {k: (lambda env, t, k=k: _report(t, _honest_updates(t, k), 10, 10))
              for k in (0, 1)}
    server, _ = _run(task, pki, makers)
    assert [r["status"] for r in server.records] == ["non-finite", "closed"]
    assert np.all(np.isfinite(_flat(server.params)))


# ---------------------------------------------------------------- authentication first


def _stalled_calls(port, pki, count, meta, method="Join"):
    """``count`` calls that open and never send their request."""
    channel = grpc.secure_channel(f"127.0.0.1:{port}", ClientTLS(pki["ca"]).credentials())
    never = threading.Event()

    def forever():
        never.wait(30)
        return
        yield  # pragma: no cover

    call = channel.stream_unary(f"/{wire.SERVICE}/{method}",
                                request_serializer=wire.Chunk.SerializeToString,
                                response_deserializer=wire.SubmitReply.FromString)
    futures = [call.future(forever(), metadata=meta, timeout=30) for _ in range(count)]
    return channel, futures, never


def test_stalled_calls_do_not_delay_authenticated_ones(pki):
    """40 calls that never send a request (more than the worker pool), unauthenticated and
    authenticated: an honest poll is answered as fast as without them."""
    task = make_task()
    server, port = start_server(task, pki, rounds=1, cohort_size=1, max_workers=8,
                                poll_hold_s=0.0, min_clients=5)
    conn = Connection(f"127.0.0.1:{port}", ClientTLS(pki["ca"]), 0, pki["tokens"][0],
                      timeout_s=5.0)
    try:
        conn.join()
        start = time.monotonic()
        conn.poll()
        normal = time.monotonic() - start
        stalls = [_stalled_calls(port, pki, 40, ()),
                  _stalled_calls(port, pki, 40, metadata(1, pki["tokens"][1]), "Submit")]
        time.sleep(0.5)
        start = time.monotonic()
        for _ in range(5):
            assert conn.poll().kind == "wait"
        assert (time.monotonic() - start) / 5 < max(10 * normal, 0.5)
        # the unauthenticated ones were refused at once, without a read
        unauth = stalls[0][1]
        assert all(f.exception(timeout=5).code() == grpc.StatusCode.UNAUTHENTICATED
                   for f in unauth)
        # the authenticated client got at most per_client_calls open calls
        assert server._gate.active(1) <= server.config.per_client_calls
    finally:
        for channel, _, never in stalls:
            never.set()
            channel.close()
        conn.close()
        server.stop()


def test_an_unselected_clients_report_is_refused_before_its_body_is_read(pki):
    """A 40 MiB report from an authenticated client that is not in the open round is
    refused from its header: the server reads none of it; empty non-final chunks are
    refused at the first."""
    task = make_task()
    server, port = start_server(task, pki, rounds=1, cohort_size=1, deadline_s=30.0,
                                poll_hold_s=0.0, chunk_bytes=1 << 20)
    selected = Connection(f"127.0.0.1:{port}", ClientTLS(pki["ca"]), 0, pki["tokens"][0],
                          timeout_s=10.0)
    other = Connection(f"127.0.0.1:{port}", ClientTLS(pki["ca"]), 3, pki["tokens"][3],
                       timeout_s=10.0)
    try:
        selected.join()
        other.join()
        env = _await_task(selected)
        pulled = [0]
        piece = b"\0" * (1 << 20)

        def big():
            for i in range(40):
                pulled[0] += 1
                yield wire.Chunk(data=piece, last=i == 39)

        forged = wire.Envelope(kind="update", client_id=3, round=env.round,
                               attempt=env.attempt, model_version=env.model_version,
                               nonce=env.nonce)
        reply = other.submit(forged, chunks=big())
        assert not reply.accepted and reply.reason.startswith("not-selected")
        assert server._bytes["in"] == 0  # refused before a byte of the body
        # the client's gRPC may queue a few pieces before the refusal reaches it (its own
        # buffers, not the server's reads); never the whole report
        assert pulled[0] < 40
        # the selected client: empty non-final chunks are refused at the first one
        empties = [0]

        def hollow():
            for _ in range(20_000):
                empties[0] += 1
                yield wire.Chunk(data=b"", last=False)

        own = wire.Envelope(kind="update", client_id=0, round=env.round, attempt=env.attempt,
                            model_version=env.model_version, nonce=env.nonce)
        reply = selected.submit(own, chunks=hollow())
        assert not reply.accepted and reply.reason.startswith("malformed: chunk 1 is empty")
        assert empties[0] < 1000
    finally:
        selected.close()
        other.close()
        server.stop()


def test_chunk_size_is_negotiated_at_join(pki):
    """A server with 4 MiB pieces and a client that takes 1 MiB: the client gets its task
    (a 2 MB model) in 1 MiB pieces; the old fixed receive limit broke every client."""
    big = 100_000
    task = make_task(num_clients=12, input_shape=(big,))
    server, port = start_server(task, pki, rounds=1, cohort_size=1, chunk_bytes=4 << 20)
    conn = Connection(f"127.0.0.1:{port}", ClientTLS(pki["ca"]), 2, pki["tokens"][2],
                      timeout_s=20.0, max_chunk_bytes=1 << 20)
    try:
        assert conn.join().chunk_bytes == 1 << 20
        env = _await_task(conn)
        assert sum(len(t.data) for t in env.tensors) > 2_000_000
    finally:
        conn.close()
        server.stop()


# ------------------------------------------------------------- bounded, honest state


def test_rejections_are_a_bounded_ring_of_codes():
    ring = Rejections(size=8)
    for i in range(1000):
        ring.add(i, 0, i % 3, "replay" if i % 2 else "bounds")
    assert len(ring) == 8 and ring.counts == {"replay": 500, "bounds": 500}
    assert all(set(e) == {"round", "attempt", "client", "kind"} for e in ring)


def test_status_says_counts_only(pki):
    task = make_task()
    makers = {k: (lambda env, t, k=k: _report(t, _honest_updates(t, k), 10, 10))
              for k in (0, 1)}
    server, port = start_server(task, pki, rounds=2, cohort_size=2, deadline_s=10.0)
    stop = threading.Event()
    stubs = [Stub(c, pki, port, server.report_template, m, stop) for c, m in makers.items()]
    try:
        for s in stubs:
            s.start()
        assert server.wait(30.0)
        from fedax.runtime import server_status

        status = server_status(f"127.0.0.1:{port}", ClientTLS(pki["ca"]))
    finally:
        stop.set()
        server.stop()
    assert set(status) == {"state", "rounds_done", "rounds", "alive_clients",
                           "registered_clients", "round", "rejected_reports"}
    assert "train_loss" not in json.dumps(status)


def test_included_is_told_only_after_a_durable_checkpoint(pki, tmp_path, monkeypatch):
    """The checkpoint write fails: no client is told its report was included."""
    import fedax.runtime.server as server_module

    def broken(path, payload):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(server_module.store, "save", broken)
    task = make_task()
    makers = {k: (lambda env, t, k=k: _report(t, _honest_updates(t, k), 10, 10))
              for k in (0, 1)}
    server, port = start_server(task, pki, rounds=2, cohort_size=2, deadline_s=10.0,
                                checkpoint_dir=str(tmp_path / "ckpt"))
    stop = threading.Event()
    stubs = [Stub(c, pki, port, server.report_template, m, stop) for c, m in makers.items()]
    try:
        for s in stubs:
            s.start()
        with pytest.raises(OSError, match="No space"):
            server.wait(30.0)
    finally:
        stop.set()
        server.stop()
    assert server.included == {}


def test_the_last_checkpoints_are_kept_and_a_damaged_one_falls_back(pki, tmp_path):
    task = make_task()
    makers = {k: (lambda env, t, k=k: _report(t, _honest_updates(t, k), 10, 10))
              for k in (0, 1)}
    ckpt = tmp_path / "ckpt"
    server, _ = _run(task, pki, makers, rounds=4, checkpoint_dir=str(ckpt))
    names = sorted(p.name for p in ckpt.iterdir() if p.name.startswith(CHECKPOINT))
    assert names == [CHECKPOINT, f"{CHECKPOINT}.1", f"{CHECKPOINT}.2"]
    assert all(stat.S_IMODE(os.stat(ckpt / n).st_mode) == 0o600 for n in names)
    data = bytearray((ckpt / CHECKPOINT).read_bytes())
    data[-10] ^= 0xFF
    (ckpt / CHECKPOINT).write_bytes(bytes(data))
    resumed = Server(task, ServerConfig(rounds=5, cohort_size=2, checkpoint_dir=str(ckpt)),
                     server.tls, server.registry, resume=True)
    assert resumed.rounds_done == 3 and resumed._secret == server._secret


def test_the_round_log_is_strict_json(pki, tmp_path):
    """A non-finite metric (a diverged round) is written as null, not NaN."""
    from fedax.runtime import Registry, ServerTLS
    from fedax.runtime.server import ROUND_LOG

    server = Server(make_task(), ServerConfig(rounds=1, cohort_size=1,
                                              checkpoint_dir=str(tmp_path)),
                    ServerTLS(pki["cert"], pki["key"]), Registry.load(pki["registry"]))
    server.checkpoints.log_record({"round": 0, "train_loss": float("nan"),
                                   "accuracy": np.float32(np.inf)})
    line = (tmp_path / ROUND_LOG).read_text().strip()
    assert json.loads(line) == {"round": 0, "train_loss": None, "accuracy": None}
    assert "NaN" not in line and "Infinity" not in line


def test_slow_uploaders_cannot_keep_an_honest_report_from_being_read(pki):
    """Four colluding selected clients each open ``per_client_calls`` report streams and
    send them slowly (they would take a minute, longer than the round's deadline), as many
    as the server has readers: each client gets one reader (its other calls are refused at
    once), the honest client's report is read and accepted, and the slow streams are cut
    at the round's deadline, not after ``report_read_s``; every reader is free again."""
    task = make_task()
    server, port = start_server(task, pki, rounds=1, cohort_size=5, min_clients=5,
                                min_reports=1, deadline_s=6.0, poll_hold_s=0.0)
    conns = [Connection(f"127.0.0.1:{port}", ClientTLS(pki["ca"]), k, pki["tokens"][k],
                        timeout_s=90.0) for k in range(5)]
    release = threading.Event()

    def slow():
        yield wire.Chunk(data=b"\0" * 1024, last=False)
        release.wait(60)
        yield wire.Chunk(data=b"", last=True)

    try:
        for conn in conns:
            conn.join()
        tasks: list = [None] * 5  # every client polls (it is alive only then)
        for _ in range(200):
            for k, conn in enumerate(conns):
                if tasks[k] is None and (env := conn.poll()).kind == "task":
                    tasks[k] = env
            if all(tasks):
                break
            time.sleep(0.05)
        assert all(tasks), tasks
        assert server.config.per_client_calls * 4 >= server.config.max_concurrent_reports
        opened = time.monotonic()
        slow_calls = [conn._calls["Submit"].future(
            slow(), metadata=(*conn._meta, *wire.report_metadata(env)), timeout=90.0)
            for conn, env in zip(conns[1:], tasks[1:], strict=True)
            for _ in range(server.config.per_client_calls)]
        time.sleep(1.0)
        env = tasks[0]
        honest = _report(server.report_template, _honest_updates(server.report_template, 0),
                         1.0, 10.0)
        reply = conns[0].submit(wire.Envelope(
            kind="update", client_id=0, round=env.round, attempt=env.attempt,
            model_version=env.model_version, nonce=env.nonce,
            tensors=wire.encode_tree(honest)))
        assert reply.accepted, reply.reason
        codes = [call.exception(timeout=30).code() for call in slow_calls]
        ended = time.monotonic() - opened
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 4 * (
            server.config.per_client_calls - 1), codes
        assert codes.count(grpc.StatusCode.CANCELLED) == 4, codes  # cut at the deadline
        assert ended < server.config.deadline_s + 5.0 < server.config.report_read_s
        assert server.wait(30.0)
        assert server.rounds_done == 1
        # a cut stream's client hears CANCELLED before the server's reader thread has run
        # its clean-up, so the readers are free soon after, not at the same instant
        for _ in range(100):
            with server._lock:
                if not server._reading:
                    break
            time.sleep(0.05)
        with server._lock:
            assert not server._reading
        assert all(server._readers.acquire(timeout=5.0)
                   for _ in range(server.config.max_concurrent_reports))
    finally:
        release.set()
        for conn in conns:
            conn.close()
        server.stop()
