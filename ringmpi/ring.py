"""The ring exchange: one K/V block in flight to the next rank while we compute.

Ranks form a periodic 1-D Cartesian communicator. At ring step s rank r holds
the block that rank (r - s) mod P started with; ``start`` posts the receive
of the next block from the previous rank and the send of the current one to
the next rank, both non-blocking, so the transfer overlaps the tile compute.

Progress: MPI libraries move a large (rendezvous) message only while some
call into the library runs, unless they have an asynchronous progress thread.
The tile loops therefore call ``test`` between blocks; ``RINGMPI_POLL=0``
turns this off, which is how the benefit is measured (see README).
"""

from __future__ import annotations

import os
import time

from mpi4py import MPI

__all__ = ["Ring", "TAG_KV"]

TAG_KV = 7301


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
        self.poll = os.environ.get("RINGMPI_POLL", "1") != "0"

    def start(self, send_buf, recv_buf, tag: int = TAG_KV) -> None:
        """Post receive of the next block and send of the current one."""
        self.requests.append(self.cart.Irecv(recv_buf, source=self.prev, tag=tag))
        self.requests.append(self.cart.Isend(send_buf, dest=self.next, tag=tag))

    def test(self) -> None:
        """Give MPI a chance to progress pending transfers (cheap, non-blocking)."""
        if self.poll and self.requests:
            self.polls += 1
            MPI.Request.Testall(self.requests)

    def wait(self) -> None:
        """Block until every posted transfer has completed."""
        if self.requests:
            t0 = time.perf_counter()
            MPI.Request.Waitall(self.requests)
            self.wait_s += time.perf_counter() - t0
            self.requests = []

    def free(self) -> None:
        """Release the Cartesian communicator (pending transfers are completed first)."""
        self.wait()
        if self.cart != MPI.COMM_NULL:
            self.cart.Free()
