"""The Shakespeare character LSTM of McMahan et al. (2017), section 3.

Characters -> learned ``embed_dim``-dimensional embedding -> ``layers`` stacked LSTM layers of
``hidden`` units -> a dense softmax layer over the vocabulary at every time step. ``apply``
takes int ids ``[B, T]`` and returns logits ``[B, T, V]``; the state starts at zero for each
sequence.

LSTM cell (gates in the order i, f, g, o; ``W_x`` ``[in, 4H]``, ``W_h`` ``[H, 4H]``, ``b``
``[4H]``)::

    z = x_t W_x + h_{t-1} W_h + b;   [z_i, z_f, z_g, z_o] = split(z, 4)
    i = sigmoid(z_i + p_i * c_{t-1});   f = sigmoid(z_f + p_f * c_{t-1});   g = tanh(z_g)
    c_t = f * c_{t-1} + i * g
    o = sigmoid(z_o + p_o * c_t);   h_t = o * tanh(c_t)

The diagonal peepholes ``p_i, p_f, p_o`` (Gers & Schmidhuber 2000; TensorFlow's
``LSTMCell(use_peepholes=True)``) exist only with ``peephole=True``; without them this is the
standard LSTM. Parameter count, with V = vocabulary, E = embed_dim, H = hidden, L = layers::

    V*E + 4H(E + H + 1) + (L - 1) * 4H(2H + 1) + [L * 3H if peephole] + H*V + V

The paper's 866,578 parameters (E = 8, H = 256, L = 2) are matched exactly by the peephole
LSTM with V = 258: ``char_lstm(258, peephole=True)`` (the standard LSTM then has 865,042).
With the 98-character table of ``fedax.data.shakespeare`` the standard model has 822,642.

Speed (``benchmarks/bench_lstm.py``, ``benchmarks/profile_step.py char_lstm``): the input
projection ``x W_x + b`` of all time steps is one matmul outside the ``lax.scan``, so each
(time-major) step does only ``h W_h`` and the gates, which are one ``tanh`` over the fused
``[..., 4H]`` block. A custom JVP rule keeps the backward pass's weight-gradient products out
of the loop (one matmul per layer and sequence) and leaves its loop one product with
``W_h^T`` and a few fused element-wise operations per step.

Initialization (the Keras defaults; the paper does not state its own): embedding U(-0.05,
0.05), ``W_x`` and the output kernel Glorot uniform, ``W_h`` orthogonal, biases zero except
the forget gate's, which is 1; peepholes zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedax.models.base import Model, Params
from fedax.models.mnist import glorot_uniform

_EMBED_INIT_SCALE = 0.05
# Unrolling a few steps of the scan lets XLA fuse across steps; measured on CPU at B = 10.
_SCAN_UNROLL = 2


def _lstm_layer_init(key: jax.Array, fan_in: int, hidden: int, peephole: bool) -> Params:
    k_x, k_h = jax.random.split(key)
    bias = jnp.zeros((4 * hidden,), jnp.float32).at[hidden : 2 * hidden].set(1.0)
    cell = {
        "w_x": glorot_uniform(k_x, (fan_in, 4 * hidden)),
        "w_h": jax.nn.initializers.orthogonal()(k_h, (hidden, 4 * hidden), jnp.float32),
        "b": bias,
    }
    if peephole:
        cell["peephole"] = jnp.zeros((3, hidden), jnp.float32)  # rows: i, f, o
    return cell


def _cell(z: jax.Array, c_prev: jax.Array, peep: jax.Array | None):
    """One LSTM step from the fused pre-activations ``z`` ``[..., 4H]`` (the module's equations).

    The three sigmoids and the tanh of the gates are one ``tanh`` over the whole contiguous
    ``[..., 4H]`` block, ``sigmoid(v) = (1 + tanh(v / 2)) / 2``: XLA:CPU vectorizes one
    transcendental over a contiguous block but not four over slices of it, which made the
    gates 5x slower than the step's product (measured, B = 10, H = 256). Without peepholes
    ``o`` is in the same block; with them ``o`` waits for ``c``.

    Returns ``h``, ``c`` and the activations ``(i, f, g, o, tanh(c))`` (for derivatives).
    """
    hidden = c_prev.shape[-1]
    if peep is None:
        t = jnp.tanh(z * _gate_scale(hidden, 4, z.dtype))
        i, f, g, o = jnp.split(t, 4, axis=-1)
        i, f, o = 0.5 * i + 0.5, 0.5 * f + 0.5, 0.5 * o + 0.5
        c = f * c_prev + i * g
    else:
        peeped = jnp.concatenate([peep[0] * c_prev, peep[1] * c_prev], axis=-1)
        z_if = z[..., : 2 * hidden] + peeped
        t = jnp.tanh(jnp.concatenate([z_if, z[..., 2 * hidden : 3 * hidden]], axis=-1)
                     * _gate_scale(hidden, 3, z.dtype))
        i, f, g = jnp.split(t, 3, axis=-1)
        i, f = 0.5 * i + 0.5, 0.5 * f + 0.5
        c = f * c_prev + i * g
        o = 0.5 * jnp.tanh(0.5 * (z[..., 3 * hidden :] + peep[2] * c)) + 0.5
    tanh_c = jnp.tanh(c)
    return o * tanh_c, c, (i, f, g, o, tanh_c)


def _gate_scale(hidden: int, gates: int, dtype) -> jax.Array:
    """``[1/2 (i), 1/2 (f), 1 (g), 1/2 (o)][:gates]``, each repeated ``hidden`` times."""
    return jnp.repeat(jnp.asarray([0.5, 0.5, 1.0, 0.5][:gates], dtype), hidden)


def _zero_state(projected: jax.Array, hidden: int) -> jax.Array:
    return jnp.zeros((*projected.shape[1:-1], hidden), projected.dtype)


@jax.custom_jvp
def _recurrence(w_h: jax.Array, peep: jax.Array | None, projected: jax.Array) -> jax.Array:
    """``h_1 .. h_T`` from the input projections ``projected`` ``[T, ..., 4H]``; zero state."""

    def step(carry, z_x):
        h, c = carry
        h, c, _ = _cell(z_x + h @ w_h, c, peep)
        return (h, c), h

    zeros = _zero_state(projected, w_h.shape[0])
    _, hs = jax.lax.scan(step, (zeros, zeros), projected, unroll=_SCAN_UNROLL)
    return hs


@_recurrence.defjvp
def _recurrence_jvp(primals, tangents):
    """Forward-mode rule, written so that its transpose (reverse mode) is fast.

    Autodiff of the scan would accumulate ``dL/dW_h`` (and ``dL/dpeep``) in the backward
    scan's carry, a ``[H, 4H]`` read-modify-write per step (per client under ``vmap``). Here
    every tangent term that does not depend on the tangent state, ``dprojected + h_{t-1}
    dW_h`` and the peephole terms, is computed for all steps at once, outside the scan; the
    tangent scan only carries ``(dh, dc)``. Its transpose then emits the cotangent of those
    terms per step and ``dL/dW_h = sum_t h_{t-1}^T a_t`` is one matmul. The rule is ordinary
    JAX code, so forward mode, reverse mode and their compositions all work.
    """
    w_h, peep, projected = primals
    dw_h, dpeep, dprojected = tangents
    hidden = w_h.shape[0]

    # The primal scan keeps one [..., 6H] row per step, (z, h, c): one store per step. The
    # activations and the tangent coefficients are then computed for all steps at once.
    def step(carry, z_x):
        h, c = carry
        z = z_x + h @ w_h
        h, c, _ = _cell(z, c, peep)
        return (h, c), jnp.concatenate([z, h, c], axis=-1)

    zeros = _zero_state(projected, hidden)
    _, rows = jax.lax.scan(step, (zeros, zeros), projected, unroll=_SCAN_UNROLL)
    zs, hs, cs = jnp.split(rows, [4 * hidden, 5 * hidden], axis=-1)
    h_prev = jnp.concatenate([zeros[None], hs[:-1]])
    c_prev = jnp.concatenate([zeros[None], cs[:-1]])
    _, _, (i, f, g, o, tanh_c) = _cell(zs, c_prev, peep)

    # Tangent terms independent of the tangent state, for all steps at once.
    a = dprojected + h_prev @ dw_h
    if peep is not None:
        a_i, a_f, a_g, a_o = jnp.split(a, 4, axis=-1)
        a = jnp.concatenate(
            [a_i + dpeep[0] * c_prev, a_f + dpeep[1] * c_prev, a_g, a_o + dpeep[2] * cs],
            axis=-1,
        )
    # The tangent state's recurrence, with the sigmoid and tanh derivatives s(1 - s) and
    # 1 - g^2 and the peepholes folded into coefficients computed here for all steps:
    #   u = dz * [k_i, k_f, k_g, k_o];  dc_t = u_i + u_f + u_g + f' dc_{t-1};
    #   dh_t = u_o + k_c' dc_t
    # (with peepholes dz_i, dz_f gain p_i dc_{t-1}, p_f dc_{t-1} and dz_o gains p_o dc_t, so
    # f' = f + k_i p_i + k_f p_f and k_c' = k_c + k_o p_o). The coefficients enter the scan
    # as they are: reverse mode linearizes the tangent scan, and any operation on known
    # values inside its body (even a split) would become a second scan storing its results;
    # one product and two sums per step keep its transpose to few XLA fusions per step.
    k_i, k_f, k_o = i * (1 - i) * g, f * (1 - f) * c_prev, o * (1 - o) * tanh_c
    gains = jnp.concatenate([k_i, k_f, i * (1 - g * g), k_o], axis=-1)
    carry_gain, out_gain = f, o * (1 - tanh_c * tanh_c)
    if peep is not None:
        carry_gain = carry_gain + k_i * peep[0] + k_f * peep[1]
        out_gain = out_gain + k_o * peep[2]

    # dh W_h as a product with W_h^T (made once, outside the scan) contracted on its second
    # axis: reverse mode runs this scan's transpose, whose per-step product is then
    # cotangent @ W_h^T read row-major. Written as dh @ W_h, its transpose contracts W_h on
    # its minor axis inside the loop, which XLA:CPU ran 2-4x slower (measured, B = 10).
    w_h_t = w_h.T
    contract_last = (((hs.ndim - 2,), (1,)), ((), ()))

    def tangent_step(carry, xs):
        dh, dc = carry
        a_t, gains_t, carry_t, out_t = xs
        u = (a_t + jax.lax.dot_general(dh, w_h_t, contract_last)) * gains_t
        u_i, u_f, u_g, u_o = jnp.split(u, 4, axis=-1)
        dc = u_i + u_f + u_g + carry_t * dc
        dh = u_o + out_t * dc
        return (dh, dc), dh

    _, dhs = jax.lax.scan(
        tangent_step,
        (jnp.zeros_like(zeros), jnp.zeros_like(zeros)),
        (a, gains, carry_gain, out_gain),
        unroll=_SCAN_UNROLL,
    )
    return hs, dhs


def lstm_layer(cell: Params, xs: jax.Array) -> jax.Array:
    """Runs one LSTM layer over a time-major sequence: ``[T, B, in]`` -> ``[T, B, H]``.

    The state starts at zero; peepholes are used iff ``cell`` has a ``"peephole"`` entry.
    The input projection of all steps is one matmul; the scan does ``h W_h`` per step.
    """
    projected = xs @ cell["w_x"] + cell["b"]  # [T, B, 4H]
    return _recurrence(cell["w_h"], cell.get("peephole"), projected)


def char_lstm_param_count(
    vocab_size: int, embed_dim: int = 8, hidden: int = 256, layers: int = 2, peephole: bool = False
) -> int:
    """The closed-form parameter count of :func:`char_lstm` (see the module docstring)."""
    count = vocab_size * embed_dim + hidden * vocab_size + vocab_size
    for layer in range(layers):
        fan_in = embed_dim if layer == 0 else hidden
        count += 4 * hidden * (fan_in + hidden + 1) + (3 * hidden if peephole else 0)
    return count


def char_lstm(
    vocab_size: int,
    embed_dim: int = 8,
    hidden: int = 256,
    layers: int = 2,
    peephole: bool = False,
) -> Model:
    """The character LSTM: embedding -> ``layers`` x LSTM(``hidden``) -> dense over the vocab.

    Args:
      vocab_size: V, the number of character ids (``fedax.data.shakespeare.VOCAB_SIZE``).
      embed_dim: E, the embedding size (paper: 8).
      hidden: H, units per LSTM layer (paper: 256).
      layers: Stacked LSTM layers (paper: 2).
      peephole: Add diagonal peephole connections (3H parameters per layer).

    Returns:
      A :class:`Model`; ``apply(params, x)`` maps int ids ``[B, T]`` to logits ``[B, T, V]``.
    """
    for name, value in (
        ("vocab_size", vocab_size),
        ("embed_dim", embed_dim),
        ("hidden", hidden),
        ("layers", layers),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")

    def init(key: jax.Array) -> Params:
        k_embed, k_out, *k_layers = jax.random.split(key, 2 + layers)
        params: Params = {
            "embed": jax.random.uniform(
                k_embed,
                (vocab_size, embed_dim),
                jnp.float32,
                -_EMBED_INIT_SCALE,
                _EMBED_INIT_SCALE,
            )
        }
        for layer, k in enumerate(k_layers):
            fan_in = embed_dim if layer == 0 else hidden
            params[f"lstm_{layer}"] = _lstm_layer_init(k, fan_in, hidden, peephole)
        params["out"] = {
            "kernel": glorot_uniform(k_out, (hidden, vocab_size)),
            "bias": jnp.zeros((vocab_size,), jnp.float32),
        }
        return params

    def apply(params: Params, x: jax.Array) -> jax.Array:
        if x.ndim != 2:
            raise ValueError(f"expected int ids of shape [B, T], got {tuple(x.shape)}")
        h = params["embed"][x.T]  # time-major [T, B, E]
        for layer in range(layers):
            h = lstm_layer(params[f"lstm_{layer}"], h)
        h = jnp.swapaxes(h, 0, 1)  # [B, T, H]
        return h @ params["out"]["kernel"] + params["out"]["bias"]

    return Model(init, apply)
