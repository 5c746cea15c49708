"""Execution strategies: how a round's client map and local-step loop are compiled.

One algorithm definition runs under several strategies with identical numbers; only speed
and memory differ. The runner picks one per backend and model (``choose_execution``), and a
user can override it.

* ``map``: ``vmap`` (vectorized cohort; the fast form on GPU/TPU and for dense models),
  ``sequential`` (``lax.map``: one client at a time, memory of one client), or ``unroll``
  (a straight-line copy per client).
* ``steps``: ``scan`` (a compiled loop over local steps) or ``unroll`` (straight-line code;
  XLA:CPU runs convolutions about 10x faster outside loops, jax-ml/jax#12868, at the cost of
  compile time proportional to the number of steps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import jax

from fedax import federated as fed
from fedax.client import steps_strategy

MAP_STRATEGIES = ("vmap", "sequential", "unroll")
STEPS_STRATEGIES = ("scan", "unroll")


class Execution(NamedTuple):
    map: str = "vmap"
    steps: str = "scan"

    def validate(self) -> Execution:
        if self.map not in MAP_STRATEGIES:
            raise ValueError(f"execution map {self.map!r} is not one of {MAP_STRATEGIES}.")
        if self.steps not in STEPS_STRATEGIES:
            raise ValueError(f"execution steps {self.steps!r} is not one of {STEPS_STRATEGIES}.")
        return self


@contextlib.contextmanager
def use_execution(execution: Execution) -> Iterator[None]:
    """Trace federated code under ``execution`` (enter this around ``jax.jit`` tracing)."""
    execution.validate()
    with fed.map_strategy(execution.map), steps_strategy(execution.steps):
        yield


def choose_execution(
    map_choice: str = "auto", steps_choice: str = "auto", backend: str | None = None
) -> Execution:
    """Resolve ``"auto"`` choices for the backend (default: JAX's default backend).

    * GPU/TPU: ``vmap`` + ``scan``: the cohort is one batched program.
    * CPU: ``sequential`` + ``scan``. Per-client matmuls at the paper's B = 10 are tiny,
      and XLA:CPU runs a vmapped (batched) matmul and a vmapped convolution slower than the
      same client programs one after another (measured on a 2-core machine: 2NN round at
      E = 1, B = 10, 10 clients: 0.47 s sequential vs 0.65 s vmap; see ``benchmarks/``).
    """
    backend = backend or jax.default_backend()
    default_map = "sequential" if backend == "cpu" else "vmap"
    return Execution(
        default_map if map_choice == "auto" else map_choice,
        "scan" if steps_choice == "auto" else steps_choice,
    ).validate()
