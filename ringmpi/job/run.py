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
import os
import platform
import signal
import sys
import time
from collections.abc import Sequence
from typing import Optional

import numpy as np

from .. import interrupt
from ..attention import ring_attention
from ..collective import run_everywhere, run_on_root
from ..grid import grid
from ..mask import check_window
from ..partition import counts
from ..watchdog import watch
from .budget import check_memory, memory_budget
from .mpio import make_store, resolve_mode
from .progress import Progress
from .reader import Reader, abandon, in_background
from .report import (
    format_summary,
    measure_rate,
    one_process_note,
    peak_rss,
    predicted_seconds,
    provenance,
    start_line,
    ticks_per_step,
    utc,
)
from .schema import InputError, make_plan
from .store import fingerprint, part_name
from .threads import limit_blas

__all__ = ["run", "format_summary", "pick_device", "gpu_probe", "provenance", "choose_ring_size"]


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


def choose_ring_size(ring_size, plan, size: int, layout: str, causal: bool, budget: int,
                     rate: float) -> int:  # fmt: skip
    """Ranks per ring: ``ring_size`` checked, or for ``"auto"`` the planner's choice.

    ``auto`` takes the ring size with the shortest predicted job among those whose
    per-rank memory fits ``budget`` for the longest sequence (many sequences:
    small rings, each holding one sequence with big blocks that hide the
    exchange; one long sequence: one ring of all ranks). The link rate is
    ``RINGMPI_LINK_GBPS`` (default 10 Gbit/s), the compute rate ``rate`` (flop/s).
    """
    if ring_size is None:
        return size
    if ring_size == "auto":
        from ..plan import recommend

        longest = max(s.length for s in plan.sequences)
        rec = recommend(
            longest, plan.heads, plan.kv_heads, plan.head_dim, ranks=size,
            memory_per_rank_bytes=budget, sequences=len(plan.sequences), causal=causal,
            dtype="float64" if plan.dtype == "float64" else "float32",
            gflops=(rate / 1e9) or 50.0,
            link_gbps=float(os.environ.get("RINGMPI_LINK_GBPS", "10")),
        )  # fmt: skip
        r = rec["ring_size"]
        shortest = min(s.length for s in plan.sequences)
        while r < size and (not rec["fits"] or shortest < r):  # keep every rank busy
            r = min(d for d in range(r + 1, size + 1) if size % d == 0)
        return r
    try:
        r = int(ring_size)
    except (TypeError, ValueError):
        msg = f"--ring-size must be a number of ranks or 'auto', not {ring_size!r}"
        raise InputError(msg) from None
    if r < 1 or size % r:
        raise InputError(f"--ring-size {r} does not divide the {size} ranks into whole rings")
    return r


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
    ring_size=None,
    output_mode: str = "auto",
    window: Optional[tuple] = None,
    rope: bool = False,
    rope_theta: float = 10000.0,
    rope_scale: float = 1.0,
) -> dict:
    """Run exact attention over every sequence of ``inputs`` and write ``output`` (collective).

    Masks and positions: ``window=(left, right)`` (-1 unbounded) and the inputs'
    packed sequences (``cu_seqlens``) and cross-attention lengths go to
    :func:`ringmpi.ring_attention`; ``rope`` rotates the projected q and k of
    features inputs at their global positions within their packed sequence
    (:func:`ringmpi.rope.apply_rope` with ``rope_theta``, ``rope_scale``).

    ``ring_size=R`` (or ``"auto"``) splits the P ranks into P/R rings of R ranks
    (:func:`ringmpi.grid`); the sequences are dealt round-robin over the rings,
    each ring reads, computes and writes its own; output, resume markers,
    progress and summary stay one job.

    ``output_mode``: ``"parts"`` (per-rank part files + a virtual-dataset file),
    ``"single"`` (one file written collectively, :mod:`ringmpi.job.mpio`; needs
    h5py with MPI and one ring) or ``"auto"`` (single where possible, else parts).

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
    started_utc = utc()
    try:
        window = check_window(window)
    except ValueError as e:
        raise InputError(f"--window: {e}") from None
    plan = make_plan(comm, inputs, weights, 1 if ring_size not in (None, size) else size, rope=rope)
    masks = {"window": window, "rope": (float(rope_theta), float(rope_scale)) if rope else None}
    head_major = [w for w in plan.warnings if "head-major" in w]
    if head_major:  # stop here with the advice: the heads taken as tokens only fail later
        raise InputError(head_major[0].replace("; if the data", ": stopping; if the data", 1))
    if rank == 0:
        for w in plan.warnings:
            print(f"ringmpi: warning: {w}", file=sys.stderr, flush=True)
    budget = memory_budget(comm, max_memory)
    dev = pick_device(device, comm)
    blas = limit_blas(comm)  # before the calibration: it runs with the job's threads
    masks["notes"] = [blas.text] + ([one_process_note()] if size == 1 else [])
    try:
        rate = measure_rate(plan, dev) if rank == 0 and (ring_size == "auto" or not quiet) else 0.0
        rs = run_on_root(
            comm, choose_ring_size, ring_size, plan, size, layout, causal, budget, rate
        )
        run_everywhere(
            comm, lambda: [check_memory(plan, s, rs, layout, budget) for s in plan.sequences]
        )
        if rs != size:
            short = run_on_root(
                comm, lambda: [s.name for s in plan.sequences if min(s.length, s.length_k) < rs]
            )
            if short:
                msg = f"sequence {short[0]} has fewer tokens than the {rs} ranks of a ring"
                raise InputError(msg)
        ring, across = (comm, None) if rs == size else grid(comm, ring_size=rs)
        return _job(plan, comm, ring, across, rs, rank, size, output_mode, output, layout, causal,
                    scale, dev, masks, window, rope, overwrite, compress, resume, quiet, strided,
                    prefetch, rate, t_start, started_utc)  # fmt: skip
    finally:
        blas.restore()


def _job(plan, comm, ring, across, rs, rank, size, output_mode, output, layout, causal, scale,
         dev, masks, window, rope, overwrite, compress, resume, quiet, strided, prefetch, rate,
         t_start, started_utc) -> dict:  # fmt: skip
    """Open the output, run the loop of this rank's ring, free the rings (collective)."""
    nrings = size // rs
    ring_rank = 0 if ring is None else ring.Get_rank()
    try:
        mode = resolve_mode(output_mode, comm, nrings)  # before anything is written
        meta = run_on_root(comm, fingerprint, plan, layout, causal, scale, size, rs)
        # masks and positions: a resumed run must use the same (compared via the manifest)
        meta["window"] = list(window) if window is not None else None
        meta["rope"] = list(masks["rope"]) if rope else None
        attrs = run_on_root(comm, provenance, plan, layout, causal, scale, size, dev,
                            window=masks["window"], rope=masks["rope"])  # fmt: skip
        attrs["ring_size"] = rs
        # what computes: a resume under another device, tile or CPU ISA would mix results
        meta["compute"] = [attrs.get(k) for k in ("device", "kernel", "isa")]
        store = make_store(mode, output, comm, plan, meta, attrs=attrs, overwrite=overwrite,
                           compress=compress, ring=ring)  # fmt: skip
        done = store.open(resume)
        todo_all = [i for i in range(len(plan.sequences)) if i not in done]
        # rings take the sequences in turn; the last may get fewer
        todo = todo_all[(0 if across is None else across.Get_rank()) :: nrings]
        return _loop(
            plan, todo, todo_all, done, store, comm, ring, rs, rank, ring_rank, size, layout,
            causal, scale, dev, attrs, quiet, strided, prefetch, rate, t_start, started_utc,
            output, masks,
        )  # fmt: skip
    finally:
        if across is not None:
            ring.Free()
            across.Free()


def _loop(plan, todo, todo_all, done, store, comm, ring, rs, rank, ring_rank, size, layout,
          causal, scale, dev, attrs, quiet, strided, prefetch, rate, t_start, started_utc,
          output, masks) -> dict:  # fmt: skip
    """The sequence loop of one ring, then the job-wide summary (collective over ``comm``)."""
    show = rank == 0 and not quiet
    predicted = predicted_seconds(plan, todo_all, size, causal, rate, masks["window"])
    bar = Progress([plan.sequences[i].length for i in todo], enabled=show, predicted=predicted)
    if show:
        bar.header(start_line(plan, todo_all, size, layout, causal, dev, attrs["kernel"],
                              attrs["isa"], rate, ring=rs, window=masks["window"],
                              notes=masks.get("notes", ())))  # fmt: skip
    where = {"j": -1, "stage": "starting", "step": 0}

    def on_step(step: int, nsteps: int) -> None:
        where["step"] = step
        bar.step(step, nsteps)

    reader = Reader(plan, ring_rank, rs, layout, strided=strided, rope=masks["rope"])
    acc = {"compute_s": 0.0, "wait_s": 0.0, "total_s": 0.0, "flops": 0.0}
    read_wait = write_s = 0.0
    tokens = 0
    timings = []
    stopped = False

    reads: list = []  # every read started (a daemon thread each, one at a time)

    def start(seq):
        reads.append(in_background(reader.read, seq))
        return reads[-1]

    def submit(j):
        return start(plan.sequences[todo[j]])

    def read(fut, name):
        """The read's result; an interrupt is noticed while waiting, a stuck read is watched."""
        what = f"its own read of sequence {name} (no HDF5 read finished)"
        with watch(what, why="the file system is stuck") as moved:
            while True:
                try:
                    return fut.result(timeout=0.2)
                except concurrent.futures.TimeoutError:
                    interrupt.check()
                    moved(reader.progress)

    nxt = None
    try:
        nxt = submit(0) if (todo and prefetch) else None
        for j, i in enumerate(todo):
            seq = plan.sequences[i]
            where.update(j=j, stage="reading", step=0)
            t_seq = time.perf_counter()
            n_here = int(counts(seq.length, rs, layout, cu_seqlens=seq.cu_seqlens)[ring_rank])
            bar.start(j, seq.name, seq.length, rs, ticks_per_step(attrs["kernel"], n_here))
            t0 = time.perf_counter()
            fut = nxt if prefetch else start(seq)
            q, k, v = run_everywhere(ring, read, fut, seq.name)
            read_wait += time.perf_counter() - t0
            t_read = time.perf_counter() - t0
            where["stage"] = "ring"
            nxt = submit(j + 1) if (prefetch and j + 1 < len(todo)) else None
            if dev == "gpu":
                import cupy

                q, k, v = cupy.asarray(q), cupy.asarray(k), cupy.asarray(v)
            stats: dict = {}
            bar.computing()
            out, lse = ring_attention(
                q, k, v, ring, causal=causal, layout=layout, scale=scale,
                return_lse=True, stats=stats, on_step=on_step,
                on_tick=bar.tick if show else None, window=masks["window"],
                cu_seqlens=seq.cu_seqlens, cu_seqlens_k=seq.cu_seqlens_k,
            )  # fmt: skip
            where["stage"] = "writing"
            if dev == "gpu":
                out, lse = out.get(), lse.get()
            for key in acc:
                acc[key] += float(stats.get(key, 0.0))
            out, lse = np.asarray(out), np.asarray(lse)
            pos = reader.positions(seq)
            run_everywhere(ring, _check_output, plan.files[0], seq, pos, out, lse)
            t0 = time.perf_counter()
            try:
                store.write(i, pos, out, lse)
            except BaseException:
                _drop_tmp_part(store, i)  # a full disk: no half-written part left behind
                raise
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
        err = _where(e, where, plan, todo, len(done) + max(where["j"], 0), rs)
        left = [r for r in reads if not r.done()]
        if left:  # a read still running may be stuck in HDF5
            abandon(err.exit_status, left, interrupt.grace() or 30.0)
        raise err from None
    finally:
        # an interrupted read is not waited for (a daemon thread: the process ends
        # right after, even when the read is stuck in the file system)
        if nxt is not None and not stopped and not nxt.cancel():
            try:  # a prefetch left running after an error: let it finish (watched)
                read(nxt, "(prefetched)")
            except BaseException:  # noqa: BLE001 - the error being raised says what went wrong
                pass
        if not stopped:
            reader.close()
        bar.close()
    wall = time.perf_counter() - t_start
    mine = np.array(
        [acc["flops"], acc["wait_s"], acc["total_s"], acc["compute_s"], read_wait + write_s,
         read_wait, write_s, reader.bytes_read, tokens / rs],
        dtype=np.float64,
    )  # fmt: skip
    peak = np.array([peak_rss(), wall], dtype=np.float64)
    if comm is not None:
        from mpi4py import MPI

        tot = np.empty_like(mine)
        comm.Allreduce(mine, tot, op=MPI.SUM)
        mx = np.empty_like(peak)
        comm.Allreduce(peak, mx, op=MPI.MAX)
        mine, peak = tot, mx
    wall = float(peak[1])
    tokens = int(round(mine[8]))  # every ring's ranks counted their ring's tokens
    hosts = [platform.node()] if comm is None else comm.allgather(platform.node())
    return {
        "ranks": size,
        "ring_size": rs,
        "layout": layout,
        "causal": bool(causal),
        "device": dev,
        "sequences": len(todo_all),
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
        "output_mode": getattr(store, "mode", "parts"),
        "started_utc": started_utc,
        "finished_utc": utc(),
        "hosts": hosts,
        "timings": timings,
        "provenance": attrs,
    }


def _drop_tmp_part(store, i: int) -> None:
    """Remove this rank's temporary part file of sequence ``i`` after a failed write."""
    parts, rank = getattr(store, "parts", None), getattr(store, "rank", None)
    if parts is None or rank is None:
        return
    tmp = os.path.join(parts, part_name(i, rank) + ".tmp")
    try:
        if os.path.isfile(tmp) and not os.path.islink(tmp):
            os.remove(tmp)
    except OSError:
        pass  # the error being raised says what went wrong; nothing under the final name


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
