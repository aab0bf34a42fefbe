"""The batch job behind ``ringmpi run``: read, ring attention, write, one sequence at a time.

:func:`run` sets the job up (plan, memory budget, device, rings, output) and
hands each ring's sequences to :class:`ringmpi.job.loop.SequenceLoop`.

Per sequence every rank reads only its own tokens (:class:`ringmpi.job.input.reader.Reader`),
calls :func:`ringmpi.ring_attention` and writes its part of the output
(:class:`ringmpi.job.output.parts.OutputStore`). While a sequence computes, a background
thread reads this rank's tokens of the next one. Only the main thread calls MPI
(so MPI_THREAD_FUNNELED suffices); the reader thread only calls h5py, which
releases the GIL inside the HDF5 read, so the read overlaps the compute.

Every step that can fail on a single rank (read, write) is followed by an
agreement (:func:`ringmpi.collective.run_everywhere`): a problem on any rank becomes
the same error on all ranks, so nobody waits forever.

A Ctrl-C or SIGTERM (caught as a flag by the command, :mod:`ringmpi.runtime.interrupt`)
stops the loop at the next tile chunk, ring step or read wait and leaves as
:class:`ringmpi.runtime.interrupt.Interrupted` carrying where it stopped; finished
sequences stay marked done for ``--resume``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Optional

import numpy as np

from ..collective import run_everywhere, run_on_root
from ..cost import flops as model_flops
from ..parallel import grid
from ..spec import AttentionSpec
from . import options as modifiers
from .input.scan import make_plan
from .loop import JobContext, SequenceLoop
from .options import JobOptions, split_keywords
from .output import make_store, resolve_mode
from .output.parts import fingerprint
from .plan import InputError, sliced, value_width
from .report import measure_rate, one_process_note, provenance, utc, visible_pairs
from .resources import (
    BALANCE,
    batch_tokens,
    check_memory,
    keep_freed,
    limit_blas,
    make_batches,
    memory_budget,
    rank_bytes,
    seq_counts,
)

__all__ = [
    "run",
    "pick_device",
    "gpu_probe",
    "choose_ring_size",
    "assign_ring_sizes",
    "phases",
    "divisors",
    "deal",
]


def choose_ring_size(
    ring_size, plan, size: int, layout: str, causal: bool, budget: int, window=None
) -> list:
    """Ranks per ring for every sequence (a list in plan order): ``ring_size`` checked.

    None: one ring of all ``size`` ranks; a number R: rings of R for every
    sequence; ``"auto"``: each sequence its own ring size
    (:func:`ringmpi.job.run.assign_ring_sizes`: rings of one for short work,
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
        (:class:`ringmpi.job.options.JobOptions`).
    comm : MPI communicator, optional
        Every rank of the job (None: this process alone).
    **keywords
        The older form: any field of either class by name, e.g.
        ``run(inputs, out, causal=True, device="cpu")`` (not together with the
        ``spec`` / ``options`` object holding the same field).

    ``ring_size=R`` (or ``"auto"``) splits the P ranks into P/R rings of R ranks
    (:func:`ringmpi.grid`); the batches are dealt over the rings by their predicted
    cost (:func:`ringmpi.job.run.deal`), each ring reads, computes and writes its
    own; output, resume markers, progress and summary stay one job. ``rope`` rotates
    the projected q and k of features inputs at their global positions within their
    packed sequence
    (:func:`ringmpi.rope.apply_rope` with ``rope_theta``, ``rope_scale``).

    ``output_mode``: ``"parts"`` (per-rank part files + a virtual-dataset file),
    ``"single"`` (one file written collectively, :mod:`ringmpi.job.output.single_file`; needs
    h5py with MPI and one ring) or ``"auto"`` (single where possible, else parts).

    Returns the summary dict (identical on every rank); raises InputError (the
    same on every rank) for bad input, output or memory budget, and
    :class:`ringmpi.runtime.interrupt.Interrupted` (``where`` filled in) when a recorded
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
    plan = make_plan(
        comm, inputs, opts.weights, 1 if ring_size not in (None, size) else size, rope=opts.rope
    )
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
    modifiers.check_masks(spec, plan, dev)  # the input's masks of slices and the options
    modifiers.check_reproducible(spec, dev)
    if spec.reproducible:
        # one sequence per ring call (a batch's packing would move the key blocks) and no
        # mid-sequence checkpoints (this mode's state is not the online softmax's): a
        # resume recomputes the sequence in progress, to the same bits
        opts = dataclasses.replace(opts, checkpoint_every=0.0)
    blas = limit_blas(comm)  # before the calibration: it runs with the job's threads
    heap = keep_freed()  # freed batch buffers reused, not unmapped (this process only)
    notes = (blas.text,) + ((one_process_note(),) if size == 1 else ())
    layout, causal = spec.layout, spec.causal
    try:
        rate = measure_rate(plan, dev) if rank == 0 and not opts.quiet else 0.0
        sizes = run_on_root(
            comm, choose_ring_size, ring_size, plan, size, layout, causal, budget, spec.window
        )
        run_everywhere(
            comm,
            lambda: [
                check_memory(plan, s, r, layout, budget) for s, r in zip(plan.sequences, sizes)
            ],
        )
        short = run_on_root(
            comm,
            lambda: [
                s.name
                for s, r in zip(plan.sequences, sizes)
                if r != size and min(s.length, s.length_k) < r
            ],
        )
        if short:
            r = sizes[[s.name for s in plan.sequences].index(short[0])]
            raise InputError(f"sequence {short[0]} has fewer tokens than the {r} ranks of a ring")
        caps = {
            r: 0 if spec.reproducible else run_on_root(comm, batch_tokens, plan, r, layout, budget)
            for r in sorted(set(sizes))
        }
        ctx = JobContext(
            plan=plan,
            spec=spec,
            options=opts,
            comm=comm,
            ring=_rings(comm, size, size)[0],  # the job's one ring (alone: COMM_SELF)
            ring_size=max(sizes),
            device=dev,
            attrs={},
            rate=rate,
            t_start=t_start,
            started_utc=started_utc,
            output=output,
            notes=notes,
            budget=budget,
            batch_tokens=caps[max(sizes)],
        )
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
    attrs = run_on_root(
        comm,
        provenance,
        plan,
        layout,
        causal,
        scale,
        size,
        ctx.device,
        window=spec.window,
        rope=ctx.rope,
    )
    attrs.update(_spec_attrs(spec))
    masked = sum(sliced(s) is not None for s in plan.sequences)
    if masked:  # each one's table is the 'slices' dataset beside its out
        attrs["mask_slices"] = int(masked)
    attrs["ring_size"] = rs if not mixed else "auto"
    if mixed:
        attrs["ring_sizes"] = [int(r) for r in sizes]
    # what computes: a resume under another device, tile or CPU ISA would mix results
    meta["compute"] = [attrs.get(k) for k in ("device", "kernel", "isa")]
    ctx.attrs = attrs
    ring, across = _rings(comm, todo_phases[0][0], size)
    store = None
    try:
        store = make_store(
            mode,
            ctx.output,
            comm,
            plan,
            meta,
            attrs=attrs,
            overwrite=opts.overwrite,
            compress=opts.compress,
            ring=ring,
            **({"ring_sizes": sizes} if mixed else {}),
        )
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
            dealt = deal(
                plan,
                left,
                nr,
                spec.causal,
                spec.window,
                ctx.device,
                head_start=len(plan.sequences) if ahead else 0,
            )
            todo = dealt[0 if across is None else across.Get_rank()]
            pctx = dataclasses.replace(ctx, ring=ring, ring_size=r, batch_tokens=caps[r])
            loop = SequenceLoop(
                pctx, store, todo, left, done, before=loops, last=last, job_left=job_left
            )
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
    """(this rank's ring of ``r`` ranks, the communicator across rings or None).

    A job without a communicator computes alone: its ring is COMM_SELF (the ring's
    default, COMM_WORLD, would wait for the other ranks of a launch that run
    something else).
    """
    if comm is None:
        from mpi4py import MPI

        return MPI.COMM_SELF, None
    return (comm, None) if r == size else grid(comm, ring_size=r)


def _free(ring, across) -> None:
    """Free a ring made by :func:`_rings` (the job's own communicator is kept)."""
    if across is not None:
        ring.Free()
        across.Free()


# ----------------------------------------------------------------------
# Which device the batch job computes on: a GPU on every rank, or the CPUs.


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


# ----------------------------------------------------------------------
# Ring size per sequence under ``--ring-size auto``: one rank for short work, more for long.
#
# A dataset of many sequences is data-parallel work: a ring of one rank per
# sequence has no exchange at all, and many rings share the sequences. A
# sequence whose compute alone would hold one rank for a good part of the
# job's time is the opposite: the rings of one would wait for it at the end
# (and its memory may need more ranks), so it gets a larger ring. The rule,
# from the plan alone (the same on every run, so ``--resume`` finds the same
# assignment):
#
# * work of a sequence ``w`` = its model flops (visible pairs of the mask);
#   one rank's fair share of the job ``W / P``;
# * a sequence takes the smallest ring size R (a divisor of P) with
#   ``w / R <= W / (P x BALANCE)`` (no call holds its ring longer than a
#   ``1/BALANCE`` share of one rank's time), whose per-rank memory fits the
#   budget and whose every rank gets tokens (R <= the sequence's length);
#   else the largest ring that the sequence's length allows.
#
# The job then runs one *phase* per ring size, the largest first
# (:func:`phases`): the ranks form rings of that size, deal that phase's
# batches by cost (:func:`deal`), and move on together; one output, one marker per batch,
# one summary (``ring_sizes``: tokens per ring size).


# The dealing's cost model (seconds; only the ratios matter, the same on every rank): a
# batch costs its model flops at the tile's rate, its bytes read and written (with the
# copies and the short-sequence overheads that grow with its tokens), a fixed cost per
# sequence and one per batch (its ring call, part file and marker); rank 0 also builds the
# output's virtual-dataset file, so its ring starts with that much work already dealt.
# Fitted to the batches of the 2,000-sequence benchmark (2-core AVX-512 machine, P = 2,
# rings of one, direct I/O; 15 batches, residuals within 0.06 s but for one of 0.15 s):
# 105-110 GFLOP/s and ~3.8 ms per 1,000 tokens (~0.8 GB/s of the 3 kB a token reads and
# writes); the index ~0.5 ms per sequence.
RATE = {"cpu": 100e9, "gpu": 20e12}  # flop/s
IO_BYTES_S = 0.8e9
SEQ_S = 3e-4
BATCH_S = 4e-3
INDEX_SEQ_S = 0.5e-3


def divisors(n: int) -> list:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def assign_ring_sizes(plan, size: int, layout: str, causal: bool, budget: int, window=None) -> list:
    """Ranks per ring for every sequence of ``plan`` (a list, in plan order), as the module says.

    Parameters
    ----------
    plan : ringmpi.job.plan.Plan
    size : int
        Ranks of the job P.
    layout : str
        Token layout (sizes the per-rank memory).
    causal : bool
    budget : int
        Per-rank memory budget (bytes).
    window : (left, right), optional
        Sliding window (fewer visible pairs).
    """
    seqs = plan.sequences
    work = [float(visible_pairs(s, causal, window)) for s in seqs]
    limit = sum(work) / (size * BALANCE)
    many = len(seqs) > 1
    out = []
    for s, w in zip(seqs, work):
        shortest = min(s.length, s.length_k)
        pick = None
        for r in divisors(size):
            if r > 1 and r > shortest:
                break
            n, nk = seq_counts(s, r, layout)
            fits = rank_bytes(plan, n, prefetch=many, n_local_k=nk, ranks=r) <= budget
            if fits and w / r <= limit:
                pick = r
                break
        if pick is None:  # the largest ring the sequence can feed (memory is checked later)
            pick = max(r for r in divisors(size) if r == 1 or r <= shortest)
        out.append(pick)
    return out


def phases(sizes: list) -> list:
    """[(ring size, plan indices in order), ...], the largest ring size first."""
    by: dict = {}
    for i, r in enumerate(sizes):
        by.setdefault(int(r), []).append(i)
    return [(r, by[r]) for r in sorted(by, reverse=True)]


def deal(
    plan,
    batches: list,
    rings: int,
    causal: bool,
    window=None,
    device: str = "cpu",
    head_start: int = 0,
) -> list:
    """Batches per ring: the dearest first, each to the ring with the least work dealt so far.

    Longest-processing-time-first list scheduling: the rings' predicted times end
    within the cheapest batch dealt last of each other (dealing in the phase's order
    could leave a dear batch for last and one ring computing it alone).

    Parameters
    ----------
    plan : ringmpi.job.plan.Plan
    batches : list of ringmpi.job.resources.Batch
        The phase's batches, in order.
    rings : int
        Rings sharing them.
    causal, window :
        The mask (the batches' visible pairs).
    device : str
        ``cpu`` or ``gpu`` (the rate of the cost model).
    head_start : int
        Sequences whose virtual-dataset entries ring 0's first rank builds meanwhile
        (``INDEX_SEQ_S`` each, dealt to ring 0 before any batch).

    Returns
    -------
    list of lists of Batch, one per ring, each in the phase's order. Without a head
    start and with equal costs this is the round-robin.
    """
    per_flop = 1.0 / RATE.get(device, RATE["cpu"])
    # a token's q and out (H heads), k and v (Hkv heads): Dk + Dv elements per head
    row = (plan.head_dim + value_width(plan)) * np.dtype(plan.dtype).itemsize
    costs = []
    for b in batches:
        seqs = [plan.sequences[i] for i in b.members]
        flops = sum(
            model_flops(
                visible_pairs(s, causal, window), plan.head_dim, plan.heads, dv=value_width(plan)
            )
            for s in seqs
        )
        nbytes = (b.length * plan.heads + b.length_k * plan.kv_heads) * row
        costs.append(flops * per_flop + nbytes / IO_BYTES_S + len(seqs) * SEQ_S + BATCH_S)
    load = [0.0] * rings
    load[0] = head_start * INDEX_SEQ_S
    mine: list = [[] for _ in range(rings)]
    for j in sorted(range(len(batches)), key=lambda j: (-costs[j], j)):
        r = min(range(rings), key=lambda x: (load[x], x))
        mine[r].append(j)
        load[r] += costs[j]
    return [[batches[j] for j in sorted(js)] for js in mine]
