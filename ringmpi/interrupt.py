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
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Optional

__all__ = ["Interrupted", "catching", "active", "pending", "check", "clear"]


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


def _handler(signum, _frame) -> None:
    global _flag
    if _flag is None:
        _flag = signum


def _replaceable(handler) -> bool:
    """Only Python's defaults are replaced: a program's own handler is left alone."""
    return handler in (signal.default_int_handler, signal.SIG_DFL, None)


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
