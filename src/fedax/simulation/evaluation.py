"""Evaluation on a test set: the model on the pooled test set (``make_evaluator``), and on
every client's own test data with the distribution over clients (``make_client_evaluator``).

FedAvg's mean accuracy can hide clients the model fails: with non-IID data the worst
clients matter (subpopulation-robust objectives ask exactly about them). ``make_client_
evaluator`` scores the model on each client's test examples in one compiled pass over the
test set (a masked scan, as ``make_evaluator``, with a segment sum by client), and returns
the global accuracy and loss of the pooled test set together with the distribution over
clients:

* ``client_accuracy_mean``: the unweighted mean over clients;
* ``client_accuracy_p10`` ... ``_p90``: percentiles (NumPy's linear interpolation);
* ``client_accuracy_worst10``: the mean accuracy of the worst 10% of clients
  (⌈K/10⌉ clients), the curve a ``target_accuracy`` can be read on as well;
* ``client_accuracy_above_target``: the fraction of clients at or above the target (with a
  target);
* ``client_loss_mean``.

Clients without test examples are left out of the distribution (and counted in
``clients_evaluated``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

PERCENTILES = (10, 25, 50, 75, 90)


def make_evaluator(
    apply_fn: Callable[[Any, jax.Array], jax.Array],
    x: np.ndarray,
    y: np.ndarray,
    chunk: int = 1000,
    pad_id: int = 0,
) -> Callable[[Any], tuple[float, float]]:
    """A compiled ``evaluate(params) -> (accuracy, mean cross-entropy)`` over a test set.

    The test set is padded to a multiple of ``chunk`` and scanned chunk by chunk with a
    mask, so memory is one chunk's activations. Sequence labels ``y [N, T]`` (next-token
    prediction) are scored per token, and targets equal to ``pad_id`` count for nothing.
    """
    n = len(y)
    sequence = y.ndim > 1
    total = float(np.sum(y != pad_id)) if sequence else float(n)
    chunks = math.ceil(n / chunk)
    pad = chunks * chunk - n
    xs = jnp.asarray(np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)]))
    ys = jnp.asarray(np.concatenate([y, np.zeros((pad, *y.shape[1:]), y.dtype)])
                     .astype(np.int32))
    mask = jnp.asarray(np.arange(chunks * chunk) < n, jnp.float32)
    xs = xs.reshape(chunks, chunk, *x.shape[1:])
    ys, mask = ys.reshape(chunks, chunk, *y.shape[1:]), mask.reshape(chunks, chunk)

    # The test set is an argument, not a closed-over constant: XLA compiles a program with
    # a large embedded constant far more slowly.
    @jax.jit
    def evaluate(params, xs, ys, mask):
        def body(carry, batch):
            bx, by, bm = batch
            logits = apply_fn(params, bx)
            logp = jax.nn.log_softmax(logits.astype(jnp.float32))
            nll = -jnp.take_along_axis(logp, by[..., None], axis=-1)[..., 0]
            correct = (jnp.argmax(logits, axis=-1) == by).astype(jnp.float32)
            if sequence:
                bm = bm[:, None] * (by != pad_id)
            return (carry[0] + jnp.sum(correct * bm), carry[1] + jnp.sum(nll * bm)), None

        (correct, nll), _ = jax.lax.scan(body, (0.0, 0.0), (xs, ys, mask))
        return correct / total, nll / total

    def run(params):
        acc, loss = evaluate(params, xs, ys, mask)
        return float(acc), float(loss)

    return run


class ClientScores(NamedTuple):
    """Each client's test accuracy, mean loss and number of scored targets, ``[K]`` each."""

    accuracy: np.ndarray
    loss: np.ndarray
    count: np.ndarray  # type: ignore[assignment]  # the field shadows tuple.count (API)


def client_index(parts: Sequence[np.ndarray], n: int) -> np.ndarray:
    """``[n]`` int32: the client of each of ``n`` test examples, from a partition
    (``parts[k]``: client k's example indices); examples of no client get -1. An example
    given to two clients is an error (the distribution would count it twice)."""
    owner = np.full(n, -1, np.int32)
    for k, part in enumerate(parts):
        part = np.asarray(part, np.int64)
        if np.any(owner[part] >= 0):
            raise ValueError(f"client {k} shares test examples with another client.")
        owner[part] = k
    return owner


def distribution(scores: ClientScores, target: float | None = None) -> dict[str, float]:
    """The distribution of the clients' accuracies (clients with test data only)."""
    seen = scores.count > 0
    acc, loss = scores.accuracy[seen], scores.loss[seen]
    out: dict[str, float] = {"clients_evaluated": int(seen.sum())}
    if not acc.size:
        return out
    out["client_accuracy_mean"] = float(np.mean(acc))
    for q, value in zip(PERCENTILES, np.percentile(acc, PERCENTILES), strict=True):
        out[f"client_accuracy_p{q}"] = float(value)
    worst = np.sort(acc)[:max(1, math.ceil(0.1 * acc.size))]
    out["client_accuracy_worst10"] = float(np.mean(worst))
    if target is not None:
        out["client_accuracy_above_target"] = float(np.mean(acc >= target))
    out["client_loss_mean"] = float(np.mean(loss))
    return out


def make_client_evaluator(
    apply_fn: Callable[[Any, jax.Array], jax.Array],
    x: np.ndarray,
    y: np.ndarray,
    clients: np.ndarray,
    *,
    target: float | None = None,
    num_clients: int | None = None,
    chunk: int = 1000,
    pad_id: int = 0,
) -> Callable[[Any], dict[str, float]]:
    """A compiled ``evaluate(params) -> dict`` of the global and per-client test metrics.

    Args:
      apply_fn: the model's ``apply(params, x) -> logits``.
      x, y: the pooled test set; sequence labels ``y [N, T]`` are scored per token, and
        targets equal to ``pad_id`` count for nothing (as in ``make_evaluator``).
      clients: ``[N]`` int, the client of each test example (``client_index``); -1 for an
        example of no client (scored globally only).
      target: the accuracy ``client_accuracy_above_target`` counts clients against.
      num_clients: K (default: the largest client index + 1); clients without test data
        are left out of the distribution.
      chunk: examples per scan step (memory is one chunk's activations).

    Returns:
      ``evaluate(params)``: ``test_accuracy`` and ``test_loss`` over the whole test set, and
      the distribution over clients (``distribution``). ``evaluate.scores(params)`` gives
      each client's ``ClientScores``.
    """
    clients = np.asarray(clients)
    if clients.shape != (len(y),):
        raise ValueError(f"clients must be [N] = [{len(y)}], got {clients.shape}.")
    num_clients = max(int(clients.max(initial=-1)) + 1, num_clients or 1)
    n = len(y)
    sequence = y.ndim > 1
    chunks = max(math.ceil(n / chunk), 1)
    pad = chunks * chunk - n

    def padded(a, fill=0):
        return np.concatenate([a, np.full((pad, *a.shape[1:]), fill, a.dtype)])

    xs = jnp.asarray(padded(x)).reshape(chunks, chunk, *x.shape[1:])
    ys = jnp.asarray(padded(y).astype(np.int32)).reshape(chunks, chunk, *y.shape[1:])
    # Padding and examples of no client go to an extra segment K, dropped from the clients.
    owners = np.where(clients >= 0, clients, num_clients).astype(np.int32)
    owner = jnp.asarray(padded(owners, num_clients)).reshape(chunks, chunk)
    mask = jnp.asarray(np.arange(chunks * chunk) < n, jnp.float32).reshape(chunks, chunk)

    @jax.jit
    def scores(params, xs, ys, owner, mask):
        def body(carry, batch):
            bx, by, bo, bm = batch
            logits = apply_fn(params, bx)
            logp = jax.nn.log_softmax(logits.astype(jnp.float32))
            nll = -jnp.take_along_axis(logp, by[..., None], axis=-1)[..., 0]
            correct = (jnp.argmax(logits, axis=-1) == by).astype(jnp.float32)
            weight = bm[:, None] * (by != pad_id) if sequence else bm
            if sequence:  # per example: sums over its tokens
                correct, nll = jnp.sum(correct * weight, -1), jnp.sum(nll * weight, -1)
                weight = jnp.sum(weight, -1)
            else:
                correct, nll = correct * weight, nll * weight
            segments = num_clients + 1
            add = [jax.ops.segment_sum(v, bo, segments) for v in (correct, nll, weight)]
            return tuple(c + a for c, a in zip(carry, add, strict=True)), None

        zeros = tuple(jnp.zeros(num_clients + 1, jnp.float32) for _ in range(3))
        totals, _ = jax.lax.scan(body, zeros, (xs, ys, owner, mask))
        return totals

    def raw(params):
        correct, nll, count = (np.asarray(v, np.float64)
                               for v in jax.device_get(scores(params, xs, ys, owner, mask)))
        return correct, nll, count

    def client_scores(params) -> ClientScores:
        correct, nll, count = raw(params)
        safe = np.maximum(count[:num_clients], 1.0)
        return ClientScores(correct[:num_clients] / safe, nll[:num_clients] / safe,
                            count[:num_clients])

    def evaluate(params) -> dict[str, float]:
        correct, nll, count = raw(params)
        total = max(count.sum(), 1.0)
        safe = np.maximum(count[:num_clients], 1.0)
        per_client = ClientScores(correct[:num_clients] / safe, nll[:num_clients] / safe,
                                  count[:num_clients])
        return {"test_accuracy": float(correct.sum() / total),
                "test_loss": float(nll.sum() / total),
                **distribution(per_client, target)}

    cast(Any, evaluate).scores = client_scores  # (a function attribute)
    return evaluate
