"""Local training on a client: masked steps with an optax optimizer."""

from fedax.client.local_training import (
    BYTE_SCALE_TABLE,
    Batches,
    ByteCoded,
    LocalResult,
    LossFn,
    current_steps_strategy,
    decoded,
    local_train,
    steps_strategy,
)

__all__ = [
    "BYTE_SCALE_TABLE",
    "Batches",
    "ByteCoded",
    "LocalResult",
    "LossFn",
    "current_steps_strategy",
    "decoded",
    "local_train",
    "steps_strategy",
]
