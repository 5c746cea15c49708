"""The server's checkpoint and round log (a ``Server`` mixin): after every round, through
``fedax.checkpoint``'s atomic mode-0600 write (it holds the server's secret), the last
``keep_checkpoints`` kept; ``resume`` continues from the newest that reads, refusing one of
another task. Every attempt's record goes to ``rounds.jsonl`` (strict JSON) beside it."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedax.algorithms.records import dumps, strict_json
from fedax.io import append_line
from fedax.runtime import store
from fedax.runtime.server_base import ServerBase

log = logging.getLogger("fedax.runtime.server")
CHECKPOINT = "server_checkpoint.msgpack"
ROUND_LOG = "rounds.jsonl"


class ServerCheckpoints(ServerBase):
    """Mixin of ``fedax.runtime.server.Server``: ``_install`` (with ``_save``), ``_log``
    and ``_restore``."""

    def _install(self, r: Any, state: Any, accepted: dict[int, Any],
                 record: dict[str, Any], metrics: dict[str, float]) -> None:
        """Make ``state`` the server's, checkpoint it, and only then tell the clients
        their reports were included (a crash before the checkpoint is durable leaves no
        client ahead of the server)."""
        self.state = state
        if self.evaluate is not None:
            metrics.update(self.evaluate(self.params))
        record.update(status="closed", round_s=round(time.monotonic() - r.started, 4),
                      **metrics)
        included = dict(self.included)
        for c in accepted:
            included[c] = (r.t, r.attempt)
        self.rounds_done = r.t + 1
        self._commit(record, included)

    def _commit(self, record: dict[str, Any], included: dict[int, tuple[int, int]]) -> None:
        """A closed round, in every server: its record joins the history, the checkpoint
        is saved, only then is ``included`` the server's (what clients are told), and the
        record is logged and handed to each ``on_round`` callback."""
        self.history.append(record)
        self._save(included)
        with self._lock:
            self.included = included
        self._log(record)
        self._closed(record)

    def _closed(self, record: dict[str, Any]) -> None:
        """A closed round's record, checkpointed: each ``on_round`` callback gets it."""
        for callback in self.on_round:
            callback(record)

    def _log(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        line = dumps(strict_json(record)[0])  # strict JSON: a NaN/inf metric is null
        log.info("round %s", line)
        if self.config.checkpoint_dir is not None:
            path = Path(self.config.checkpoint_dir) / ROUND_LOG
            path.parent.mkdir(parents=True, exist_ok=True)
            append_line(path, line)

    def _checkpoint_paths(self, directory: str) -> list[Path]:
        return store.kept_paths(Path(directory) / CHECKPOINT, self.config.keep_checkpoints)

    def _save(self, included: dict[int, tuple[int, int]]) -> None:
        if self.config.checkpoint_dir is None:
            return
        # store.save writes through a 0600 temporary file: the secret stays the owner's.
        store.save_kept(self._checkpoint_paths(self.config.checkpoint_dir), {
            "version": 2, "task_sha256": self.task.sha256(), "round": self.rounds_done,
            "state": store.encode(self.state), "secret": self._secret,
            "key": np.asarray(jax.random.key_data(self._key)).tobytes(),
            "included": {str(k): list(v) for k, v in included.items()},
            "history": self.history, **self._learned_checkpoint()})

    def _restore(self) -> None:
        if self.config.checkpoint_dir is None:
            raise ValueError("resume needs a checkpoint_dir")
        path, data = store.load_newest(self._checkpoint_paths(self.config.checkpoint_dir))
        if path is None or data is None:  # (both or neither)
            log.warning("no checkpoint in %s; starting from round 0",
                        self.config.checkpoint_dir)
            return
        if data.get("task_sha256") != self.task.sha256():
            raise ValueError(f"the checkpoint in {path.parent} is from another task; resume "
                             "with the same task settings or use a new checkpoint dir")
        self.state = store.decode(data["state"], self._state_template, "checkpoint")
        self.state = jax.tree.map(jnp.asarray, self.state)
        if "secret" in data:
            words = np.frombuffer(bytes(data["key"]), np.uint32).copy()
            self._set_key(jax.random.wrap_key_data(words, impl=jax.random.key_impl(self._key)),
                          bytes(data["secret"]))
        self.rounds_done = int(data["round"])
        self.included = {int(k): (int(v[0]), int(v[1])) for k, v in data["included"].items()}
        self.history = list(data["history"])
        self._learned_restore(data)
        log.info("resumed from %s after round %d", path, self.rounds_done)
