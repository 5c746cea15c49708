"""Attacks (``fedax.attacks``) against NumPy formulas (docs/references.md, robust aggregation and
attacks): attackers chosen by seed, the update attacks on hand-made client-placed updates (padding
clients, whose id may equal an attacker's, never attack; honest clients are never touched), Baruch
et al.'s z_max, the data attacks, and attacked FedAvg rounds (plugged in where the pieces say, and
deterministic in the key). Then the config sections and a config run."""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax import aggregators as agg
from fedax import attacks
from fedax.algorithms import CohortBatches, compose, fedavg
from fedax.client import Batches
from fedax.spec.config import ConfigError, validate_config

NUM = 20  # population
IDS = np.array([3, 7, 11, 0, 15, 2, 9, 3], np.int32)  # the last is padding with id 3
WEIGHTS = np.array([5, 3, 4, 2, 6, 1, 2, 0], np.float32)
ATTACKERS = np.array([3, 11, 15])


def updates(seed=0, d=4):
    rng = np.random.default_rng(seed)
    u = {"a": rng.normal(size=(len(IDS), d)).astype(np.float32),
         "b": rng.normal(size=(len(IDS), 2)).astype(np.float32)}
    u["a"][-1], u["b"][-1] = 0.0, 0.0  # padding: zeros
    return u


def flat(u):
    return np.concatenate([u["a"], u["b"]], axis=1).astype(np.float64)


def attack(adversary, u, key=0):
    out, w = jax.jit(adversary)(jax.tree.map(jnp.asarray, u), jnp.asarray(WEIGHTS),
                                jnp.asarray(IDS), jax.random.key(key))
    np.testing.assert_array_equal(np.asarray(w), WEIGHTS)  # attackers keep their weights
    return flat(jax.tree.map(np.asarray, out))


IS_ATTACKER = np.isin(IDS, ATTACKERS) & (WEIGHTS > 0)  # clients 0, 2, 4
HONEST = ~np.isin(IDS, ATTACKERS) & (WEIGHTS > 0)


def check_rest_untouched(got, x):
    np.testing.assert_array_equal(got[~IS_ATTACKER], x[~IS_ATTACKER].astype(np.float32))


def test_attackers_are_chosen_by_seed():
    a = attacks.choose_attackers(100, 0.2, seed=3)
    np.testing.assert_array_equal(a, attacks.choose_attackers(100, 0.2, seed=3))
    assert len(a) == 20 and np.all(np.diff(a) > 0) and a.min() >= 0 and a.max() < 100
    assert not np.array_equal(a, attacks.choose_attackers(100, 0.2, seed=4))
    assert len(attacks.choose_attackers(10, 0.15, 0)) == 2  # round(1.5) = 2
    assert len(attacks.choose_attackers(10, 0.0, 0)) == 0
    np.testing.assert_array_equal(
        a, np.sort(np.random.default_rng([3, 0x61747461]).choice(100, 20, replace=False)))
    # not the run's first cohort for the same seed (the draw a cohort sampler makes)
    from fedax.data import sample_clients

    for seed in range(5):
        cohort = np.sort(sample_clients(seed, 50, 0.2))
        assert not np.array_equal(attacks.choose_attackers(50, 0.2, seed), cohort)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        attacks.choose_attackers(10, 1.0, 0)


def test_alie_z_is_baruchs_formula():
    for n, f, want in ((50, 12, 0.583), (20, 4, 0.385), (10, 2, 0.253)):
        s = n // 2 + 1 - f
        ref = statistics.NormalDist().inv_cdf((n - s) / n)
        assert abs(float(attacks.alie_z(n, f)) - ref) < 1e-5
        assert abs(ref - want) < 1e-3  # the formula's values, worked out by hand


def test_omniscient_attacks_against_numpy():
    u = updates()
    x = flat(u)
    mu = x[HONEST].mean(0)
    sigma = x[HONEST].std(0, ddof=1)
    n, f = int((WEIGHTS > 0).sum()), int(IS_ATTACKER.sum())
    z = statistics.NormalDist().inv_cdf((n - (n // 2 + 1 - f)) / n)
    cases = {
        "sign_flip": (attacks.sign_flip(ATTACKERS, NUM), -mu),
        "ipm": (attacks.ipm(ATTACKERS, NUM, epsilon=0.5), -0.5 * mu),
        "alie": (attacks.alie(ATTACKERS, NUM), mu - z * sigma),
        "alie_fixed_z": (attacks.alie(ATTACKERS, NUM, z=1.5), mu - 1.5 * sigma),
    }
    for name, (adversary, want) in cases.items():
        got = attack(adversary, u)
        check_rest_untouched(got, x)
        for row in np.flatnonzero(IS_ATTACKER):
            np.testing.assert_allclose(got[row], want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_own_update_attacks_against_numpy():
    u = updates(1)
    x = flat(u)
    real = int((WEIGHTS > 0).sum())
    got = attack(attacks.scaled(ATTACKERS, NUM), u)  # λ = clients in the round (7)
    check_rest_untouched(got, x)
    np.testing.assert_allclose(got[IS_ATTACKER], real * x[IS_ATTACKER], rtol=1e-6)
    got = attack(attacks.scaled(ATTACKERS, NUM, factor=3.0, project=0.5), u)
    norms = np.linalg.norm(x[IS_ATTACKER], axis=1, keepdims=True)
    np.testing.assert_allclose(got[IS_ATTACKER],
                               3.0 * x[IS_ATTACKER] * np.minimum(1, 0.5 / norms), rtol=1e-5)
    got = attack(attacks.sign_flip(ATTACKERS, NUM, mode="own"), u)
    np.testing.assert_allclose(got[IS_ATTACKER], -x[IS_ATTACKER], rtol=1e-6)
    check_rest_untouched(got, x)


def test_gaussian_attack_is_seeded_and_distributed_as_stated():
    u = updates(2, d=4000)
    x = flat(u)
    adversary = attacks.gaussian(ATTACKERS, NUM, stddev=2.0)
    one, again, other = attack(adversary, u, 5), attack(adversary, u, 5), attack(adversary, u, 6)
    np.testing.assert_array_equal(one, again)
    assert not np.array_equal(one[IS_ATTACKER], other[IS_ATTACKER])
    check_rest_untouched(one, x)
    noise = one[IS_ATTACKER]
    assert abs(noise.mean()) < 0.05 and abs(noise.std() - 2.0) < 0.05
    assert not np.allclose(noise[0], noise[1])  # each attacker its own draw


def test_data_attacks():
    labels = np.arange(40) % 10
    parts = [np.arange(0, 10), np.arange(10, 25), np.arange(25, 40)]
    flipped = attacks.flip_labels(labels, parts, np.array([1]), 10)
    np.testing.assert_array_equal(flipped[10:25], 9 - labels[10:25])
    np.testing.assert_array_equal(flipped[:10], labels[:10])
    np.testing.assert_array_equal(flipped[25:], labels[25:])
    x = np.random.default_rng(0).random((40, 8, 8, 1)).astype(np.float32) * 0.5
    xp, yp = attacks.poison_backdoor(x, labels, parts, np.array([0, 2]), target=7,
                                     poison_fraction=0.4, seed=1, size=2)
    changed = np.flatnonzero(np.any(xp != x, axis=(1, 2, 3)))
    assert len(changed) == 4 + 6  # round(0.4 * 10) + round(0.4 * 15)
    assert set(changed) <= set(parts[0]) | set(parts[2])
    np.testing.assert_array_equal(yp[changed], 7)
    assert np.all(xp[changed][:, 5:7, 5:7] == 1.0)  # the trigger square
    untouched = np.setdiff1d(np.arange(40), changed)
    np.testing.assert_array_equal(yp[untouched], labels[untouched])
    xs, ys = attacks.backdoor_test_set(x, labels, target=7, size=2)
    assert len(xs) == 36 and np.all(ys == 7) and np.all(xs[:, 5:7, 5:7] == 1.0)
    np.testing.assert_array_equal(xs[:, :5], x[labels != 7][:, :5])


# ---- attacked rounds -----------------------------------------------------------------


def loss_fn(params, batch: Batches):
    residual = batch.x @ params["w"] - batch.y
    return 0.5 * jnp.sum(batch.mask * residual ** 2) / jnp.maximum(jnp.sum(batch.mask), 1.0)


def small_cohort():
    rng = np.random.default_rng(0)
    c, s, b, d = len(IDS), 2, 3, 4
    mask = np.ones((c, s, b), np.float32)
    mask[-1] = 0.0  # padding: no steps, n_k = 0
    batches = Batches(jnp.asarray(rng.normal(size=(c, s, b, d)).astype(np.float32)),
                      jnp.asarray(rng.normal(size=(c, s, b)).astype(np.float32)),
                      jnp.asarray(mask))
    return CohortBatches(batches, jnp.asarray(mask.sum(axis=(1, 2))), jnp.asarray(IDS))


def one_round(alg, key=0):
    params = {"w": jnp.ones(4) * 0.1}
    state = alg.init(params, jax.random.key(0))
    state, metrics = jax.jit(alg.round)(state, small_cohort(), jax.random.key(key))
    return np.asarray(alg.server_params(state)["w"]), metrics


def test_attack_runs_where_the_pieces_say_and_is_deterministic():
    clean = fedavg(loss_fn, optax.sgd(0.1))
    w0 = 0.1 * np.ones(4)
    everyone = np.arange(NUM)  # every real client attacks: sign of its own update flipped
    flipped, _ = one_round(attacks.attacked(clean, attacks.sign_flip(everyone, NUM, "own")))
    base, _ = one_round(clean)
    np.testing.assert_allclose(flipped - w0, -(base - w0), rtol=1e-5)
    noisy = attacks.attacked(fedavg(loss_fn, optax.sgd(0.1), aggregator=agg.median()),
                             attacks.gaussian(ATTACKERS, NUM, stddev=1.0))
    a, _ = one_round(noisy, key=3)
    b, _ = one_round(noisy, key=3)
    c, _ = one_round(noisy, key=4)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert attacks.attacked(clean, None) is clean
    with pytest.raises(ValueError, match="already attacked"):
        attacks.attacked(noisy, attacks.ipm(ATTACKERS, NUM))


def honest_updates(alg, params):
    """Each cohort client's FedAvg update Δ_k = w_t − w_k before any attack, from the
    algorithm's own client update on ``small_cohort()`` (the inputs the round sees)."""
    pieces = alg.pieces
    payload = pieces.payload(pieces.server_init(params))
    cohort = small_cohort()
    message = jax.jit(jax.vmap(lambda b, n: pieces.client_update(payload, None, b, n)))(
        cohort.batches, cohort.num_examples)
    return np.asarray(message.update["w"], np.float64)


def np_krum_selection(x, f, m):
    """Flower's Krum over the rows of x: the m lowest sums of the max(1, n − f − 2)
    smallest squared distances to the others (ties: the lower index)."""
    n = len(x)
    d = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    q = max(1, n - f - 2)
    scores = np.array([np.sort(np.delete(d[i], i))[:q].sum() for i in range(n)])
    return np.argsort(scores, kind="stable")[:m]


@pytest.mark.parametrize("m", [1, 3])
def test_an_attacked_round_reports_its_attackers_and_krums_choice(m):
    """Sign flipping (−μ, μ the honest clients' mean) against Multi-Krum(f=1, m) on the
    small cohort: ``attackers_in_cohort`` is the attacker ids among the real clients (the
    padding client's id 3 is an attacker's: not counted), ``krum_discarded`` r − m and
    ``attackers_selected`` the attackers in the selection NumPy's Krum makes from the
    same updates, whose weighted mean is the server's step."""
    params = {"w": jnp.ones(4) * 0.1}
    clean = fedavg(loss_fn, optax.sgd(0.1), aggregator=agg.multi_krum(1, m))
    adversary = attacks.sign_flip(ATTACKERS, NUM)
    np.testing.assert_array_equal(adversary.attackers, np.sort(ATTACKERS))
    w, metrics = one_round(attacks.attacked(clean, adversary))
    x = honest_updates(clean, params)
    real = np.asarray(small_cohort().num_examples) > 0
    x[IS_ATTACKER] = -x[~np.isin(IDS, ATTACKERS) & real].mean(0)
    chosen = np_krum_selection(x[real], 1, m)
    n = np.asarray(small_cohort().num_examples)[real][chosen]
    np.testing.assert_allclose(w, 0.1 - (n[:, None] * x[real][chosen]).sum(0) / n.sum(),
                               rtol=1e-5, atol=1e-6)
    assert int(metrics["attackers_in_cohort"]) == int(np.isin(IDS[real], ATTACKERS).sum()) == 3
    assert int(metrics["krum_discarded"]) == int(real.sum()) - m
    assert int(metrics["attackers_selected"]) == int(IS_ATTACKER[real][chosen].sum())
    assert int(metrics["attackers_selected"]) >= 1  # three equal vectors: Krum's blind spot
    # the flags change no number: the same round with the bare adversary
    bare = compose(clean.pieces, adversary=adversary)
    w_bare, metrics_bare = one_round(bare)
    np.testing.assert_array_equal(w, w_bare)
    assert set(metrics) - set(metrics_bare) == {"attackers_in_cohort", "attackers_selected"}


def test_attacker_counts_for_a_data_attack_a_rejected_attacker_and_an_anonymous_one():
    """A data-level attack (no adversary, ``attackers=``) under the trimmed mean: the same
    model as the clean round, 3 attackers counted and ⌊0.2·7⌋ = 1 value cut per end. An
    attacker whose update is not finite is rejected, so not counted among the accepted
    (one of the 3). An adversary that does not say who attacks reports no count."""
    clean = fedavg(loss_fn, optax.sgd(0.1), aggregator=agg.trimmed_mean(0.2))
    flagged = attacks.attacked(clean, None, attackers=ATTACKERS)
    w, metrics = one_round(flagged)
    np.testing.assert_array_equal(w, one_round(clean)[0])
    assert int(metrics["attackers_in_cohort"]) == 3
    assert int(metrics["trimmed_per_end"]) == 1
    mean = fedavg(loss_fn, optax.sgd(0.1))
    broken = attacks.scaled(ATTACKERS[:1], NUM, factor=np.inf)  # id 3 sends inf
    _, metrics = one_round(attacks.attacked(mean, broken, attackers=ATTACKERS))
    assert int(metrics["rejected_clients"]) == 1
    assert int(metrics["attackers_in_cohort"]) == 2
    _, metrics = one_round(attacks.attacked(mean, lambda u, w, i, k: (u, w)))
    assert "attackers_in_cohort" not in metrics


# ---- config ----------------------------------------------------------------------------

BASE = dict(rounds=2, dataset="synthetic", num_clients=12, model="logistic",
            algorithm="fedavg", client_fraction=0.5, local_epochs=1, batch_size=10,
            client_lr=0.05, execution={"devices": 1, "strategy": "vmap"})


@pytest.mark.parametrize("extra,match", [
    ({"robust": {"rule": "trimmed_mean"}}, "'robust.beta': rule 'trimmed_mean' needs beta"),
    ({"robust": {"rule": "median", "keep": 2}}, "'robust.keep': applies to rule"),
    ({"robust": {"rule": "mode"}}, "'robust.rule': must be one of 'median'"),
    ({"robust": {"rule": "median"}, "privacy": {"mechanism": "gaussian", "clip": 1.0,
                                                 "noise_multiplier": 1.0}},
     "'robust.rule': rule 'median' cannot carry DP noise: noise calibrated to the clip needs "
     "a sum"),
    ({"robust": {"rule": "norm_bounding", "norm_bound": 1.0},
      "privacy": {"mechanism": "gaussian", "clip": 1.0, "noise_multiplier": 1.0}},
     "already bounds"),
    ({"attack": {"kind": "alie", "fraction": 0.2, "epsilon": 1.0}},
     "'attack.epsilon': applies to kind 'ipm' only"),
    ({"attack": {"kind": "ipm", "fraction": 1.0}}, "'attack.fraction'"),
    ({"attack": {"kind": "backdoor", "fraction": 0.1}}, "needs an image data set"),
])
def test_config_errors_are_one_line_naming_the_key(extra, match):
    with pytest.raises(ConfigError, match=match) as err:
        validate_config({**BASE, **extra})
    assert "\n" not in str(err.value)


def test_a_config_run_with_an_attack_and_a_robust_rule(tmp_path):
    from fedax.experiments.run import run_experiment

    config = validate_config({**BASE, "robust": {"rule": "trimmed_mean", "beta": 0.2},
                              "attack": {"kind": "label_flip", "fraction": 0.25}})
    one = run_experiment(config, tmp_path / "a", progress=False, tensorboard=False)
    assert one["attack"]["num_attackers"] == 3
    np.testing.assert_array_equal(one["attack"]["attackers"],
                                  attacks.choose_attackers(12, 0.25, 0))
    assert one["config"]["robust"]["rule"] == "trimmed_mean"
    assert 0 <= one["final_test_accuracy"] <= 1


def test_an_attacked_robust_run_resumes_exactly(tmp_path):
    """A keyed attack (Gaussian updates, drawn from the round key) against a robust rule:
    resumed from its round-2 checkpoint, the run repeats rounds 3-4 exactly."""
    import json

    from fedax.experiments.run import run_experiment

    config = validate_config({**BASE, "rounds": 4, "checkpoint_every": 2,
                              "robust": {"rule": "trimmed_mean", "beta": 0.2},
                              "attack": {"kind": "gaussian", "fraction": 0.25,
                                         "stddev": 1.0}})

    def records(out):
        return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"}
                for line in (out / "metrics.jsonl").read_text().splitlines()]

    full = run_experiment(config, tmp_path / "full", progress=False, tensorboard=False)
    run_experiment(config, tmp_path / "cut", progress=False, tensorboard=False)
    (tmp_path / "cut" / "checkpoints" / "ckpt_4.msgpack").unlink()  # as if killed at round 3
    resumed = run_experiment(config, tmp_path / "cut", progress=False, resume=True,
                             tensorboard=False)
    assert resumed["resumed_from_round"] == 2
    assert records(tmp_path / "cut") == records(tmp_path / "full")
    assert len(records(tmp_path / "full")) == 4
    # the summary's total is over every round: unknown to a run resumed halfway
    assert full["attack"]["attackers_in_cohort_total"] == sum(
        r["attackers_in_cohort"] for r in records(tmp_path / "full"))
    assert resumed["attack"]["attackers_in_cohort_total"] is None
