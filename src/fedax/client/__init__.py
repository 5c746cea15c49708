"""Local training on a client: masked steps with an optax optimizer, optionally stopped
early by the EB criterion (``fedax.client.early_stopping``).

``ByteCoded`` and ``BYTE_SCALE_TABLE`` live in ``fedax.data`` (``fedax.data.byte_coded``);
they are re-exported here because ``Batches.x`` may be ``ByteCoded``.
"""

from fedax.client.dp_sgd import dp_gradient, dp_local_train
from fedax.client.early_stopping import (
    EBCheck,
    EBStopping,
    StopState,
    eb_criterion,
    eb_statistics,
    eb_stopping,
    per_example_gradients,
)
from fedax.client.local_training import (
    Batches,
    LocalResult,
    LossFn,
    current_steps_strategy,
    decoded,
    local_train,
    mean_gradient,
    steps_strategy,
)
from fedax.data.byte_coded import BYTE_SCALE_TABLE, ByteCoded

__all__ = [
    "BYTE_SCALE_TABLE",
    "Batches",
    "ByteCoded",
    "EBCheck",
    "EBStopping",
    "LocalResult",
    "LossFn",
    "current_steps_strategy",
    "decoded",
    "dp_gradient",
    "dp_local_train",
    "eb_criterion",
    "eb_statistics",
    "eb_stopping",
    "local_train",
    "mean_gradient",
    "per_example_gradients",
    "steps_strategy",
    "StopState",
]
