"""The MNIST models of McMahan et al. (2017), "Communication-Efficient Learning of Deep
Networks from Decentralized Data", AISTATS (arXiv 1602.05629), section 3.

Both take images ``[B, 28, 28, 1]`` (or anything with 784 features per example, e.g.
``[B, 784]``) and return logits ``[B, 10]``. Params are plain nested dicts
``{layer: {"kernel": w, "bias": b}}`` of float32 arrays.

Initialization: kernels are Glorot (Xavier) uniform, U(-a, a) with
a = sqrt(6 / (fan_in + fan_out)) (fan = receptive field x channels for convolutions),
biases are zeros, i.e. the Keras/TensorFlow defaults. The paper does not state its
initialization.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fedax.models.base import Model, Params

CONV_IMPLS = ("lax", "patches", "lax_vjp")

_IMAGE_SHAPE = (28, 28, 1)
_NUM_CLASSES = 10


def glorot_uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Glorot & Bengio (2010) uniform: U(-a, a), a = sqrt(6 / (fan_in + fan_out)).

    For a kernel ``[..., in, out]`` (dense ``[in, out]``, conv HWIO), the fans are ``in`` and
    ``out`` times the receptive field size ``prod(shape[:-2])``.
    """
    receptive = math.prod(shape[:-2])
    limit = math.sqrt(6 / (receptive * (shape[-2] + shape[-1])))
    return jax.random.uniform(key, shape, jnp.float32, -limit, limit)


def _dense_init(key: jax.Array, fan_in: int, fan_out: int) -> dict[str, jax.Array]:
    return {
        "kernel": glorot_uniform(key, (fan_in, fan_out)),
        "bias": jnp.zeros((fan_out,), jnp.float32),
    }


def _conv_init(key: jax.Array, size: int, c_in: int, c_out: int) -> dict[str, jax.Array]:
    return {
        "kernel": glorot_uniform(key, (size, size, c_in, c_out)),  # HWIO
        "bias": jnp.zeros((c_out,), jnp.float32),
    }


def _dense(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return x @ p["kernel"] + p["bias"]


def _flat_features(x: jax.Array) -> jax.Array:
    """``[B, ...]`` with 784 features per example -> ``[B, 784]``; a clear error otherwise."""
    size = math.prod(_IMAGE_SHAPE)
    if x.ndim < 2 or math.prod(x.shape[1:]) != size:
        raise ValueError(
            f"expected MNIST inputs of shape [B, 28, 28, 1] or [B, 784], got {tuple(x.shape)}"
        )
    return x.reshape(x.shape[0], size)


def _same_padding(size: int) -> tuple[int, int]:
    """'SAME' padding for stride 1: (k-1)//2 before, the rest after (as in XLA/TF)."""
    lo = (size - 1) // 2
    return lo, size - 1 - lo


_NHWC = ("NHWC", "HWIO", "NHWC")


def _conv_nhwc(x: jax.Array, kernel: jax.Array, padding) -> jax.Array:
    return jax.lax.conv_general_dilated(x, kernel, (1, 1), padding, dimension_numbers=_NHWC)


@jax.custom_vjp
def _conv_same_vjp(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """'SAME' stride-1 convolution whose gradients are again canonical NHWC/HWIO
    convolutions (see :func:`conv2d`, ``impl="lax_vjp"``)."""
    kh, kw = kernel.shape[:2]
    return _conv_nhwc(x, kernel, (_same_padding(kh), _same_padding(kw)))


def _conv_same_fwd(x, kernel):
    return _conv_same_vjp(x, kernel), (x, kernel)


def _conv_same_bwd(residuals, g):
    """dx[b,i,j,c] = sum g[b,i-di+lo,j-dj+lo,o] w[di,dj,c,o]: g correlated with the flipped,
    in/out-swapped kernel (padding mirrored); dw[di,dj,c,o] = sum_{b,i,j} xpad[b,i+di,j+dj,c]
    g[b,i,j,o]: a convolution of x^T [C,H,W,B] with g^T [H,W,B,O] (the batch is the
    contracted feature axis), giving [C,kh,kw,O]."""
    x, kernel = residuals
    kh, kw = kernel.shape[:2]
    (lo_h, hi_h), (lo_w, hi_w) = _same_padding(kh), _same_padding(kw)
    flipped = jnp.flip(kernel, (0, 1)).transpose(0, 1, 3, 2)
    dx = _conv_nhwc(g, flipped, ((hi_h, lo_h), (hi_w, lo_w)))
    dw = _conv_nhwc(x.transpose(3, 1, 2, 0), g.transpose(1, 2, 0, 3), ((lo_h, hi_h), (lo_w, hi_w)))
    return dx, dw.transpose(1, 2, 0, 3)


_conv_same_vjp.defvjp(_conv_same_fwd, _conv_same_bwd)


def conv2d(x: jax.Array, kernel: jax.Array, impl: str = "lax") -> jax.Array:
    """2-D convolution (cross-correlation), stride 1, 'SAME' padding, no bias.

    ``y[b, i, j, o] = sum_{di, dj, c} xpad[b, i + di, j + dj, c] * kernel[di, dj, c, o]``,
    where ``xpad`` is ``x`` zero-padded by ``(k-1)//2`` before and ``k-1-(k-1)//2`` after
    on each spatial axis.

    Args:
        x: ``[B, H, W, Cin]`` (NHWC).
        kernel: ``[kh, kw, Cin, Cout]`` (HWIO).
        impl: ``"lax"``, ``jax.lax.conv_general_dilated``; or ``"patches"``, the
            ``kh*kw`` shifted windows of ``xpad`` concatenated on the channel axis
            (``[B, H, W, kh*kw*Cin]``, ordered (di, dj, c)) times the kernel reshaped to
            ``[kh*kw*Cin, Cout]`` in a single matmul. Same numbers; the patches form is
            much faster on XLA:CPU inside loops and under ``vmap``. ``"lax_vjp"``:
            ``lax`` convolutions with a hand-written reverse-mode rule whose input and
            weight gradients are themselves canonical NHWC/HWIO convolutions. XLA:CPU
            rewrites autodiff's weight-gradient convolution into that form only outside
            loops; inside a loop it runs it about 10x slower (jax-ml/jax#12868), so this
            is the fast CPU form for local steps (1.25x faster per step than ``patches``
            on one core, ``benchmarks/bench_conv.py``). Reverse mode only: forward-mode
            AD (``jax.jvp``) raises; use ``lax`` or ``patches`` for that.

    Returns:
        ``[B, H, W, Cout]``.
    """
    kh, kw, c_in, c_out = kernel.shape
    pad_h, pad_w = _same_padding(kh), _same_padding(kw)
    if impl == "lax":
        return _conv_nhwc(x, kernel, (pad_h, pad_w))
    if impl == "patches":
        _, h, w, _ = x.shape
        xpad = jnp.pad(x, ((0, 0), pad_h, pad_w, (0, 0)))
        windows = [xpad[:, di : di + h, dj : dj + w, :] for di in range(kh) for dj in range(kw)]
        patches = jnp.concatenate(windows, axis=-1)
        return patches @ kernel.reshape(kh * kw * c_in, c_out)
    if impl == "lax_vjp":
        return _conv_same_vjp(x, kernel)
    raise ValueError(f"unknown conv_impl {impl!r}; allowed: {', '.join(CONV_IMPLS)}")


def max_pool_2x2(x: jax.Array) -> jax.Array:
    """2x2 max pooling with stride 2 ('VALID': an odd last row/column is dropped).

    Written as a reshape and a max, which XLA:CPU runs faster than ``reduce_window``.
    """
    b, h, w, c = x.shape
    x = x[:, : h // 2 * 2, : w // 2 * 2, :]
    return x.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


def mlp_2nn() -> Model:
    """McMahan et al.'s "2NN": 784 -> 200 ReLU -> 200 ReLU -> 10; 199,210 params.

    784*200+200 + 200*200+200 + 200*10+10 = 199,210.
    """

    def init(key: jax.Array) -> Params:
        k1, k2, k3 = jax.random.split(key, 3)
        return {
            "dense1": _dense_init(k1, 784, 200),
            "dense2": _dense_init(k2, 200, 200),
            "dense3": _dense_init(k3, 200, _NUM_CLASSES),
        }

    def apply(params: Params, x: jax.Array) -> jax.Array:
        h = _flat_features(x).astype(params["dense1"]["kernel"].dtype)
        h = jax.nn.relu(_dense(params["dense1"], h))
        h = jax.nn.relu(_dense(params["dense2"], h))
        return _dense(params["dense3"], h)

    return Model(init, apply)


def cnn(conv_impl: str = "auto") -> Model:
    """McMahan et al.'s MNIST CNN; 1,663,370 params.

    conv 5x5x32 ('SAME') + ReLU -> maxpool 2x2 -> conv 5x5x64 ('SAME') + ReLU ->
    maxpool 2x2 -> flatten (7*7*64 = 3136) -> FC 512 ReLU -> FC 10.
    Params: 832 + 51,264 + 1,606,144 + 5,130 = 1,663,370 (with 'VALID' padding it would be
    582,026, a common slip).

    Args:
        conv_impl: ``"lax"``, ``"patches"`` or ``"lax_vjp"``, for both convolutions; see
            :func:`conv2d`. All use the same params and compute the same function.
            ``"auto"`` (default) picks per backend and layer: on accelerators ``"lax"``;
            on CPU ``"lax_vjp"`` for the 32-channel second convolution, where XLA runs
            autodiff's ``lax`` weight-gradient convolutions inside loops several times
            slower (jax-ml/jax#12868), and ``"patches"`` for the one-channel first, a
            single ``[B*784, 25] @ [25, 32]`` product that XLA:CPU computes faster than its
            one-input-channel convolution (``benchmarks/profile_step.py``: that
            convolution ran at 9 GFLOP/s where the second ran at 68;
            ``benchmarks/bench_conv.py`` times the whole step).
    """
    if conv_impl == "auto":
        on_cpu = jax.default_backend() == "cpu"
        impls = ("patches", "lax_vjp") if on_cpu else ("lax", "lax")
    elif conv_impl in CONV_IMPLS:
        impls = (conv_impl, conv_impl)
    else:
        raise ValueError(f"unknown conv_impl {conv_impl!r}; allowed: {', '.join(CONV_IMPLS)}")

    def init(key: jax.Array) -> Params:
        k1, k2, k3, k4 = jax.random.split(key, 4)
        return {
            "conv1": _conv_init(k1, 5, 1, 32),
            "conv2": _conv_init(k2, 5, 32, 64),
            "dense1": _dense_init(k3, 7 * 7 * 64, 512),
            "dense2": _dense_init(k4, 512, _NUM_CLASSES),
        }

    def apply(params: Params, x: jax.Array) -> jax.Array:
        h = _flat_features(x).reshape(-1, *_IMAGE_SHAPE)
        h = h.astype(params["conv1"]["kernel"].dtype)
        for name, impl in zip(("conv1", "conv2"), impls, strict=True):
            p = params[name]
            h = max_pool_2x2(jax.nn.relu(conv2d(h, p["kernel"], impl) + p["bias"]))
        h = jax.nn.relu(_dense(params["dense1"], h.reshape(h.shape[0], -1)))
        return _dense(params["dense2"], h)

    return Model(init, apply)
