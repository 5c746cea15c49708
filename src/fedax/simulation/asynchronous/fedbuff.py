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

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedax.algorithms import FederatedAlgorithm, RoundPieces
from fedax.simulation.asynchronous.clock import Latency, Staleness
from fedax.simulation.asynchronous.config import AsyncConfig
from fedax.simulation.asynchronous.stream import BufferedStream
from fedax.simulation.asynchronous.updates import check_pieces
from fedax.simulation.execution import Execution, choose_execution, use_execution
from fedax.simulation.history import Callback, History, rounds_to_target
from fedax.simulation.schedule import Schedule, run_identity
from fedax.simulation.sources import PartitionSource


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


def _settings(config: AsyncConfig) -> dict[str, Any]:
    """``AsyncConfig``'s settings as identity items (``async.staleness.kind``, ...)."""
    items = {}
    for name, value in config._asdict().items():
        if hasattr(value, "_asdict"):  # a NamedTuple: Staleness, Latency
            for sub, v in value._asdict().items():
                items[f"async.{name}.{sub}"] = v
        else:
            items[f"async.{name}"] = value
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
    plan = Schedule(server_updates, eval_every, target_accuracy, stop_at_target,
                    checkpoint_dir, checkpoint_every, resume, max_rejected_fraction,
                    record_fields=record_fields, step_name="server update")
    _check_source(source)
    execution = execution or choose_execution(params=init_params, devices=1)
    if execution.devices != 1 or execution.map == "processes":
        raise ValueError("run_async runs on one device in this process: use an execution "
                         "with devices=1 and map vmap, sequential or unroll.")
    identity = None
    if checkpoint_every or resume:
        identity = run_identity(init_params, execution, source, fingerprint,
                                server_updates=server_updates, seed=seed,
                                eval_every=eval_every, target_accuracy=target_accuracy,
                                stop_at_target=stop_at_target, **_settings(config))
    stream = BufferedStream(pieces, source, evaluate, config, plan, seed, callbacks,
                            AsyncHistory(), trace)
    with use_execution(execution):
        stream.start(init_params)
        stream.restore(identity)
        history = stream.run(identity)
    assert isinstance(history, AsyncHistory)
    return history


def _check_source(source: Any) -> None:
    if not isinstance(source, PartitionSource):
        raise ValueError("run_async needs a PartitionSource (its rounds are the blocks of "
                         f"trips), got {type(source).__name__}.")
    if source.sampling != "fixed" or source.straggler_fraction or source.drop_stragglers:
        raise ValueError("run_async needs a PartitionSource with fixed sampling and no "
                         "stragglers (trip durations come from the latency model).")


__all__ = ["AsyncHistory", "fedasync", "fedbuff", "run_async"]
