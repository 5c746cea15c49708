"""The FAD papers of ``fedax reproduce`` (``fad-server-lr``, ``fad-client-weights``): the
mislabelling partition, the carried-tangent server-lr hypergradient (against the library's
one-round version and the exact hypergradient through two rounds), and both papers run end
to end by the engine at tiny sizes: the protocol's choices, the claims and the reports."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax import data as fdata
from fedax.algorithms import fedavg
from fedax.hyper import HyperCohort, hypergradient, learned_server_lr, learned_server_lr_carried
from fedax.reproduce import EXPERIMENTS, get_paper, reproduce
from fedax.reproduce.hooks import fad_client_weights as fcw
from fedax.reproduce.hooks import fad_server_lr as fsl


def _labels_and_parts(num_clients=20, per_client=20, classes=10):
    labels = np.arange(num_clients * per_client, dtype=np.int32) % classes
    return labels, fdata.iid(len(labels), num_clients, seed=0)


@pytest.mark.parametrize("mode", fdata.MISLABEL_MODES)
def test_mislabel_clients_count_changed_and_deterministic(mode):
    labels, parts = _labels_and_parts()
    original = labels.copy()
    new, bad = fdata.mislabel_clients(labels, parts, 0.3, seed=5, mode=mode)
    np.testing.assert_array_equal(labels, original)  # the input is not modified
    assert new.dtype == labels.dtype
    assert len(bad) == 6 and len(np.unique(bad)) == 6 and np.all(np.diff(bad) > 0)
    for k, idx in enumerate(parts):
        if k in bad:
            assert np.all(new[idx] != labels[idx]), k  # every label of a bad client changed
            assert np.all((new[idx] >= 0) & (new[idx] < 10))
        else:
            np.testing.assert_array_equal(new[idx], labels[idx])
    again, bad_again = fdata.mislabel_clients(labels, parts, 0.3, seed=5, mode=mode)
    np.testing.assert_array_equal(again, new)
    np.testing.assert_array_equal(bad_again, bad)
    others = [fdata.mislabel_clients(labels, parts, 0.3, seed=s, mode=mode)[1] for s in (6, 7)]
    assert any(not np.array_equal(o, bad) for o in others)


def test_mislabel_permute_is_a_per_client_bijection_and_edge_fractions():
    labels, parts = _labels_and_parts()
    new, bad = fdata.mislabel_clients(labels, parts, 0.5, seed=1, mode="permute")
    maps = []
    for k in bad:
        idx = parts[k]
        mapping = {}
        for a, b in zip(labels[idx], new[idx], strict=True):
            assert mapping.setdefault(int(a), int(b)) == int(b)  # consistent within the client
        assert len(set(mapping.values())) == len(mapping)  # injective
        maps.append(tuple(sorted(mapping.items())))
    assert len(set(maps)) > 1  # each bad client has its own permutation
    assert len(fdata.mislabel_clients(labels, parts, 0.0, seed=1)[1]) == 0
    assert len(fdata.mislabel_clients(labels, parts, 1.0, seed=1)[1]) == len(parts)
    with pytest.raises(ValueError):
        fdata.mislabel_clients(labels, parts, 0.3, seed=1, mode="flip")


# ---------------------------------------------------------- carried-tangent hypergradient

D, K, C, S, B = 4, 3, 5, 3, 4


def _loss_fn(params, batch):
    logits = batch.x @ params["w"] + params["b"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch.y[:, None], axis=1)[:, 0]
    return jnp.sum(nll * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)


def _cohort(rng):
    from fedax.algorithms import CohortBatches
    from fedax.client import Batches

    x = rng.normal(size=(C, S, B, D)).astype(np.float32)
    y = rng.integers(0, K, size=(C, S, B)).astype(np.int32)
    mask = np.ones((C, S, B), np.float32)
    mask[0, -1] = 0.0
    return CohortBatches(Batches(x, y, mask), mask.sum(axis=(1, 2)),
                         np.arange(C, dtype=np.int32))


def _make(lr):
    return fedavg(_loss_fn, optax.sgd(0.3), optax.sgd(lr))


def _problem(rounds=3):
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(D, K)) * 0.3, jnp.float32),
              "b": jnp.zeros(K, jnp.float32)}
    return params, [HyperCohort(_cohort(rng), _cohort(rng)) for _ in range(rounds)]


@jax.jit
def _carried_step(state, cohort, hyper_lr, decay):
    """A round of the carried-tangent algorithm (Adam on log η), compiled once for all."""
    algorithm = learned_server_lr_carried(_make, 1.0, _loss_fn, optax.adam(hyper_lr), decay)
    return algorithm.round(state, cohort, None)


def test_carried_tangent_with_zero_decay_is_the_one_round_hypergradient():
    params, cohorts = _problem()
    ours = learned_server_lr_carried(_make, 0.7, _loss_fn, optax.adam(0.1))
    library = learned_server_lr(_make, 0.7, _loss_fn, optax.adam(0.1), mode="forward")
    library_step = jax.jit(library.round)
    a, b = ours.init(params, None), library.init(params, None)
    for cohort in cohorts:
        a, ma = _carried_step(a, cohort, 0.1, 0.0)
        b, mb = library_step(b, cohort, None)
        np.testing.assert_allclose(ma["server_lr"], mb["server_lr"], rtol=1e-6)
        np.testing.assert_allclose(ma["holdout_loss"], mb["holdout_loss"], rtol=1e-6)
    np.testing.assert_allclose(a.log_lr, b.hparams, rtol=1e-5)
    np.testing.assert_allclose(ours.server_params(a)["w"], library.server_params(b)["w"],
                               rtol=1e-5, atol=1e-6)


def test_carried_tangent_is_the_exact_hypergradient_through_past_rounds():
    """With η frozen (hyper step 0) and no decay, the round-2 hypergradient is d/d log η of
    the round-2 holdout loss after both rounds: fedax.hyper.hypergradient through 2 rounds."""
    params, cohorts = _problem(rounds=2)
    lr = 0.7
    algorithm = learned_server_lr_carried(_make, lr, _loss_fn, optax.adam(0.0))
    carried = one_round = algorithm.init(params, None)
    for cohort in cohorts:
        carried, metrics = _carried_step(carried, cohort, 0.0, 1.0)
        one_round, one_round_metrics = _carried_step(one_round, cohort, 0.0, 0.0)
    np.testing.assert_allclose(carried.log_lr, np.log(lr), rtol=1e-6)  # frozen
    trains = jax.tree.map(lambda *a: np.stack(a), *[c.train for c in cohorts])
    loss, grad = jax.jit(lambda u: hypergradient(
        lambda v: _make(jnp.exp(v)), u, params, trains, cohorts[-1].holdout, _loss_fn,
        mode="forward", remat=False))(jnp.log(jnp.float32(lr)))
    np.testing.assert_allclose(metrics["holdout_loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["hypergradient"], grad, rtol=1e-3)
    # Not trivially so: the one-round hypergradient of the same loss is different.
    assert abs(float(one_round_metrics["hypergradient"]) - float(grad)) > 0.05 * abs(float(grad))


# ------------------------------------------------------------------- the papers, tiny


# Synthetic IID data, 10 clients (sizes 48-711), logistic regression: seconds a run.
TINY_TASK = {"task": "tiny", "title": "tiny synthetic", "note": "tiny",
             "data": {"dataset": "synthetic", "synthetic": {"iid": True}, "num_clients": 10},
             "clients_per_round": 5, "epochs": 1, "batch": 10, "client_lr": 0.1}


def _tiny(name, settings):
    return dataclasses.replace(get_paper(name), settings={"quick": settings})


def _tables(text):
    return [line for line in text.splitlines() if line.startswith("|")]


def test_server_lr_protocol_claims_and_report_of_a_tiny_run(tmp_path):
    variant = {"name": "v", "hyper_lr": 0.1, "decay": 0.5, "holdout_factor": 2}
    task = {**TINY_TASK, "rounds": 4, "eval_every": 2, "grid": [0.316, 1.0]}
    command = "fedax reproduce fad-server-lr --quick"
    reproduce(_tiny("fad-server-lr", {"seed": 0, "tasks": [task], "variants": [variant]}),
              tmp_path, quick=True, progress=False, command=command, log=lambda _: None)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["command"] == command and saved["quick"] is True
    assert saved["experiment"] == "fad-server-lr" and saved["machine"]["cpus"] >= 1
    t = saved["tasks"][0]
    fixed = {r["initial_server_lr"]: r for r in t["fixed"]}
    # η* has the grid's lowest training loss; the starts are the lattice points 0.1x and 10x.
    assert t["best_fixed_lr"] == min((0.316, 1.0), key=lambda lr: fixed[lr]["tail_train_loss"])
    assert t["starts"] == {0.316: [0.0316, 3.16], 1.0: [0.1, 10.0]}[t["best_fixed_lr"]]
    assert set(fixed) == {0.316, 1.0, *t["starts"]}
    assert [r["initial_server_lr"] for r in t["learned"]] == t["starts"]
    assert all(len(r["records"]) == 2 for r in t["fixed"] + t["learned"])
    for r in t["fixed"] + t["learned"]:  # the last-20% values: the last of 2 evaluations
        assert r["tail_test_accuracy"] == r["records"][-1]["test_accuracy"]
    assert all(r["final_server_lr"] != r["initial_server_lr"] for r in t["learned"])  # η moved
    assert all(r["final_server_lr"] == r["initial_server_lr"] for r in t["fixed"])
    assert t["selected_variant"] == "v"
    assert t["variant_scores"]["v"] == pytest.approx(
        np.mean([r["tail_train_loss"] for r in t["learned"]]))
    # Three claims, each held exactly when the numbers say so.
    best = fixed[t["best_fixed_lr"]]
    expected = [
        all(r["tail_test_accuracy"] >= best["tail_test_accuracy"] - 0.005 for r in t["learned"]),
        all(r["tail_train_loss"] <= 1.02 * best["tail_train_loss"] for r in t["learned"]),
        all(r["tail_train_loss"] < fixed[r["initial_server_lr"]]["tail_train_loss"]
            for r in t["learned"]),
    ]
    assert [c["held"] for c in saved["claims"]] == expected
    assert saved["verdicts"]["tiny"] == dict(zip(
        ["matches_best_fixed", "matches_best_fixed_train_loss", "improves_on_its_start"],
        expected, strict=True))
    report = (tmp_path / "report.md").read_text()
    assert f"Command: `{command}` (quick subset)" in report and "CPU cores" in report
    tables = _tables(report)
    assert tables[0].startswith("| data set | η* |")
    assert tables[3].startswith("| fixed η | final test acc |") and len(tables) == 3 + 6 + 4
    assert f"| {t['best_fixed_lr']:g} (η*) |" in report and " (off grid) |" in report
    assert sum("| v **(selected)** |" in line for line in tables) == 2
    assert "holdout 2×m clients" in report
    assert saved["figures"] == ["test_accuracy.png", "server_lr.png"]
    assert all((tmp_path / name).stat().st_size > 0 for name in saved["figures"])
    # --report-only rewrites the same report from results.json.
    reproduce("fad-server-lr", tmp_path, report_only=True, progress=False, log=lambda _: None)
    assert (tmp_path / "report.md").read_text() == report


def test_weight_stats():
    stats = fcw.weight_stats(np.array([1.0, 1.0, 2.0, 4.0]), np.array([3, 5, 7, 9]),
                             bad=np.array([5, 9]), sizes=np.array([10.0, 10.0, 10.0, 30.0]))
    assert stats["bad_weight_share"] == pytest.approx(5 / 8)
    assert stats["bad_example_share"] == pytest.approx(40 / 60)
    assert stats["bad_norm_weight"] == pytest.approx((0.5 + 2.0) / 2)
    assert stats["good_norm_weight"] == pytest.approx((0.5 + 1.0) / 2)
    assert stats["num_bad"] == 2


def test_client_weights_down_weight_mislabelled_clients_claims_and_report(tmp_path):
    """On 10 clients, 3 with permuted labels, the learned rule (soft-error holdout from the
    whole population, as in the paper file) drives θ₂ (local loss) below 0 and gives the bad
    clients less than half their share of the examples: its claim holds; the oracle never
    sees a bad client."""
    methods = {"n_k": {}, "learned (soft-error holdout)": {"holdout": "population",
                                                          "objective": "soft error"},
               "oracle": {"train": "good"}}
    settings = {"seed": 0, "fraction": 0.3, "mode": "permute", "hyper_lr": 0.1,
                "rounds": 40, "eval_every": 10, "task": TINY_TASK, "methods": methods}
    reproduce(_tiny("fad-client-weights", settings), tmp_path, quick=True, progress=False,
              log=lambda _: None)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["experiment"] == "fad-client-weights" and len(saved["bad_clients"]) == 3
    assert list(saved["methods"]) == list(methods)
    r = saved["methods"]["learned (soft-error holdout)"]
    assert len(r["final_theta"]) == 2 and len(r["records"]) == 4
    assert r["final_theta"][1] < 0
    assert r["tail_bad_weight_share"] < 0.5 * r["tail_bad_example_share"]
    assert r["tail_bad_norm_weight"] < r["tail_good_norm_weight"]
    assert r["mean_bad_weight_share"] == pytest.approx(
        np.mean([x["bad_weight_share"] for x in r["records"]]))
    assert "final_theta" not in saved["methods"]["n_k"]
    assert saved["down_weights"] == {"learned (soft-error holdout)": True}
    [claim] = saved["claims"]
    assert claim["held"] is True and claim["claim"].startswith("learned (soft-error holdout)")
    report = (tmp_path / "report.md").read_text()
    tables = _tables(report)
    assert all(any(line.startswith(f"| {name} |") for line in tables) for name in methods)
    assert "| learned (soft-error holdout) | all (contaminated) | soft error |" in report
    assert tables[-1].endswith("| yes |") and "30%" in report
    assert (tmp_path / "client_weights.png").stat().st_size > 0


def test_registered_and_the_lattice_of_server_rates():
    assert {"fad-server-lr", "fad-client-weights"} <= set(EXPERIMENTS)
    assert [fsl.lattice(k) for k in range(-2, 3)] == [0.1, 0.316, 1.0, 3.16, 10.0]
