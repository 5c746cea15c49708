"""The networked runtime on loopback: a real gRPC server with TLS and client tokens, real
clients (threads of this process, each with its own partition and state directory; in one
test ``fedax client`` processes), the same round pieces as the simulator.

Every server and client here stops by itself: servers run a fixed number of rounds and
clients leave when the server says ``done``; every wait has a timeout."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax import aggregators
from fedax.algorithms import CohortBatches, make
from fedax.client import Batches, dp_local_train
from fedax.data import synthetic
from fedax.models import get_model, softmax_cross_entropy
from fedax.runtime import (
    Client,
    ClientConfig,
    ClientTLS,
    Connection,
    Refused,
    Registry,
    Server,
    ServerConfig,
    ServerTLS,
    Task,
    local_batches,
    make_dev_pki,
    server_status,
    wire,
)
from fedax.runtime.client import train_key
from fedax.simulation import Execution, HostCohorts
from fedax.simulation import run as simulate

# Network deadlines of a few seconds: `make test` runs these alone (pyproject `serial`).
pytestmark = pytest.mark.serial

NUM_CLIENTS = 6
DIM, CLASSES = 20, 5


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_dev_pki(tmp_path_factory.mktemp("pki"), num_clients=200)


@pytest.fixture(scope="module")
def parts():
    """Each client's own examples (non-IID Synthetic(1, 1), 40 examples each)."""
    train, _ = synthetic(1.0, 1.0, num_clients=NUM_CLIENTS, dim=DIM, num_classes=CLASSES,
                         seed=3, sizes=45)
    return [(train.x[train.client_indices(k)], train.y[train.client_indices(k)])
            for k in range(NUM_CLIENTS)]


# The experiment config the tasks here are made from: every client in every round.
BASE_CONFIG = {"seed": 7, "rounds": 3, "dataset": "synthetic",
               "model": "logistic", "client_fraction": 1.0, "local_epochs": 2,
               "batch_size": 10, "client_lr": 0.1}


def make_task(algorithm="fedavg", num_clients=NUM_CLIENTS, input_shape=(DIM,), **config):
    """The runtime task of an experiment config (``BASE_CONFIG`` with ``algorithm`` and the
    keys in ``config``: ``privacy``, ``robust``, ``algorithm_options``, ...), on clients of
    ``input_shape`` examples (the logistic model's ``input_dim``)."""
    data = {**BASE_CONFIG, "algorithm": algorithm, "num_clients": num_clients, **config}
    return Task(data, num_clients, list(input_shape),
                {"input_dim": int(np.prod(input_shape)), "num_classes": CLASSES})


def start_server(task, pki, key="seed", **config):
    """A started server; its secret key is ``key(task.seed)``, the simulator's (``key=None``:
    its own secret, as in a deployment)."""
    config.setdefault("deadline_s", 20.0)
    config.setdefault("poll_interval_s", 0.05)
    if key == "seed":
        key = jax.random.key(task.seed)
    server = Server(task, ServerConfig(**config), ServerTLS(pki["cert"], pki["key"]),
                    Registry.load(pki["registry"]), key=key)
    return server, server.start()


def client_config(pki, port, k, tmp_path=None, **kw):
    state_dir = None if tmp_path is None else str(tmp_path / f"client{k}")
    return ClientConfig(f"127.0.0.1:{port}", k, pki["tokens"][k], ClientTLS(pki["ca"]),
                        state_dir=state_dir, reconnect_s=kw.pop("reconnect_s", 10.0), **kw)


def run_clients(configs, parts, results=None):
    """Start one thread per client config; returns the threads and their results."""
    results = {} if results is None else results

    def go(cfg):
        try:
            x, y = parts[cfg.client_id % len(parts)]
            results[cfg.client_id] = Client(cfg, x, y).run()
        except BaseException as err:  # reported by the test
            results[cfg.client_id] = err

    threads = [threading.Thread(target=go, args=(c,), daemon=True) for c in configs]
    for th in threads:
        th.start()
    return threads, results


def join_all(threads, timeout=60.0):
    end = time.monotonic() + timeout
    for th in threads:
        th.join(max(end - time.monotonic(), 0.0))
    assert not any(th.is_alive() for th in threads), "a client did not stop by itself"


def simulated(task, parts, rounds, cohorts=None, aggregator=None, history_out=False):
    """The simulator's model after ``rounds`` rounds of ``task``, round t with the clients
    ``cohorts[t]`` (default: every client every round), each client's batches made as the
    client makes them; ``aggregator`` built here from ``fedax.aggregators`` (not from the
    task's spec); ``history_out=True``: the simulator's ``History`` too."""
    model = get_model(task.model, **task.model_options)

    def loss_fn(params, batch):
        return softmax_cross_entropy(model.apply(params, batch.x), batch.y, batch.mask)

    algorithm = make(task.algorithm, loss_fn, num_clients=task.num_clients,
                     client_lr=task.client_lr, aggregator=aggregator,
                     **task.spec().algorithm_options)

    def cohort(t):
        ids = range(len(parts)) if cohorts is None else cohorts[t]
        made = [local_batches(*parts[k], task.local_epochs, task.batch, task.seed, t, k)
                for k in ids]
        xs, ys, masks, ns = zip(*made, strict=True)
        return CohortBatches(Batches(np.stack(xs), np.stack(ys), np.stack(masks)),
                             np.array(ns, np.float32), np.array(list(ids), np.int32))

    params = jax.jit(model.init)(jax.random.key(task.seed))
    history = simulate(algorithm, params, HostCohorts(cohort, task.num_clients), None,
                       rounds=rounds, seed=task.seed, execution=Execution("vmap", "scan", 1))
    params = algorithm.server_params(history.state)
    return (params, history) if history_out else params


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def networked(task, pki, parts, tmp_path, rounds):
    """A server and NUM_CLIENTS client threads running ``task`` to the end, every client
    in every round; returns the stopped server."""
    server, port = start_server(task, pki, rounds=rounds, cohort_size=NUM_CLIENTS,
                                checkpoint_dir=str(tmp_path / "server"))
    try:
        threads, results = run_clients(
            [client_config(pki, port, k, tmp_path) for k in range(NUM_CLIENTS)], parts)
        assert server.wait(60.0)
        join_all(threads)
    finally:
        server.stop()
    for k in range(NUM_CLIENTS):
        assert results[k] == [(t, 0, True, "") for t in range(rounds)], results[k]
    return server


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold", "fedadam"])
def test_networked_run_equals_the_simulator(algorithm, pki, parts, tmp_path):
    rounds = 3
    task = make_task(algorithm)
    server = networked(task, pki, parts, tmp_path, rounds)
    expected = simulated(task, parts, rounds)
    assert_trees_close(server.params, expected)
    # The model moved (the comparison is not between two initial models).
    initial = jax.jit(get_model("logistic", input_dim=DIM, num_classes=CLASSES).init)(
        jax.random.key(task.seed))
    assert max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
               zip(jax.tree.leaves(initial), jax.tree.leaves(server.params), strict=True)) > 1e-3
    for record in server.history:
        assert (record["selected"], record["reported"], record["dropped"],
                record["rejected"]) == (NUM_CLIENTS, NUM_CLIENTS, 0, 0)
        assert record["bytes_in"] > 0 and record["bytes_out"] > 0 and record["round_s"] > 0
    if algorithm == "scaffold":  # c_i lives on the client, in its own directory
        assert all((tmp_path / f"client{k}" / "client_state.msgpack").exists()
                   for k in range(NUM_CLIENTS))
        assert not (tmp_path / "server" / "client_state.msgpack").exists()


def test_client_processes_equal_the_simulator(pki, parts, tmp_path):
    """Server + 3 ``fedax client`` processes on loopback, each loading its own partition
    from its own file and keeping SCAFFOLD's c_i in its own directory: the simulator's
    model after 3 rounds."""
    rounds, n = 3, 3
    task = make_task("scaffold", num_clients=n)
    server, port = start_server(task, pki, rounds=rounds, cohort_size=n)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src") + os.pathsep + \
        env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    procs = []
    try:
        for k in range(n):
            np.savez(tmp_path / f"client_{k}.npz", x=parts[k][0], y=parts[k][1])
            (tmp_path / f"{k}.token").write_text(pki["tokens"][k])
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "fedax.cli.main", "client",
                 "--server", f"127.0.0.1:{port}", "--ca", pki["ca"], "--id", str(k),
                 "--token-file", str(tmp_path / f"{k}.token"),
                 "--data", str(tmp_path / f"client_{k}.npz"),
                 "--state-dir", str(tmp_path / f"client{k}"), "--reconnect-s", "20"],
                stderr=subprocess.PIPE, text=True, env=env))
        assert server.wait(60.0)
        for k, proc in enumerate(procs):
            _, err = proc.communicate(timeout=30)
            assert proc.returncode == 0, err
            assert f"fedax client {k}: done; {rounds} of {rounds} reports accepted" in err
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        server.stop()
    assert [(r["selected"], r["reported"]) for r in server.history] == [(n, n)] * rounds
    assert_trees_close(server.params, simulated(task, parts[:n], rounds))
    assert all((tmp_path / f"client{k}" / "client_state.msgpack").exists() for k in range(n))


# DP-FedAvg over the network: the config's privacy section in the task, the oracle built
# here directly.
S, Z = 0.05, 1.0  # S well below the updates' norms: every client is clipped
DP_CASES = {
    "dp_gaussian": (
        {"level": "user", "mechanism": "gaussian", "clip": S, "noise_multiplier": Z},
        lambda: aggregators.dp_gaussian(S, Z, NUM_CLIENTS)),
    "dp_adaptive_gaussian": (  # z < 2·σ_b; σ_b = max(m/20, z), the config's rule
        {"level": "user", "mechanism": "adaptive", "noise_multiplier": 0.5, "clip": S,
         "clip_learning_rate": 0.5},
        lambda: aggregators.dp_adaptive_gaussian(0.5, NUM_CLIENTS, initial_clip=S,
                                                 learning_rate=0.5,
                                                 clipped_count_stddev=0.5)),
}


@pytest.mark.parametrize("kind", list(DP_CASES))
def test_dp_round_over_the_network_equals_the_simulators(kind, pki, parts, tmp_path):
    """Clipping on each client with the aggregator state the server sent, the sum, noise
    and the state update on the server from the round key: the simulator's DP round,
    same seed, same noise, to float tolerance."""
    rounds = 3
    privacy, make_aggregator = DP_CASES[kind]
    task = make_task("fedavg", privacy=privacy)
    assert Task.from_json(task.to_json()) == task  # the config travels as JSON
    server = networked(task, pki, parts, tmp_path, rounds)
    expected, history = simulated(task, parts, rounds, aggregator=make_aggregator(),
                                  history_out=True)
    assert_trees_close(server.params, expected, rtol=1e-5)
    # The server's round metrics are the simulator's (its per-round values).
    assert len(history.records) == len(server.history) == rounds
    for record, sim in zip(server.history, history.records, strict=True):
        assert record["dp_noise_stddev"] == pytest.approx(sim["dp_noise_stddev"], rel=1e-5)
        if kind == "dp_gaussian":  # every client was clipped, on its own machine
            assert record["clipped_clients"] == NUM_CLIENTS == sim["clipped_clients"]
        else:  # the clip the clients used moved with the server's state
            assert record["clip_norm"] == pytest.approx(sim["clip_norm"], rel=1e-5)
    if kind == "dp_adaptive_gaussian":
        assert server.history[-1]["clip_norm"] != pytest.approx(S, rel=1e-3)


def test_example_level_dp_sgd_over_the_network(pki, parts, tmp_path):
    """Keyed client updates: each client runs DP-SGD with noise from its own secret key
    (``state_dir/client_seed``, never sent); the model is FedAvg of exactly those local
    DP-SGD runs, computed here with ``dp_local_train`` and each client's key."""
    rounds, clip, z = 2, 0.5, 1.0
    task = make_task("fedavg", privacy={"level": "example", "clip": clip,
                                        "noise_multiplier": z})
    seeds = {k: bytes([k + 1]) * 32 for k in range(NUM_CLIENTS)}
    for k, seed in seeds.items():
        (tmp_path / f"client{k}").mkdir()
        (tmp_path / f"client{k}" / "client_seed").write_text(seed.hex())
    server = networked(task, pki, parts, tmp_path, rounds)
    model = get_model(task.model, **task.model_options)

    def loss_fn(params, batch):
        return softmax_cross_entropy(model.apply(params, batch.x), batch.y, batch.mask)

    @jax.jit
    def local(params, batches, key, noise):
        result = dp_local_train(loss_fn, params, batches, optax.sgd(task.client_lr),
                                l2_clip=clip, noise_multiplier=noise, key=key)
        return jax.tree.map(jnp.subtract, params, result.params)

    def oracle(noise):
        params = jax.jit(model.init)(jax.random.key(task.seed))
        for t in range(rounds):
            total, weight = None, 0.0
            for k in range(NUM_CLIENTS):
                x, y, mask, n = local_batches(*parts[k], task.local_epochs, task.batch,
                                              task.seed, t, k)
                key = jax.random.wrap_key_data(train_key(seeds[k], t))
                delta = jax.tree.map(lambda d, n=n: d * n,
                                     local(params, Batches(x, y, mask), key, noise))
                total = delta if total is None else jax.tree.map(jnp.add, total, delta)
                weight += float(n)
            params = jax.tree.map(lambda p, d, w=weight: p - d / w, params, total)
        return params

    assert_trees_close(server.params, oracle(z), rtol=1e-4, atol=1e-5)
    gap = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
              zip(jax.tree.leaves(oracle(0.0)), jax.tree.leaves(server.params), strict=True))
    assert gap > 1e-3, gap  # the clients' noise is in the model


def test_every_aggregator_section_builds_and_travels(tmp_path):
    """A task is the config's task part: every aggregator section builds on the server's
    side and round-trips as JSON; a bad one fails when the task is made, naming its key; a
    task.json of the older form (its own aggregator kinds) is refused in one line."""
    from fedax.runtime import build

    for section in ({"privacy": {"mechanism": "gaussian", "clip": 1.0,
                                 "noise_multiplier": 1.0}},
                    {"privacy": {"mechanism": "adaclip", "noise_multiplier": 0.5}},
                    {"privacy": {"level": "example", "clip": 1.0, "noise_multiplier": 0.5}},
                    {"robust": {"rule": "median"}},
                    {"robust": {"rule": "norm_bounding", "norm_bound": 1.0}},
                    {"robust": {"rule": "trimmed_mean", "beta": 0.2, "clip": 1.0}},
                    {"compression": {"scheme": "qsgd", "levels": 16}}):
        task = make_task(**section)
        assert Task.from_json(task.to_json()) == task
        assert build(task).pieces is not None
    cases = {"config key 'privacy.clip': must be a number > 0": {
        "privacy": {"mechanism": "gaussian", "clip": -1.0}},
             "unknown config key 'robust.mode'": {"robust": {"rule": "median", "mode": 1}},
             "holds no engine section": {"execution": {"mode": "network"}}}
    for message, section in cases.items():
        with pytest.raises(ValueError, match=message):
            make_task(**section)
    old = {"algorithm": "fedavg", "model": "logistic", "num_clients": 2, "client_lr": 0.1,
           "aggregator": {"kind": "mean"}}
    with pytest.raises(ValueError, match="older fedax.*fedax server init DIR --config"):
        Task.from_json(json.dumps(old))


def test_robust_aggregator_over_the_network(pki, parts, tmp_path):
    """A robust reduction (the clip on each client, the coordinate-wise median of the
    reports on the server) gives the simulator's model."""
    rounds, rule = 2, "median"
    task = make_task("fedavg", robust={"rule": rule, "clip": 0.5})
    server = networked(task, pki, parts, tmp_path, rounds)
    expected = simulated(task, parts, rounds,
                         aggregator=aggregators.robust(rule, clip=0.5))
    assert_trees_close(server.params, expected)


# ---------------------------------------------------------------------- security


def test_plaintext_client_is_refused(pki, tmp_path):
    server, port = start_server(make_task(), pki, rounds=1, cohort_size=1)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        call = channel.unary_unary(f"/{wire.SERVICE}/Status",
                                   request_serializer=wire.StatusRequest.SerializeToString,
                                   response_deserializer=wire.StatusReply.FromString)
        with pytest.raises(grpc.RpcError) as err:
            call(wire.StatusRequest(), timeout=3.0)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        channel.close()
        # The same call over TLS works: the server is up, it only refuses plaintext.
        status = server_status(f"127.0.0.1:{port}", ClientTLS(pki["ca"]))
        assert status["state"] == "waiting" and status["rounds_done"] == 0
    finally:
        server.stop()


def test_unauthenticated_clients_are_refused(pki, parts, caplog):
    tokens = dict(pki["tokens"])
    registry = Registry.of_tokens({0: tokens[0], 1: tokens[1]}, revoked=[1])
    server = Server(make_task(), ServerConfig(rounds=1, cohort_size=1, poll_interval_s=0.05),
                    ServerTLS(pki["cert"], pki["key"]), registry)
    port = server.start()
    caplog.set_level(logging.WARNING, logger="fedax.runtime.server")
    try:
        cases = {"unknown client 5": (5, tokens[5]), "wrong token for client 0": (0, "nope"),
                 "client 1 is revoked": (1, tokens[1])}
        for reason, (cid, token) in cases.items():
            cfg = ClientConfig(f"127.0.0.1:{port}", cid, token, ClientTLS(pki["ca"]),
                               reconnect_s=2.0)
            # The caller hears one reason for all three (no enumeration of ids) ...
            with pytest.raises(Refused, match="unknown client, wrong token or revoked") as err:
                Client(cfg, *parts[0]).run()
            assert str(cid) not in str(err.value).split(":", 1)[1]
            assert reason in caplog.text  # ... the operator's log says which
        assert server.last_seen == {}  # none of them got in
        assert server.rounds_done == 0
    finally:
        server.stop()


# ---------------------------------------------------------------------- report checks


def _rogue(kind, cid, pki, port, template, done, log):
    """A registered, selected client that sends a bad report of ``kind`` every round."""
    conn = Connection(f"127.0.0.1:{port}", ClientTLS(pki["ca"]), cid, pki["tokens"][cid],
                      timeout_s=5.0)
    conn.chunk_bytes = conn.join().chunk_bytes  # as a real client does
    zeros = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), template)
    old = None
    try:
        while not done.is_set():
            env = conn.poll()
            if env.kind == "done":
                return
            if env.kind != "task":
                time.sleep(0.02)
                continue
            report = zeros._replace(weight=np.float32(0.0), num_examples=np.float32(0.0))
            if kind == "shape":
                report = report._replace(update=jax.tree.map(
                    lambda a: np.zeros((a.shape[0] + 1, *a.shape[1:]), a.dtype), report.update))
            if kind == "nan":
                report = report._replace(update=jax.tree.map(
                    lambda a: np.full(a.shape, np.nan, a.dtype), report.update),
                    weight=np.float32(1.0))
            out = wire.Envelope(kind="update", client_id=cid, round=env.round,
                                attempt=env.attempt, model_version=env.model_version,
                                nonce=env.nonce, tensors=wire.encode_tree(report))
            if kind == "wrong-round":
                out.round = env.round + 1
            if kind == "oversized":
                out.tensors.extend(wire.encode_arrays([("extra", np.zeros(50_000, np.float32))]))
            if kind == "truncated":
                pieces = list(wire.chunks(out, 64))
                log.append((kind, conn.submit(out, chunks=pieces[: len(pieces) // 2])))
            elif kind == "replay":
                if old is not None:  # the previous round's accepted report, sent again
                    log.append(("replay-old", conn.submit(old)))
                else:
                    log.append(("first", conn.submit(out)))
                    log.append(("replay", conn.submit(out)))
                    old = out
            else:
                log.append((kind, conn.submit(out)))
    finally:
        conn.close()


ROGUES = {"shape": "structure", "nan": "non-finite", "truncated": "truncated",
          "oversized": "oversized", "wrong-round": "wrong-round", "replay": "replay"}


def test_bad_reports_are_rejected_and_never_averaged(pki, parts, caplog):
    honest = 4
    rogues = list(ROGUES)
    task = make_task()
    caplog.set_level(logging.INFO, logger="fedax.runtime.server")
    server, port = start_server(task, pki, rounds=2, cohort_size=honest + len(rogues),
                                min_reports=honest, max_message_bytes=100_000,
                                chunk_bytes=4096)
    done, logs = threading.Event(), {}
    try:
        threads, results = run_clients([client_config(pki, port, k) for k in range(honest)],
                                       parts)
        for i, kind in enumerate(rogues):
            logs[kind] = []
            th = threading.Thread(target=_rogue, daemon=True, args=(
                kind, honest + i, pki, port, server.report_template, done, logs[kind]))
            th.start()
            threads.append(th)
        assert server.wait(60.0)
        join_all(threads)
    finally:
        done.set()
        server.stop()
    for k in range(honest):
        assert [r[2] for r in results[k]] == [True, True]
    kinds = {(e["client"], e["kind"]) for e in server.rejections}
    for i, kind in enumerate(rogues):
        assert (honest + i, ROGUES[kind]) in kinds, (kind, server.rejections)
        assert f"rejected a report from client {honest + i}: {ROGUES[kind]}" in caplog.text
    replies = dict(logs["replay"])
    assert replies["first"].accepted and not replies["replay"].accepted
    assert replies["replay"].reason.startswith("replay")
    assert replies["replay-old"].reason.startswith("wrong-round")
    # Each round closed with the honest clients (and in round 0 the replayer's first report).
    assert [(r["status"], r["reported"], r["rejected"]) for r in server.history] == [
        ("closed", honest + 1, len(rogues) - 1), ("closed", honest, len(rogues))]
    # Never averaged: the model is the honest clients' (the replayer's first report has
    # weight 0, so it counts for nothing either).
    assert_trees_close(server.params, simulated(task, parts[:honest], 2))


# ---------------------------------------------------------------------- the command


def test_the_commands(pki, tmp_path, capsys):
    """``fedax server init`` writes a working setup, ``fedax server status`` reads a running
    server, and a refused client ends in one line."""
    from fedax.builder.datasets import build_data
    from fedax.cli.main import main
    from fedax.runtime.launch import network_task
    from fedax.spec.config import load_config

    out = tmp_path / "setup"
    assert main(["server", "init", str(out), "--clients", "2", "--set", "rounds=1"]) == 0
    for name in ("ca.pem", "server.pem", "server.key", "registry.json", "config.yaml",
                 "tokens/0.token", "tokens/1.token"):
        assert (out / name).is_file(), name
    config = load_config(out / "config.yaml")
    assert (config.execution.mode, config.network.setup, config.num_clients,
            config.rounds) == ("network", str(out.resolve()), 2, 1)
    setup = {"cert": str(out / "server.pem"), "key": str(out / "server.key"),
             "registry": str(out / "registry.json")}
    task = network_task(config, build_data(config))
    server, port = start_server(task, setup, rounds=1, cohort_size=2)
    try:
        capsys.readouterr()
        assert main(["server", "status", "--server", f"localhost:{port}",
                     "--ca", str(out / "ca.pem")]) == 0
        assert '"state": "waiting"' in capsys.readouterr().out
        (tmp_path / "bad.token").write_text("not-the-token")
        status = main(["client", "--server", f"localhost:{port}", "--ca", str(out / "ca.pem"),
                       "--id", "0", "--token-file", str(tmp_path / "bad.token"),
                       "--config", str(out / "config.yaml"), "--reconnect-s", "2"])
        err = capsys.readouterr().err.strip().splitlines()
        assert status == 2 and err[-1] == ("fedax: error: the server refused client 0: "
                                           "refused: unknown client, wrong token or "
                                           "revoked client")
    finally:
        server.stop()
