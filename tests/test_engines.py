"""One experiment, every engine: the shipped MNIST 2NN non-IID FedAvg config with a DP
aggregator runs under ``execution.mode`` sync, async and network with no other change.

* async in lockstep (K = M = m, constant latency and staleness weights) is the sync run,
  bit for bit, ε included;
* network (a TLS gRPC server and two ``fedax client`` processes hosting the 100 clients on
  loopback, ``network.server_randomness: seed``) gives the sync run's records and final
  model to float tolerance: the same selection, the same per-client shuffles
  (``default_rng([seed, t, k])``), the same DP noise;
* the same for SCAFFOLD (sync and network; FedBuff refuses per-client state).

What a mode cannot do is refused in one line naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedax.experiments.network import run_network
from fedax.experiments.run import run_experiment
from fedax.runtime import Task
from fedax.spec.config import ConfigError, config_to_dict, load_config, validate_config

CONFIG = Path(__file__).resolve().parents[1] / "src" / "fedax" / "configs" / \
    "mnist_2nn_noniid_fedavg.yaml"
DP = ["privacy.level=user", "privacy.mechanism=gaussian", "privacy.noise_multiplier=1.0",
      "privacy.clip=0.5", "privacy.delta=1e-5"]
SHORT = ["rounds=2", "eval_every=1", "execution.devices=1", "checkpoint_every=2"]
LOCKSTEP = ["execution.mode=async", "asynchronous.latency.kind=constant",
            "asynchronous.staleness.kind=constant"]
NETWORK = ["execution.mode=network", "network.local_clients=2",
           "network.server_randomness=seed", "network.deadline_s=120"]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def final_params(out: Path) -> dict[str, np.ndarray]:
    """The server's model in a run directory's newest checkpoint, either engine's (one
    format, ``fedax.checkpoint``): its ``.server`` leaves by path, read from the bytes."""
    from fedax.checkpoint import read_file

    files = sorted((out / "checkpoints").glob("*.msgpack"), key=lambda p: p.stat().st_mtime)
    leaves = read_file(files[-1])["state"]
    params = {}
    for leaf in leaves:  # a learned η's simulator state nests the round's in .inner, and
        # the asynchronous simulator's holds it in ['state'] beside its clock's ['host']
        path = leaf["path"].removeprefix("['state']").removeprefix(".inner")
        if path.startswith(".server.params"):
            params[path] = np.frombuffer(leaf["data"], np.dtype(leaf["dtype"])).reshape(
                leaf["shape"])
    return params


def run(sets: list[str], out: Path) -> list[dict]:
    """Every engine through the one entry point (``execution.mode`` picks it)."""
    run_experiment(load_config(CONFIG, sets), out, progress=False, tensorboard=False)
    return records(out)


def assert_close_records(sync, other, keys, rtol):
    assert [r["round"] for r in sync] == [r["round"] for r in other]
    for a, b in zip(sync, other, strict=True):
        for key in keys:
            np.testing.assert_allclose(b[key], a[key], rtol=rtol, err_msg=key)


def assert_same_model(a, b, rtol=1e-5, atol=1e-6):
    assert sorted(a) == sorted(b) and len(a) > 0, (sorted(a), sorted(b))
    for path in a:
        np.testing.assert_allclose(b[path], a[path], rtol=rtol, atol=atol, err_msg=path)


@pytest.mark.serial
def test_one_dp_config_in_all_three_engines(tmp_path):
    sync = run(SHORT + DP, tmp_path / "sync")
    assert len(sync) == 2 and sync[-1]["clipped_clients"] == 10
    lockstep = run(SHORT + DP + LOCKSTEP, tmp_path / "async")
    for a, b in zip(sync, lockstep, strict=True):
        for key in ("train_loss", "test_accuracy", "test_loss", "epsilon",
                    "dp_noise_stddev"):
            assert a[key] == b[key], (key, a[key], b[key])  # the same bits
    network = run(SHORT + DP + NETWORK, tmp_path / "network")
    assert_close_records(sync, network, ("train_loss", "test_accuracy", "test_loss"), 1e-5)
    assert [r["epsilon"] for r in network] == [r["epsilon"] for r in sync]
    assert [(r["selected"], r["reported"], r["rejected"]) for r in network] == [(10, 10, 0)] * 2
    assert_same_model(final_params(tmp_path / "sync"), final_params(tmp_path / "network"))
    summary = json.loads((tmp_path / "network" / "summary.json").read_text())
    assert summary["execution"]["mode"] == "network"
    assert [json.loads((tmp_path / d / "summary.json").read_text())["engine"]
            for d in ("sync", "async", "network")] == ["sync", "async", "network"]
    assert summary["privacy"]["epsilon"] == pytest.approx(sync[-1]["epsilon"])
    # the server's sampling event: m = 10 of the N = 100 registered clients without
    # replacement each round, which `fedax privacy epsilon --population 100` accounts
    from fedax.privacy import epsilon

    assert summary["privacy"]["epsilon"] == pytest.approx(
        epsilon(1.0, 0.1, 2, 1e-5, sampling="fixed", population=100), rel=1e-12)
    assert (summary["privacy"]["sampling"], summary["privacy"]["expected_clients"]) == \
        ("fixed", 10)


@pytest.mark.serial
def test_scaffold_sync_and_network(tmp_path):
    sets = SHORT + ["algorithm=scaffold", "client_lr=0.05"]
    sync = run(sets, tmp_path / "sync")
    network = run(sets + NETWORK, tmp_path / "network")
    assert_close_records(sync, network, ("train_loss", "test_accuracy", "test_loss"), 1e-5)
    assert_same_model(final_params(tmp_path / "sync"), final_params(tmp_path / "network"))
    # c_i lives with each selected client, in its own state directory
    kept = list((tmp_path / "network" / "network" / "clients").glob("*/client_state.msgpack"))
    assert 10 <= len(kept) <= 20


def test_the_task_is_the_configs_task_part():
    config = load_config(CONFIG, DP + NETWORK)
    task = Task.from_config(config, num_clients=100, input_shape=[28, 28, 1],
                            model_options={})
    assert set(task.config) == set(config_to_dict(config)) - {"execution", "network"}
    assert Task.from_json(task.to_json()) == task  # names and numbers travel as JSON
    assert task.spec().privacy == config.privacy
    assert (task.algorithm, task.client_lr, task.local_epochs, task.batch) == \
        ("fedavg", 0.2, 1, 10)
    with pytest.raises(ValueError, match="holds no engine section; remove \\['network'\\]"):
        Task({**task.config, "network": {}}, 100, [28, 28, 1])
    with pytest.raises(ValueError, match="config key 'client_lr'"):
        Task({**task.config, "client_lr": -1.0}, 100, [28, 28, 1])


@pytest.mark.parametrize("change, key", [
    (["server.lr=learned", "learned_lr.clip=1.0", *DP], "server.lr"),
    (["attack.kind=sign_flip", "attack.fraction=0.2"], "attack"),
    (["stragglers=0.5"], "stragglers"),
    (["privacy.level=user", "privacy.mechanism=gaussian", "privacy.noise_multiplier=1.0",
      "privacy.clip=0.5", "privacy.delta=1e-5", "network.over_selection=0.3"],
     "network.over_selection"),
])
def test_what_the_network_does_not_carry_is_refused(change, key):
    with pytest.raises(ConfigError, match=rf"config key '{key}'.*execution.mode network"):
        load_config(CONFIG, ["execution.mode=network", *change])


def test_privacy_runs_asynchronously_only_in_lockstep():
    load_config(CONFIG, DP + LOCKSTEP)  # a flush is a round: accounted
    with pytest.raises(ConfigError, match="config key 'privacy'.*lockstep"):
        load_config(CONFIG, DP + LOCKSTEP + ["asynchronous.buffer_size=5"])


def test_engine_sections_dump_only_with_their_mode():
    sync = validate_config(config_to_dict(load_config(CONFIG)))
    assert "network" not in config_to_dict(sync) and "asynchronous" not in config_to_dict(sync)
    network = config_to_dict(load_config(CONFIG, NETWORK))
    assert network["network"]["local_clients"] == 2 and "asynchronous" not in network


@pytest.mark.serial
def test_server_init_start_and_clients_from_one_config(tmp_path, capsys):
    """``fedax server init --config`` writes the config and the setup; ``fedax server start
    --config`` serves it and ``fedax client --config --id 0-2`` (one process, three
    clients) trains on the config's partition; the outputs are ``fedax run``'s."""
    import os
    import socket
    import subprocess
    import sys

    from fedax.cli.main import main

    setup = tmp_path / "setup"
    assert main(["server", "init", str(setup), "--clients", "3", "--set", "rounds=2"]) == 0
    assert main(["server", "start", "--config", str(setup / "config.yaml"),
                 "--rounds", "3"]) == 2
    assert "--rounds come from the config" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GRPC_VERBOSITY": "ERROR"}
    fedax = [sys.executable, "-m", "fedax.cli.main"]
    server = subprocess.Popen([*fedax, "server", "start", "--config",
                               str(setup / "config.yaml"), "--port", str(port), "--out",
                               str(tmp_path / "run"), "--linger-s", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        client = subprocess.run([*fedax, "client", "--server", f"127.0.0.1:{port}", "--ca",
                                 str(setup / "ca.pem"), "--config", str(setup / "config.yaml"),
                                 "--id", "0-2", "--token-file", str(setup / "tokens/{id}.token"),
                                 "--state-dir", str(tmp_path / "c{id}"), "--connect-s", "60",
                                 "--delay-s", "0.3"],  # slow devices: 0.3 s before reporting
                                capture_output=True, text=True, env=env, timeout=120)
        out, err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    assert client.returncode == 0, client.stderr
    for k in range(3):
        assert f"fedax client {k}: done; 2 of 2 reports accepted" in client.stderr
    assert server.returncode == 0, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["rounds_run"] == 2
    assert len(records(tmp_path / "run")) == 2
    assert all(r["round_s"] >= 0.3 for r in records(tmp_path / "run"))  # the clients waited


SHAKESPEARE = {"seed": 0, "rounds": 2, "dataset": "shakespeare", "partition": "natural",
               "shakespeare": {"max_clients": 6, "seq_len": 20}, "num_clients": 6,
               "model": "char_lstm", "algorithm": "fedavg", "client_fraction": 0.5,
               "local_epochs": 1, "batch_size": 10, "client_lr": 1.0, "eval_every": 1,
               "execution": {"devices": 1}, "checkpoint_every": 2}


@pytest.mark.serial
def test_the_char_lstm_over_the_network_equals_the_simulator(tmp_path):
    """Token ids in, a token per position out, the model's own sequence loss: the char-LSTM
    on six Shakespeare roles, one client process hosting them, equals the sync run."""
    from fedax.spec.config import validate_config

    config = validate_config(SHAKESPEARE)
    run_experiment(config, tmp_path / "sync", progress=False, tensorboard=False)
    network = validate_config({**SHAKESPEARE, "execution": {"mode": "network"},
                               "network": {"local_clients": 1, "server_randomness": "seed",
                                           "deadline_s": 120}})
    run_network(network, tmp_path / "network", progress=False)
    sync, net = records(tmp_path / "sync"), records(tmp_path / "network")
    assert_close_records(sync, net, ("train_loss", "test_accuracy", "test_loss"), 1e-5)
    assert_same_model(final_params(tmp_path / "sync"), final_params(tmp_path / "network"))
    task = json.loads((tmp_path / "network" / "network" / "config.json").read_text())
    assert task["model"] == "char_lstm"


@pytest.mark.slow
@pytest.mark.serial
def test_compressed_uplinks_on_the_wire(tmp_path):
    """The codes are what crosses: each client encodes with the aggregator's state the
    server broadcast and its own client-stage key (the simulator's), the server decodes
    after validating them. Top-k with error feedback (deterministic; the residual on each
    client's disk) gives the simulator's model; 4-bit rotation puts 7.5x fewer bytes on the
    wire than float32, within 5% of the compressor's message size."""
    top_k = ["compression.scheme=top_k", "compression.fraction=0.1",
             "compression.error_feedback=true"]
    sync = run(SHORT + top_k, tmp_path / "sync")
    network = run(SHORT + top_k + NETWORK, tmp_path / "network")
    assert_close_records(sync, network, ("train_loss", "test_accuracy", "test_loss"), 1e-5)
    assert_same_model(final_params(tmp_path / "sync"), final_params(tmp_path / "network"))
    residuals = list((tmp_path / "network" / "network" / "clients").glob("*/client_state.*"))
    assert len(residuals) >= 10  # the cohorts' clients keep their residuals
    for record in network:
        assert abs(record["bytes_in"] / record["uplink_bytes"] - 1) < 0.05, record

    rotation = ["compression.scheme=rotation", "compression.bits=4"]
    network = run(["rounds=1", "eval_every=1", "execution.devices=1", *rotation, *NETWORK],
                  tmp_path / "rotation")
    float32 = 10 * 4 * (784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10)  # 10 2NN updates
    (record,) = network
    assert abs(record["bytes_in"] / record["uplink_bytes"] - 1) < 0.05, record
    assert float32 / record["bytes_in"] >= 7.5, float32 / record["bytes_in"]
    assert record["compression_ratio"] == pytest.approx(7.8, abs=0.05)


@pytest.mark.serial
def test_dp_over_a_compressed_uplink_equals_the_simulator(tmp_path):
    """DP-FedAvg over 16-bit codes: the clients clip, weigh and encode; the server decodes,
    clips each decoded message to S again, sets every weight to 1, sums and adds the noise
    from its key: with the simulator's randomness, the simulator's DP run."""
    sets = SHORT + DP + ["compression.scheme=float16"]
    sync = run(sets, tmp_path / "sync")
    network = run(sets + NETWORK, tmp_path / "network")
    assert_close_records(sync, network, ("train_loss", "test_loss"), 1e-5)
    assert [r["epsilon"] for r in network] == [r["epsilon"] for r in sync]
    # (a last-bit difference in an update can round to the next float16: 1.5e-6 seen)
    assert_same_model(final_params(tmp_path / "sync"), final_params(tmp_path / "network"),
                      atol=1e-5)


def test_a_dp_reports_weight_is_one_whatever_it_claims():
    """Under DP over a compressed uplink the server sets each report's weight to 1 (0 for
    none) before the sum, as DP-FedAvg's client stage does: a claimed weight of 1e6 moves
    the model no more than 1."""
    import jax

    from fedax.algorithms.protocol import Reports, apply_reports
    from fedax.runtime.task import build, server_state

    config = load_config(CONFIG, DP + ["compression.scheme=float16", "privacy.clip=10.0"])
    task = Task.from_config(config, num_clients=100, input_shape=[28, 28, 1],
                            model_options={})
    built = build(task)
    state = server_state(built.pieces, built.params)
    rng = np.random.default_rng(0)
    encoded = []  # three clients' float16 codes and stats, from the aggregator's client stage
    client_stage = jax.jit(built.pieces.aggregator.client)  # compiled once, not op by op
    for _ in range(3):
        update = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(a.dtype) * 0.01,
                              built.params)
        out = client_stage(update, np.float32(1), state.aggregator, jax.random.key(1))
        encoded.append((out[0], out[2]))
    codes, stage = jax.tree.map(lambda *xs: np.stack(xs), *encoded)

    @jax.jit
    def step(weights):
        reports = Reports(codes, weights,
                          {"local_steps": np.ones(3, np.float32),
                           "train_loss": np.ones(3, np.float32)}, (),
                          np.full(3, 600.0, np.float32), stage)
        new, _ = apply_reports(built.pieces, state, reports, jax.random.key(0),
                               keep=np.ones(3, bool), client_keys=np.zeros((3, 2), np.uint32),
                               staged=True, unit_weights=True)
        return built.pieces.server_params(new.server)

    honest = step(np.array([1.0, 1.0, 1.0], np.float32))
    claimed = step(np.array([1e6, 1.0, 1.0], np.float32))
    for a, b in zip(jax.tree.leaves(honest), jax.tree.leaves(claimed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.serial
def test_the_learned_server_lr_over_the_network_follows_the_simulators(tmp_path):
    """FAD over the network: the server differentiates its half of the round in u = log η
    and sends (x_{t+1}, ∂x_{t+1}/∂u) to holdout clients (a second kind of task), whose loss
    values and JVPs make the hypergradient; Adam on u. With the same keys the η trajectory,
    the holdout losses and the models are the simulator's, to float tolerance."""
    learned = ["rounds=3", "eval_every=1", "execution.devices=1", "checkpoint_every=3",
               "server.lr=learned", "server.optimizer=sgd", "learned_lr.init=1.0",
               "learned_lr.hyper_lr=0.1"]
    sync = run(learned, tmp_path / "sync")
    network = run(learned + NETWORK, tmp_path / "network")
    assert_close_records(sync, network, ("train_loss", "test_loss", "holdout_loss"), 1e-4)
    assert_close_records(sync, network, ("server_lr",), 1e-5)
    assert_close_records(sync, network, ("hypergradient_norm",), 1e-2)
    etas = [r["server_lr"] for r in network]
    assert etas[0] == 1.0 and len(set(etas)) == 3  # η moved every round
    # (after three rounds whose η agree to 1e-6, one weight in 40,000 differs by 1.5e-5)
    assert_same_model(final_params(tmp_path / "sync"), final_params(tmp_path / "network"),
                      rtol=1e-3, atol=5e-5)


@pytest.mark.parametrize("weighting", ["algorithm", "equal"])
def test_the_async_servers_step_is_fedbuffs(tmp_path, weighting):
    """``AsyncServer``'s server step on K buffered reports with staleness τ_k equals a NumPy
    FedBuff step: x − η Σ_k w_k s(τ_k) Δ_k / Σ_k w_k with s(τ) = (1 + τ)^(−1/2) (FedAvg's
    weighted mean, server SGD at η = 1), w_k = n_k, or 1 with ``weighting: equal`` (as the
    simulator's ``AsyncConfig.weighting``)."""
    from fedax.algorithms.protocol import Reports
    from fedax.runtime import Registry, ServerConfig, ServerTLS, make_dev_pki
    from fedax.runtime.async_server import AsyncServer
    from fedax.runtime.task import round_key
    from fedax.simulation.asynchronous import AsyncConfig, Staleness

    pki = make_dev_pki(tmp_path, 4)
    config = {"seed": 1, "rounds": 2, "dataset": "synthetic", "model": "logistic",
              "algorithm": "fedavg", "client_fraction": 1.0, "local_epochs": 1,
              "batch_size": 10, "client_lr": 0.1, "num_clients": 4}
    task = Task(config, 4, [3], {"input_dim": 3, "num_classes": 2})
    server = AsyncServer(task, ServerConfig(rounds=2, cohort_size=3),
                         ServerTLS(pki["cert"], pki["key"]), Registry.load(pki["registry"]),
                         buffered=AsyncConfig(3, 4, Staleness("polynomial", 0.5),
                                           weighting=weighting))
    rng = np.random.default_rng(0)
    before = {k: np.asarray(v) for k, v in server.params["dense"].items()}
    deltas = [{"dense": {k: rng.normal(size=v.shape).astype(np.float32)
                         for k, v in before.items()}} for _ in range(3)]
    n = np.array([5.0, 10.0, 20.0], np.float32)
    taus = np.array([0, 1, 3], np.int32)
    reports = Reports({"dense": {k: np.stack([d["dense"][k] for d in deltas])
                                 for k in before}},
                      n, {"train_loss": np.zeros(3, np.float32)}, (), n, {})
    keys = np.zeros((3, 2), np.uint32)
    state, metrics = server._flush(server.state, reports, taus, (), keys,
                                   round_key(server._key, 0))
    s = (1.0 + taus) ** -0.5
    for k, x in before.items():
        w = n if weighting == "algorithm" else np.ones(3, np.float32)
        mean = sum(w[i] * s[i] * deltas[i]["dense"][k] for i in range(3)) / w.sum()
        np.testing.assert_allclose(np.asarray(server.pieces.server_params(
            state.server)["dense"][k]), x - mean, rtol=1e-5, atol=1e-6)
    assert float(metrics["mean_staleness_weight"]) == pytest.approx(s.mean(), rel=1e-6)


def test_the_async_server_stages_each_report_with_its_downloaded_version(tmp_path):
    """A stateful client stage (the adaptive clip, z = 0) runs on each buffered report with
    the aggregator state of the version its client downloaded, as the simulator runs it
    where the update is computed, not with the state at the flush: three reports that
    downloaded clips 0.5, 0.2 and 1.0 give Σ_k clip(Δ_k, C_k) / m (m = 4, DP-FedAvg's
    fixed denominator), not the current clip's."""
    from fedax.aggregators.adaptive_clipping import QuantileClipState
    from fedax.algorithms.protocol import Reports
    from fedax.runtime import Registry, ServerConfig, ServerTLS, make_dev_pki
    from fedax.runtime.async_server import AsyncServer
    from fedax.runtime.task import round_key
    from fedax.simulation.asynchronous import AsyncConfig, Staleness

    pki = make_dev_pki(tmp_path, 4)
    config = {"seed": 1, "rounds": 2, "dataset": "synthetic", "model": "logistic",
              "algorithm": "fedavg", "client_fraction": 1.0, "local_epochs": 1,
              "batch_size": 10, "client_lr": 0.1, "num_clients": 4,
              "privacy": {"level": "user", "mechanism": "adaptive", "noise_multiplier": 0.0,
                          "clip": 0.5, "delta": 1e-5}}
    task = Task(config, 4, [3], {"input_dim": 3, "num_classes": 2})
    server = AsyncServer(task, ServerConfig(rounds=2, cohort_size=3),
                         ServerTLS(pki["cert"], pki["key"]), Registry.load(pki["registry"]),
                         buffered=AsyncConfig(3, 4, Staleness("constant")))
    assert float(server.state.aggregator.clip) == 0.5  # the current version's clip
    rng = np.random.default_rng(0)
    before = {k: np.asarray(v) for k, v in server.params["dense"].items()}
    deltas = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in before.items()}
              for _ in range(3)]
    n = np.array([5.0, 10.0, 20.0], np.float32)
    reports = Reports({"dense": {k: np.stack([d[k] for d in deltas]) for k in before}}, n,
                     {"train_loss": np.zeros(3, np.float32)}, (), n, {})
    clips = np.array([0.5, 0.2, 1.0], np.float32)
    norms = [np.sqrt(sum(float((d[k].astype(np.float64) ** 2).sum()) for k in d))
             for d in deltas]
    assert min(norms) > 1.0  # every report is clipped, each by its own C_k
    state, _ = server._flush(server.state, reports, np.zeros(3, np.int32),
                             QuantileClipState(clips), np.zeros((3, 2), np.uint32),
                             round_key(server._key, 0))
    for k, x in before.items():
        expected = sum(deltas[i][k] * min(1.0, clips[i] / norms[i]) for i in range(3)) / 4
        np.testing.assert_allclose(np.asarray(server.pieces.server_params(
            state.server)["dense"][k]), x - expected, rtol=1e-5, atol=1e-6)


def _one_version_config(weighting: str):
    """FedBuff with K = M = N = 6 synthetic clients (unequal n_k), one full-batch step each
    (no training key matters), constant staleness, one server step."""
    from fedax.spec.config import validate_config

    return validate_config({
        "seed": 3, "rounds": 1, "eval_every": 1, "checkpoint_every": 1,
        "dataset": "synthetic", "num_clients": 6, "model": "logistic", "algorithm": "fedavg",
        "client_fraction": 1.0, "local_epochs": 1, "batch_size": "inf", "client_lr": 0.5,
        "execution": {"mode": "async", "devices": 1},
        "asynchronous": {"buffer_size": 6, "concurrency": 6, "weighting": weighting,
                         "staleness": {"kind": "constant"}, "latency": {"kind": "constant"}}})


@pytest.mark.serial
def test_equal_weighting_changes_both_async_engines_alike(tmp_path):
    """``asynchronous.weighting: equal`` means the same in the networked asynchronous server
    as in the simulator: the six clients' updates of version 0, buffered by a real
    ``AsyncServer`` from six client threads, give the simulator's equal-weighted model
    (float tolerance: reports arrive in any order), which differs from n_k weighting's."""
    import jax
    from test_runtime import client_config, run_clients

    from fedax.builder.datasets import build_data
    from fedax.runtime import Registry, ServerConfig, ServerTLS, make_dev_pki
    from fedax.runtime.async_server import AsyncServer
    from fedax.runtime.launch import client_examples, network_task
    from fedax.simulation.asynchronous import AsyncConfig, Staleness

    models = {}
    for weighting in ("algorithm", "equal"):
        out = tmp_path / weighting
        run_experiment(_one_version_config(weighting), out, progress=False,
                       tensorboard=False)
        models[weighting] = final_params(out)
    gap = max(float(np.abs(models["algorithm"][p] - models["equal"][p]).max())
              for p in models["equal"])
    assert gap > 1e-3, gap  # the weighting matters on these unequal n_k

    config = _one_version_config("equal")
    pki = make_dev_pki(tmp_path / "pki", 6)
    server = AsyncServer(network_task(config, build_data(config)),
                         ServerConfig(rounds=1, cohort_size=6, poll_interval_s=0.05,
                                      deadline_s=60.0),
                         ServerTLS(pki["cert"], pki["key"]), Registry.load(pki["registry"]),
                         key=jax.random.key(config.seed), start_with=6,
                         buffered=AsyncConfig(6, 6, Staleness("constant"), weighting="equal"))
    port = server.start()
    parts = client_examples(config, list(range(6)))
    # each client reports 1 s after its task: all six report version 0 before any could
    # report a second trip (the record's clients say so)
    threads, results = run_clients([client_config(pki, port, k, delay_s=1.0)
                                    for k in range(6)], [parts[k][:2] for k in range(6)])
    try:
        assert server.wait(120.0), "the server did not finish its one step"
    finally:
        server.stop()
    for th in threads:
        th.join(30.0)
    assert server.history[0]["clients"] == list(range(6)), server.history[0]
    net = {path: np.asarray(leaf) for path, leaf in
           ((f".server.params['dense']['{k}']", v) for k, v in server.params["dense"].items())}
    assert_same_model(models["equal"], net)


@pytest.mark.serial
def test_an_asynchronous_networked_run(tmp_path):
    """FedBuff over the network: K = 5 reports a server step, M = 10 trips in flight, no
    rounds; every version's record says its staleness, trips and bytes, and the model
    learns (its test accuracy is twice chance)."""
    sets = ["rounds=6", "eval_every=3", "execution.mode=network", "network.local_clients=2",
            "network.asynchronous=true", "asynchronous.buffer_size=5",
            "asynchronous.concurrency=10", "asynchronous.staleness.kind=constant"]
    records_ = run(sets, tmp_path / "async")
    assert [r["round"] for r in records_] == [1, 2, 3, 4, 5, 6]
    for r in records_:  # (bytes are counted as they arrive, so a version may read 0)
        assert len(r["clients"]) == 5 and r["bytes_in"] >= 0 and r["stale"] == 0
        assert 0 <= r["mean_staleness"] <= r["max_staleness"] <= 6
    assert sum(r["bytes_in"] for r in records_) > 30 * 4 * 199_210  # 30 float32 2NN updates
    assert sum(r["trips"] for r in records_) >= 30  # every step took five finished trips
    # the model learns: ten classes, chance 0.1 (two-digit clients, five a step: noisy)
    assert max(r["test_accuracy"] for r in records_ if "test_accuracy" in r) > 0.2
    summary = json.loads((tmp_path / "async" / "summary.json").read_text())
    assert summary["rounds_run"] == 6 and summary["config"]["network"]["asynchronous"]


@pytest.mark.parametrize("change, key", [
    (["algorithm=scaffold"], "algorithm"),
    (DP, "privacy"),
    (["asynchronous.buffer_size=20", "asynchronous.concurrency=10"],
     "asynchronous.concurrency"),
])
def test_what_the_async_server_does_not_carry_is_refused(change, key):
    with pytest.raises(ConfigError, match=rf"config key '{key}'.*execution.mode network"):
        load_config(CONFIG, ["execution.mode=network", "network.asynchronous=true", *change])


@pytest.mark.serial
def test_clients_evaluate_on_their_own_test_data(tmp_path):
    """per_client_eval over the network: at each evaluation every client gets the new model
    (an evaluate task) and reports its test sums on its own test examples; the distribution
    over clients is the simulator's, which scores the pooled test set by client."""
    sets = ["rounds=2", "eval_every=1", "execution.devices=1", "per_client_eval=true"]
    sync = run(sets, tmp_path / "sync")
    network = run(sets + NETWORK, tmp_path / "network")
    keys = [k for k in sync[0] if k.startswith("client_accuracy") or k == "client_loss_mean"]
    assert len(keys) >= 8 and network[0]["clients_evaluated"] == 100
    assert_close_records(sync, network, keys, 1e-5)
    summary = json.loads((tmp_path / "network" / "summary.json").read_text())
    assert summary["final_client_accuracy"]["client_accuracy_worst10"] == \
        pytest.approx(sync[-1]["client_accuracy_worst10"], abs=1e-6)


@pytest.mark.serial
def test_the_async_server_resumes_mid_stream(tmp_path):
    """An asynchronous run stopped after 3 of 5 versions continues from its checkpoint
    (``--resume``): the versions, the server's key and the history carry on; trips in
    flight at the stop are dropped, and the clients take new ones."""
    base = ["eval_every=1", "execution.mode=network", "network.local_clients=2",
            "network.asynchronous=true", "asynchronous.buffer_size=5",
            "asynchronous.concurrency=10", "asynchronous.staleness.kind=constant"]
    first = run(["rounds=3", *base], tmp_path / "run")
    assert [r["round"] for r in first] == [1, 2, 3]
    config = load_config(CONFIG, ["rounds=5", *base])
    run_network(config, tmp_path / "run", progress=False, resume=True)
    resumed = records(tmp_path / "run")
    assert [r["round"] for r in resumed] == [1, 2, 3, 4, 5]
    assert resumed[:3] == first  # the checkpoint's history, unchanged
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["rounds_run"] == 5 and summary["status"] == "ok"


def _tiny_server(tmp_path, server_class=None, **kwargs):
    from fedax.runtime import Registry, Server, ServerConfig, ServerTLS, make_dev_pki

    pki = make_dev_pki(tmp_path, 4)
    config = {"seed": 1, "rounds": 2, "dataset": "synthetic", "model": "logistic",
              "algorithm": "fedavg", "client_fraction": 1.0, "local_epochs": 1,
              "batch_size": 10, "client_lr": 0.1, "num_clients": 4}
    task = Task(config, 4, [3], {"input_dim": 3, "num_classes": 2})
    return (server_class or Server)(task, ServerConfig(rounds=2, cohort_size=3),
                                    ServerTLS(pki["cert"], pki["key"]),
                                    Registry.load(pki["registry"]), **kwargs)


def test_the_network_runs_records_are_written_as_its_rounds_close(tmp_path):
    """``metrics.jsonl`` of a networked run holds each round as soon as it is closed and
    checkpointed (a run that fails later keeps them), and a resumed run's file starts with
    its checkpoint's rounds."""
    from fedax.experiments.network import _record_writer

    server = _tiny_server(tmp_path / "a")
    writer = _record_writer(server, tmp_path, None, resume=False)
    server.checkpoints.commit({"round": 0, "status": "closed", "train_loss": 1.5}, {})
    assert records(tmp_path) == [{"round": 1, "status": "ok", "train_loss": 1.5}]
    server.checkpoints.commit({"round": 1, "status": "closed", "train_loss": 1.25}, {})
    assert [r["round"] for r in records(tmp_path)] == [1, 2] == \
        [r["round"] for r in writer.records]
    again = _tiny_server(tmp_path / "b")
    again.history = [{"round": 0, "status": "closed", "train_loss": 1.5}]
    (tmp_path / "metrics.jsonl").write_text('{"round": 9}\n')  # a later, lost round
    _record_writer(again, tmp_path, None, resume=True)
    assert [r["round"] for r in records(tmp_path)] == [1]


@pytest.mark.parametrize("phase, values, problem", [
    ("evaluate", (5.0, 3.2, 10.0), None),
    ("evaluate", (11.0, 3.2, 10.0), "not 0 <= correct <= count"),
    ("evaluate", (5.0, -1.0, 10.0), "loss >= 0"),
    ("evaluate", (5.0, 3.2, 10.5), "not 0 <= correct <= count"),
    ("evaluate", (5.0, float("nan"), 10.0), "NaN or infinity"),
    ("holdout", (2.3, 0.1, 40.0), None),
    ("holdout", (2.3, 0.1, -1.0), "is not an integer in"),
    ("holdout", (2.3, 0.1, 2e6), "is not an integer in"),
])
def test_holdout_and_evaluate_reports_are_checked(tmp_path, phase, values, problem):
    """A holdout or evaluate client's report is checked as any report: exact arrays,
    finite, and its own bounds (n_k an integer in [0, max_examples]; 0 <= correct <=
    count an integer, loss >= 0)."""
    from types import SimpleNamespace

    from fedax.runtime import wire
    from fedax.runtime.holdout import EvalReport, HoldoutReport

    server = _tiny_server(tmp_path)
    kind = EvalReport if phase == "evaluate" else HoldoutReport
    env = wire.Envelope(tensors=wire.encode_tree(kind(*map(np.float32, values))))
    _, found = server._checked_report(SimpleNamespace(phase=phase, payload={}), env)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found[1], found


def test_the_async_server_takes_the_simulators_settings_and_refuses_what_it_cannot_run(
        tmp_path):
    """``AsyncServer`` takes the simulator's ``AsyncConfig`` (one record for both engines),
    validates it as the simulator does, and refuses FedAsync's mixing in one line."""
    from fedax.runtime.async_server import AsyncServer
    from fedax.simulation.asynchronous import AsyncConfig, Staleness

    with pytest.raises(ValueError, match="concurrency .* must be >= buffer_size"):
        _tiny_server(tmp_path / "a", AsyncServer, buffered=AsyncConfig(3, 2))
    with pytest.raises(ValueError, match="mixing .* not with an asynchronous server"):
        _tiny_server(tmp_path / "b", AsyncServer,
                     buffered=AsyncConfig(2, 3, Staleness("constant"), mixing=True))


def test_an_async_report_must_match_its_trip(tmp_path):
    """The asynchronous server refuses, before reading a body, a report that names no trip
    in flight for its client, or another trip's version or nonce; a report of a trip that
    has ended is late, not a violation."""
    from fedax.runtime.async_server import AsyncServer, Trip
    from fedax.simulation.asynchronous import AsyncConfig, Staleness

    server = _tiny_server(tmp_path, AsyncServer,
                          buffered=AsyncConfig(2, 3, Staleness("constant"), max_staleness=1))
    server._trips[1] = Trip(0, 0, "n" * 32, "v1", b"", {}, (), np.zeros(2, np.uint32), 1e18)
    server._next_trip = 1
    assert server._check_header(None, 1, 0, 0, "v1", "n" * 32) is None
    for header in ((0, 0, "v2", "n" * 32), (0, 0, "v1", "m" * 32), (5, 0, "v1", "n" * 32)):
        reply = server._check_header(None, 1, *header)
        assert not reply.accepted and reply.reason.startswith("wrong-round"), header
    reply = server._check_header(None, 2, 0, 0, "v1", "n" * 32)  # client 2's trip ended
    assert not reply.accepted and reply.reason.startswith("late")
    assert [e["kind"] for e in server.rejections] == ["wrong-round"] * 3


def test_a_report_staler_than_max_staleness_is_refused_and_never_buffered(tmp_path):
    import jax

    from fedax.runtime import wire
    from fedax.runtime.async_server import AsyncServer, Trip
    from fedax.simulation.asynchronous import AsyncConfig, Staleness

    server = _tiny_server(tmp_path, AsyncServer,
                          buffered=AsyncConfig(2, 3, Staleness("constant"), max_staleness=1))
    report = jax.tree.map(lambda a: np.ones(a.shape, a.dtype), server.report_template)
    report = report._replace(weight=np.float32(5), num_examples=np.float32(5),
                             stats={"local_steps": np.float32(1),
                                    "train_loss": np.float32(1)})
    for cid, version in ((1, 2), (2, 0)):  # staleness 1 (kept), 3 (> 1: refused)
        server._trips[cid] = Trip(cid, version, "n" * 32, "v", b"", {}, (),
                                  np.zeros(2, np.uint32), 1e18)
    server.rounds_done = 3
    for cid in (1, 2):
        env = wire.Envelope(client_id=cid, round=cid, attempt=0, model_version="v",
                            nonce="n" * 32, tensors=wire.encode_tree(report))
        reply = server._check_report(None, cid, (cid, 0, "v", "n" * 32), env)
        assert reply.accepted == (cid == 1), reply.reason
    assert [(c, tau) for c, _, tau, _ in server._buffer] == [(1, 1)]
    assert [e["kind"] for e in server.rejections] == ["stale"]
