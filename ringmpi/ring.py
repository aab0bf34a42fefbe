"""The ring exchange: one K/V block in flight to the next rank while we compute.

Ranks form a periodic 1-D Cartesian communicator. At ring step s rank r holds
the block that rank (r - s) mod P started with. :class:`Ring` posts the receive
of the next block from the previous rank and the send of the current one to the
next rank, both non-blocking, so the transfer overlaps the tile compute.
:class:`KVRing` is the scaffolding both ring loops share: K and V packed in one
buffer, double-buffered, the next exchange posted before the compute of the
current block, and the communicator freed on exit (a context manager).
:class:`Exchanger` is the contract every exchanger implements (this module's
:class:`Ring` for host buffers, :class:`ringmpi.gpu.ring.GpuRing` for device
buffers); the ring loops (:mod:`ringmpi.attention`, :mod:`ringmpi.backward`)
use nothing else.

Progress: MPI libraries move a large (rendezvous) message only while some
call into the library runs, unless they have an asynchronous progress thread.
The tile loops therefore call ``test`` between blocks; ``RINGMPI_POLL=0``
turns this off, which is how the benefit is measured (see docs/design.md).

Every wait on a neighbour runs under :mod:`ringmpi.runtime.watchdog`.

Interrupts: ``test`` (the tiles' progress callback) and ``wait`` call
:func:`ringmpi.runtime.interrupt.check`, so a Ctrl-C recorded as a flag stops a ring
within one tile chunk; ``free(abandon=True)`` (the exit of an interrupted or
failed ring) cancels what is still in flight instead of waiting for a peer
that may never answer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any, Optional, Protocol, runtime_checkable

from mpi4py import MPI

from .runtime import faults, interrupt
from .runtime.watchdog import watch

__all__ = ["Exchanger", "Ring", "KVRing", "TAG_KV", "abandoned", "settle"]

TAG_KV = 7301
# seconds an abandoned ring waits for its cancelled transfers to settle
ABANDON_S = 2.0
# transfers that neither completed nor cancelled in time: kept referenced (with their
# buffers) so MPI never writes into freed memory; MPI_Finalize must not run with them
_ABANDONED: list = []
# communicators of abandoned rings, never freed: a peer that stopped at another step may
# have sent to this ring a message nobody will receive; freed, its context id could go to
# a later communicator, whose receives would then match that stale message
KEPT_COMMS: list = []


def abandoned() -> int:
    """Number of transfers an interrupted ring left in flight (0: MPI may finalize)."""
    return len(_ABANDONED)


def settle(requests: list, seconds: float = ABANDON_S) -> bool:
    """Complete or cancel ``requests`` within ``seconds``; True if none is left in flight.

    Three quarters of the time go to completing them (a peer that stopped in the
    same step finishes its side), then what is left is cancelled and the cancels
    get the rest. Requests still pending after that are kept referenced (see
    :func:`abandoned`), so MPI never writes into freed memory.

    Parameters
    ----------
    requests : list of mpi4py.MPI.Request
        The transfers of an exchange that is being abandoned.
    seconds : float
        The time they get in all (default ``ABANDON_S``).
    """
    end = time.monotonic() + seconds
    done = MPI.Request.Testall(requests)
    while not done and time.monotonic() < end - seconds / 4:
        done = MPI.Request.Testall(requests)
    if not done:
        for r in requests:
            try:
                r.Cancel()
            except MPI.Exception:
                pass
    while not done and time.monotonic() < end:
        done = MPI.Request.Testall(requests)
    if not done:
        _ABANDONED.extend(requests)
    return bool(done)


@runtime_checkable
class Exchanger(Protocol):
    """What the ring loops need from an exchanger (:class:`Ring`, ``GpuRing``).

    ``prev``/``next`` are the neighbour ranks; ``wait_s`` the seconds blocked in
    :meth:`wait`; ``polls`` and ``ticks`` count :meth:`test` calls that polled MPI
    and all of them. One exchange (the posts of one :meth:`start`) is completed by
    :meth:`wait` before the next may start.
    """

    prev: int
    next: int
    wait_s: float
    polls: int
    ticks: int

    def start(
        self,
        send_buf,
        recv_buf,
        tag: int = TAG_KV,
        dest: Optional[int] = None,
        source: Optional[int] = None,
    ) -> None:
        """Post the receive into ``recv_buf`` (from ``source``, default ``prev``) and the
        send of ``send_buf`` (to ``dest``, default ``next``); return at once."""

    def test(self) -> None:
        """Progress pending transfers without blocking; raise a recorded interrupt."""

    def wait(self) -> None:
        """Block until the posted exchange is complete (``recv_buf`` holds the block)."""

    def free(self, abandon: bool = False) -> None:
        """Finish (or, with ``abandon``, cancel within ABANDON_S) and release the ring."""


class Ring:
    """Non-blocking neighbour exchange on a periodic ring.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        Intra-communicator; its rank order is the ring order (no reordering,
        because token layouts are defined by the rank).
    """

    def __init__(self, comm: MPI.Comm):
        self.cart = comm.Create_cart([comm.Get_size()], periods=[True], reorder=False)
        self.prev, self.next = self.cart.Shift(0, 1)
        self.requests: list = []
        self.wait_s = 0.0
        self.polls = 0
        self.ticks = 0  # calls of test(): the tiles' progress callbacks
        self.poll = os.environ.get("RINGMPI_POLL", "1") != "0"

    def start(self, send_buf, recv_buf, tag: int = TAG_KV, dest=None, source=None) -> None:
        """Post receive of the next block and send of the current one.

        By default from the previous rank and to the next; ``dest``/``source``
        name other ranks (a block going straight home after an early stop).
        """
        src = self.prev if source is None else source
        dst = self.next if dest is None else dest
        self.requests.append(self.cart.Irecv(recv_buf, source=src, tag=tag))
        self.requests.append(self.cart.Isend(send_buf, dest=dst, tag=tag))

    def test(self) -> None:
        """Give MPI a chance to progress pending transfers (cheap, non-blocking).

        Also the place where a recorded Ctrl-C/SIGTERM is raised (:mod:`ringmpi.runtime.interrupt`).
        """
        self.ticks += 1
        if self.poll and self.requests:
            self.polls += 1
            MPI.Request.Testall(self.requests)
        interrupt.check()

    def wait(self) -> None:
        """Block until every posted transfer has completed (interruptible while catching)."""
        if self.requests:
            t0 = time.perf_counter()
            if interrupt.active():
                # poll instead of Waitall, which no signal can leave
                while not MPI.Request.Testall(self.requests):
                    interrupt.check()
            else:
                MPI.Request.Waitall(self.requests)
            self.wait_s += time.perf_counter() - t0
            self.requests = []

    def free(self, abandon: bool = False) -> None:
        """Release the Cartesian communicator.

        Normally pending transfers are completed first. With ``abandon`` (the
        ring stops early: an error or an interrupt, perhaps on the peers too)
        they get ``ABANDON_S`` seconds: three quarters to complete (a peer that
        stopped in the same step finishes its side), then they are cancelled;
        what is still in flight after that is kept referenced (see
        :func:`abandoned`) rather than waited for. An abandoned ring's communicator
        is kept, not freed (a peer may have sent it a message no one receives).
        """
        if abandon:
            settled = settle(self.requests) if self.requests else True
            self.requests = []
            if settled and self.cart != MPI.COMM_NULL:
                KEPT_COMMS.append(self.cart)  # not freed: see KEPT_COMMS
                self.cart = MPI.COMM_NULL
            return
        self.wait()
        if self.cart != MPI.COMM_NULL:
            self.cart.Free()


class LocalRing:
    """The exchanger of a ring of one rank: nothing to send, nothing to wait for."""

    prev = next = 0
    wait_s = 0.0
    polls = 0

    def __init__(self) -> None:
        self.ticks = 0

    def start(self, send_buf, recv_buf, tag: int = TAG_KV, dest=None, source=None) -> None:
        raise RuntimeError("a ring of one rank exchanges no block")

    def test(self) -> None:
        """Raise a recorded interrupt (the tiles' progress callback)."""
        self.ticks += 1
        interrupt.check()

    def wait(self) -> None:
        """Nothing was posted."""

    def free(self, abandon: bool = False) -> None:
        """Nothing to release."""


class KVRing:
    """K/V blocks travelling the ring; iterate to get each step's block.

    ``for step, src, k, v in kv:`` yields, at step s < nsteps, the block rank
    (rank - s) mod P started with, as (B, Hkv, count, Dk) and (B, Hkv, count, Dv)
    views of one packed buffer (K first, then V: B Hkv count (Dk + Dv) elements;
    keys and values may differ in width, issue 42). Before yielding, the exchange
    that brings step s+1's block into the other buffer is already posted; after the
    loop body, the exchange is waited for. Sizes are exact: blocks of different
    owners may differ by a token or two. Use as a context manager: the communicator
    is freed on exit, also on error.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
    backend : ringmpi.backend.Backend
        Gives the array module and the exchanger (``backend.ring``).
    k : (B, Hkv, S_local, Dk) ; v : (B, Hkv, S_local, Dv)
        This rank's keys and values in the tile layout (copied into the buffer).
    counts : list of int
        Tokens held by every rank.
    nsteps : int, optional
        Steps to run (default P); no block is sent for a step past the last.
    first : int, optional
        Start at this step (a resumed ring, the same on every rank): the block of
        rank (rank - first) mod P is fetched directly by one exchange shifted by
        ``first`` (send to rank + first, receive from rank - first), then the
        ring goes on as usual from step ``first``.
    """

    def __init__(self, comm, backend: Any, k, v, counts: list, nsteps=None, first: int = 0):
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.nsteps = self.size if nsteps is None else int(nsteps)
        self.first = int(first)
        self.counts = counts
        self.bytes_sent = 0
        b, hkv, s, dk = k.shape
        self.shape = (b, hkv, dk, int(v.shape[-1]))
        self.local = None
        if self.size == 1 and self.first == 0:  # a ring of one: nothing travels, no copy
            self.local, self.bufs, self.ring = (k, v), [], LocalRing()
            return
        size = self.span(max(counts))
        self.bufs = [backend.xp.empty(size, dtype=k.dtype) for _ in range(2)]
        first_k, first_v = self.parts(self.bufs[0], s)
        first_k[...] = k
        first_v[...] = v
        with watch("creating the ring communicator (Create_cart) with the other ranks"):
            self.ring = backend.ring(comm)
        if 0 < self.first < self.nsteps:
            self._fetch(s)

    def _fetch(self, count: int) -> None:
        """Bring the block of step ``first`` into its buffer: one exchange shifted by ``first``."""
        f = self.first
        src, dst = self.owner(f), (self.rank + f) % self.size
        n = self.span(count)
        if f % 2 == 0:  # step f computes on buffer 0, which holds ours: move ours aside
            self.bufs[1][:n] = self.bufs[0][:n]
        mine, into = self.bufs[(f + 1) % 2][:n], self.bufs[f % 2]
        self.ring.start(mine, into[: self.span(self.counts[src])], dest=dst, source=src)
        self.bytes_sent += mine.nbytes
        with watch(f"resuming at ring step {f}: the K/V block from rank {src}"):
            self.ring.wait()

    def span(self, count: int) -> int:
        """Elements of a packed block of ``count`` tokens: B Hkv count (Dk + Dv)."""
        b, hkv, dk, dv = self.shape
        return b * hkv * count * (dk + dv)

    def parts(self, buf, count: int) -> tuple:
        """The first ``count`` tokens' worth of a flat buffer as (K, V) views.

        K (B, Hkv, count, Dk) comes first, then V (B, Hkv, count, Dv); with Dk = Dv
        the layout is that of one (2, B, Hkv, count, D) array.
        """
        b, hkv, dk, dv = self.shape
        nk = b * hkv * count * dk
        kpart = buf[:nk].reshape(b, hkv, count, dk)
        vpart = buf[nk : nk + b * hkv * count * dv].reshape(b, hkv, count, dv)
        return kpart, vpart

    def owner(self, step: int) -> int:
        """Rank whose block this rank holds at ``step``."""
        return (self.rank - step) % self.size

    def __iter__(self) -> Iterator[tuple]:
        if self.local is not None:
            for step in range(self.nsteps):  # one step (or none)
                interrupt.check()
                faults.ring_step(self.rank, step)
                yield step, 0, self.local[0], self.local[1]
            return
        for step in range(self.first, self.nsteps):
            interrupt.check()
            faults.ring_step(self.rank, step)
            src = self.owner(step)
            cur, nxt = self.bufs[step % 2], self.bufs[(step + 1) % 2]
            if step + 1 < self.nsteps:
                send = cur[: self.span(self.counts[src])]
                recv = nxt[: self.span(self.counts[self.owner(step + 1)])]
                self.ring.start(send, recv)
                self.bytes_sent += send.nbytes
            kb, vb = self.parts(cur, self.counts[src])
            yield step, src, kb, vb
            with watch(f"ring step {step}: the K/V block from rank {self.ring.prev}"):
                self.ring.wait()

    def __enter__(self) -> KVRing:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.ring.free(abandon=True)  # do not wait for a peer that may have stopped too
        else:
            self.ring.free()
