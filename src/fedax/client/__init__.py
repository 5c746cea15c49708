"""Local training on a client: masked steps with an optax optimizer."""

from fedax.client.local_training import (
    Batches,
    LocalResult,
    LossFn,
    current_steps_strategy,
    local_train,
    steps_strategy,
)

__all__ = [
    "Batches",
    "LocalResult",
    "LossFn",
    "current_steps_strategy",
    "local_train",
    "steps_strategy",
]
