"""Fuzzing the networked runtime (issue 29, item 7): property-based tests (hypothesis) of the
wire decoder, the chunk joiner, the runtime's file format and the report bounds, then of
every RPC of one live server on loopback with random bytes, random shapes, dtypes and
paths, and random metadata. The properties: every malformed input is refused with a
reason (a ``WireError`` of a known kind, a ``ValueError``, a ``SubmitReply`` with
``accepted=False`` and a reason naming its kind, or a gRPC status with details), nothing
raises anything else, and the server stays up: after the fuzzing it still answers
``Status`` and an honest client still gets its task and has its report accepted.

Deterministic and bounded: ``derandomize=True`` (the same examples on every run), no
example database and hypothesis's caches in the temporary directory (nothing is written to
the tree), 60 to 150 examples per property, every call with a deadline, the server stopped
at the end of the module (within a bounded wait). About 20 s on 2 cores.

Three bugs this fuzzing found are fixed, and their tests stay (each with a "Was a bug"
comment): ``store.load`` of a well-framed non-map body, a non-ASCII nonce, ``Server.stop``
hanging after a Submit message that is no ``Chunk``.
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import string
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

import grpc
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from test_runtime import make_task, start_server

from fedax.runtime import ClientTLS, Connection, Registry, make_dev_pki, store, wire
from fedax.runtime.checks import ReportChecks
from fedax.runtime.gate import REFUSED, Gate
from fedax.runtime.security import CLIENT_ID_KEY, TOKEN_KEY
from fedax.runtime.task import build, report_template, server_state

# The tests of a live server (deadlines of seconds) are marked `serial`: `make test` runs
# them alone; the pure ones (wire, store, checks, gate) run beside the rest of the suite.

# Hypothesis keeps caches (never an example database here: database=None) in its home
# directory, by default ./.hypothesis: keep it out of the tree.
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "fedax-hypothesis")
_BASE = settings(database=None, derandomize=True, deadline=None, print_blob=False,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.filter_too_much,
                                        HealthCheck.function_scoped_fixture])
PURE = settings(_BASE, max_examples=150)  # no I/O: a fraction of a millisecond each
LIVE = settings(_BASE, max_examples=60)  # one or two RPCs (and a round re-opened) each

WIRE_KINDS = {"structure", "truncated", "oversized", "malformed", "non-finite"}

# ------------------------------------------------------------------------ strategies

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "int32", "int64", "uint8",
          "uint32", "bool", "complex64"]
WEIRD_DTYPES = ["", "float", "object", "O", "V8", "<f4", ">f4", "f4", "S3", "U2", "M8",
                "datetime64", "float32 ", "FLOAT32", "bfloat16\x00", "int4", "float8_e4m3fn",
                "void", "str", "float32;rm -rf /", "\u00e9\u00e8"]
INT64 = st.integers(-(2**63), 2**63 - 1)


def _itemsize(dtype: str) -> int:
    return np.dtype(wire._numpy_dtype(dtype)).itemsize


paths = st.one_of(st.text(max_size=16),
                  st.sampled_from([".update['w']", ".weight", "", "..", "\x00", "p" * 200]))
shapes = st.lists(st.integers(0, 4), max_size=3).map(tuple)
weird_shapes = st.one_of(
    st.lists(INT64, max_size=5),
    st.lists(st.sampled_from([-1, 0, 1, 2**31, 2**40, 2**62, -(2**63)]), max_size=4))
weird_dtypes = st.one_of(st.sampled_from(DTYPES + WEIRD_DTYPES), st.text(max_size=10))
layouts = st.lists(st.tuples(paths, st.sampled_from(DTYPES), shapes), max_size=4)


@st.composite
def exact_tensor(draw, path: str, dtype: str, shape: tuple[int, ...]) -> Any:
    """A tensor that matches one layout entry, with random bytes of the right length."""
    size = math.prod(shape) * _itemsize(dtype)
    return wire.Tensor(path=path, dtype=dtype, shape=list(shape),
                       data=draw(st.binary(min_size=size, max_size=size)))


@st.composite
def tensors_against(draw, layout: list) -> list:
    """Tensors for ``layout``: exact ones, then up to 3 random changes (a tensor dropped,
    added or repeated; its path, dtype, shape or byte count changed)."""
    tensors = [draw(exact_tensor(*entry)) for entry in layout]
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["drop", "add", "repeat", "path", "dtype", "shape",
                                   "bytes"]))
        if op == "add" or not tensors:
            tensors.insert(draw(st.integers(0, len(tensors))), wire.Tensor(
                path=draw(paths), dtype=draw(weird_dtypes), shape=draw(weird_shapes),
                data=draw(st.binary(max_size=64))))
            continue
        i = draw(st.integers(0, len(tensors) - 1))
        t = wire.Tensor()
        t.CopyFrom(tensors[i])
        if op == "drop":
            del tensors[i]
            continue
        if op == "repeat":
            tensors.insert(i, t)
            continue
        if op == "path":
            t.path = draw(paths)
        elif op == "dtype":
            t.dtype = draw(weird_dtypes)
        elif op == "shape":
            del t.shape[:]
            t.shape.extend(draw(weird_shapes))
        else:
            cut = draw(st.integers(0, len(t.data)))
            t.data = t.data[:cut] + draw(st.binary(max_size=9))
        tensors[i] = t
    return tensors


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


@st.composite
def protobuf_like(draw, depth: int = 2) -> bytes:
    """Bytes that look like protobuf: tags of the fields ``Envelope``/``Tensor`` have (and
    others), every wire type (valid or not), lengths right or wrong, nested messages."""
    out = bytearray()
    for number, wire_type in draw(st.lists(st.tuples(st.integers(0, 16), st.integers(0, 7)),
                                           max_size=6)):
        out += _varint(number << 3 | wire_type)
        if wire_type == 0:
            out += _varint(draw(st.integers(-(2**63), 2**64 - 1)))
        elif wire_type == 1:
            out += draw(st.binary(min_size=8, max_size=8))
        elif wire_type == 5:
            out += draw(st.binary(min_size=4, max_size=4))
        elif wire_type == 2:
            nested = depth > 0 and draw(st.booleans())
            body = draw(protobuf_like(depth - 1)) if nested else draw(st.binary(max_size=24))
            length = len(body) + draw(st.sampled_from([0, 0, 0, 0, -1, 1, 2**31]))
            out += _varint(max(length, 0)) + body
        # 3, 4: group start and end markers (no body); 6, 7: not wire types at all
    return bytes(out)


def pieces(data: bytes, cuts: list[int]) -> list:
    """``data`` as ``Chunk``s cut at ``cuts`` (no empty piece but a lone last one)."""
    bounds = sorted({c % (len(data) + 1) for c in cuts} - {0, len(data)})
    starts, ends = [0, *bounds], [*bounds, len(data)]
    return [wire.Chunk(data=data[a:b], last=b == len(data)) for a, b in zip(starts, ends,
                                                                            strict=True)]


# ---------------------------------------------------------------------- wire.decode_arrays


def _expected_decode(tensors: list, layout: list) -> str | None:
    """The kind of the first difference ``decode_arrays`` must name, None if none."""
    if len(tensors) != len(layout):
        return "structure"
    for t, (path, dtype, shape) in zip(tensors, layout, strict=True):
        if (t.path, t.dtype, tuple(t.shape)) != (path, dtype, shape):
            return "structure"
        if len(t.data) != math.prod(shape) * _itemsize(dtype):
            return "truncated"
    return None


def _check_decode(tensors: list, layout: list) -> None:
    # through the wire: what the receiver decodes is what parsing gives it
    tensors = list(wire.Envelope.FromString(
        wire.Envelope(tensors=tensors).SerializeToString()).tensors)
    expected = _expected_decode(tensors, layout)
    try:
        arrays = wire.decode_arrays(tensors, layout, "fuzz")
    except wire.WireError as err:
        assert err.kind == expected, (err.kind, expected, str(err))
        assert str(err).startswith("fuzz: ")
        return
    assert expected is None
    assert len(arrays) == len(layout)
    for array, tensor, (_, dtype, shape) in zip(arrays, tensors, layout, strict=True):
        assert array.dtype.name == np.dtype(wire._numpy_dtype(dtype)).name == dtype
        assert array.dtype.byteorder in "<=|"  # little-endian (or byte-sized)
        assert array.shape == shape and array.tobytes() == tensor.data


@PURE
@given(st.data(), layouts)
def test_decode_arrays_returns_the_layout_or_a_wire_error(data, layout):
    _check_decode(data.draw(tensors_against(layout)), layout)


@PURE
@given(st.lists(st.tuples(paths, weird_dtypes, weird_shapes, st.binary(max_size=40))
                .map(lambda x: wire.Tensor(path=x[0], dtype=x[1], shape=x[2], data=x[3])),
                max_size=4),
       layouts)
def test_decode_arrays_of_random_tensors(tensors, layout):
    _check_decode(tensors, layout)


# ---------------------------------------------------------------------- wire.join_chunks

chunk_lists = st.lists(st.tuples(st.one_of(st.binary(max_size=24), protobuf_like()),
                                 st.booleans()), max_size=10)


@PURE
@given(chunk_lists, st.integers(0, 160), st.none() | st.integers(0, 10))
@example([(b"", False), (b"", True)], 100, None)  # an empty chunk that is not the last
@example([(b"\x08\x01", False)], 100, None)  # no last chunk
@example([(b"\x08", True)], 100, None)  # a varint cut short
@example([(b"\x08\x01", False), (b"\x10\x02", True)], 3, None)  # past max_bytes
@example([(b"\x08\x01", False), (b"\x10\x02", True)], 100, 1)  # past limit_chunks
def test_join_chunks_returns_an_envelope_or_a_wire_error(items, max_bytes, limit):
    """Random chunk sequences (random data, random ``last`` flags, empty chunks): the
    envelope the bytes make, or the documented ``WireError``; the limits hold, reading
    stops at the first refusal, and the counter counts the bytes read."""
    chunks = [wire.Chunk(data=d, last=last) for d, last in items]
    # what join_chunks must do, step by step (its docstring)
    expected, buffer, read, used = "truncated", b"", 0, 0
    for i, c in enumerate(chunks, start=1):
        used, read = i, read + len(c.data)
        if len(buffer) + len(c.data) > max_bytes or (limit is not None and i > limit):
            expected = "oversized"
            break
        if not c.last and not c.data:
            expected = "malformed"
            break
        buffer += c.data
        if c.last:
            expected = None
            break
    stream, counter = iter(chunks), [0]
    try:
        env = wire.join_chunks(stream, max_bytes, counter, limit)
    except wire.WireError as err:
        if expected is None:  # the bytes were complete: they must not parse
            with pytest.raises(Exception):  # noqa: B017 (protobuf's DecodeError, any module)
                wire.Envelope.FromString(buffer)
            expected = "malformed"
        assert err.kind == expected and err.kind in WIRE_KINDS, (err.kind, expected, str(err))
        assert str(err)
    else:
        assert expected is None
        assert env == wire.Envelope.FromString(buffer)
    assert counter[0] == read
    assert len(list(stream)) == len(chunks) - used  # nothing read past where it stopped


envelopes = st.builds(
    wire.Envelope, kind=st.text(max_size=8), client_id=INT64, round=INT64, attempt=INT64,
    model_version=st.text(max_size=20), nonce=st.text(max_size=40),
    deadline_s=st.floats(), retry_after_s=st.floats(), rounds_done=INT64,
    included_round=INT64, included_attempt=INT64,
    tensors=st.lists(st.builds(wire.Tensor, path=st.text(max_size=12), dtype=weird_dtypes,
                               shape=st.lists(INT64, max_size=3), data=st.binary(max_size=40)),
                     max_size=3))


@PURE
@given(envelopes, st.lists(st.integers(0, 10**6), max_size=8), st.integers(-2, 2))
def test_join_chunks_round_trips_any_envelope(envelope, cuts, slack):
    """Any envelope cut anywhere comes back equal within its size, is ``oversized`` one
    byte short of it."""
    data = envelope.SerializeToString()
    limit = len(data) + slack
    stream = pieces(data, cuts)
    if limit < len(data):
        with pytest.raises(wire.WireError) as err:
            wire.join_chunks(stream, limit)
        assert err.value.kind == "oversized"
        return
    got = wire.join_chunks(stream, limit, limit_chunks=len(stream))
    assert got.SerializeToString() == data
    if len(stream) > 1:
        with pytest.raises(wire.WireError, match="chunks"):
            wire.join_chunks(stream, limit, limit_chunks=len(stream) - 1)


@pytest.fixture(scope="module")
def fedavg() -> Any:
    task = make_task()
    built = build(task)
    template = report_template(built.pieces, built.params, task.input_shape)
    return task, built, template, wire.expected_layout(template)


@PURE
@given(data=st.one_of(st.binary(max_size=300), protobuf_like(3)),
       cuts=st.lists(st.integers(0, 400), max_size=5))
@example(data=b"\x62\x05\x0a\x03\xff\xfe\xfd", cuts=[])  # a tensor path of invalid UTF-8
@example(data=b"\x0a\x80\x80\x80\x80\x10", cuts=[])  # a length past the end
@example(data=b"\x0b" * 50, cuts=[])  # unclosed groups
def test_random_bytes_are_an_envelope_or_malformed(fedavg, data, cuts):
    """Random bytes (and protobuf-like ones) as a message: ``join_chunks`` parses them into
    an envelope or says ``malformed``; the envelope's tensors then decode against a real
    report layout or give a ``WireError``, and the finiteness check never raises."""
    layout = fedavg[3]
    try:
        env = wire.join_chunks(pieces(data, cuts), 1 << 20)
    except wire.WireError as err:
        assert err.kind == "malformed", err
        return
    try:
        arrays = wire.decode_arrays(list(env.tensors), layout, "report")
    except wire.WireError as err:
        assert err.kind in {"structure", "truncated"}
        return
    assert wire.all_finite(arrays) in {None, *map(str, range(len(arrays)))}


# ------------------------------------------------------------------------ store.load


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, fedavg) -> bytes:
    """The bytes of a real runtime file (a server state and some history)."""
    task, built, _, _ = fedavg
    path = tmp_path_factory.mktemp("store") / "state.msgpack"
    store.save(path, {"version": 2, "round": 3, "state": store.encode(
        server_state(built.pieces, built.params)), "secret": b"\x01" * 32,
        "history": [{"round": 0, "loss": 1.5}]})
    return path.read_bytes()


class _Pickled:
    """An object whose unpickling would be seen (``loaded`` set)."""

    loaded = False

    def __reduce__(self):
        return (_mark_loaded, ())


def _mark_loaded():
    _Pickled.loaded = True
    return "unpickled"


def _framed(body: bytes) -> bytes:
    return (store.frame(body) if len(body) % 2 else  # today's frame, or an old runtime one
            store.OLD_RUNTIME_MAGIC + hashlib.sha256(body).digest() + body)


def _load(tmp_path_factory, data: bytes) -> Any:
    path = tmp_path_factory.getbasetemp() / "fuzzed.msgpack"
    path.write_bytes(data)
    refuse = mock.Mock(side_effect=AssertionError("store.load unpickled something"))
    with mock.patch.object(pickle, "loads", refuse), mock.patch.object(pickle, "load", refuse):
        return store.load(path)


@PURE
@given(data=st.data(), how=st.sampled_from(["random", "flip", "truncate", "extend",
                                            "magic-only", "pickle"]))
def test_store_load_refuses_any_corruption(tmp_path_factory, checkpoint, data, how):
    """A random, bit-flipped, truncated or extended file, or a pickle in a runtime file's
    frame, is refused with ``ValueError``; nothing is unpickled."""
    good = checkpoint
    if how == "random":
        bad = data.draw(st.binary(max_size=200))
    elif how == "flip":
        bit = data.draw(st.integers(0, 8 * len(good) - 1))
        bad = bytearray(good)
        bad[bit // 8] ^= 1 << (bit % 8)
        bad = bytes(bad)
    elif how == "truncate":
        bad = good[: data.draw(st.integers(0, len(good) - 1))]
    elif how == "extend":
        bad = good + data.draw(st.binary(min_size=1, max_size=16))
    elif how == "magic-only":
        bad = store.MAGIC + data.draw(st.binary(max_size=60))
    else:  # a pickle, framed with a wrong checksum (the file was tampered with)
        body = pickle.dumps(_Pickled(), protocol=data.draw(st.integers(0, 5)))
        bad = store.MAGIC + data.draw(st.binary(min_size=32, max_size=32)) + body
    assume(bad != good)
    with pytest.raises(ValueError):
        _load(tmp_path_factory, bad)
    assert not _Pickled.loaded
    assert _load(tmp_path_factory, good)["round"] == 3  # and the good file still loads


@PURE
@given(protocol=st.integers(0, 5))
def test_store_load_never_unpickles_a_well_framed_pickle(tmp_path_factory, protocol):
    """A pickle with a correct checksum (anyone can compute a SHA-256): msgpack refuses it
    (``ValueError``) and no pickle code runs."""
    body = pickle.dumps(_Pickled(), protocol=protocol)
    try:
        value = _load(tmp_path_factory, _framed(body))
    except ValueError:
        value = None
    assert not _Pickled.loaded and value != "unpickled"


# Was a bug (store.load; fixed, keep this test): a file with
# a valid frame and checksum (a SHA-256 anyone can compute, not a MAC) but a body that is not
# a msgpack map is not refused with ValueError: a map whose key is a map or an array makes
# `msgpack.unpackb` raise TypeError ("unhashable type: 'dict'"), and a body that is a valid
# msgpack scalar is returned as is (an int, not a dict), which `Server._restore` then
# calls `.get` on (AttributeError). `_restore` catches only ValueError to fall back to the
# checkpoint before, so such a file stops `fedax server start --resume` instead.
# Minimal reproducer: store.load(p), p holding MAGIC + sha256(body) + body for
# body = b"\x81\x80\x01" (TypeError) or b"\x05" (returns 5).
@PURE
@given(body=st.one_of(st.binary(max_size=40), protobuf_like()))
@example(body=b"\x81\x80\x01")  # {{}: 1}: TypeError unhashable type: 'dict'
@example(body=b"\x81\x91\x01\x02")  # {[1]: 2}: TypeError unhashable type: 'list'
@example(body=b"\x05")  # 5: not a payload
def test_store_load_of_a_well_framed_body_is_a_dict_or_value_error(tmp_path_factory, body):
    try:
        value = _load(tmp_path_factory, _framed(body))
    except ValueError:
        return
    assert isinstance(value, dict), f"store.load returned {value!r}"


# ------------------------------------------------------------------------ ReportChecks

MAX_EXAMPLES = 1_000_000


@pytest.fixture(scope="module")
def checked() -> dict[str, Any]:
    """algorithm -> (ReportChecks, zero report of its template, the payload the server
    sends, task)."""
    out = {}
    for algorithm in ("fedavg", "fednova", "scaffold"):
        task = make_task(algorithm)
        built = build(task)
        template = report_template(built.pieces, built.params, task.input_shape)
        zeros = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), template)
        payload = jax.device_get(built.pieces.payload(server_state(built.pieces,
                                                                   built.params).server))
        checks = ReportChecks(algorithm, task.client_lr, task.local_epochs, task.batch,
                              MAX_EXAMPLES)
        out[algorithm] = (checks, zeros, payload, task)
    return out


finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
counts = st.one_of(finite32, st.integers(-5, MAX_EXAMPLES + 5).map(float),
                   st.sampled_from([0.0, 0.5, -0.0, 1e6, 1e6 + 1, -1.0, 3e38]))


def _leaves_like(tree: Any, values: st.SearchStrategy) -> st.SearchStrategy:
    leaves, treedef = jax.tree.flatten(tree)
    return st.tuples(*[st.lists(values, min_size=a.size, max_size=a.size) for a in leaves]) \
        .map(lambda xs: treedef.unflatten([np.asarray(x, np.float32).reshape(a.shape)
                                           for x, a in zip(xs, leaves, strict=True)]))


@PURE
@given(st.data(), st.sampled_from(["fedavg", "fednova", "scaffold"]), counts, counts,
       counts | st.none(), finite32)
def test_report_checks_of_random_numbers(checked, data, algorithm, n, w, steps, loss):
    """Any finite numbers: ``None`` or ``("bounds", reason)``, never an exception; a report
    outside the documented bounds of n_k, weight and K_i is always refused."""
    checks, zeros, payload, task = checked[algorithm]
    n32, w32 = np.float32(n), np.float32(w)
    stats = {"train_loss": np.float32(loss)}
    if steps is not None:
        stats["local_steps"] = np.float32(steps)
    report = zeros._replace(
        num_examples=n32, weight=w32, stats=stats,
        update=data.draw(_leaves_like(zeros.update, finite32)),
        sums=data.draw(_leaves_like(zeros.sums, finite32 | counts)))
    result = checks.check(report, payload)
    assert result is None or (result[0] == "bounds" and isinstance(result[1], str)
                              and result[1]), result
    n, w = float(n32), float(w32)
    in_bounds = 0 <= n <= MAX_EXAMPLES and n == math.floor(n) and 0 <= w <= MAX_EXAMPLES
    if in_bounds and steps is not None:
        most = task.local_epochs * math.ceil(n / task.batch)
        s = float(np.float32(steps))
        in_bounds = 0 <= s <= most and s == math.floor(s)
    if not in_bounds:
        assert result is not None


@PURE
@given(st.data(), st.sampled_from(["fedavg", "fednova", "scaffold"]),
       st.integers(0, MAX_EXAMPLES), st.sampled_from(["n", "one", "zero"]), finite32,
       st.booleans(), st.floats(-1e3, 1e3, width=32))
def test_report_checks_accept_a_genuine_report(checked, data, algorithm, n, weight, loss,
                                               with_steps, scale):
    """A report a client can really send (n_k examples, its weight, K_i ≤ E·⌈n_k/B⌉
    steps, the exact sums its algorithm computes from them) is never refused."""
    checks, zeros, payload, task = checked[algorithm]
    most = task.local_epochs * math.ceil(n / task.batch)
    steps = data.draw(st.integers(0, most))
    update = data.draw(_leaves_like(zeros.update, st.floats(-1, 1, width=32)))
    update = jax.tree.map(lambda u: (u * scale).astype(np.float32), update)
    stats = {"train_loss": np.float32(loss)}
    if with_steps:
        stats["local_steps"] = np.float32(steps)
    used = steps if with_steps else most
    if algorithm == "fednova":
        sums = (np.float32(n * used), np.float32(n))
    elif algorithm == "scaffold":  # Option II: Δc = −c + Δy / (K·η_l), zero for n_k = 0
        _, control = payload
        scale_steps = max(used, 1) * task.client_lr
        sums = jax.tree.map(
            lambda c, u: ((-np.asarray(c, np.float64) + np.asarray(u, np.float64)
                           / scale_steps) if n > 0 else np.zeros(c.shape)).astype(np.float32),
            control, update)
    else:
        sums = zeros.sums
    w = {"n": n, "one": 1, "zero": 0}[weight]
    report = zeros._replace(update=update, weight=np.float32(w), stats=stats, sums=sums,
                            num_examples=np.float32(n))
    assert checks.check(report, payload) is None


# ------------------------------------------------------------------ the Gate, any values


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(code, details)
        self.code, self.details = code, details


class FakeContext:
    """What the behaviours use of ``grpc.ServicerContext``, with any metadata: gRPC's
    Python client sends printable ASCII only, but grpc-core passes on the other bytes a raw
    HTTP/2 peer sends, which grpcio decodes as UTF-8 (else Latin-1): any ``str`` reaches
    the server."""

    def __init__(self, metadata: tuple):
        self.metadata, self.cancelled = tuple(metadata), False

    def invocation_metadata(self) -> tuple:
        return self.metadata

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Aborted(code, details)

    def cancel(self) -> None:
        self.cancelled = True

    def is_active(self) -> bool:
        return not self.cancelled

    def time_remaining(self) -> float:
        return CALL_S

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"


class _Untouched:
    """A request iterator that fails the test if anything reads it."""

    def __iter__(self):
        return self

    def __next__(self):
        raise AssertionError("an unauthenticated call's request was read")


class _CallDetails(NamedTuple):
    method: str
    invocation_metadata: tuple


ANY_TEXT = st.text(max_size=40)  # any code points (no lone surrogates: grpcio decodes)
GATE_TOKENS = {0: "token-0", 1: "token-1", 2: "token-2"}


@PURE
@given(data=st.data(), method=st.integers(0, 3).flatmap(
    lambda i: ANY_TEXT if i == 0 else st.sampled_from(
        [f"/{wire.SERVICE}/{m}" for m in (*wire.METHODS, "Nope")])))
def test_gate_refuses_any_metadata_before_reading(data, method):
    """``Gate.service`` with any client id and token values (any Unicode, huge, empty,
    repeated, missing), on every method and on unknown ones: an unknown method gets no
    handler; an unauthenticated call is refused with UNAUTHENTICATED and the one reason,
    without its request being read or its behaviour run; an authenticated one runs the
    behaviour once with its client id, and its call slot is released after."""
    registry = Registry.of_tokens(GATE_TOKENS, revoked=[2])
    ran: list[int | None] = []

    def unary(requests, context, cid):
        ran.append(cid)
        return wire.SubmitReply(accepted=True)

    def streaming(requests, context, cid):
        ran.append(cid)
        yield wire.Chunk(last=True)

    behaviours = {"Join": (unary, True), "Poll": (streaming, True), "Submit": (unary, True),
                  "Status": (unary, False)}
    gate = Gate(registry, behaviours, per_client=2)
    ids = st.one_of(st.sampled_from(["0", "1", "2", " 1", "+1", "1_0", "\u0661", "\uff11",
                                     "01", "1.0", "-0", "9" * 4301]), ANY_TEXT,
                    st.integers(-(2**70), 2**70).map(str))
    tokens = st.one_of(st.sampled_from(list(GATE_TOKENS.values())), ANY_TEXT,
                       st.sampled_from(list(GATE_TOKENS.values())).map(lambda t: t + " "))
    pairs = []
    for key, values in ((CLIENT_ID_KEY, ids), (TOKEN_KEY, tokens)):
        for _ in range(data.draw(st.sampled_from([1, 1, 0, 2]))):  # once, missing, repeated
            pairs.append((key, data.draw(values)))
    pairs += [(data.draw(ANY_TEXT), data.draw(ANY_TEXT)) for _ in range(data.draw(
        st.integers(0, 2)))]
    pairs = data.draw(st.permutations(pairs))
    handler = gate.service(_CallDetails(method, tuple(pairs)))
    name = method.rsplit("/", 1)[-1]
    if not method.startswith(f"/{wire.SERVICE}/") or name not in behaviours:
        assert handler is None
        return
    meta = dict(pairs)
    cid = registry.check(meta.get(CLIENT_ID_KEY), meta.get(TOKEN_KEY))[0]
    needs_client = behaviours[name][1]
    event("refused" if needs_client and cid is None else "authenticated or open")
    call = handler.stream_stream if name == "Poll" else handler.stream_unary
    run = (lambda r, c: list(call(r, c))) if name == "Poll" else call
    if needs_client and cid is None:
        with pytest.raises(_Aborted) as err:
            run(_Untouched(), FakeContext(pairs))
        assert (err.value.code, err.value.details) == (grpc.StatusCode.UNAUTHENTICATED,
                                                       REFUSED)
        assert ran == []
        return
    run(_Untouched(), FakeContext(pairs))
    assert ran == [cid if needs_client else None]
    assert cid is None or gate.active(cid) == 0  # the slot was given back


# ======================================================================= a live server

CHUNK = 4096  # the server's chunk size (a client may ask for less, down to 1024)
MAX_MESSAGE = 20_000  # the server's report size limit
GRPC_LIMIT = CHUNK + (64 << 10)  # gRPC's own message limit (wire.grpc_options)
CALL_S = 10.0  # every call's deadline
PRINTABLE = st.characters(min_codepoint=0x20, max_codepoint=0x7E)  # what metadata may hold


class Live(NamedTuple):
    server: Any
    port: int
    pki: dict
    channel: grpc.Channel
    calls: dict  # method -> raw callable (requests as bytes)
    conn: Connection  # client 0: authenticated, fuzzes its own reports
    layout: list
    zeros: Any  # a zero report (weight 0, no examples): honest, always accepted
    checks: ReportChecks


def _identity(b: bytes) -> bytes:
    return b


def raw_channel(pki: dict, port: int) -> tuple[grpc.Channel, dict]:
    """A TLS channel to the server and its four methods, called with requests as raw bytes
    (any bytes, not only messages) and replies parsed (see ``client.Connection``)."""
    channel = grpc.secure_channel(f"127.0.0.1:{port}", ClientTLS(pki["ca"]).credentials(),
                                  options=wire.grpc_options(1 << 20))
    calls = {}
    for name, (_, response, req_stream, resp_stream) in wire.METHODS.items():
        make = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
                (True, False): channel.stream_unary}[(req_stream, resp_stream)]
        calls[name] = make(f"/{wire.SERVICE}/{name}", request_serializer=_identity,
                           response_deserializer=response.FromString)
    return channel, calls


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """One server for the module: 1,000 rounds of cohort 8 that never fill (at most two
    clients are ever alive), a round opens as soon as one client is alive, each attempt is
    retried (up to a billion times) when its only selected client is refused; 6 s rounds.
    Stopped at the end of the module."""
    pki = make_dev_pki(tmp_path_factory.mktemp("pki"), num_clients=4)
    task = make_task()
    server, port = start_server(
        task, pki, key=None, rounds=1000, cohort_size=8, min_clients=1,
        max_attempts=10**9, deadline_s=6.0, poll_hold_s=0.5, liveness_s=20.0,
        chunk_bytes=CHUNK, max_message_bytes=MAX_MESSAGE, report_read_s=5.0,
        per_client_calls=4)
    channel, calls = raw_channel(pki, port)
    conn = Connection(f"127.0.0.1:{port}", ClientTLS(pki["ca"]), 0, pki["tokens"][0],
                      timeout_s=CALL_S)
    template = server.report_template
    zeros = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), template)
    checks = ReportChecks(task.algorithm, task.client_lr, task.local_epochs, task.batch,
                          server.config.max_examples)
    try:
        yield Live(server, port, pki, channel, calls, conn, wire.expected_layout(template),
                   zeros, checks)
    finally:
        conn.close()
        channel.close()
        stop_within(server, 3.0)  # bounded: see test_server_stops_after_unparsable_chunks


def stop_within(server: Any, seconds: float) -> bool:
    """``server.stop()`` in a daemon thread; whether it returned within ``seconds`` (a
    stop that hangs must not hang the test run)."""
    stopper = threading.Thread(target=server.stop, name="fuzz-stop", daemon=True)
    stopper.start()
    stopper.join(seconds)
    return not stopper.is_alive()


def _meta(live: Live, cid: int = 0) -> tuple:
    return ((CLIENT_ID_KEY, str(cid)), (TOKEN_KEY, live.pki["tokens"][cid]))


def fresh_task(conn: Connection, margin_s: float = 2.0, within_s: float = 20.0) -> Any:
    """A task this client has not reported on yet, with at least ``margin_s`` of its
    round left."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        env = conn.poll()
        if env.kind == "task" and env.deadline_s >= margin_s:
            return env
        assert env.kind in {"task", "wait"}, env.kind
        if env.kind == "task":  # too little left: the next attempt comes at its deadline
            time.sleep(min(env.deadline_s + 0.05, 1.0))
    raise AssertionError(f"no task for client {conn.client_id} within {within_s} s")


def report_envelope(live: Live, task: Any, tensors: list | None = None) -> Any:
    if tensors is None:
        tensors = wire.encode_tree(live.zeros)
    return wire.Envelope(kind="update", client_id=live.conn.client_id, round=task.round,
                         attempt=task.attempt, model_version=task.model_version,
                         nonce=task.nonce, tensors=tensors)


def submit(live: Live, items: list[bytes], metadata: tuple) -> tuple[Any, Any]:
    """(SubmitReply, None) or (None, RpcError)."""
    try:
        return live.calls["Submit"](iter(items), metadata=metadata, timeout=CALL_S), None
    except grpc.RpcError as err:
        return None, err


def assert_refused(reply: Any, kinds: set[str] | None = None) -> str:
    """A refusal with a reason (of one of ``kinds``); returns its kind."""
    assert reply is not None and not reply.accepted and reply.reason, reply
    kind = reply.reason.split(":", 1)[0]
    if kinds is not None and kind != "late":  # a round that closed meanwhile: also a reason
        assert kind in kinds, (kind, kinds, reply.reason)
    return kind


class _GrpcRefuses(Exception):
    pass


def _as_chunks(items: list[bytes]):
    """The ``Chunk``s the server reads of ``items``, in order; ``_GrpcRefuses`` where
    gRPC ends the call instead (a message past its size limit); a message that does not
    parse as a ``Chunk`` is the server's ``malformed`` refusal (it reads raw bytes)."""
    for item in items:
        if len(item) > GRPC_LIMIT:
            raise _GrpcRefuses
        yield from wire.parse_chunks([item])


def expected_submit(live: Live, items: list[bytes], task: Any) -> str | None:
    """What the server must say to a correct report header followed by ``items``: a
    refusal kind, ``"grpc"`` for a call gRPC refuses (a message past gRPC's size limit),
    None for an acceptable report."""
    try:
        env = wire.join_chunks(_as_chunks(items), MAX_MESSAGE, None,
                               wire.max_chunks(MAX_MESSAGE, live.conn.chunk_bytes))
    except _GrpcRefuses:
        return "grpc"
    except wire.WireError as err:
        return err.kind
    if env.client_id != 0 or (env.round, env.attempt, env.model_version, env.nonce) != (
            task.round, task.attempt, task.model_version, task.nonce):
        return "sender"
    try:
        arrays = wire.decode_arrays(list(env.tensors), live.layout, "report")
    except wire.WireError as err:
        return err.kind
    if wire.all_finite(arrays) is not None:
        return "non-finite"
    report = jax.tree.structure(live.zeros).unflatten(arrays)
    problem = live.checks.check(report, None)
    return None if problem is None else problem[0]


def _refusals(live: Live) -> int:
    return sum(live.server.rejections.counts.values())


def assert_verdict(reply: Any, err: Any, expected: str | None) -> None:
    """The call ended without a gRPC error, accepted (or late) when ``expected`` is None,
    else refused with the reason kind ``expected``."""
    assert err is None, (err.code(), err.details())
    if expected is None:
        assert reply.accepted or assert_refused(reply) == "late", reply
    else:
        assert_refused(reply, {expected})


def check_submit(live: Live, items: list[bytes], task: Any) -> None:
    expected = expected_submit(live, items, task)
    event(f"expected {expected or 'accepted or bounds'}")
    reply, err = submit(live, items, _meta(live) + wire.report_metadata(task))
    if expected == "grpc":
        assert err is not None, reply
        # a message past gRPC's limit cancels the call: the handler's read raises gRPC's
        # error, so the server neither counts it nor excludes the client (its nonce stays
        # good, as for a client that lost its connection mid-report)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err.code(), err.details())
        assert err.details()
        return
    assert_verdict(reply, err, expected)


@pytest.fixture
def joined(live):
    """Client 0 joined with the default chunk size (the server's, 4096)."""
    live.conn.chunk_bytes = live.conn.join().chunk_bytes
    assert live.conn.chunk_bytes == CHUNK
    return live


raw_items = st.lists(st.one_of(
    st.binary(max_size=40), protobuf_like(),
    st.builds(lambda d, last: wire.Chunk(data=d, last=last).SerializeToString(),
              st.one_of(st.binary(max_size=40), protobuf_like(3),
                        st.tuples(st.integers(0, 255), st.integers(0, 30_000))
                        .map(lambda x: bytes([x[0]]) * x[1])),
              st.booleans())), max_size=8)


@pytest.mark.serial  # a live server with deadlines of seconds
@LIVE
@given(items=raw_items)
@example(items=[wire.Chunk(data=b"", last=False).SerializeToString()] * 3)
@example(items=[wire.Chunk(data=b"\x08", last=False).SerializeToString()] * 400)  # > chunks
@example(items=[wire.Chunk(data=b"\x00" * (GRPC_LIMIT + 1), last=True).SerializeToString()])
@example(items=[b"\xff\xff\xff"])
@example(items=[])
def test_submit_of_random_bytes_is_refused_with_a_reason(joined, items):
    """Random bytes as the report stream of a selected client with a correct header:
    random chunk messages (random data, flags, empty chunks, too many, too large) and
    bytes that are no ``Chunk`` at all. Each is refused with the reason the wire checks
    give (``SubmitReply``), or by gRPC with a status and details."""
    check_submit(joined, items, fresh_task(joined.conn))


def _random_tensor(draw) -> Any:
    return wire.Tensor(path=draw(paths), dtype=draw(weird_dtypes), shape=draw(weird_shapes),
                       data=draw(st.binary(max_size=48)))


@pytest.mark.serial  # a live server with deadlines of seconds
@LIVE
@given(data=st.data())
def test_submit_of_random_reports_is_refused_with_a_reason(joined, data):
    """Well-formed envelopes with the right header and random tensors: random paths,
    dtypes, shapes, byte counts and values (NaN, infinities, any n_k, weight and K_i).
    Each gets the verdict of the wire and bounds checks (a report within the bounds is
    accepted); nothing else."""
    live = joined
    task = fresh_task(live.conn)
    values = st.one_of(st.just(0.0), st.floats(width=32), st.integers(-3, 50).map(float))
    leaves, treedef = jax.tree.flatten(live.zeros)
    arrays = [np.asarray(data.draw(st.lists(values, min_size=a.size, max_size=a.size)),
                         np.float32).reshape(a.shape) for a in leaves]
    tensors = wire.encode_tree(treedef.unflatten(arrays))
    if data.draw(st.booleans()):  # paths, dtypes, shapes or byte counts changed
        layout = [(t.path, t.dtype, tuple(t.shape)) for t in tensors]
        tensors = data.draw(tensors_against(layout)) if data.draw(st.booleans()) else \
            [_random_tensor(data.draw) for _ in range(data.draw(st.integers(0, 8)))]
    envelope = report_envelope(live, task, tensors)
    cuts = data.draw(st.lists(st.integers(0, 10**5), max_size=4))
    items = [c.SerializeToString() for c in pieces(envelope.SerializeToString(), cuts)]
    check_submit(live, items, task)


def header_values(true: Any, text: st.SearchStrategy | None = None) -> st.SearchStrategy:
    """A header value: the right one, missing, empty, random ``text`` (printable ASCII by
    default: what gRPC's client sends), huge ints, near misses."""
    true = str(true)
    wrong = st.one_of(
        st.none(), st.just(""), st.text(PRINTABLE, max_size=40) if text is None else text,
        st.integers(-(10**30), 10**30).map(str), st.just("9" * 4301),  # past int()'s digits
        st.sampled_from([true + "0", "0" + true, "-" + true, true[:-1], true.upper(),
                         f"+{true}", "1e3", "0x1", "NaN", "inf", "None", "\\x00"]))
    # right 3 times in 4, so that every check is reached (the first wrong field decides)
    return st.integers(0, 3).flatmap(lambda i: wrong if i == 0 else st.just(true))


def expected_header(sent: dict[str, str | None], task: Any) -> str | None:
    """The refusal kind of a report header (``REPORT_KEYS`` -> value or None if absent) as
    the server reads it (``int`` of round and attempt, ``str`` of the others), None if it
    is the task's."""
    t, attempt = (_header_int(sent[k]) for k in wire.REPORT_KEYS[:2])
    version, nonce = (str(sent[k]) for k in wire.REPORT_KEYS[2:])
    if t is None or attempt is None:
        return "malformed"
    if (t, attempt) != (task.round, task.attempt):
        return "wrong-round"
    if version != task.model_version:
        return "model-version"
    if nonce != task.nonce:
        return "replay"
    return None


def _metadata_bytes(meta: tuple) -> int:
    return sum(len(k) + len(v) + 32 for k, v in meta)  # HTTP/2's accounting (RFC 7540 6.5.2)


def _header_int(value: str | None) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


@pytest.mark.serial  # a live server with deadlines of seconds
@LIVE
@given(data=st.data())
def test_submit_with_random_report_headers(joined, data):
    """Random round, attempt, model version and nonce metadata (random strings, huge and
    negative ints, empty, missing) on an honest report: refused before the body with the
    reason of the first field that is wrong, accepted when all four are right."""
    live = joined
    task = fresh_task(live.conn)
    true = dict(wire.report_metadata(task))
    sent = {key: data.draw(header_values(true[key]), label=key) for key in wire.REPORT_KEYS}
    meta = _meta(live) + tuple((k, v) for k, v in sent.items() if v is not None)
    expected = expected_header(sent, task)
    event(f"expected {expected or 'accepted'}")
    body = [c.SerializeToString() for c in wire.chunks(report_envelope(live, task), CHUNK)]
    reply, err = submit(live, body, meta)
    if err is not None and _metadata_bytes(meta) > 7000:  # near gRPC's 8 KiB soft limit
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.details()
        return
    assert_verdict(reply, err, expected)


@pytest.mark.serial  # a live server with deadlines of seconds
@LIVE
@given(data=st.data())
def test_report_headers_of_any_unicode(joined, data):
    """What a raw HTTP/2 peer can send and gRPC's Python client cannot: report header
    values of any code points, given to the Submit behaviour as gRPC would (an empty body
    after them). Each is refused with the reason of its first wrong field, or, with all
    four right, as ``truncated`` (the body). A non-ASCII nonce with the other three right
    is left out here: it is a bug, see test_a_non_ascii_nonce_is_refused_with_a_reason."""
    live = joined
    task = fresh_task(live.conn)
    true = dict(wire.report_metadata(task))
    sent = {key: data.draw(header_values(true[key], ANY_TEXT), label=key)
            for key in wire.REPORT_KEYS}
    expected = expected_header(sent, task)
    assume(expected != "replay" or str(sent[wire.REPORT_KEYS[3]]).isascii())
    event(f"expected {expected or 'truncated'}")
    meta = _meta(live) + tuple((k, v) for k, v in sent.items() if v is not None)
    reply = live.server.rpcs.submit(iter(()), FakeContext(meta), 0)  # after the Gate
    assert_refused(reply, {expected or "truncated"})


# Was a bug (server; fixed, keep this test): a report
# header whose nonce is not ASCII (a raw HTTP/2 client sends one; grpc-core passes it, and
# grpcio decodes it as UTF-8) with the right round, attempt and model version makes
# `Server._check_header` call `secrets.compare_digest(nonce, issued)`, which raises
# TypeError ("comparing strings with non-ASCII characters is not supported"): the call
# ends with UNKNOWN "Exception calling application: ..." instead of a `replay` refusal,
# the refusal is not counted and the client is not excluded from the round. The server
# stays up. Reproduced over the wire with the `h2` package (a Submit whose `fedax-nonce`
# header is b"\xc3\xa9"); here through the behaviour itself, as gRPC calls it. Fix idea:
# compare bytes (`nonce.encode()`, `issued.encode()`) or refuse a non-ASCII header first.
@pytest.mark.serial  # a live server with deadlines of seconds
def test_a_non_ascii_nonce_is_refused_with_a_reason(joined):
    live = joined
    task = fresh_task(live.conn)
    meta = _meta(live) + tuple((k, "\u00e9" if k == "fedax-nonce" else v)
                               for k, v in wire.report_metadata(task))
    reply = live.server.rpcs.submit(iter(()), FakeContext(meta), 0)
    assert_refused(reply, {"replay"})


def _authenticates(registry: Registry, pairs: tuple) -> bool:
    """Whether any client id with any token of ``pairs`` is a registered pair (whichever
    of repeated keys the server reads)."""
    ids = [v for k, v in pairs if k == CLIENT_ID_KEY] or [None]
    tokens = [v for k, v in pairs if k == TOKEN_KEY] or [None]
    return any(registry.check(i, t)[0] is not None for i in ids for t in tokens)


@st.composite
def credentials(draw, registry: Registry, tokens: dict[int, str]) -> tuple:
    """Client id and token metadata of every kind but a valid pair: missing, empty, random,
    huge, long, another client's token, duplicated keys, extra keys."""
    ids = st.one_of(st.none(), st.just(""), st.sampled_from(["0", "1", "3", "4", "999", "-1",
                                                             " 0", "+1", "0x1", "1e3", "00"]),
                    st.integers(-(2**70), 2**70).map(str), st.text(PRINTABLE, max_size=40),
                    st.text(PRINTABLE, min_size=1000, max_size=3000), st.just("9" * 4301))
    secret = st.one_of(st.none(), st.just(""), st.sampled_from(list(tokens.values())),
                        st.text(PRINTABLE, max_size=60),
                        st.text(PRINTABLE, min_size=1000, max_size=3000))
    pairs = []
    for key, values in ((CLIENT_ID_KEY, ids), (TOKEN_KEY, secret)):
        for _ in range(draw(st.sampled_from([1, 1, 1, 0, 2]))):
            value = draw(values)
            if value is not None:
                pairs.append((key, value))
    for _ in range(draw(st.integers(0, 2))):
        pairs.append(("x-fuzz-" + draw(st.text(string.ascii_lowercase + string.digits,
                                                min_size=1, max_size=8)),
                      draw(st.text(PRINTABLE, max_size=40))))
    pairs = draw(st.permutations(pairs))
    assume(not _authenticates(registry, pairs))
    return tuple(pairs)


def _call(live: Live, method: str, metadata: tuple, body: list[bytes]) -> Any:
    call = live.calls[method]
    if method == "Submit":
        return call(iter(body), metadata=metadata, timeout=CALL_S)
    if method == "Poll":
        return list(call(b"", metadata=metadata, timeout=CALL_S))
    return call(body[0] if body else b"", metadata=metadata, timeout=CALL_S)


@pytest.mark.serial  # a live server with deadlines of seconds
@LIVE
@given(data=st.data(), method=st.sampled_from(["Join", "Poll", "Submit"]))
def test_random_credentials_are_refused_before_any_work(live, data, method):
    """Random client id and token metadata on Join, Poll and Submit (with a random
    body): UNAUTHENTICATED with the one reason for every failure; the server records no
    sign of the caller."""
    meta = data.draw(credentials(live.server.registry, live.pki["tokens"]), label="metadata")
    body = data.draw(st.lists(st.binary(max_size=40), max_size=3), label="body")
    seen = dict(live.server.last_seen)
    with pytest.raises(grpc.RpcError) as err:
        _call(live, method, meta, body)
    if _metadata_bytes(meta) > 7000 and err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        assert err.value.details()  # gRPC's soft limit on metadata (8 KiB), with a reason
    else:
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (err.value.code(),
                                                                     err.value.details())
        assert err.value.details() == REFUSED
    assert set(live.server.last_seen) <= set(seen) | {0}  # client 0 fuzzes alongside


@pytest.mark.serial  # a live server with deadlines of seconds
@pytest.mark.parametrize("method", ["Join", "Poll", "Submit", "Status"])
def test_oversized_metadata_is_refused(live, method):
    """Metadata past gRPC's hard limit (16 KiB): refused by gRPC, with a reason."""
    meta = ((CLIENT_ID_KEY, "0"), (TOKEN_KEY, "t" * 20_000))
    with pytest.raises(grpc.RpcError) as err:
        _call(live, method, meta, [b""])
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.details()


@pytest.mark.serial  # a live server with deadlines of seconds
@LIVE
@given(data=st.data())
def test_status_answers_any_metadata(live, data):
    """Status needs no token: any metadata (even valid credentials) gets the counts."""
    meta = data.draw(st.one_of(st.just(()), credentials(live.server.registry, live.pki["tokens"]),
                               st.just(_meta(live, 2))))
    reply = _call(live, "Status", meta, [data.draw(st.binary(max_size=20))])
    status = json.loads(reply.json)
    assert status["rounds"] == 1000 and status["state"] in {"round", "waiting"}


@LIVE
@given(wanted=st.one_of(st.none(), st.integers(-(2**70), 2**70).map(str),
                        st.text(PRINTABLE, max_size=30), st.just("9" * 5000),
                        st.sampled_from(["", "0", "-1", "1023", "1024", "4096", "4097",
                                         "1e9", " 2048 ", "2_048"])))
@pytest.mark.serial  # a live server with deadlines of seconds
def test_join_with_random_chunk_sizes(live, wanted):
    """Any ``MAX_CHUNK_KEY`` a client sends: a chunk size within [1024, the server's]:
    the one it asked for when it is an int in range, the server's when it is no int."""
    meta = _meta(live, 0) + (() if wanted is None else ((wire.MAX_CHUNK_KEY, wanted),))
    reply = _call(live, "Join", meta, [b""])
    asked = _header_int(wanted)
    expected = CHUNK if asked is None else min(max(asked, 1024), CHUNK)
    assert reply.chunk_bytes == expected and json.loads(reply.task_json)["config"][
        "algorithm"] == "fedavg"


@pytest.mark.serial  # a live server with deadlines of seconds
def test_server_is_up_after_the_fuzzing(live):
    """After the fuzzing: the server answers Status, its rounds still run (no error),
    every refusal was counted by reason code, and an honest client (client 1) polls, gets
    its task and has its report accepted."""
    status = json.loads(live.calls["Status"](b"", timeout=CALL_S).json)
    assert status["state"] in {"round", "waiting"} and status["rounds_done"] == 0
    counts = status["rejected_reports"]  # (the explicit examples' kinds at least)
    assert {"malformed", "truncated", "oversized"} <= set(counts), counts
    assert all(isinstance(v, int) and v > 0 for v in counts.values())
    assert live.server.wait(0) is False  # raises the error that stopped the rounds, if any
    assert len(live.server.rejections) <= 256  # bounded
    honest = Connection(f"127.0.0.1:{live.port}", ClientTLS(live.pki["ca"]), 1,
                        live.pki["tokens"][1], timeout_s=CALL_S)
    try:
        honest.chunk_bytes = honest.join().chunk_bytes
        honest.poll()  # alive now: the next attempt selects it too
        task = fresh_task(live.conn)  # client 0 settles the open round with an empty
        reply, _ = submit(live, [wire.Chunk(last=True).SerializeToString()],  # report
                          _meta(live) + wire.report_metadata(task))
        assert_refused(reply, {"sender"})
        task = fresh_task(honest, within_s=15.0)
        report = report_envelope(live, task)
        report.client_id = 1
        reply = honest.submit(report)
        assert reply.accepted, reply
    finally:
        honest.close()
    assert json.loads(live.calls["Status"](b"", timeout=CALL_S).json)["alive_clients"] == 2


# Was a bug (server + grpcio; fixed, keep this test): a
# selected client whose report stream holds a message that is no `Chunk` makes
# `Server.stop()` hang for ever. gRPC's deserializer fails, grpcio aborts the call
# (INTERNAL "Exception deserializing request!", status sent) and ends the request iterator;
# `ServerRPCs.submit` then sees a stream without its last chunk (`truncated`) and *returns* a
# SubmitReply, so grpcio starts a second send-status batch on the finished call, which never
# completes: the call stays in grpcio's bookkeeping and `grpc.Server.stop(grace).wait()`,
# which `Server.stop` calls without a timeout, never returns (`fedax server start` cannot
# shut down). One such call hangs the stop about half of the time, 20 of them every time.
# Minimal reproducer: a selected client's Submit with a correct report header whose stream
# is the single message b"\xff\xff\xff" (sent with an identity request serializer), then
# `server.stop()`. Fix idea: the Gate takes requests as bytes (no deserializer) and the
# behaviour parses each Chunk itself (a `malformed` WireError), or the behaviour answers
# nothing once `context.is_active()` is False. Not strict: the hang is a race.
@pytest.mark.serial  # a live server with deadlines of seconds
def test_server_stops_after_unparsable_chunks(tmp_path_factory):
    pki = make_dev_pki(tmp_path_factory.mktemp("pki-stop"), num_clients=1)
    server, port = start_server(make_task(), pki, key=None, rounds=1000, cohort_size=2,
                                min_clients=1, max_attempts=10**9, deadline_s=6.0,
                                poll_hold_s=0.5, liveness_s=20.0, chunk_bytes=CHUNK)
    channel, calls = raw_channel(pki, port)
    conn = Connection(f"127.0.0.1:{port}", ClientTLS(pki["ca"]), 0, pki["tokens"][0],
                      timeout_s=CALL_S)
    meta = ((CLIENT_ID_KEY, "0"), (TOKEN_KEY, pki["tokens"][0]))
    try:
        for i in range(20):
            task = fresh_task(conn)
            reply = calls["Submit"](iter([b"\xff\xff\xff"]), timeout=CALL_S,
                                    metadata=meta + wire.report_metadata(task))
            assert not reply.accepted  # fedax refuses it itself (it reads raw bytes)
            assert reply.reason.startswith("malformed: a piece of the stream is not a Chunk")
            assert server.rejections.counts["malformed"] == i + 1
        # the server still serves meanwhile
        assert json.loads(calls["Status"](b"", timeout=CALL_S).json)["state"] in {
            "round", "waiting"}
    finally:
        conn.close()
        channel.close()
        stopped = stop_within(server, 3.0)
    assert stopped, "Server.stop() did not return within 3 s"
