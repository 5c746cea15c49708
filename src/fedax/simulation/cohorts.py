"""A sampled cohort as a round's input, for driving ``algorithm.round`` by hand.

The runner keeps the training set on the device and gathers each cohort inside its compiled
round; :func:`cohort_batches` does the same gather on the host, giving the values the
runner's round receives (features decoded, as ``local_train`` sees them).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fedax.algorithms import CohortBatches
from fedax.client import Batches
from fedax.data import ClientData, Cohort


def cohort_batches(train: ClientData, cohort: Cohort) -> CohortBatches:
    """The ``CohortBatches`` of ``cohort`` (from ``make_cohort(train, ...)``).

    ``x [C, S, B, ...]`` is ``train.x[cohort.idx]`` as JAX holds it (float32 for float
    features, int32 for token ids when 64-bit mode is off), ``y [C, S, B, ...]`` is
    ``train.y[cohort.idx]`` as int32; ``mask [C, S, B]``, ``num_examples [C]`` (float32)
    and ``client_ids [C]`` (int32) are the cohort's. Padded entries gather example 0 and
    have mask 0.
    """
    batches = Batches(
        jnp.asarray(train.x[cohort.idx]),
        jnp.asarray(train.y[cohort.idx].astype(np.int32)),
        jnp.asarray(cohort.mask, jnp.float32),
    )
    return CohortBatches(
        batches,
        jnp.asarray(cohort.num_examples, jnp.float32),
        jnp.asarray(cohort.client_ids, jnp.int32),
    )
