"""One server-optimizer spec: ``server_optimizer(name, **hyperparameters)``.

* The FedOpt transforms (``fedadam``, ``fedyogi``, ``fedadagrad``, ``fedamsgrad``, ``fedavgm``)
  are thin calls of it, with η in the state (``optax.inject_hyperparams``), and their numbers
  are bit-identical to the code before the spec (frozen below as ``_before``), states included.
* A hyperparameter that does not apply is an error naming it, the optimizer and the allowed
  ones; ranges are checked; η can be read, replaced and differentiated.
* The registry's FedOpt names are FedAvg with that server optimizer (one construction path),
  and the algorithms built from a config give the numbers of the code before the spec.
* ``fedax run`` records the resolved server optimizer in ``summary.json`` (fedadam without
  ``server.lr`` runs at adam's default 0.01), and a misplaced key is a one-line error.
"""

import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import TINY_CONFIG, run_fedax

from fedax.algorithms import (
    ALGORITHMS,
    SERVER_OPTIMIZERS,
    CohortBatches,
    FedAdaptiveState,
    FedAMSGradState,
    ServerOptimizerError,
    fedadagrad,
    fedadam,
    fedamsgrad,
    fedavg,
    fedavgm,
    fedprox,
    fedsgd,
    fedyogi,
    make,
    resolve_server_optimizer,
    scaffold,
    server_learning_rate,
    server_optimizer,
    with_server_learning_rate,
)
from fedax.builder.build import build_algorithm
from fedax.client import Batches
from fedax.spec.config import validate_config

# ---------------------------------------------------------------------------------------
# The server optimizers as they were before the spec (fedax.algorithms.server_optimizers at
# commit 82d2273), verbatim but for the names and the argument checks: the reference for
# bit-identity.


_State, _AMSState = FedAdaptiveState, FedAMSGradState  # the state types are the same


def _check(tau, b1, b2, initial_accumulator):
    v0 = tau**2 if initial_accumulator is None else initial_accumulator
    return v0


def _fed_adaptive(lr, b1, tau, v0, second_moment, amsgrad=False):
    def init(params):
        m = jax.tree.map(jnp.zeros_like, params)
        v = jax.tree.map(lambda p: jnp.full_like(p, v0), params)
        return _AMSState(m, v, v) if amsgrad else _State(m, v)

    def update(updates, state, params=None):
        del params
        m = jax.tree.map(lambda mm, g: b1 * mm + (1.0 - b1) * g, state.m, updates)
        v = jax.tree.map(lambda vv, g: second_moment(vv, jnp.square(g)), state.v, updates)
        if amsgrad:
            v_hat = jax.tree.map(jnp.maximum, state.v_hat, v)
            new_state, denom = _AMSState(m, v, v_hat), v_hat
        else:
            new_state, denom = _State(m, v), v
        steps = jax.tree.map(lambda mm, vv: -lr * mm / (jnp.sqrt(vv) + tau), m, denom)
        return steps, new_state

    return optax.GradientTransformation(init, update)


def _fedadagrad(lr, tau=1e-3, b1=0.0, initial_accumulator=None):
    v0 = _check(tau, b1, 0.0, initial_accumulator)
    return _fed_adaptive(lr, b1, tau, v0, lambda v, g2: v + g2)


def _fedadam(lr, b1=0.9, b2=0.99, tau=1e-3, initial_accumulator=None):
    v0 = _check(tau, b1, b2, initial_accumulator)
    return _fed_adaptive(lr, b1, tau, v0, lambda v, g2: b2 * v + (1.0 - b2) * g2)


def _fedyogi(lr, b1=0.9, b2=0.99, tau=1e-3, initial_accumulator=None):
    v0 = _check(tau, b1, b2, initial_accumulator)
    return _fed_adaptive(lr, b1, tau, v0, lambda v, g2: v - (1.0 - b2) * g2 * jnp.sign(v - g2))


def _fedamsgrad(lr, b1=0.9, b2=0.99, tau=1e-3, initial_accumulator=None):
    v0 = _check(tau, b1, b2, initial_accumulator)
    return _fed_adaptive(lr, b1, tau, v0, lambda v, g2: b2 * v + (1.0 - b2) * g2, amsgrad=True)


def _fedavgm(lr=1.0, momentum=0.9):
    return optax.sgd(lr, momentum=momentum)


_before = SimpleNamespace(fedadagrad=_fedadagrad, fedadam=_fedadam, fedyogi=_fedyogi,
                          fedamsgrad=_fedamsgrad, fedavgm=_fedavgm)
NOW = {"fedadagrad": fedadagrad, "fedadam": fedadam, "fedyogi": fedyogi,
       "fedamsgrad": fedamsgrad, "fedavgm": fedavgm}

# ---------------------------------------------------------------------------------------
# The transforms.

CASES = [
    ("fedadagrad", (0.3,), {}),
    ("fedadagrad", (0.3,), {"tau": 1e-2, "b1": 0.5, "initial_accumulator": 0.5}),
    ("fedadam", (0.1,), {}),
    ("fedadam", (0.1,), {"b1": 0.8, "b2": 0.9, "tau": 0.1}),
    ("fedyogi", (0.1,), {}),
    ("fedyogi", (0.1,), {"b1": 0.7, "b2": 0.9, "tau": 1e-2, "initial_accumulator": 1e-3}),
    ("fedamsgrad", (0.1,), {}),
    ("fedamsgrad", (0.1,), {"b1": 0.5, "b2": 0.5, "tau": 1e-2}),
    ("fedavgm", (0.7,), {"momentum": 0.9}),
    ("fedavgm", (1.0,), {"momentum": 0.0}),
    ("fedavgm", (), {}),
]


def _steps(opt, x0, deltas, jit):
    params = {"w": jnp.asarray(x0[:6].reshape(2, 3)), "b": jnp.asarray(x0[6:])}
    state = opt.init(params)
    update = jax.jit(opt.update) if jit else opt.update
    for d in deltas:
        pseudo_grad = {"w": -jnp.asarray(d[:6].reshape(2, 3)), "b": -jnp.asarray(d[6:])}
        updates, state = update(pseudo_grad, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name,args,kwargs", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_fedopt_transforms_are_bit_identical_to_before_the_spec(name, args, kwargs, dtype):
    rng = np.random.default_rng(0)
    x0 = rng.normal(size=8).astype(dtype)
    # mixed magnitudes: Yogi's sign takes both values, AMSGrad's max both branches
    deltas = [(s * rng.normal(size=8)).astype(dtype) for s in (1, 0.01, 3, 1e-3, 0.5, 0.02, 2)]
    with jax.enable_x64(dtype == np.float64):
        for jit in (True, False):
            old_params, old_state = _steps(getattr(_before, name)(*args, **kwargs), x0, deltas,
                                           jit)
            new_params, new_state = _steps(NOW[name](*args, **kwargs), x0, deltas, jit)
            assert jax.tree.structure(new_state.inner_state) == jax.tree.structure(old_state)
            for old, new in zip(jax.tree.leaves((old_params, old_state)),
                                jax.tree.leaves((new_params, new_state.inner_state)),
                                strict=True):
                assert new.dtype == old.dtype == dtype
                np.testing.assert_array_equal(new, old)
            lr = args[0] if args else 1.0
            assert server_learning_rate(new_state) == np.asarray(lr, dtype)
            assert server_learning_rate(new_state).dtype == dtype


def test_the_fedopt_names_are_the_spec_names():
    params = {"a": jnp.arange(3.0)}
    g = {"a": jnp.asarray([0.5, -2.0, 1e-3])}
    for fedopt, name in [(fedadagrad, "adagrad"), (fedadam, "adam"), (fedyogi, "yogi"),
                         (fedamsgrad, "amsgrad")]:
        a, b = fedopt(0.1, tau=0.01), server_optimizer(name, lr=0.1, tau=0.01)
        ua, _ = a.update(g, a.init(params), params)
        ub, _ = b.update(g, b.init(params), params)
        np.testing.assert_array_equal(ua["a"], ub["a"])
    for transform in (server_optimizer("sgd"), server_optimizer("sgd", lr=1.0)):
        (u, _), (ref, _) = (transform.update(g, transform.init(params)),
                            optax.sgd(1.0).update(g, optax.sgd(1.0).init(params)))
        np.testing.assert_array_equal(u["a"], ref["a"])  # FedAvg's server step
    nesterov = server_optimizer("momentum", lr=0.5, momentum=0.8, nesterov=True)
    ref = optax.sgd(0.5, momentum=0.8, nesterov=True)
    s, r = nesterov.init(params), ref.init(params)
    for _ in range(3):
        (u, s), (v, r) = nesterov.update(g, s, params), ref.update(g, r, params)
        np.testing.assert_array_equal(u["a"], v["a"])


def test_defaults_come_from_the_spec_table():
    expected = {"sgd": 1.0, "momentum": 1.0, "adagrad": 0.1, "adam": 0.01, "yogi": 0.01,
                "amsgrad": 0.01}
    assert {n: s.hyperparameters["lr"].default for n, s in SERVER_OPTIMIZERS.items()} == expected
    adam = resolve_server_optimizer("adam")
    assert dict(adam.hyperparameters) == {"lr": 0.01, "b1": 0.9, "b2": 0.99, "tau": 1e-3,
                                          "initial_accumulator": 1e-3**2}
    assert adam.defaults == ("lr", "b1", "b2", "tau", "initial_accumulator")
    assert adam.reference.startswith("Reddi et al. 2021")
    adagrad = resolve_server_optimizer("adagrad", lr=0.3, tau=0.1)
    assert adagrad.hyperparameters["b1"] == 0.0  # plain Adagrad, the paper's experiments
    assert adagrad.hyperparameters["initial_accumulator"] == 0.1**2  # τ², derived
    assert adagrad.defaults == ("b1", "initial_accumulator")
    momentum = resolve_server_optimizer("momentum", nesterov=None)  # None: not given
    assert dict(momentum.hyperparameters) == {"lr": 1.0, "momentum": 0.9, "nesterov": False}
    assert momentum.reference.startswith("Hsu et al. 2019")
    assert resolve_server_optimizer("sgd", lr=0.5).as_dict() == {
        "name": "sgd", "lr": 0.5, "defaults": [], "reference": SERVER_OPTIMIZERS["sgd"].reference}


@pytest.mark.parametrize(("call", "message"), [
    (lambda: server_optimizer("sgd", b1=0.9),
     "server optimizer 'sgd' has no hyperparameter 'b1'; allowed: lr"),
    (lambda: server_optimizer("momentum", tau=1e-3),
     "server optimizer 'momentum' has no hyperparameter 'tau'; allowed: lr, momentum, nesterov"),
    (lambda: server_optimizer("adagrad", b2=0.9),
     "server optimizer 'adagrad' has no hyperparameter 'b2'; allowed: lr, b1, tau,"
     " initial_accumulator"),
    (lambda: server_optimizer("rmsprop"),
     "unknown server optimizer 'rmsprop'; allowed: sgd, momentum, adagrad, adam, yogi, amsgrad"),
    (lambda: server_optimizer("adam", lr=0.0), "server optimizer 'adam': lr must be > 0, got 0.0"),
    (lambda: server_optimizer("adam", b1=1.0), "server optimizer 'adam': b1 must be in [0, 1)"),
    (lambda: server_optimizer("adam", tau=float("nan")), "tau must be >= 0, got nan"),
    (lambda: server_optimizer("adam", tau=0.0),
     "server optimizer 'adam': tau = 0 needs initial_accumulator > 0"),
    (lambda: server_optimizer("momentum", nesterov=1), "nesterov must be true or false"),
    (lambda: server_optimizer("sgd", lr="0.1"), "lr must be a number > 0, got '0.1'"),
    (lambda: fedavgm(1.0, momentum=1.0), "momentum must be in [0, 1), got 1.0"),
])
def test_a_wrong_hyperparameter_is_a_value_error_naming_it(call, message):
    with pytest.raises(ServerOptimizerError) as info:
        call()
    assert isinstance(info.value, ValueError) and message in str(info.value)
    assert info.value.key in str(info.value)


def test_server_optimizer_tables_agree_on_each_hyperparameters_range():
    ranges: dict[str, tuple] = {}
    for spec in SERVER_OPTIMIZERS.values():
        assert next(iter(spec.hyperparameters)) == "lr"
        for key, h in spec.hyperparameters.items():
            assert ranges.setdefault(key, (h.gt, h.ge, h.lt, h.le, h.kind)) == (
                h.gt, h.ge, h.lt, h.le, h.kind), key


def test_the_learning_rate_lives_in_the_state_and_can_be_replaced_or_learned():
    params = {"a": jnp.ones(2)}
    g = {"a": jnp.asarray([1.0, -2.0])}
    opt = server_optimizer("adam", lr=0.1)
    state = opt.init(params)
    assert float(server_learning_rate(state)) == pytest.approx(0.1)
    assert server_learning_rate(optax.sgd(1.0).init(params)) is None
    with pytest.raises(ValueError, match="holds no learning rate"):
        with_server_learning_rate(optax.sgd(1.0).init(params), 0.5)
    # replaced: the next step is the one of an optimizer built with that rate
    replaced = with_server_learning_rate(state, 0.3)
    assert server_learning_rate(replaced).dtype == jnp.float32
    ref = server_optimizer("adam", lr=0.3)
    np.testing.assert_array_equal(opt.update(g, replaced, params)[0]["a"],
                                  ref.update(g, ref.init(params), params)[0]["a"])
    # learned: differentiable in η (sgd: x1 = x0 − η g, d Σx1 / dη = −Σg)
    def total_after_one_step(lr):
        sgd = server_optimizer("sgd", lr=lr)
        updates, _ = sgd.update(g, sgd.init(params), params)
        return jnp.sum(optax.apply_updates(params, updates)["a"])

    assert float(jax.grad(total_after_one_step)(0.5)) == pytest.approx(1.0)
    # in x64, float32 params keep a float32 η (optax casts it to the params' dtype)
    with jax.enable_x64(True):
        assert server_learning_rate(opt.init(params)).dtype == jnp.float32


# ---------------------------------------------------------------------------------------
# The registry and the config: FedAvg with a server optimizer, one construction path.

D, K, POPULATION = 3, 2, 5


def _loss(params, batch):
    logits = batch.x @ params["w"] + params["b"]
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, batch.y[:, None], axis=1)[:, 0]
    return jnp.sum(nll * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)


def _cohort():
    rng = np.random.default_rng(0)
    c, steps, b = 3, 3, 2
    x = rng.normal(size=(c, steps, b, D)).astype(np.float32)
    y = rng.integers(0, K, size=(c, steps, b)).astype(np.int32)
    mask = np.ones((c, steps, b), np.float32)
    mask[1, 2:] = 0.0
    return CohortBatches(Batches(x, y, mask), np.asarray([6.0, 4.0, 6.0], np.float32),
                         np.asarray([3, 0, 4], np.int32))


def _params():
    rng = np.random.default_rng(1)
    return {"w": jnp.asarray(rng.normal(size=(D, K)) * 0.3, jnp.float32),
            "b": jnp.asarray(rng.normal(size=K) * 0.1, jnp.float32)}


def _train(alg, rounds=3):
    cohort, key = _cohort(), jax.random.key(0)
    state = alg.init(_params(), key)
    step = jax.jit(alg.round)
    for _ in range(rounds):
        state, _ = step(state, cohort, key)
    return alg.server_params(state)


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(_train(a)), jax.tree.leaves(_train(b)), strict=True):
        np.testing.assert_array_equal(x, y)


def test_every_entry_declares_its_options_and_implied_server_optimizer():
    implied = {name: spec.server_optimizer for name, spec in ALGORITHMS.items()}
    assert implied == {"fedavg": None, "fedsgd": None, "fedprox": None, "scaffold": None,
                       "scaffold_option1": None, "fednova": None, "fedadagrad": "adagrad",
                       "fedadam": "adam",
                       "fedyogi": "yogi", "fedamsgrad": "amsgrad", "fedavgm": "momentum"}
    assert dict(ALGORITHMS["fedprox"].options) == {"mu": 0.01}
    assert dict(ALGORITHMS["scaffold"].options) == {"weighting": "uniform"}
    assert all(spec.name == name and spec.doc for name, spec in ALGORITHMS.items())


# name -> the server optimizer the registry built before the spec, at its defaults then
BEFORE_DEFAULTS = {"fedadagrad": lambda: _fedadagrad(0.1), "fedadam": lambda: _fedadam(0.01),
                   "fedyogi": lambda: _fedyogi(0.01), "fedamsgrad": lambda: _fedamsgrad(0.01),
                   "fedavgm": lambda: _fedavgm(1.0)}


@pytest.mark.parametrize("name", sorted(BEFORE_DEFAULTS))
def test_fedopt_names_are_fedavg_with_that_server_optimizer(name):
    client = optax.sgd(0.2)
    _assert_same(make(name, _loss, POPULATION, 0.2),
                 fedavg(_loss, client, BEFORE_DEFAULTS[name]()))
    spec = ALGORITHMS[name].server_optimizer
    _assert_same(make(name, _loss, POPULATION, 0.2, server_lr=0.05),
                 make("fedavg", _loss, POPULATION, 0.2, server_optimizer=spec, server_lr=0.05))


def test_the_other_entries_default_to_server_sgd_at_one_as_before():
    client = optax.sgd(0.2)
    _assert_same(make("fedavg", _loss, POPULATION, 0.2), fedavg(_loss, client))
    _assert_same(make("fedsgd", _loss, POPULATION, 0.2), fedsgd(_loss, 0.2))
    _assert_same(make("fedprox", _loss, POPULATION, 0.2, mu=0.5), fedprox(_loss, client, 0.5))
    _assert_same(make("scaffold", _loss, POPULATION, 0.2, aggregator=None),
                 scaffold(_loss, 0.2, POPULATION))
    _assert_same(make("fedavg", _loss, POPULATION, 0.2, server_optimizer=optax.sgd(0.5)),
                 fedavg(_loss, client, optax.sgd(0.5)))  # a transform still works


@pytest.mark.parametrize(("name", "options", "fragment"), [
    ("fedavg", {"b1": 0.9}, "algorithm 'fedavg' with server optimizer 'sgd' has no option 'b1'"),
    ("fedavgm", {"tau": 0.1}, "server optimizer 'momentum' has no option 'tau'; allowed: "
                              "server_optimizer, server_lr, momentum, nesterov, aggregator"),
    ("fedprox", {"lr": 0.1}, "has no option 'lr'; allowed: mu, server_optimizer, server_lr"),
    ("fedadam", {"server_optimizer": "sgd"}, "algorithm 'fedadam' is FedAvg with server"
                                             " optimizer 'adam', got server optimizer 'sgd'"),
    ("fedadam", {"server_optimizer": optax.sgd(1.0)}, "pass its name or hyperparameters"),
    ("fedavg", {"server_optimizer": optax.sgd(1.0), "server_lr": 0.5},
     "'server_lr' does not apply to a server optimizer given as a transform"),
    ("fedavg", {"server_optimizer": "adam", "tau": -1.0}, "tau must be >= 0"),
])
def test_registry_options_that_do_not_apply_are_errors(name, options, fragment):
    with pytest.raises(ValueError) as info:
        make(name, _loss, POPULATION, 0.2, **options)
    assert fragment in str(info.value)


def _apply(params, x):
    return x @ params["w"] + params["b"]


CONFIG = {"rounds": 1, "dataset": "synthetic", "num_clients": POPULATION, "model": "logistic",
          "client_fraction": 0.5, "local_epochs": 1, "batch_size": 2, "client_lr": 0.2}


def _before_build(config):
    """What fedax.builder.build.build_algorithm built before the spec (its server keys
    then had config defaults: lr 1, momentum 0.9, b1 0.9, b2 0.99, tau 1e-3)."""
    from fedax.models import softmax_cross_entropy

    def loss(params, batch):
        return softmax_cross_entropy(_apply(params, batch.x), batch.y, batch.mask)

    s = {"optimizer": "sgd", "lr": 1.0, "momentum": 0.9, "b1": 0.9, "b2": 0.99, "tau": 1e-3,
         **config.get("server", {})}
    client, name = optax.sgd(config["client_lr"]), config["algorithm"]
    fedopt = {"fedadam": _fedadam, "fedyogi": _fedyogi, "fedamsgrad": _fedamsgrad}
    if name in fedopt:
        return fedavg(loss, client, fedopt[name](s["lr"], s["b1"], s["b2"], s["tau"]))
    if name == "fedadagrad":
        return fedavg(loss, client, _fedadagrad(s["lr"], tau=s["tau"]))
    if name == "fedavgm":
        return fedavg(loss, client, _fedavgm(s["lr"], momentum=s["momentum"]))
    server = {"sgd": optax.sgd(s["lr"]),
              "momentum": optax.sgd(s["lr"], momentum=s["momentum"])}[s["optimizer"]]
    if name == "fedprox":
        return fedprox(loss, client, config.get("mu", 0.01), server)
    if name == "fedsgd":
        return fedsgd(loss, config["client_lr"], server)
    if name == "scaffold":
        return scaffold(loss, config["client_lr"], POPULATION, "II", server)
    return fedavg(loss, client, server)


@pytest.mark.parametrize("changes", [
    {"algorithm": "fedavg"},
    {"algorithm": "fedavg", "server": {"optimizer": "sgd", "lr": 1.0}},
    {"algorithm": "fedavg", "server": {"optimizer": "momentum", "lr": 0.5, "momentum": 0.5}},
    {"algorithm": "fedsgd", "local_epochs": 1, "batch_size": "inf"},
    {"algorithm": "fedprox", "mu": 0.5},
    {"algorithm": "scaffold", "server": {"optimizer": "sgd", "lr": 1.0}},
    {"algorithm": "fedavgm", "server": {"lr": 0.3}},
    {"algorithm": "fedavgm", "server": {"lr": 1.0, "momentum": 0.5}},
    {"algorithm": "fedadam", "server": {"lr": 0.00316, "tau": 1e-4}},
    {"algorithm": "fedyogi", "server": {"lr": 0.01, "tau": 1e-4}},
    {"algorithm": "fedamsgrad", "server": {"lr": 0.01, "b1": 0.5, "b2": 0.9}},
    {"algorithm": "fedadagrad", "server": {"lr": 0.1, "tau": 1e-2}},
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_configs_build_the_numbers_they_built_before_the_spec(changes):
    config = {**CONFIG, **changes}
    _assert_same(build_algorithm(validate_config(config), _apply), _before_build(config))


def test_fedadam_without_server_lr_runs_at_adams_default_not_fedavgs():
    config = validate_config({**CONFIG, "algorithm": "fedadam"})
    _assert_same(build_algorithm(config, _apply), _before_build({
        **CONFIG, "algorithm": "fedadam", "server": {"lr": 0.01}}))


# ---------------------------------------------------------------------------------------
# Through the real command.


def test_the_summary_records_the_resolved_server_optimizer(tmp_path):
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG)
    done = run_fedax("run", "tiny.yaml", "--out", "adam", "--no-progress",
                     "--set", "algorithm=fedadam", "--set", "server.tau=1e-2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "adam" / "summary.json").read_text())
    assert summary["server_optimizer"] == {
        "name": "adam", "lr": 0.01, "b1": 0.9, "b2": 0.99, "tau": 0.01,
        "initial_accumulator": 0.01**2, "defaults": ["lr", "b1", "b2", "initial_accumulator"],
        "reference": SERVER_OPTIMIZERS["adam"].reference}
    assert summary["config"]["server"] == {"tau": 0.01}  # the keys given, as given


def test_a_misplaced_server_key_is_one_line_from_fedax_run(tmp_path):
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG + "server:\n  b1: 0.9\n")
    done = run_fedax("run", "tiny.yaml", "--out", "run", "--no-progress", cwd=tmp_path)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "fedax: error: config key 'server.b1': server optimizer 'sgd' (the default; choose one"
        " with server.optimizer) has no hyperparameter 'b1'; allowed: optimizer, lr (remove it,"
        " or --set server.b1=null)"]
    assert not (tmp_path / "run").exists()
