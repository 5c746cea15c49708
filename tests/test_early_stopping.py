"""Early stopping of local training by the EB criterion (fedax.client.early_stopping) against
a NumPy reference: the criterion on hand-made per-example gradients, the stopping step of a
reference Python loop, the algorithms' rounds and metrics, the config, and derivatives of a
stopped round (stopping step held fixed) against finite differences."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import TINY_CONFIG

from fedax import federated as fed
from fedax.algorithms import ALGORITHMS, CohortBatches, fedavg, fednova, fedprox, make, scaffold
from fedax.cli.main import main
from fedax.client import (
    Batches,
    EBStopping,
    eb_statistics,
    eb_stopping,
    local_train,
    steps_strategy,
)
from fedax.spec.config import ConfigError, config_to_dict, validate_config

D, K = 4, 3  # features, classes


def loss_fn(params, batch):
    logits = batch.x @ params["w"] + params["b"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch.y[:, None], axis=1)[:, 0]
    return jnp.sum(nll * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)


# ---- NumPy reference ----------------------------------------------------------------------


def np_eb(grads, mask, calibrated=False):
    """1 − (B/D) Σ_k g_k²/Σ̂_k over the coordinates whose variance exceeds (1e-4 g_k)²
    (float64, two-pass variance); (value, defined, informative)."""
    g = np.asarray(grads, np.float64)[np.asarray(mask) > 0]
    b = len(g)
    if b < (4 if calibrated else 2):
        return None, False, None
    var, mean = g.var(0, ddof=1), g.mean(0)
    keep = var > (1e-4 * mean) ** 2
    if not keep.any():
        return 1.0, True, 0
    ratio = mean[keep] ** 2 / var[keep]
    scale = b / keep.sum() * ((b - 3) / (b - 1) if calibrated else 1.0)
    return 1.0 - scale * ratio.sum(), True, int(keep.sum())


def np_example_grads(w, b, x, y):
    """Per-example gradients of the softmax regression, flattened [w, b] per row."""
    z = x @ w + b
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return np.concatenate([(x[:, :, None] * p[:, None, :]).reshape(len(y), -1), p], 1)


def np_local_train(w, b, x, y, m, lr, rule):
    """The steps of one client with the rule: check before steps m, 2m, ... (a defined
    batch, the client still running), stop when the smoothed criterion exceeds the
    threshold; returns (w, b, steps taken, stopped)."""
    stopped, checks, crit, taken = False, 0, 0.0, 0
    for j in range(len(m)):
        real = m[j] > 0
        if not real.any():
            continue
        if j > 0 and j % rule.every == 0 and not stopped:
            value, defined, _ = np_eb(np_example_grads(w, b, x[j][real], y[j][real]),
                                      np.ones(real.sum()), rule.calibrated)
            if defined:
                crit = value if checks == 0 else (
                    rule.smoothing * crit + (1 - rule.smoothing) * value)
                checks += 1
                stopped = crit > rule.threshold
        if stopped:
            continue
        g = np_example_grads(w, b, x[j][real], y[j][real]).mean(0)
        w, b = w - lr * g[:-K].reshape(D, K), b - lr * g[-K:]
        taken += 1
    return w, b, taken, stopped


def monitor(w, b, x, y, m, lr, rule):
    """The smoothed criterion at every check of a client that never stops."""
    values, checks, crit = [], 0, 0.0
    for j in range(len(m)):
        real = m[j] > 0
        if real.any() and j > 0 and j % rule.every == 0:
            value, defined, _ = np_eb(np_example_grads(w, b, x[j][real], y[j][real]),
                                      np.ones(real.sum()), rule.calibrated)
            if defined:
                crit = value if checks == 0 else rule.smoothing * crit + (
                    1 - rule.smoothing) * value
                checks += 1
                values.append(crit)
        if real.any():
            g = np_example_grads(w, b, x[j][real], y[j][real]).mean(0)
            w, b = w - lr * g[:-K].reshape(D, K), b - lr * g[-K:]
    return values


# ---- the criterion ------------------------------------------------------------------------


def test_criterion_matches_the_reference_with_zero_variance_and_masked_rows():
    rng = np.random.default_rng(0)
    B = 6
    a = rng.normal(size=(B, 3, 2))
    a[:, 0, 0] = 0.0  # every example 0 (a blank input): left out
    a[:, 1, 1] = 2.5  # every example the same non-zero value: left out
    bias = rng.normal(size=(B, 4))
    bias[:, 2] = -1.0
    a[:, 2, 0] = 3.0 * (1 + 1e-6 * rng.normal(size=B))  # a spread of float32 rounding: out
    a[:, 2, 1] = 3.0 * (1 + 1e-2 * rng.normal(size=B))  # a small real spread: in
    mask = np.array([0, 1, 1, 1, 0, 1], np.float32)  # padding first and inside
    a[0], bias[4] = 1e30, np.nan  # garbage in padding rows counts for nothing
    for calibrated in (False, True):
        got = eb_statistics({"a": jnp.asarray(a, jnp.float32),
                             "b": jnp.asarray(bias, jnp.float32)}, jnp.asarray(mask),
                            calibrated)
        value, defined, informative = np_eb(np.concatenate([a.reshape(B, -1), bias], 1), mask,
                                            calibrated)
        assert bool(got.defined) == defined
        assert int(got.informative) == informative == 3 + 3  # three of a's six, one of b's
        np.testing.assert_allclose(float(got.value), value, rtol=1e-5)


def test_a_pure_noise_batch_is_near_zero_and_a_signal_batch_far_below():
    rng = np.random.default_rng(1)
    noise = rng.normal(size=(200, 500))
    value, _, _ = np_eb(noise, np.ones(200))
    got = eb_statistics(jnp.asarray(noise, jnp.float32), jnp.ones(200))
    np.testing.assert_allclose(float(got.value), value, rtol=1e-4)
    assert abs(float(got.value)) < 0.2
    signal = eb_statistics(jnp.asarray(noise + 1.0, jnp.float32), jnp.ones(200))
    assert float(signal.value) < -100


def test_identical_examples_give_one_and_small_batches_no_decision():
    row = np.array([0.1, -0.3, 7.0, 0.0], np.float32)  # 0.1 has no exact binary mean
    same = eb_statistics(jnp.asarray(np.tile(row, (7, 1))), jnp.ones(7))
    assert (float(same.value), bool(same.defined), int(same.informative)) == (1.0, True, 0)
    one = eb_statistics(jnp.asarray(np.tile(row, (3, 1))), jnp.array([0.0, 1.0, 0.0]))
    assert not bool(one.defined)
    three = eb_statistics(jnp.asarray(np.eye(3, 4)), jnp.ones(3), calibrated=True)
    assert not bool(three.defined)


def test_rule_arguments_are_checked():
    assert eb_stopping(3, -0.5, 0.9, True) == EBStopping(3, -0.5, 0.9, True)
    for bad in ({"every": 0}, {"every": 1.5}, {"threshold": 1.5}, {"threshold": float("nan")},
                {"smoothing": 1.0}, {"smoothing": -0.1}, {"calibrated": 1}):
        with pytest.raises(ValueError, match="EB stopping needs"):
            eb_stopping(**bad)


# ---- the loop -----------------------------------------------------------------------------


def make_client(rng, n, steps, batch, epochs=3):
    """One client's [S, B] batches: ``epochs`` passes over ``n`` examples in batches of
    ``batch`` (the last of each partial), the remaining steps padding."""
    x = np.zeros((steps, batch, D), np.float32)
    y = np.zeros((steps, batch), np.int32)
    m = np.zeros((steps, batch), np.float32)
    data_x = rng.normal(size=(n, D)).astype(np.float32)
    data_y = rng.integers(0, K, n)
    cuts = [np.arange(s, min(s + batch, n)) for _ in range(epochs) for s in range(0, n, batch)]
    for j, idx in enumerate(cuts):
        x[j, :len(idx)], y[j, :len(idx)], m[j, :len(idx)] = data_x[idx], data_y[idx], 1.0
    return x, y, m


@pytest.fixture(scope="module")
def clients():
    rng = np.random.default_rng(3)
    steps, batch = 12, 6
    parts = [make_client(rng, n, steps, batch) for n in (20, 13, 9)]
    x, y, m = (np.stack(p) for p in zip(*parts, strict=True))  # 12, 9 and 6 real steps
    w0 = (rng.normal(size=(D, K)) * 0.3).astype(np.float32)
    return Batches(x, y, m), {"w": jnp.asarray(w0), "b": jnp.zeros(K)}


def chosen_threshold(values):
    """A threshold whose first crossing is a later check, far from every value."""
    for t in range(1, len(values)):
        if values[t] > max(values[:t]) + 0.02:
            return (max(values[:t]) + values[t]) / 2, t
    return None


def test_the_compiled_loop_stops_where_the_reference_does(clients):
    """Per rule and client, a threshold that the reference crosses at a later check (else
    -0.2); the clients run vmapped, their thresholds traced (one program per rule)."""
    batches, params = clients
    lr = 0.8
    stopped_inside = 0
    for every, smoothing, calibrated in ((1, 0.0, False), (3, 0.0, False), (2, 0.5, True)):
        rule = EBStopping(every, 1.0, smoothing, calibrated)
        thresholds = []
        for k in range(3):
            pick = chosen_threshold(monitor(np.float64(params["w"]), np.zeros(K), batches.x[k],
                                            batches.y[k], batches.mask[k], lr, rule))
            thresholds.append(-0.2 if pick is None else float(pick[0]))
        for strategy in ("scan", "unroll") if every == 3 else ("scan",):
            with steps_strategy(strategy):
                got = jax.jit(jax.vmap(lambda b, t, rule=rule: local_train(
                    loss_fn, params, b, optax.sgd(lr), stopping=rule._replace(threshold=t))))(
                        batches, jnp.asarray(thresholds, jnp.float32))
            for k in range(3):
                one = jax.tree.map(lambda a, k=k: a[k], batches)
                w, b, taken, stopped = np_local_train(
                    np.float64(params["w"]), np.zeros(K), one.x, one.y, one.mask, lr,
                    rule._replace(threshold=thresholds[k]))
                assert int(got.num_steps[k]) == taken, (k, rule, strategy)
                assert bool(got.stopping.stopped[k]) == stopped
                np.testing.assert_allclose(got.params["w"][k], w, rtol=2e-4, atol=2e-5)
                np.testing.assert_allclose(got.params["b"][k], b, rtol=2e-4, atol=2e-5)
                stopped_inside += 0 < taken < int(one.mask.any(-1).sum())
    assert stopped_inside >= 6  # the test is about real stops, not only full runs


# ---- rounds ---------------------------------------------------------------------------------


def cohort_of(batches):
    n = np.asarray(batches.mask).sum((1, 2)) / 3  # any positive n_k
    return CohortBatches(batches, n.astype(np.float32), np.arange(len(n), dtype=np.int32))


@pytest.mark.parametrize("build", ["fedavg", "fedprox", "scaffold", "fednova"])
def test_a_round_whose_criterion_never_fires_is_the_plain_round_bit_for_bit(clients, build):
    batches, params = clients
    cohort = cohort_of(batches)

    def algorithm(stopping):
        return {"fedavg": lambda: fedavg(loss_fn, optax.sgd(0.5), local_stopping=stopping),
                "fedprox": lambda: fedprox(loss_fn, optax.sgd(0.5), 0.1,
                                           local_stopping=stopping),
                "scaffold": lambda: scaffold(loss_fn, 0.5, 3, local_stopping=stopping),
                "fednova": lambda: fednova(loss_fn, 0.5, local_stopping=stopping)}[build]()

    def two_rounds(alg):
        state, round_fn = alg.init(params, None), jax.jit(alg.round)
        for t in range(2):
            state, metrics = round_fn(state, cohort, jax.random.key(t))
        return state, metrics

    # checked every step but threshold 1 (the criterion never exceeds 1), and never checked;
    # clients vmapped, and one after another (real branches: a stopped client's steps skip)
    rules = [EBStopping(1, 1.0, 0.5)] + ([EBStopping(every=100)] if build == "fedavg" else [])
    for strategy in ("vmap", "sequential") if build == "fedavg" else ("vmap",):
        with fed.map_strategy(strategy):
            plain, plain_metrics = two_rounds(algorithm(None))
            for rule in rules:
                state, metrics = two_rounds(algorithm(rule))
                for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(state), strict=True):
                    np.testing.assert_array_equal(a, b)
                assert metrics["local_steps"] == plain_metrics["local_steps"]
                assert metrics["stopped_early"] == 0.0
                np.testing.assert_array_equal(metrics["local_steps_per_client"],
                                              np.asarray(batches.mask).any(-1).sum(-1))


def test_a_client_of_one_repeated_example_stops_after_its_first_check(clients):
    batches, params = clients
    x, y, m = (np.array(a) for a in batches)
    x[2], y[2] = x[2, 0, 0], y[2, 0, 0]  # every example of client 2 is its first one
    cohort = cohort_of(Batches(x, y, m))
    for every in (1, 4):
        alg = fedavg(loss_fn, optax.sgd(0.5), local_stopping=EBStopping(every=every))
        _, metrics = jax.jit(alg.round)(alg.init(params, None), cohort, jax.random.key(0))
        steps = metrics["local_steps_per_client"]
        assert steps[2] == every and steps[0] > every and steps[1] > every
        full = np.asarray(m).any(-1).sum(-1)
        n = cohort.num_examples
        np.testing.assert_allclose(metrics["stopped_early"], (n * (steps < full)).sum() / n.sum(),
                                   rtol=1e-6)
        assert (metrics["local_steps_min"], metrics["local_steps_max"]) == (every, steps.max())
        assert metrics["local_steps_total"] == steps.sum()


def test_scaffold_option_two_divides_by_the_steps_taken(clients):
    batches, params = clients
    cohort = cohort_of(batches)
    lr = 0.5
    alg = scaffold(loss_fn, lr, 3, local_stopping=EBStopping(1, -0.5))
    state, metrics = jax.jit(alg.round)(alg.init(params, None), cohort, jax.random.key(0))
    steps = metrics["local_steps_per_client"]
    full = np.asarray(batches.mask).any(-1).sum(-1)
    assert (steps < full).any()
    for k in range(3):
        one = jax.tree.map(lambda a, k=k: a[k], batches)
        y = local_train(loss_fn, params, one, optax.sgd(lr), stopping=EBStopping(1, -0.5))
        assert y.num_steps == steps[k]
        # first round: c = c_i = 0, so c_i⁺ = (x − y_i) / (K_i η_l)
        expect = (params["w"] - y.params["w"]) / (steps[k] * lr)
        np.testing.assert_allclose(state.clients["w"][k], expect, rtol=1e-5, atol=1e-7)


def test_the_registry_and_the_builders_refuse_what_does_not_compose():
    assert {n for n, s in ALGORITHMS.items() if not s.local_stopping} == {"fedsgd"}
    with pytest.raises(ValueError, match="no local training to stop early"):
        make("fedsgd", loss_fn, 3, 0.1, local_stopping=EBStopping())
    with pytest.raises(ValueError, match="does not compose with example_privacy"):
        fedavg(loss_fn, optax.sgd(0.1), example_privacy=(1.0, 1.0), local_stopping=EBStopping())
    with pytest.raises(ValueError, match="must be None or a fedax.client.EBStopping"):
        fedavg(loss_fn, optax.sgd(0.1), local_stopping="eb")
    assert make("fedyogi", loss_fn, 3, 0.1, local_stopping=EBStopping()).pieces.spread == (
        "local_steps",)


# ---- derivatives ----------------------------------------------------------------------------


def test_hypergradient_with_the_stopping_step_held_fixed(clients):
    """d/d client_lr of the loss after an EB-stopped round: forward and reverse mode agree
    with each other, with central differences (no client's stopping step moves within ±h),
    and with the plain round on the batches cut at the steps the stopped round took."""
    batches, params = clients
    cohort = cohort_of(batches)
    x = jnp.asarray(batches.x).reshape(-1, D)
    pooled = Batches(x, jnp.asarray(batches.y).reshape(-1), jnp.ones(len(x)))

    def after_round(lr, cohort, stopping):
        alg = fedavg(loss_fn, optax.sgd(lr), local_stopping=stopping)
        state, metrics = alg.round(alg.init(params, None), cohort, None)
        return loss_fn(alg.server_params(state), pooled), metrics

    stopped = jax.jit(lambda v: after_round(v, cohort, EBStopping(1, -0.5)))
    lr, h = 0.6, 1e-3
    (down, m0), (_, m1), (up, m2) = (stopped(v) for v in (lr - h, lr, lr + h))
    s0, steps, s2 = (m["local_steps_per_client"] for m in (m0, m1, m2))
    full = np.asarray(batches.mask).any(-1).sum(-1)
    assert (steps < full).any()  # a client stopped early
    np.testing.assert_array_equal(s0, steps)
    np.testing.assert_array_equal(s2, steps)

    def f(v):
        return stopped(v)[0]

    forward = jax.jit(lambda v: jax.jvp(f, (v,), (1.0,))[1])(lr)
    reverse = jax.jit(jax.grad(f))(lr)
    np.testing.assert_allclose(forward, reverse, rtol=1e-5)
    np.testing.assert_allclose(forward, (up - down) / (2 * h), rtol=2e-2)
    # the same derivative as the plain round whose steps after each stop are padding
    cut = np.array(batches.mask)
    for k, s in enumerate(np.asarray(steps).astype(int)):
        cut[k, np.flatnonzero(cut[k].any(-1))[s:]] = 0.0
    plain = cohort._replace(batches=batches._replace(mask=cut))
    fixed = jax.jit(jax.grad(lambda v: after_round(v, plain, None)[0]))(lr)
    np.testing.assert_allclose(reverse, fixed, rtol=1e-5)


# ---- config ---------------------------------------------------------------------------------

SYNTHETIC = {"rounds": 2, "dataset": "synthetic", "num_clients": 12, "model": "logistic",
             "algorithm": "fedavg", "client_fraction": 0.5, "local_epochs": 1,
             "batch_size": 10, "client_lr": 0.05}


def test_config_builds_the_rule_and_round_trips():
    config = validate_config({**SYNTHETIC, "client": {"stopping": "eb", "stopping_every": 5,
                                                      "stopping_smoothing": 0.9}})
    assert config.client.stopping_rule() == EBStopping(5, 0.0, 0.9, False)
    assert config_to_dict(config)["client"] == {"stopping": "eb", "stopping_every": 5,
                                                "stopping_smoothing": 0.9}
    assert validate_config(config_to_dict(config)) == config
    plain = validate_config(SYNTHETIC)
    assert plain.client.stopping_rule() is None and "client" not in config_to_dict(plain)


@pytest.mark.parametrize("change, message", [
    ({"client": {"stopping": "patience"}}, "config key 'client.stopping': must be one of"),
    ({"client": {"stopping": "eb", "stopping_every": 0}}, "'client.stopping_every': must be"),
    ({"client": {"stopping": "eb", "stopping_threshold": 1.5}}, "'client.stopping_threshold'"),
    ({"client": {"stopping": "eb", "stopping_smoothing": 1}}, "'client.stopping_smoothing'"),
    ({"client": {"stopping_every": 3}}, "'client.stopping_every': applies with client."
                                         "stopping: eb only"),
    ({"client": {"stoping": "eb"}}, "unknown config key 'client.stoping' (did you mean "
                                    "'client.stopping'?)"),
    ({"algorithm": "fedsgd", "batch_size": "inf", "client": {"stopping": "eb"}},
     "'client.stopping': algorithm 'fedsgd' has no local training to stop early"),
    ({"client": {"stopping": "eb"},
      "privacy": {"level": "example", "clip": 1.0, "noise_multiplier": 1.0}},
     "'client.stopping': 'eb' with privacy level 'example'"),
])
def test_config_errors_name_the_key(change, message):
    with pytest.raises(ConfigError) as err:
        validate_config({**SYNTHETIC, **change})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_bad_value_on_the_command_line_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG)
    assert main(["run", "tiny.yaml", "--set", "client.stopping=eb", "--set",
                 "client.stopping_every=-1", "--out", "runs/x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "client.stopping_every" in err[0]


def test_a_run_reports_the_steps_and_writes_their_histogram(tmp_path, monkeypatch):
    from fedax.experiments.run import run_experiment
    from fedax.simulation.tensorboard import read_histograms

    config = validate_config({**SYNTHETIC, "local_epochs": 3, "execution": {"devices": 1},
                              "client": {"stopping": "eb", "stopping_threshold": -1.0}})
    summary = run_experiment(config, tmp_path, progress=False)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text()
               .splitlines()]
    assert summary["local_stopping"]["local_steps_total"] == sum(
        r["local_steps_total"] for r in records)
    for r in records:
        real = [s for s in r["local_steps_per_client"] if s > 0]
        assert (r["local_steps_min"], r["local_steps_max"]) == (min(real), max(real))
        assert 0 <= r["stopped_early"] <= 1
    histograms = read_histograms(tmp_path / "tensorboard")
    assert [step for step, _ in histograms["clients/local_steps_per_client"]] == [1, 2]
