"""GPU tile backend (CuPy + the CUDA kernels in kernels/attention_fwd.cu) and the GPU ring.

``forward_tile`` has the signature and semantics of :func:`ringmpi.cpu.forward_tile`
(the specification) for CuPy arrays in the internal head-major layout:

    q     (B, H,   Sq, D)   float16, bfloat16, float32 or float64
    k, v  (B, Hkv, Sk, D)   same dtype; query head h reads K/V head h // (H // Hkv)
    q_pos (Sq,), k_pos (Sk,)  numpy int64 global positions
    acc   (B, H, Sq, D), m, l (B, H, Sq)   CuPy, float32 (float64 for float64 inputs)

bfloat16: CuPy arrays of dtype ``bfloat16`` (where CuPy has it) or ``uint16``
arrays holding the bfloat16 bit patterns (:func:`to_bf16_bits` makes them) both
run the bf16 kernel. fp16/bf16 with D <= 128 run on tensor cores
(mma.sync m16n8k16, fp32 accumulation); wider heads and fp32/fp64 run the
CUDA-core kernel. Any D <= 256 works.

CuPy is imported lazily: importing this module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import collections
import ctypes
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from . import cuda_loader

__all__ = [
    "KERNEL_FILE",
    "kernel_names",
    "forward_tile",
    "tile_dtype",
    "acc_dtype",
    "to_bf16_bits",
    "from_bf16_bits",
    "GpuRing",
    "bind_device",
    "cuda_aware",
    "info",
]

KERNEL_FILE = "attention_fwd.cu"
MAX_D = 256
_MMA_HD = (32, 64, 96, 128)  # tensor-core head dims (D padded up to one of these)
# CUDA-core kernel (storage, acc, DMAX) -> (BM, BN): sized so shared memory fits sm_80
_SIMT = {
    ("float", "float", 64): (64, 64),
    ("float", "float", 128): (64, 64),
    ("float", "float", 256): (32, 32),
    ("double", "double", 64): (32, 32),
    ("double", "double", 128): (32, 32),
    ("double", "double", 256): (16, 16),
    ("half_t", "float", 256): (32, 32),
    ("bf16_t", "float", 256): (32, 32),
}


@dataclass(frozen=True)
class _Kernel:
    expr: str  # NVRTC name expression
    bm: int  # query rows per CTA
    bn: int  # keys per block
    threads: int
    smem: int  # dynamic shared memory bytes
    mma: bool  # tensor-core kernel (needs 16-byte rows)


def _mma_kernel(storage: str, hd: int) -> _Kernel:
    smem = (64 + 4 * 64) * (hd + 8) * 2  # Q + double-buffered K and V, 16-bit
    return _Kernel(f"attn_fwd_mma<{storage}, {hd}>", 64, 64, 128, smem, True)


def _simt_kernel(storage: str, acc: str, dmax: int) -> _Kernel:
    bm, bn = _SIMT[(storage, acc, dmax)]
    size = 8 if acc == "double" else 4
    smem = ((bm + 2 * bn) * (dmax + 1) + bm * (bn + 1)) * size
    return _Kernel(f"attn_fwd_simt<{storage}, {acc}, {dmax}, {bm}, {bn}>", bm, bn, 256, smem, False)


def kernel_names() -> tuple:
    """Every template instantiation the backend may launch (NVRTC name expressions)."""
    names = [_mma_kernel(s, hd).expr for s in ("half_t", "bf16_t") for hd in _MMA_HD]
    names += [_simt_kernel(*key).expr for key in _SIMT]
    return tuple(names)


def _dtype_name(dtype) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:  # e.g. a CuPy-only bfloat16 type
        return getattr(dtype, "name", getattr(dtype, "__name__", str(dtype)))


def _storage(dtype) -> str:
    name = _dtype_name(dtype)
    kinds = {"float16": "half_t", "bfloat16": "bf16_t", "uint16": "bf16_t"}
    kinds.update(float32="float", float64="double")
    if name not in kinds:
        raise TypeError(f"GPU tile: unsupported dtype {name}")
    return kinds[name]


def _select(storage: str, d: int) -> _Kernel:
    if not 1 <= d <= MAX_D:
        raise ValueError(f"GPU tile: head dim D={d} outside 1..{MAX_D}")
    if storage in ("half_t", "bf16_t") and d <= _MMA_HD[-1]:
        return _mma_kernel(storage, next(hd for hd in _MMA_HD if d <= hd))
    acc = "double" if storage == "double" else "float"
    return _simt_kernel(storage, acc, next(x for x in (64, 128, 256) if d <= x))


def tile_dtype(dtype):
    """Dtype q/k/v are kept in for the kernels: the input dtype, float32 for others."""
    name = _dtype_name(dtype)
    if name in ("float16", "uint16", "float32", "float64"):
        return np.dtype(name)
    if name == "bfloat16":
        return dtype  # CuPy's own bfloat16 type, where it has one
    return np.dtype(np.float32)


def acc_dtype(dtype):
    """Accumulation dtype of the state: float64 for float64 inputs, float32 otherwise."""
    name = _dtype_name(dtype)
    return np.dtype(np.float64) if name == "float64" else np.dtype(np.float32)


def _xp(x):
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def to_bf16_bits(x):
    """float array (numpy or CuPy) -> uint16 bfloat16 bits, round to nearest even."""
    xp = _xp(x)
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    # add 0x7fff plus the lowest kept bit, then keep the upper half (NaN is not special-cased)
    return ((u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16).astype(xp.uint16)


def from_bf16_bits(u):
    """uint16 bfloat16 bits (numpy or CuPy) -> float32, exactly."""
    xp = _xp(u)
    return (xp.asarray(u).astype(xp.uint32) << 16).view(xp.float32)


# ----------------------------------------------------------------------------
# host-side plan: block bounds (for skipping) and the flop count, cached
# ----------------------------------------------------------------------------
def block_bounds(pos: np.ndarray, bs: int) -> tuple:
    """(min, max) position of each block of ``bs`` consecutive rows, int64 arrays."""
    starts = np.arange(0, len(pos), bs)
    return np.minimum.reduceat(pos, starts), np.maximum.reduceat(pos, starts)


def visible_pairs(q_pos: np.ndarray, k_pos: np.ndarray, bm: int, bn: int, causal: bool) -> int:
    """Query-key pairs inside the (bm x bn) blocks the kernel computes (not skipped)."""
    sq, sk = len(q_pos), len(k_pos)
    if not causal:
        return sq * sk
    qhi = block_bounds(q_pos, bm)[1]
    klo = block_bounds(k_pos, bn)[0]
    nq = np.diff(np.append(np.arange(0, sq, bm), sq))
    nk = np.diff(np.append(np.arange(0, sk, bn), sk))
    order = np.argsort(klo, kind="stable")
    cum = np.concatenate(([0], np.cumsum(nk[order])))
    # keys in blocks with klo <= qhi are computed for that q block
    return int(np.dot(nq, cum[np.searchsorted(klo[order], qhi, side="right")]))


class _Lru(collections.OrderedDict):
    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def put(self, key, value):
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)
        return value


_POS_CACHE = _Lru(128)  # (device, bytes) -> device int64 array
_PLAN_CACHE = _Lru(256)  # (device, q bytes, k bytes, bm, bn, causal) -> (bounds, pairs)
_FUNCS: dict = {}


def _device_pos(pos: np.ndarray, dev: int):
    import cupy

    key = (dev, pos.tobytes())
    hit = _POS_CACHE.get(key)
    if hit is None:
        hit = _POS_CACHE.put(key, cupy.asarray(pos))
    return hit


def _plan(q_pos: np.ndarray, k_pos: np.ndarray, kern: _Kernel, causal: bool, dev: int):
    import cupy

    key = (dev, q_pos.tobytes(), k_pos.tobytes(), kern.bm, kern.bn, causal)
    hit = _PLAN_CACHE.get(key)
    if hit is None:
        qlo, qhi = block_bounds(q_pos, kern.bm)
        klo, khi = block_bounds(k_pos, kern.bn)
        bounds = cupy.asarray(np.concatenate((qlo, qhi, klo, khi)).astype(np.int64))
        pairs = visible_pairs(q_pos, k_pos, kern.bm, kern.bn, causal)
        hit = _PLAN_CACHE.put(key, (bounds, pairs))
    return hit


def _function(kern: _Kernel, dev: int):
    fn = _FUNCS.get((dev, kern.expr))
    if fn is None:
        fn = cuda_loader.get_function(KERNEL_FILE, kern.expr, kernel_names())
        if kern.smem > 48 * 1024:  # opt in to more than the default 48 KiB
            fn.max_dynamic_shared_size_bytes = kern.smem
        _FUNCS[(dev, kern.expr)] = fn
    return fn


def _rows16(x, ld: int):
    """Contiguous, 16-byte aligned copy of ``x`` with rows zero-padded to ``ld`` (if needed)."""
    import cupy

    if x.shape[-1] != ld:
        out = cupy.zeros(x.shape[:-1] + (ld,), dtype=x.dtype)
        out[..., : x.shape[-1]] = x
        return out
    if not x.flags.c_contiguous or x.data.ptr % 16:
        return x.copy()  # CuPy allocations are 256-byte aligned
    return x


def _check_state(name, x, shape, dtype) -> None:
    if tuple(x.shape) != tuple(shape) or x.dtype != dtype or not x.flags.c_contiguous:
        raise ValueError(
            f"GPU tile: {name} must be a C-contiguous {dtype} array of shape {tuple(shape)}, "
            f"got {x.dtype} {tuple(x.shape)}"
        )


def forward_tile(
    q,
    k,
    v,
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    acc,
    m,
    l,
    *,
    scale: float,
    causal: bool,
    progress: Optional[Callable[[], None]] = None,
) -> int:
    """Fold one K/V block into the online-softmax state on the GPU, in place.

    Parameters
    ----------
    q : cupy.ndarray (B, H, Sq, D)
    k, v : cupy.ndarray (B, Hkv, Sk, D), same dtype as q
    q_pos : numpy.ndarray (Sq,) int64 ; k_pos : numpy.ndarray (Sk,) int64
        Global token positions.
    acc : cupy.ndarray (B, H, Sq, D) ; m, l : cupy.ndarray (B, H, Sq)
        State in :func:`acc_dtype`, C-contiguous, updated in place.
    scale : float
    causal : bool
    progress : callable, optional
        If given, called repeatedly until the kernel has finished (so MPI can
        progress a pending exchange); forward_tile then returns after the
        kernel. Without it the launch is asynchronous on the current stream.

    Returns
    -------
    int
        4 * pairs * D * B * H over the (query block, key block) pairs that
        were not skipped.
    """
    import cupy

    bsz, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if k.shape != (bsz, hkv, sk, d) or v.shape != k.shape or hkv == 0 or h % hkv:
        raise ValueError(f"GPU tile: q {q.shape} does not match k {k.shape} / v {v.shape}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"GPU tile: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if len(q_pos) != sq or len(k_pos) != sk:
        raise ValueError("GPU tile: q_pos/k_pos lengths do not match Sq/Sk")
    adt = acc_dtype(q.dtype)
    _check_state("acc", acc, q.shape, adt)
    _check_state("m", m, q.shape[:3], adt)
    _check_state("l", l, q.shape[:3], adt)
    if sq == 0 or sk == 0 or bsz == 0 or h == 0:
        return 0
    kern = _select(_storage(q.dtype), d)
    if kern.mma:
        ld = -(-d // 8) * 8  # 16-byte rows for cp.async
        q, k, v = _rows16(q, ld), _rows16(k, ld), _rows16(v, ld)
    else:
        ld = d
        q, k, v = (cupy.ascontiguousarray(x) for x in (q, k, v))
    q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
    k_pos = np.ascontiguousarray(k_pos, dtype=np.int64)
    dev = cupy.cuda.Device().id
    bounds, pairs = _plan(q_pos, k_pos, kern, bool(causal), dev)
    fscale = np.float64(scale) if adt == np.float64 else np.float32(scale)
    args = (q, k, v, acc, m, l, _device_pos(q_pos, dev), _device_pos(k_pos, dev), bounds)
    args += tuple(np.int32(x) for x in (h, hkv, sq, sk, d, ld)) + (fscale, np.int32(causal))
    grid = (-(-sq // kern.bm), h, bsz)
    _function(kern, dev)(grid, (kern.threads,), args, shared_mem=kern.smem)
    if progress is not None:
        done = cupy.cuda.Event(block=False, disable_timing=True)
        done.record()
        progress()
        while not done.done:
            progress()
    return 4 * pairs * d * bsz * h


# ----------------------------------------------------------------------------
# devices, CUDA-aware MPI and the GPU ring
# ----------------------------------------------------------------------------
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


TAG_KV = 7301
_MAX_RECORDS = 4096


class GpuRing:
    """Non-blocking neighbour exchange of device buffers on a periodic ring.

    Same methods as :class:`ringmpi.ring.Ring` (``start``, ``test``, ``wait``,
    ``free``, ``wait_s``). With CUDA-aware MPI the device buffers go to MPI
    directly after the producing stream is synchronized; otherwise they are
    staged through pinned host buffers with async copies on a private stream.

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
        self.poll = os.environ.get("RINGMPI_POLL", "1") != "0"
        self._copy = cupy.cuda.Stream(non_blocking=True)
        self._pinned = (None, None)
        self._pending = None  # (device recv buffer, pinned host buffer) to upload after wait
        self._cur = None  # record of the exchange in flight
        self.records: list = []
        # common clock: an event that completed at host time _t0
        self._ev0 = cupy.cuda.Event()
        self._ev0.record()
        self._ev0.synchronize()
        self._t0 = time.perf_counter()

    def _host_buffers(self, nbytes: int):
        import cupy

        hs, hr = self._pinned
        if hs is None or hs.nbytes < nbytes:
            mk = cupy.cuda.alloc_pinned_memory
            hs = np.frombuffer(mk(nbytes), dtype=np.uint8, count=nbytes)
            hr = np.frombuffer(mk(nbytes), dtype=np.uint8, count=nbytes)
            self._pinned = (hs, hr)
        return hs[:nbytes], hr[:nbytes]

    def start(self, send_buf, recv_buf, tag: int = TAG_KV) -> None:
        """Post receive of the next block from the previous rank and send of ``send_buf``."""
        import cupy
        from cupy.cuda import runtime

        MPI = self._MPI
        stream = cupy.cuda.get_current_stream()
        ev_post = cupy.cuda.Event()
        ev_post.record(stream)
        t_post = time.perf_counter()
        if self.cuda_aware:
            # the producer of send_buf and the last reader of recv_buf run on this stream
            stream.synchronize()
            self.requests.append(self.cart.Irecv([recv_buf, MPI.BYTE], self.prev, tag))
            self.requests.append(self.cart.Isend([send_buf, MPI.BYTE], self.next, tag))
        else:
            nbytes = max(send_buf.nbytes, recv_buf.nbytes)
            hs, hr = self._host_buffers(nbytes)
            self._copy.wait_event(ev_post)
            d2h = runtime.memcpyDeviceToHost
            runtime.memcpyAsync(hs.ctypes.data, send_buf.data.ptr, send_buf.nbytes, d2h,
                                self._copy.ptr)  # fmt: skip
            self._copy.synchronize()  # also completes the previous upload out of hr
            self.requests.append(self.cart.Irecv([hr[: recv_buf.nbytes], MPI.BYTE], self.prev, tag))
            self.requests.append(self.cart.Isend([hs[: send_buf.nbytes], MPI.BYTE], self.next, tag))
            self._pending = (recv_buf, hr)
        self._cur = {"t_post": t_post, "ev_post": ev_post, "bytes": int(send_buf.nbytes)}

    def test(self) -> None:
        """Give MPI a chance to progress pending transfers (cheap, non-blocking)."""
        if self.poll and self.requests:
            self.polls += 1
            self._MPI.Request.Testall(self.requests)

    def wait(self) -> None:
        """Complete the exchange; recv_buf then holds the block (in current-stream order)."""
        import cupy
        from cupy.cuda import runtime

        if not self.requests:
            return
        stream = cupy.cuda.get_current_stream()
        ev_wait = cupy.cuda.Event()
        ev_wait.record(stream)  # end of the compute enqueued while the exchange was in flight
        t0 = time.perf_counter()
        self._MPI.Request.Waitall(self.requests)
        t_done = time.perf_counter()
        self.wait_s += t_done - t0
        self.requests = []
        if self._pending is not None:
            recv_buf, hr = self._pending
            self._pending = None
            runtime.memcpyAsync(recv_buf.data.ptr, hr.ctypes.data, recv_buf.nbytes,
                                runtime.memcpyHostToDevice, self._copy.ptr)  # fmt: skip
            uploaded = cupy.cuda.Event(disable_timing=True)
            uploaded.record(self._copy)
            stream.wait_event(uploaded)
        if self._cur is not None:
            self._cur.update(t_wait=t0, t_done=t_done, ev_wait=ev_wait)
            self.records.append(self._cur)
            del self.records[:-_MAX_RECORDS]
            self._cur = None

    def free(self) -> None:
        """Complete pending transfers and release the communicator (if made here)."""
        self.wait()
        self._copy.synchronize()
        if self._own and self.cart != self._MPI.COMM_NULL:
            self.cart.Free()
        self._pinned = (None, None)

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
            rows.append({"bytes": r["bytes"], "exchange_s": x1 - x0, "compute_s": c1 - c0,
                         "overlap_s": ov, "blocked_s": x1 - r["t_wait"]})  # fmt: skip
        tot = {k: sum(r[k] for r in rows) for k in ("exchange_s", "compute_s", "overlap_s")}
        tot["blocked_s"] = sum(r["blocked_s"] for r in rows)
        tot["hidden_fraction"] = tot["overlap_s"] / tot["exchange_s"] if tot["exchange_s"] else 0.0
        return {"cuda_aware": self.cuda_aware, "steps": len(rows), **tot, "per_step": rows}
