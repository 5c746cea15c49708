"""The driver of ``execution.mode: network``: a server and ``network.local_clients`` client
processes on this machine (``fedax.runtime.launch``), with the simulator's outputs
(``metrics.jsonl`` as the rounds close, ``summary.json`` naming the engine, ``accuracy.png``).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fedax.builder.datasets import build_data
from fedax.builder.privacy_plan import cohort_size, privacy_plan
from fedax.experiments.outputs import JsonlWriter, write_outputs
from fedax.experiments.summary import summarize
from fedax.runtime.config import ServerConfig
from fedax.runtime.launch import network_setup, network_task, spawn_clients
from fedax.runtime.secagg.identity import Roster
from fedax.runtime.security import Registry, ServerTLS
from fedax.runtime.server import Server
from fedax.spec.config import Config, check_against_data
from fedax.spec.errors import CommandError


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

    from fedax.builder.build import param_count
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
    setup = network_setup(config, out, train.num_clients)
    evaluate_fn = make_evaluator(model.apply, data.x_test, data.y_test)

    rounds = config.rounds if plan is None else plan.rounds
    running: list[Server] = []
    server_class: type[Server] = Server
    extra: dict[str, Any] = {}
    if net.asynchronous:  # FedBuff on the server: rounds count server steps
        from fedax.builder.asynchronous import async_settings
        from fedax.runtime.async_server import AsyncServer

        server_class = AsyncServer
        extra = {"buffered": async_settings(config, train.num_clients)}
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
        roster=Roster.load(setup / "roster.json") if (setup / "roster.json").exists() else None,
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
    procs = spawn_clients(config, setup, out, port, train.num_clients)
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
