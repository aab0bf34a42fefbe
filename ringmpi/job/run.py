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

A Ctrl-C or SIGTERM (caught as a flag by the command, :mod:`ringmpi.interrupt`)
stops the loop at the next tile chunk, ring step or read wait and leaves as
:class:`ringmpi.interrupt.Interrupted` carrying where it stopped; finished
sequences stay marked done for ``--resume``.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import platform
import resource
import signal
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

from .. import interrupt
from ..attention import ring_attention
from ..collective import run_everywhere, run_on_root
from ..partition import counts
from .budget import check_memory, memory_budget, rank_bytes
from .progress import Progress, duration
from .reader import Reader
from .schema import InputError, make_plan
from .store import FORMAT, OutputStore, fingerprint

__all__ = ["run", "format_summary", "pick_device", "gpu_probe", "provenance"]


def gpu_probe() -> tuple:
    """(usable, reason) for this process: is there a GPU ringmpi can use, and if not, why."""
    try:
        import cupy
    except ImportError:
        return False, "CuPy is not installed"
    except Exception as e:  # noqa: BLE001 - a broken CuPy install
        return False, f"CuPy does not import ({type(e).__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver, no device, no permission
        text = str(e)
        if "insufficient" in text.lower():
            why = "no NVIDIA driver is loaded; CUDA reports an insufficient driver"
        elif "NoDevice" in text or "no CUDA-capable device" in text:
            why = "CUDA sees no device"
        else:
            why = f"CUDA: {type(e).__name__}: {text}"
        return False, f"no GPU found: {why}"
    if n < 1:
        return False, "no GPU found: CUDA sees 0 devices"
    try:
        from .. import gpu  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return False, f"ringmpi.gpu does not import ({type(e).__name__}: {e})"
    return True, f"{n} GPU(s)"


def pick_device(device: str, comm) -> str:
    """Resolve ``auto`` to ``gpu`` when CuPy sees a GPU on every rank, else ``cpu``.

    Every rank first reports whether it has a usable GPU; only when all do are
    the ranks bound to devices (a collective step), so a node without CuPy
    cannot leave the others waiting. ``gpu`` without a GPU on some rank is an
    InputError giving each such rank's reason.
    """
    if device == "cpu":
        return "cpu"
    probe = gpu_probe()
    probes = [probe] if comm is None else comm.allgather(probe)
    flags = [ok for ok, _ in probes]
    if device == "gpu" and not all(flags):
        bad = [f"rank {r}: {why}" for r, (ok, why) in enumerate(probes) if not ok]
        more = f" (and {len(bad) - 3} more rank(s))" if len(bad) > 3 else ""
        raise InputError(f"--device gpu: no usable GPU on {'; '.join(bad[:3])}{more}")
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


def _kernel(dev: str, dtype: str) -> tuple:
    """(kernel name, ISA) of the tile the run uses."""
    if dev == "gpu":
        return "cuda", "cuda"
    from ..backend import select

    name = select(np.empty(0, dtype)).name
    if name != "fused":
        return name, "numpy"
    from ..cpu import fused

    isa = getattr(fused, "isa", None)
    if callable(isa):
        return name, str(isa())
    width = fused.simd_width()
    return name, {64: "avx512", 32: "avx2", 16: "sse/neon", 0: "scalar"}.get(width, f"simd{width}")


def provenance(plan, layout: str, causal: bool, scale, size: int, dev: str) -> dict:
    """Typed attributes of the output: options, resolved scale, sizes, versions, kernel, host.

    No time stamp: the output is a deterministic function of these (the run's
    time is in the summary).
    """
    import h5py

    from .. import __version__

    try:
        import mpi4py
        from mpi4py import MPI

        mpi = MPI.Get_library_version().strip().splitlines()[0].strip()
        mpi4py_version = mpi4py.__version__
    except ImportError:  # pragma: no cover - the job always has mpi4py
        mpi, mpi4py_version = "none", "none"
    kernel, isa = _kernel(dev, plan.dtype)
    return {
        "format": FORMAT,
        "structure": plan.structure,
        "layout": layout,
        "causal": bool(causal),
        "scale": float(scale) if scale is not None else 1.0 / math.sqrt(plan.head_dim),
        "scale_is_default": scale is None,
        "ranks": int(size),
        "dtype": plan.dtype,
        "heads": int(plan.heads),
        "kv_heads": int(plan.kv_heads),
        "head_dim": int(plan.head_dim),
        "sequences": len(plan.sequences),
        "tokens": int(sum(s.length for s in plan.sequences)),
        "inputs": [os.path.abspath(p) for p in plan.files],
        "weights": os.path.abspath(plan.weights) if plan.weights else "",
        "device": dev,
        "kernel": kernel,
        "isa": isa,
        "ringmpi_version": __version__,
        "numpy_version": np.__version__,
        "h5py_version": h5py.version.version,
        "hdf5_version": h5py.version.hdf5_version,
        "mpi_version": mpi,
        "mpi4py_version": mpi4py_version,
        "python_version": platform.python_version(),
        "host": platform.node(),
    }


def _ticks_per_step(kernel: str, n_local: int) -> int:
    """Progress callbacks one forward tile call makes (fused: one per CHUNK_Q query rows)."""
    if kernel != "fused" or n_local == 0:
        return 0
    from ..cpu import fused

    return -(-n_local // fused.CHUNK_Q)


def _measure_rate(plan, dev: str) -> float:
    """Flop/s of this rank's forward tile on a small block of the plan's shape (0 if unknown)."""
    if dev != "cpu":
        return 0.0
    from ..backend import select
    from ..softmax import init_state

    be = select(np.empty(0, plan.dtype))
    dt = be.tile_dtype(np.dtype(plan.dtype))
    rng = np.random.default_rng(0)
    sq, sk = 512, 2048
    q = rng.standard_normal((1, plan.heads, sq, plan.head_dim)).astype(dt)
    k = rng.standard_normal((1, plan.kv_heads, sk, plan.head_dim)).astype(dt)
    pos_q, pos_k = np.arange(sq, dtype=np.int64) + sk, np.arange(sk, dtype=np.int64)
    best = 0.0
    for _ in range(2):  # the first call may compile or warm the caches
        acc, m, l = init_state(q.shape, be.acc_dtype(dt), np)
        t0 = time.perf_counter()
        f = be.forward_tile(q, k, k, pos_q, pos_k, acc, m, l, scale=0.1, causal=False)
        t = time.perf_counter() - t0
        best = max(best, f / t if t > 0 else 0.0)
    return best


def _flops(plan, causal: bool, lengths: list) -> float:
    """Model flops of the sequences: 4 S^2 D H, half of it under a causal mask."""
    per = 4.0 * plan.head_dim * plan.heads
    return sum(per * n * n * (0.5 if causal else 1.0) for n in lengths)


def _start_line(plan, todo, size, layout, causal, dev, kernel, isa, rate) -> str:
    """The job's first line: what, where, how much memory, how long (predicted)."""
    lengths = [plan.sequences[i].length for i in todo]
    tokens = sum(lengths)
    n_max = max((int(counts(n, size, layout).max()) for n in lengths), default=0)
    mem = rank_bytes(plan, n_max) / 2**30
    where = f"{dev} ({kernel}, {isa})" if dev == "cpu" else dev
    text = (
        f"{len(todo)} sequence(s), {tokens:,} tokens (H={plan.heads}, Hkv={plan.kv_heads}, "
        f"D={plan.head_dim}, {plan.dtype}), {size} rank(s), {layout}{', causal' if causal else ''}"
        f", {where}; ~{mem:.2f} GiB per rank"
    )
    if rate > 0 and tokens:
        secs = _flops(plan, causal, lengths) / size / rate
        text += f"; predicted ~{duration(secs)} at {rate / 1e9:.1f} GFLOP/s per rank (measured)"
    return text


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
    overwrite: bool = False,
    compress: Optional[str] = None,
) -> dict:
    """Run exact attention over every sequence of ``inputs`` and write ``output`` (collective).

    Returns the summary dict (identical on every rank); raises InputError (the
    same on every rank) for bad input, output or memory budget, and
    :class:`ringmpi.interrupt.Interrupted` (``where`` filled in) when a recorded
    SIGINT/SIGTERM stops it.
    """
    rank = 0 if comm is None else comm.Get_rank()
    size = 1 if comm is None else comm.Get_size()
    if comm is not None:
        comm.Barrier()
    t_start = time.perf_counter()
    started_utc = _utc()
    plan = make_plan(comm, inputs, weights, size)
    if rank == 0:
        for w in plan.warnings:
            print(f"ringmpi: warning: {w}", file=sys.stderr, flush=True)
    budget = memory_budget(comm, max_memory)
    run_everywhere(
        comm, lambda: [check_memory(plan, s, size, layout, budget) for s in plan.sequences]
    )
    dev = pick_device(device, comm)
    meta = run_on_root(comm, fingerprint, plan, layout, causal, scale, size)
    attrs = run_on_root(comm, provenance, plan, layout, causal, scale, size, dev)
    store = OutputStore(output, comm, plan, meta, attrs=attrs, overwrite=overwrite,
                        compress=compress)  # fmt: skip
    done = store.open(resume)
    todo = [i for i in range(len(plan.sequences)) if i not in done]

    show = rank == 0 and not quiet
    bar = Progress([plan.sequences[i].length for i in todo], enabled=show)
    if show:
        rate = _measure_rate(plan, dev)
        bar.header(_start_line(plan, todo, size, layout, causal, dev, attrs["kernel"],
                               attrs["isa"], rate))  # fmt: skip
    where = {"j": -1, "stage": "starting", "step": 0}

    def on_step(step: int, nsteps: int) -> None:
        where["step"] = step
        bar.step(step, nsteps)

    reader = Reader(plan, rank, size, layout, strided=strided)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ringmpi-read")
    acc = {"compute_s": 0.0, "wait_s": 0.0, "total_s": 0.0, "flops": 0.0}
    read_wait = write_s = 0.0
    tokens = 0
    timings = []
    stopped = False

    def submit(j):
        seq = plan.sequences[todo[j]]
        return pool.submit(reader.read, seq)

    def result(fut):
        """The read's result; a recorded interrupt is noticed while waiting for it."""
        while True:
            try:
                return fut.result(timeout=0.2)
            except concurrent.futures.TimeoutError:
                interrupt.check()

    try:
        nxt = submit(0) if (todo and prefetch) else None
        for j, i in enumerate(todo):
            seq = plan.sequences[i]
            where.update(j=j, stage="reading", step=0)
            t_seq = time.perf_counter()
            n_here = int(counts(seq.length, size, layout)[rank])
            bar.start(j, seq.name, seq.length, size, _ticks_per_step(attrs["kernel"], n_here))
            t0 = time.perf_counter()
            fut = nxt if prefetch else pool.submit(reader.read, seq)
            q, k, v = run_everywhere(comm, result, fut)
            read_wait += time.perf_counter() - t0
            t_read = time.perf_counter() - t0
            where["stage"] = "ring"
            nxt = submit(j + 1) if (prefetch and j + 1 < len(todo)) else None
            if dev == "gpu":
                import cupy

                q, k, v = cupy.asarray(q), cupy.asarray(k), cupy.asarray(v)
            stats: dict = {}
            out, lse = ring_attention(
                q, k, v, comm, causal=causal, layout=layout, scale=scale,
                return_lse=True, stats=stats, on_step=on_step,
                on_tick=bar.tick if show else None,
            )  # fmt: skip
            where["stage"] = "writing"
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
            secs = time.perf_counter() - t_seq
            timings.append({
                "sequence": seq.name, "tokens": seq.length, "seconds": secs, "read_wait_s": t_read,
                "compute_s": float(stats.get("compute_s", 0.0)),
                "mpi_wait_s": float(stats.get("wait_s", 0.0)), "write_s": time.perf_counter() - t0,
            })  # fmt: skip
            bar.finish_seq(secs)
            _test_kill(rank, j + 1)
        where["stage"] = "finishing"
        store.finish()
    except KeyboardInterrupt as e:
        stopped = True
        bar.close()
        raise _where(e, where, plan, todo, len(done) + max(where["j"], 0), size) from None
    finally:
        # an interrupted read is not waited for: the process ends right after
        pool.shutdown(wait=not stopped, cancel_futures=True)
        if not stopped:
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
    hosts = [platform.node()] if comm is None else comm.allgather(platform.node())
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
        "parts": os.path.abspath(output) + ".parts",
        "started_utc": started_utc,
        "finished_utc": _utc(),
        "hosts": hosts,
        "timings": timings,
        "provenance": attrs,
    }


def _utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _where(e: KeyboardInterrupt, where: dict, plan, todo: list, finished: int, size: int):
    """An Interrupted saying at which sequence and ring step the job stopped."""
    err = e if isinstance(e, interrupt.Interrupted) else interrupt.Interrupted(signal.SIGINT)
    j = where["j"]
    if j < 0:
        err.where = "the start, before any sequence"
    else:
        i = todo[j]
        text = f"sequence {i + 1}/{len(plan.sequences)} ({plan.sequences[i].name})"
        if where["stage"] == "ring":
            text += f", ring step {min(where['step'] + 1, size)}/{size}"
        else:
            text += f", while {where['stage']}"
        err.where = text
    err.finished = finished
    return err


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
    name = os.path.basename(s["output"])
    keep = (
        f"  {name} reads its data from {name}.parts/: keep the two together, or write one "
        f"self-contained file with 'ringmpi pack {name} -o FILE'"
    )
    return head + "\n" + body + "\n" + keep
