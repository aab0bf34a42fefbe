"""Memory budget of the batch job: what one rank needs for a sequence, and what it may use.

:func:`check_memory` refuses a sequence whose per-rank footprint exceeds the
budget before anything is read, so a job fails in seconds with one clear line
instead of being killed by the out-of-memory handler an hour in.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..layout import counts
from ..runtime import env
from ..slices import Slices
from .plan import InputError, Plan, SeqInfo, fail, layout_mask, sliced

__all__ = [
    "parse_size",
    "rank_bytes",
    "resident_bytes",
    "seq_counts",
    "memory_budget",
    "check_memory",
    "Batch",
    "batch_tokens",
    "make_batches",
    "split",
    "joined",
    "check_batch",
    "check_output",
    "DEFAULT_TOKENS",
    "keep_freed",
    "HeapKeep",
    "cores_per_rank",
    "limit_blas",
    "BlasLimit",
]


def parse_size(text: str) -> int:
    """Parse a byte count such as ``"512M"``, ``"16G"`` or ``"1.5T"``."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?)i?[bB]?\s*", str(text))
    if not m:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 512M or 16G")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


# Bytes the ring holds beyond its inputs, per byte of q and of k+v in the compute dtype,
# measured with tracemalloc around ring_attention (float32, H = 8, Hkv = 8 and 2, P = 1, 2):
# q: the head-major copy, the accumulator, the finalized output (2.73); k, v: the head-major
# copy and two ring buffers (2.65; on one rank the receive buffer is never touched: 1.65).
# The job reads into head-major buffers (ringmpi.job.loop): no copy unless the input dtype
# is converted (float16 computes in float32), one less of each (COPY).
RING_Q = 2.75
RING_KV = 2.75
COPY = 1.0


def rank_bytes(
    plan: Plan, n_local: int, prefetch: bool = True, n_local_k=None, ranks: int = 2
) -> int:
    """Estimate of the bytes one rank holding ``n_local`` tokens needs for one sequence.

    The peak of: the local q/k/v as read, plus the larger of the ring's state
    (``RING_Q``/``RING_KV`` times q and k+v in the compute dtype, m and l, tile
    scratch), the write (the output, and a compressed part's in-memory image) and, for
    features inputs, the float64 read and projection temporaries. With read-ahead
    (``prefetch``: more sequences follow) the next sequence's inputs and its read
    come on top. ``n_local_k``: key/value tokens of the rank when they differ
    (cross-attention; the maximum over ranks sizes the ring buffers). ``ranks``:
    ring size (one rank never fills the receive buffer). The interpreter and
    libraries (:func:`resident_bytes`) are not included. Within 25% of the
    measured peak (tests/job/test_report_estimates.py).
    """
    isz = np.dtype(plan.dtype).itemsize
    csz = 8 if plan.dtype == "float64" else 4
    h, hkv, d = plan.heads, plan.kv_heads, plan.head_dim
    dv = getattr(plan, "value_dim", 0) or d  # the value width (out, acc, v): Dv may differ
    nk = n_local if n_local_k is None else int(n_local_k)
    # q and the state (acc: Dv wide) counted at the mean width, (Dk + Dv) / 2
    q_el, kv_el = n_local * h * (d + dv) // 2, nk * hkv * (d + dv)
    held = (n_local * h * d + kv_el) * isz
    kv_factor = RING_KV if ranks > 1 else RING_KV - 1
    copy = 0.0 if isz == csz else COPY  # the job's inputs are head-major already
    ring = (RING_Q - COPY + copy) * q_el * csz + (kv_factor - COPY + copy) * kv_el * csz
    ring += 2 * n_local * h * csz
    ring += 3 * 256 * 1024 * h * csz  # tile scratch (scores, probabilities)
    # out (+ image and bytes: compressed parts); lse
    write = 3 * n_local * h * dv * isz + n_local * h * 8
    read = 0
    if plan.mode == "features":
        f = plan.features
        read = (n_local + nk) * f * (isz + 8) + (n_local * h * d + kv_el) * 8
        read += f * (h * d + hkv * (d + dv)) * 8
    if prefetch:
        return int(2 * held + max(ring, write) + read)
    return int(held + max(ring, write, read))


def resident_bytes() -> int:
    """Resident memory of this process now (interpreter, libraries, arrays), in bytes."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def seq_counts(seq: SeqInfo, nranks: int, layout: str) -> tuple:
    """(most query tokens, most key/value tokens) any rank holds of ``seq``."""
    mask = layout_mask(seq, layout)
    n = int(counts(seq.length, nranks, layout, cu_seqlens=seq.cu_seqlens, mask=mask).max())
    cu_k = seq.cu_seqlens if seq.cu_seqlens_k is None else seq.cu_seqlens_k
    nk = int(counts(seq.length_k, nranks, layout, cu_seqlens=cu_k, mask=mask).max())
    return n, nk


def memory_budget(comm, limit: Optional[int] = None) -> int:
    """Bytes this rank may use: ``limit`` or 80% of the node's available memory / ranks on it."""
    if limit is not None:
        return int(limit)
    avail = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # a cgroup limit (batch systems) can be tighter than the node
        with open("/sys/fs/cgroup/memory.max") as fh:
            cg = fh.read().strip()
        if cg != "max":
            with open("/sys/fs/cgroup/memory.current") as fh:
                used = int(fh.read().strip())
            avail = min(avail or 1 << 62, int(cg) - used)
    except (OSError, ValueError):
        pass
    if avail is None:
        avail = 4 << 30
    local = 1
    if comm is not None and comm.Get_size() > 1:
        from mpi4py import MPI

        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        local = node.Get_size()
        node.Free()
    return int(0.8 * avail / local)


def check_memory(plan: Plan, seq: SeqInfo, nranks: int, layout: str, budget: int) -> None:
    """Raise InputError if the rank with the most tokens of ``seq`` would exceed ``budget``."""
    n, nk = seq_counts(seq, nranks, layout)
    # the budget comes from the memory still available: the process itself is not counted
    need = rank_bytes(plan, n, prefetch=len(plan.sequences) > 1, n_local_k=nk, ranks=nranks)
    if need > budget:
        gib = 1 << 30
        fail(
            plan.files[0],
            f"sequence {seq.name} (S={seq.length}, H={plan.heads}, D={plan.head_dim}) needs "
            f"~{need / gib:.2f} GiB per rank with {nranks} ranks, over the budget of "
            f"{budget / gib:.2f} GiB; use more ranks or raise --max-memory",
        )


# ----------------------------------------------------------------------
# Batches: consecutive short sequences of a ring packed into one ring call.
#
# A dataset of many moderate sequences spent its time around the kernels: a
# read, a ring call, a part file, a marker and an fsync per sequence per rank,
# and several collectives each. The loop therefore takes the sequences a ring
# was dealt in runs (:func:`make_batches`) of up to ``cap`` tokens
# (:func:`batch_tokens`: ``RINGMPI_BATCH_TOKENS``, lowered to what the memory
# budget allows) and computes each run as ONE packed sequence: the members one
# after another along the token axis, their boundaries as ``cu_seqlens``
# (a member that is itself packed keeps its own boundaries inside), so no token
# sees another member's (the masks skip those tiles). Each rank's tokens of the
# batch are exactly its tokens of every member, in member order
# (:func:`ringmpi.layout.positions` applies the layout within each packed
# sequence), so the reads concatenate and the outputs split back (:func:`split`).
#
# Results: a batch of one sequence is the very call the job made before
# (bitwise). A member of a larger batch is computed by the same tiles against
# the same keys, but the key blocks a tile folds at a time start at the batch's
# block boundaries, not the member's: the float32 sums group differently, so
# the member equals its own call to rounding (well inside verify's tolerance),
# not bit for bit. ``RINGMPI_BATCH_TOKENS=0`` turns batching off.


DEFAULT_TOKENS = int(env.REGISTRY["RINGMPI_BATCH_TOKENS"].default)
BALANCE = 4  # batches per ring at least, when the rings share many short sequences


@dataclass(frozen=True)
class Batch:
    """Sequences ``members`` (plan indices, consecutive in the ring's order) as one packed call.

    ``length``/``length_k``: query / key tokens of all members; ``cu_seqlens`` and
    ``cu_seqlens_k``: the packed offsets (None, as the sequence itself has, for a
    batch of one); ``slices``: the mask of slices of a batch of one sequence that
    has one (such a sequence is always a batch of its own), else None.
    """

    members: tuple
    length: int
    length_k: int
    cu_seqlens: Optional[tuple]
    cu_seqlens_k: Optional[tuple]
    name: str
    slices: Optional[Slices] = None

    @property
    def single(self) -> bool:
        return len(self.members) == 1


def batch_tokens(plan, ring_size: int, layout: str, budget: int) -> int:
    """Tokens one batch may hold: ``RINGMPI_BATCH_TOKENS`` (default 65,536), within ``budget``.

    The memory check is the one a single sequence of that many tokens gets
    (:func:`ringmpi.job.resources.rank_bytes` on the rank holding the most);
    0 disables batching (every batch one sequence).
    """
    try:
        cap = env.get("RINGMPI_BATCH_TOKENS")
    except ValueError as e:
        raise InputError(str(e)) from None
    if cap <= 0:
        return 0

    def fits(n: int) -> bool:
        n_local = -(-n // ring_size) + 2  # zigzag/striped: at most a chunk or two more per rank
        return rank_bytes(plan, n_local, prefetch=True, n_local_k=n_local, ranks=ring_size) <= (
            budget
        )

    while cap > 256 and not fits(cap):
        cap //= 2
    return cap if fits(cap) else 0


def make_batches(plan, todo, cap: int, rings: int = 1) -> list:
    """Split ``todo`` (plan indices, in order) into consecutive :class:`Batch` runs of <= ``cap``.

    A sequence of ``cap`` tokens or more (queries or keys) is a batch of its own;
    so is every sequence when ``cap`` is 0, and every sequence with a mask of
    slices (its mask is the call's whole mask). With ``rings`` rings sharing the
    work, a batch holds at most 1/(BALANCE x rings) of all the tokens, so that
    every ring gets batches and the last batches even out the rings' times.
    """
    todo = list(todo)
    total = sum(max(plan.sequences[i].length, plan.sequences[i].length_k) for i in todo)
    if cap > 0 and rings > 1:
        cap = max(1, min(cap, -(-total // (BALANCE * rings))))
    out, run, tokens = [], [], 0
    for i in todo:
        s = plan.sequences[i]
        n = max(s.length, s.length_k)
        alone = n >= cap or sliced(s) is not None
        if run and (tokens + n > cap or alone):
            out.append(_batch(plan, run))
            run, tokens = [], 0
        run.append(i)
        tokens += n
        if alone:
            out.append(_batch(plan, run))
            run, tokens = [], 0
    if run:
        out.append(_batch(plan, run))
    return out


def _batch(plan, members: list) -> Batch:
    seqs = [plan.sequences[i] for i in members]
    if len(seqs) == 1:
        s = seqs[0]
        return Batch(
            (members[0],), s.length, s.length_k, s.cu_seqlens, s.cu_seqlens_k, s.name, sliced(s)
        )
    cu, cu_k, cross = [0], [0], False
    for s in seqs:
        own = s.cu_seqlens if s.cu_seqlens is not None else (0, s.length)
        own_k = s.cu_seqlens_k if s.cu_seqlens_k is not None else own
        if s.cu_seqlens is None and s.length_k != s.length:
            own_k = (0, s.length_k)
        cross = cross or tuple(own_k) != tuple(own)
        base, base_k = cu[-1], cu_k[-1]
        cu.extend(base + int(x) for x in own[1:])
        cu_k.extend(base_k + int(x) for x in own_k[1:])
    name = f"{seqs[0].name}..{seqs[-1].name} ({len(seqs)} sequences)"
    return Batch(tuple(members), cu[-1], cu_k[-1], tuple(cu), tuple(cu_k) if cross else None, name)


def split(out: np.ndarray, lse: np.ndarray, rows: list) -> list:
    """The members' (out (n_s, H, D), lse (H, n_s)) from the batch's, ``rows`` = [n_s, ...]."""
    if len(rows) == 1:
        return [(out, lse)]
    edges = np.cumsum([0] + list(rows))
    return [(out[a:b], lse[:, a:b]) for a, b in zip(edges[:-1], edges[1:])]


def joined(arrays: list, axis: int) -> np.ndarray:
    """``np.concatenate(arrays, axis)``, without a copy when the arrays are the consecutive
    slices of one array along ``axis`` (a batch's output split into its members)."""
    full = [a for a in arrays if a.size]  # an empty slice may point anywhere
    if not full:
        return np.concatenate(arrays, axis=axis)
    a0 = full[0]
    step, at, total = a0.strides[axis], a0.ctypes.data, 0
    for a in full:
        same = a.strides == a0.strides and a.dtype == a0.dtype and a.ndim == a0.ndim
        if (
            not same
            or a.ctypes.data != at
            or any(n != m for d, (n, m) in enumerate(zip(a.shape, a0.shape)) if d != axis)
        ):
            return np.concatenate(arrays, axis=axis)
        at += a.shape[axis] * step
        total += a.shape[axis]
    shape = a0.shape[:axis] + (total,) + a0.shape[axis + 1 :]
    return np.lib.stride_tricks.as_strided(a0, shape=shape, strides=a0.strides, writeable=False)


def check_batch(path: str, seqs: list, items: list, out, lse) -> None:
    """:func:`check_output` of every member of a batch, in one pass over the batch's arrays.

    The output's minimum and maximum are finite exactly when no element is inf or NaN
    (both propagate NaN), and the lse's maximum is below +inf exactly when no element is
    NaN or +inf; only otherwise are the members checked one by one (which names the first
    bad one). (Two vectorised reductions: 4.5 ms per 65k-token batch, against 12 ms for
    the float64 sum it replaces.)
    """
    out, lse = np.asarray(out), np.asarray(lse)
    fine = out.size == 0 or bool(np.isfinite(out.min()) and np.isfinite(out.max()))
    if fine and lse.size and not lse.max() < np.inf:
        fine = False
    if not fine:
        for s, it in zip(seqs, items):
            check_output(path, s, *it[1:])


def check_output(path: str, seq, pos: np.ndarray, out: np.ndarray, lse: np.ndarray) -> None:
    """Refuse to write a non-finite result (the inputs were checked finite when read).

    Finite inputs can still overflow the accumulation dtype: float32 logits beyond
    ~3e38 turn into inf and then NaN. Such a sequence must fail with a clear error,
    not be written and marked complete. A row with no visible key has lse = -inf
    by design, so only NaN and +inf count there.
    """
    bad = ~np.isfinite(out)
    bad_lse = np.isnan(lse) | np.isposinf(lse)
    if bad.any() or bad_lse.any():
        rows = np.flatnonzero(bad.reshape(len(out), -1).any(axis=1))
        t = int(pos[rows[0]]) if len(rows) else int(pos[np.argwhere(bad_lse)[0][-1]])
        raise InputError(
            f"{path}: sequence {seq.name}: attention output is not finite (token {t}): the "
            f"scores overflow {out.dtype} arithmetic; rescale the input or use float64"
        )


# ----------------------------------------------------------------------
# Freed memory kept for the next batch, while the job runs (glibc's malloc).
#
# Every batch allocates arrays of tens to hundreds of MiB: the read buffers, the
# tile layout copies, the online-softmax state, the output. glibc serves each of
# them with a fresh ``mmap`` and unmaps it on free, so the next batch faults every
# page in again and the kernel zeroes it: on the 2,000-sequence log-normal set a
# profile spent 12% of all CPU time in ``clear_page_erms`` (about 2 s per rank
# of an 18 s job). While a job runs, :func:`keep_freed` has malloc take large
# blocks from the heap (``M_MMAP_MAX`` 0) and never give its free top back
# (``M_TRIM_THRESHOLD`` at its maximum), so the next batch reuses the pages the
# last one freed. The peak is what it was (the same arrays live at the same
# time); the process just does not shrink between batches. When the job ends
# the defaults come back and the free memory is returned (``malloc_trim``).
#
# ``RINGMPI_KEEP_MEMORY=0`` leaves malloc alone. Other C libraries (musl, macOS)
# have no such switches: nothing is changed there.


# mallopt parameters (malloc.h) and glibc's defaults for them
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_DEFAULT_TRIM, _DEFAULT_MMAP_MAX = 128 * 1024, 65536
_MAX_INT = 2**31 - 1


class HeapKeep:
    """What :func:`keep_freed` changed; :meth:`restore` puts glibc's defaults back."""

    def __init__(self, libc: Optional[ctypes.CDLL]) -> None:
        self._libc = libc

    @property
    def active(self) -> bool:
        return self._libc is not None

    def restore(self) -> None:
        libc, self._libc = self._libc, None
        if libc is None:
            return
        libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM)
        libc.malloc_trim(0)


def _glibc() -> Optional[ctypes.CDLL]:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        if not hasattr(libc, "gnu_get_libc_version"):  # glibc only: musl has other parameters
            return None
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed() -> HeapKeep:
    """Have malloc reuse freed blocks for the rest of the job (see the module); call
    ``restore()`` on the result when the job ends.
    """
    if not env.get("RINGMPI_KEEP_MEMORY"):
        return HeapKeep(None)
    libc = _glibc()
    if libc is None:
        return HeapKeep(None)
    if not libc.mallopt(_M_TRIM_THRESHOLD, _MAX_INT) or not libc.mallopt(_M_MMAP_MAX, 0):
        keep = HeapKeep(libc)
        keep.restore()
        return HeapKeep(None)
    return HeapKeep(libc)


# ----------------------------------------------------------------------
# BLAS threads per rank: no more than the cores the rank owns (threadpoolctl).
#
# Every rank of a job on one node would otherwise start as many BLAS threads as
# the node has cores, and P ranks x C threads fight over C cores (measured: the
# numpy tile 4.2x slower). :func:`limit_blas` sets the BLAS (and OpenMP) pools of
# this process to the cores this rank owns:
#
# * the launcher bound the ranks to disjoint core sets (``srun --cpu-bind``,
#   ``mpiexec -bind-to core``): the size of this rank's set;
# * otherwise (every rank may run anywhere): the cores this rank may use divided
#   by the ranks on the node sharing them, at least 1.
#
# It never raises the pools above what the environment already asked for
# (``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``, read by the
# libraries at load). ``RINGMPI_BLAS_THREADS=N`` sets N threads per rank instead;
# ``RINGMPI_BLAS_THREADS=0`` leaves the pools alone.


def _affinity() -> set:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux: the machine's count
        return set(range(os.cpu_count() or 1))


def cores_per_rank(mine: set, node_sets: list) -> tuple:
    """(cores, how) this rank owns, from its core set and those of every rank on its node.

    Parameters
    ----------
    mine : set of int
        The cores this rank may run on.
    node_sets : list of set of int
        The core sets of all ranks on this node (this one included).
    """
    disjoint = sum(len(s) for s in node_sets) == len(set().union(*node_sets))
    if disjoint:
        return max(1, len(mine)), "bound"
    sharing = sum(1 for s in node_sets if s & mine)
    return max(1, len(mine) // max(1, sharing)), f"{len(mine)} cores / {sharing} ranks"


class BlasLimit:
    """The limit in force: ``threads`` per rank (None: not limited), ``text`` for the start line.

    Parameters
    ----------
    threads : int or None
    text : str
    limiter : threadpoolctl.threadpool_limits or None
        Restored by :meth:`restore`.
    """

    def __init__(self, threads: Optional[int], text: str, limiter=None):
        self.threads, self.text, self._limiter = threads, text, limiter

    def restore(self) -> None:
        """Give the pools back the sizes they had before."""
        if self._limiter is not None:
            self._limiter.restore_original_limits()
            self._limiter = None


def _wanted(env) -> Optional[int]:
    """RINGMPI_BLAS_THREADS as a number (None: unset)."""
    from .plan import InputError

    want = env.get("RINGMPI_BLAS_THREADS", "").strip()
    if not want:
        return None
    if not want.isdigit():
        raise InputError(f"RINGMPI_BLAS_THREADS must be a number of threads (0: off), not {want!r}")
    return int(want)


def limit_blas(comm=None, env=None) -> BlasLimit:
    """Limit this rank's BLAS/OpenMP threads to its cores (collective over ``comm``'s node).

    Returns a :class:`BlasLimit`; call its ``restore()`` when the job ends.
    """
    from ..collective import run_everywhere

    env = os.environ if env is None else env
    want = run_everywhere(comm, _wanted, env)  # a bad value: the same error on every rank
    mine = _affinity()
    node_sets = [mine]
    if comm is not None and comm.Get_size() > 1:
        from mpi4py import MPI

        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            node_sets = [set(s) for s in node.allgather(sorted(mine))]
        finally:
            node.Free()
    if want == 0:
        return BlasLimit(None, "BLAS threads not limited (RINGMPI_BLAS_THREADS=0)")
    try:
        from threadpoolctl import threadpool_info, threadpool_limits
    except ImportError:
        return BlasLimit(None, "BLAS threads not limited (threadpoolctl is not installed)")
    if want is not None:
        n, how = want, "RINGMPI_BLAS_THREADS"
    else:
        n, how = cores_per_rank(mine, node_sets)
        now = [p["num_threads"] for p in threadpool_info() if p.get("num_threads")]
        if now and min(now) < n:  # the environment asked for fewer: keep that
            n, how = min(now), "as the environment set"
    limiter = threadpool_limits(limits=n)
    word = "thread" if n == 1 else "threads"
    return BlasLimit(n, f"BLAS {n} {word} per rank ({how})", limiter)
