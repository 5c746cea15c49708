"""How the ``fedax`` command fails: any error as one line (``failure_message``: the message
and the exit status), warnings as one line each, and Ctrl-C that stops quietly, also inside
JAX's host callbacks (``Interrupts``)."""

from __future__ import annotations

import _thread
import os
import sys
import threading

from fedax.cli.run_dirs import os_error_message
from fedax.spec.errors import CommandError, ConfigError


def one_line(err: BaseException | str, limit: int = 300) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_instance(err: BaseException, module: str, name: str) -> bool:
    cls = getattr(sys.modules.get(module), name, None)
    return isinstance(cls, type) and isinstance(err, cls)


def failure_message(err: BaseException) -> tuple[str, int]:
    """What the command prints for ``err`` (one line; a missing data set's message also
    lists the sources tried), and its exit status."""
    if isinstance(err, CommandError):
        return f"fedax: {err.kind}: {err}", err.status
    if isinstance(err, ConfigError):
        return f"fedax: error: {one_line(err, 1000)}", 2
    if isinstance(err, KeyboardInterrupt):
        return "fedax: interrupted: stopped before any run started", 130
    if _is_instance(err, "fedax.data._cache", "DataUnavailableError"):
        first, *rest = str(err).splitlines() or [""]
        return "\n".join([f"fedax: error: {first}", *rest]), 1
    if isinstance(err, FloatingPointError):
        return f"fedax: error: {one_line(err)}", 1
    if isinstance(err, OSError):
        return f"fedax: error: {os_error_message(err)}", 1
    text = one_line(err)
    return (f"fedax: error: {type(err).__name__}{': ' + text if text else ''}; run with "
            "--debug for the traceback"), 1


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"fedax: warning: {one_line(message, 1000)}", file=sys.stderr)


# Code that runs inside a JAX host callback: the ``processes`` strategy's client map.
_CALLBACK_FILES = (os.path.join("jax", "_src", "callback.py"),
                   os.path.join("fedax", "simulation", "processes.py"))


def _in_host_callback(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.endswith(_CALLBACK_FILES):
            return True
        frame = frame.f_back
    return False


class Interrupts:
    """The command's SIGINT handler: KeyboardInterrupt, but not inside a JAX host callback,
    which XLA may run on the main thread and would fail with an error of its own (and a
    logged traceback). There the interrupt is delivered again shortly, until the main
    thread is back in the run's code; a second Ctrl-C meanwhile interrupts at once."""

    def __init__(self):
        self.retry: threading.Timer | None = None
        self.presses = 0

    def __call__(self, signum, frame) -> None:
        if self.retry is not None and not self.retry.is_alive():
            self.retry = None  # our own re-delivery
        else:
            self.presses += 1
        if self.presses < 2 and _in_host_callback(frame):
            if self.retry is None:
                self.retry = threading.Timer(0.05, _thread.interrupt_main)
                self.retry.daemon = True
                self.retry.start()
            return
        self.presses = 0
        raise KeyboardInterrupt

    def cancel(self) -> None:
        if self.retry is not None:
            self.retry.cancel()
