"""The FAD experiments of ``fedax reproduce``: the mislabelling partition, the carried-tangent
server-lr hypergradient (against the library's one-round version and the exact hypergradient
through two rounds), learned client weights that down-weight mislabelled clients, and the
reports of tiny runs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedax import data as fdata
from fedax.algorithms import fedavg
from fedax.hyper import HyperCohort, hypergradient, learned_server_lr, learned_server_lr_carried
from fedax.reproduce import EXPERIMENTS
from fedax.reproduce import fad_client_weights as fcw
from fedax.reproduce import fad_server_lr as fsl


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


def test_weight_stats():
    stats = fcw.weight_stats(np.array([1.0, 1.0, 2.0, 4.0]), np.array([3, 5, 7, 9]),
                             bad=np.array([5, 9]), sizes=np.array([10.0, 10.0, 10.0, 30.0]))
    assert stats["bad_weight_share"] == pytest.approx(5 / 8)
    assert stats["bad_example_share"] == pytest.approx(40 / 60)
    assert stats["bad_norm_weight"] == pytest.approx((0.5 + 2.0) / 2)
    assert stats["good_norm_weight"] == pytest.approx((0.5 + 1.0) / 2)
    assert stats["num_bad"] == 2


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


# ----------------------------------------------------------------------- tiny experiments


def _tiny_task(seed=0, fraction=0.3, mode="permute", clients=10, per_client=60):
    train, test = fdata.synthetic(0.0, 0.0, num_clients=clients, dim=8, num_classes=4,
                                  seed=seed, iid=True, sizes=per_client)
    parts = [train.client_indices(k) for k in range(clients)]
    y, bad = fdata.mislabel_clients(train.y, parts, fraction, seed, mode)
    train = fdata.ClientData(train.x, y, train.indices, train.offsets)
    task = fsl.Task("tiny", "tiny synthetic", train, test.x, test.y,
                    fsl.logistic_model(8, 4), clients_per_round=5, epochs=1, batch=10,
                    client_lr=0.1, note="tiny")
    return task, bad


def test_server_lr_report_from_a_tiny_run(tmp_path, monkeypatch):
    monkeypatch.setattr(fsl, "load_task", lambda name, seed: _tiny_task(seed, 0.0)[0])
    command = "fedax reproduce fad-server-lr --quick"
    results = fsl.run(tmp_path, True, False, command, tasks=("tiny",),
                      settings={"tiny": dict(rounds=4, eval_every=2, grid=(0.316, 1.0))},
                      variants=(fsl.Variant("v", 0.1, decay=0.5),), log=lambda _: None)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["command"] == command and saved["quick"] is True
    assert saved["experiment"] == "fad-server-lr" and saved["machine"]["cpus"] >= 1
    task = saved["tasks"][0]
    best = task["best_fixed_lr"]
    assert best in (0.316, 1.0)
    assert task["starts"] == [fsl.lattice_neighbour(best, 0.1), fsl.lattice_neighbour(best, 10)]
    fixed = {r["initial_server_lr"] for r in task["fixed"]}
    assert fixed >= {0.316, 1.0, *task["starts"]}
    assert [r["initial_server_lr"] for r in task["learned"]] == task["starts"]
    assert all(len(r["records"]) == 2 for r in task["fixed"] + task["learned"])
    assert task["selected_variant"] == "v" and set(task["verdict"]) >= {"matches_best_fixed"}
    report = (tmp_path / "report.md").read_text()
    assert f"Command: `{command}` (quick subset)" in report and "CPU cores" in report
    assert "| fixed η |" in report and "| variant | start |" in report
    assert "Selected variant: **v**" in report and "![tiny](tiny.png)" in report
    assert (tmp_path / "tiny.png").stat().st_size > 0
    assert results["figures"] == ["tiny.png"]


def test_client_weights_down_weight_mislabelled_clients_and_report(tmp_path):
    """On 10 IID clients, 3 with permuted labels, the learned rule (soft-error holdout from
    the whole population, as in the experiment) drives θ₂ (local loss) below 0 and gives the
    bad clients less than half their share of the examples, while n_k weighting gives them
    exactly their share; and the report of the run has its fields."""
    methods = ("n_k", "learned (soft-error holdout)", "oracle")
    results = fcw.run(tmp_path, True, False, "fedax reproduce fad-client-weights --quick",
                      task_loader=lambda seed, fraction, mode: _tiny_task(seed, fraction, mode),
                      settings=dict(rounds=40, eval_every=10), methods=methods,
                      hyper_lr=0.1, log=lambda _: None)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["experiment"] == "fad-client-weights" and saved["fraction"] == 0.3
    assert len(saved["bad_clients"]) == 3
    assert list(saved["methods"]) == list(methods)
    r = saved["methods"]["learned (soft-error holdout)"]
    assert len(r["final_theta"]) == 2 and len(r["records"]) == 4
    assert r["final_theta"][1] < 0
    assert r["tail_bad_weight_share"] < 0.5 * r["tail_bad_example_share"]
    assert r["tail_bad_norm_weight"] < r["tail_good_norm_weight"]
    assert saved["verdict"] == {"learned (soft-error holdout)": results["verdict"][
        "learned (soft-error holdout)"]}
    assert saved["verdict"]["learned (soft-error holdout)"]["down_weights"] is True
    report = (tmp_path / "report.md").read_text()
    assert "Command: `fedax reproduce fad-client-weights --quick` (quick subset)" in report
    assert all(f"| {name} |" in report for name in methods)
    assert "![client weights](client_weights.png)" in report
    assert (tmp_path / "client_weights.png").stat().st_size > 0


def test_registered():
    assert {"fad-server-lr", "fad-client-weights"} <= set(EXPERIMENTS)
