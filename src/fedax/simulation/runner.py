"""The simulation runner: seeded cohorts, compiled rounds, evaluation and callbacks.

A run is a pure function of its inputs and seed. Round t draws its cohort and the clients'
shuffles from ``np.random.default_rng([seed, t])`` and its JAX key from
``fold_in(key(seed), t)``, so any round can be reproduced (and a run resumed) on its own.
The whole training set lives on the device once; a cohort travels as example indices
``[C, S, B]`` plus masks, and the gather happens inside the compiled round.

With ``checkpoint_dir`` and ``checkpoint_every``, the state and the records so far are saved
every k rounds (see ``fedax.simulation.checkpoint``), and ``resume=True`` continues from the
newest valid checkpoint: the resumed run's records and final state are bit-identical to an
uninterrupted run's (``elapsed_s`` aside). A resumed run may have more rounds than the run it
continues (a finished run is extended): its records are then those of an uninterrupted run
of the new length.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from fedax.algorithms import FederatedAlgorithm
from fedax.data import ClientData
from fedax.simulation.client_state import ClientStateStore
from fedax.simulation.execution import Execution, choose_execution, use_execution
from fedax.simulation.history import Callback, History
from fedax.simulation.round_loop import RoundCallback, RoundLoop, maybe_mesh
from fedax.simulation.schedule import Schedule, check_schedule, flat_items, run_identity
from fedax.simulation.sources import CohortSource, PartitionSource

__all__ = ["RoundCallback", "check_schedule", "flat_items", "run"]


def run(
    algorithm: FederatedAlgorithm,
    init_params: Any,
    source: ClientData | CohortSource,
    evaluate: Callable[[Any], Any] | None,
    *,
    rounds: int,
    client_fraction: float | None = None,
    local_epochs: int | None = None,
    batch_size: float | None = None,
    seed: int = 0,
    eval_every: int = 1,
    target_accuracy: float | None = None,
    stop_at_target: bool = False,
    execution: Execution | None = None,
    callbacks: Sequence[Callback] = (),
    round_callbacks: Sequence[RoundCallback] = (),
    progress: bool = False,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    fingerprint: Mapping[str, Any] | None = None,
    schedule: Sequence[str] = (),
    straggler_fraction: float = 0.0,
    drop_stragglers: bool = False,
    client_state: ClientStateStore | None = None,
    max_rejected_fraction: float = 0.5,
    stop_on_divergence: bool = True,
    record_fields: Callable[[int], Mapping[str, Any]] | None = None,
) -> History:
    """Run ``rounds`` rounds of ``algorithm`` on a cohort source, evaluating every
    ``eval_every``. The one round loop of fedax: data sets, virtual populations and the
    hypergradient experiments all run through it (``fedax.simulation.round_loop``).

    Args:
      algorithm: a ``FederatedAlgorithm``.
      init_params: the initial server model.
      source: a ``ClientData`` (then ``client_fraction``, ``local_epochs``, ``batch_size``
        and the straggler options make its ``PartitionSource``), or any cohort source
        (``fedax.simulation.sources``: ``PopulationSource``, ``HostCohorts``).
      evaluate: ``evaluate(params) -> (accuracy, loss)`` on the test set, or a dict of
        named values; None records no evaluation.
      rounds, eval_every, target_accuracy, stop_at_target, checkpoint_dir,
        checkpoint_every, resume, max_rejected_fraction, stop_on_divergence, record_fields:
        the run's ``fedax.simulation.schedule.Schedule`` (``rounds`` is its ``steps``): when
        it records, saves, stops and has diverged. A checkpoint must come from the same
        run (arguments, execution, initial params, training data, ``fingerprint``).
      client_fraction, local_epochs, batch_size: the paper's C, E, B for a ``ClientData``
        (``batch_size=math.inf`` is the full local data set).
      seed: the run's only source of randomness (with the source's own seed).
      execution: execution strategy; default ``choose_execution(params=init_params)``.
      callbacks: each is called with every record (see ``Callback``).
      round_callbacks: each is called after every round (see ``RoundCallback``).
      progress: show a progress bar with the round, test accuracy and rounds/s.
      fingerprint: items identifying the run that the runner cannot see (the experiment
        config), stored in every checkpoint and compared on resume.
      schedule: keys of ``fingerprint`` (dotted for nested items) that a resumed run may
        change, as ``rounds`` may (the caller's own schedule, which the caller checks).
      straggler_fraction, drop_stragglers: FedProx's systems heterogeneity (Li et al. 2020,
        §5; ``PartitionSource``): a straggler runs U{1..E} epochs (its unused steps are
        padding), or with ``drop_stragglers`` weight 0; 0 draws nothing.
      client_state: a host ``ClientStateStore`` of the algorithm's per-client state (a row
        per client): the round runs ``cohort_round`` with the cohort's rows gathered before
        and the accepted clients' rows scattered back after (nothing of size N on the
        device). Default: the algorithm keeps it in its own state.

    Returns:
      The ``History`` of evaluation records (restored ones included), with the final
      algorithm state and each round's wall time. Every record holds the round, the
      evaluation, ``train_loss``, ``rejected_clients`` (since the previous record) and
      every other metric of the round, as JSON values.

    Raises:
      DivergenceError: see ``Schedule.max_rejected_fraction``.
      RunInterrupted: on Ctrl-C, with the rounds done and the newest checkpoint's round.
    """
    plan = Schedule(rounds, eval_every, target_accuracy, stop_at_target, checkpoint_dir,
                    checkpoint_every, resume, max_rejected_fraction, stop_on_divergence,
                    record_fields)
    source = _cohort_source(source, client_fraction, local_epochs, batch_size, seed,
                            straggler_fraction, drop_stragglers)
    if client_state is not None:
        _check_store(algorithm, client_state, source)
    execution = execution or choose_execution(params=init_params)
    identity = None
    if checkpoint_every or resume:
        identity = run_identity(
            init_params, execution, source, fingerprint, rounds=rounds, seed=seed,
            eval_every=eval_every, target_accuracy=target_accuracy,
            stop_at_target=stop_at_target)
    loop = RoundLoop(algorithm, source, evaluate, plan, execution, seed, client_state,
                     callbacks, round_callbacks)
    with use_execution(execution), maybe_mesh(loop.mesh):
        loop.start(init_params)
        # What a resumed run may change: how many rounds it runs, and the caller's schedule.
        loop.restore(identity, ("rounds", *(f"config.{key}" for key in schedule)))
        return loop.run(progress, identity)


def _cohort_source(source, client_fraction, local_epochs, batch_size, seed,
                   straggler_fraction, drop_stragglers) -> CohortSource:
    """A ``ClientData``'s ``PartitionSource`` (C, E, B and the straggler options needed), or
    a cohort source as it is (which carries its own: none of them may be given)."""
    if isinstance(source, ClientData):
        missing = [name for name, value in (("client_fraction", client_fraction),
                                            ("local_epochs", local_epochs),
                                            ("batch_size", batch_size)) if value is None]
        if missing:
            raise ValueError(f"run on a ClientData needs {', '.join(missing)}.")
        assert client_fraction is not None and local_epochs is not None  # (missing)
        return PartitionSource(source, client_fraction, local_epochs, cast(float, batch_size),
                               seed, straggler_fraction, drop_stragglers)
    if (client_fraction, local_epochs, batch_size) != (None, None, None) or \
            straggler_fraction or drop_stragglers:
        raise ValueError("client_fraction, local_epochs, batch_size and the straggler options "
                         "belong to a ClientData; a cohort source carries its own.")
    return source


def _check_store(algorithm: FederatedAlgorithm, store: ClientStateStore,
                 source: CohortSource) -> None:
    pieces = algorithm.pieces
    if pieces is None or pieces.client_state is None:
        raise ValueError("client_state needs an algorithm with per-client state "
                         "(pieces.client_state), e.g. scaffold.")
    if store.num_clients != source.num_clients:
        raise ValueError(f"the client state store has {store.num_clients} rows, "
                         f"the cohort source {source.num_clients} clients.")
