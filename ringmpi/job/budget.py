"""Memory budget of the batch job: what one rank needs for a sequence, and what it may use.

:func:`check_memory` refuses a sequence whose per-rank footprint exceeds the
budget before anything is read, so a job fails in seconds with one clear line
instead of being killed by the out-of-memory handler an hour in.
"""

from __future__ import annotations

import os
import re
from typing import Optional

import numpy as np

from ..partition import counts
from .schema import Plan, SeqInfo, fail

__all__ = [
    "parse_size", "rank_bytes", "resident_bytes", "seq_counts", "memory_budget", "check_memory",
]  # fmt: skip


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


def rank_bytes(plan: Plan, n_local: int, prefetch: bool = True, n_local_k=None,
               ranks: int = 2) -> int:  # fmt: skip
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
    measured peak (tests/test_day2_estimates.py).
    """
    isz = np.dtype(plan.dtype).itemsize
    csz = 8 if plan.dtype == "float64" else 4
    h, hkv, d = plan.heads, plan.kv_heads, plan.head_dim
    nk = n_local if n_local_k is None else int(n_local_k)
    q_el, kv_el = n_local * h * d, 2 * nk * hkv * d
    held = (q_el + kv_el) * isz
    kv_factor = RING_KV if ranks > 1 else RING_KV - 1
    copy = 0.0 if isz == csz else COPY  # the job's inputs are head-major already
    ring = (RING_Q - COPY + copy) * q_el * csz + (kv_factor - COPY + copy) * kv_el * csz
    ring += 2 * n_local * h * csz
    ring += 3 * 256 * 1024 * h * csz  # tile scratch (scores, probabilities)
    write = 3 * q_el * isz + n_local * h * 8  # out (+ image and bytes: compressed parts); lse
    read = 0
    if plan.mode == "features":
        f = plan.features
        read = (n_local + nk) * f * (isz + 8) + (q_el + kv_el) * 8 + f * (h + 2 * hkv) * d * 8
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
    n = int(counts(seq.length, nranks, layout, cu_seqlens=seq.cu_seqlens).max())
    cu_k = seq.cu_seqlens if seq.cu_seqlens_k is None else seq.cu_seqlens_k
    nk = int(counts(seq.length_k, nranks, layout, cu_seqlens=cu_k).max())
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
