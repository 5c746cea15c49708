"""8-bit encodings of features: uint8 codes ``k`` standing for ``float32(k) / 255``.

Image data sets are stored as bytes and scaled to ``k / 255`` in float32 (MNIST,
Fashion-MNIST, CIFAR, FEMNIST). ``fedax.simulation.device_data`` keeps such data on the
device as codes and hands cohorts over as :class:`ByteCoded`; ``fedax.client.local_train``
decodes each step's batch just before the loss sees it.

This module imports JAX only when a code is decoded, so ``import fedax.data`` stays
NumPy-only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import jax

BYTE_SCALE_TABLE = np.arange(256, dtype=np.float32) / np.float32(255.0)
"""Code k -> float32(k) / float32(255): 8-bit image data as the loaders scale it."""


class ByteCoded(NamedTuple):
    """Features held as their uint8 codes ``k``, standing for ``float32(k) / 255`` (8-bit
    images scaled the usual way). The runner passes image cohorts this way (a quarter of
    the bytes); ``local_train`` decodes each step's batch just before the loss sees it, so
    loss functions always receive the float values, bit for bit."""

    codes: jax.Array

    def decode(self) -> jax.Array:
        import jax.numpy as jnp

        return jnp.asarray(BYTE_SCALE_TABLE)[self.codes]
