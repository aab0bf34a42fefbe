"""The tests' fault-injection seam: the one place a run can be made to fail on purpose.

Each point where a test breaks a run (a rank that raises in the ring, a rank killed after
a sequence, inside a batch, after a checkpoint step or mid-write, a read stuck in the file
system) calls one function here. The function reads its test variable
through the environment registry (:mod:`ringmpi.runtime.env`, where each is documented)
and does nothing when it is unset, which is always the case outside the tests. No other
module reads these variables.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from . import env

__all__ = [
    "RING_STEP",
    "KILL_AFTER",
    "KILL_IN_BATCH",
    "KILL_AT_STEP",
    "MPIO_KILL",
    "READ_STALL",
    "RING_DONE_STALL",
    "ring_step",
    "sequences_done",
    "batch_read",
    "checkpoint_step",
    "rows_written",
    "read",
    "ring_done",
]

RING_STEP = "RINGMPI_TEST_FAULT"
KILL_AFTER = "RINGMPI_TEST_KILL_AFTER"
KILL_IN_BATCH = "RINGMPI_TEST_KILL_IN_BATCH"
KILL_AT_STEP = "RINGMPI_TEST_KILL_AT_STEP"
MPIO_KILL = "RINGMPI_TEST_MPIO_KILL"
READ_STALL = "RINGMPI_TEST_READ_STALL_S"
RING_DONE_STALL = "RINGMPI_TEST_RING_DONE_STALL"


def _kill(sig: int = signal.SIGKILL) -> None:
    os.kill(os.getpid(), sig)


def ring_step(rank: int, step: int) -> None:
    """``RANK:STEP``: that rank raises RuntimeError before that ring step."""
    spec = env.get(RING_STEP)
    if spec:
        r, s = (int(t) for t in spec.split(":"))
        if r == rank and s == step:
            raise RuntimeError(f"injected fault on rank {rank} at ring step {step}")


def sequences_done(rank: int, completed: int) -> None:
    """``n``: rank 0 SIGKILLs itself once ``completed`` sequences of this run are written."""
    n = env.get(KILL_AFTER)
    if rank == 0 and n is not None and completed >= int(n):
        _kill()


def batch_read(rank: int, j: int) -> None:
    """``j``: rank 0 SIGKILLs itself once batch ``j`` (0-based) is read, before computing it."""
    n = env.get(KILL_IN_BATCH)
    if rank == 0 and n is not None and j == int(n):
        _kill()


def checkpoint_step(ring, rank: int, seq: int, done: int) -> None:
    """``SEQ:STEP``: after ring step STEP of sequence SEQ, ring rank 0 SIGKILLs itself.

    The ring (an MPI communicator, or None for one rank) first passes a barrier, so every
    rank's checkpoint of that step is on disk. ``SEQ:STEP:TERM`` sends SIGTERM to every
    rank of the ring instead (as mpiexec forwards it).
    """
    spec = env.get(KILL_AT_STEP)
    if not spec:
        return
    i, s, *how = spec.split(":")
    if int(i) == seq and int(s) == done:
        if ring is not None:
            ring.Barrier()
        if how == ["TERM"]:
            _kill(signal.SIGTERM)
        elif rank == 0:
            _kill()


def rows_written(rank: int, i: int) -> None:
    """``i``: rank 0 SIGKILLs itself after writing sequence ``i``'s rows of a one-file
    output, before the flush and the marker (a crash mid-sequence)."""
    n = env.get(MPIO_KILL)
    if rank == 0 and n is not None and int(n) == i:
        _kill()


def read(rank: int) -> None:
    """``[RANK:]S``: each input read blocks S seconds (only on ring rank RANK if given).

    It holds h5py's global lock while it sleeps, as a read stuck inside HDF5 (a hung file
    system) does.
    """
    text = (env.get(READ_STALL) or "").strip()
    if not text:
        return
    who, _, secs = text.rpartition(":")
    if who and int(who) != rank:
        return
    from h5py._objects import phil

    with phil:
        time.sleep(float(secs))


def ring_done(rank: int, j: int) -> None:
    """``RANK:J:S``: after batch ``J``'s ring, ring rank RANK waits S seconds before the
    agreement that follows it (a slow rank: the others wait for it in that agreement).

    It says so on stderr (``ringmpi test: stalling``) and notices Ctrl-C and SIGTERM while
    it waits, as the ring's own waits do.
    """
    spec = env.get(RING_DONE_STALL)
    if not spec:
        return
    r, i, secs = spec.split(":")
    if int(r) != rank or int(i) != j:
        return
    from . import interrupt

    sys.stderr.write(f"ringmpi test: stalling rank {rank} for {secs} s after batch {j}\n")
    sys.stderr.flush()
    end = time.monotonic() + float(secs)
    while time.monotonic() < end:
        interrupt.check()
        time.sleep(0.01)
