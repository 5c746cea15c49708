"""``execution.mode: network`` from an experiment config: the same YAML the simulator runs,
on a gRPC server (TLS, client tokens) with real client processes.

``run_network(config, out)`` is what ``fedax run CONFIG --set execution.mode=network``
does: it builds the config's data (to evaluate on its test set and to know the population
N, one example's shape and the model's arguments), serializes the config's task part as the
runtime ``Task`` (``Task.from_config``: every key but the engine sections), starts the
server with a development PKI (or the ``network.setup`` a ``fedax server init`` wrote), and
starts ``network.local_clients`` ``fedax client`` processes on loopback that host the N
clients between them. Each client process loads the same config's partition for its ids
(``client_examples``), receives the task at Join and rebuilds it with the one builder
(``fedax.experiments.build``), so the three engines run the same algorithm. The outputs are
the simulator's (``metrics.jsonl``, ``summary.json``, ``accuracy.png``), each record with
the network's own numbers (selected, reported, rejected, dropped, bytes, round time).

With ``network.server_randomness: seed`` the server uses the config's seed for its keys and
its selection, as the simulator does, and with no faults the run equals ``mode: sync`` to
float tolerance (tests/test_engines.py); ``secret`` (the default) is a deployment's.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedax.experiments.config import Config, check_against_data, config_to_dict
from fedax.experiments.datasets import FederatedData, build_data
from fedax.experiments.errors import CommandError
from fedax.experiments.outputs import JsonlWriter, write_outputs
from fedax.experiments.privacy_plan import cohort_size, privacy_plan
from fedax.experiments.summary import summarize
from fedax.io import write_json
from fedax.runtime.config import ServerConfig
from fedax.runtime.security import Registry, ServerTLS, make_dev_pki
from fedax.runtime.server import Server
from fedax.runtime.task import Task

log = logging.getLogger("fedax.runtime.launch")
# The network's own numbers, kept in each record beside the evaluation.
NETWORK_FIELDS = ("attempt", "selected", "reported", "rejected", "dropped", "unneeded",
                  "bytes_in", "bytes_out", "round_s")


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


def _setup(config: Config, out: Path, num_clients: int) -> Path:
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


def _spawn_clients(config: Config, setup: Path, out: Path, port: int,
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
                   "--state-dir", str(out / "network" / "clients" / "{id}"),
                   "--reconnect-s", "60"]
        with open(logs / f"clients_{first}-{last}.log", "wb") as err:
            procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err,
                                          env=dict(os.environ)))
    return procs


def _record(closed: dict[str, Any], plan: Any) -> dict[str, Any]:
    """A server's closed round as the simulator's record (``round`` counts rounds done),
    with the network's numbers and, under privacy, the ε spent so far."""
    record = {"round": closed["round"] + 1,
              **{k: v for k, v in closed.items() if k != "round"}}
    if plan is not None:
        record["epsilon"] = plan.epsilon(record["round"])
    return record


def _record_writer(server: Server, out: Path, plan: Any, resume: bool) -> JsonlWriter:
    """``metrics.jsonl`` as the rounds close (each record once its round is checkpointed;
    a resumed run's file first holds the checkpoint's rounds, as the simulator's does)."""
    writer = JsonlWriter(out / "metrics.jsonl")
    if resume and server.history:
        writer.on_resume([_record(r, plan) for r in server.history])
    server.on_round.append(lambda closed: writer(_record(closed, plan)))
    return writer


def run_network(config: Config, out_dir: str | Path, *, progress: bool = True,
                resume: bool = False, label: str | None = None,
                title: str | None = None,
                server_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run ``config`` (``execution.mode: network``) on a server and client processes on
    this machine; write the simulator's outputs into ``out_dir`` and return the summary.
    ``server_options``: more ``ServerConfig`` fields (polling, liveness, message sizes,
    kept checkpoints) than the ``network:`` section sets."""
    import jax

    from fedax.experiments.build import param_count
    from fedax.models import get_model, with_precision
    from fedax.simulation import make_evaluator

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = build_data(config)
    train = data.train
    check_against_data(config, train.sizes.tolist())
    task = network_task(config, data)
    model = with_precision(get_model(config.model, **data.model_kwargs), config.precision)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    plan = privacy_plan(config, train.num_clients, train.sizes, dim=param_count(shapes))
    net = config.network
    setup = _setup(config, out, train.num_clients)
    evaluate_fn = make_evaluator(model.apply, data.x_test, data.y_test)

    rounds = config.rounds if plan is None else plan.rounds
    running: list[Server] = []
    server_class: type[Server] = Server
    extra: dict[str, Any] = {}
    if net.asynchronous:  # FedBuff on the server: rounds count server steps
        from fedax.runtime.async_server import AsyncServer, Buffered
        from fedax.simulation.asynchronous import Staleness

        a, m = config.asynchronous, cohort_size(config, train.num_clients)
        server_class, extra = AsyncServer, {"buffered": Buffered(
            a.buffer_size or m, a.concurrency or m, Staleness(**a.staleness.model_dump()),
            a.max_staleness, a.weighting)}
        if net.local_clients:  # trips start once every client is up
            extra["start_with"] = train.num_clients

    def evaluate(params) -> dict[str, float]:
        done = running[0].rounds_done + 1  # the round being installed
        if done % config.eval_every and done != rounds:
            return {}
        accuracy, loss = evaluate_fn(params)
        return {"test_accuracy": float(accuracy), "test_loss": float(loss)}

    server = server_class(
        task,
        ServerConfig(rounds=rounds, cohort_size=net.cohort_size or cohort_size(
                         config, train.num_clients),
                     over_selection=float(net.over_selection), min_reports=net.min_reports,
                     deadline_s=float(net.deadline_s), max_attempts=net.max_attempts,
                     checkpoint_dir=str(out / "checkpoints"), max_examples=net.max_examples,
                     # local clients host the whole population: wait for all of them, so
                     # that the first round selects from N as later ones (and the simulator)
                     **{"min_clients": train.num_clients if net.local_clients else None,
                        **(server_options or {})}),
        ServerTLS(str(setup / "server.pem"), str(setup / "server.key")),
        Registry.load(str(setup / "registry.json")), address=f"{net.host}:{net.port}",
        resume=resume, evaluate=evaluate,
        simulator_seed=config.seed if net.server_randomness == "seed" else None, **extra)
    if config.per_client_eval:  # the clients evaluate on their own test data
        server.client_eval = lambda done: not done % config.eval_every or done == rounds
        server.client_eval_target = config.target_accuracy
    running.append(server)
    writer = _record_writer(server, out, plan, resume)
    started = time.perf_counter()
    port = server.start()
    if progress:
        print(f"fedax run: server on {net.host}:{port}; {net.local_clients} client "
              f"processes host {train.num_clients} clients", file=sys.stderr, flush=True)
    procs = _spawn_clients(config, setup, out, port, train.num_clients)
    try:
        _wait(server, procs, out, progress, rounds)
        _linger(procs, 5.0)  # polling clients hear "done" and leave by themselves
    finally:
        server.stop()
        for proc in procs:  # the rest (e.g. reconnecting to the stopped server) are ended
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
    summary = summarize(config, writer.records, time.perf_counter() - started,
                        {"mode": "network", "local_clients": net.local_clients,
                         "port": port}, plan=plan)
    label = label or config.algorithm
    write_outputs(out, summary, writer.records, label, title or label or out.name)
    return summary


def _linger(procs: list[subprocess.Popen], seconds: float) -> None:
    """Up to ``seconds`` for the client processes to end by themselves."""
    end = time.monotonic() + seconds
    while procs and any(p.poll() is None for p in procs) and time.monotonic() < end:
        time.sleep(0.1)


def _wait(server: Server, procs: list[subprocess.Popen], out: Path, progress: bool,
          rounds: int) -> None:
    """Until the server has run every round; a server error, or every client process
    gone before that, ends the run with one line."""
    shown = 0
    while not server.wait(0.5):
        if progress and len(server.history) > shown:
            shown = len(server.history)
            record = server.history[-1]
            accuracy = record.get("test_accuracy")
            print(f"fedax run: round {shown}/{rounds}"
                  + ("" if accuracy is None else f", test accuracy {accuracy:.4f}"),
                  file=sys.stderr, flush=True)
        if procs and all(p.poll() is not None for p in procs):
            logs = out / "network" / "logs"
            raise CommandError(f"every client process ended before the server's last round; "
                               f"see {logs}")
