"""Both exchangers through one contract: ringmpi.ring.Ring and GpuRing on the CuPy stand-in.

GpuRing runs on tests/tools/fakecupy (host memory, no CUDA): staged (pinned
buffers, deferred copies on the copy stream) and CUDA-aware (device buffers to
MPI). The same protocol calls (start with and without dest/source, test, wait,
free and free(abandon=True)) run on Ring with numpy buffers, at any P.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from tools import standin

from ringmpi.ring import Exchanger, Ring
from ringmpi.testing import assert_all


@pytest.fixture(scope="module")
def cupy():
    """The CuPy stand-in, for this module only (not a GPU: see tests/tools/standin.py)."""
    with standin.installed() as cp:
        yield cp


# (name, RINGMPI_CUDA_AWARE): the host ring, then the GPU ring staged and CUDA-aware
KINDS = [("Ring", None), ("GpuRing staged", "0"), ("GpuRing CUDA-aware", "1")]


def make(kind, aware, comm, cupy, monkeypatch):
    """(exchanger, array module) of one kind."""
    if aware is None:
        return Ring(comm), np
    from ringmpi.gpu.ring import GpuRing

    monkeypatch.setenv("RINGMPI_CUDA_AWARE", aware)
    ring = GpuRing(comm)
    assert ring.cuda_aware == (aware == "1")
    return ring, cupy


def test_both_rings_have_the_contract_signatures():
    from ringmpi.gpu.ring import GpuRing

    for name in ("start", "test", "wait", "free"):
        want = inspect.signature(getattr(Exchanger, name))
        for cls in (Ring, GpuRing):
            got = inspect.signature(getattr(cls, name))
            assert list(got.parameters) == list(want.parameters), f"{cls.__name__}.{name}{got}"
            for p, q in zip(got.parameters.values(), want.parameters.values()):
                assert p.default == q.default and p.kind == q.kind, f"{cls.__name__}.{name}: {p}"


def exchange(ring, xp, comm, n, dest=None, source=None, tag=7301):
    """One exchange of a rank-stamped block; the block received (numpy)."""
    # values shaped like data: a mean per rank, a small spread
    base = 100.0 + comm.rank + 1e-3 * np.arange(n)
    send = xp.asarray(base.astype(np.float32))
    recv = xp.full(n, -1.0, dtype=np.float32)
    ring.start(send, recv, tag=tag, dest=dest, source=source)
    ring.test()
    ring.test()
    ring.wait()
    got = recv.get() if xp is not np else recv
    return got


def expected(rank, n):
    return (100.0 + rank + 1e-3 * np.arange(n)).astype(np.float32)


@pytest.mark.parametrize("kind, aware", KINDS)
def test_exchange_contract_one_process(kind, aware, cupy, monkeypatch):
    """On COMM_SELF every exchange comes back to the sender, through the whole protocol."""
    from mpi4py import MPI

    comm = MPI.COMM_SELF
    ring, xp = make(kind, aware, comm, cupy, monkeypatch)
    assert isinstance(ring, Exchanger) and (ring.prev, ring.next) == (0, 0)
    for n in (1, 4097, 300):  # growing and shrinking buffers (staging slots are reused)
        got = exchange(ring, xp, comm, n)
        assert np.array_equal(got, expected(0, n)), f"{kind}: wrong block"
    got = exchange(ring, xp, comm, 33, dest=0, source=0, tag=7302)
    assert np.array_equal(got, expected(0, 33)), f"{kind}: dest/source"
    assert ring.ticks >= 8 and ring.wait_s >= 0.0
    if aware is not None:  # GpuRing's overlap report: one row per exchange
        rep = ring.overlap_report()
        assert rep["steps"] == 4 and rep["cuda_aware"] == (aware == "1"), rep
        assert 0.0 <= rep["hidden_fraction"] <= 1.0 and rep["exchange_s"] >= 0.0, rep
        assert [r["bytes"] for r in rep["per_step"]] == [4, 4 * 4097, 4 * 300, 4 * 33]
    ring.free()


@pytest.mark.mpi
@pytest.mark.parametrize("kind, aware", KINDS)
def test_exchange_contract(comm, kind, aware, cupy, monkeypatch):
    """Neighbour exchange, then dest/source two ranks away (the backward ring's last hop)."""
    ring, xp = make(kind, aware, comm, cupy, monkeypatch)
    r, p = comm.rank, comm.size
    ok = isinstance(ring, Exchanger) and ring.prev == (r - 1) % p and ring.next == (r + 1) % p
    assert_all(comm, ok, f"{kind}: neighbours {ring.prev}, {ring.next}")
    for n in (5000, 17):
        got = exchange(ring, xp, comm, n)
        assert_all(comm, np.array_equal(got, expected((r - 1) % p, n)), f"{kind}: n={n}")
    got = exchange(ring, xp, comm, 64, dest=(r + 2) % p, source=(r - 2) % p, tag=7302)
    assert_all(comm, np.array_equal(got, expected((r - 2) % p, 64)), f"{kind}: dest/source")
    ring.free()


@pytest.mark.mpi
@pytest.mark.parametrize("kind, aware", KINDS)
def test_free_abandon_cancels_a_pending_exchange(comm, kind, aware, cupy, monkeypatch):
    """Every rank stops with an exchange posted: free(abandon=True) returns, nothing leaks."""
    from ringmpi import ring as ring_mod

    ring, xp = make(kind, aware, comm, cupy, monkeypatch)
    before = ring_mod.abandoned()
    send, recv = xp.zeros(1 << 16, dtype=np.float32), xp.zeros(1 << 16, dtype=np.float32)
    ring.start(send, recv)
    ring.free(abandon=True)  # the peers do the same: the transfers complete or cancel
    assert_all(comm, ring_mod.abandoned() == before, f"{kind}: transfers left in flight")
    comm.Barrier()
    # the communicator is usable again: a fresh ring exchanges normally
    ring, xp = make(kind, aware, comm, cupy, monkeypatch)
    got = exchange(ring, xp, comm, 8)
    ring.free()
    assert_all(comm, np.array_equal(got, expected((comm.rank - 1) % comm.size, 8)), kind)


@pytest.mark.mpi
@pytest.mark.parametrize("kind, aware", KINDS)
def test_free_abandon_alone_is_bounded(comm, kind, aware, cupy, monkeypatch):
    """Only rank 0 posts an exchange (its peers stopped before): free(abandon=True) still
    returns within ABANDON_S; the staged ring never posts a send whose copy is pending."""
    import time

    from ringmpi import ring as ring_mod

    ring, xp = make(kind, aware, comm, cupy, monkeypatch)
    if comm.rank == 0:
        ring.start(xp.zeros(16, dtype=np.float32), xp.zeros(16, dtype=np.float32))
        if aware == "0":
            assert ring._unsent is not None  # its copy has not been seen to finish yet
    t0 = time.monotonic()
    ring.free(abandon=True)
    took = time.monotonic() - t0
    assert_all(comm, took < ring_mod.ABANDON_S + 1.0, f"{kind}: free(abandon) took {took:.1f} s")
    assert_all(comm, not ring.requests, f"{kind}: requests kept on the ring")
    comm.Barrier()
    # rank 0's message to rank 1 was never received: a later ring must not get it
    for _ in range(3):
        ring, xp = make(kind, aware, comm, cupy, monkeypatch)
        got = exchange(ring, xp, comm, 16)
        ring.free()
        want = expected((comm.rank - 1) % comm.size, 16)
        assert_all(comm, np.array_equal(got, want), f"{kind}: a later ring got stale data")


def test_staged_ring_waits_for_its_copy(cupy, monkeypatch):
    """The staged send is posted only once the device-to-host copy has run.

    The stand-in defers copies on the copy stream: a send posted before the copy's
    event completed would carry the pinned buffer's stale bytes.
    """
    from mpi4py import MPI

    ring, xp = make("GpuRing staged", "0", MPI.COMM_SELF, cupy, monkeypatch)
    ring.reserve(4 * 1000)
    allocs = cupy.cuda.pinned_allocations[0]
    send = xp.asarray(np.linspace(5.0, 6.0, 1000, dtype=np.float32))
    recv = xp.zeros(1000, dtype=np.float32)
    ring.start(send, recv)
    assert ring._unsent is not None, "the send went out before its copy could have finished"
    ring.test()  # first query of the copy event: still in flight, no send yet
    assert ring._unsent is not None
    ring.wait()
    assert np.array_equal(recv.get(), np.linspace(5.0, 6.0, 1000, dtype=np.float32))
    assert cupy.cuda.pinned_allocations[0] == allocs, "start allocated pinned memory"
    ring.free()


def test_staged_ring_never_hands_mpi_a_device_buffer(cupy, monkeypatch):
    """A device buffer given to a non-CUDA-aware MPI is refused by the stand-in."""
    from mpi4py import MPI

    from ringmpi.gpu.ring import GpuRing

    monkeypatch.setenv("RINGMPI_CUDA_AWARE", "0")
    ring = GpuRing(MPI.COMM_SELF)
    ring.cuda_aware = True  # the wrong path for this MPI
    buf = cupy.zeros(8, dtype=np.float32)
    with pytest.raises(TypeError, match="RINGMPI_CUDA_AWARE"):
        ring.start(buf, cupy.zeros(8, dtype=np.float32))
    ring.requests, ring._cur = [], None
    ring.free()
