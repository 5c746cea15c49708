"""Models as pure ``(init, apply)`` pairs, the papers' model zoo, and losses."""

from __future__ import annotations

from collections.abc import Callable

from fedax.models.base import Model, Params, param_count
from fedax.models.linear import logistic
from fedax.models.losses import (
    accuracy,
    masked_mean,
    per_example_cross_entropy,
    softmax_cross_entropy,
    token_accuracy,
    token_cross_entropy,
)
from fedax.models.lstm import char_lstm, char_lstm_param_count
from fedax.models.mnist import cnn, conv2d, glorot_uniform, max_pool_2x2, mlp_2nn
from fedax.models.precision import PRECISIONS, mixed_precision, with_precision

_REGISTRY: dict[str, Callable[..., Model]] = {"2nn": mlp_2nn, "cnn": cnn, "logistic": logistic,
                                             "char_lstm": char_lstm}
MODEL_NAMES = tuple(_REGISTRY)
"""The names ``get_model`` accepts."""


def get_model(name: str, **kwargs) -> Model:
    """The model registered as ``name`` (one of ``MODEL_NAMES``), built with ``kwargs``.

    Raises:
        ValueError: ``name`` is not registered; the message lists the allowed names.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; allowed: {', '.join(MODEL_NAMES)}")
    return _REGISTRY[name](**kwargs)


__all__ = [
    "MODEL_NAMES",
    "PRECISIONS",
    "Model",
    "Params",
    "accuracy",
    "char_lstm",
    "char_lstm_param_count",
    "cnn",
    "conv2d",
    "get_model",
    "glorot_uniform",
    "logistic",
    "masked_mean",
    "max_pool_2x2",
    "mixed_precision",
    "mlp_2nn",
    "param_count",
    "per_example_cross_entropy",
    "softmax_cross_entropy",
    "token_accuracy",
    "token_cross_entropy",
    "with_precision",
]
