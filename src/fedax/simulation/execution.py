"""Execution strategies: how a round's client map and local-step loop are compiled.

One algorithm definition runs under several strategies with identical numbers; only speed
and memory differ. The runner picks one per backend and model (``choose_execution``), and a
user can override it.

* ``map``: ``vmap`` (vectorized cohort; the fast form on GPU/TPU and for dense models),
  ``sequential`` (``lax.map``: one client at a time, memory of one client), ``unroll``
  (a straight-line copy per client), or ``processes`` (CPU: blocks of clients run
  ``sequential`` in worker processes, one JAX runtime pinned to each core; see
  ``fedax.simulation.processes``).
* ``steps``: ``scan`` (a compiled loop over local steps) or ``unroll`` (straight-line code;
  XLA:CPU runs convolutions about 10x faster outside loops, jax-ml/jax#12868, at the cost of
  compile time proportional to the number of steps).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import jax
import jax.numpy as jnp

from fedax import federated as fed
from fedax.client import steps_strategy
from fedax.simulation.host import usable_cores

if TYPE_CHECKING:
    from fedax.client.local_training import StepsStrategy
    from fedax.federated._map import MapStrategy

MAP_STRATEGIES = ("vmap", "sequential", "unroll", "lockstep", "processes")
STEPS_STRATEGIES = ("scan", "unroll")


class Execution(NamedTuple):
    """``map`` and ``steps`` strategies, and ``devices``: how many devices share the
    cohort (a mesh axis ``clients``; each device runs the strategy over its block). Under
    ``map="processes"``, ``devices`` is the number of worker processes (each its own
    single-core CPU device), and the calling process uses one device."""

    map: str = "vmap"
    steps: str = "scan"
    devices: int = 1

    def validate(self) -> Execution:
        if self.map not in MAP_STRATEGIES:
            raise ValueError(f"execution map {self.map!r} is not one of {MAP_STRATEGIES}.")
        if self.steps not in STEPS_STRATEGIES:
            raise ValueError(f"execution steps {self.steps!r} is not one of {STEPS_STRATEGIES}.")
        if self.map == "processes":
            cores = len(usable_cores())
            if jax.default_backend() != "cpu":
                raise ValueError(
                    "execution map 'processes' runs clients in CPU worker processes; on "
                    f"{jax.default_backend()} use 'vmap' (the default there)."
                )
            if self.devices < 1:
                raise ValueError(
                    f"execution map 'processes' needs devices >= 1 worker processes (one per "
                    f"core is fastest; this process may use {cores}), got {self.devices}."
                )
            return self
        available = jax.device_count()
        if not 1 <= self.devices <= available:
            raise ValueError(
                f"execution devices={self.devices}, but {available} device(s) are available; "
                "on CPU, start with XLA_FLAGS=--xla_force_host_platform_device_count=N "
                "(the fedax command does this) to split the host into N devices."
            )
        return self

    def mesh(self) -> jax.sharding.Mesh | None:
        """The 1-D mesh ``clients`` over the first ``devices`` devices (None for one)."""
        if self.devices == 1 or self.map == "processes":
            return None
        return jax.make_mesh(
            (self.devices,),
            (fed.CLIENTS_AXIS,),
            axis_types=(jax.sharding.AxisType.Explicit,),
            devices=jax.devices()[: self.devices],
        )


@contextlib.contextmanager
def use_execution(execution: Execution) -> Iterator[None]:
    """Trace federated code under ``execution`` (enter this around ``jax.jit`` tracing)."""
    execution.validate()
    strategy: MapStrategy | fed.ClientMapper
    if execution.map == "processes":
        from fedax.simulation.processes import client_processes

        strategy = client_processes(execution.devices)
    else:
        strategy = cast("MapStrategy", execution.map)  # validated: one of MAP_STRATEGIES
    with fed.map_strategy(strategy), steps_strategy(cast("StepsStrategy", execution.steps)):
        yield


def choose_execution(
    map_choice: str = "auto",
    steps_choice: str = "auto",
    devices: int | str = "auto",
    backend: str | None = None,
    params: Any = None,
) -> Execution:
    """Resolve ``"auto"`` choices for the backend (default: JAX's default backend) and the
    model (``params``: the initial model parameters, when known).

    * GPU/TPU: ``vmap`` + ``scan`` on every device: the cohort is one batched program.
    * CPU, convolutional models (a parameter of rank >= 4, i.e. a convolution kernel) on
      more than one core: ``processes``, one worker process per core. A conv client's
      steps are heavy next to the data a round moves, and separate single-threaded
      runtimes scale over cores where XLA devices in one process do not (MNIST CNN,
      workload W on 2 cores: 27.4 s a round against 38.1 s for ``sequential`` over two
      in-process devices in one run, 39.5 s against 40.9 s in a later run on a slower
      machine state; ``benchmarks/results/summary.md``).
    * CPU, other models: ``sequential`` + ``scan``, with the cohort split over all host
      devices (one per core when started by the fedax command). Per-client matmuls at the
      paper's B = 10 are tiny, XLA:CPU runs a vmapped (batched) matmul or convolution
      slower than the same client programs one after another, and one single-threaded
      client program per core beats one program using both cores (measured on a 2-core
      machine, 2NN, 10 clients, E = 1, B = 10: vmap 0.65 s, sequential 0.47 s per round on
      one device; sequential 0.17 s on one device vs 0.10 s over two; see
      ``benchmarks/``). For the 2NN, moving each cohort to worker processes costs about what
      their better scaling gains (W: 0.513 s a round against 0.493 s in one run).

    ``devices="auto"`` is ``$FEDAX_DEVICES`` when set (the ``--devices N`` flag of the
    ``fedax`` command sets it), else every device (``processes``: every core). Over several
    processes (``fedax.simulation.distributed``) "every device" is every device of every
    process, and the CPU default is ``sequential``.
    """
    backend = backend or jax.default_backend()
    if devices == "auto":
        devices = os.environ.get("FEDAX_DEVICES", "auto")
    if devices != "auto":
        devices = int(devices)
    cores = len(usable_cores())
    if backend != "cpu":
        default_map = "vmap"
    elif jax.process_count() > 1:
        default_map = "sequential"  # worker processes do not combine with a global mesh
    elif cores > 1 and _has_convolutions(params) and devices != 1:
        default_map = "processes"
    else:
        default_map = "sequential"
    map_ = default_map if map_choice == "auto" else map_choice
    if devices == "auto":
        devices = cores if map_ == "processes" else jax.device_count()
    assert isinstance(devices, int)  # (an int, or "auto" resolved above)
    return Execution(map_, "scan" if steps_choice == "auto" else steps_choice,
                     devices).validate()


def _has_convolutions(params: Any) -> bool:
    return any(
        getattr(leaf, "ndim", 0) >= 4 and jnp.issubdtype(leaf.dtype, jnp.floating)
        for leaf in jax.tree.leaves(params)
    )
