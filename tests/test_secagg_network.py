"""SecAgg+ in the networked runtime (``fedax.runtime.secure_phase``, ``secure_client``):
a task whose aggregator declares ``secure`` runs the protocol's four stages over the
runtime's authenticated calls, the server learns only the sum of the surviving clients'
encoded client-stage outputs, exactly, with drop-outs at every stage up to the threshold;
below it the attempt aborts holding masked vectors only and is retried; a client refuses a
request for both shares of one neighbour and the server refuses bytes that do not parse,
without crashing either; the shipped MNIST config with ``secure`` (plain and with central
DP) over the network equals the simulator."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from test_engines import (
    CONFIG,
    DP,
    NETWORK,
    SHORT,
    assert_close_records,
    assert_same_model,
    final_params,
    run,
)
from test_runtime import CLASSES, DIM, client_config, join_all

from fedax.data import synthetic
from fedax.runtime import (
    Client,
    ClientTLS,
    Connection,
    Registry,
    Server,
    ServerConfig,
    ServerTLS,
    Task,
    make_dev_pki,
    wire,
)
from fedax.runtime.rounds import RoundFailed
from fedax.runtime.secagg import IdentityKey, Roster, SecAggServer
from fedax.runtime.secure_client import SecAggFault
from fedax.runtime.secure_phase import WITHHELD
from fedax.runtime.secure_task import (
    SECAGG_PATH,
    SECURE_KEY_PATH,
    STAGE_KEY_PATH,
    default_threshold,
    protocol_shape,
)
from fedax.spec.config import ConfigError, load_config

N = 8  # registered clients; the rounds here select 7 (n = k = 7, t = 4) unless said
SECURE = {"bits": 32, "max_weight": 45}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_dev_pki(tmp_path_factory.mktemp("pki"), num_clients=N)


@pytest.fixture(scope="module")
def parts():
    train, _ = synthetic(1.0, 1.0, num_clients=N, dim=DIM, num_classes=CLASSES, seed=3,
                         sizes=45)
    return [(train.x[train.client_indices(k)], train.y[train.client_indices(k)])
            for k in range(N)]


def secure_task(n=7, secure=None, **config):
    data = {"seed": 7, "rounds": 1, "dataset": "synthetic", "model": "logistic",
            "client_fraction": 1.0, "local_epochs": 2, "batch_size": 10, "client_lr": 0.1,
            "algorithm": "fedavg", "num_clients": n, "secure": secure or SECURE, **config}
    return Task(data, n, [DIM], {"input_dim": DIM, "num_classes": CLASSES})


def make_server(task, pki, key="seed", roster=None, **config):
    config = {"rounds": 1, "cohort_size": task.num_clients, "deadline_s": 3.0,
              "poll_interval_s": 0.05, **config}
    return Server(task, ServerConfig(**config), ServerTLS(pki["cert"], pki["key"]),
                  Registry.load(pki["registry"]),
                  key=jax.random.key(task.seed) if key == "seed" else key, roster=roster)


def identity_of(pki, k):
    """Client k's identity key and the roster (``make_dev_pki`` wrote them)."""
    setup = Path(pki["roster"]).parent
    return {"identity": IdentityKey.load(setup / "identities" / f"{k}.key"),
            "roster": Roster.load(pki["roster"])}


def secure_run(task, pki, parts, faults=None, ids=None, expect_error=None, checked=None,
               **config):
    """A secure server and one client thread per id (``faults``: id -> SecAggFault) run to
    the end (or to the server's error); returns the stopped server and the clients.
    ``checked``: "both" (the server has the roster and the clients their identity keys),
    "clients" (only they), None (neither)."""
    roster = Roster.load(pki["roster"]) if checked == "both" else None
    server = make_server(task, pki, roster=roster, **config)
    port = server.start()
    stop, clients, errors = threading.Event(), {}, {}
    ids = range(task.num_clients) if ids is None else ids

    def go(k):
        keys = identity_of(pki, k) if checked else {}
        clients[k] = Client(client_config(pki, port, k, reconnect_s=5.0, **keys), *parts[k],
                            stop=stop, fault=(faults or {}).get(k))
        try:
            clients[k].run()
        except BaseException as err:  # reported below
            errors[k] = err

    threads = [threading.Thread(target=go, args=(k,), daemon=True) for k in ids]
    for th in threads:
        th.start()
    try:
        if expect_error is None:
            assert server.wait(60.0)
        else:
            with pytest.raises(expect_error):
                server.wait(60.0)
            stop.set()
        join_all(threads, 30.0)
    finally:
        stop.set()
        server.stop()
    assert not errors, errors
    return server, clients


def serve_to_the_end(server, clients):
    """Runs every client in a thread until the started ``server`` finishes, then stops it."""
    threads = [threading.Thread(target=c.run, daemon=True) for c in clients.values()]
    for thread in threads:
        thread.start()
    try:
        assert server.wait(60.0)
        join_all(threads, 30.0)
    finally:
        server.stop()


def modular_total(clients, ids, bits=32):
    """Σ of the clients' encoded vectors mod 2^bits (what the server must unmask)."""
    total = sum(clients[k].secure_input[1].astype(np.uint64) for k in ids)
    return (total % (1 << bits)).astype(np.uint32)


def scalar_record(record):
    assert all(isinstance(v, (int, float, str)) for v in record.values()), record


# ----------------------------------------------------------------------- no network


def test_the_protocol_shape_defaults_and_refusals():
    for k in range(2, 40):
        t = default_threshold(k)
        assert k / 2 < t <= k and t >= (2 * k) // 3
    assert protocol_shape(7, None, None) == (7, 4)
    assert protocol_shape(10, None, None) == (9, 6)  # MNIST's cohort: 2⌈log2 10⌉+1
    assert protocol_shape(100, None, None) == (15, 10)
    assert protocol_shape(6, 9, None) == (6, 4)  # at most the cohort (complete graph)
    for n, k, t, words in [(1, None, None, "at least 2 clients"),
                           (10, 4, None, "must be odd"),
                           (10, 9, 4, "must exceed half of num_shares 9")]:
        with pytest.raises(ValueError, match=words):
            protocol_shape(n, k, t)


def test_fault_injection_names_the_last_stage_answered():
    stages = ("setup", "share_keys", "masked_input", "unmask")
    silent = {f: [SecAggFault(f).silent(s, 0, 0) for s in stages]
              for f in ("offline", *stages)}
    assert silent == {"offline": [True] * 4, "setup": [False, True, True, True],
                      "share_keys": [False, False, True, True],
                      "masked_input": [False, False, False, True],
                      "unmask": [False, False, False, True]}
    assert not SecAggFault("offline", frozenset({(0, 0)})).silent("setup", 0, 1)
    with pytest.raises(ValueError, match="one of offline"):
        SecAggFault("typo")


def test_what_does_not_compose_is_refused_in_one_line(pki):
    from fedax.runtime.async_server import AsyncServer
    from fedax.simulation.asynchronous import AsyncConfig, Staleness

    with pytest.raises(ConfigError, match="config key 'secure'.*asynchronous"):
        load_config(CONFIG, ["secure.bits=32", "execution.mode=network",
                             "network.asynchronous=true"])
    task = secure_task()
    with pytest.raises(ValueError, match="not with an asynchronous server"):
        AsyncServer(
            task, ServerConfig(rounds=1, cohort_size=7), ServerTLS(pki["cert"], pki["key"]),
            Registry.load(pki["registry"]), buffered=AsyncConfig(2, 3, Staleness("constant")))
    with pytest.raises(ValueError, match="at least 2 clients a round"):
        make_server(task, pki, cohort_size=1)
    with pytest.raises(ValueError, match="must exceed half of num_shares 7"):
        make_server(secure_task(secure={**SECURE, "threshold": 3}), pki)
    with pytest.raises(ValueError, match="with 8 bits wraps around"):
        make_server(secure_task(secure={**SECURE, "bits": 8, "levels": 100}), pki)


@pytest.mark.parametrize("key", ["seed", None], ids=["rehearsal", "deployment"])
def test_a_clients_keys_are_in_its_own_task_only(pki, key):
    """Each selected client's task carries its quantization key and its Setup; its
    client-stage key only in a rehearsal with the server's keys given (in a deployment the
    client draws its own, so the noise distributed DP adds is not the server's to know)."""
    server = make_server(secure_task(), pki, key=key)
    r = server.secure.open(0, 0, list(range(7)))
    for cid in r.selected:
        paths = [t.path for t in r.own[cid]]
        assert paths == ([STAGE_KEY_PATH] if key else []) + [SECURE_KEY_PATH, SECAGG_PATH]
    assert len({r.own[c][-1].data for c in r.selected}) == 7  # one Setup each
    assert r.target == 7 and r.phase == "train"


def test_a_client_refuses_a_setup_a_lying_server_could_exploit(pki, parts):
    """A Setup whose threshold is not above half of num_shares (with which a server that
    says a survivor dropped could collect both its shares) is refused before the client
    trains or answers; so is one for another client."""
    from fedax.runtime.client_task import built
    from fedax.runtime.secagg import SecAggParams, Setup
    from fedax.runtime.secure_task import pack

    task = secure_task()
    server = make_server(task, pki)
    r = server.secure.open(0, 0, list(range(7)))
    b = built(task.to_json())
    client = Client(client_config(pki, 1, 0), *parts[0])
    for setup, words in [(Setup(SecAggParams(7, 7, 3, 32, b["secure"].length, b"s"), 0,
                                (1, 2, 3, 4, 5, 6)), "threshold 3 is not above half"),
                         (Setup(SecAggParams(7, 7, 4, 32, b["secure"].length, b"s"), 1,
                                (0, 2, 3, 4, 5, 6)), "a Setup for client 1")]:
        env = wire.Envelope()
        env.ParseFromString(server._task_for(0))
        env.tensors[-1].CopyFrom(pack(setup))
        client._secure._refused = None  # (a task it refused is let pass when asked again)
        client._secure.train(None, b, env)  # no connection: it must not answer
        (t, attempt, accepted, why), = client.rounds[-1:]
        assert (t, attempt, accepted) == (0, 0, False) and words in why, why
    assert client.secure_input is None  # it did not train
    assert r.nonces  # (the round stayed open, unanswered)


# ----------------------------------------------------------------------- on loopback


@pytest.mark.serial
def test_the_sum_is_exact_with_dropouts_at_every_stage_up_to_the_threshold(pki, parts):
    """n = k = 7, t = 4: client 1 drops after sharing its keys (its pairwise masks are
    removed with its key's shares), client 2 after sending its masked vector and client 3
    during unmasking (both are survivors: their self-masks are removed with shares held by
    others). The server's sum is exactly Σ of the six survivors' encoded vectors mod 2^32,
    with the four unmask replies t needs; the record says who survived and what moved."""
    task = secure_task()
    faults = {1: SecAggFault("share_keys"), 2: SecAggFault("masked_input"),
              3: SecAggFault("unmask")}
    server, clients = secure_run(task, pki, parts, faults, min_reports=4)
    (transcript,) = server.secure.transcripts
    protocol = transcript.protocol
    survivors = (0, 2, 3, 4, 5, 6)
    assert protocol.survivors == survivors
    np.testing.assert_array_equal(protocol.result, modular_total(clients, survivors))
    assert sorted(transcript.received["unmask"]) == [0, 4, 5, 6]  # exactly t replies
    (record,) = server.history
    scalar_record(record)
    assert (record["selected"], record["reported"], record["secure_survivors"],
            record["secure_dropped"], record["dropped"], record["rejected"]) == (
        7, 6, 6, 1, 1, 0)
    assert (record["secure_num_shares"], record["secure_threshold"]) == (7, 4)
    assert record["secure_step"] == pytest.approx(8.0 / 2 ** 22)
    assert record["client_stats"] == WITHHELD and "train_loss" not in record
    for stage in ("train", "keys", "masked", "unmask"):
        assert record[f"secure_bytes_in_{stage}"] > 0 < record[f"secure_bytes_out_{stage}"]
    assert record["bytes_in"] == sum(record[f"secure_bytes_in_{s}"]
                                     for s in ("train", "keys", "masked", "unmask"))
    assert record["secure_server_cpu_s"] > 0
    for k in (0, 4, 5, 6):
        assert clients[k].rounds == [(0, 0, True, "")]
    assert clients[1].rounds == [(0, 0, False, "fault: dropped at masked_input")]
    assert all(np.all(np.isfinite(np.asarray(a))) for a in jax.tree.leaves(server.params))


@pytest.mark.serial
def test_below_the_threshold_the_attempt_aborts_holding_masked_vectors_only(pki, parts,
                                                                            tmp_path):
    """Four of seven drop during unmasking in attempt 0: three replies, fewer than t = 4
    shares of every secret; the server unmasks nothing (no sum, no update: its transcript
    holds masked vectors, its log counts), logs the attempt as aborted and retries it as a
    round with too few reports; attempt 1 closes with all seven."""
    task = secure_task()
    once = frozenset({(0, 0)})
    faults = {k: SecAggFault("masked_input", once) for k in (1, 2, 3, 4)}
    server, clients = secure_run(task, pki, parts, faults, min_reports=4,
                                 checkpoint_dir=str(tmp_path))
    aborted, closed = server.secure.transcripts
    assert (aborted.attempt, closed.attempt) == (0, 1)
    assert aborted.protocol.result is None and "fewer than 4 shares" in aborted.aborted
    assert set(aborted.received) == {"train", "keys", "masked", "unmask"}
    assert set(aborted.received["masked"].values()) == {"MaskedVector"}
    assert sorted(aborted.received["unmask"]) == [0, 5, 6]
    for u, y in aborted.protocol._masked.items():  # masked: not the client's vector
        x = clients[u].secure_input[1]  # (the same in both attempts: same t, same keys)
        small = lambda v: np.minimum(v, (1 << 32) - v.astype(np.int64)) <= 2 ** 22  # noqa: E731
        assert small(x).all() and small(y).mean() < 0.1 and not np.array_equal(x, y)
    np.testing.assert_array_equal(closed.protocol.result, modular_total(clients, range(7)))
    lines = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [(r["attempt"], r["status"]) for r in lines] == [(0, "aborted"), (1, "closed")]
    for record in lines:
        scalar_record(record)
    assert lines[0]["reported"] == 0 and "fewer than 4 shares" in lines[0]["secure_abort"]
    assert clients[1].rounds == [(0, 0, False, "fault: dropped at unmask"), (0, 1, True, "")]


@pytest.mark.serial
def test_the_round_fails_when_every_attempt_aborts(pki, parts):
    task = secure_task()
    faults = {k: SecAggFault("setup") for k in (1, 2, 3, 4)}  # no shares from them
    server, _ = secure_run(task, pki, parts, faults, expect_error=RoundFailed,
                           max_attempts=1, deadline_s=2.0)
    (transcript,) = server.secure.transcripts
    assert "clients can go on to stage 3, fewer than the threshold 4" in transcript.aborted
    assert transcript.protocol.result is None and not hasattr(transcript.protocol, "_masked")
    assert server.rounds_done == 0 and server.history == []


def _garbage_client(pki, port, cid, replies, done):
    """A registered client that answers its secure training task with bytes that are no
    SecAgg+ message."""
    conn = Connection(f"127.0.0.1:{port}", ClientTLS(pki["ca"]), cid, pki["tokens"][cid],
                      timeout_s=5.0)
    conn.chunk_bytes = conn.join().chunk_bytes
    try:
        while not done.is_set():
            env = conn.poll()
            if env.kind == "done":
                return
            if env.kind == "task" and not replies:
                out = wire.Envelope(kind="secagg", client_id=cid, round=env.round,
                                    attempt=env.attempt, model_version=env.model_version,
                                    nonce=env.nonce, tensors=wire.encode_arrays(
                                        [(SECAGG_PATH, np.frombuffer(b"\x01\x02garbage",
                                                                     np.uint8))]))
                replies.append(conn.submit(out))
            time.sleep(0.05)
    finally:
        conn.close()


@pytest.mark.serial
def test_a_client_refuses_both_shares_of_one_neighbour_and_garbage_is_refused(
        pki, parts, monkeypatch):
    """A server that asks client 0 for the self-mask share *and* the key share of one
    survivor gets nothing from it (the client refuses, records why and goes on: the server
    sees a drop-out); a client whose reply does not parse is refused (``secagg``), as any
    malformed report. The round closes with the others, the sum exact."""
    task = secure_task(n=N)  # eight selected: k = 7, t = 4
    honest = list(range(N - 1))
    collect_masked = SecAggServer.collect_masked

    def lying(self, replies, blamed=None):
        requests = collect_masked(self, replies, blamed)
        survivors, dropped = requests[0]
        requests[0] = (survivors, (*dropped, next(v for v in survivors if v != 0)))
        return requests

    monkeypatch.setattr(SecAggServer, "collect_masked", lying)
    server = make_server(task, pki, min_reports=4)
    port = server.start()
    replies, done = [], threading.Event()
    rogue = threading.Thread(target=_garbage_client, daemon=True,
                             args=(pki, port, N - 1, replies, done))
    rogue.start()
    clients, threads = {}, []
    for k in honest:
        clients[k] = Client(client_config(pki, port, k, reconnect_s=5.0), *parts[k])
        threads.append(threading.Thread(target=clients[k].run, daemon=True))
        threads[-1].start()
    try:
        assert server.wait(60.0)
        join_all(threads + [rogue], 30.0)
    finally:
        done.set()
        server.stop()
    (reply,) = replies
    assert not reply.accepted and reply.reason.startswith("secagg: malformed PublicKeys")
    assert [(e["client"], e["kind"]) for e in server.rejections] == [(N - 1, "secagg")]
    ((t, attempt, accepted, why),) = clients[0].rounds
    assert (t, attempt, accepted) == (0, 0, False)
    assert why.startswith("secagg refused: secagg-unmask") and "as dropped" in why
    (transcript,) = server.secure.transcripts
    assert transcript.protocol.survivors == tuple(honest)
    assert 0 not in transcript.received["unmask"]
    np.testing.assert_array_equal(transcript.protocol.result, modular_total(clients, honest))
    (record,) = server.history
    assert (record["selected"], record["reported"], record["rejected"]) == (N, N - 1, 1)


@pytest.mark.serial
def test_a_client_that_sends_garbage_shares_is_dropped_and_the_round_completes(
        pki, parts, monkeypatch):
    """Issue 55: one selected client that follows the protocol but encrypts garbage for
    every neighbour made each honest neighbour refuse and drop out, and the server abort.
    Now each neighbour blames it (its shares are authenticated under its key), the server
    drops it (a ``secagg`` rejection naming the blamers), and the round closes with the
    others on the first attempt, the sum theirs exactly."""
    from fedax.runtime.secagg import SecAggClient

    task = secure_task(n=N)  # eight selected: k = 7, t = 4
    rogue, honest = N - 1, list(range(N - 1))
    share_keys = SecAggClient.share_keys

    def garbling(self, keys, signatures=None):
        out = share_keys(self, keys, signatures)
        if self.cid == rogue:
            out = {v: bytes(len(c)) for v, c in out.items()}
        return out

    monkeypatch.setattr(SecAggClient, "share_keys", garbling)
    server = make_server(task, pki, min_reports=4)
    port = server.start()
    clients = {k: Client(client_config(pki, port, k, reconnect_s=5.0), *parts[k])
               for k in range(N)}
    serve_to_the_end(server, clients)
    (transcript,) = server.secure.transcripts
    assert transcript.aborted is None
    assert transcript.protocol.survivors == tuple(honest)
    assert transcript.protocol.rejected[rogue].endswith("shares that do not open")
    np.testing.assert_array_equal(transcript.protocol.result, modular_total(clients, honest))
    assert [(e["client"], e["kind"]) for e in server.rejections] == [(rogue, "secagg")]
    assert all(clients[k].rounds[0][2] for k in honest)  # every honest report included
    (record,) = server.history
    assert (record["selected"], record["reported"], record["rejected"]) == (N, N - 1, 1)


@pytest.mark.serial
def test_a_dishonest_clients_integers_are_bounded_by_the_modulus_only(pki, parts):
    """What the protocol cannot check: a client that skips its client stage and encoding
    may mask any vector in [0, 2^b)^d. Client 0 sends 2^30 in every coordinate of its value
    (its weight coordinate left honest; in range, so it is summed as any other): decoded
    with Δ = 8/2^22 this moves every coordinate of the weighted sum by 2^30·Δ = 2048 (the
    mean of the 7 unit weights by about 293), far beyond the ±8 an honest client's clip
    allows. The secure mean's bound holds for honest clients only."""
    from fedax.runtime.secure_client import SecureRounds

    class Dishonest(SecureRounds):
        def train(self, conn, b, env):
            super().train(conn, b, env)
            self._x = self._x.copy()
            self._x[:-1] = 2 ** 30  # the value's coordinates; the last one is the weight
            self.client.secure_input = (self._at, self._x)

    task = secure_task()
    server = make_server(task, pki)
    port = server.start()
    clients = {k: Client(client_config(pki, port, k, reconnect_s=5.0), *parts[k])
               for k in range(7)}
    clients[0]._secure = Dishonest(clients[0])
    initial = jax.tree.map(np.asarray, server.params)
    serve_to_the_end(server, clients)
    (transcript,) = server.secure.transcripts
    np.testing.assert_array_equal(transcript.protocol.result, modular_total(clients, range(7)))
    moved = max(float(np.abs(np.asarray(a) - b).max())
                for a, b in zip(jax.tree.leaves(server.params), jax.tree.leaves(initial),
                                strict=True))
    assert moved > 8.0 and server.rejections.counts == {}


@pytest.mark.serial
def test_distributed_dp_clients_noise_with_their_own_keys(pki, parts):
    """``privacy.mechanism: skellam`` with ``secure.bits: 20`` in a deployment (the
    server's own secret): each client noises its integers with a key it drew itself; the
    server's sum is exactly theirs mod 2^20 and its record distributed DP's."""
    task = secure_task(secure={"bits": 20}, privacy={
        "level": "user", "mechanism": "skellam", "clip": 0.5, "noise_multiplier": 1.0})
    server, clients = secure_run(task, pki, parts, key=None)
    (transcript,) = server.secure.transcripts
    np.testing.assert_array_equal(transcript.protocol.result,
                                  modular_total(clients, range(7), bits=20))
    (record,) = server.history
    assert record["noised_clients"] == 7 and "secure_step" not in record
    assert record["dp_effective_noise_multiplier"] == pytest.approx(1.0)


@pytest.mark.serial
@pytest.mark.parametrize("privacy", [
    [], pytest.param([*DP, "rounds=1", "checkpoint_every=1"], marks=pytest.mark.slow)],
    ids=["mean", "gaussian"])
def test_secure_mnist_over_the_network_equals_the_simulator(privacy, tmp_path):
    """The shipped MNIST 2NN non-IID config with ``secure: {bits: 32}`` (the secure mean,
    two rounds; with ``privacy.mechanism: gaussian``, central DP noise on the secure sum,
    one round) under
    ``execution.mode: network`` (two ``fedax client`` processes, the simulator's keys):
    the server unmasks the sums the simulator's ``secure_sum`` computes, so the records
    and the final model equal the simulator's to float tolerance."""
    sets = SHORT + ["secure.bits=32", *privacy]
    sync = run(sets, tmp_path / "sync")
    network = run(sets + NETWORK, tmp_path / "network")
    assert_close_records(sync, network, ("test_accuracy", "test_loss"), 1e-5)
    assert_same_model(final_params(tmp_path / "sync"), final_params(tmp_path / "network"))
    for a, b in zip(sync, network, strict=True):
        assert (b["selected"], b["secure_survivors"], b["secure_num_shares"],
                b["secure_threshold"]) == (10, 10, 9, 6)
        assert "train_loss" in a and "train_loss" not in b
        if privacy:
            assert b["epsilon"] == a["epsilon"] and "clipped_clients" not in b
            assert b["dp_noise_stddev"] == pytest.approx(a["dp_noise_stddev"])
        else:
            assert b["secure_step"] == pytest.approx(a["secure_step"])
