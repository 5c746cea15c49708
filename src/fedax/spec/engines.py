"""The engine sections of an experiment config (``fedax.spec.config``):
``execution`` (which engine, ``mode: sync | async | network``, and how the simulator
executes), ``asynchronous`` (FedBuff's buffer, concurrency, latency and staleness) and
``network`` (the gRPC server's cohort, deadlines and setup), with what each engine refuses
(``async_combination``, ``network_combination``). A runtime task is a config without them
(``fedax.runtime.task.ENGINE_KEYS``)."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator

from fedax.algorithms import ALGORITHMS
from fedax.spec.sections import Number, _Section


class ExecutionConfig(_Section):
    """How rounds execute; ``auto`` lets the runner choose per backend and model.
    ``mode``: ``sync`` (rounds, ``fedax.simulation.run``), ``async`` (FedBuff on a virtual
    clock, ``fedax.simulation.asynchronous.run_async``, with the ``asynchronous:``
    section; ``rounds`` counts server updates) or ``network`` (a gRPC server and real
    client processes, ``fedax.runtime``, with the ``network:`` section)."""

    mode: Literal["sync", "async", "network"] = "sync"
    strategy: Literal["auto", "vmap", "sequential", "unroll", "lockstep", "processes"] = "auto"
    local_steps: Literal["auto", "scan", "unroll"] = "auto"
    devices: Any = Field("auto", description="'auto' or an integer >= 1")

    @field_validator("devices")
    @classmethod
    def _devices(cls, value: Any) -> Any:
        if value == "auto" or (type(value) is int and value >= 1):
            return value
        raise ValueError(f"must be 'auto' or an integer >= 1, got {value!r}")


class LatencyConfig(_Section):
    """A client trip's duration on the virtual clock (``fedax.simulation.asynchronous.
    Latency``): ``kind`` and its ``mean``, ``sd``, ``min``."""

    kind: Literal["constant", "half_normal", "uniform", "exponential",
                  "per_example_gaussian"] = "half_normal"
    mean: Number = Field(1.0, gt=0, allow_inf_nan=False)
    sd: Number = Field(1.0, ge=0, allow_inf_nan=False)
    min: Number = Field(0.0, ge=0, allow_inf_nan=False)


class StalenessConfig(_Section):
    """The weight s(τ) of an update τ versions old (``fedax.simulation.asynchronous.
    Staleness``): ``constant`` (1), ``polynomial`` ((1 + τ)^-exponent), ``threshold`` (1 up
    to ``cutoff``, then ``value_after``)."""

    kind: Literal["constant", "polynomial", "threshold"] = "polynomial"
    exponent: Number = Field(0.5, ge=0, le=1)
    cutoff: int = Field(0, ge=0)
    value_after: Number = Field(0.0, ge=0, le=1)


class AsynchronousConfig(_Section):
    """``execution.mode: async``: FedBuff (Nguyen et al. 2022) on a virtual clock. Clients
    train on the model version they downloaded; the server applies every ``buffer_size``
    (K) updates, each weighted by its staleness, with the algorithm's server update;
    ``concurrency`` (M) clients train at every moment. Both default to the cohort size m
    (``client_fraction`` × clients); with K = M = m, a constant latency and constant
    staleness it is the synchronous run, bit for bit."""

    buffer_size: int | None = Field(None, ge=1)  # default: the cohort size m
    concurrency: int | None = Field(None, ge=1)  # default: the cohort size m
    staleness: StalenessConfig = StalenessConfig()
    max_staleness: int | None = Field(None, ge=0)  # staler updates are dropped and counted
    latency: LatencyConfig = LatencyConfig()
    weighting: Literal["algorithm", "equal"] = "algorithm"


def _first_refusal(why: dict[str, tuple[bool, str]], mode: str) -> tuple[str, str] | None:
    """The first ``key: (refused, reason)`` that is refused, as ``(key, message)``."""
    for key, (refused, reason) in why.items():
        if refused:
            return key, f"{reason}: not with execution.mode {mode} (use mode sync)"
    return None


def _cohort(config: Any) -> int:
    """m, the cohort of ``client_fraction`` of ``num_clients`` (``sample_clients``')."""
    n = config.num_clients
    return min(max(math.floor(config.client_fraction * n + 1e-9), 1), n)


def lockstep(config: Any) -> bool:
    """FedBuff in lockstep: K = M = the cohort m, every trip as long, no staleness weight;
    each flush is then a synchronous round of m clients (bit for bit,
    tests/test_execution_modes.py)."""
    a, m = config.asynchronous, _cohort(config)
    return (a.buffer_size in (None, m) and a.concurrency in (None, m)
            and a.latency.kind == "constant" and a.staleness.kind == "constant"
            and a.weighting == "algorithm" and a.max_staleness is None)


def async_combination(config: Any) -> tuple[str, str] | None:
    """Why ``config`` cannot run with ``execution.mode: async``, as ``(key, message)``, or
    None. FedBuff's server applies buffered updates of clients that keep no state of their
    own, sampled as fixed-size blocks; what it does not model is refused here."""
    if config.execution.mode != "async":
        return None
    why = {**_buffered_refusals(config),
           "privacy": (config.privacy is not None and not lockstep(config), "the "
                       "accountant counts synchronous rounds, not buffered asynchronous "
                       "updates (only in lockstep, asynchronous.buffer_size = concurrency = "
                       "the cohort, constant latency and staleness weights, is a flush a "
                       "round)"),
           "server.lr": (config.server.lr == "learned", "'learned' differentiates a "
                         "synchronous round"),
           "attack": (config.attack is not None, "simulated attacks act on a synchronous "
                      "cohort"),
           "stragglers": (config.stragglers > 0, "the virtual clock's latency model "
                          "replaces stragglers (asynchronous.latency)"),
           "execution.devices": (config.execution.devices not in ("auto", 1), "the virtual "
                                 "clock runs on one device"),
           "execution.strategy": (config.execution.strategy == "processes", "the virtual "
                                  "clock runs in one process")}
    return _first_refusal(why, "async")


def _buffered_refusals(config: Any) -> dict[str, tuple[bool, str]]:
    """What buffered asynchronous updates (FedBuff, simulated or networked) cannot carry."""
    a, m = config.asynchronous, _cohort(config)
    compressed = config.compression is not None
    return {"algorithm": (ALGORITHMS[config.algorithm].client_state, "keeps per-client "
                         "state, which buffered asynchronous updates do not carry"),
           "compression.error_feedback": (compressed and config.compression.error_feedback,
                                          "keeps per-client state (the residual), which "
                                          "buffered asynchronous updates do not carry"),
           "asynchronous.staleness": (compressed and a.staleness.kind != "constant", "the "
                                      "staleness weight would scale the encoded codes, not "
                                      "the decoded update; use staleness.kind constant with "
                                      "compression"),
           "asynchronous.concurrency": ((a.concurrency or m) < (a.buffer_size or m),
                                        f"must be at least buffer_size ({a.buffer_size or m}"
                                        "): fewer clients in flight never fill the buffer")}


class NetworkConfig(_Section):
    """``execution.mode: network``: the rounds run on a gRPC server (TLS, client tokens)
    with real client processes (``fedax.runtime``; docs/deployment.md). ``fedax run``
    starts the server and ``local_clients`` client processes on this machine, which host
    the N clients between them (a one-machine rehearsal of a deployment; 0: start the
    server only and wait for ``fedax client`` processes). ``cohort_size`` (K, default the
    cohort m) accepted reports close a round; ``over_selection`` f selects ⌈K(1+f)⌉;
    ``min_reports`` at the ``deadline_s`` keep a round, fewer retry it (``max_attempts``).
    ``setup``: a directory ``fedax server init`` wrote (CA, server certificate and key,
    registry, tokens; default: a fresh development PKI in the run directory).
    ``server_randomness``: ``secret`` (``os.urandom``, a deployment's) or ``seed`` (the
    config's seed: the simulator's keys and selection, so the run equals ``mode: sync``;
    public, a rehearsal's only). ``asynchronous``: FedBuff on the server, no rounds
    (``fedax.runtime.async_server``): clients take the current model when they are free and
    report when done, every ``asynchronous.buffer_size`` reports make a server step with
    ``asynchronous.staleness`` weights, ``asynchronous.concurrency`` trips in flight
    (``asynchronous.latency`` is the simulator's; here trips take what they take)."""

    local_clients: int = Field(2, ge=0)
    cohort_size: int | None = Field(None, ge=1)
    over_selection: Number = Field(0.0, ge=0, allow_inf_nan=False)
    min_reports: int | None = Field(None, ge=1)
    deadline_s: Number = Field(60.0, gt=0, allow_inf_nan=False)
    max_attempts: int = Field(10, ge=1)
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    setup: str | None = None
    server_randomness: Literal["secret", "seed"] = "secret"
    max_examples: int = Field(1_000_000, ge=1)
    asynchronous: bool = False


def network_combination(config: Any) -> tuple[str, str] | None:
    """Why ``config`` cannot run with ``execution.mode: network``, as ``(key, message)``,
    or None: what only a simulation has (attacks, simulated stragglers, devices), what the
    runtime does not carry yet (the learned η under privacy),
    and what its accountant would not cover (Poisson sampling, over-selection under DP)."""
    if config.execution.mode != "network":
        return None
    private = config.privacy is not None
    buffered = _buffered_refusals(config) if config.network.asynchronous else {}
    if config.network.asynchronous:
        buffered.update({
            "privacy": (private, "the accountant counts synchronous rounds, not buffered "
                                 "asynchronous updates"),
            "server.lr": (config.server.lr == "learned", "'learned' differentiates a "
                                                         "synchronous round")})
    if _first_refusal(buffered, "network") is not None:
        return _first_refusal(buffered, "network")
    why = {"server.lr": (config.server.lr == "learned" and private, "'learned' with privacy "
                         "privatizes the holdout hypergradient, which the networked server "
                         "does not do yet"),
           "attack": (config.attack is not None, "attacks are simulated; over the network a "
                      "client attacks by itself"),
           "stragglers": (config.stragglers > 0, "stragglers are simulated; over the network "
                          "deadlines and drop-outs are real (network.deadline_s)"),
           "privacy.sampling": (private and config.privacy.sampling == "poisson", "the "
                                "server selects fixed-size cohorts"),
           "network.over_selection": (private and config.network.over_selection > 0,
                                      "with over-selection the first reports to arrive are "
                                      "kept, which is not the uniform sampling the accountant "
                                      "assumes"),
           "execution.strategy": (config.execution.strategy == "processes", "each client "
                                  "trains in its own process already")}
    return _first_refusal(why, "network")
