"""The sequence loop of the batch job: read, ring attention, write, for one ring's batches.

:class:`SequenceLoop` runs the batches a ring was dealt (:mod:`ringmpi.job.resources`:
one long sequence, or consecutive shorter ones packed into one call), one
after another: its ranks read their own tokens of every member (the next
batch's in a background thread while this one computes), call
:func:`ringmpi.ring_attention` once with the job's
:class:`ringmpi.spec.AttentionSpec` plus the batch's packing offsets, split the
result back to the members and write it (one part file per rank and one marker
per batch). Collectives: a constant number per batch. :meth:`SequenceLoop.summary`
then sums the job over every rank. Only the main thread calls MPI.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import platform
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..attention import resumable_ring_attention
from ..collective import run_everywhere
from ..layout import counts
from ..runtime import faults, interrupt
from ..runtime.watchdog import watch
from ..spec import AttentionSpec
from .input.reader import Reader, abandon, in_background
from .options import JobOptions
from .output.checkpoint import Checkpoints
from .output.layout import part_name
from .plan import layout_mask, value_width
from .report import Progress, peak_rss, predicted_seconds, start_line, ticks_per_step, utc
from .resources import check_batch, split

__all__ = ["JobContext", "SequenceLoop", "job_summary"]


@dataclass
class JobContext:
    """What every stage of one job shares (the same on every rank, but ``ring``)."""

    plan: Any  # ringmpi.job.plan.Plan
    spec: AttentionSpec  # the job's spec (packing offsets come per sequence)
    options: JobOptions
    comm: Any  # every rank of the job (None: one process without MPI)
    ring: Any  # this rank's ring (``comm`` when there is one ring)
    ring_size: int
    device: str
    attrs: dict  # the output's provenance attributes
    rate: float  # measured tile flop/s (0: not measured)
    t_start: float
    started_utc: str
    output: str
    notes: tuple = ()
    budget: int = 0  # per-rank memory budget (bytes)
    batch_tokens: int = 0  # tokens of one batch at most (0: one sequence per batch)

    @property
    def rank(self) -> int:
        return 0 if self.comm is None else self.comm.Get_rank()

    @property
    def size(self) -> int:
        return 1 if self.comm is None else self.comm.Get_size()

    @property
    def ring_rank(self) -> int:
        return 0 if self.ring is None else self.ring.Get_rank()

    @property
    def rope(self) -> Optional[tuple]:
        o = self.options
        return (float(o.rope_theta), float(o.rope_scale)) if o.rope else None

    def spec_of(self, unit) -> AttentionSpec:
        """The spec of a sequence or batch: the job's, with its packing offsets, or with its
        mask of slices (a batch of one sequence that has one: then its whole mask)."""
        if getattr(unit, "slices", None) is not None:
            return dataclasses.replace(self.spec, slices=unit.slices)
        return dataclasses.replace(
            self.spec, cu_seqlens=unit.cu_seqlens, cu_seqlens_k=unit.cu_seqlens_k
        )


class SequenceLoop:
    """One ring's batches ``todo`` (:class:`~ringmpi.job.resources.Batch`), then the summary.

    Parameters
    ----------
    ctx : JobContext
    store : output store (:func:`ringmpi.job.output.make_store`), already opened
    todo : list of Batch
        The batches this ring computes, in order.
    left : list of Batch
        Every batch left to compute in the job (all rings).
    done : set of int
        Sequences an earlier run finished (``--resume``).
    before : list of SequenceLoop
        The job's earlier phases (``--ring-size auto``: rings of another size),
        already run: the summary counts them, the start line was theirs.
    last : bool
        The job's last phase: write the output's index and return the summary.
    job_left : list of (Batch, ring size), optional
        Every batch left in the job, all phases (default ``left`` on this ring size):
        the start line.
    """

    def __init__(
        self,
        ctx: JobContext,
        store,
        todo: list,
        left: list,
        done,
        before=(),
        last: bool = True,
        job_left: Optional[list] = None,
    ) -> None:
        self.ctx, self.store = ctx, store
        self.todo, self.left, self.done = todo, left, done
        self.before, self.last = list(before), last
        self.job_left = [(b, ctx.ring_size) for b in left] if job_left is None else job_left
        self.todo_all = [i for b in left for i in b.members]
        todo_all = self.todo_all
        plan, spec = ctx.plan, ctx.spec
        self.show = ctx.rank == 0 and not ctx.options.quiet
        predicted = predicted_seconds(plan, todo_all, ctx.size, spec.causal, ctx.rate, spec.window)
        work = [sum(float(plan.sequences[i].length) ** 2 for i in b.members) for b in todo]
        unit = "batch" if any(not b.single for b in todo) else "sequence"
        self.bar = Progress(
            [b.length for b in todo], enabled=self.show, predicted=predicted, work=work, unit=unit
        )
        self.where = {"j": -1, "stage": "starting", "step": 0}
        self.reader = Reader(
            plan,
            ctx.ring_rank,
            ctx.ring_size,
            spec.layout,
            strided=ctx.options.strided,
            rope=ctx.rope,
        )
        self.acc = {"compute_s": 0.0, "wait_s": 0.0, "total_s": 0.0, "flops": 0.0}
        self.read_wait = self.write_s = 0.0
        self.tokens = 0
        self.timings: list = []
        # the reads not yet finished (a daemon thread each, one at a time): a finished
        # read's Future holds its batch's q, k, v, so none is kept past its batch
        self.reads: list = []
        self.nxt = None  # the read of the next batch, started ahead
        self.finished = 0  # sequences this ring wrote
        # checkpoints of a batch's ring state, named by its first sequence
        self.ckpt = Checkpoints(
            store.parts,
            ctx.ring,
            store.meta,
            ctx.options.checkpoint_every,
            ctx.options.resume,
            todo=[b.members[0] for b in todo],
            finished=done,
        )

    # -- reading ---------------------------------------------------------------------------
    def read_ahead(self) -> None:
        """Start reading the first batch now (the job's set-up, e.g. rank 0's index, goes on
        meanwhile); :meth:`run` takes it."""
        if self.todo and self.ctx.options.prefetch and self.nxt is None:
            self.nxt = self._start(0)

    def _start(self, j: int):
        self.reads = [r for r in self.reads if not r.done()]
        self.reads.append(in_background(self._read_batch, self.todo[j]))
        return self.reads[-1]

    def _read_batch(self, batch) -> tuple:
        """(rows, (q, k, v)): this rank's query rows of each member of ``batch`` and the
        batch's q, k, v, the members' tokens one after the other (in the reader thread).

        Each member is read straight into its rows of the batch's arrays (no copy). The
        arrays are token-major views (S, H, D) of head-major buffers (H, S, D): the
        reads transpose as they copy, and the tiles' head-major layout
        (:func:`ringmpi.arguments.to_internal`) is then the buffers themselves, not a
        transposing copy of every batch (measured: 0.1 s per 65k-token batch of q, k, v).
        """
        plan, rd = self.ctx.plan, self.reader
        seqs = [plan.sequences[i] for i in batch.members]
        ns = [len(rd.positions(s)) for s in seqs]
        nks = [len(rd.positions_k(s)) for s in seqs]
        dt, h, hkv, d = np.dtype(plan.dtype), plan.heads, plan.kv_heads, plan.head_dim
        q = np.empty((h, sum(ns), d), dt).transpose(1, 0, 2)
        k, v = (np.empty((hkv, sum(nks), w), dt).transpose(1, 0, 2) for w in (d, value_width(plan)))
        a = ak = 0
        intos = []
        for n, nk in zip(ns, nks):
            intos.append((q[a : a + n], k[ak : ak + nk], v[ak : ak + nk]))
            a, ak = a + n, ak + nk
        rd.read_many(seqs, intos=intos)
        return ns, (q, k, v)

    def _result(self, fut, name):
        """The read's result; an interrupt is noticed while waiting, a stuck read is watched."""
        what = f"its own read of sequence {name} (no HDF5 read finished)"
        with watch(what, why="the file system is stuck") as moved:
            while True:
                try:
                    return fut.result(timeout=0.2)
                except concurrent.futures.TimeoutError:
                    interrupt.check()
                    moved(self.reader.progress)

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> dict:
        """Compute and write every sequence of ``todo``; the summary (collective over comm)."""
        ctx, bar = self.ctx, self.bar
        if self.show and not self.before:
            every = [i for b, _ in self.job_left for i in b.members]
            bar.header(
                start_line(
                    ctx.plan,
                    every,
                    ctx.size,
                    ctx.spec.layout,
                    ctx.spec.causal,
                    ctx.device,
                    ctx.attrs["kernel"],
                    ctx.attrs["isa"],
                    ctx.rate,
                    ring=ctx.ring_size,
                    window=ctx.spec.window,
                    notes=ctx.notes,
                    units=[b for b, _ in self.job_left],
                    unit_rings=[r for _, r in self.job_left],
                )
            )
        if self.show and (self.before or not self.last):  # --ring-size auto: say the phase
            rings = ctx.size // ctx.ring_size
            n = sum(len(b.members) for b in self.left)
            bar.note(
                f"{rings} ring(s) of {ctx.ring_size}: {n} sequence(s) in {len(self.left)} call(s)"
            )
        prefetch = ctx.options.prefetch
        stopped = False
        try:
            self.read_ahead()  # (a no-op when started already)
            for j, batch in enumerate(self.todo):
                self._one(j, batch, self.nxt if prefetch else self._start(j))
            if self.last:
                self.where["stage"] = "finishing"
                self.store.finish()
        except KeyboardInterrupt as e:
            stopped = True
            bar.close()
            err = self._interrupted(e)
            left = [r for r in self.reads if not r.done()]
            if left:  # a read still running may be stuck in HDF5
                abandon(err.exit_status, left, interrupt.grace() or 30.0)
            raise err from None
        finally:
            # an interrupted read is not waited for (a daemon thread: the process ends
            # right after, even when the read is stuck in the file system)
            nxt = self.nxt
            if nxt is not None and not stopped and not nxt.cancel():
                try:  # a prefetch left running after an error: let it finish (watched)
                    self._result(nxt, "(prefetched)")
                except BaseException:  # noqa: BLE001 - the error being raised says what went wrong
                    pass
            if not stopped:
                self.reader.close()
            bar.close()
        return self.summary() if self.last else {}

    def _one(self, j: int, batch, fut) -> None:
        """Batch ``todo[j]``: wait for its read ``fut``, start the next, compute, write."""
        ctx, bar, where = self.ctx, self.bar, self.where
        plan, rs = ctx.plan, ctx.ring_size
        spec = ctx.spec_of(batch)
        where.update(j=j, stage="reading", step=0)
        t_seq = time.perf_counter()
        n_here = int(
            counts(
                batch.length,
                rs,
                spec.layout,
                cu_seqlens=batch.cu_seqlens,
                mask=layout_mask(batch, spec.layout),
            )[ctx.ring_rank]
        )
        bar.start(j, batch.name, batch.length, rs, ticks_per_step(ctx.attrs["kernel"], n_here))
        t0 = time.perf_counter()
        rows, (q, k, v) = run_everywhere(ctx.ring, self._result, fut, batch.name)
        t_read = time.perf_counter() - t0
        self.read_wait += t_read
        where["stage"] = "ring"
        self.nxt = None
        if ctx.options.prefetch and j + 1 < len(self.todo):
            self.nxt = self._start(j + 1)
        faults.batch_read(ctx.rank, j)
        if ctx.device == "gpu":
            import cupy

            q, k, v = cupy.asarray(q), cupy.asarray(k), cupy.asarray(v)
        stats: dict = {}
        start = self._resume_point(batch.members[0], batch.name, q)
        bar.computing()

        def on_step(step: int, nsteps: int) -> None:
            where["step"] = step
            bar.step(step, nsteps)

        out, lse = resumable_ring_attention(
            q,
            k,
            v,
            ctx.ring,
            spec=spec,
            return_lse=True,
            stats=stats,
            on_step=on_step,
            on_tick=bar.tick if self.show else None,
            on_state=self.ckpt.on_state if self.ckpt.on else None,
            start=start,
        )
        del q, k, v
        where["stage"] = "writing"
        if ctx.device == "gpu":
            out, lse = out.get(), lse.get()
        for key in self.acc:
            self.acc[key] += float(stats.get(key, 0.0))
        seqs = [plan.sequences[i] for i in batch.members]
        items = [
            (i, self.reader.positions(s), o, ls)
            for i, s, (o, ls) in zip(
                batch.members, seqs, split(np.asarray(out), np.asarray(lse), rows)
            )
        ]
        faults.ring_done(ctx.ring_rank, j)
        run_everywhere(ctx.ring, check_batch, plan.files[0], seqs, items, out, lse)
        t0 = time.perf_counter()
        try:
            self.store.write_batch(items)
        except BaseException:
            _drop_tmp_part(self.store, batch.members[0])  # a full disk: no half-written part
            raise
        self.ckpt.finish(batch.members[0])
        self.write_s += time.perf_counter() - t0
        self.tokens += batch.length
        secs = time.perf_counter() - t_seq
        self.timings.append(
            {
                "sequence": batch.name,
                "sequences": len(batch.members),
                "tokens": batch.length,
                "seconds": secs,
                "read_wait_s": t_read,
                "compute_s": float(stats.get("compute_s", 0.0)),
                "mpi_wait_s": float(stats.get("wait_s", 0.0)),
                "write_s": time.perf_counter() - t0,
                "ring_steps": int(stats.get("steps", 0)),
                "ring_steps_resumed": int(stats.get("steps_resumed", 0)),
            }
        )
        bar.finish_seq(secs)
        self.finished += len(batch.members)
        faults.sequences_done(ctx.rank, self.finished + sum(b.finished for b in self.before))

    def _resume_point(self, i: int, name: str, q) -> Optional[tuple]:
        """The checkpoint the batch of first sequence ``i`` resumes from (collective over the
        ring), said on stderr."""
        from ..backend import select

        ctx = self.ctx
        b, (s, h, d) = 1, q.shape[-3:]
        acc_dtype = select(q).acc_dtype(q.dtype)
        shapes = [(b, h, s, d), (b, h, s), (b, h, s)]
        start = self.ckpt.start(i, name, shapes, str(np.dtype(acc_dtype)))
        if start is not None and ctx.ring_rank == 0 and not ctx.options.quiet:
            self.bar.close()
            s, p = start[0], ctx.ring_size
            print(
                f"ringmpi: sequence {name}: resuming at ring step {s}/{p} from a "
                f"checkpoint ({s} step(s) done, {p - s} to compute)",
                file=sys.stderr,
                flush=True,
            )
        return start

    # -- the end ---------------------------------------------------------------------------
    def summary(self) -> dict:
        """The job's summary, identical on every rank (:func:`ringmpi.job.loop.job_summary`)."""
        return job_summary(self.ctx, self.before + [self], len(self.done), self.store)

    def _interrupted(self, e: KeyboardInterrupt):
        """An Interrupted saying at which sequence and ring step the job stopped."""
        err = e if isinstance(e, interrupt.Interrupted) else interrupt.Interrupted(signal.SIGINT)
        plan, where, j = self.ctx.plan, self.where, self.where["j"]
        if j < 0:
            err.where = "the start, before any sequence"
        else:
            batch = self.todo[j]
            i = batch.members[0]
            text = f"sequence {i + 1}/{len(plan.sequences)} ({plan.sequences[i].name})"
            if not batch.single:
                last = batch.members[-1]
                text = f"sequences {i + 1}-{last + 1}/{len(plan.sequences)} ({batch.name})"
            if where["stage"] == "ring":
                text += f", ring step {min(where['step'] + 1, self.ctx.ring_size)}"
                text += f"/{self.ctx.ring_size}"
            else:
                text += f", while {where['stage']}"
            err.where = text
        err.finished = len(self.done) + self.finished + sum(b.finished for b in self.before)
        return err


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


# ----------------------------------------------------------------------
# The batch job's summary: one dict, identical on every rank, over every phase of the job.
#
# Sums (flops, waits, compute, I/O, bytes read, tokens per ring size) and maxima
# (peak memory, wall time) over all ranks in two Allreduce calls; the host names
# in one allgather. What :func:`ringmpi.job.run.run` returns and
# ``--summary-json`` writes.


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
        mine[:9] += [
            a["flops"],
            a["wait_s"],
            a["total_s"],
            a["compute_s"],
            p.read_wait + p.write_s,
            p.read_wait,
            p.write_s,
            p.reader.bytes_read,
            p.tokens / p.ctx.ring_size,
        ]
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
