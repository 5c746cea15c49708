"""Simulation: cohorts, compiled rounds, evaluation, rounds to target."""

from fedax.simulation.execution import Execution, choose_execution, use_execution
from fedax.simulation.runner import History, make_evaluator, rounds_to_target, run

__all__ = [
    "Execution",
    "History",
    "choose_execution",
    "make_evaluator",
    "rounds_to_target",
    "run",
    "use_execution",
]
