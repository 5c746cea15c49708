"""A fedax client: its own data, its own per-client state, the algorithm's client piece.

The client pulls (Flower's SuperNodes do the same; docs/references.md, deployment
runtime): it calls ``Join`` once (the server answers with the task and the chunk size),
then ``Poll``s (the server holds an idle poll open until there is a task for it); when it
is selected the poll streams the task (payload, round id, model version, nonce), the client
runs ``client_step`` (jit-compiled: the algorithm's ``client_update`` on its own batches
and state; the aggregator's client stage, e.g. the clip, runs on the server) and streams
its report back with ``Submit``. It never sends its data or its per-client state. Under a
secure aggregator it runs the client stage itself and answers SecAgg+'s four stages
instead of reporting (``fedax.runtime.secure_client``): only a masked vector leaves it.

Round t's batches are ``make_cohort`` of the client's own examples with
``default_rng([seed, t, client_id])`` (``local_batches``): a pure function of what the
client holds, so a simulator given the same per-client batches computes the same round.

Per-client state (SCAFFOLD's c_i) lives in ``state_dir``: ``client_state.msgpack`` is the
state after the last report the server aggregated; a new report's state waits in
``pending_state.msgpack`` until a later poll says the round included it
(``included_round``/``included_attempt``); if the round closed without it (a retry, a
late or refused report), it is dropped. So a client that crashes, or a round that is
retried, never leaves the client's state ahead of the server's.

Reaching the server: before its first ``Join`` the client checks the address itself
(``security.probe``: a TCP connection and a TLS handshake verified against its CA), so a
wrong port, an unknown host or a certificate its CA did not sign is named at once, and
gRPC never attempts a handshake that cannot succeed. It retries with backoff (1, 2, 4, 4,
... s), logging one line per retry, until ``connect_s`` has passed; a certificate that
does not verify is not retried. Then it raises ``Unreachable``: ``cannot connect to
HOST:PORT: <cause>; <what to do>``.

``Connection`` (``fedax.runtime.connection``) is the thin RPC layer (TLS channel, token
metadata, chunked streams); ``fedax.runtime.client_task`` builds the task's steps and the
round batches (``local_batches``). This module re-exports both modules' public names.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from fedax.runtime import wire
from fedax.runtime.client_task import BUILD_LOCK, built, local_batches
from fedax.runtime.connection import (
    RETRY,
    Connection,
    Refused,
    Unreachable,
    grpc_problem,
    server_status,
)
from fedax.runtime.secure_client import SecureRounds
from fedax.runtime.secure_task import STAGES
from fedax.runtime.security import (  # noqa: F401 (train_key: this module's name too)
    ClientTLS,
    load_or_make_secret,
    probe,
    train_key,
)

__all__ = [
    "PENDING",
    "STATE",
    "Client",
    "ClientConfig",
    "Connection",
    "Refused",
    "Unreachable",
    "local_batches",
    "server_status",
]

log = logging.getLogger("fedax.runtime.client")

STATE = "client_state.msgpack"
PENDING = "pending_state.msgpack"


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """Where the server is and who this client is.

    Attributes:
      address: the server's ``host:port``.
      client_id: this client's registered id (0..N-1).
      token: its token.
      tls: the CA to trust (``ClientTLS``).
      state_dir: where the per-client state and the client's secret training seed live
        (needed by algorithms with per-client state; without it the seed lives in memory).
      connect_s: at the start, give up after trying to reach the server this long
        (default: ``reconnect_s``); one log line per retry.
      reconnect_s: once joined, give up after this many seconds without reaching the
        server (a server restart within it is invisible to the client).
      max_message_bytes: refuse a larger task from the server.
      delay_s: wait this long after training each task, before reporting (a slow device,
        for experiments with clients of several speeds).
      identity: its SecAgg+ identity key (``secagg.IdentityKey``) and ``roster``, every
        client's verification key (``secagg.Roster``, from outside the server): with them
        it takes part in secure rounds only with the consistency check, which a server
        that lies about who dropped cannot pass (``fedax.runtime.secagg.identity``).
    """

    address: str
    client_id: int
    token: str
    tls: ClientTLS
    state_dir: str | None = None
    reconnect_s: float = 30.0
    connect_s: float | None = None
    max_message_bytes: int = 256 << 20
    timeout_s: float = 30.0
    delay_s: float = 0.0
    identity: Any = None
    roster: Any = None


class Client:
    """A client over its own examples ``x``, ``y`` (see the module docstring).

    ``run()`` returns when the server says the run is done (or ``stop`` is set); it raises
    ``Refused`` if the server refuses the credentials and ``Unreachable`` (a
    ``ConnectionError``) if the server cannot be reached within ``connect_s`` at the start,
    or for ``reconnect_s`` later, naming the cause.
    """

    def __init__(self, config: ClientConfig, x: np.ndarray, y: np.ndarray,
                 stop: threading.Event | None = None,
                 test: tuple[np.ndarray, np.ndarray] | None = None, fault: Any = None):
        self.config = config
        self.x, self.y = np.asarray(x), np.asarray(y)
        self.test = test  # its own test examples (x, y), for per_client_eval
        self.stop = stop or threading.Event()
        self.rounds: list[tuple[int, int, bool, str]] = []  # (round, attempt, accepted, why)
        self._conn: Connection | None = None
        self._seed: bytes | None = None  # the secret training seed (its training keys)
        # secure rounds (fedax.runtime.secure_client); ``fault``: a SecAggFault, tests only
        self._secure = SecureRounds(self, fault)
        self.secure_input: tuple[tuple[int, int], np.ndarray] | None = None  # never sent

    # ---------------------------------------------------------------- state files

    def _paths(self) -> tuple[Path, Path] | tuple[None, None]:
        if self.config.state_dir is None:
            return None, None
        d = Path(self.config.state_dir)
        return d / STATE, d / PENDING

    def _load_state(self, b) -> Any:
        from fedax.runtime import store

        if b["state_template"] is None:
            return None
        state_path, _ = self._paths()
        if state_path is None:
            raise ValueError(f"algorithm {b['task'].algorithm!r} keeps per-client state: give "
                             "the client a state_dir")
        if state_path.exists():
            data = store.load(state_path)
            if data.get("task_sha256") != b["task"].sha256():
                raise ValueError(f"{state_path} belongs to another task; use a new state_dir")
            return store.decode(data["state"], b["state_template"], "client state")
        return b["pieces"].client_state(b["params"])

    def _settle(self, b, env) -> None:
        """Commit or drop the pending state per the server's ``included_*``."""
        state_path, pending_path = self._paths()
        if state_path is None or pending_path is None or not pending_path.exists():
            return
        from fedax.runtime import store

        pending = store.load(pending_path)
        mine = (pending["round"], pending["attempt"])
        if (env.included_round, env.included_attempt) == mine:
            pending_path.replace(state_path)
            log.info("client %d: state of round %d.%d kept", self.config.client_id, *mine)
        elif env.rounds_done > mine[0]:
            pending_path.unlink()
            log.info("client %d: round %d.%d closed without this report; its state dropped",
                     self.config.client_id, *mine)

    def _train_key(self, t: int):
        """The client's own training key for round t (every client update gets one;
        example-level DP-SGD draws its noise from it): ``train_key(secret, t)`` with a
        256-bit secret drawn from the OS once and kept in ``state_dir/client_seed`` (hex,
        mode 0600, written atomically; without a ``state_dir``, in this object's memory
        only). It never leaves the client."""
        if self._seed is None:
            if self.config.state_dir is None:
                self._seed = os.urandom(32)
            else:
                self._seed = load_or_make_secret(Path(self.config.state_dir) / "client_seed")
        return train_key(self._seed, t)

    # ----------------------------------------------------------------------- loop

    def _refused(self, err: grpc.RpcError) -> Refused:
        return Refused(f"the server refused client {self.config.client_id}: {err.details()}")

    def _connect(self, conn: Connection) -> Any:
        """The first ``Join``'s reply (``None`` if ``stop`` was set first): ``probe`` the
        address, then join; on failure log the cause and retry after 1, 2, 4, 4, ... s
        while ``connect_s`` lasts, then raise ``Unreachable``. A certificate that does
        not verify, or a server that is not a fedax server, is not retried."""
        cfg = self.config
        limit = cfg.reconnect_s if cfg.connect_s is None else cfg.connect_s
        start, wait, tries = time.monotonic(), 1.0, 0
        while not self.stop.is_set():
            tries += 1
            left = limit - (time.monotonic() - start)
            problem = probe(cfg.address, cfg.tls, timeout_s=min(max(left, 1.0), 5.0))
            if problem is None:
                try:
                    return conn.join()
                except grpc.RpcError as err:
                    code = err.code()
                    if code == grpc.StatusCode.UNAUTHENTICATED:
                        raise self._refused(err) from None
                    if code not in RETRY + (grpc.StatusCode.UNIMPLEMENTED,):
                        raise
                    problem = grpc_problem(err, cfg.address)
            cause, fix, retry = problem
            elapsed = time.monotonic() - start
            if not retry or elapsed >= limit - 0.1:
                if tries > 1:
                    cause = f"{cause}, {tries} tries in {elapsed:.0f} s"
                raise Unreachable(cfg.address, cause, fix)
            pause = min(wait, limit - elapsed)
            log.warning("client %d: cannot connect to %s: %s; retrying in %g s",
                        cfg.client_id, cfg.address, cause, round(pause, 1))
            self.stop.wait(pause)
            wait = min(wait * 2, 4.0)
        return None

    def _call(self, fn, *args):
        """``fn(*args)``, reconnecting through transient failures for ``reconnect_s``."""
        cfg = self.config
        start, wait, lost = time.monotonic(), 0.05, False
        while True:
            try:
                out = fn(*args)
                if lost:
                    log.info("client %d: reached %s again", cfg.client_id, cfg.address)
                return out
            except grpc.RpcError as err:
                code = err.code()
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    raise self._refused(err) from None
                if code not in RETRY or self.stop.is_set():
                    raise
                failure: grpc.RpcError | wire.WireError = err
            except wire.WireError as err:  # a poll stream cut short: the server went away
                failure = err
            if time.monotonic() - start > cfg.reconnect_s:
                problem = probe(cfg.address, cfg.tls) or (
                    grpc_problem(failure, cfg.address) if isinstance(failure, grpc.RpcError)
                    else (str(failure), "check that the server runs", True))
                raise Unreachable(cfg.address, f"{problem[0]} (for {cfg.reconnect_s:g} s)",
                                  problem[1]) from None
            if not lost:
                lost = True
                log.warning("client %d: lost %s (%s); reconnecting for up to %g s",
                            cfg.client_id, cfg.address,
                            failure.code().name if isinstance(failure, grpc.RpcError)
                            else failure, cfg.reconnect_s)
            self.stop.wait(wait)
            wait = min(wait * 2, 1.0)

    def run(self) -> list[tuple[int, int, bool, str]]:
        cfg = self.config
        conn = Connection(cfg.address, cfg.tls, cfg.client_id, cfg.token,
                          timeout_s=cfg.timeout_s)
        self._conn = conn
        try:
            reply = self._connect(conn)
            if reply is None:
                return self.rounds
            b = built(reply.task_json)
            self._warm_up(b)
            log.info("client %d joined %s", cfg.client_id, cfg.address)
            while not self.stop.is_set():
                env = self._call(conn.poll, cfg.max_message_bytes)
                self._settle(b, env)
                if env.kind == "done":
                    break
                if env.kind == "task":
                    self._work(conn, b, env)
                    continue
                if env.kind in ("holdout", "evaluate"):
                    (self._holdout if env.kind == "holdout" else self._evaluate)(conn, b, env)
                    continue
                if env.kind in STAGES:  # SecAgg+'s requests after a secure training task
                    self._secure.answer(conn, env)
                    continue
                self.stop.wait(max(env.retry_after_s, 0.01))
        finally:
            conn.close()
        return self.rounds

    def _inputs(self, b, t: int, sent: Any):
        from fedax.client import Batches

        task = b["task"]
        x, y, mask, n = local_batches(self.x, self.y, task.local_epochs, task.batch,
                                      task.seed, t, self.config.client_id)
        return (sent["payload"], self._load_state(b), Batches(x, y, mask), n,
                self._train_key(t), sent.get("stage"))

    def _warm_up(self, b) -> None:
        """Compile the client step for this client's batch shapes before polling, so the
        first round's deadline is not spent compiling (one compilation per process and
        shape: client threads sharing a process wait for the first)."""
        import jax
        import jax.numpy as jnp

        from fedax.runtime import store

        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), b["sent"])
        sent = store.typed(zeros, b["sent_typed"])
        step = b["step"]
        extra: tuple[Any, ...] = ()  # a secure task's: for the n it expects (secure_steps)
        if b["secure"] is not None and b["secure_n"] is not None:
            step, extra = b["secure_step"](b["secure_n"]), (zeros["stage"]["key"],)
        with BUILD_LOCK:
            jax.block_until_ready(step(*self._inputs(b, 0, sent), *extra))

    def _work(self, conn: Connection, b, env) -> None:
        from fedax.runtime import store

        if b["secure"] is not None:  # train, then SecAgg+ (fedax.runtime.secure_client)
            return self._secure.train(conn, b, env)
        sent = store.typed(wire.decode_tree(list(env.tensors), b["sent"], "task"),
                           b["sent_typed"])
        report = self._train(b, env, sent)
        if report is None:
            return
        out = wire.Envelope(kind="update", client_id=self.config.client_id, round=env.round,
                            attempt=env.attempt, model_version=env.model_version,
                            nonce=env.nonce, tensors=wire.encode_tree(report))
        if self.config.delay_s > 0:
            self.stop.wait(self.config.delay_s)
        reply = self._call(conn.submit, out)
        self.rounds.append((int(env.round), int(env.attempt), bool(reply.accepted),
                            reply.reason))
        if not reply.accepted:
            log.warning("client %d: report for round %d.%d refused: %s",
                        self.config.client_id, env.round, env.attempt, reply.reason)

    def _train(self, b, env, sent, step=None, *extra) -> Any:
        """The client step of round ``env.round`` on ``sent`` (typed; ``step``: another
        compiled step taking ``extra`` arguments too): its outputs but the new state (the
        report first), as NumPy, or None if the report is not finite (recorded, not
        reported); a new per-client state waits in the pending file."""
        import jax

        from fedax.runtime import store

        task = b["task"]
        cid, t = self.config.client_id, int(env.round)
        *out, new_state = (step or b["step"])(*self._inputs(b, t, sent), *extra)
        out = jax.device_get(out)
        report = out[0]
        finite = wire.all_finite(jax.tree.leaves(report)) is None
        if new_state is not None:
            finite = finite and wire.all_finite(
                np.asarray(a) for a in jax.tree.leaves(new_state)) is None
        if not finite:
            log.warning("client %d: round %d.%d gave non-finite values; not reporting",
                        cid, t, env.attempt)
            self.rounds.append((t, int(env.attempt), False, "non-finite"))
            return None
        if new_state is not None:
            _, pending_path = self._paths()
            assert pending_path is not None  # (_load_state wants a state_dir for a state)
            store.save(pending_path, {"round": t, "attempt": int(env.attempt),
                                      "task_sha256": task.sha256(),
                                      "state": store.encode(new_state)})
        return out if step is not None else report

    def _holdout(self, conn: Connection, b, env) -> None:
        """A holdout task (``fedax.runtime.holdout``): the loss at the new model over all
        this client's examples, in one batch, and its derivative along the tangent sent."""
        import jax

        from fedax.client import Batches

        sent = wire.decode_tree(list(env.tensors), b["holdout_sent"], "holdout task")
        x = self.x.astype(np.int32 if np.issubdtype(self.x.dtype, np.integer) else np.float32)
        batches = Batches(x[None], self.y.astype(np.int32)[None],
                          np.ones((1, len(self.y)), np.float32))
        report = jax.device_get(b["holdout_step"](
            sent["payload"]["params"], sent["payload"]["tangent"], batches,
            np.float32(len(self.y))))
        self._submit(conn, env, report)

    def _evaluate(self, conn: Connection, b, env) -> None:
        """An evaluate task: the test sums at the model sent on this client's own test
        examples (zeros without any)."""
        import jax

        from fedax.runtime.holdout import EvalReport

        sent = wire.decode_tree(list(env.tensors), b["eval_sent"], "evaluate task")
        if self.test is None or len(self.test[1]) == 0:
            report = EvalReport(np.float32(0), np.float32(0), np.float32(0))
        else:
            x, y = self.test
            x = x.astype(np.int32 if np.issubdtype(x.dtype, np.integer) else np.float32)
            report = jax.device_get(b["eval_step"](sent["payload"]["params"], x,
                                                   y.astype(np.int32)))
        self._submit(conn, env, report)

    def _submit(self, conn: Connection, env, report) -> None:
        out = wire.Envelope(kind="update", client_id=self.config.client_id, round=env.round,
                            attempt=env.attempt, model_version=env.model_version,
                            nonce=env.nonce, tensors=wire.encode_tree(report))
        reply = self._call(conn.submit, out)
        self.rounds.append((int(env.round), int(env.attempt), bool(reply.accepted),
                            reply.reason))
