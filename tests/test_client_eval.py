"""Per-client evaluation against a NumPy evaluation of each client, and TensorBoard event
files read back against the run's metrics."""

import json
import math

import jax
import numpy as np
import pytest
import yaml
from conftest import TINY_CONFIG

from fedax.experiments.run import run_experiment
from fedax.simulation.evaluation import client_index, make_client_evaluator
from fedax.simulation.tensorboard import read_histograms, read_scalars
from fedax.spec.config import validate_config


def numpy_client_metrics(w, b, x, y, parts):
    """Each client's accuracy and mean cross-entropy of the linear model, in NumPy (float64)."""
    accs, losses = [], []
    for part in parts:
        logits = x[part].astype(np.float64) @ w + b
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        accs.append(np.mean(np.argmax(logits, 1) == y[part]))
        losses.append(-np.mean(logp[np.arange(len(part)), y[part]]))
    return np.array(accs), np.array(losses)


def test_per_client_metrics_equal_a_numpy_evaluation_of_each_client():
    rng = np.random.default_rng(0)
    n, d, k, clients = 530, 7, 4, 23
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = rng.integers(0, k, n).astype(np.int32)
    w = rng.normal(size=(d, k)).astype(np.float32)
    b = rng.normal(size=k).astype(np.float32)
    # Unequal clients, one with no test data, 10 examples of no client.
    order = rng.permutation(n - 10)
    cuts = np.sort(rng.choice(np.arange(1, n - 10), clients - 2, replace=False))
    parts = np.split(order, cuts) + [np.array([], np.int64)]
    evaluate = make_client_evaluator(lambda p, v: v @ p[0] + p[1], x, y,
                                     client_index(parts, n), target=0.3, chunk=64,
                                     num_clients=clients)
    params = (jax.numpy.asarray(w), jax.numpy.asarray(b))
    scores = evaluate.scores(params)
    real = [p for p in parts if len(p)]
    acc, loss = numpy_client_metrics(w, b, x, y, real)
    assert len(scores.accuracy) == clients
    np.testing.assert_allclose(scores.accuracy[:-1], acc, rtol=1e-6)
    np.testing.assert_allclose(scores.loss[:-1], loss, rtol=1e-4)
    assert scores.count[-1] == 0 and list(scores.count[:-1]) == [len(p) for p in real]

    result = evaluate(params)
    glob_acc, glob_loss = numpy_client_metrics(w, b, x, y, [np.arange(n)])
    assert result["test_accuracy"] == pytest.approx(glob_acc[0], rel=1e-6)
    assert result["test_loss"] == pytest.approx(glob_loss[0], rel=1e-4)
    assert result["clients_evaluated"] == clients - 1
    assert result["client_accuracy_mean"] == pytest.approx(acc.mean(), rel=1e-6)
    for q in (10, 25, 50, 75, 90):
        assert result[f"client_accuracy_p{q}"] == pytest.approx(np.percentile(acc, q), rel=1e-6)
    worst = np.sort(acc)[:3]  # ceil(10% of 22 clients)
    assert result["client_accuracy_worst10"] == pytest.approx(worst.mean(), rel=1e-6)
    assert result["client_accuracy_above_target"] == pytest.approx(np.mean(acc >= 0.3))
    assert result["client_loss_mean"] == pytest.approx(loss.mean(), rel=1e-4)


def test_sequences_are_scored_per_token_and_pads_count_for_nothing():
    rng = np.random.default_rng(1)
    n, t, v = 9, 5, 6
    logits = rng.normal(size=(n, t, v)).astype(np.float32)
    y = rng.integers(1, v, (n, t)).astype(np.int32)
    y[:, 3:] = 0  # PAD
    owner = np.array([0, 0, 1, 1, 1, 2, 2, 2, 2], np.int32)
    evaluate = make_client_evaluator(lambda p, i: p[i], np.arange(n), y, owner, chunk=4)
    scores = evaluate.scores(jax.numpy.asarray(logits))
    for c in range(3):
        rows = owner == c
        real = y[rows] != 0
        hits = (logits[rows].argmax(-1) == y[rows])[real]
        assert scores.accuracy[c] == pytest.approx(hits.mean(), rel=1e-6)
        assert scores.count[c] == real.sum()


@pytest.fixture(scope="module")
def per_client_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("per_client")
    data = yaml.safe_load(TINY_CONFIG)
    data.update(rounds=3, per_client_eval=True, target_accuracy=0.3)
    summary = run_experiment(validate_config(data), out, progress=False)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, summary, records


def test_a_run_records_the_distribution_over_clients(per_client_run):
    out, summary, records = per_client_run
    assert [r["round"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["clients_evaluated"] == 12
        assert r["client_accuracy_p10"] <= r["client_accuracy_p50"] <= r["client_accuracy_p90"]
        assert r["client_accuracy_worst10"] <= r["client_accuracy_p10"] + 1e-9
        assert 0 <= r["client_accuracy_above_target"] <= 1
    assert summary["final_client_accuracy"]["client_accuracy_worst10"] == \
        records[-1]["client_accuracy_worst10"]
    assert "rounds_to_target_worst10" in summary
    assert (out / "client_accuracy.png").stat().st_size > 10_000


def test_tensorboard_event_files_hold_the_runs_metrics(per_client_run):
    out, _, records = per_client_run
    scalars = read_scalars(out / "tensorboard")
    expected = {"test/test_accuracy", "test/test_loss", "round/train_loss",
                "clients/client_accuracy_worst10", "clients/client_accuracy_p50",
                "round/local_steps"}
    assert expected <= set(scalars)
    for name, points in scalars.items():
        key = name.split("/", 1)[1]
        want = [(r["round"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        assert [p[0] for p in points] == [w[0] for w in want], name
        np.testing.assert_allclose([p[1] for p in points], [w[1] for w in want], rtol=1e-6)
    assert not any(math.isnan(v) for points in scalars.values() for _, v in points)


def test_tensorboard_logs_learned_hyperparameters_and_client_vectors(tmp_path):
    from fedax.simulation.tensorboard import TensorBoardLogger

    with TensorBoardLogger(tmp_path) as board:
        board.on_round(1, {"update_norms": np.array([1.0, 2.0, 3.0, 0.0]),
                           "train_loss": np.float32(0.5)}, None)
        board.on_round(2, {"update_norms": np.array([1.0, 2.0])}, None)
        board({"round": 2, "server_lr": 0.7, "test_accuracy": 0.5, "status": "ok"})
    assert read_scalars(tmp_path) == {"hyper/server_lr": [(2, pytest.approx(0.7))],
                                      "test/test_accuracy": [(2, 0.5)]}
    assert read_histograms(tmp_path) == {"clients/update_norms": [(1, 4), (2, 2)]}
    # A resumed run drops the events of rounds after its checkpoint.
    with TensorBoardLogger(tmp_path) as board:
        board.on_resume([{"round": 1}])
        board({"round": 2, "server_lr": 0.9})
    assert read_scalars(tmp_path)["hyper/server_lr"] == [(2, pytest.approx(0.9))]
