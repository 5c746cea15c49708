"""How much of the Shakespeare LSTM's test accuracy depends on how the test text is cut?

Reads the server model of a ``fedax reproduce fedavg-shakespeare`` checkpoint and scores it
on the full test data three ways:

* chunk samples (what the chunk cells report): each 80-character window starts from a
  zero state, so its first characters are predicted with little context; the accuracy is
  also printed by position in the window;
* line samples (what the ``*-natural-line`` cells report): one printed line per sample,
  predicted from its preceding newline only;
* a stream: each client's test text read once, with the LSTM state carried from one
  80-character window to the next (as a truncated-BPTT language model is evaluated).

The stream uses its own plain LSTM (``sigmoid`` gates, i-f-g-o order, the equations of
``fedax.models.lstm``), checked against ``char_lstm``'s ``apply`` on the first window.

Usage: python experiments/shakespeare_context.py CHECKPOINT
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from fedax.data.shakespeare import PAD, VOCAB_SIZE, load_shakespeare
from fedax.models.lstm import char_lstm
from fedax.simulation.checkpoint import read_checkpoint

LAYERS, HIDDEN = 2, 256
PREFIX = ".server.params"
MODEL = char_lstm(VOCAB_SIZE)


def server_params(path: str) -> dict:
    """The ``server.params`` leaves of a checkpoint as a nested dict of arrays."""
    params: dict = {}
    for leaf in read_checkpoint(path)["state"]:
        if not leaf["path"].startswith(PREFIX):
            continue
        keys = [k.strip("'") for k in leaf["path"][len(PREFIX):].strip("[]").split("][")]
        value = np.frombuffer(leaf["data"], leaf["data_dtype"]).reshape(leaf["data_shape"])
        node = params
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = jnp.asarray(value)
    return params


def _layer(cell, xs, h, c):
    projected = xs @ cell["w_x"] + cell["b"]

    def step(carry, z):
        h, c = carry
        i, f, g, o = jnp.split(z + h @ cell["w_h"], 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    (h, c), hs = jax.lax.scan(step, (h, c), projected)
    return hs, (h, c)


@jax.jit
def stream_window(params, state, x):
    """Logits of one window ``x`` ``[B, T]`` from ``state``; returns the new state too."""
    h = params["embed"][x.T]
    new_state = []
    for layer in range(LAYERS):
        h, carry = _layer(params[f"lstm_{layer}"], h, *state[layer])
        new_state.append(carry)
    return new_state, jnp.swapaxes(h, 0, 1) @ params["out"]["kernel"] + params["out"]["bias"]


def zero_state(batch: int):
    return [(jnp.zeros((batch, HIDDEN)), jnp.zeros((batch, HIDDEN))) for _ in range(LAYERS)]


def by_position(params, x, y, batch=2000):
    """Correct predictions and targets per window position."""
    predict = jax.jit(lambda p, xb: jnp.argmax(MODEL.apply(p, xb), -1))
    correct = np.zeros(x.shape[1])
    count = np.zeros(x.shape[1])
    for i in range(0, len(x), batch):
        pred = np.asarray(predict(params, jnp.asarray(x[i:i + batch])))
        real = y[i:i + batch] != PAD
        correct += ((pred == y[i:i + batch]) & real).sum(0)
        count += real.sum(0)
    return correct, count


def stream_accuracy(params, data) -> float:
    """Accuracy with the state carried across each client's consecutive chunk windows."""
    x, y, parts = data["x_test"], data["y_test"], data["test_partition"]
    windows = max(len(p) for p in parts)
    xs = np.full((windows, len(parts), x.shape[1]), PAD, np.int32)
    ys = xs.copy()
    for k, idx in enumerate(parts):
        xs[: len(idx), k], ys[: len(idx), k] = x[idx], y[idx]
    state = zero_state(len(parts))
    correct = total = 0
    for w in range(windows):
        state, logits = stream_window(params, state, jnp.asarray(xs[w]))
        if w == 0:  # the plain LSTM from a zero state is the model's own apply
            ref = MODEL.apply(params, jnp.asarray(xs[0]))
            np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=2e-3)
        real = ys[w] != PAD
        correct += int(((np.asarray(jnp.argmax(logits, -1)) == ys[w]) & real).sum())
        total += int(real.sum())
    return correct / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    params = server_params(parser.parse_args().checkpoint)
    for sample in ("chunk", "line"):
        data = load_shakespeare(sample=sample)
        correct, count = by_position(params, data["x_test"], data["y_test"])
        print(f"{sample} samples: accuracy {correct.sum() / count.sum():.4f} "
              f"over {int(count.sum())} targets")
        for a, b in ((0, 5), (5, 10), (10, 20), (20, 40), (40, 80)):
            print(f"  positions {a:2d}-{b - 1:2d}: {correct[a:b].sum() / count[a:b].sum():.4f}")
        if sample == "chunk":
            print(f"chunk windows as one stream per client: {stream_accuracy(params, data):.4f}")


if __name__ == "__main__":
    main()
