"""Secure aggregation in the networked runtime: what the server and its clients share.

A task whose aggregator declares ``secure`` (a ``fedax.federated.SecureSum``) runs SecAgg+
(``fedax.runtime.secagg``) each round instead of plain reports: the client runs the
aggregator's client stage itself, encodes its output as integers in [0, 2^b) and the
server learns only their sum mod 2^b (``fedax.runtime.secure_phase``, the server's side;
``fedax.runtime.secure_client``, the client's). This module holds the encoding both sides
agree on:

* ``SecurePlan``: the client stage's output (its pytree of shapes and dtypes) and the one
  vector of length d that carries it: every leaf, encoded (``secure_client_step``, the
  client's training, client stage and encoding in one compiled program), raveled and
  concatenated in ``jax.tree`` order (``flatten``), split back by the server and decoded
  (``decode``: ``fedax.federated.secure.decode_tree`` for a float ``SecureSum`` with the
  number of clients *selected* n, which fixes the quantization levels; the integers
  themselves for ``clip=None``, e.g. distributed DP's noised integers);
* the keys: client i of the n selected quantizes leaf j with ``fold_in(k_i, j)``, k_i =
  ``client_keys(reduce_key, n)[i]`` and ``reduce_key`` the second of ``round_keys`` of the
  round key, exactly the simulator's ``secure_sum`` (``secure_keys``);
* the wire: every SecAgg+ message travels as its own bytes (``messages.py``, parsed
  strictly) in one uint8 ``Tensor`` at path ``SECAGG_PATH`` (``pack``, ``unpack``); the
  server's requests after the training task have the envelope kinds ``STAGES``;
* the protocol's shape: k neighbours (``secure.num_shares``, default
  ``default_num_shares(n)``) and the threshold t (``secure.threshold``, default
  ``default_threshold(k)``), with t > k/2 required (``protocol_shape``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import numpy as np

from fedax.runtime import wire
from fedax.runtime.secagg import (
    EncryptedShares,
    KeyDirectory,
    MaskedVector,
    PublicKeys,
    SecAggError,
    ShareDelivery,
    SurvivorSet,
    SurvivorSignature,
    UnmaskRequest,
    UnmaskShares,
    default_num_shares,
)

SECAGG_PATH = "secagg"
STAGE_KEY_PATH = "['stage']['key']"  # a client's client-stage key (a rehearsal's only)
SECURE_KEY_PATH = "['secure']['key']"  # its quantization key k_i
KEYS, MASKED, UNMASK = "secagg-keys", "secagg-masked", "secagg-unmask"
SIGN = "secagg-sign"  # the consistency check, between MASKED and UNMASK (with a roster)
STAGES = (KEYS, MASKED, SIGN, UNMASK)  # envelope kinds (and the server's phases) after "task"


class MessageClass(Protocol):
    """A SecAgg+ message class (``fedax.runtime.secagg``): it parses its bytes."""

    def from_bytes(self, data: bytes) -> Any: ...


REQUESTS: dict[str, MessageClass] = {KEYS: KeyDirectory, MASKED: ShareDelivery,
                                     SIGN: SurvivorSet, UNMASK: UnmaskRequest}
# what a client answers in each phase ("train": the training task, with the Setup)
REPLIES: dict[str, MessageClass] = {"train": PublicKeys, KEYS: EncryptedShares,
                                    MASKED: MaskedVector, SIGN: SurvivorSignature,
                                    UNMASK: UnmaskShares}


def default_threshold(num_shares: int) -> int:
    """t = max(⌊k/2⌋ + 1, ⌊2k/3⌋): a strict majority of the k holders of each secret (so a
    server that lies about who dropped cannot collect t shares of both secrets of one node
    from clients that each reveal one), and about 2/3 of them, which tolerates k/3
    drop-outs in a neighbourhood."""
    return max(num_shares // 2 + 1, (2 * num_shares) // 3)


def protocol_shape(n: int, num_shares: int | None, threshold: int | None) -> tuple[int, int]:
    """``(k, t)`` for a round of ``n`` selected clients; ValueError (one line, naming the
    config key) when they do not fit."""
    if n < 2:
        raise ValueError(f"secure aggregation needs at least 2 clients a round, got {n}: "
                         "one client's sum is its update")
    k = default_num_shares(n) if num_shares is None else min(int(num_shares), n)
    if k % 2 == 0 and k != n:
        raise ValueError(f"secure.num_shares {k} must be odd (or the {n} clients selected)")
    t = default_threshold(k) if threshold is None else int(threshold)
    if not k / 2 < t <= k:
        raise ValueError(f"secure.threshold {t} must exceed half of num_shares {k} (and not "
                         "exceed it): with t <= k/2 a server that lies about drop-outs can "
                         "unmask one client's update")
    return k, t


@dataclasses.dataclass(frozen=True)
class SecurePlan:
    """How the client stage's output crosses as one vector (see the module docstring).

    Attributes:
      spec: the aggregator's ``SecureSum``.
      update: the client stage's output, as ``jax.ShapeDtypeStruct`` leaves.
      shapes: each leaf's shape, in ``jax.tree`` order.
      length: d, the vector's length (every leaf's size together).
    """

    spec: Any
    update: Any
    shapes: tuple[tuple[int, ...], ...]
    length: int

    def flatten(self, encoded: Any) -> np.ndarray:
        """One client's encoded leaves (uint32, < 2^b) as the uint32 vector of length d."""
        import jax

        leaves = [np.asarray(a) for a in jax.tree.leaves(encoded)]
        if [a.shape for a in leaves] != list(self.shapes) or any(
                a.dtype != np.uint32 for a in leaves):
            raise ValueError("the encoded client stage does not match the task's shapes")
        return np.concatenate([a.ravel() for a in leaves]) if leaves else np.zeros(
            0, np.uint32)

    def split(self, total: np.ndarray) -> list[np.ndarray]:
        """The protocol's sum (uint32 [d]) as the leaves' sums."""
        out, start = [], 0
        for shape in self.shapes:
            size = math.prod(shape)
            out.append(np.asarray(total[start:start + size], np.uint32).reshape(shape))
            start += size
        return out

    def decode(self, leaves: list[Any], n: int) -> Any:
        """The aggregator's reduced value from the leaves' modular sums (traceable)."""
        import jax

        totals = jax.tree.unflatten(jax.tree.structure(self.update), leaves)
        if self.spec.clip is None:
            return totals
        from fedax.federated import secure

        return secure.decode_tree(totals, self.spec, n, self.update)


def secure_plan(task: Any, pieces: Any, params: Any) -> SecurePlan | None:
    """The plan of ``task``'s aggregator (None when it does not sum securely); ValueError
    if its client stage's output does not suit its ``SecureSum`` (floats for a clip range,
    uint32 for ``clip=None``)."""
    import jax
    import jax.numpy as jnp

    from fedax.runtime.task import report_template

    spec = pieces.aggregator.secure
    if spec is None:
        return None
    update = report_template(pieces, params, task.input_shape, task.input_dtype,
                             task.label_shape, encoded=True).update
    leaves = jax.tree.leaves(update)
    if spec.clip is None:
        ok = all(a.dtype == jnp.uint32 for a in leaves)
    else:
        ok = all(jnp.issubdtype(a.dtype, jnp.floating) for a in leaves)
    if not leaves or not ok:
        raise ValueError("the aggregator's client stage must output "
                         + ("uint32 integers" if spec.clip is None else "floats")
                         + " for its secure sum")
    shapes = tuple(tuple(int(d) for d in a.shape) for a in leaves)
    length = sum(math.prod(s) for s in shapes)
    if not 1 <= length < 2**32:
        raise ValueError(f"a secure sum of {length} coordinates does not fit SecAgg+")
    return SecurePlan(spec, update, shapes, length)


def secure_client_step(pieces: Any, plan: SecurePlan, n: int, payload: Any,
                       client_state: Any, batches: Any, num_examples: Any, train_key: Any,
                       stage: Any, raw_key: Any) -> tuple[Any, Any, Any]:
    """A secure client's half of a round in one program (``jax.jit`` with ``n`` static):
    ``fedax.runtime.task.client_step`` with the aggregator's client stage, and its output
    encoded for a sum over ``n`` clients with the quantization key ``raw_key``. Returns
    ``(report, encoded leaves, new client state)``; the report (the float update, for the
    client's finite check) never leaves the client."""
    from fedax.federated import secure
    from fedax.runtime.task import client_step

    report, new_state = client_step(pieces, payload, client_state, batches, num_examples,
                                    train_key, stage)
    encoded = report.update
    if plan.spec.clip is not None:
        encoded = secure.encode_tree(report.update, raw_key, plan.spec, n)
    return report, encoded, new_state


def expected_clients(task: Any) -> int | None:
    """The n a task's rounds select when nothing fails (its cohort size; the client
    compiles its secure step for it before polling), None if it cannot be encoded."""
    from fedax.builder.privacy_plan import cohort_size

    n = cohort_size(task.spec(), task.num_clients)
    spec = task.spec().secure
    try:
        protocol_shape(n, spec and spec.num_shares, spec and spec.threshold)
    except ValueError:
        return None
    return n


def secure_steps(task: Any, pieces: Any, params: Any) -> dict[str, Any]:
    """A client's compiled secure steps: ``secure`` (the ``SecurePlan``, None for a plain
    task), ``secure_step(n)`` (``secure_client_step`` compiled for n, kept for a few n) and
    ``secure_n`` (the n it compiles for before polling, ``expected_clients``)."""
    import functools

    import jax

    plan = secure_plan(task, pieces, params)
    if plan is None:
        return {"secure": None}

    @functools.lru_cache(maxsize=4)
    def step(n: int):
        return jax.jit(functools.partial(secure_client_step, pieces, plan, n))

    return {"secure": plan, "secure_step": step, "secure_n": expected_clients(task)}


def secure_keys(key: Any, n: int) -> np.ndarray:
    """``[n, ...]`` raw quantization keys of the n selected clients from the round key:
    ``client_keys(round_keys(key, n)[1], n)``, the simulator's ``secure_sum`` keys."""
    from fedax.aggregators.base import round_keys
    from fedax.federated import secure

    return np.asarray(secure.client_keys(round_keys(key, n)[1], n))


def pack(message: Any) -> Any:
    """A SecAgg+ message as the one ``Tensor`` that carries it."""
    return wire.encode_arrays([(SECAGG_PATH, np.frombuffer(message.to_bytes(), np.uint8))])[0]


def tensor_bytes(tensor: Any) -> bytes:
    """The bytes of a ``pack``ed tensor, checked (``WireError`` ``structure``)."""
    data = bytes(tensor.data)
    if (tensor.path, tensor.dtype, list(tensor.shape)) != (SECAGG_PATH, "uint8", [len(data)]):
        raise wire.WireError("structure", f"a secure-aggregation message is one uint8 array "
                                          f"{SECAGG_PATH!r}, got {tensor.path!r} "
                                          f"{tensor.dtype}{list(tensor.shape)}")
    return data


def unpack(tensors: Any, kind: MessageClass) -> Any:
    """The one message of ``kind`` in ``tensors``: ``WireError`` for anything but one
    ``pack``ed tensor, ``SecAggError`` for bytes that do not parse."""
    tensors = list(tensors)
    if len(tensors) != 1:
        raise wire.WireError("structure", f"a secure-aggregation message is one array, got "
                                          f"{len(tensors)}")
    return kind.from_bytes(tensor_bytes(tensors[0]))


def sender(message: Any) -> int:
    """The client id a reply names as its sender."""
    return int(message.src if isinstance(message, EncryptedShares) else message.cid)


__all__ = ["KEYS", "MASKED", "REPLIES", "REQUESTS", "SECAGG_PATH", "SECURE_KEY_PATH",
           "SIGN", "STAGES", "STAGE_KEY_PATH", "UNMASK", "SecAggError", "SecurePlan",
           "default_threshold", "expected_clients", "pack", "protocol_shape",
           "secure_client_step", "secure_keys", "secure_plan", "secure_steps",
           "sender", "tensor_bytes", "unpack"]
