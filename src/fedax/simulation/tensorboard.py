"""TensorBoard logs of a run through tensorboardX (no TensorFlow).

``TensorBoardLogger(logdir)`` is a runner callback (``run(..., callbacks=[logger],
round_callbacks=[logger.on_round])``) that writes, at each evaluation record's round:

* every number the record holds as a scalar (the evaluation, ``train_loss``, the round's
  and its aggregator's metrics, ε), tagged by kind: ``test/…`` (global evaluation),
  ``clients/…`` (the per-client distribution), ``hyper/…`` (learned hyperparameters over
  time: a learned server learning rate, an adaptive clip), ``round/…`` (everything else);
* every vector a round returns (one value per client, e.g. the clients' update norms
  with ``fedax.aggregators.record_update_norms``) as a histogram at that round.

Nothing is written before the first record (histograms of earlier rounds wait for it), so a
run that fails to start leaves the directory as it was; a fresh run then removes the
directory's old event files. A resumed run (``on_resume``) instead opens its writer with
``purge_step`` at the round after the checkpoint, so TensorBoard drops the old events of
the rounds the resumed run computes again.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

# Record entries that are not metrics.
_NOT_METRICS = ("round", "status", "elapsed_s")


def tag(name: str) -> str:
    """The TensorBoard tag of a record entry (its group, then its name)."""
    if name.startswith("test_"):
        return f"test/{name}"
    if name.startswith(("client_", "clients_")):
        return f"clients/{name}"
    if name.endswith("_lr") or name in ("clip", "clip_norm") or name.startswith(
            ("learned_", "clip_next", "dp_clip", "adaclip_")):
        return f"hyper/{name}"
    return f"round/{name}"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class TensorBoardLogger:
    """A runner callback writing TensorBoard event files into ``logdir`` (see the module
    docstring). Call ``close()`` at the end (a ``with`` block does)."""

    def __init__(self, logdir: str | os.PathLike[str]):
        self.logdir = Path(logdir)
        self._writer = None
        self._purge_step: int | None = None
        self._resumed = False
        self._pending: list[tuple[int, str, np.ndarray]] = []

    def _open(self):
        if self._writer is None:
            from tensorboardX import SummaryWriter

            if not self._resumed and self.logdir.is_dir():  # a replaced run's events
                for old in self.logdir.glob("events.out.tfevents.*"):
                    old.unlink()
            self._writer = SummaryWriter(str(self.logdir), purge_step=self._purge_step,
                                         flush_secs=30)
        return self._writer

    def on_resume(self, records: list[dict[str, Any]]) -> None:
        """A resumed run: later events replace those of rounds after the checkpoint."""
        self._resumed = True
        self._purge_step = (records[-1]["round"] + 1) if records else None

    def on_round(self, number: int, metrics: Mapping[str, Any], data: Any = None) -> None:
        """Round callback: keeps the round's per-client vectors for histograms."""
        for name, value in metrics.items():
            array = np.asarray(value)
            if array.ndim >= 1 and array.size and np.issubdtype(array.dtype, np.number):
                if data is not None and getattr(data, "real", None) is not None \
                        and array.ndim == 1 and len(array) >= data.real:
                    array = array[:data.real]  # the cohort's real clients, not padding
                finite = array[np.isfinite(array)]
                if finite.size:
                    self._pending.append((number, f"clients/{name}", finite))

    def __call__(self, record: Mapping[str, Any]) -> None:
        writer = self._open()
        step = int(record["round"])
        for number, name, values in self._pending:
            writer.add_histogram(name, values, number)
        self._pending.clear()
        for name, value in record.items():
            if name in _NOT_METRICS:
                continue
            scalar = _number(value)
            if scalar is not None:
                writer.add_scalar(tag(name), scalar, step)
            elif isinstance(value, list) and value:
                array = np.asarray(value, dtype=np.float64)
                if array.ndim >= 1 and np.all(np.isfinite(array)):
                    writer.add_histogram(tag(name), array.reshape(-1), step)
        writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_scalars(logdir: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of the scalars in ``logdir``'s event files, read
    with tensorboardX's protobuf (TFRecord framing: length, CRC, event, CRC), in file and
    write order; a purge marker drops the earlier events at or after its step."""
    return {k: v for k, v in _read(logdir).items() if not k.startswith("histogram:")}


def read_histograms(logdir: str | os.PathLike[str]) -> dict[str, list[tuple[int, int]]]:
    """``{tag: [(step, number of values), ...]}`` of the histograms in ``logdir``."""
    return {k[len("histogram:"):]: v for k, v in _read(logdir).items()
            if k.startswith("histogram:")}


def _read(logdir) -> dict[str, list]:
    import struct

    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list] = {}
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            if event.HasField("session_log") and event.session_log.status == 1:  # START
                for key in out:
                    out[key] = [p for p in out[key] if p[0] < event.step]
            for value in event.summary.value:
                if value.HasField("histo"):
                    out.setdefault(f"histogram:{value.tag}", []).append(
                        (event.step, int(value.histo.num)))
                elif value.HasField("simple_value"):
                    out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out
