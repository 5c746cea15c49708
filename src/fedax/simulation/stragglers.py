"""Stragglers, as in FedProx's systems-heterogeneity experiments (Li et al., MLSys 2020, §5).

At each round a fraction of the selected devices are stragglers: they run x ~ U[1, E] local
epochs instead of E. FedProx aggregates their partial work; FedAvg drops them.

In fedax both are expressed in the cohort, never in the algorithm (the runner,
``fedax.simulation.run(..., straggler_fraction, drop_stragglers)``, reshapes each round's
cohort with the two functions here):

* partial work: the data layer cuts each client's E_k = ``straggler_epochs(...)[k]`` epochs
  into its masks; the steps it did not take are padding, which local training skips. Every
  algorithm then keeps the partial update at the client's usual weight.
* dropping: ``drop_stragglers`` sets a straggler's ``num_examples`` to 0, i.e. weight 0 in
  every aggregate (and, for stateful algorithms such as SCAFFOLD, no per-client state update).

Deviation to know about: the FedProx authors' code draws a straggler's epochs with
``np.random.randint(1, E)``, i.e. from [1, E − 1]; the paper says U[1, E], which we follow,
so a straggler may draw E. ``drop_stragglers(cohort, epochs < E)`` drops exactly the clients
that did less than E epochs.
"""

from __future__ import annotations

import numbers
from typing import Any, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

CohortT = TypeVar("CohortT", bound="_WithNumExamples")


class _WithNumExamples(Protocol):
    """A cohort NamedTuple with a ``num_examples [C]`` field."""

    @property
    def num_examples(self) -> Any: ...

    def _replace(self: CohortT, *, num_examples: Any) -> CohortT: ...


def straggler_epochs(
    rng: int | np.random.Generator, num_clients: int, epochs: int, fraction: float
) -> np.ndarray:
    """Per-client local epochs with a ``fraction`` of stragglers.

    ``round(fraction * num_clients)`` clients (Python's round: to nearest, ties to even),
    chosen uniformly without replacement, draw their epochs uniformly from {1, ..., E}; the
    others run E epochs.

    Args:
      rng: a seed or a ``np.random.Generator`` (which is advanced).
      num_clients: the cohort size C ≥ 1.
      epochs: E ≥ 1.
      fraction: the fraction of stragglers, in [0, 1] (the paper uses 0, 0.5, 0.9).

    Returns:
      int64 array ``[C]`` of epochs, each in [1, E].
    """
    for value, name in ((num_clients, "num_clients"), (epochs, "epochs")):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")
    rng = np.random.default_rng(rng)
    num_stragglers = int(round(fraction * num_clients))
    out = np.full(num_clients, epochs, np.int64)
    who = rng.choice(num_clients, size=num_stragglers, replace=False)
    out[who] = rng.integers(1, epochs, size=num_stragglers, endpoint=True)
    return out


def drop_stragglers(cohort: CohortT, is_straggler) -> CohortT:
    """Give the stragglers weight 0: set their ``num_examples`` to 0 (FedAvg's treatment).

    Works on any cohort NamedTuple with a ``num_examples [C]`` field: the device-side
    ``CohortBatches`` (jax arrays: the result stays traceable) and the host-side
    ``fedax.data.Cohort`` (NumPy). A client with ``num_examples == 0`` is not aggregated and
    its per-client state is not updated, by every algorithm. If every client of a cohort is
    dropped, the n_k-weighted mean has no weight at all: 0/0, NaN parameters; keep at least
    one client (the FedProx setup always does, its stragglers being a fraction < 1).

    Args:
      cohort: the round's cohort.
      is_straggler: bool ``[C]``.
    """
    num_examples = cohort.num_examples
    traced = isinstance(num_examples, jax.Array) or isinstance(is_straggler, jax.Array)
    xp = jnp if traced else np
    is_straggler = xp.asarray(is_straggler)
    if is_straggler.shape != num_examples.shape:
        raise ValueError(
            f"is_straggler must have shape {num_examples.shape} (one per client), "
            f"got {is_straggler.shape}."
        )
    dropped = xp.where(is_straggler, xp.zeros_like(num_examples), num_examples)
    return cohort._replace(num_examples=dropped)
