"""DP in a run: Poisson client sampling, the `privacy:` config section with one-line errors,
ε in every record against direct dp-accounting calls, and a privacy budget that ends the run
before the round that would exceed it."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from conftest import TINY_CONFIG

from fedax import aggregators
from fedax import data as fdata
from fedax.builder.build import privacy_aggregator
from fedax.builder.privacy_plan import privacy_plan
from fedax.experiments.run import run_experiment
from fedax.privacy import epsilon, round_up
from fedax.simulation.sources import PartitionSource
from fedax.spec.config import ConfigError, validate_config


def test_poisson_sampling_draws_each_client_with_probability_q():
    train, _ = fdata.synthetic(0.5, 0.5, num_clients=40, seed=0)
    source = PartitionSource(train, 0.1, 1, 10, seed=7, sampling="poisson")
    sizes = set()
    for t in range(30):
        data = source.round_data(t, pad_to=1)
        want = np.nonzero(np.random.default_rng([7, t]).random(40) < 0.1)[0]
        assert list(data.ids) == list(want) and data.real == len(want)
        num_examples = data.plain[0]
        assert np.all(num_examples[:data.real] > 0) and not np.any(num_examples[data.real:])
        sizes.add(data.size)
        if data.real == 0:  # nobody joined: an empty cohort that trains nothing
            assert not np.any(data.sharded[1])
    assert sizes == {source.capacity}  # one shape, so one compilation
    assert source.capacity < 40
    with pytest.raises(ValueError, match="sampling"):
        PartitionSource(train, 0.1, 1, 10, sampling="bernoulli")


def _config(**privacy):
    data = yaml.safe_load(TINY_CONFIG)
    data.update(num_clients=30, client_fraction=0.2, rounds=6)
    data["privacy"] = privacy
    return data


@pytest.mark.parametrize("privacy,key,fragment", [
    ({"mechanism": "gaussian", "clip": 1.0, "noise_multiplier": -1}, "privacy.noise_multiplier",
     ">= 0"),
    ({"mechanism": "gaussian", "clip": 0.0, "noise_multiplier": 1}, "privacy.clip", "> 0"),
    ({"mechanism": "gaussian", "noise_multiplier": 1}, "privacy.clip", "needs clip"),
    ({"mechanism": "gaussian", "clip": 1.0}, "privacy.noise_multiplier", "target_epsilon"),
    ({"mechanism": "adaptive", "noise_multiplier": 1, "accountant": "pld"},
     "privacy.accountant", "poisson"),
    ({"mechanism": "adaptive", "noise_multiplier": 1, "per_layer": True},
     "privacy.per_layer", "gaussian"),
    ({"mechanism": "laplace", "noise_multiplier": 1}, "privacy.mechanism", "gaussian"),
    ({"mechanism": "gaussian", "clip": 1.0, "noise_multiplier": 1, "pin_scale": True},
     "privacy.pin_scale", "adaclip"),
])
def test_invalid_privacy_configs_are_one_line(privacy, key, fragment):
    with pytest.raises(ConfigError) as info:
        validate_config(_config(**privacy))
    message = str(info.value)
    assert "\n" not in message and key in message and fragment in message, message


def test_pin_scale_builds_adaclip_with_its_budget_at_the_clip():
    """The pinned AdaCliP's first round is flat clipping at ``clip`` (dp_gaussian's)."""
    config = validate_config(_config(mechanism="adaclip", clip=0.3, noise_multiplier=1.0,
                                     pin_scale=True))
    plan = privacy_plan(config, 30)
    aggregator = privacy_aggregator(config, plan)
    rng = np.random.default_rng(0)
    values = jnp.asarray(rng.normal(size=(4, 50)), jnp.float32)
    weights, key = jnp.ones(4), jax.random.key(1)
    got, _, _ = aggregators.aggregate(aggregator, values, weights, aggregator.init(values[0]),
                                      key)
    flat = aggregators.dp_gaussian(0.3, 1.0, plan.expected_clients)
    want, _, _ = aggregators.aggregate(flat, values, weights, (), key)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_delta_at_least_one_over_n_warns():
    config = validate_config(_config(mechanism="gaussian", clip=1.0, noise_multiplier=1.0,
                                     delta=0.05))
    with pytest.warns(UserWarning, match="1/N"):
        privacy_plan(config, 30)


def test_epsilon_in_every_record_and_the_budget_stops_the_run(tmp_path):
    config = validate_config(_config(mechanism="gaussian", clip=0.5, noise_multiplier=1.0,
                                     delta=1e-3, target_epsilon=12.0))
    plan = privacy_plan(config, 30)
    direct = [epsilon(1.0, 6 / 30, t, 1e-3, sampling="fixed", population=30)
              for t in range(1, 7)]
    allowed = max(t for t in range(1, 7) if direct[t - 1] <= 12.0)
    assert 1 <= allowed < 6 and plan.rounds == allowed  # the budget binds in this test
    summary = run_experiment(config, tmp_path / "a", progress=False)
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").open()]
    assert [r["round"] for r in records] == list(range(1, allowed + 1))
    for r in records:
        assert r["epsilon"] == pytest.approx(direct[r["round"] - 1], rel=1e-12)
        assert r["dp_noise_stddev"] == pytest.approx(1.0 * 0.5 / 6, rel=1e-6)
    privacy = summary["privacy"]
    assert privacy["stopped_by_budget"] and privacy["epsilon"] <= 12.0
    assert privacy["rounds_within_budget"] == allowed and "fixed-size" in privacy["accounting"]
    # what epsilon covers is said, and the unnoised columns recorded beside it are named
    # one neighbouring relation, the accountant's: fixed-size sampling is replace-one
    assert "REPLACE_ONE" in privacy["accounting"]
    assert privacy["neighbouring_relation"].startswith("replace-one client")
    assert not any("add-or-remove" in line for line in privacy["epsilon_covers"])
    assert privacy["releases_per_round"] == 1
    assert {"train_loss", "clipped_clients", "rejected_clients"} <= set(
        privacy["diagnostics_not_covered"])
    assert not {"epsilon", "test_accuracy", "dp_noise_stddev"} & set(
        privacy["diagnostics_not_covered"])
    # the budget stop says so, in the status and in one line
    assert summary["status"] == "stopped_by_budget"
    assert summary["stop_reason"] == (
        f"stopped by the privacy budget after round {allowed} of 6: round {allowed + 1} "
        f"would spend epsilon = {round_up(direct[allowed], 4)} > privacy.target_epsilon = 12")
    # The same seed gives the same noise: the same numbers again.
    run_experiment(config, tmp_path / "b", progress=False)
    again = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").open()]
    strip = [{k: v for k, v in r.items() if k != "elapsed_s"} for r in records]
    assert strip == [{k: v for k, v in r.items() if k != "elapsed_s"} for r in again]


def test_target_epsilon_alone_calibrates_the_noise():
    config = validate_config(_config(mechanism="adaptive", target_epsilon=20.0, delta=1e-3,
                                     sampling="poisson"))
    plan = privacy_plan(config, 30)
    assert plan.rounds == 6 and plan.noise_multiplier > 0
    spent = epsilon(plan.noise_multiplier, 0.2, 6, 1e-3)
    assert spent <= 20.0 and spent > 0.95 * 20.0
    assert math.isclose(plan.expected_clients, 6.0)


def test_example_level_fedavg_with_no_noise_and_no_clip_is_fedavg():
    """``fedavg(..., example_privacy=(huge clip, 0))`` runs DP-SGD in the local steps that
    clips and noises nothing: the plain FedAvg round, to float rounding; with noise the
    clients' keys make it differ, the same round key the same."""
    import jax
    import jax.numpy as jnp
    import optax

    from fedax.algorithms import fedavg
    from fedax.simulation import cohort_batches

    # 90 training examples each: full batches of 10 (DP-SGD divides by the configured B,
    # local_train a partial batch by its real examples)
    train, _ = fdata.synthetic(0.5, 0.5, num_clients=8, sizes=100, seed=1)
    cohort = fdata.make_cohort(train, np.arange(4), 1, 10, np.random.default_rng(0))
    batches = cohort_batches(train, cohort)
    params = {"w": jnp.zeros((60, 10)), "b": jnp.zeros(10)}

    def loss(p, batch):
        logits = batch.x @ p["w"] + p["b"]
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch.y)
        return jnp.sum(nll * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)

    def one_round(alg, key):
        state, _ = jax.jit(alg.round)(alg.init(params, None), batches, key)
        return alg.server_params(state)["w"]

    plain = one_round(fedavg(loss, optax.sgd(0.1)), jax.random.key(0))
    private = fedavg(loss, optax.sgd(0.1), example_privacy=(1e6, 0.0))
    np.testing.assert_allclose(one_round(private, jax.random.key(0)), plain, rtol=1e-5,
                               atol=1e-7)
    noisy = fedavg(loss, optax.sgd(0.1), example_privacy=(1.0, 1.0))
    a, b = one_round(noisy, jax.random.key(3)), one_round(noisy, jax.random.key(3))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, one_round(noisy, jax.random.key(4)))
    with pytest.raises(ValueError, match="give the round a key"):
        noisy.round(noisy.init(params, None), batches, None)


def test_example_level_config_and_its_epsilon():
    from fedax.privacy import ExampleLevelLedger

    with pytest.raises(ConfigError, match="privacy.mechanism"):
        validate_config(_config(level="example", mechanism="gaussian", clip=1.0,
                                noise_multiplier=1.0))
    with pytest.raises(ConfigError, match="privacy.clip"):
        validate_config(_config(level="example", noise_multiplier=1.0))
    ledger = ExampleLevelLedger(1.1, [60, 60, 30], 10, 2, 1e-5)
    want = max(epsilon(1.1, 10 / 60, 5 * 2 * 6, 1e-5), epsilon(1.1, 10 / 30, 5 * 2 * 3, 1e-5))
    assert ledger.epsilon_after(5) == pytest.approx(want, rel=1e-12)
    assert ledger.rounds_within(ledger.epsilon_after(5), 50) == 5


@pytest.mark.parametrize("mechanism", ["gaussian", "adaptive"])
def test_a_dp_run_over_two_devices_equals_one_device(tmp_path, mechanism):
    """The cohort split over a 2-device mesh: a stateless DP aggregator (nothing to
    broadcast) and a stateful one; the same noise, so the same numbers to float rounding.
    z = 0 records epsilon as null ("no guarantee"), and the run's status stays ok."""
    records = {}
    for devices in (1, 2):
        data = _config(mechanism=mechanism, clip=1.0, noise_multiplier=0.0)
        data.update(rounds=2, execution={"devices": devices})
        summary = run_experiment(validate_config(data), tmp_path / str(devices),
                                 progress=False)
        assert summary["status"] == "ok" and summary["privacy"]["epsilon"] is None
        records[devices] = [json.loads(line)
                            for line in (tmp_path / str(devices) / "metrics.jsonl").open()]
    for one, two in zip(records[1], records[2], strict=True):
        assert one["epsilon"] is None and one["status"] == "ok"
        assert two["train_loss"] == pytest.approx(one["train_loss"], rel=1e-5)
        assert two["test_accuracy"] == pytest.approx(one["test_accuracy"], abs=2e-3)


def test_fedax_run_prints_epsilon_and_the_budget_stop(tmp_path, capsys):
    from fedax.cli.main import main

    config = tmp_path / "dp.yaml"
    data = _config(mechanism="gaussian", clip=1.0, noise_multiplier=1.0, target_epsilon=12.0,
                   delta=1e-3)
    config.write_text(yaml.safe_dump(data))
    assert main(["run", str(config), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    eps = summary["privacy"]["epsilon"]
    shown = json.loads(out[:out.index("}") + 1])
    assert shown["epsilon"] == eps and shown["status"] == "stopped_by_budget"
    assert f"privacy: epsilon = {round_up(eps, 4)} at delta = 0.001 after " \
           f"{summary['rounds_run']} round(s) (user level" in out
    assert summary["stop_reason"] in out.splitlines()


def test_learned_server_lr_under_privacy_reports_the_epsilon_of_both_releases(tmp_path):
    data = _config(mechanism="gaussian", clip=1.0, noise_multiplier=1.0, delta=1e-3)
    data.update(rounds=3, server={"lr": "learned"}, learned_lr={"clip": 0.5})
    summary = run_experiment(validate_config(data), tmp_path / "a", progress=False)
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").open()]
    # two Gaussian releases a round (update and holdout hypergradient), both at z = 1
    want = epsilon((1.0, 1.0), 6 / 30, 3, 1e-3, sampling="fixed", population=30)
    assert want > epsilon(1.0, 6 / 30, 3, 1e-3, sampling="fixed", population=30)
    assert summary["privacy"]["epsilon"] == pytest.approx(want, rel=1e-12)
    assert summary["privacy"]["releases_per_round"] == 2
    assert "hypergradient" in summary["privacy"]["epsilon_covers"][1]
    assert all(math.isfinite(r["hypergradient"]) and r["server_lr"] > 0 for r in records)
    assert "holdout_loss" not in records[-1]  # its value is not released under privacy


def test_adaptive_clipping_defaults_work_on_small_cohorts_and_bad_values_fail_at_config_time(
        tmp_path, capsys):
    from fedax.aggregators import split_noise_multiplier
    from fedax.cli.main import main

    # The shipped MNIST configs' cohort: m = 10 of 100. TFF's σ_b = m/20 = 0.5 needs z < 1.
    data = _config(mechanism="adaptive", noise_multiplier=1.0)
    data.update(num_clients=100, client_fraction=0.1)
    plan = privacy_plan(validate_config(data), 100)
    assert plan.count_stddev == 1.0  # max(m/20, z)
    assert split_noise_multiplier(1.0, plan.count_stddev) == pytest.approx(1 / 0.75 ** 0.5)
    assert plan.summary(validate_config(data), 1)["count_stddev"] == 1.0
    # where m/20 is enough, it is TFF's default unchanged
    data.update(num_clients=400, client_fraction=0.5)
    assert privacy_plan(validate_config(data), 400).count_stddev == 10.0
    # an explicit count noise too small for z: the config key, at config time (exit 2)
    with pytest.raises(ConfigError, match=r"^config key 'privacy.count_stddev': 0.4 is too"):
        validate_config(_config(mechanism="adaptive", noise_multiplier=1.0, count_stddev=0.4))
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(_config(mechanism="adaptive", noise_multiplier=1.0,
                                             count_stddev=0.4)))
    assert main(["run", str(config), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "privacy.count_stddev" in err[0]
    assert "clipped_count_stddev" not in err[0] and "ValueError" not in err[0]
    # a z calibrated to a budget is checked against it before the run starts
    calibrated = validate_config(_config(mechanism="adaptive", target_epsilon=2.0,
                                         count_stddev=0.3))
    with pytest.raises(ConfigError, match="privacy.count_stddev"):
        privacy_plan(calibrated, 30)
