"""Ctrl-C and SIGTERM as a flag: noticed between tiles and ring steps, never raised inside a kernel.

Python's default SIGINT handler raises KeyboardInterrupt at whatever bytecode
the main thread runs next. Inside the ctypes progress callback of a C kernel
that can be before the callback's ``try``: ctypes then prints "Exception
ignored on calling ctypes callback function" and the kernel carries on, so the
Ctrl-C is lost. While :func:`catching` is active the handler only records the
signal; :func:`check`, called from every tile's progress callback (through
:meth:`ringmpi.ring.Ring.test`), from the ring waits and between ring steps,
raises :class:`Interrupted` (a KeyboardInterrupt) where raising is safe.

The library (``ring_attention``, ``ring_attention_backward``) catches SIGINT
this way for the duration of a call when the default handler is in place; the
``ringmpi run`` command catches SIGINT and SIGTERM for the whole job.

Python runs signal handlers only when the main thread executes bytecode, so a
rank blocked inside one C call (an MPI collective whose peer is gone, a parallel
HDF5 call) would never see the signal, and a launcher's SIGTERM would be
swallowed. A backstop covers that: while signals are caught, the C-level wakeup
fd wakes a daemon thread at the moment a signal arrives; if the signal has not
been raised at a safe point within ``RINGMPI_INTERRUPT_GRACE_S`` seconds (default
30; 0 disables), the thread prints one line and ends the process with 128 +
signal number. (A thread cannot run while the main thread holds the GIL inside
a C call that does not release it; the watchdog's timer covers those waits.)
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Optional

__all__ = ["Interrupted", "catching", "active", "pending", "check", "clear", "grace", "GRACE_ENV"]

GRACE_ENV = "RINGMPI_INTERRUPT_GRACE_S"
DEFAULT_GRACE_S = 30.0


class Interrupted(KeyboardInterrupt):
    """A SIGINT or SIGTERM noticed at a safe point.

    Attributes
    ----------
    signum : int
        The signal (``signal.SIGINT`` or ``signal.SIGTERM``).
    where : str
        Filled in by whoever knows where the work stood (e.g. the batch job:
        "sequence 2/5 (seq001), ring step 1/4"); empty otherwise.
    """

    def __init__(self, signum: int, where: str = ""):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)
        self.where = where

    @property
    def exit_status(self) -> int:
        """The shell convention: 128 + signal number (130 SIGINT, 143 SIGTERM)."""
        return 128 + self.signum


_lock = threading.Lock()
_flag: Optional[int] = None  # first signal received and not yet raised
_saved: dict = {}  # signum -> handler we replaced
_depth: dict = {}  # signum -> nesting depth of catching()
_handled_at: Optional[float] = None  # when our handler last ran (monotonic)


def _handler(signum, _frame) -> None:
    global _flag, _handled_at
    _handled_at = time.monotonic()
    if _flag is None:
        _flag = signum


def _replaceable(handler) -> bool:
    """Only Python's defaults are replaced: a program's own handler is left alone."""
    return handler in (signal.default_int_handler, signal.SIG_DFL, None)


def grace() -> Optional[float]:
    """Seconds from ``RINGMPI_INTERRUPT_GRACE_S`` (default 30), or None when off (0)."""
    return _grace()


def _grace() -> Optional[float]:
    text = os.environ.get(GRACE_ENV, "").strip()
    try:
        value = float(text) if text else DEFAULT_GRACE_S
    except ValueError:
        value = DEFAULT_GRACE_S
    return value if value > 0 else None


class _Backstop:
    """A signal not raised at a safe point within the grace period ends the process."""

    def __init__(self):
        self.fds: Optional[tuple] = None
        self.done = threading.Event()

    def start(self) -> None:
        """Main thread, when catching begins: take the wakeup fd unless someone has it."""
        grace = _grace()
        if grace is None or self.fds is not None:
            return
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            old = None
        if old != -1:  # failed, or an event loop owns it: leave theirs in place
            if old is not None:
                signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            return
        self.fds, self.done = (r, w), threading.Event()
        t = threading.Thread(
            target=self._run,
            args=(r, grace, self.done),
            daemon=True,
            name="ringmpi-interrupt-backstop",
        )
        t.start()

    def stop(self) -> None:
        """Main thread, when catching ends: give the wakeup fd back, end the thread."""
        if self.fds is None:
            return
        signal.set_wakeup_fd(-1)
        self.done.set()
        r, w = self.fds
        self.fds = None
        os.close(w)  # the thread's read returns b"" and it closes r

    @staticmethod
    def _run(r: int, grace: float, done: threading.Event) -> None:
        try:
            while True:
                data = os.read(r, 64)
                if not data or done.is_set():
                    return
                # only the signals recorded by our handler (a program's own handler for
                # another signal also writes to the wakeup fd)
                sigs = [
                    b
                    for b in data
                    if b in (signal.SIGINT, signal.SIGTERM) and signal.getsignal(b) is _handler
                ]
                if not sigs:
                    continue
                t0 = time.monotonic()
                while not _acted(t0):
                    if done.wait(0.1):
                        return
                    if time.monotonic() - t0 > grace:
                        _give_up(sigs[0], grace)
        except OSError:
            return
        finally:
            try:
                os.close(r)
            except OSError:
                pass


def _acted(t_read: float) -> bool:
    """Has the main thread run our handler for a signal read at ``t_read`` and raised it?

    The handler runs in the main thread within milliseconds of the signal unless
    that thread is stuck in C; it may run just before the backstop reads the byte,
    hence the second of slack.
    """
    return _flag is None and _handled_at is not None and _handled_at >= t_read - 1.0


def _give_up(signum: int, grace: float) -> None:
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        rank = mpi.COMM_WORLD.Get_rank() if mpi is not None else 0
    except Exception:  # noqa: BLE001 - best effort in a dying process
        rank = "?"
    name = signal.Signals(signum).name
    sys.stderr.write(
        f"ringmpi: {name} not acted on within {grace:g} s: rank {rank} is inside a call that "
        f"cannot stop safely (MPI, I/O); exiting now without cleanup ({GRACE_ENV}={grace:g})\n"
    )
    sys.stderr.flush()
    os._exit(128 + signum)


_BACKSTOP = _Backstop()


@contextmanager
def catching(signals=(signal.SIGINT,)):
    """Record ``signals`` as a flag for the duration of the block (main thread only; nests).

    On leaving the block without an exception, a signal that arrived after the
    last :func:`check` is raised as :class:`Interrupted`, so it is never lost.
    Outside the main thread (where Python cannot install handlers) this does
    nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    mine = []
    with _lock:
        first = not any(_depth.values())
        for s in signals:
            if _depth.get(s, 0) > 0:
                _depth[s] += 1
                mine.append(s)
                continue
            old = signal.getsignal(s)
            if _replaceable(old):
                _saved[s] = old
                signal.signal(s, _handler)
                _depth[s] = 1
                mine.append(s)
        if first and mine:
            _BACKSTOP.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        with _lock:
            for s in mine:
                _depth[s] -= 1
                if _depth[s] == 0:
                    signal.signal(s, _saved.pop(s))
            if mine and not any(_depth.values()):
                _BACKSTOP.stop()
        if ok and not any(_depth.get(s, 0) for s in mine):
            check()


def active() -> bool:
    """True while some signal is being caught as a flag."""
    return any(_depth.values())


def pending() -> Optional[int]:
    """The signal number recorded and not yet raised, or None."""
    return _flag


def clear() -> None:
    """Forget a recorded signal (tests)."""
    global _flag
    _flag = None


def check() -> None:
    """Raise :class:`Interrupted` if a signal was recorded (and forget it)."""
    global _flag
    s = _flag
    if s is not None:
        _flag = None
        raise Interrupted(s)
