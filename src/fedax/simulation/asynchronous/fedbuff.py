"""Asynchronous buffered aggregation on a virtual clock: FedBuff and FedAsync (synchronous
FedAvg measured on the same clock: ``fedax.simulation.asynchronous.synchronous``).

FedBuff (Nguyen et al., AISTATS 2022, arXiv 2106.06639; FLSim's ``FedBuffAggregator``;
docs/references.md, asynchronous aggregation). ``concurrency`` M clients train at every moment (a
closed loop: when a client's trip ends, a new client starts at that instant). A client downloads the
current model w_v (version v) and returns Δ_i = w_v − w_i (the algorithm's own ``client_update``,
unchanged). When it arrives, the server is at version v' ≥ v; its staleness is
τ_i = v' − v, and it goes into the buffer (unless it is not finite, or τ_i exceeds
``max_staleness``: then it is dropped and counted). When K = ``buffer_size`` updates are
buffered, the server takes one step with

    Δ̄ = Σ_{i∈buffer} (w_i / Σ_j w_j) · s(τ_i) · Δ_i,        w ← server_update(w, Δ̄),

where w_i is the client's weight (the algorithm's n_k, or 1 with ``weighting="equal"``,
FLSim's default) and s the staleness weight (``Staleness``; FedBuff's 1/√(1 + τ)). With
equal weights Δ̄ = (1/K) Σ s(τ_i) Δ_i, FedBuff's Algorithm 1; the server learning rate η_g
is the algorithm's server optimizer (``fedavg(..., server_optimizer=optax.sgd(η_g))``:
w ← w − η_g Δ̄).

FedAsync (Xie, Koyejo, Gupta 2019) is ``fedasync()``: K = 1 and ``mixing=True``. Each
arrival is mixed into the current model, x ← (1 − α s(τ)) x + α s(τ) x_i, i.e. the value
aggregated is w_{v'} − w_i (the current model minus the client's local model, FLSim's
``fed_async_aggregation``) instead of the client's own Δ_i, and α is the server SGD rate.

**Same pieces.** Everything runs the algorithm's ``RoundPieces``: ``payload`` and
``client_update`` when a client starts, ``server_update`` at every buffer flush. Clients
that start on the same model version are computed together in one compiled call
(``map_clients`` over up to K clients, padded to K): a client's update is computed when it
starts and delivered when its trip ends, held meanwhile in a device pool of M + K rows.
The compiled functions, and how the aggregator's client stage, reduction and server stage
compose with the buffer (DP's ``dp_gaussian(S, z, D)`` with D = K), are in
``fedax.simulation.asynchronous.updates``; ``AsyncConfig`` is in
``fedax.simulation.asynchronous.config``. DP accounting for asynchronous participation is
not provided.

**Determinism and resume.** Everything depends only on the seed: the clients and their
shuffles (block b of C trips is ``source.round_data(b)``, the synchronous round b's
cohort), the trip durations (``clock.block_durations``), the clients' keys
(``fold_in`` of a stream per trip) and the flush keys (``fold_in(key(seed), v)``, the
runner's round keys). Simultaneous arrivals are delivered in trip order, and their
replacements start after all of them, on the newest model. Checkpoints (``simulation/
checkpoint.py``) hold the server state, the pool of computed but undelivered updates and
the clock's host arrays; a resumed run is bit-identical to an uninterrupted one.

**Exactness.** With K = M = C, a constant latency and no staleness, every version's K
clients are exactly synchronous round v's cohort, computed in one call of the same shape,
and the flush is the same weighted mean and server update: the server models equal the
runner's bit for bit on XLA:CPU (``tests/test_fedbuff.py``); in general the two are
separate compiled programs, so only float rounding could differ.
"""

from __future__ import annotations

import heapq
import math
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedax.algorithms import FederatedAlgorithm, RoundPieces, init_state
from fedax.simulation import checkpoint as ckpt
from fedax.simulation.asynchronous.clock import Latency, Staleness, TripBlocks
from fedax.simulation.asynchronous.config import AsyncConfig
from fedax.simulation.asynchronous.updates import check_pieces, update_functions
from fedax.simulation.execution import Execution, choose_execution, use_execution
from fedax.simulation.history import (
    Callback,
    DivergenceError,
    History,
    RunInterrupted,
    round_metrics,
    rounds_to_target,
)
from fedax.simulation.host import compiler_options
from fedax.simulation.runner import check_schedule
from fedax.simulation.sources import PartitionSource

_TRAINING_STREAM = 0x74726E  # "trn": the clients' own training keys, per trip
_AGGREGATOR_STREAM = 0x616763  # "agc": the aggregator client stage's keys, per trip
_UNCOMPUTED, _EMPTY = -1, -2  # pool slot of a trip whose update is not computed / no trip


def fedbuff(buffer_size: int = 10, concurrency: int = 100, *,
            staleness: Staleness | None = None, latency: Latency | None = None,
            max_staleness: int | None = None, weighting: str = "equal") -> AsyncConfig:
    """FedBuff: a buffer of K, s(τ) = 1/√(1 + τ), equal weights (FLSim's defaults)."""
    return AsyncConfig(buffer_size, concurrency, staleness or Staleness("polynomial", 0.5),
                       max_staleness, latency or Latency(), weighting).validate()


def fedasync(concurrency: int = 100, *, staleness: Staleness | None = None,
             latency: Latency | None = None, max_staleness: int | None = None) -> AsyncConfig:
    """FedAsync: K = 1 with mixing, s(τ) = (1 + τ)^(−1/2); α is the server SGD rate."""
    return AsyncConfig(1, concurrency, staleness or Staleness("polynomial", 0.5),
                       max_staleness, latency or Latency(), "equal", True).validate()


@dataclass
class AsyncHistory(History):
    """A ``History`` whose records also hold ``virtual_time``, ``client_updates`` (client
    trips that reached the server), ``accepted_updates`` and staleness statistics.
    ``round`` is the number of server updates. ``trace`` (with ``trace=True``) holds one
    tuple per arrival: ``(trip, client_id, start, finish, start_version, arrival_version,
    status)``, status ``buffered``, ``nonfinite`` or ``stale`` (a resumed run: from the
    checkpoint on)."""

    trace: list[tuple] = field(default_factory=list)

    def to_target(self, target: float, x: str = "virtual_time") -> float | None:
        """``x`` (``virtual_time``, ``client_updates`` or ``round``) at which the best-so-far
        test accuracy first reaches ``target``, interpolated (McMahan et al.'s reading)."""
        return rounds_to_target(self.column(x), self.column("test_accuracy"), target)


def _host_template(config: AsyncConfig) -> dict[str, np.ndarray]:
    m, k = config.concurrency, config.buffer_size
    i64 = np.int64
    return {
        "now": np.zeros((), np.float64), "next_trip": np.zeros((), i64),
        "version": np.zeros((), i64),
        "flight_trip": np.zeros(m, i64), "flight_start": np.zeros(m, np.float64),
        "flight_finish": np.zeros(m, np.float64), "flight_version": np.zeros(m, i64),
        "flight_slot": np.full(m, _UNCOMPUTED, i64), "flight_finite": np.zeros(m, bool),
        "flight_client": np.zeros(m, i64),
        "buffer_slot": np.zeros(k, i64), "buffer_tau": np.zeros(k, i64),
        "buffer_count": np.zeros((), i64),
        # totals, and counts since the last record / since the last server update
        "trips": np.zeros((), i64), "accepted": np.zeros((), i64),
        "rejected": np.zeros((), i64), "stale": np.zeros((), i64),
        "record_trips": np.zeros((), i64), "record_rejected": np.zeros((), i64),
        "record_stale": np.zeros((), i64), "record_tau_sum": np.zeros((), i64),
        "record_tau_max": np.zeros((), i64), "record_accepted": np.zeros((), i64),
        "update_trips": np.zeros((), i64), "update_rejected": np.zeros((), i64),
    }


def _identity(init_params, execution, source, config, fingerprint, **arguments):
    items: dict[str, Any] = dict(arguments)
    items.update(source.identity())
    items.update({f"execution.{k}": v for k, v in execution._asdict().items()})
    items["init_params.sha256"] = ckpt.tree_sha256(init_params)
    for name, value in config._asdict().items():
        if isinstance(value, tuple):
            for sub, v in value._asdict().items():
                items[f"async.{name}.{sub}"] = v
        else:
            items[f"async.{name}"] = value
    for key, value in (fingerprint or {}).items():
        items[f"config.{key}"] = value
    return items


def run_async(
    algorithm: FederatedAlgorithm | RoundPieces,
    init_params: Any,
    source: PartitionSource,
    evaluate: Callable[[Any], Any] | None,
    config: AsyncConfig,
    *,
    server_updates: int,
    seed: int = 0,
    eval_every: int = 1,
    target_accuracy: float | None = None,
    stop_at_target: bool = False,
    execution: Execution | None = None,
    callbacks: Sequence[Callback] = (),
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    fingerprint: Mapping[str, Any] | None = None,
    max_rejected_fraction: float = 0.5,
    trace: bool = False,
    record_fields: Callable[[int], Mapping[str, Any]] | None = None,
) -> AsyncHistory:
    """Run FedBuff (or FedAsync) for ``server_updates`` server steps on a virtual clock.

    Args:
      algorithm: a ``FederatedAlgorithm`` composed of pieces (or the ``RoundPieces``);
        no per-client state, no reweighing.
      init_params: the initial server model.
      source: a ``PartitionSource`` (fixed sampling, no stragglers): its round b is block b
        of C trips (see the module docstring).
      evaluate: ``evaluate(params) -> (accuracy, loss)`` or a dict; None: no evaluation.
      config: ``AsyncConfig`` (``fedbuff(...)``, ``fedasync(...)``).
      server_updates: T, server steps to run.
      seed: the JAX keys' seed and the latency stream's (the source has its own seed).
      eval_every: record after every k-th server update and the last.
      target_accuracy, stop_at_target: stop at the first record that reaches the target.
      execution: how ``map_clients`` runs (one device); default the runner's choice.
      callbacks: called with each record.
      checkpoint_dir, checkpoint_every, resume, fingerprint: as ``fedax.simulation.run``;
        a checkpoint is taken at the end of the clock instant in which its server update
        happened, named by the server updates done.
      max_rejected_fraction: a server update whose buffer filled while more than this
        fraction of the arrivals were non-finite stops the run (``DivergenceError``), as
        does a non-finite server model, or 10·(M + K) arrivals without an update.
      trace: keep one tuple per arrival in ``AsyncHistory.trace``.
      record_fields: ``record_fields(version) -> dict`` of more values for that record
        (the ε spent, as ``fedax.simulation.run``).

    Returns:
      ``AsyncHistory`` (records, final ``RoundState``, trace).
    """
    config = config.validate()
    pieces = check_pieces(algorithm, config)
    if server_updates < 1:
        raise ValueError(f"server_updates must be >= 1, got {server_updates}.")
    check_schedule(eval_every, checkpoint_every, resume, checkpoint_dir)
    if not isinstance(source, PartitionSource):
        raise ValueError("run_async needs a PartitionSource (its rounds are the blocks of "
                         f"trips), got {type(source).__name__}.")
    if source.sampling != "fixed" or source.straggler_fraction or source.drop_stragglers:
        raise ValueError("run_async needs a PartitionSource with fixed sampling and no "
                         "stragglers (trip durations come from the latency model).")
    execution = execution or choose_execution(params=init_params, devices=1)
    if execution.devices != 1 or execution.map == "processes":
        raise ValueError("run_async runs on one device in this process: use an execution "
                         "with devices=1 and map vmap, sequential or unroll.")
    k, m = config.buffer_size, config.concurrency
    capacity = m + k
    chunk = k
    identity = None
    if checkpoint_every or resume:
        identity = _identity(init_params, execution, source, config, fingerprint,
                             server_updates=server_updates, seed=seed, eval_every=eval_every,
                             target_accuracy=target_accuracy, stop_at_target=stop_at_target)

    blocks = TripBlocks(source, config.latency, seed)
    cohort_size = blocks.size()
    home = jax.devices()[0]
    placed = source.place(home)
    base_key = jax.random.key(seed)
    streams = (jax.random.fold_in(base_key, _TRAINING_STREAM),
               jax.random.fold_in(base_key, _AGGREGATOR_STREAM))

    # ---------------------------------------------------------------- compiled pieces

    compute, compute_into, server_step = update_functions(pieces, source, config)

    # ---------------------------------------------------------------- host clock

    history = AsyncHistory()
    with use_execution(execution):
        options = compiler_options()
        compute_fn = jax.jit(compute_into, donate_argnums=(1,), compiler_options=options)
        server_fn = jax.jit(server_step, donate_argnums=(0,), compiler_options=options)
        state = jax.device_put(jax.tree.map(jnp.copy, init_state(pieces, init_params)), home)
        idx0, mask0, n0, ids0, _ = blocks.get(0)

        def padded(rows_idx, rows_mask, rows_n, rows_ids):
            """A chunk's rows padded to K with empty clients (n_k = 0, all masked)."""
            extra = chunk - len(rows_n)

            def pad(a, dtype):
                a = np.asarray(a, dtype)
                return np.concatenate([a, np.zeros((extra, *a.shape[1:]), dtype)])

            return (pad(rows_idx, idx0.dtype), pad(rows_mask, np.float32),
                    pad(rows_n, np.float32), pad(rows_ids, np.int32))

        shapes = jax.eval_shape(compute, state, placed, *padded(
            idx0[:0], mask0[:0], n0[:0], ids0[:0]), np.zeros(chunk, np.int32), streams)[0]
        pool = jax.tree.map(lambda s: jnp.zeros((capacity, *s.shape[1:]), s.dtype), shapes)
        pool = jax.device_put(pool, home)
        host = _host_template(config)
        first_start = True
        checkpoint_round = None
        elapsed_before = 0.0
        if resume:
            template = {"state": state, "pool": pool, "host": host}
            restored = ckpt.latest_checkpoint(checkpoint_dir, template, identity)
            if restored is None:
                warnings.warn(f"resume: no checkpoint in {checkpoint_dir}; starting from "
                              "server update 0", ckpt.CheckpointWarning, stacklevel=2)
            else:
                state, pool = restored.state["state"], restored.state["pool"]
                host = {name: np.array(v) for name, v in restored.state["host"].items()}
                first_start = False
                checkpoint_round = restored.round
                elapsed_before = restored.elapsed_s
                history = AsyncHistory(list(restored.history), resumed_from=restored.round)
                for callback in callbacks:
                    on_resume = getattr(callback, "on_resume", None)
                    if on_resume is not None:
                        on_resume(list(history.records))
        elif checkpoint_every:
            ckpt.remove_checkpoints(checkpoint_dir)

        occupied = set(int(s) for s in host["flight_slot"] if s >= 0)
        occupied |= set(int(s) for s in host["buffer_slot"][:int(host["buffer_count"])])
        free = [s for s in range(capacity) if s not in occupied]
        heapq.heapify(free)

        def put(name: str, value: Any) -> None:
            """Set a host scalar, keeping its dtype (the checkpoint template's)."""
            host[name] = np.asarray(value, host[name].dtype)

        def bump(*names: str, by: int = 1) -> None:
            for name in names:
                put(name, int(host[name]) + by)

        def start_trip(position: int, now: float) -> None:
            j = int(host["next_trip"])
            put("next_trip", j + 1)
            block = blocks.get(j // cohort_size)
            host["flight_client"][position] = block[3][j % cohort_size]
            durations = block[4]
            host["flight_trip"][position] = j
            host["flight_start"][position] = now
            host["flight_finish"][position] = now + float(durations[j % cohort_size])
            host["flight_version"][position] = host["version"]
            host["flight_slot"][position] = _UNCOMPUTED
            host["flight_finite"][position] = False

        def compute_pending() -> None:
            nonlocal pool
            pending = np.nonzero(host["flight_slot"] == _UNCOMPUTED)[0]
            if pending.size == 0:
                return
            pending = pending[np.argsort(host["flight_trip"][pending], kind="stable")]
            for start in range(0, pending.size, chunk):
                positions = pending[start:start + chunk]
                trips = host["flight_trip"][positions]
                rows = [blocks.get(int(j) // cohort_size) for j in trips]
                r = [int(j) % cohort_size for j in trips]
                idx = np.stack([b[0][i] for b, i in zip(rows, r, strict=True)])
                mask = np.stack([b[1][i] for b, i in zip(rows, r, strict=True)])
                n = np.asarray([b[2][i] for b, i in zip(rows, r, strict=True)])
                ids = np.asarray([b[3][i] for b, i in zip(rows, r, strict=True)])
                idx, mask, n, ids = padded(idx, mask, n, ids)
                slots = np.full(chunk, capacity, np.int32)
                for i in range(len(positions)):
                    slots[i] = heapq.heappop(free)
                trip_ids = np.zeros(chunk, np.int32)
                trip_ids[:len(positions)] = trips
                pool, finite = compute_fn(state, pool, placed, idx, mask, n, ids, trip_ids,
                                          streams, slots)
                finite = np.asarray(finite)
                host["flight_slot"][positions] = slots[:len(positions)]
                host["flight_finite"][positions] = finite[:len(positions)]
            low = int(host["next_trip"]) // cohort_size
            blocks.forget_below(low)

        if first_start:
            for position in range(m):
                start_trip(position, 0.0)

        def release(slot: int) -> None:
            heapq.heappush(free, int(slot))

        def record_for(version: int, metrics: dict[str, Any]) -> dict[str, Any]:
            record: dict[str, Any] = {"round": version}
            if evaluate is not None:
                result = evaluate(pieces.server_params(state.server))
                if isinstance(result, Mapping):
                    record.update(result)
                else:
                    record["test_accuracy"], record["test_loss"] = result
            if "train_loss" in metrics:
                record["train_loss"] = float(metrics["train_loss"])
            accepted = int(host["record_accepted"])
            record.update({
                "virtual_time": float(host["now"]),
                "client_updates": int(host["trips"]),
                "accepted_updates": int(host["accepted"]),
                "rejected_clients": int(host["record_rejected"]),
                "stale_clients": int(host["record_stale"]),
                "mean_staleness": (float(host["record_tau_sum"]) / accepted
                                   if accepted else 0.0),
                "max_staleness": int(host["record_tau_max"]),
            })
            for name, value in round_metrics(metrics).items():
                if name not in ("server_finite",):
                    record.setdefault(name, value)
            for name in ("record_trips", "record_rejected", "record_stale", "record_tau_sum",
                         "record_tau_max", "record_accepted"):
                put(name, 0)
            if record_fields is not None:
                record.update(record_fields(version))
            record["elapsed_s"] = elapsed_before + time.perf_counter() - started
            return record

        started = time.perf_counter()
        done = int(host["version"])
        stop = any(
            stop_at_target and target_accuracy is not None
            and r.get("test_accuracy", -math.inf) >= target_accuracy
            for r in history.records)
        try:
            while int(host["version"]) < server_updates and not stop:
                now = float(host["flight_finish"].min())
                put("now", now)
                arriving = np.nonzero(host["flight_finish"] == now)[0]
                arriving = arriving[np.argsort(host["flight_trip"][arriving], kind="stable")]
                freed, new_records, due = [], [], False
                for position in arriving:
                    version = int(host["version"])
                    if version >= server_updates or stop:
                        break
                    if host["flight_slot"][position] == _UNCOMPUTED:
                        compute_pending()
                    tau = version - int(host["flight_version"][position])
                    slot = int(host["flight_slot"][position])
                    bump("trips", "record_trips", "update_trips")
                    if not host["flight_finite"][position]:
                        status = "nonfinite"
                        bump("rejected", "record_rejected", "update_rejected")
                        release(slot)
                    elif config.max_staleness is not None and tau > config.max_staleness:
                        status = "stale"
                        bump("stale", "record_stale")
                        release(slot)
                    else:
                        status = "buffered"
                        count = int(host["buffer_count"])
                        host["buffer_slot"][count] = slot
                        host["buffer_tau"][count] = tau
                        bump("buffer_count", "accepted", "record_accepted")
                        bump("record_tau_sum", by=tau)
                        put("record_tau_max", max(int(host["record_tau_max"]), tau))
                    if trace:
                        history.trace.append((
                            int(host["flight_trip"][position]),
                            int(host["flight_client"][position]),
                            float(host["flight_start"][position]), now,
                            int(host["flight_version"][position]), version, status))
                    freed.append(int(position))
                    host["flight_slot"][position] = _EMPTY
                    host["flight_finish"][position] = math.inf
                    if int(host["update_trips"]) > 10 * (m + k):
                        raise DivergenceError(
                            f"{int(host['update_trips'])} client updates arrived without K = {k}"
                            " usable ones (non-finite or too stale); lower client_lr or raise "
                            "max_staleness", version)
                    if int(host["buffer_count"]) < k:
                        continue
                    # The buffer is full: clients that started on this version are computed
                    # before the model changes, then the server steps.
                    compute_pending()
                    slots = host["buffer_slot"].astype(np.int32)
                    taus = host["buffer_tau"].astype(np.int32)
                    state, metrics = server_fn(state, pool, slots, taus,
                                               jax.random.fold_in(base_key, version))
                    for s in slots:
                        release(int(s))
                    put("buffer_count", 0)
                    put("version", version + 1)
                    metrics = jax.device_get(metrics)
                    bad, arrived = int(host["update_rejected"]), int(host["update_trips"])
                    put("update_trips", 0)
                    put("update_rejected", 0)
                    if not bool(metrics["server_finite"]):
                        raise DivergenceError(
                            f"server update {version + 1}: the server model is no longer "
                            "finite (NaN or inf); lower client_lr or the server rate",
                            version + 1)
                    if bad > max_rejected_fraction * arrived:
                        raise DivergenceError(
                            f"server update {version + 1}: {bad} of {arrived} arrivals were "
                            f"non-finite, more than max_rejected_fraction="
                            f"{max_rejected_fraction}; lower client_lr", version + 1)
                    done = version + 1
                    if done % eval_every == 0 or done == server_updates:
                        record = record_for(done, metrics)
                        history.records.append(record)
                        new_records.append(record)
                        stop = (stop_at_target and target_accuracy is not None
                                and record.get("test_accuracy", -math.inf)
                                >= target_accuracy)
                    if checkpoint_every and (done % checkpoint_every == 0
                                             or done == server_updates):
                        due = True
                for position in freed:
                    start_trip(position, now)
                if checkpoint_every and (due or stop):
                    ckpt.save_checkpoint(
                        checkpoint_dir, int(host["version"]),
                        {"state": state, "pool": pool, "host": host},
                        history=history.records, fingerprint=identity,
                        elapsed_s=elapsed_before + time.perf_counter() - started)
                    checkpoint_round = int(host["version"])
                for record in new_records:
                    for callback in callbacks:
                        callback(record)
        except KeyboardInterrupt:
            raise RunInterrupted(done, checkpoint_round) from None
    history.state = state
    return history


__all__ = ["AsyncHistory", "fedasync", "fedbuff", "run_async"]
