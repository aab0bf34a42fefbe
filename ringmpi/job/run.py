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

import dataclasses
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
from .heap import keep_freed
from .loop import JobContext, SequenceLoop
from .mpio import make_store, resolve_mode
from .report import format_summary, measure_rate, one_process_note, provenance, utc
from .rings import assign_ring_sizes, deal, phases
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
                     window=None) -> list:  # fmt: skip
    """Ranks per ring for every sequence (a list in plan order): ``ring_size`` checked.

    None: one ring of all ``size`` ranks; a number R: rings of R for every
    sequence; ``"auto"``: each sequence its own ring size
    (:func:`ringmpi.job.rings.assign_ring_sizes`: rings of one for short work,
    larger rings for sequences that would hold one rank too long or do not fit).
    """
    n = len(plan.sequences)
    if ring_size is None:
        return [size] * n
    if ring_size == "auto":
        return assign_ring_sizes(plan, size, layout, causal, budget, window)
    try:
        r = int(ring_size)
    except (TypeError, ValueError):
        msg = f"--ring-size must be a number of ranks or 'auto', not {ring_size!r}"
        raise InputError(msg) from None
    if r < 1 or size % r:
        raise InputError(f"--ring-size {r} does not divide the {size} ranks into whole rings")
    return [r] * n


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
    (:func:`ringmpi.grid`); the batches are dealt over the rings by their predicted
    cost (:func:`ringmpi.job.rings.deal`), each ring reads, computes and writes its
    own; output, resume markers, progress and summary stay one job. ``rope`` rotates
    the projected q and k of features inputs at their global positions within their
    packed sequence
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
    modifiers.check_tiles(spec, dev)  # a tile that cannot apply them: refused before any file
    blas = limit_blas(comm)  # before the calibration: it runs with the job's threads
    heap = keep_freed()  # freed batch buffers reused, not unmapped (this process only)
    notes = (blas.text,) + ((one_process_note(),) if size == 1 else ())
    layout, causal = spec.layout, spec.causal
    try:
        rate = measure_rate(plan, dev) if rank == 0 and not opts.quiet else 0.0
        sizes = run_on_root(comm, choose_ring_size, ring_size, plan, size, layout, causal,
                            budget, spec.window)  # fmt: skip
        run_everywhere(comm, lambda: [check_memory(plan, s, r, layout, budget)
                                      for s, r in zip(plan.sequences, sizes)])  # fmt: skip
        short = run_on_root(comm, lambda: [
            s.name for s, r in zip(plan.sequences, sizes)
            if r != size and min(s.length, s.length_k) < r
        ])  # fmt: skip
        if short:
            r = sizes[[s.name for s in plan.sequences].index(short[0])]
            raise InputError(f"sequence {short[0]} has fewer tokens than the {r} ranks of a ring")
        caps = {r: run_on_root(comm, batch_tokens, plan, r, layout, budget)
                for r in sorted(set(sizes))}  # fmt: skip
        ctx = JobContext(plan=plan, spec=spec, options=opts, comm=comm, ring=comm,
                         ring_size=max(sizes), device=dev, attrs={}, rate=rate, t_start=t_start,
                         started_utc=started_utc, output=output, notes=notes, budget=budget,
                         batch_tokens=caps[max(sizes)])  # fmt: skip
        return _job(ctx, sizes, caps)
    finally:
        heap.restore()
        blas.restore()


def _spec_attrs(spec: AttentionSpec) -> dict:
    """The spec's fields beyond those the output always records (causal, scale, layout, window).

    Every later field (a score modifier) lands in the attributes, the resume
    fingerprint and verify through here, by its own name.
    """
    skip = {"causal", "scale", "layout", "window", "cu_seqlens", "cu_seqlens_k", "head_parallel"}
    return {k: v for k, v in spec.to_attrs().items() if k not in skip}


def _job(ctx: JobContext, sizes: list, caps: dict) -> dict:
    """Open the output, run each phase's rings over their batches (collective).

    ``sizes``: ranks per ring of every sequence; ``caps``: batch tokens per ring size.
    """
    plan, spec, opts, comm = ctx.plan, ctx.spec, ctx.options, ctx.comm
    size = ctx.size
    todo_phases = phases(sizes)
    mixed = len(todo_phases) > 1
    nrings = size // min(sizes)
    mode = resolve_mode(opts.output_mode, comm, nrings)  # before anything is written
    layout, causal, scale = spec.layout, spec.causal, spec.scale
    rs = max(sizes) if mixed else sizes[0]
    meta = run_on_root(comm, fingerprint, plan, layout, causal, scale, size, rs)
    if mixed:  # which ring wrote which sequence: resume reads the parts by it
        meta["ring_size"] = "auto"
        meta["ring_sizes"] = [int(r) for r in sizes]
    # masks, positions and modifiers: a resumed run must use the same (compared via the manifest)
    meta["window"] = list(spec.window) if spec.window is not None else None
    meta["rope"] = list(ctx.rope) if ctx.rope else None
    meta.update(_spec_attrs(spec))
    # how sequences are packed into calls decides the rounding of each: resume must match
    tokens = [caps[r] for r, _ in todo_phases]
    meta["batch_tokens"] = tokens if mixed else tokens[0]
    attrs = run_on_root(comm, provenance, plan, layout, causal, scale, size, ctx.device,
                        window=spec.window, rope=ctx.rope)  # fmt: skip
    attrs.update(_spec_attrs(spec))
    attrs["ring_size"] = rs if not mixed else "auto"
    if mixed:
        attrs["ring_sizes"] = [int(r) for r in sizes]
    # what computes: a resume under another device, tile or CPU ISA would mix results
    meta["compute"] = [attrs.get(k) for k in ("device", "kernel", "isa")]
    ctx.attrs = attrs
    ring, across = _rings(comm, todo_phases[0][0], size)
    store = None
    try:
        store = make_store(mode, ctx.output, comm, plan, meta, attrs=attrs,
                           overwrite=opts.overwrite, compress=opts.compress, ring=ring,
                           **({"ring_sizes": sizes} if mixed else {}))  # fmt: skip
        done = store.open(opts.resume)
        # the batches follow from the plan alone (not from what is done), so a resumed
        # run computes every batch it redoes exactly as the first run did
        lefts = []
        for r, members in todo_phases:
            every = make_batches(plan, members, caps[r], size // r)
            lefts.append([b for b in every if not set(b.members) <= done])
        job_left = [(b, r) for (r, _), left in zip(todo_phases, lefts) for b in left]
        loops: list = []
        for p, ((r, _), left) in enumerate(zip(todo_phases, lefts)):
            if p:
                _free(ring, across)
                ring, across = None, None
                ring, across = _rings(comm, r, size)
                store.use_ring(ring)
            nr = size // r
            last = p == len(todo_phases) - 1
            # rank 0 builds the output's index while the other rings compute (several rings,
            # the part files): its ring is dealt that much less of the last phase
            ahead = last and nr > 1 and hasattr(store, "build_ahead")
            dealt = deal(plan, left, nr, spec.causal, spec.window, ctx.device,
                         head_start=len(plan.sequences) if ahead else 0)  # fmt: skip
            todo = dealt[0 if across is None else across.Get_rank()]
            pctx = dataclasses.replace(ctx, ring=ring, ring_size=r, batch_tokens=caps[r])
            loop = SequenceLoop(pctx, store, todo, left, done, before=loops, last=last,
                                job_left=job_left)  # fmt: skip
            loop.read_ahead()  # the first batch's read goes on while rank 0 builds the index
            if ahead:
                store.build_ahead([(b.members, rb) for b, rb in job_left])
            if last:
                return loop.run()
            loop.run()
            loops.append(loop)
        raise AssertionError("unreachable: the last phase returns")
    finally:
        if store is not None and hasattr(store, "discard"):
            store.discard()  # an index built ahead by a job that did not finish
        _free(ring, across)


def _rings(comm, r: int, size: int) -> tuple:
    """(this rank's ring of ``r`` ranks, the communicator across rings or None)."""
    return (comm, None) if r == size else grid(comm, ring_size=r)


def _free(ring, across) -> None:
    """Free a ring made by :func:`_rings` (the job's own communicator is kept)."""
    if across is not None:
        ring.Free()
        across.Free()
