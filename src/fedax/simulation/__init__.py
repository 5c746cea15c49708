"""Simulation: cohorts, compiled rounds, evaluation, rounds to target, checkpoints."""

from fedax.simulation.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointWarning,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from fedax.simulation.cohorts import cohort_batches
from fedax.simulation.execution import Execution, choose_execution, use_execution
from fedax.simulation.population import (
    ClientStateStore,
    VirtualPopulation,
    run_population,
    sample_cohort,
)
from fedax.simulation.runner import (
    DivergenceError,
    History,
    RunInterrupted,
    make_evaluator,
    rounds_to_target,
    run,
)

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointWarning",
    "ClientStateStore",
    "DivergenceError",
    "Execution",
    "VirtualPopulation",
    "History",
    "RunInterrupted",
    "choose_execution",
    "cohort_batches",
    "latest_checkpoint",
    "load_checkpoint",
    "make_evaluator",
    "rounds_to_target",
    "run",
    "run_population",
    "sample_cohort",
    "save_checkpoint",
    "use_execution",
]
