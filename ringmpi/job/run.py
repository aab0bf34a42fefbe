"""The batch job behind ``ringmpi run``: read, ring attention, write, one sequence at a time.

:func:`run` sets the job up (plan, memory budget, device, rings, output) and
hands each ring's sequences to :class:`ringmpi.job.loop.SequenceLoop`.

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

import os
import time
from collections.abc import Sequence
from typing import Optional

from ..collective import run_everywhere, run_on_root
from ..grid import grid
from ..spec import AttentionSpec
from . import modifiers
from .batch import batch_tokens, make_batches
from .budget import check_memory, memory_budget
from .config import JobOptions, split_keywords
from .devices import gpu_probe, pick_device
from .loop import JobContext, SequenceLoop
from .mpio import make_store, resolve_mode
from .report import format_summary, measure_rate, one_process_note, provenance, utc
from .schema import InputError, make_plan
from .store import fingerprint
from .threads import limit_blas

__all__ = [
    "run",
    "JobOptions",
    "format_summary",
    "pick_device",
    "gpu_probe",
    "provenance",
    "choose_ring_size",
]


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
    spec: Optional[AttentionSpec] = None,
    options: Optional[JobOptions] = None,
    *,
    comm=None,
    **keywords,
) -> dict:
    """Run exact attention over every sequence of ``inputs`` and write ``output`` (collective).

    Parameters
    ----------
    inputs : sequence of str
        Input HDF5 files, in sequence order (see data/README.md for the schema).
    output : str
        Output HDF5 file (parts go to ``output + ".parts"``).
    spec : ringmpi.spec.AttentionSpec, optional
        What is computed: ``causal``, ``window=(left, right)`` (-1 unbounded),
        ``scale``, ``layout``; each sequence adds its own packing offsets
        (``cu_seqlens``) and cross-attention lengths from the inputs. Recorded in
        the output's attributes and the resume fingerprint, read back by verify.
    options : JobOptions, optional
        How: device, rings, files, memory, reads, RoPE of features inputs
        (:class:`ringmpi.job.config.JobOptions`).
    comm : MPI communicator, optional
        Every rank of the job (None: this process alone).
    **keywords
        The older form: any field of either class by name, e.g.
        ``run(inputs, out, causal=True, device="cpu")`` (not together with the
        ``spec`` / ``options`` object holding the same field).

    ``ring_size=R`` (or ``"auto"``) splits the P ranks into P/R rings of R ranks
    (:func:`ringmpi.grid`); the sequences are dealt round-robin over the rings,
    each ring reads, computes and writes its own; output, resume markers,
    progress and summary stay one job. ``rope`` rotates the projected q and k of
    features inputs at their global positions within their packed sequence
    (:func:`ringmpi.rope.apply_rope` with ``rope_theta``, ``rope_scale``).

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
    spec, opts = split_keywords(spec, options, keywords)
    ring_size = opts.ring_size
    plan = make_plan(comm, inputs, opts.weights, 1 if ring_size not in (None, size) else size,
                     rope=opts.rope)  # fmt: skip
    # ALiBi slopes (--alibi, --alibi-slopes) and the weights' sinks join the spec here
    spec = modifiers.resolve(comm, spec, plan, opts.alibi, opts.alibi_slopes_file)
    head_major = [w for w in plan.warnings if "head-major" in w]
    if head_major:  # stop here with the advice: the heads taken as tokens only fail later
        raise InputError(head_major[0].replace("; if the data", ": stopping; if the data", 1))
    if rank == 0:
        import sys

        for w in plan.warnings:
            print(f"ringmpi: warning: {w}", file=sys.stderr, flush=True)
    budget = memory_budget(comm, opts.max_memory)
    dev = pick_device(opts.device, comm)
    blas = limit_blas(comm)  # before the calibration: it runs with the job's threads
    notes = (blas.text,) + ((one_process_note(),) if size == 1 else ())
    layout, causal = spec.layout, spec.causal
    try:
        calibrate = rank == 0 and (ring_size == "auto" or not opts.quiet)
        rate = measure_rate(plan, dev) if calibrate else 0.0
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
        cap = run_on_root(comm, batch_tokens, plan, rs, layout, budget)
        ring, across = (comm, None) if rs == size else grid(comm, ring_size=rs)
        ctx = JobContext(plan=plan, spec=spec, options=opts, comm=comm, ring=ring, ring_size=rs,
                         device=dev, attrs={}, rate=rate, t_start=t_start,
                         started_utc=started_utc, output=output, notes=notes, budget=budget,
                         batch_tokens=cap)  # fmt: skip
        try:
            return _job(ctx, across)
        finally:
            if across is not None:
                ring.Free()
                across.Free()
    finally:
        blas.restore()


def _spec_attrs(spec: AttentionSpec) -> dict:
    """The spec's fields beyond those the output always records (causal, scale, layout, window).

    Every later field (a score modifier) lands in the attributes, the resume
    fingerprint and verify through here, by its own name.
    """
    skip = {"causal", "scale", "layout", "window", "cu_seqlens", "cu_seqlens_k", "head_parallel"}
    return {k: v for k, v in spec.to_attrs().items() if k not in skip}


def _job(ctx: JobContext, across) -> dict:
    """Open the output, run the loop of this rank's ring (collective)."""
    plan, spec, opts, comm = ctx.plan, ctx.spec, ctx.options, ctx.comm
    size, rs = ctx.size, ctx.ring_size
    nrings = size // rs
    mode = resolve_mode(opts.output_mode, comm, nrings)  # before anything is written
    layout, causal, scale = spec.layout, spec.causal, spec.scale
    meta = run_on_root(comm, fingerprint, plan, layout, causal, scale, size, rs)
    # masks, positions and modifiers: a resumed run must use the same (compared via the manifest)
    meta["window"] = list(spec.window) if spec.window is not None else None
    meta["rope"] = list(ctx.rope) if ctx.rope else None
    meta.update(_spec_attrs(spec))
    # how sequences are packed into calls decides the rounding of each: resume must match
    meta["batch_tokens"] = ctx.batch_tokens
    attrs = run_on_root(comm, provenance, plan, layout, causal, scale, size, ctx.device,
                        window=spec.window, rope=ctx.rope)  # fmt: skip
    attrs.update(_spec_attrs(spec))
    attrs["ring_size"] = rs
    # what computes: a resume under another device, tile or CPU ISA would mix results
    meta["compute"] = [attrs.get(k) for k in ("device", "kernel", "isa")]
    ctx.attrs = attrs
    store = make_store(mode, ctx.output, comm, plan, meta, attrs=attrs, overwrite=opts.overwrite,
                       compress=opts.compress, ring=ctx.ring)  # fmt: skip
    done = store.open(opts.resume)
    # the batches follow from the plan alone (not from what is done), so a resumed run
    # computes every batch it redoes exactly as the first run did
    every = make_batches(plan, range(len(plan.sequences)), ctx.batch_tokens, nrings)
    left = [b for b in every if not set(b.members) <= done]
    # rings take the batches in turn; the last may get fewer
    todo = left[(0 if across is None else across.Get_rank()) :: nrings]
    return SequenceLoop(ctx, store, todo, left, done).run()
