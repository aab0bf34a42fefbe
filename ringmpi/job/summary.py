"""The batch job's summary: one dict, identical on every rank, over every phase of the job.

Sums (flops, waits, compute, I/O, bytes read, tokens per ring size) and maxima
(peak memory, wall time) over all ranks in two Allreduce calls; the host names
in one allgather. What :func:`ringmpi.job.run.run` returns and
``--summary-json`` writes.
"""

from __future__ import annotations

import os
import platform
import time

import numpy as np

from .report import peak_rss, utc

__all__ = ["job_summary"]


def job_summary(ctx, phases: list, skipped: int, store) -> dict:
    """The job's summary, identical on every rank (sums and maxima over ``ctx.comm``).

    Parameters
    ----------
    ctx : ringmpi.job.loop.JobContext
    phases : list of ringmpi.job.loop.SequenceLoop
        Every phase this rank ran (one per ring size), in order.
    skipped : int
        Sequences an earlier run had finished (``--resume``).
    store : the output store
    """
    size = ctx.size
    wall = time.perf_counter() - ctx.t_start
    sizes = sorted({p.ctx.ring_size for p in phases}, reverse=True)
    # every ring's ranks count their ring's tokens: / ring size, then summed over comm
    mine = np.zeros(9 + len(sizes), dtype=np.float64)
    for p in phases:
        a = p.acc
        mine[:9] += [a["flops"], a["wait_s"], a["total_s"], a["compute_s"],
                     p.read_wait + p.write_s, p.read_wait, p.write_s,
                     p.reader.bytes_read, p.tokens / p.ctx.ring_size]  # fmt: skip
        mine[9 + sizes.index(p.ctx.ring_size)] += p.tokens / p.ctx.ring_size
    peak = np.array([peak_rss(), wall], dtype=np.float64)
    if ctx.comm is not None:
        from mpi4py import MPI

        tot = np.empty_like(mine)
        ctx.comm.Allreduce(mine, tot, op=MPI.SUM)
        mx = np.empty_like(peak)
        ctx.comm.Allreduce(peak, mx, op=MPI.MAX)
        mine, peak = tot, mx
    wall = float(peak[1])
    tokens = int(round(mine[8]))  # every ring's ranks counted their ring's tokens
    hosts = [platform.node()] if ctx.comm is None else ctx.comm.allgather(platform.node())
    by_size = {int(r): int(round(t)) for r, t in zip(sizes, mine[9:])}
    return {
        "ranks": size,
        "ring_size": sizes[0] if len(sizes) == 1 else "auto",
        "ring_sizes": by_size,  # tokens computed by rings of each size
        "layout": ctx.spec.layout,
        "causal": bool(ctx.spec.causal),
        "device": ctx.device,
        "sequences": sum(len(p.todo_all) for p in phases),
        "skipped_done": skipped,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "gflops": mine[0] / wall / 1e9 if wall > 0 else 0.0,
        "flops": float(mine[0]),
        "peak_rss_bytes_max": int(peak[0]),
        "mpi_wait_share": float(mine[1] / mine[2]) if mine[2] > 0 else 0.0,
        # the tiles' own time (every rank's, / ranks) and its share of the ranks' wall time
        "compute_s": float(mine[3] / size),
        "kernel_share": float(mine[3] / (wall * size)) if wall > 0 else 0.0,
        "io_share": float(mine[4] / (wall * size)) if wall > 0 else 0.0,
        "read_wait_s": float(mine[5] / size),
        "write_s": float(mine[6] / size),
        "read_mb_per_rank": float(mine[7] / size / 1e6),
        "output": os.path.abspath(ctx.output),
        "parts": os.path.abspath(ctx.output) + ".parts",
        "output_mode": getattr(store, "mode", "parts"),
        "started_utc": ctx.started_utc,
        "finished_utc": utc(),
        "hosts": hosts,
        "timings": [t for p in phases for t in p.timings],
        "provenance": ctx.attrs,
    }
