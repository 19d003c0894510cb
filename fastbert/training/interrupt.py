"""Graceful stop on Ctrl-C (SIGINT) and SIGTERM (what schedulers send).

While the training loop runs, the first signal only asks it to stop: the loop saves a checkpoint at
the next step boundary where all ranks agree (every step with one rank; at log steps, inside the
loop's existing all-reduce, with several), and the command says how to resume. A second Ctrl-C
exits at once (checkpoints are written atomically, so nothing half-written is left as the newest);
if the checkpoint is not written within ``timeout_s`` the process exits by itself. A SIGTERM after
the first signal is taken as the same request (``torchrun`` forwards one to its workers after the
terminal's SIGINT), not as the second Ctrl-C.

Outside the loop (data preparation, start-up, export) SIGTERM is turned into ``Terminated`` (a
``KeyboardInterrupt``), so the command prints one line and exits with 143 instead of dying silently.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, Optional

NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}


class Terminated(KeyboardInterrupt):
    """SIGTERM outside the training loop."""


def exit_code(signum: int) -> int:
    return 128 + int(signum)


def _raise_terminated(signum, frame):
    raise Terminated()


def terminate_as_interrupt() -> None:
    """SIGTERM raises ``Terminated`` (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


class StopRequest:
    """Catches SIGINT/SIGTERM between ``install()`` and ``remove()``; ``requested`` is this rank's flag."""

    def __init__(self, log: Callable[[str], None], timeout_s: float = 300.0):
        self.log = log
        self.timeout_s = timeout_s
        self.signum: Optional[int] = None
        self._previous: dict = {}
        self._timer: Optional[threading.Timer] = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum or signal.SIGINT)

    def install(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for s in NAMES:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def remove(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        if self._timer is not None:
            self._timer.cancel()

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:
                print("\n[fastbert] second Ctrl-C: stopping now, without a new checkpoint", file=sys.stderr,
                      flush=True)
                os._exit(exit_code(signum))
            return
        self.signum = signum
        self.log(f"\n[fastbert] {NAMES.get(signum, signum)}: saving a checkpoint at the end of this step, then "
                 f"stopping (Ctrl-C again to stop at once; gives up after {self.timeout_s:.0f}s)")
        self._timer = threading.Timer(self.timeout_s, self._give_up)
        self._timer.daemon = True
        self._timer.start()

    def _give_up(self) -> None:
        print(f"[fastbert] no step boundary within {self.timeout_s:.0f}s of the signal: stopping without a "
              "new checkpoint", file=sys.stderr, flush=True)
        os._exit(self.exit_code)
