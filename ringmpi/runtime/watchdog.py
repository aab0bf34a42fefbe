"""A watchdog for waits on other ranks: no hang longer than a limit, whatever the launcher does.

A peer that dies behind a wrapper script, or hangs, leaves the other ranks
blocked in MPI; some launchers never notice. Every wait on another rank (a ring
exchange, an agreement collective) runs inside :func:`watch`: if it has not
returned after ``RINGMPI_WATCHDOG_S`` seconds (default 600; 0 disables), a
background thread prints one line naming the rank and what it was waiting for,
and ends the process with exit status 124. The launcher then tears the job down;
where it does not, every other waiting rank's own watchdog ends it.

Waits on this rank's own file system are watched the same way: the batch job
waits for its reader thread under :func:`watch` with ``why`` saying so, and moves
the deadline on each time the read makes progress (one HDF5 read done), so a read
that is slow but moving is not cut off, and one that is stuck ends the job.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Optional

__all__ = ["ENV", "DEFAULT_S", "MAX_S", "EXIT_STATUS", "limit", "watch"]

ENV = "RINGMPI_WATCHDOG_S"
DEFAULT_S = 600.0
MAX_S = 7 * 86400.0  # longer limits are clamped to a week
EXIT_STATUS = 124


def limit() -> Optional[float]:
    """The limit in seconds from ``RINGMPI_WATCHDOG_S``, or None when disabled (0).

    A finite number >= 0 is accepted; values above ``MAX_S`` (one week) are clamped
    to it. ``nan``, ``inf``, negative numbers and text are refused with a ValueError
    (they would otherwise switch the watchdog off silently or crash its thread).
    """
    text = os.environ.get(ENV, "").strip()
    if not text:
        return DEFAULT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{ENV} must be a finite number of seconds >= 0 (0 disables), not {text!r}"
        ) from None
    return min(value, MAX_S) if value > 0 else None


class _Dog:
    """One daemon thread that fires when the armed deadline passes before disarm."""

    def __init__(self):
        self.cond = threading.Condition()
        self.deadline: Optional[float] = None
        self.what = ""
        self.why = ""
        self.seconds = 0.0
        self.thread: Optional[threading.Thread] = None

    def arm(self, seconds: float, what: str, why: str = "the peer is dead or hung") -> None:
        with self.cond:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="ringmpi-watchdog")
                self.thread.daemon = True
                self.thread.start()
            self.deadline = time.monotonic() + seconds
            self.what, self.why, self.seconds = what, why, seconds
            self.cond.notify()

    def moved(self, at: float) -> None:
        """Progress at monotonic time ``at``: the deadline becomes ``at`` + the limit."""
        with self.cond:
            if self.deadline is not None:
                self.deadline = max(self.deadline, at + self.seconds)
                self.cond.notify()

    def disarm(self) -> None:
        with self.cond:
            self.deadline = None

    def _run(self) -> None:
        with self.cond:
            while True:
                if self.deadline is None:
                    self.cond.wait()
                    continue
                left = self.deadline - time.monotonic()
                if left > 0:
                    self.cond.wait(left)
                    continue
                self._fire()

    def _fire(self) -> None:
        rank = _rank()
        sys.stderr.write(
            f"ringmpi: watchdog: rank {rank} waited more than {self.seconds:g} s for "
            f"{self.what}; {self.why}: aborting the job ({ENV}={self.seconds:g})\n"
        )
        sys.stderr.flush()
        time.sleep(0.3)  # let the launcher forward the line before the job is torn down
        os._exit(EXIT_STATUS)


_DOG = _Dog()


def _rank() -> str:
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        return str(mpi.COMM_WORLD.Get_rank()) if mpi is not None else "?"
    except Exception:  # noqa: BLE001 - best effort in a dying process
        return "?"


def _still(_at: float) -> None:
    """What :func:`watch` yields when the watchdog is off: progress changes nothing."""


@contextmanager
def watch(what: str, why: str = "the peer is dead or hung"):
    """Run the body under the watchdog: past the limit the process ends with one line.

    Parameters
    ----------
    what : str
        What the rank waits for ("the agreement after read with the other ranks").
    why : str
        The likely cause, said in the line.

    Yields
    ------
    moved : callable (float) -> None
        Call with the monotonic time of progress (``time.monotonic()``) to move
        the deadline to that time plus the limit (never earlier).
    """
    seconds = limit()
    if seconds is None:
        yield _still
        return
    _DOG.arm(seconds, what, why)
    try:
        yield _DOG.moved
    finally:
        _DOG.disarm()
