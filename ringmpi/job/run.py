"""The batch job behind ``ringmpi run``: read, ring attention, write, one sequence at a time.

Per sequence every rank reads only its own tokens (:class:`ringmpi.job.reader.Reader`),
calls :func:`ringmpi.ring_attention` and writes its part of the output
(:class:`ringmpi.job.store.OutputStore`). While a sequence computes, a background
thread reads this rank's tokens of the next one. Only the main thread calls MPI
(so MPI_THREAD_FUNNELED suffices); the reader thread only calls h5py, which
releases the GIL inside the HDF5 read, so the read overlaps the compute.

Every step that can fail on a single rank (read, write) is followed by an
agreement (:func:`ringmpi.collective.run_everywhere`): a problem on any rank becomes
the same error on all ranks, so nobody waits forever.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

from ..attention import ring_attention
from ..collective import run_everywhere, run_on_root
from .budget import check_memory, memory_budget
from .progress import Progress
from .reader import Reader
from .schema import InputError, make_plan
from .store import OutputStore, fingerprint

__all__ = ["run", "format_summary", "pick_device"]


def pick_device(device: str, comm) -> str:
    """Resolve ``auto`` to ``gpu`` when CuPy sees a GPU on every rank, else ``cpu``.

    Every rank first reports whether it has a usable GPU; only when all do are
    the ranks bound to devices (a collective step), so a node without CuPy
    cannot leave the others waiting.
    """
    if device == "cpu":
        return "cpu"
    ok = False
    try:
        import cupy

        from .. import gpu  # noqa: F401

        ok = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no GPU: all mean "no GPU"
        ok = False
    flags = [ok] if comm is None else comm.allgather(ok)
    if device == "gpu" and not all(flags):
        bad = [r for r, f in enumerate(flags) if not f]
        raise InputError(f"--device gpu: no usable GPU (CuPy + ringmpi.gpu) on rank(s) {bad}")
    if all(flags) and comm is not None:
        from .. import gpu

        gpu.bind_device(comm)
    return "gpu" if all(flags) else "cpu"


def _test_kill(rank: int, completed: int) -> None:
    """Test hook: RINGMPI_TEST_KILL_AFTER=n SIGKILLs rank 0 after n sequences of this run."""
    n = os.environ.get("RINGMPI_TEST_KILL_AFTER")
    if rank == 0 and n is not None and completed >= int(n):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def _check_output(path: str, seq, pos: np.ndarray, out: np.ndarray, lse: np.ndarray) -> None:
    """Refuse to write a non-finite result (the inputs were checked finite when read).

    Finite inputs can still overflow the accumulation dtype: float32 logits beyond
    ~3e38 turn into inf and then NaN. Such a sequence must fail with a clear error,
    not be written and marked complete. A row with no visible key has lse = -inf
    by design, so only NaN and +inf count there.
    """
    bad = ~np.isfinite(out)
    if bad.any() or np.isnan(lse).any() or np.isposinf(lse).any():
        rows = np.flatnonzero(bad.reshape(len(out), -1).any(axis=1))
        t = int(pos[rows[0]]) if len(rows) else int(pos[np.argwhere(~(lse > -np.inf))[0][-1]])
        raise InputError(
            f"{path}: sequence {seq.name}: attention output is not finite (token {t}): the "
            f"scores overflow {out.dtype} arithmetic; rescale the input or use float64"
        )


def _peak_rss() -> int:
    """Peak resident memory of this process in bytes (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def run(
    inputs: Sequence[str],
    output: str,
    *,
    comm=None,
    causal: bool = False,
    layout: str = "zigzag",
    device: str = "auto",
    scale: Optional[float] = None,
    weights: Optional[str] = None,
    resume: bool = False,
    quiet: bool = False,
    max_memory: Optional[int] = None,
    strided: str = "auto",
    prefetch: bool = True,
) -> dict:
    """Run exact attention over every sequence of ``inputs`` and write ``output`` (collective).

    Returns the summary dict (identical on every rank); raises InputError (the
    same on every rank) for bad input, output or memory budget.
    """
    rank = 0 if comm is None else comm.Get_rank()
    size = 1 if comm is None else comm.Get_size()
    if comm is not None:
        comm.Barrier()
    t_start = time.perf_counter()
    plan = make_plan(comm, inputs, weights, size)
    budget = memory_budget(comm, max_memory)
    run_everywhere(
        comm, lambda: [check_memory(plan, s, size, layout, budget) for s in plan.sequences]
    )
    dev = pick_device(device, comm)
    meta = run_on_root(comm, fingerprint, plan, layout, causal, scale, size)
    store = OutputStore(output, comm, plan, meta)
    done = store.open(resume)
    todo = [i for i in range(len(plan.sequences)) if i not in done]

    bar = Progress(len(todo), enabled=(rank == 0 and not quiet))
    on_step = bar.step if (rank == 0 and not quiet) else None
    reader = Reader(plan, rank, size, layout, strided=strided)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ringmpi-read")
    acc = {"compute_s": 0.0, "wait_s": 0.0, "total_s": 0.0, "flops": 0.0}
    read_wait = write_s = 0.0
    tokens = 0

    def submit(j):
        seq = plan.sequences[todo[j]]
        return pool.submit(reader.read, seq)

    try:
        nxt = submit(0) if (todo and prefetch) else None
        for j, i in enumerate(todo):
            seq = plan.sequences[i]
            t_seq = time.perf_counter()
            bar.start(j, seq.name, seq.length)
            t0 = time.perf_counter()
            fut = nxt if prefetch else pool.submit(reader.read, seq)
            q, k, v = run_everywhere(comm, fut.result)
            read_wait += time.perf_counter() - t0
            nxt = submit(j + 1) if (prefetch and j + 1 < len(todo)) else None
            if dev == "gpu":
                import cupy

                q, k, v = cupy.asarray(q), cupy.asarray(k), cupy.asarray(v)
            stats: dict = {}
            out, lse = ring_attention(
                q, k, v, comm, causal=causal, layout=layout, scale=scale,
                return_lse=True, stats=stats, on_step=on_step,
            )  # fmt: skip
            if dev == "gpu":
                out, lse = out.get(), lse.get()
            for key in acc:
                acc[key] += float(stats.get(key, 0.0))
            out, lse = np.asarray(out), np.asarray(lse)
            pos = reader.positions(seq)
            run_everywhere(comm, _check_output, plan.files[0], seq, pos, out, lse)
            t0 = time.perf_counter()
            store.write(i, pos, out, lse)
            write_s += time.perf_counter() - t0
            tokens += seq.length
            bar.finish_seq(time.perf_counter() - t_seq)
            _test_kill(rank, j + 1)
        store.finish()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        reader.close()
        bar.close()
    wall = time.perf_counter() - t_start
    mine = np.array(
        [acc["flops"], acc["wait_s"], acc["total_s"], acc["compute_s"], read_wait + write_s,
         read_wait, write_s, reader.bytes_read],
        dtype=np.float64,
    )  # fmt: skip
    peak = np.array([_peak_rss(), wall], dtype=np.float64)
    if comm is not None:
        from mpi4py import MPI

        tot = np.empty_like(mine)
        comm.Allreduce(mine, tot, op=MPI.SUM)
        mx = np.empty_like(peak)
        comm.Allreduce(peak, mx, op=MPI.MAX)
        mine, peak = tot, mx
    wall = float(peak[1])
    return {
        "ranks": size,
        "layout": layout,
        "causal": bool(causal),
        "device": dev,
        "sequences": len(todo),
        "skipped_done": len(done),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "gflops": mine[0] / wall / 1e9 if wall > 0 else 0.0,
        "flops": float(mine[0]),
        "peak_rss_bytes_max": int(peak[0]),
        "mpi_wait_share": float(mine[1] / mine[2]) if mine[2] > 0 else 0.0,
        "io_share": float(mine[4] / (wall * size)) if wall > 0 else 0.0,
        "read_wait_s": float(mine[5] / size),
        "write_s": float(mine[6] / size),
        "read_mb_per_rank": float(mine[7] / size / 1e6),
        "output": os.path.abspath(output),
    }


def format_summary(s: dict) -> str:
    """Human-readable two-line summary of :func:`run`'s result."""
    skip = f" ({s['skipped_done']} already done)" if s["skipped_done"] else ""
    head = (
        f"ringmpi: {s['sequences']} sequence(s){skip}, {s['tokens']:,} tokens, {s['ranks']} ranks, "
        f"{s['layout']}{', causal' if s['causal'] else ''}, {s['device']} -> {s['output']}"
    )
    body = (
        f"  {s['wall_s']:.2f} s | {s['tokens_per_s']:,.0f} tokens/s | {s['gflops']:.2f} GFLOP/s | "
        f"peak memory/rank {s['peak_rss_bytes_max'] / 2**20:,.0f} MiB | "
        f"MPI wait {100 * s['mpi_wait_share']:.1f}% | I/O {100 * s['io_share']:.1f}%"
    )
    return head + "\n" + body
