"""Populations of up to millions of clients: data made on demand, per-client state on the host.

``fedax.simulation.run`` holds the whole training set on the device and, for SCAFFOLD, every
client's c_i in the algorithm state: memory grows with the population N. Here nothing of
size N is ever materialised, on the host or on the device:

* :class:`fedax.data.VirtualPopulation` (``fedax.data.virtual_population``): N clients whose
  data is a pure function of (seed, client id), generated when the client is sampled
  (Synthetic(α, β)-style), so a round costs O(cohort).
* :class:`fedax.simulation.client_state.ClientStateStore`: per-client algorithm state
  (SCAFFOLD's c_i) as host arrays with leaves ``[N, ...]``, in memory or in memory-mapped
  ``.npy`` files, zero until written (the OS materialises a page only when it is touched).
  A round gathers the cohort's rows and scatters them back: only the cohort's part moves.
* :func:`fedax.data.sample_cohort`: C distinct ids out of N in O(C) time and memory (Floyd's
  algorithm), where ``rng.choice(N, C, replace=False)`` is O(N).
* :func:`run_population`: ``fedax.simulation.run`` on a ``PopulationSource``: each round
  generates the cohort's data on the host into fixed-shape buffers (``[C · n_max, dim]``
  with n_max the most training examples a client can have, so the round compiles once),
  cuts it into ``[C, S, B]`` batches with :func:`fedax.data.make_cohort`, and runs one
  compiled round. Device memory is O(C · n_max · dim + model), independent of N.

SCAFFOLD runs with its c_i in a store: the runner gathers the cohort's rows, runs the
algorithm's ``cohort_round`` with them, and scatters the accepted clients' new rows back.
Same SCAFFOLD code and numbers as with its on-device table; the c-update divides by N.

Seeding matches ``fedax.simulation.run``: round t draws its cohort and the clients'
shuffles from ``np.random.default_rng([seed, t])`` and its JAX key from
``fold_in(key(seed), t)``. The population's data has its own seed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fedax.algorithms import FederatedAlgorithm
from fedax.data.virtual_population import VirtualPopulation
from fedax.simulation.client_state import ClientStateStore
from fedax.simulation.execution import Execution, choose_execution
from fedax.simulation.history import Callback, History
from fedax.simulation.runner import run
from fedax.simulation.sources import PopulationSource

PopulationHistory = History
"""The population runner's history: a ``History`` (with ``round_times``)."""


def run_population(
    algorithm: FederatedAlgorithm,
    init_params: Any,
    population: VirtualPopulation,
    evaluate: Callable[[Any], Any] | None,
    *,
    rounds: int,
    cohort_size: int,
    local_epochs: int,
    batch_size: float,
    seed: int = 0,
    client_state: ClientStateStore | None = None,
    eval_every: int = 1,
    execution: Execution | None = None,
    callbacks: Sequence[Callback] = (),
) -> History:
    """Run ``rounds`` rounds of ``algorithm`` on a virtual population, cohort by cohort.

    ``fedax.simulation.run`` with a ``PopulationSource(population, cohort_size,
    local_epochs, batch_size, seed)``; the next cohort is prepared while the device works.

    Args:
      algorithm: A ``FederatedAlgorithm``.
      init_params: The initial server model.
      population: The clients.
      evaluate: ``evaluate(params) -> (accuracy, loss)``, or None to record only the
        training metrics (e.g. a test set from ``population.client_data(ids, "test")`` and
        ``make_evaluator``).
      rounds, cohort_size, local_epochs, batch_size: T, C, E and B (``math.inf``: the full
        local data set in one step per epoch).
      seed: The run's randomness (cohorts, shuffles, keys).
      client_state: Host store of the algorithm's per-client state (N rows), or None: the
        algorithm then keeps it in its own state (SCAFFOLD's on-device table, O(N)).
      eval_every: Record (and evaluate) after every k-th round and after the last one.
      execution: Execution strategy; default ``choose_execution()``.
      callbacks: Each is called with every record.

    Returns:
      The ``History``: records, the final state and per-round wall times.
    """
    source = PopulationSource(population, cohort_size, local_epochs, batch_size, seed)
    return run(algorithm, init_params, source, evaluate, rounds=rounds, seed=seed,
               eval_every=eval_every, execution=execution or choose_execution(),
               callbacks=callbacks, client_state=client_state)
