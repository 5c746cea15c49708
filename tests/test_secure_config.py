"""``secure:`` in the one experiment spec: the simulator runs the secure sum's exact
arithmetic (a secure FedAvg run equals the plain run within the quantization error), DP
over a secure sum is recognised by the audit, and every combination that cannot compose
with secure aggregation is refused in one line naming its key."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_engines import CONFIG, SHORT, final_params, records

from fedax.experiments.run import run_experiment
from fedax.spec.config import ConfigError, load_config

SECURE = ["secure.bits=32"]


@pytest.mark.parametrize("sets,key,words", [
    (["robust.rule=median"], "secure", "needs each client's update"),
    (["compression.scheme=qsgd", "compression.levels=16"], "secure", "decodes each client"),
    (["privacy.mechanism=adaptive", "privacy.noise_multiplier=1.0"], "privacy.mechanism",
     "adapts from per-client"),
    (["algorithm=scaffold"], "secure", "beside the update"),
    (["server.lr=learned"], "server.lr", "not securely aggregated"),
    (["execution.mode=async"], "secure", "asynchronous buffered aggregation"),
    (["secure.threshold=9", "secure.num_shares=5"], "secure.threshold", "exceeds num_shares"),
    (["secure.threshold=3", "secure.num_shares=7"], "secure.threshold", "at most half"),
])
def test_what_does_not_compose_with_secure_is_refused(sets, key, words):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG, SECURE + sets)
    message = str(err.value)
    assert f"'{key}'" in message and words in message and "\n" not in message


def test_too_few_bits_for_the_cohort_is_refused_before_any_round(tmp_path: Path):
    config = load_config(CONFIG, SHORT + ["secure.bits=8", "secure.levels=100"])
    with pytest.raises(ConfigError, match=r"^config key 'secure.bits': a secure sum of 10 "
                                          r"clients with 8 bits wraps around.*at least 11"):
        run_experiment(config, tmp_path, progress=False, tensorboard=False)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_distributed_dp_needs_a_secure_sum():
    with pytest.raises(ConfigError, match=r"'privacy.mechanism'.*distributed DP.*add a "
                                          r"secure section"):
        load_config(CONFIG, ["privacy.mechanism=skellam", "privacy.clip=0.5",
                             "privacy.noise_multiplier=1.0"])


def test_a_secure_run_is_the_plain_run_within_the_quantization_error(tmp_path: Path):
    """One round of the shipped MNIST 2NN non-IID FedAvg config: with ``secure`` (32 bits,
    the coordinates of each client's n_k/max n_k-weighted update in [-8, 8], Δ = 8/2^22)
    the model equals the plain run's within the quantization bound (the ten clients' sums
    each within 10Δ, divided by Σ n_k/max n_k = 10 here) and the records to float
    tolerance; the record carries the step."""
    plain = records_of(tmp_path / "plain", [])
    secure = records_of(tmp_path / "secure", SECURE)
    assert [r["round"] for r in secure] == [r["round"] for r in plain]
    for a, b in zip(plain, secure, strict=True):
        assert b["secure_step"] == pytest.approx(8.0 / 2 ** 22)
        assert abs(a["test_accuracy"] - b["test_accuracy"]) <= 2e-3
        np.testing.assert_allclose(b["train_loss"], a["train_loss"], rtol=1e-6)
    p, s = final_params(tmp_path / "plain"), final_params(tmp_path / "secure")
    assert sorted(p) == sorted(s)
    differs = False
    for path in p:
        np.testing.assert_allclose(s[path], p[path], rtol=0, atol=10 * 8.0 / 2 ** 22 / 10
                                   * 1.01)
        differs |= bool(np.any(s[path] != p[path]))
    assert differs  # the secure path ran, quantized


def records_of(out: Path, sets: list[str]) -> list[dict]:
    config = load_config(CONFIG, SHORT + ["rounds=1", "checkpoint_every=1"] + sets)
    run_experiment(config, out, progress=False, tensorboard=False)
    return records(out)


@pytest.mark.parametrize("mechanism", [
    "skellam", pytest.param("discrete_gaussian", marks=pytest.mark.slow)])
def test_distributed_dp_run_accounts_its_own_mechanism(tmp_path: Path, mechanism):
    """``privacy.mechanism: skellam`` (or discrete_gaussian) with ``secure``: each client
    noises its integers; ε is distributed DP's (no amplification: above the central
    Gaussian's subsampled ε at the same z), its epsilon_covers names the mechanism."""
    import json

    from fedax.privacy import epsilon

    sets = ["secure.bits=20", "privacy.level=user", f"privacy.mechanism={mechanism}",
            "privacy.noise_multiplier=1.0", "privacy.clip=0.5"]
    config = load_config(CONFIG, SHORT + ["rounds=1", "checkpoint_every=1"] + sets)
    run_experiment(config, tmp_path, progress=False, tensorboard=False)
    record = records(tmp_path)[-1]
    assert record["noised_clients"] == 10 and record["modular_wrap_risk"] < 1e-3
    privacy = json.loads((tmp_path / "summary.json").read_text())["privacy"]
    assert mechanism in privacy["accounting"] and "without subsampling" in privacy["accounting"]
    central = epsilon(1.0, 0.1, 1, 1e-5)
    assert privacy["epsilon"] > central
    assert any(mechanism in line for line in privacy["epsilon_covers"])
