"""Checkpoints: format round trip, atomic writes, corruption detection, exact resume."""

import json
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax import data as fdata
from fedax.aggregators import Aggregator, chain, clip_norm, mean
from fedax.algorithms import scaffold
from fedax.cli.main import main
from fedax.models import get_model, softmax_cross_entropy
from fedax.simulation import (
    CheckpointError,
    CheckpointWarning,
    Execution,
    latest_checkpoint,
    load_checkpoint,
    make_evaluator,
    run,
    save_checkpoint,
)
from fedax.simulation import checkpoint as ckpt
from fedax.spec.config import ConfigError, validate_config

# ----------------------------------------------------------------------------- format


class Opt(NamedTuple):
    count: jax.Array
    mu: dict


class State(NamedTuple):
    params: dict
    opt: Opt
    round: jax.Array
    keys: jax.Array
    per_client: np.ndarray
    extra: tuple


def make_state(seed, w_shape=(3, 4)):
    k = jax.random.key(seed)
    w = jax.random.normal(k, w_shape, jnp.float32)
    b = jax.random.normal(jax.random.fold_in(k, 1), (4,)).astype(jnp.bfloat16)
    return State(
        params={"w": w, "b": b},
        opt=Opt(jnp.asarray(seed + 7, jnp.int32), {"w": w * 2, "b": b}),
        round=jnp.asarray(seed, jnp.int32),
        keys=jax.random.split(jax.random.fold_in(k, 2), 5),  # typed PRNG keys
        per_client=np.arange(20, dtype=np.int64).reshape(10, 2) * (seed + 1),
        extra=(jnp.asarray(0.5 + seed),  # weakly typed scalar
               jax.random.PRNGKey(seed),  # raw uint32 key
               optax.EmptyState()),
    )


def on(device, tree):
    """``tree`` with its JAX arrays moved to ``device`` (NumPy leaves stay NumPy)."""
    return jax.tree.map(
        lambda x: jax.device_put(x, device) if isinstance(x, jax.Array) else x, tree)


def assert_bit_identical(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array))
        assert x.dtype == y.dtype and x.shape == y.shape
        assert getattr(x, "weak_type", False) == getattr(y, "weak_type", False)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_round_trip_is_bit_identical_into_the_template_structure(tmp_path):
    saved = make_state(1)
    history = [{"round": 1, "test_accuracy": 0.1 + 0.2, "elapsed_s": 1.5}]
    fingerprint = {"seed": 1, "batch_size": float("inf"), "execution.devices": 2}
    path = save_checkpoint(tmp_path, 4, saved, history=history, fingerprint=fingerprint,
                           elapsed_s=12.25)
    assert path.name == "ckpt_4.msgpack"
    device = jax.devices()[1]
    template = on(device, make_state(0))
    restored = load_checkpoint(path, template, fingerprint)
    assert (restored.round, restored.history, restored.elapsed_s) == (4, history, 12.25)
    assert restored.fingerprint == fingerprint
    assert_bit_identical(restored.state, saved)
    assert restored.state.extra[0].weak_type and isinstance(restored.state.per_client, np.ndarray)
    # Restored leaves are placed like the template's.
    for leaf in jax.tree.leaves(restored.state):
        if isinstance(leaf, jax.Array):
            assert leaf.sharding == jax.sharding.SingleDeviceSharding(device)


def test_the_file_is_not_a_pickle_and_has_the_documented_header(tmp_path):
    path = save_checkpoint(tmp_path, 2, make_state(0))
    blob = path.read_bytes()
    assert blob[:8] == ckpt.MAGIC and b"pickle" not in blob
    assert ckpt.read_checkpoint(path)["round"] == 2


def test_wrong_template_is_a_clear_error_naming_the_leaf(tmp_path):
    path = save_checkpoint(tmp_path, 2, make_state(1))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, make_state(0, w_shape=(3, 5)))
    assert ".params['w']" in str(info.value)
    assert "float32[3, 4]" in str(info.value) and "float32[3, 5]" in str(info.value)
    other_dtype = make_state(0)._replace(round=jnp.asarray(0.0, jnp.float32))
    with pytest.raises(CheckpointError, match=r"\.round is int32\[\], .* float32\[\]"):
        load_checkpoint(path, other_dtype)
    fewer = make_state(0)._replace(params={"w": jnp.zeros((3, 4))})
    with pytest.raises(CheckpointError, match=r"unexpected leaves \[\"\.params\['b'\]\"\]"):
        load_checkpoint(path, fewer)


def test_another_runs_fingerprint_is_an_error_naming_the_differences(tmp_path):
    path = save_checkpoint(tmp_path, 2, make_state(0),
                           fingerprint={"seed": 0, "shape": (1, 2), "lr": 1})
    load_checkpoint(path, make_state(0), {"seed": 0, "shape": [1, 2], "lr": 1.0})
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, make_state(0), {"seed": 1, "shape": (1, 2), "lr": 1})
    assert "seed: 0 in the checkpoint, 1 now" in str(info.value)
    assert "shape" not in str(info.value)


def test_keeps_the_last_two_and_leaves_no_temporary_files(tmp_path):
    for r in (2, 4, 6):
        save_checkpoint(tmp_path, r, make_state(r))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_4.msgpack", "ckpt_6.msgpack"]
    assert latest_checkpoint(tmp_path, make_state(0)).round == 6


def test_a_crash_mid_write_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 2, make_state(2))

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 4, make_state(4))
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt_2.msgpack"]
    # A temporary file left by a killed process is not a checkpoint.
    (tmp_path / ".ckpt_4.msgpack.x1y2.tmp").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path, make_state(0)).round == 2


@pytest.mark.parametrize("damage", ["truncate", "flip_byte"])
def test_a_damaged_checkpoint_is_detected_and_the_previous_one_used(tmp_path, damage):
    save_checkpoint(tmp_path, 2, make_state(2))
    newest = save_checkpoint(tmp_path, 4, make_state(4))
    blob = bytearray(newest.read_bytes())
    if damage == "truncate":
        newest.write_bytes(blob[: len(blob) // 2])
        message = "truncated"
    else:
        blob[len(blob) // 2] ^= 0x01
        newest.write_bytes(bytes(blob))
        message = "corrupted: SHA-256 mismatch"
    with pytest.raises(CheckpointError, match=message):
        ckpt.read_checkpoint(newest)
    with pytest.warns(CheckpointWarning, match=message):
        found = latest_checkpoint(tmp_path, make_state(0))
    assert found.round == 2
    assert_bit_identical(found.state, make_state(2))
    # With every checkpoint damaged, resuming is an error (not a silent fresh start).
    (tmp_path / "ckpt_2.msgpack").write_bytes(b"FEDAXCK")
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError, match="no checkpoint"):
        latest_checkpoint(tmp_path, make_state(0))
    assert latest_checkpoint(tmp_path / "empty", make_state(0)) is None


def test_checkpoint_every_config_key():
    base = {"rounds": 5, "partition": "iid", "model": "2nn", "algorithm": "fedsgd",
            "client_fraction": 0.1, "client_lr": 0.1}
    assert validate_config(base).checkpoint_every == 0
    assert validate_config({**base, "checkpoint_every": 10}).checkpoint_every == 10
    with pytest.raises(ConfigError, match="'checkpoint_every'.*>= 0"):
        validate_config({**base, "checkpoint_every": -1})


# ----------------------------------------------------------------------------- exact resume


@pytest.fixture(scope="module")
def small_mnist():
    arrays = fdata.load_mnist()
    x, y = arrays["x_train"][:2000], arrays["y_train"][:2000]
    train = fdata.ClientData.from_partition(x, y, fdata.iid(len(y), 20, seed=0))
    model = get_model("2nn")
    # One evaluator for all runs: compiled once (the runner compiles each run's rounds).
    evaluate = make_evaluator(model.apply, arrays["x_test"][:1000], arrays["y_test"][:1000],
                              chunk=500)
    return train, model, evaluate


class Killed(Exception):
    """Stands in for the process dying."""


def noisy_clipped_mean(sigma=1e-4):
    """A stateful, keyed aggregator: clip, mean, then Gaussian noise from the round's key;
    its state counts rounds and sums the noise norms, and it reports both as metrics."""

    def server(value, stats, state, key):
        leaves, treedef = jax.tree.flatten(value)
        keys = jax.random.split(key, len(leaves))
        noise = [sigma * jax.random.normal(k, leaf.shape, leaf.dtype)
                 for k, leaf in zip(keys, leaves, strict=True)]
        norm = optax.tree.norm(noise)
        state = (state[0] + 1, state[1] + norm)
        noisy = jax.tree.unflatten(treedef, [a + b for a, b in zip(leaves, noise, strict=True)])
        return noisy, state, {"noise_norm": norm, "noise_total": state[1]}

    noise = Aggregator(lambda template: (jnp.zeros((), jnp.int32), jnp.zeros(())),
                       server=server)
    return chain(clip_norm(1.0), mean(), noise)


def _run(small_mnist, directory, *, execution, kill_after=None, resume=False, seed=0):
    train, model, evaluate = small_mnist

    def loss(params, batch):
        return softmax_cross_entropy(model.apply(params, batch.x), batch.y, batch.mask)

    def kill(record):
        if record["round"] == kill_after:
            raise Killed

    return run(
        # SCAFFOLD with server momentum: server, optimizer and per-client state (every
        # client's control variate) and a round counter must all survive the resume.
        # An aggregator with state, keys and metrics of its own: they survive it too.
        scaffold(loss, 0.1, train.num_clients, "II", optax.sgd(1.0, momentum=0.5),
                 aggregator=noisy_clipped_mean()),
        model.init(jax.random.key(seed)),
        train,
        evaluate,
        rounds=6,
        client_fraction=0.2,
        local_epochs=1,
        batch_size=10,
        seed=seed,
        execution=execution,
        callbacks=[kill],
        checkpoint_dir=directory,
        checkpoint_every=2,
        resume=resume,
    )


def _strip(history):
    return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in history.records]


def test_a_killed_and_resumed_run_equals_the_uninterrupted_run(small_mnist, tmp_path, caplog):
    """Killed right after the round-4 checkpoint, with the cohort sharded over two devices
    (the end-to-end test below covers one device and a kill between checkpoints)."""
    execution, kill_after = Execution("sequential", "scan", 2), 4
    full = _run(small_mnist, tmp_path / "full", execution=execution)
    assert [r["round"] for r in full.records] == [1, 2, 3, 4, 5, 6]
    assert full.records[-1]["test_accuracy"] > 0.5  # it learns
    assert int(full.state.round) == 6
    assert np.any(np.asarray(full.state.clients["dense1"]["kernel"]) != 0)
    assert int(full.state.aggregator[2][0]) == 6  # the aggregator's own state
    assert all(r["noise_norm"] > 0 and "clipped_clients" in r for r in full.records)
    with pytest.raises(Killed):
        _run(small_mnist, tmp_path / "run", execution=execution, kill_after=kill_after)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "ckpt_2.msgpack", "ckpt_4.msgpack"]
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        resumed = _run(small_mnist, tmp_path / "run", execution=execution, resume=True)
    # The restored state is placed as a fresh one: one compilation of the round, as in a
    # fresh run, and the same program.
    assert sum("Compiling jit(device_round)" in m for m in caplog.messages) == 1
    assert resumed.resumed_from == 4
    assert _strip(resumed) == _strip(full)
    assert_bit_identical(resumed.state, full.state)
    assert resumed.records[-1]["elapsed_s"] > resumed.records[3]["elapsed_s"]

    # Resuming a finished run runs no round and returns the same history and state.
    again = _run(small_mnist, tmp_path / "run", execution=execution, resume=True)
    assert again.records == resumed.records and again.resumed_from == 6
    assert_bit_identical(again.state, full.state)
    # Another run's checkpoints are refused, naming what differs.
    with pytest.raises(CheckpointError, match="seed: 0 in the checkpoint, 1 now"):
        _run(small_mnist, tmp_path / "run", execution=execution, resume=True, seed=1)


def test_fedax_run_resume_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["run", "mnist_2nn_noniid_fedavg", "--set", "rounds=4", "--set", "eval_every=1",
            "--set", "client_fraction=0.05", "--set", "batch_size=50",
            "--set", "client_lr=0.1", "--set", "checkpoint_every=2",
            "--set", "execution.devices=1",
            "--no-progress", "--out", str(out)]
    assert main(args) == 0
    full = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in full] == [1, 2, 3, 4]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "ckpt_2.msgpack", "ckpt_4.msgpack"]

    # The files as a kill during round 4 leaves them (the runner-level test above kills a
    # run for real): rounds 1-3 logged, the last line torn, the newest checkpoint round 2.
    (out / "checkpoints" / "ckpt_4.msgpack").unlink()
    (out / "metrics.jsonl").write_text("\n".join(full[:3]) + "\n" + full[3][:10])
    assert main([*args, "--resume"]) == 0

    def strip(lines):
        return [{k: v for k, v in json.loads(x).items() if k != "elapsed_s"} for x in lines]

    resumed = (out / "metrics.jsonl").read_text().splitlines()
    assert strip(resumed) == strip(full)
    assert resumed[:2] == full[:2]  # restored from the checkpoint as logged
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_round"] == 2 and summary["rounds_run"] == 4
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "ckpt_2.msgpack", "ckpt_4.msgpack"]

    capsys.readouterr()
    assert main([*args, "--set", "client_lr=0.2", "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "cannot resume" in err
    assert "config.client_lr: 0.1 in the checkpoint, 0.2 now" in err


# ----------------------------------------------------------------------------- extend


def test_a_run_resumed_with_more_rounds_equals_an_uninterrupted_run_of_them(tmp_path):
    """A finished 3-round run continued to 7 rounds: its round-3 record (the old last
    round, off the eval_every=2 schedule) is not one of a 7-round run's, and the clients
    rejected in round 3 count in the round-4 record instead; records and final state equal
    the uninterrupted run's. Fewer rounds than done are refused, as is any other change."""
    train, _ = fdata.synthetic(0.5, 0.5, 4, dim=8, num_classes=3, seed=0,
                               sizes=[30, 40, 25, 35])
    x = train.x.copy()
    for k in (1, 3):  # their updates are not finite: rejected and counted
        x[train.client_indices(k)] = np.nan
    data = fdata.ClientData(x, train.y, train.indices, train.offsets)
    model = get_model("logistic", input_dim=8, num_classes=3)

    def loss(p, batch):
        return softmax_cross_entropy(model.apply(p, batch.x), batch.y, batch.mask)

    algorithm = scaffold(loss, 0.1, 4, weighting="num_examples")
    params = model.init(jax.random.key(0))

    def go(rounds, directory, resume=False, lr=0.1):
        return run(algorithm, params, data, lambda p: (0.5, 1.0), rounds=rounds,
                   client_fraction=0.5, local_epochs=1, batch_size=10, seed=1, eval_every=2,
                   execution=Execution("sequential", "scan", 1), checkpoint_dir=directory,
                   checkpoint_every=2, resume=resume, max_rejected_fraction=1.0,
                   fingerprint={"rounds": rounds, "lr": lr}, schedule=("rounds",))

    rejected = [int(np.isin(fdata.sample_clients(np.random.default_rng([1, t]), 4, 0.5),
                            [1, 3]).sum()) for t in range(7)]
    assert rejected[2] > 0  # round 3 rejects clients: the test sees where they are counted
    full = go(7, tmp_path / "full")
    assert [(r["round"], r["rejected_clients"]) for r in full.records] == [
        (2, rejected[0] + rejected[1]), (4, rejected[2] + rejected[3]),
        (6, rejected[4] + rejected[5]), (7, rejected[6])]
    short = go(3, tmp_path / "run")
    assert [r["round"] for r in short.records] == [2, 3]
    longer = go(7, tmp_path / "run", resume=True)
    assert longer.resumed_from == 3
    assert _strip(longer) == _strip(full)
    assert_bit_identical(longer.state, full.state)

    with pytest.raises(ckpt.ResumeError, match="round 7, after this run's last round 5"):
        go(5, tmp_path / "run", resume=True)
    with pytest.raises(CheckpointError, match="config.lr: 0.1 in the checkpoint, 0.2 now"):
        go(9, tmp_path / "run", resume=True, lr=0.2)
    assert [r for r, _ in ckpt.list_checkpoints(tmp_path / "run")] == [7, 6]


def test_load_checkpoint_may_ignore_the_schedule_items(tmp_path):
    path = save_checkpoint(tmp_path, 2, make_state(0), fingerprint={"rounds": 3, "lr": 1})
    with pytest.raises(CheckpointError, match="rounds: 3 in the checkpoint, 6 now"):
        load_checkpoint(path, make_state(0), {"rounds": 6, "lr": 1})
    restored = load_checkpoint(path, make_state(0), {"rounds": 6, "lr": 1}, ignore=("rounds",))
    assert restored.round == 2 and restored.fingerprint["rounds"] == 3
    with pytest.raises(CheckpointError, match="lr: 1 in the checkpoint, 2 now"):
        load_checkpoint(path, make_state(0), {"rounds": 6, "lr": 2}, ignore=("rounds",))
    assert ckpt.newest_readable(tmp_path)["round"] == 2
