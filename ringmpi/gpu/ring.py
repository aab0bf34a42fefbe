"""The GPU ring: device binding, CUDA-aware MPI detection, and the exchange of device buffers.

With CUDA-aware MPI the device buffers go to MPI directly once the producing stream
is synchronised; otherwise they are staged through pinned host buffers with
asynchronous copies on a private stream that overlap the step's kernel
(:class:`GpuRing`). CuPy is imported lazily.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Optional

import numpy as np

from ..runtime import interrupt
from .tile import kernel_names

__all__ = ["GpuRing", "bind_device", "cuda_aware", "info", "TAG_KV"]


def bind_device(comm) -> int:
    """Make GPU (node-local rank mod device count) current for this rank; return its id."""
    import cupy
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    rank = local.Get_rank()
    local.Free()
    count = cupy.cuda.runtime.getDeviceCount()
    if count < 1:
        raise RuntimeError("bind_device: no CUDA device visible")
    dev = rank % count
    cupy.cuda.Device(dev).use()
    return dev


def _mpi_libraries() -> list:
    """ctypes handles that may hold the MPI symbols: the process, then libmpi* mapped in it."""
    libs = [ctypes.CDLL(None)]
    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if "libmpi" in ln and ".so" in ln}
    except OSError:  # not Linux
        paths = set()
    for p in sorted(paths):
        try:
            libs.append(ctypes.CDLL(p))
        except OSError:
            pass
    return libs


def cuda_aware() -> Optional[bool]:
    """Whether MPI can read and write device buffers; None when the library cannot tell.

    ``RINGMPI_CUDA_AWARE=0|1`` overrides. Otherwise mpi4py's own query is used
    if it has one, then ``MPIX_Query_cuda_support`` (Open MPI, MPICH >= 4)
    through ctypes on the loaded MPI library.
    """
    env = os.environ.get("RINGMPI_CUDA_AWARE", "").strip()
    if env:
        if env not in ("0", "1"):
            raise ValueError(f"RINGMPI_CUDA_AWARE must be 0 or 1, not {env!r}")
        return env == "1"
    from mpi4py import MPI

    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        return bool(query())
    for lib in _mpi_libraries():
        fn = getattr(lib, "MPIX_Query_cuda_support", None)
        if fn is not None:
            fn.restype = ctypes.c_int
            return bool(fn())
    return None


def info() -> dict:
    """Facts for ``ringmpi info``: CuPy version, device, CUDA runtime, CUDA-aware MPI."""
    out: dict = {"cupy": None, "device": None, "device_id": None, "compute_capability": None}
    out["cuda_runtime"] = None
    try:
        import cupy

        out["cupy"] = cupy.__version__
        out["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        if cupy.cuda.runtime.getDeviceCount() > 0:
            dev = cupy.cuda.Device()
            props = cupy.cuda.runtime.getDeviceProperties(dev.id)
            name = props["name"]
            out["device"] = name.decode() if isinstance(name, bytes) else str(name)
            out["device_id"] = dev.id
            out["compute_capability"] = dev.compute_capability
    except Exception as exc:  # no CuPy, no driver, no device: report, do not fail
        out["error"] = f"{type(exc).__name__}: {exc}"
    try:
        out["cuda_aware"] = cuda_aware()
    except Exception as exc:
        out["cuda_aware"] = None
        out.setdefault("error", f"{type(exc).__name__}: {exc}")
    out["kernels"] = len(kernel_names())
    return out


TAG_KV = 7301  # ringmpi.ring.TAG_KV (that module imports mpi4py.MPI; this one lazily)
_MAX_RECORDS = 4096
# pinned buffers of exchanges an abandoned ring could not settle: MPI may still touch them
_KEEP: list = []


class GpuRing:
    """Non-blocking neighbour exchange of device buffers on a periodic ring.

    Implements :class:`ringmpi.ring.Exchanger`, like :class:`ringmpi.ring.Ring`
    (``start`` with ``dest``/``source``, ``test``, ``wait``, ``free(abandon=)``,
    ``wait_s``, ``polls``, ``ticks``); one exchange is in flight at a time.

    CUDA-aware MPI: ``start`` synchronises the current stream (the producer of
    the send buffer and the last reader of the receive buffer) and hands both
    device buffers to MPI.

    Staged (no CUDA-aware MPI): ``start`` records an event on the current
    (compute) stream, enqueues the device-to-host copy of the send buffer on a
    private copy stream behind that event and posts the receive into a pinned
    host buffer; it returns at once, so the copy runs while the step's kernel
    computes. The send is posted as soon as the copy has finished: ``test``
    (called between tile blocks) polls the copy's event, ``wait`` blocks on it.
    ``wait`` completes the transfers and enqueues the host-to-device upload on
    the copy stream; the current stream waits for it. Two pairs of pinned
    buffers alternate, so a receive never lands in a buffer an upload is still
    reading; :meth:`reserve` allocates them ahead (an allocation of pinned memory
    synchronises the device, so it should not happen inside a timed step).

    Interrupts and errors: ``test`` and ``wait`` raise a recorded Ctrl-C
    (:mod:`ringmpi.runtime.interrupt`); ``free(abandon=True)`` posts no staged send that
    is still waiting for its copy and cancels the transfers in flight, as
    :meth:`ringmpi.ring.Ring.free` does.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        A 1-D periodic Cartesian communicator (used as is) or any
        intra-communicator (a ring in rank order is made from it).
    """

    def __init__(self, comm):
        import cupy
        from mpi4py import MPI

        self._MPI = MPI
        if isinstance(comm, MPI.Cartcomm) and comm.Get_dim() == 1:
            self.cart, self._own = comm, False
        else:
            self.cart = comm.Create_cart([comm.Get_size()], periods=[True], reorder=False)
            self._own = True
        self.prev, self.next = self.cart.Shift(0, 1)
        self.cuda_aware = bool(cuda_aware())
        self.requests: list = []
        self.wait_s = 0.0
        self.polls = 0
        self.ticks = 0
        self.poll = os.environ.get("RINGMPI_POLL", "1") != "0"
        self._copy = cupy.cuda.Stream(non_blocking=True)
        # per slot: [send host buffer, recv host buffer, event of the last upload out of it]
        self._slots = [[None, None, None], [None, None, None]]
        self._slot = 0
        self._unsent = None  # (copy-done event, host send buffer, dest, tag) until the Isend
        self._pending = None  # (device recv buffer, host recv buffer, slot) to upload after wait
        self._cur = None  # record of the exchange in flight
        self.records: list = []
        # common clock: an event that completed at host time _t0
        self._ev0 = cupy.cuda.Event()
        self._ev0.record()
        self._ev0.synchronize()
        self._t0 = time.perf_counter()

    def reserve(self, nbytes: int) -> None:
        """Allocate both pairs of pinned staging buffers for exchanges up to ``nbytes``.

        Parameters
        ----------
        nbytes : int
            Size of the largest send or receive buffer to come (a no-op when
            CUDA-aware: MPI then reads and writes the device buffers).
        """
        if not self.cuda_aware:
            for slot in self._slots:
                self._alloc(slot, nbytes)

    @staticmethod
    def _alloc(slot: list, nbytes: int) -> None:
        import cupy

        if slot[0] is None or slot[0].nbytes < nbytes:
            mk = cupy.cuda.alloc_pinned_memory
            slot[0] = np.frombuffer(mk(nbytes), dtype=np.uint8, count=nbytes)
            slot[1] = np.frombuffer(mk(nbytes), dtype=np.uint8, count=nbytes)

    def _host_buffers(self, nbytes: int):
        """Pinned (send, recv) buffers of the next slot, free for a new exchange."""
        slot = self._slots[self._slot]
        if slot[2] is not None:
            slot[2].synchronize()  # the upload out of this recv buffer (two exchanges ago)
            slot[2] = None
        if slot[0] is None or slot[0].nbytes < nbytes:
            for other in self._slots:  # both pairs at once: one allocation pause, not two
                if other is not slot and other[2] is not None:
                    other[2].synchronize()
                    other[2] = None
                self._alloc(other, nbytes)
        return slot[0], slot[1]

    def start(
        self,
        send_buf,
        recv_buf,
        tag: int = TAG_KV,
        dest: Optional[int] = None,
        source: Optional[int] = None,
    ) -> None:
        """Post the receive of the next block and the send of ``send_buf``.

        Parameters
        ----------
        send_buf, recv_buf : cupy.ndarray
            Contiguous device buffers (any dtype); ``send_buf`` is produced by work
            already enqueued on the current stream.
        tag : int
        dest, source : int, optional
            Ranks of ``cart`` to send to and receive from (default ``next`` and
            ``prev``; the backward ring's last hop sends every block straight home).
        """
        import cupy
        from cupy.cuda import runtime

        if self._cur is not None:
            raise RuntimeError("GpuRing.start: the previous exchange has not been waited for")
        MPI = self._MPI
        src = self.prev if source is None else source
        dst = self.next if dest is None else dest
        stream = cupy.cuda.get_current_stream()
        ev_post = cupy.cuda.Event()
        ev_post.record(stream)  # everything that produces send_buf is before this event
        t_post = time.perf_counter()
        if self.cuda_aware:
            # the producer of send_buf and the last reader of recv_buf run on this stream
            stream.synchronize()
            self.requests.append(self.cart.Irecv([recv_buf, MPI.BYTE], src, tag))
            self.requests.append(self.cart.Isend([send_buf, MPI.BYTE], dst, tag))
        else:
            hs, hr = self._host_buffers(max(send_buf.nbytes, recv_buf.nbytes))
            self.requests.append(self.cart.Irecv([hr[: recv_buf.nbytes], MPI.BYTE], src, tag))
            self._copy.wait_event(ev_post)
            d2h = runtime.memcpyDeviceToHost
            runtime.memcpyAsync(
                hs.ctypes.data, send_buf.data.ptr, send_buf.nbytes, d2h, self._copy.ptr
            )
            copied = cupy.cuda.Event(block=False, disable_timing=True)
            copied.record(self._copy)
            self._unsent = (copied, hs[: send_buf.nbytes], dst, tag)
            self._pending = (recv_buf, hr, self._slot)
            self._slot ^= 1
        self._cur = {"t_post": t_post, "ev_post": ev_post, "bytes": int(send_buf.nbytes)}

    def _post_send(self, block: bool) -> None:
        """Post the staged Isend once its device-to-host copy is complete."""
        copied, hs, dst, tag = self._unsent
        if block:
            copied.synchronize()
        elif not copied.done:
            return
        self.requests.append(self.cart.Isend([hs, self._MPI.BYTE], dst, tag))
        self._unsent = None
        if self._cur is not None:
            self._cur["t_send"] = time.perf_counter()

    def test(self) -> None:
        """Give MPI a chance to progress pending transfers (cheap, non-blocking).

        Also the place where a recorded Ctrl-C/SIGTERM is raised (:mod:`ringmpi.runtime.interrupt`).
        """
        self.ticks += 1
        if self._unsent is not None:
            self._post_send(block=False)
        if self.poll and self.requests:
            self.polls += 1
            self._MPI.Request.Testall(self.requests)
        interrupt.check()

    def wait(self) -> None:
        """Complete the exchange; recv_buf then holds the block (in current-stream order)."""
        import cupy
        from cupy.cuda import runtime

        if self._cur is None and not self.requests:
            return
        stream = cupy.cuda.get_current_stream()
        ev_wait = cupy.cuda.Event()
        ev_wait.record(stream)  # end of the compute enqueued while the exchange was in flight
        t0 = time.perf_counter()
        if self._unsent is not None:
            self._post_send(block=True)
        if interrupt.active():  # poll instead of Waitall, which no signal can leave
            while not self._MPI.Request.Testall(self.requests):
                interrupt.check()
        else:
            self._MPI.Request.Waitall(self.requests)
        t_done = time.perf_counter()
        self.wait_s += t_done - t0
        self.requests = []
        if self._pending is not None:
            recv_buf, hr, slot = self._pending
            self._pending = None
            runtime.memcpyAsync(
                recv_buf.data.ptr,
                hr.ctypes.data,
                recv_buf.nbytes,
                runtime.memcpyHostToDevice,
                self._copy.ptr,
            )
            uploaded = cupy.cuda.Event(block=False, disable_timing=True)
            uploaded.record(self._copy)
            stream.wait_event(uploaded)
            self._slots[slot][2] = uploaded
        if self._cur is not None:
            self._cur.update(t_wait=t0, t_done=t_done, ev_wait=ev_wait)
            self.records.append(self._cur)
            del self.records[:-_MAX_RECORDS]
            self._cur = None

    def free(self, abandon: bool = False) -> None:
        """Complete pending transfers and release the communicator (if made here).

        With ``abandon`` (the ring stops early: an error or an interrupt, perhaps
        on the peers too) a staged send still waiting for its copy is not posted,
        nothing is uploaded, and the transfers in flight are settled as
        :func:`ringmpi.ring.settle` does (completed or cancelled within
        ``ABANDON_S``); buffers of transfers that did not settle stay referenced.
        """
        if abandon and (self.requests or self._unsent is not None or self._cur is not None):
            self._unsent = self._pending = self._cur = None
            from ..ring import settle

            self._copy.synchronize()  # the device-to-host copy into a pinned buffer
            settled = settle(self.requests) if self.requests else True
            self.requests = []
            if not settled:
                _KEEP.append(self._slots)  # MPI may still write into a pinned buffer
                self._slots = [[None, None, None], [None, None, None]]
                return  # the communicator stays: its transfers are not finished
        if abandon:
            from ..ring import KEPT_COMMS

            self._copy.synchronize()
            if self._own and self.cart != self._MPI.COMM_NULL:
                KEPT_COMMS.append(self.cart)  # not freed: see ringmpi.ring.KEPT_COMMS
                self.cart = self._MPI.COMM_NULL
            self._slots = [[None, None, None], [None, None, None]]
            return
        self.wait()
        self._copy.synchronize()
        if self._own and self.cart != self._MPI.COMM_NULL:
            self.cart.Free()
        self._slots = [[None, None, None], [None, None, None]]

    def overlap_report(self) -> dict:
        """How much of each exchange ran while the GPU computed.

        For exchange i the transfer interval is [post, Waitall done] on the host
        clock; the compute interval is [ev_post, ev_wait] on the stream (the
        kernels enqueued between ``start`` and ``wait``), mapped to the host
        clock through a reference event. Returns totals and per-step rows.
        """
        import cupy

        rows = []
        for r in self.records:
            r["ev_wait"].synchronize()
            c0 = self._t0 + cupy.cuda.get_elapsed_time(self._ev0, r["ev_post"]) / 1e3
            c1 = self._t0 + cupy.cuda.get_elapsed_time(self._ev0, r["ev_wait"]) / 1e3
            x0, x1 = r["t_post"], r["t_done"]
            ov = max(0.0, min(c1, x1) - max(c0, x0))
            rows.append(
                {
                    "bytes": r["bytes"],
                    "exchange_s": x1 - x0,
                    "compute_s": c1 - c0,
                    "overlap_s": ov,
                    "blocked_s": x1 - r["t_wait"],
                }
            )
        tot = {k: sum(r[k] for r in rows) for k in ("exchange_s", "compute_s", "overlap_s")}
        tot["blocked_s"] = sum(r["blocked_s"] for r in rows)
        tot["hidden_fraction"] = tot["overlap_s"] / tot["exchange_s"] if tot["exchange_s"] else 0.0
        return {"cuda_aware": self.cuda_aware, "steps": len(rows), **tot, "per_step": rows}
