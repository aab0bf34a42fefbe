"""Memory budget of the batch job: what one rank needs for a sequence, and what it may use.

:func:`check_memory` refuses a sequence whose per-rank footprint exceeds the
budget before anything is read, so a job fails in seconds with one clear line
instead of being killed by the out-of-memory handler an hour in.
"""

from __future__ import annotations

import re
from typing import Optional

import numpy as np

from ..partition import counts
from .schema import Plan, SeqInfo, fail

__all__ = ["parse_size", "rank_bytes", "seq_counts", "memory_budget", "check_memory"]


def parse_size(text: str) -> int:
    """Parse a byte count such as ``"512M"``, ``"16G"`` or ``"1.5T"``."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?)i?[bB]?\s*", str(text))
    if not m:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 512M or 16G")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def rank_bytes(plan: Plan, n_local: int, prefetch: bool = True, n_local_k=None) -> int:
    """Upper estimate of the bytes one rank holding ``n_local`` tokens needs for one sequence.

    Counts the local q/k/v (twice with read-ahead of the next sequence), the
    head-major copies and accumulator state of the ring (acc, m, l in the compute
    dtype), three K/V blocks in flight (current + double-buffered receive), the
    output and lse, and for features inputs the float64 projection temporaries.
    ``n_local_k``: key/value tokens of the rank when they differ (cross-attention);
    the K/V blocks in flight are sized by the largest rank's, ``n_local_k`` is an
    upper bound for that when given as the maximum over ranks.
    """
    isz = np.dtype(plan.dtype).itemsize
    csz = 8 if plan.dtype == "float64" else 4
    h, hkv, d = plan.heads, plan.kv_heads, plan.head_dim
    nk = n_local if n_local_k is None else int(n_local_k)
    qkv = n_local * h * d + 2 * nk * hkv * d
    need = qkv * isz * (2 if prefetch else 1)
    need += qkv * csz  # head-major compute-dtype copies
    need += n_local * h * (d + 2) * csz  # acc, m, l
    need += 3 * 2 * nk * hkv * d * csz  # K/V ring buffers
    need += n_local * h * d * isz + n_local * h * csz  # out, lse
    need += 3 * 256 * 1024 * h * csz  # tile scratch (scores, probabilities)
    if plan.mode == "features":
        f = plan.features
        need += (n_local + nk) * f * (isz + 8) + f * (h + 2 * hkv) * d * 8 + qkv * 8
    return int(need)


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
    need = rank_bytes(plan, n, n_local_k=nk)
    if need > budget:
        gib = 1 << 30
        fail(
            plan.files[0],
            f"sequence {seq.name} (S={seq.length}, H={plan.heads}, D={plan.head_dim}) needs "
            f"~{need / gib:.2f} GiB per rank with {nranks} ranks, over the budget of "
            f"{budget / gib:.2f} GiB; use more ranks or raise --max-memory",
        )
