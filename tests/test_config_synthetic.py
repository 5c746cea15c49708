"""Config keys for Synthetic(α, β), ``model: logistic`` and stragglers, and their wiring."""

import json

import numpy as np
import pytest

from fedax import data as fdata
from fedax.builder.datasets import _linear_kwargs, build_data
from fedax.cli.main import main
from fedax.experiments.resume import _fingerprint
from fedax.reproduce.runs import same_config
from fedax.spec.config import ConfigError, config_to_dict, validate_config

SYNTHETIC = {
    "rounds": 2, "dataset": "synthetic", "num_clients": 12, "model": "logistic",
    "algorithm": "fedprox", "mu": 1.0, "client_fraction": 0.5, "local_epochs": 3,
    "batch_size": 10, "client_lr": 0.01,
}


def test_synthetic_config_fills_the_natural_partition_and_defaults():
    config = validate_config(SYNTHETIC)
    assert config.partition == "natural"
    assert (config.synthetic.alpha, config.synthetic.beta, config.synthetic.iid) == (1, 1, False)
    assert (config.stragglers, config.drop_stragglers) == (0.0, False)
    config = validate_config({**SYNTHETIC, "synthetic": {"alpha": 0.5, "beta": 0, "iid": True},
                              "stragglers": 0.9, "drop_stragglers": True})
    assert (config.synthetic.alpha, config.synthetic.beta, config.synthetic.iid) == (0.5, 0, True)
    assert (config.stragglers, config.drop_stragglers) == (0.9, True)
    assert validate_config(config_to_dict(config)) == config  # round trip


@pytest.mark.parametrize("change,key", [
    ({"partition": "iid"}, "'partition'"),
    ({"model": "2nn"}, "'model'"),
    ({"synthetic": {"alpha": -1}}, "'synthetic.alpha'"),
    ({"synthetic": {"beta": "inf"}}, "'synthetic.beta'"),
    ({"synthetic": {"gamma": 1}}, "'synthetic.gamma'"),
    ({"synthetic": {"iid": "yes"}}, "'synthetic.iid'"),
    ({"synthetic": 3}, "'synthetic'"),
    ({"stragglers": 1.5}, "'stragglers'"),
    ({"stragglers": -0.1}, "'stragglers'"),
    ({"drop_stragglers": 1}, "'drop_stragglers'"),
    ({"dataset": "mnist", "partition": "natural", "model": "2nn"}, "'partition'"),
])
def test_bad_values_are_one_line_naming_the_key(change, key):
    with pytest.raises(ConfigError) as err:
        validate_config({**SYNTHETIC, **change})
    message = str(err.value)
    assert key in message and "\n" not in message
    if key == "'drop_stragglers'":
        assert "true or false" in message


def test_synthetic_data_pools_the_clients_test_splits():
    config = validate_config({**SYNTHETIC, "seed": 4, "synthetic": {"alpha": 0.5, "beta": 0.5}})
    data = build_data(config)
    train, test = fdata.synthetic(0.5, 0.5, 12, seed=4)
    np.testing.assert_array_equal(data.train.x, train.x)
    np.testing.assert_array_equal(data.train.offsets, train.offsets)
    np.testing.assert_array_equal(data.x_test, test.x)
    np.testing.assert_array_equal(data.y_test, test.y)
    assert data.model_kwargs == {"input_dim": 60, "num_classes": int(train.y.max()) + 1}
    iid = build_data(validate_config({**SYNTHETIC, "synthetic": {"iid": True}}))
    np.testing.assert_array_equal(iid.y_test, fdata.synthetic(1, 1, 12, seed=0, iid=True)[1].y)


def test_logistic_takes_its_sizes_from_image_data():
    config = validate_config({**SYNTHETIC, "dataset": "mnist", "partition": "iid"})
    x, y = np.zeros((5, 28, 28, 1), np.float32), np.array([0, 9, 3, 1, 2])
    assert _linear_kwargs(config, x, y) == {"input_dim": 784, "num_classes": 10}
    other = validate_config({**SYNTHETIC, "dataset": "mnist", "partition": "iid", "model": "2nn"})
    assert _linear_kwargs(other, x, y) == {}


def test_new_keys_at_their_defaults_keep_older_runs_and_checkpoints_valid():
    config = validate_config({**SYNTHETIC, "dataset": "mnist", "partition": "iid",
                              "model": "2nn"})
    saved = config_to_dict(config)
    new_keys = ("synthetic", "stragglers", "drop_stragglers")
    older = {k: v for k, v in saved.items() if k not in new_keys}
    fingerprint = _fingerprint(config)
    assert not set(fingerprint) & {*new_keys, "checkpoint_every"}
    assert all(fingerprint[k] == older[k] for k in fingerprint)
    assert same_config(older, saved)  # a summary written before the keys existed is reused
    assert not same_config({**older, "rounds": 3}, saved)
    stragglers = validate_config({**SYNTHETIC, "stragglers": 0.5})
    assert _fingerprint(stragglers)["stragglers"] == 0.5


def test_fedax_run_synthetic_with_stragglers(tmp_path):
    out = tmp_path / "run"
    path = tmp_path / "config.json"  # JSON is YAML
    path.write_text(json.dumps({**SYNTHETIC, "stragglers": 0.5, "drop_stragglers": True,
                                "algorithm": "fedavg", "client_lr": 0.05}))
    assert main(["run", str(path), "--out", str(out), "--no-progress"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [r["round"] for r in records] == [1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["stragglers"] == 0.5 and summary["config"]["partition"] == "natural"
    assert 0.0 <= summary["final_test_accuracy"] <= 1.0


def test_the_new_experiments_are_registered_and_every_cell_validates():
    from fedax.reproduce import EXPERIMENTS
    from fedax.reproduce.report import _fmt_column
    from fedax.reproduce.runs import cell_config

    for name in ("scaffold-mnist", "fedprox-synthetic", "fedopt-fashion"):
        experiment = EXPERIMENTS[name]
        assert experiment.quick and experiment.notes and experiment.quick_notes
        for cell in (*experiment.cells, *experiment.quick):
            for lr in cell.lrs:
                cell_config(experiment, cell, lr)
    assert (_fmt_column(0.5), _fmt_column(0.001), _fmt_column(20)) == ("0.5", "0.001", "20")
