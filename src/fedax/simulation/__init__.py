"""Simulation: cohorts, compiled rounds, evaluation, rounds to target, checkpoints."""

from fedax.data import VirtualPopulation, sample_cohort  # re-exported: they live in data
from fedax.simulation.asynchronous import (  # FedBuff, FedAsync, sync on a virtual clock
    AsyncConfig,
    AsyncHistory,
    Latency,
    Staleness,
    fedasync,
    fedbuff,
    run_async,
    run_synchronous,
)
from fedax.simulation.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointWarning,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from fedax.simulation.client_state import ClientStateStore
from fedax.simulation.cohorts import cohort_batches
from fedax.simulation.evaluation import ClientScores, make_client_evaluator, make_evaluator
from fedax.simulation.execution import Execution, choose_execution, use_execution
from fedax.simulation.history import DivergenceError, History, RunInterrupted, rounds_to_target
from fedax.simulation.population import run_population
from fedax.simulation.runner import run
from fedax.simulation.sources import (
    CohortSource,
    HostCohorts,
    PartitionSource,
    PopulationSource,
    RoundData,
)
from fedax.simulation.stragglers import drop_stragglers, straggler_epochs

__all__ = [
    "AsyncConfig",
    "AsyncHistory",
    "Latency",
    "Staleness",
    "fedasync",
    "fedbuff",
    "run_async",
    "run_synchronous",
    "Checkpoint",
    "CheckpointError",
    "CheckpointWarning",
    "ClientScores",
    "ClientStateStore",
    "CohortSource",
    "HostCohorts",
    "PartitionSource",
    "PopulationSource",
    "RoundData",
    "DivergenceError",
    "Execution",
    "VirtualPopulation",
    "History",
    "RunInterrupted",
    "choose_execution",
    "cohort_batches",
    "drop_stragglers",
    "latest_checkpoint",
    "load_checkpoint",
    "make_client_evaluator",
    "make_evaluator",
    "rounds_to_target",
    "run",
    "run_population",
    "sample_cohort",
    "save_checkpoint",
    "straggler_epochs",
    "use_execution",
]
