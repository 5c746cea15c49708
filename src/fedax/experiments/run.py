"""Build and run one experiment from a validated config; write its outputs.

Outputs in ``out_dir``: ``metrics.jsonl`` (one JSON object per evaluation), ``summary.json``
(config, seed, final accuracy, rounds to target, the server optimizer with every
hyperparameter and which are defaults) and ``accuracy.png``; with
``checkpoint_every > 0``, ``checkpoints/ckpt_<round>.msgpack`` (the last two), from which
``resume=True`` continues: ``metrics.jsonl`` then ends up as an uninterrupted run's.

Nothing is lost on the way: a run touches no earlier output until its first evaluation (so
a refused resume or a failed start leaves the directory as it was), ``summary.json``,
``accuracy.png`` and every rewrite of ``metrics.jsonl`` are written atomically, and the
JSON is strict: a non-finite number is written as ``null`` and marks its record (and the
summary) ``"status": "diverged"``; other records say ``"status": "ok"``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedax.builder.build import build, param_count
from fedax.builder.datasets import build_data
from fedax.builder.features import (
    TALLIED,
    RoundTally,
    attack_plan,
    feature_summaries,
    with_backdoor,
)
from fedax.builder.privacy_plan import PrivacyPlan, cohort_size, privacy_plan
from fedax.experiments.outputs import JsonlWriter, write_outputs
from fedax.experiments.resume import _fingerprint, resume_schedule
from fedax.experiments.summary import summarize
from fedax.simulation import Execution, choose_execution, make_evaluator, run
from fedax.simulation.evaluation import make_client_evaluator
from fedax.simulation.host import cpu_dots_for, cpu_has_bf16, preferred_cpu_dots
from fedax.simulation.sources import HoldoutSource, PartitionSource
from fedax.spec.config import Config, check_against_data


def _check_precision_hardware(precision: str) -> None:
    """Warn where ``precision: bfloat16`` runs on a CPU: the numbers are bfloat16 compute's
    either way, but XLA:CPU ran it slower than float32 here, even with AMX-BF16
    (``benchmarks/bench_precision.py``); it pays on GPUs."""
    import jax

    if jax.default_backend() == "cpu":
        has = "with" if cpu_has_bf16() else "without"
        warnings.warn(f"precision: {precision} on a CPU ({has} bfloat16 arithmetic): XLA:CPU "
                      "ran the MNIST CNN and the char-LSTM slower than float32 "
                      "(benchmarks/bench_precision.py); it pays on GPUs. Drop the key for "
                      "float32", RuntimeWarning, stacklevel=2)



def run_experiment(
    config: Config,
    out_dir: str | Path,
    *,
    progress: bool = True,
    label: str | None = None,
    resume: bool = False,
    title: str | None = None,
    tensorboard: bool = True,
) -> dict[str, Any]:
    """Run ``config`` and write ``metrics.jsonl``, ``summary.json`` and ``accuracy.png``
    (with ``per_client_eval``, also ``client_accuracy.png``), and with ``tensorboard`` the
    TensorBoard event files of every record into ``tensorboard/``.

    With ``resume``, continue from the newest valid checkpoint in ``out_dir/checkpoints``
    (the config must be the same, ``checkpoint_every`` and the schedule of
    :func:`resume_schedule` aside: ``rounds`` may grow; else ``CheckpointError``, and
    nothing in ``out_dir`` has changed). A run that restores no checkpoint replaces the
    directory's earlier outputs at its first evaluation. A run that diverges still writes
    its summary (``"status": "diverged"``) and plot, then raises its ``FloatingPointError``.
    ``label`` names the curve (default: the algorithm), ``title`` the plot (default:
    ``label`` or the directory's name).

    Every ``execution.mode`` runs from here: ``sync`` and ``async`` in this process (the
    simulator), ``network`` on a gRPC server with ``network.local_clients`` client
    processes on this machine (``fedax.experiments.network.run_network``; with none, the server
    waits for clients started elsewhere). ``summary.json``'s ``engine`` names the one that
    ran."""
    if config.execution.mode == "network":
        return _run_network(config, out_dir, progress=progress, label=label, resume=resume,
                            title=title)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = build_data(config)
    attack = attack_plan(config, data)
    if attack is not None:
        data = attack.data
    train = data.train
    check_against_data(config, train.sizes)
    if config.precision != "float32":
        _check_precision_hardware(config.precision)
    algorithm, model, params, plan = build(
        config, num_clients=train.num_clients, model_kwargs=data.model_kwargs,
        sequence=data.y_test.ndim > 1, client_sizes=train.sizes)
    # What a resume may change (the schedule); raises, changing nothing, if it cannot.
    schedule = () if not resume else resume_schedule(
        config, out, plan, lambda c: privacy_plan(c, train.num_clients, train.sizes,
                                                  dim=param_count(params)))
    evaluate: Callable[[Any], Any]  # a dict of named values, or (accuracy, loss)
    if data.test_clients is not None:
        evaluate = make_client_evaluator(model.apply, data.x_test, data.y_test,
                                         data.test_clients, target=config.target_accuracy,
                                         num_clients=train.num_clients)
    else:
        evaluate = make_evaluator(model.apply, data.x_test, data.y_test)
    if attack is not None:
        from fedax.attacks import attacked

        algorithm = attacked(algorithm, attack.adversary, train.num_clients,
                             attackers=attack.attackers)
        if attack.backdoor is not None:
            evaluate = with_backdoor(evaluate, make_evaluator(model.apply, *attack.backdoor))
    devices = config.execution.devices
    if config.execution.mode == "async" and devices == "auto":
        devices = 1  # FedBuff's clock runs in one process on one device
    execution: Execution = choose_execution(
        config.execution.strategy, config.execution.local_steps, devices, params=params,
    )

    writer, callbacks, round_callbacks, tally = _recorders(config, out, tensorboard)
    label = label or config.algorithm
    title = title or label or out.name
    started = time.perf_counter()
    sampling = "fixed" if plan is None or config.privacy is None else config.privacy.sampling
    partition = PartitionSource(
        train, config.client_fraction, config.local_epochs, config.batch_size, config.seed,
        config.stragglers, config.drop_stragglers, sampling=sampling)
    source: PartitionSource | HoldoutSource = partition
    if config.server.lr == "learned":
        # the holdout cohort is the train cohort's size m unless set (under privacy the plan
        # requires m: its hypergradient's fixed denominator and sampling rate)
        source = HoldoutSource(partition, config.learned_lr.holdout_clients
                               or cohort_size(config, train.num_clients))
    try:
        with preferred_cpu_dots(cpu_dots_for(config.model, config.precision)):
            kit = _run_kit(config, plan, execution, callbacks, out, resume)
            if config.execution.mode == "async":
                history = _run_async(config, algorithm, params, source, evaluate, kit,
                                     train.num_clients)
            else:
                steps = kit.pop("steps")
                history = run(algorithm, params, source, evaluate, rounds=steps,
                              round_callbacks=round_callbacks, progress=progress,
                              schedule=schedule, **kit)
    except FloatingPointError as err:
        writer.start()
        summary = summarize(config, writer.records, time.perf_counter() - started, execution,
                            plan=plan)
        summary.update(status="diverged", diverged_at_round=getattr(err, "round", None),
                       error=str(err))
        summary.update(feature_summaries(config, params, attack, tally))
        write_outputs(out, summary, writer.records, label, title)
        raise
    finally:
        for callback in callbacks:
            getattr(callback, "close", lambda: None)()
    summary = summarize(config, history.records, time.perf_counter() - started, execution,
                        resumed_from=history.resumed_from, plan=plan)
    summary.update(feature_summaries(config, params, attack, tally))
    write_outputs(out, summary, history.records, label, title)
    return summary


def _recorders(config: Config, out: Path, tensorboard: bool):
    """``(writer, callbacks, round_callbacks, tally)``: ``metrics.jsonl``'s writer (whose
    first record replaces a fresh run's earlier outputs), the TensorBoard logger and the
    summary's per-round tally."""

    def replace_earlier_outputs() -> None:
        for name in ("summary.json", "accuracy.png", "client_accuracy.png"):
            (out / name).unlink(missing_ok=True)
        if not config.checkpoint_every:  # else the runner has already replaced them
            from fedax.simulation.checkpoint import remove_checkpoints

            remove_checkpoints(out / "checkpoints")

    writer = JsonlWriter(out / "metrics.jsonl", on_start=replace_earlier_outputs)
    callbacks: list[Any] = [writer]
    round_callbacks: list[Any] = []
    if tensorboard:  # after the writer: its on_start replaces earlier outputs first
        from fedax.simulation.tensorboard import TensorBoardLogger

        board = TensorBoardLogger(out / "tensorboard")
        callbacks.append(board)
        round_callbacks.append(board.on_round)
    tally = RoundTally(TALLIED)  # the summary's totals over every round
    callbacks.append(tally)
    round_callbacks.append(tally.on_round)
    return writer, callbacks, round_callbacks, tally


def _run_kit(config: Config, plan: PrivacyPlan | None, execution: Execution,
             callbacks: list[Any], out: Path, resume: bool) -> dict[str, Any]:
    """The keyword arguments both simulated engines take (``steps`` the rounds or server
    updates): a privacy budget ends the run before the step that would exceed it, and the
    fingerprint holds the algorithm, model and data choices the runner cannot see (how often
    to save does not change the run, so a resumed run may save more or less often)."""
    return {"steps": config.rounds if plan is None else plan.rounds, "seed": config.seed,
            "eval_every": config.eval_every, "target_accuracy": config.target_accuracy,
            "stop_at_target": config.stop_at_target, "execution": execution,
            "callbacks": callbacks, "checkpoint_dir": out / "checkpoints",
            "checkpoint_every": config.checkpoint_every, "resume": resume,
            "fingerprint": _fingerprint(config),
            "record_fields": None if plan is None else (
                lambda t: {"epsilon": plan.epsilon(t)}),
            "max_rejected_fraction": config.max_rejected_fraction}


def _run_async(config: Config, algorithm, params, source, evaluate, kit: dict[str, Any],
               num_clients: int):
    """``execution.mode: async``: FedBuff on the virtual clock over the same algorithm,
    data, evaluation and outputs, ``rounds`` server updates of ``asynchronous.buffer_size``
    updates each (``fedax.simulation.asynchronous.run_async``; with privacy, lockstep
    only: a flush is a round)."""
    from fedax.builder.asynchronous import async_settings
    from fedax.simulation.asynchronous import run_async

    settings = async_settings(config, num_clients)
    steps = kit.pop("steps")
    return run_async(algorithm, params, source, evaluate, settings, server_updates=steps,
                     **kit)


def _run_network(config: Config, out_dir: str | Path, **options) -> dict[str, Any]:
    """``execution.mode: network``: the runtime's server and local client processes (it
    writes the same outputs; TensorBoard files are the simulator's alone)."""
    import os

    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # gRPC's C core logs to stderr
    from fedax.experiments.network import run_network

    return run_network(config, out_dir, **options)
