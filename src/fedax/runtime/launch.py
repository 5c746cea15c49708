"""``execution.mode: network`` from an experiment config: the same YAML the simulator runs,
on a gRPC server (TLS, client tokens) with real client processes. This module holds the
runtime's part of it; the driver, ``fedax.experiments.network.run_network`` (what ``fedax
run CONFIG --set execution.mode=network`` does), starts the server and writes the records.

``network_task`` serializes the config's task part as the runtime ``Task``
(``Task.from_config``: every key but the engine sections) with the population N, one
example's shape and the model's arguments; ``network_setup`` is the development PKI (or the
``network.setup`` a ``fedax server init`` wrote); ``spawn_clients`` starts
``network.local_clients`` ``fedax client`` processes on loopback that host the N clients
between them. Each client process loads the same config's partition for its ids
(``client_examples``), receives the task at Join and rebuilds it with the one builder
(``fedax.builder.build``), so the three engines run the same algorithm.

With ``network.server_randomness: seed`` the server uses the config's seed for its keys and
its selection, as the simulator does, and with no faults the run equals ``mode: sync`` to
float tolerance (tests/test_engines.py); ``secret`` (the default) is a deployment's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from fedax.builder.datasets import FederatedData, build_data
from fedax.io import write_json
from fedax.runtime.security import Registry, make_dev_pki
from fedax.runtime.task import Task
from fedax.spec.config import Config, config_to_dict


def network_task(config: Config, data: FederatedData) -> Task:
    """The runtime ``Task`` of ``config`` on its data: the config's task part with N, one
    example's shape and the model's arguments; a secure mean's ``secure.max_weight``, when
    not given, is the data's largest n_k, as the simulator takes it."""
    train = data.train
    secure, private = config.secure, config.privacy is not None and config.privacy.level == "user"
    if secure is not None and secure.max_weight is None and not private:
        largest = float(max(1, int(max(train.sizes))))
        config = config.model_copy(update={"secure": secure.model_copy(
            update={"max_weight": largest})})
    tokens = np.issubdtype(np.asarray(train.x[:1]).dtype, np.integer)
    return Task.from_config(config, num_clients=train.num_clients,
                            input_shape=list(train.x.shape[1:]),
                            model_options=dict(data.model_kwargs),
                            sequence=data.y_test.ndim > 1,
                            input_dtype="int32" if tokens else "float32",
                            label_shape=list(train.y.shape[1:]))


def client_examples(config: Config, ids: list[int]) -> dict[int, tuple[Any, Any, Any]]:
    """Client k's own examples ``(x, y, test)`` for each k in ``ids``: the config's
    partition, as the simulator deals it (``fedax client --config``); ``test`` its own test
    examples ``(x, y)`` with ``per_client_eval`` (None without)."""
    data = build_data(config)
    train = data.train
    bad = [k for k in ids if not 0 <= k < train.num_clients]
    if bad:
        raise ValueError(f"client ids {bad} are not in the config's population 0.."
                         f"{train.num_clients - 1}")
    out = {}
    for k in ids:
        test = None
        if data.test_clients is not None:
            own = data.test_clients == k
            test = (data.x_test[own], data.y_test[own])
        out[k] = (train.x[train.client_indices(k)], train.y[train.client_indices(k)], test)
    return out


def network_setup(config: Config, out: Path, num_clients: int) -> Path:
    """The PKI and registry: ``network.setup``, or a development one in ``out/network``
    (made once; a resumed run keeps it)."""
    given = config.network.setup
    setup = Path(given) if given else out / "network"
    registry = setup / "registry.json"
    if not registry.exists():
        if given:
            raise ValueError(f"network.setup {given!r} holds no registry.json; run fedax "
                             "server init DIR first, or drop network.setup")
        make_dev_pki(setup, num_clients, hosts=("127.0.0.1", "localhost"))
    clients = len(Registry.load(str(registry)).clients)
    if clients < num_clients:
        raise ValueError(f"the registry in {setup} has {clients} clients, the config's data "
                         f"{num_clients}; make a setup for {num_clients} clients")
    return setup


def spawn_clients(config: Config, setup: Path, out: Path, port: int,
                   num_clients: int) -> list[subprocess.Popen]:
    """``network.local_clients`` ``fedax client`` processes on loopback, each hosting a
    contiguous range of the ids."""
    processes = min(config.network.local_clients, num_clients)
    if processes == 0:
        return []
    spec = write_json(out / "network" / "config.json", config_to_dict(config), indent=1)
    bounds = np.linspace(0, num_clients, processes + 1).round().astype(int)
    logs = out / "network" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for j in range(processes):
        first, last = int(bounds[j]), int(bounds[j + 1]) - 1
        command = [sys.executable, "-m", "fedax.cli.main", "client",
                   "--server", f"127.0.0.1:{port}", "--ca", str(setup / "ca.pem"),
                   "--config", str(spec), "--id", f"{first}-{last}",
                   "--token-file", str(setup / "tokens" / "{id}.token"),
                   *(["--identity", str(setup / "identities" / "{id}.key"),
                      "--roster", str(setup / "roster.json")]
                     if (setup / "roster.json").exists() else []),
                   "--state-dir", str(out / "network" / "clients" / "{id}"),
                   "--reconnect-s", "60"]
        with open(logs / f"clients_{first}-{last}.log", "wb") as err:
            procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err,
                                          env=dict(os.environ)))
    return procs
