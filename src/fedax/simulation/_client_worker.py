"""A client worker process: one JAX runtime pinned to one core (see ``processes``).

Started by ``ClientProcesses`` as ``python -m fedax.simulation._client_worker CORE RFD WFD``.
It reads requests from file descriptor RFD and answers on WFD; nothing is pickled. A
request is a length-prefixed JSON header and a length-prefixed payload:

* ``load``: the payload is a serialized ``jax.export.Exported`` (a block of clients'
  program, made by the parent from the round it is tracing); the worker compiles it once.
* ``run``: inputs and outputs are laid out in two shared-memory segments named in the
  header (offset, dtype, shape per leaf); the worker runs the program and writes outputs.
* ``exit``.

The core is pinned and XLA is told it has one thread before JAX starts, so two workers on
two cores do not compete for each other's threads (the reason for processes: two XLA
devices in one process share one intra-op thread pool).

A worker ignores SIGINT: Ctrl-C in a terminal reaches the whole process group, and it is
the parent that stops the run and then the workers (``exit``). A worker whose parent is
gone (a closed pipe) exits quietly.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, cast


def read_message(fd: int) -> tuple[dict, bytes]:
    header = json.loads(_read_frame(fd))
    return header, _read_frame(fd)


def write_message(fd: int, header: dict, payload: bytes = b"") -> None:
    head = json.dumps(header).encode()
    data = struct.pack("<Q", len(head)) + head + struct.pack("<Q", len(payload))
    _write_all(fd, data)
    if payload:
        _write_all(fd, payload)


def _read_exact(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 24))
        if not chunk:
            raise EOFError("the other end of the client worker pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int) -> bytes:
    (n,) = struct.unpack("<Q", _read_exact(fd, 8))
    return _read_exact(fd, n)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _views(buffer, leaves):
    import numpy as np

    return [
        np.ndarray(tuple(shape), dtype=np.dtype(dtype), buffer=buffer, offset=offset)
        for offset, dtype, shape in leaves
    ]


def main(core: int, rfd: int, wfd: int) -> None:
    if core >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(flags)
    os.environ["JAX_PLATFORMS"] = "cpu"

    from multiprocessing import resource_tracker, shared_memory

    import jax
    import numpy as np

    from fedax.simulation.host import compiler_options

    programs: dict[str, Callable[..., Any]] = {}
    segments: dict[str, shared_memory.SharedMemory] = {}

    def segment(name: str) -> shared_memory.SharedMemory:
        if name not in segments:
            shm = shared_memory.SharedMemory(name=name)
            # The parent owns the segment; this process must not unlink it at exit.
            # (_name, private: the name it was registered under; typeshed omits it)
            resource_tracker.unregister(cast(Any, shm)._name, "shared_memory")
            segments[name] = shm
        return segments[name]

    write_message(wfd, {"ok": True, "pid": os.getpid(), "devices": jax.device_count()})
    while True:
        header, payload = read_message(rfd)  # EOFError: the parent is gone
        op = header.get("op")
        try:
            if op == "exit":
                write_message(wfd, {"ok": True})
                return
            if op == "load":
                exported = jax.export.deserialize(bytearray(payload))
                compiled = (
                    jax.jit(exported.call)
                    .lower(*exported.in_avals)
                    .compile(compiler_options("cpu", dots=header.get("dots")))
                )
                programs[header["key"]] = compiled
                write_message(wfd, {"ok": True})
            elif op == "run":
                for name in list(segments):  # segments the parent has replaced
                    if name not in (header["in"]["name"], header["out"]["name"]):
                        segments.pop(name).close()
                start = time.perf_counter()
                inputs = _views(segment(header["in"]["name"]).buf, header["in"]["leaves"])
                outputs = programs[header["key"]](*inputs)
                targets = _views(segment(header["out"]["name"]).buf, header["out"]["leaves"])
                for target, value in zip(targets, jax.tree.leaves(outputs), strict=True):
                    np.copyto(target, np.asarray(value))
                del inputs, targets, outputs
                write_message(wfd, {"ok": True, "seconds": time.perf_counter() - start})
            else:
                raise ValueError(f"unknown request {op!r}")
        except BrokenPipeError:
            raise
        except Exception:  # report to the parent, which raises it
            write_message(wfd, {"ok": False, "error": traceback.format_exc()})


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    try:
        main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
    except (EOFError, BrokenPipeError):  # the parent is gone: nothing to report to
        pass
