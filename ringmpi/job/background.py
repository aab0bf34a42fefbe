"""The batch job's background reads: a daemon thread per read, and a sure exit when one sticks.

A read stuck in the file system (a hung NFS server) must neither keep the
process alive at exit nor block a SIGTERM: :func:`in_background` runs each read
in a daemon thread, and :func:`abandon` makes sure the process still ends when
such a read is left behind.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future

__all__ = ["in_background", "abandon"]


def in_background(fn, *args) -> Future:
    """Call ``fn(*args)`` in a new daemon thread; its Future (result or exception).

    A daemon thread, not a ThreadPoolExecutor's worker: those are joined when the
    interpreter exits, so a read stuck in the file system would keep the process
    (and the MPI job) alive forever after a SIGTERM.
    """
    fut: Future = Future()

    def work():
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            fut.set_exception(e)

    threading.Thread(target=work, name="ringmpi-read", daemon=True).start()
    return fut


def abandon(code: int, pending: list, grace: float = 30.0) -> None:
    """Reads are left running, maybe stuck in HDF5: make sure the process still ends.

    A stuck reader holds h5py's global lock, so freeing any h5py object at
    interpreter exit (or in a garbage collection) would wait for it forever. While
    a read of ``pending`` is unfinished, the process ends at exit with
    ``os._exit(code)`` (stdout and stderr flushed) before those objects are
    collected, and a daemon timer does the same after ``grace`` seconds should the
    main thread get stuck on the lock first. Once the reads have finished, neither
    does anything.

    Parameters
    ----------
    code : int
        The exit status (128 + the signal number after a SIGTERM/SIGINT).
    pending : list of concurrent.futures.Future
        The reads left running.
    grace : float
        Seconds before the timer ends the process regardless.
    """
    import atexit
    import sys

    def bye():
        if all(f.done() for f in pending):
            return
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)

    atexit.register(bye)
    timer = threading.Timer(grace, bye)
    timer.daemon = True
    timer.start()
