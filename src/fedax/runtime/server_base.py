"""What the parts of ``fedax.runtime.server.Server`` share, declared once for the type
checker: ``Server`` is made of mixins (``ServerRPCs``, ``SecurePhase``, ``HoldoutPhase``,
``ServerCheckpoints``), each based on ``ServerBase``, that read and write the attributes
``Server.__init__`` sets and call one another's methods. At run time ``ServerBase`` is an
empty class: the annotations and the ``TYPE_CHECKING`` signatures below only tell mypy
what a ``Server`` has (``make typecheck``)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jax

    from fedax.algorithms.base import RoundPieces, RoundState
    from fedax.runtime.checks import ReportChecks
    from fedax.runtime.config import ServerConfig
    from fedax.runtime.gate import RateLimitedLog, Rejections
    from fedax.runtime.rounds import OpenRound, PhaseRound
    from fedax.runtime.security import Registry
    from fedax.runtime.task import Task


class ServerBase:
    """The state of a ``Server`` that its parts use (set by ``Server.__init__``)."""

    task: Task
    config: ServerConfig
    registry: Registry
    evaluate: Callable[[Any], dict[str, float]] | None
    pieces: RoundPieces
    state: RoundState
    _state_template: Any  # the state's jax.ShapeDtypeStructs
    report_template: Any  # what every training report must look like
    _report_layout: list[tuple[str, str, tuple[int, ...]]]
    _report_treedef: Any  # jax's PyTreeDef
    _checks: ReportChecks
    _encodes: bool
    _key: jax.Array
    _secret: bytes
    _simulator_seed: int | None
    # the rounds: the lock guards the open round and the counters, news wakes long polls
    _lock: threading.Condition
    _news: threading.Condition
    _stop: threading.Event
    _readers: threading.BoundedSemaphore
    _held: int
    _holding: collections.Counter[int]
    _round: OpenRound | None
    _last_closed: OpenRound | None
    _done: bool
    _error: BaseException | None
    _bytes: dict[str, int]
    rounds_done: int
    last_seen: dict[int, float]
    chunk_bytes: dict[int, int]
    included: dict[int, tuple[int, int]]
    history: list[dict[str, Any]]
    on_round: list[Callable[[dict[str, Any]], None]]
    records: list[dict[str, Any]]
    rejections: Rejections
    _refusals: RateLimitedLog

    if TYPE_CHECKING:  # methods of Server and of its parts that another part calls

        @property
        def params(self) -> Any: ...

        def _set_key(self, key: jax.Array | None, secret: bytes | None = None) -> None: ...

        def _alive(self) -> list[int]: ...

        def _wait_alive(self, need: int,
                        flag: str = "--min-clients") -> list[int] | None: ...

        def _publish(self, t: int, attempt: int, selected: list[int], sent: Any,
                     payload: Any, keys: Any, phase: str = "train",
                     target: int | None = None, own: dict[int, list] | None = None,
                     version: str | None = None) -> OpenRound: ...

        def _close(self, r: OpenRound) -> dict[str, Any]: ...

        def _checked_report(self, r: PhaseRound,
                            env: Any) -> tuple[Any, tuple[str, str] | None]: ...

        def _log(self, record: dict[str, Any]) -> None: ...

        def _closed(self, record: dict[str, Any]) -> None: ...

        def _commit(self, record: dict[str, Any],
                    included: dict[int, tuple[int, int]]) -> None: ...

        def _learned_checkpoint(self) -> dict[str, Any]: ...

        def _learned_restore(self, data: dict[str, Any]) -> None: ...


__all__ = ["ServerBase"]
