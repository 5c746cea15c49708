"""A config's data: the data set, partitioned into clients, and the model's keyword
arguments that fit it (``build_data``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from fedax import data as fdata
from fedax.simulation.evaluation import client_index
from fedax.spec.config import (
    Config,
)

_DATASETS: dict[str, Any] = {}


def load_dataset(name: str) -> dict[str, np.ndarray]:
    """The named data set as NumPy arrays (cached in-process)."""
    loaders = {"mnist": fdata.load_mnist, "fashion_mnist": fdata.load_fashion_mnist}
    if name not in _DATASETS:
        if name not in loaders:
            raise ValueError(f"unknown dataset {name!r}; allowed: {', '.join(loaders)}")
        _DATASETS[name] = loaders[name]()
    return _DATASETS[name]


def partition(config: Config, y: np.ndarray) -> list[np.ndarray]:
    if config.partition == "iid":
        return fdata.iid(len(y), config.num_clients, config.seed)
    if config.partition == "pathological":
        return fdata.pathological(y, config.num_clients, 2, seed=config.seed)
    if config.partition == "dirichlet":
        return fdata.dirichlet(y, config.num_clients, config.dirichlet_alpha, config.seed)
    if config.partition == "similarity":
        return fdata.similarity(y, config.num_clients, config.similarity, config.seed)
    return fdata.unbalanced(len(y), config.num_clients, config.seed)


class FederatedData(NamedTuple):
    """What a run needs from its data set: the clients' training data, a pooled test set,
    and the keyword arguments the model needs to fit the data (e.g. a vocabulary size)."""

    train: fdata.ClientData
    x_test: np.ndarray
    y_test: np.ndarray
    model_kwargs: dict[str, Any]
    # [N_test] int: the client of each test example (-1: none), with per_client_eval
    test_clients: np.ndarray | None = None


def _linear_kwargs(config: Config, x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    """``model: logistic`` takes its input size and class count from the data."""
    if config.model != "logistic":
        return {}
    return {"input_dim": int(np.prod(x.shape[1:])), "num_classes": int(y.max()) + 1}


def _image_data(config: Config) -> FederatedData:
    arrays = load_dataset(config.dataset)
    train = fdata.ClientData.from_partition(
        arrays["x_train"], arrays["y_train"], partition(config, arrays["y_train"])
    )
    # Each client's test data: the test set dealt by the same partitioner (same seed).
    test_clients = None if not config.per_client_eval else client_index(
        partition(config, arrays["y_test"]), len(arrays["y_test"]))
    return FederatedData(train, arrays["x_test"], arrays["y_test"],
                         _linear_kwargs(config, arrays["x_train"], arrays["y_train"]),
                         test_clients)


def _synthetic_data(config: Config) -> FederatedData:
    """Synthetic(α, β) with ``num_clients`` devices (seeded by ``seed``); each device's 90/10
    train/test split, the test splits pooled into the test set."""
    options = config.synthetic
    train, test = fdata.synthetic(options.alpha, options.beta, config.num_clients,
                                  seed=config.seed, iid=options.iid)
    test_clients = None if not config.per_client_eval else client_index(
        [test.indices[a:b] for a, b in zip(test.offsets[:-1], test.offsets[1:], strict=True)],
        len(test.y))
    return FederatedData(train, test.x, test.y, _linear_kwargs(config, train.x, train.y),
                         test_clients)


# The parsed data of the last options used (a reproduction runs many cells on the same data).
_load_shakespeare = functools.lru_cache(maxsize=1)(fdata.load_shakespeare)


def _shakespeare_data(config: Config) -> FederatedData:
    """Shakespeare by role (``partition: natural``) or its balanced IID variant, the test
    lines of every role pooled into the test set; next-character prediction."""
    options = config.shakespeare
    arrays = _load_shakespeare(
        iid=config.partition == "iid", seq_len=options.seq_len,
        max_clients=options.max_clients, sample=options.sample, seed=config.seed)
    train = fdata.ClientData.from_partition(arrays["x_train"], arrays["y_train"],
                                            arrays["train_partition"])
    # Each role's own test lines (with partition: iid too: the roles' lines are theirs).
    test_clients = None if not config.per_client_eval else client_index(
        arrays["test_partition"], len(arrays["y_test"]))
    return FederatedData(train, arrays["x_test"], arrays["y_test"],
                         {"vocab_size": int(arrays["vocab_size"])}, test_clients)


# config.dataset -> builder. A data set whose labels are [N, T] (sequences) is trained and
# evaluated per token, PAD (id 0) targets ignored.
DATA_BUILDERS: dict[str, Callable[[Config], FederatedData]] = {
    "mnist": _image_data,
    "fashion_mnist": _image_data,
    "synthetic": _synthetic_data,
    "shakespeare": _shakespeare_data,
}


def build_data(config: Config) -> FederatedData:
    if config.dataset not in DATA_BUILDERS:
        raise ValueError(f"unknown dataset {config.dataset!r}; "
                         f"allowed: {', '.join(DATA_BUILDERS)}")
    return DATA_BUILDERS[config.dataset](config)
