"""The server's checkpoint and round log (``Server.checkpoints``): after every round, through
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

log = logging.getLogger("fedax.runtime.server")
CHECKPOINT = "server_checkpoint.msgpack"
ROUND_LOG = "rounds.jsonl"


class Checkpoints:
    """A server's checkpoints and round log: ``install`` (a closed round's new state),
    ``commit``, ``log_record`` and ``restore``, on the ``server``'s state and records."""

    def __init__(self, server: Any):
        self.server = server

    def install(self, r: Any, state: Any, accepted: dict[int, Any],
                record: dict[str, Any], metrics: dict[str, float]) -> None:
        """Make ``state`` the server's, checkpoint it, and only then tell the clients
        their reports were included (a crash before the checkpoint is durable leaves no
        client ahead of the server)."""
        server = self.server
        server.state = state
        if server.evaluate is not None:
            metrics.update(server.evaluate(server.params))
        record.update(status="closed", round_s=round(time.monotonic() - r.started, 4),
                      **metrics)
        included = dict(server.included)
        for c in accepted:
            included[c] = (r.t, r.attempt)
        server.rounds_done = r.t + 1
        self.commit(record, included)

    def commit(self, record: dict[str, Any], included: dict[int, tuple[int, int]]) -> None:
        """A closed round, in every server: its record joins the history, the checkpoint
        is saved, only then is ``included`` the server's (what clients are told), and the
        record is logged and handed to each ``on_round`` callback."""
        server = self.server
        server.history.append(record)
        self._save(included)
        with server._lock:
            server.included = included
        self.log_record(record)
        for callback in server.on_round:
            callback(record)

    def log_record(self, record: dict[str, Any]) -> None:
        """An attempt's record: kept, logged, and appended to ``rounds.jsonl``."""
        self.server.records.append(record)
        line = dumps(strict_json(record)[0])  # strict JSON: a NaN/inf metric is null
        log.info("round %s", line)
        if self.server.config.checkpoint_dir is not None:
            path = Path(self.server.config.checkpoint_dir) / ROUND_LOG
            path.parent.mkdir(parents=True, exist_ok=True)
            append_line(path, line)

    def _paths(self) -> list[Path]:
        config = self.server.config
        assert config.checkpoint_dir is not None
        return store.kept_paths(Path(config.checkpoint_dir) / CHECKPOINT,
                                config.keep_checkpoints)

    def _save(self, included: dict[int, tuple[int, int]]) -> None:
        server = self.server
        if server.config.checkpoint_dir is None:
            return
        # store.save writes through a 0600 temporary file: the secret stays the owner's.
        store.save_kept(self._paths(), {
            "version": 2, "task_sha256": server.task.sha256(), "round": server.rounds_done,
            "state": store.encode(server.state), "secret": server._secret,
            "key": np.asarray(jax.random.key_data(server._key)).tobytes(),
            "included": {str(k): list(v) for k, v in included.items()},
            "history": server.history, **server.phases.checkpoint()})

    def restore(self) -> None:
        """The server's state, keys, round count, inclusions and history from the newest
        checkpoint that reads (none: round 0, with a warning)."""
        server = self.server
        if server.config.checkpoint_dir is None:
            raise ValueError("resume needs a checkpoint_dir")
        path, data = store.load_newest(self._paths())
        if path is None or data is None:  # (both or neither)
            log.warning("no checkpoint in %s; starting from round 0",
                        server.config.checkpoint_dir)
            return
        if data.get("task_sha256") != server.task.sha256():
            raise ValueError(f"the checkpoint in {path.parent} is from another task; resume "
                             "with the same task settings or use a new checkpoint dir")
        state = store.decode(data["state"], server._state_template, "checkpoint")
        server.state = jax.tree.map(jnp.asarray, state)
        if "secret" in data:
            words = np.frombuffer(bytes(data["key"]), np.uint32).copy()
            impl = jax.random.key_impl(server._key)
            server._set_key(jax.random.wrap_key_data(words, impl=impl), bytes(data["secret"]))
        server.rounds_done = int(data["round"])
        server.included = {int(k): (int(v[0]), int(v[1]))
                           for k, v in data["included"].items()}
        server.history = list(data["history"])
        server.phases.restore(data)
        log.info("resumed from %s after round %d", path, server.rounds_done)
