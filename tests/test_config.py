"""Tests for fedax.spec.config: schema, one-line errors, --set overrides, example configs."""

import json
import math
from importlib import resources
from typing import get_args

import pytest
import yaml

from fedax.spec.config import (
    Config,
    ConfigError,
    check_against_data,
    config_to_dict,
    load_config,
    resolved_server_optimizer,
    validate_config,
)

VALID = {
    "seed": 3,
    "rounds": 50,
    "dataset": "mnist",
    "num_clients": 100,
    "partition": "pathological",
    "dirichlet_alpha": 0.5,
    "similarity": 0.1,
    "model": "2nn",
    "precision": "float32",
    "algorithm": "fedavg",
    "mu": 0.01,
    "client_fraction": 0.1,
    "local_epochs": 1,
    "batch_size": 10,
    "client_lr": 0.1,
    "server": {"optimizer": "momentum", "lr": 1.0, "momentum": 0.5},
    "eval_every": 5,
    "target_accuracy": 0.97,
    "stop_at_target": False,
    "checkpoint_every": 10,
    "execution": {"strategy": "vmap", "local_steps": "scan", "devices": 2},
    "synthetic": {"alpha": 1.0, "beta": 1.0, "iid": False},
    "shakespeare": {"max_clients": None, "sample": "chunk", "seq_len": 80},
    "stragglers": 0.0,
    "drop_stragglers": False,
    "max_rejected_fraction": 0.5,
}


@pytest.fixture
def write(tmp_path):
    def _write(data, name="config.yaml"):
        path = tmp_path / name
        path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
        return path

    return _write


def _with(**changes):
    data = json.loads(json.dumps(VALID))
    for key, value in changes.items():
        if value is ...:
            del data[key]
        else:
            data[key] = value
    return data


def test_valid_config_round_trips(write):
    config = load_config(write(VALID))
    assert config.batch_size == 10 and config.server.optimizer == "momentum"
    as_dict = config_to_dict(config)
    assert as_dict == VALID
    assert validate_config(json.loads(json.dumps(as_dict))) == config


def test_defaults():
    config = validate_config(
        _with(
            seed=...,
            num_clients=...,
            server=...,
            execution=...,
            eval_every=...,
            target_accuracy=...,
            dataset=...,
        )
    )
    assert (config.seed, config.num_clients, config.eval_every) == (0, 100, 1)
    assert config.server.optimizer is None and config.server.lr is None  # not given
    server = resolved_server_optimizer(config)
    assert (server.name, dict(server.hyperparameters), server.defaults) == ("sgd", {"lr": 1.0},
                                                                            ("lr",))
    assert (config.execution.strategy, config.execution.local_steps) == ("auto", "auto")
    assert config.dataset == "mnist" and config.target_accuracy is None


@pytest.mark.parametrize("value", ["inf", float("inf"), ".inf", "Infinity"])
def test_batch_size_inf_is_stored_as_math_inf_and_written_as_string(value):
    config = validate_config(_with(batch_size=value))
    assert config.batch_size == math.inf
    assert config_to_dict(config)["batch_size"] == "inf"
    json.dumps(config_to_dict(config), allow_nan=False)


@pytest.mark.parametrize(
    ("data", "key", "fragment"),
    [
        (_with(lr_client=0.1), "'lr_client'", "(did you mean 'client_lr'?)"),
        (_with(xyzzy=0.1), "'xyzzy'", "allowed: seed, rounds"),
        (_with(server={"lrr": 0.5}), "'server.lrr'", "(did you mean 'server.lr'?)"),
        (_with(server={"xyzzy": 0.5}), "'server.xyzzy'",
         "allowed: optimizer, lr, momentum, nesterov, b1, b2, tau, initial_accumulator"),
        (_with(execution={"strategy": "pmap"}), "'execution.strategy'", "'vmap'"),
        (_with(rounds="ten"), "'rounds'", "an integer > 0, got 'ten'"),
        (_with(rounds="10"), "'rounds'", "an integer > 0"),
        (_with(rounds=...), "'rounds'", "required"),
        (_with(client_fraction=0.0), "'client_fraction'", "must be a number in (0, 1], got 0.0"),
        (_with(client_fraction=-0.5), "'client_fraction'", "(0, 1]"),
        (_with(client_fraction=1.5), "'client_fraction'", "(0, 1]"),
        (_with(local_epochs=0), "'local_epochs'", ">= 1"),
        (_with(batch_size=0), "'batch_size'", "an integer >= 1 or inf, got 0"),
        (_with(batch_size=2.5), "'batch_size'", "an integer >= 1 or inf"),
        (_with(target_accuracy=0), "'target_accuracy'", "(0, 1] or null"),
        (_with(target_accuracy=1.5), "'target_accuracy'", "(0, 1] or null"),
        (_with(client_lr=0), "'client_lr'", "> 0"),
        (_with(client_lr=True), "'client_lr'", "> 0"),
        (_with(server={"lr": -1.0}), "'server.lr'", "> 0"),
        (_with(server={"momentum": 1.0}), "'server.momentum'", "[0, 1)"),
        (_with(server={"optimizer": "rmsprop"}), "'server.optimizer'", "'sgd', 'momentum'"),
        (_with(server={"optimizer": "momentum", "nesterov": "yes"}), "'server.nesterov'",
         "true or false"),
        (_with(server="adam"), "'server'", "a section with keys optimizer, lr, momentum"),
        (_with(model="resnet"), "'model'", "'2nn', 'cnn'"),
        (_with(partition="shards"), "'partition'",
         "'iid', 'pathological', 'unbalanced', 'dirichlet'"),
        (_with(algorithm="fedsgd", local_epochs=5), "'local_epochs'", "must be 1"),
        (_with(algorithm="fedsgd", batch_size=10), "'batch_size'", "must be inf"),
    ],
)
def test_invalid_configs_name_the_key(write, data, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(write(data))
    message = str(info.value)
    assert "\n" not in message
    assert key in message and fragment in message


def test_fedsgd_fills_in_e1_binf():
    config = validate_config(_with(algorithm="fedsgd", local_epochs=..., batch_size=...))
    assert config.local_epochs == 1 and config.batch_size == math.inf
    explicit = validate_config(_with(algorithm="fedsgd", local_epochs=1, batch_size="inf"))
    assert explicit == config


def test_fedavg_requires_e_and_b():
    with pytest.raises(ConfigError, match="'local_epochs' is required"):
        validate_config(_with(local_epochs=...))


def test_set_overrides(write):
    path = write(VALID)
    config = load_config(
        path,
        [
            "server.lr=0.5",
            "batch_size=inf",
            "rounds=7",
            "client_lr=1e-3",
            "target_accuracy=null",
            "execution.strategy=sequential",
        ],
    )
    assert config.server.lr == 0.5 and config.server.optimizer == "momentum"
    assert config.batch_size == math.inf and config.rounds == 7 and config.client_lr == 1e-3
    assert config.target_accuracy is None and config.execution.strategy == "sequential"


def test_set_reaches_a_section_missing_from_the_file(write):
    config = load_config(write(_with(server=...)), ["server.optimizer=adam"])
    assert config.server.optimizer == "adam" and config.server.lr is None
    assert resolved_server_optimizer(config).hyperparameters["lr"] == 0.01  # adam's default


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("rounds", "malformed --set 'rounds'"),
        ("=3", "malformed"),
        ("server.=3", "malformed"),
        ("lr_client=0.1", "unknown config key 'lr_client' (did you mean 'client_lr'?)"),
        ("server.lrr=0.5", "unknown config key 'server.lrr' (did you mean 'server.lr'?)"),
        ("server.xyzzy=0.5",
         "unknown config key 'server.xyzzy' (allowed: optimizer, lr, momentum, nesterov, b1, "
         "b2, tau, initial_accumulator)"),
        ("rounds.x=1", "unknown config key 'rounds.x'"),
        ("client_fraction=0", "config key 'client_fraction'"),
        ("server.lr=[1", "not valid YAML"),
    ],
)
def test_bad_set_overrides(write, override, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(write(VALID), [override])
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(("typo", "message"), [
    ({"client_lrr": 0.1}, "unknown config key 'client_lrr' (did you mean 'client_lr'?)"),
    ({"privacy": {"mechanism": "gaussian", "clipp": 1.0, "noise_multiplier": 1.0}},
     "unknown config key 'privacy.clipp' (did you mean 'privacy.clip'?)"),
])
def test_a_misspelled_required_key_is_named_before_the_key_it_leaves_missing(write, typo,
                                                                            message):
    """`client_lrr` for `client_lr` also leaves `client_lr` missing (and a nested typo sits
    beside that error): the typo is what the user must fix, so it is the error."""
    data = {k: v for k, v in VALID.items() if k != "client_lr"}
    data.update(typo)
    with pytest.raises(ConfigError) as info:
        load_config(write(data))
    assert str(info.value) == message


def test_unreadable_or_malformed_files(write, tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(write("rounds: 3\nmodel: [2nn\n"))
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(write("- 1\n- 2\n"))
    with pytest.raises(ConfigError, match="'rounds' is required"):
        load_config(write(""))


@pytest.mark.parametrize(("text", "fragment"), [
    ("rounds: 3\nseed: 1\nrounds: 5\n", "key 'rounds' twice (lines 1 and 3)"),
    ("server:\n  lr: 0.5\n  optimizer: sgd\n  lr: 1\n", "key 'lr' twice (lines 2 and 4)"),
    ("server: {lr: 0.5, lr: 1}\n", "key 'lr' twice (line 1)"),
])
def test_a_key_given_twice_is_an_error_naming_it_and_its_lines(write, text, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(write(text))
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_yaml_merge_keys_may_be_overridden(write):
    text = yaml.safe_dump({k: v for k, v in VALID.items() if k != "server"})
    config = load_config(write(text + "server:\n  <<: {lr: 0.5, optimizer: sgd}\n  lr: 0.25\n"))
    assert config.server.lr == 0.25 and config.server.optimizer == "sgd"


def test_the_last_set_of_a_key_wins(write):
    assert load_config(write(VALID), ["rounds=3", "rounds=4"]).rounds == 4


def test_check_against_data():
    config = validate_config(_with(batch_size=1000))
    with pytest.raises(ConfigError) as info:
        check_against_data(config, [600, 300, 450])
    assert str(info.value) == (
        "config key 'batch_size': 1000 is larger than every client's data (max n_k = 600);"
        " use a value <= 600 or inf"
    )
    check_against_data(validate_config(_with(batch_size=600)), [600, 10])
    check_against_data(validate_config(_with(batch_size="inf")), [5])


def test_example_configs_validate():
    configs = resources.files("fedax") / "configs"
    fedavg = load_config(configs / "mnist_2nn_noniid_fedavg.yaml")
    assert (fedavg.algorithm, fedavg.model, fedavg.partition) == ("fedavg", "2nn", "pathological")
    assert (fedavg.client_fraction, fedavg.local_epochs, fedavg.batch_size) == (0.1, 1, 10)
    assert (fedavg.rounds, fedavg.eval_every, fedavg.target_accuracy) == (1000, 5, 0.97)
    fedsgd = load_config(configs / "mnist_2nn_noniid_fedsgd.yaml")
    assert (fedsgd.algorithm, fedsgd.local_epochs, fedsgd.batch_size) == ("fedsgd", 1, math.inf)
    assert (fedsgd.rounds, fedsgd.eval_every, fedsgd.client_lr) == (2000, 10, 0.5)


def test_model_names_match_the_model_registry():
    from fedax.models import MODEL_NAMES

    assert get_args(Config.model_fields["model"].annotation) == MODEL_NAMES


def test_algorithm_names_are_the_registry_at_validation_time():
    """The config's ``algorithm`` is read from the registry when a config is validated, so an
    algorithm registered after import (a user's own) is accepted, and an unknown name is
    refused in one line listing every registered one."""
    from fedax.algorithms import ALGORITHMS, AlgorithmSpec

    base = {"rounds": 1, "dataset": "synthetic", "num_clients": 4, "model": "logistic",
            "client_fraction": 0.5, "local_epochs": 1, "batch_size": 10, "client_lr": 0.1}
    with pytest.raises(ConfigError, match=r"^config key 'algorithm': must be one of "
                       + ", ".join(repr(n) for n in ALGORITHMS) + ", got 'mine'$"):
        validate_config({**base, "algorithm": "mine"})
    ALGORITHMS["mine"] = AlgorithmSpec("mine", ALGORITHMS["fedavg"].build, exact_sums=(),
                                       client_state=False)
    try:
        assert validate_config({**base, "algorithm": "mine"}).algorithm == "mine"
    finally:
        del ALGORITHMS["mine"]


def test_new_keys_are_validated(write):
    cases = [("mu=-1", "'mu'"), ("server.tau=-1", "'server.tau'"),
             ("server.tau=0", "'server.tau': server optimizer 'adam': tau = 0 needs"),
             ("server.b2=1.5", "'server.b2'"), ("dirichlet_alpha=0", "'dirichlet_alpha'"),
             ("similarity=2", "'similarity'"), ("dataset=cifar", "'dataset'")]
    for override, key in cases:
        with pytest.raises(ConfigError, match=key):
            load_config(write(VALID), ["server.optimizer=adam", "server.momentum=null",
                                       override])


def test_shakespeare_goes_with_the_char_lstm_and_its_own_partitions():
    from fedax.spec.config import ConfigError, validate_config

    base = {"rounds": 1, "dataset": "shakespeare", "model": "char_lstm",
            "algorithm": "fedavg", "client_fraction": 0.1, "local_epochs": 1,
            "batch_size": 10, "client_lr": 1.47}
    assert validate_config(base).partition == "natural"  # one client per role by default
    assert validate_config({**base, "partition": "iid"}).partition == "iid"
    cfg = validate_config({**base, "shakespeare": {"max_clients": 5, "sample": "line"}})
    assert cfg.shakespeare.max_clients == 5 and cfg.shakespeare.sample == "line"
    with pytest.raises(ConfigError, match="partition.*'natural'.*'iid'"):
        validate_config({**base, "partition": "pathological"})
    with pytest.raises(ConfigError, match="char_lstm"):
        validate_config({**base, "model": "2nn"})
    with pytest.raises(ConfigError, match="char_lstm"):
        validate_config({**base, "dataset": "mnist", "partition": "iid"})
    with pytest.raises(ConfigError, match="shakespeare.max_clients"):
        validate_config({**base, "shakespeare": {"max_clients": 0}})


# The server section: one spec (fedax.algorithms.server_optimizers), the keys from the specs.

_ONE_LINE_SERVER_ERRORS = [
    ("fedavg", {"b1": 0.9}, "config key 'server.b1': server optimizer 'sgd' (the default;"
     " choose one with server.optimizer) has no hyperparameter 'b1'; allowed: optimizer, lr"),
    ("fedprox", {"optimizer": "momentum", "tau": 0.1}, "config key 'server.tau': server"
     " optimizer 'momentum' has no hyperparameter 'tau'; allowed: optimizer, lr, momentum,"
     " nesterov"),
    ("fedadam", {"momentum": 0.9}, "config key 'server.momentum': server optimizer 'adam'"
     " (implied by algorithm 'fedadam') has no hyperparameter 'momentum'; allowed: optimizer,"
     " lr, b1, b2, tau, initial_accumulator"),
    ("fedadagrad", {"b2": 0.9}, "config key 'server.b2': server optimizer 'adagrad' (implied"
     " by algorithm 'fedadagrad') has no hyperparameter 'b2'"),
    ("fedavgm", {"b1": 0.9}, "config key 'server.b1': server optimizer 'momentum' (implied"),
    ("fedadam", {"optimizer": "sgd"}, "config key 'server.optimizer': algorithm 'fedadam' is"
     " FedAvg with server optimizer 'adam', got server optimizer 'sgd'"),
    ("fedavgm", {"optimizer": "adam"}, "config key 'server.optimizer': algorithm 'fedavgm'"),
    ("fedyogi", {"tau": 0}, "config key 'server.tau': server optimizer 'yogi': tau = 0 needs"
     " initial_accumulator > 0"),
]


@pytest.mark.parametrize(("algorithm", "server", "message"), _ONE_LINE_SERVER_ERRORS)
def test_a_server_key_that_does_not_apply_is_one_line_naming_it(write, algorithm, server,
                                                                 message):
    with pytest.raises(ConfigError) as info:
        load_config(write(_with(algorithm=algorithm, server=server)))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(("algorithm", "optimizer", "lr"), [
    ("fedavg", "sgd", 1.0), ("fedsgd", "sgd", 1.0), ("fedprox", "sgd", 1.0),
    ("scaffold", "sgd", 1.0), ("fedavgm", "momentum", 1.0), ("fedadagrad", "adagrad", 0.1),
    ("fedadam", "adam", 0.01), ("fedyogi", "yogi", 0.01), ("fedamsgrad", "amsgrad", 0.01),
])
def test_the_server_lr_defaults_to_the_optimizers_own(algorithm, optimizer, lr):
    data = _with(algorithm=algorithm, server=..., local_epochs=1, batch_size="inf")
    server = resolved_server_optimizer(validate_config(data))
    assert (server.name, server.hyperparameters["lr"]) == (optimizer, lr)
    assert "lr" in server.defaults
    # the implied optimizer may be named, and then is the same spec
    named = validate_config({**data, "server": {"optimizer": optimizer, "lr": 0.5}})
    assert resolved_server_optimizer(named).name == optimizer
    assert resolved_server_optimizer(named).hyperparameters["lr"] == 0.5
    assert "lr" not in resolved_server_optimizer(named).defaults


def test_the_server_section_is_written_with_the_keys_given():
    for server in ({}, {"lr": 0.5}, {"optimizer": "adam", "tau": 1e-4, "b2": 0.999},
                   {"optimizer": "momentum", "nesterov": True}):
        config = validate_config(_with(server=server))
        assert config_to_dict(config)["server"] == server
        assert validate_config(config_to_dict(config)) == config
    adam = resolved_server_optimizer(validate_config(_with(server={"optimizer": "adam",
                                                                   "tau": "1e-4"})))
    assert adam.hyperparameters["tau"] == 1e-4 and adam.hyperparameters["b2"] == 0.99
    assert adam.defaults == ("lr", "b1", "b2", "initial_accumulator")


def test_server_keys_come_from_the_server_optimizer_specs():
    from fedax.algorithms import SERVER_OPTIMIZERS
    from fedax.spec.config import ServerConfig

    keys = {k for spec in SERVER_OPTIMIZERS.values() for k in spec.hyperparameters}
    assert set(ServerConfig.model_fields) == {"optimizer"} | keys
    assert get_args(get_args(ServerConfig.model_fields["optimizer"].annotation)[0]) == tuple(
        SERVER_OPTIMIZERS)


def test_example_configs_run_server_sgd_at_one():
    configs = resources.files("fedax") / "configs"
    for name in ("mnist_2nn_noniid_fedavg.yaml", "mnist_2nn_noniid_fedsgd.yaml"):
        server = resolved_server_optimizer(load_config(configs / name))
        assert (server.name, dict(server.hyperparameters)) == ("sgd", {"lr": 1.0})


def test_set_null_unsets_a_key_so_switching_algorithm_works():
    """A shipped config pins server.optimizer: sgd; --set algorithm=fedadam names the key
    and how to unset it, and --set server.optimizer=null (its default: the optimizer the
    algorithm implies) makes it run; key=null restores any key's default."""
    from pathlib import Path

    import fedax
    from fedax.spec.config import ConfigError, load_config

    path = Path(fedax.__file__).parent / "configs" / "mnist_2nn_noniid_fedavg.yaml"
    with pytest.raises(ConfigError, match=r"server\.optimizer.*--set server\.optimizer=null"):
        load_config(path, ["algorithm=fedadam"])
    config = load_config(path, ["algorithm=fedadam", "server.optimizer=null"])
    assert config.algorithm == "fedadam" and config.server.optimizer is None
    with pytest.raises(ConfigError, match="config key 'client_lr' is required"):
        load_config(path, ["client_lr=null"])  # unset, and it has no default
    assert load_config(path, ["eval_every=7", "eval_every=null"]).eval_every == 1


def test_algorithm_options_come_from_the_registry():
    """``algorithm_options`` is validated against ``AlgorithmSpec.options`` (names and the
    default's type) and reaches the algorithm: SCAFFOLD's weighting is settable from YAML."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from conftest import TINY_CONFIG

    from fedax.algorithms import CohortBatches
    from fedax.builder.build import build_algorithm
    from fedax.client import Batches

    base = {**yaml.safe_load(TINY_CONFIG), "algorithm": "scaffold"}

    def apply(params, x):
        return x @ params["w"]

    rounds = {}
    for weighting in ("uniform", "num_examples"):
        config = validate_config({**base, "algorithm_options": {"weighting": weighting}})
        assert config_to_dict(config)["algorithm_options"] == {"weighting": weighting}
        algorithm = build_algorithm(config, apply, num_clients=2)
        params = {"w": jnp.zeros((3, 2))}
        x = jnp.ones((2, 1, 4, 3)) * jnp.array([1.0, -1.0])[:, None, None, None]
        y = jnp.zeros((2, 1, 4), jnp.int32)
        mask = jnp.ones((2, 1, 4)).at[1, 0, 1:].set(0.0)  # n_k = 4 and 1
        cohort = CohortBatches(Batches(x, y, mask), jnp.array([4.0, 1.0]),
                               jnp.array([0, 1], jnp.int32))
        state = algorithm.init(params, jax.random.key(0))
        state, _ = algorithm.round(state, cohort, jax.random.key(1))
        rounds[weighting] = algorithm.server_params(state)["w"]
    # n_k weights move the model towards client 0's update: another model
    assert not np.allclose(rounds["uniform"], rounds["num_examples"])
    assert "algorithm_options" not in config_to_dict(validate_config(base))
    with pytest.raises(ConfigError, match="'algorithm_options.weighting': must be a str"):
        validate_config({**base, "algorithm_options": {"weighting": 3}})
    with pytest.raises(ConfigError, match="has no option 'mu' \\(its options: weighting\\)"):
        validate_config({**base, "algorithm_options": {"mu": 0.1}})
    with pytest.raises(ValueError, match="weighting must be 'uniform' or 'num_examples'"):
        build_algorithm(validate_config({**base, "algorithm_options": {"weighting": "n"}}),
                        apply, num_clients=2)
