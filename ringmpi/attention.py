"""The ring loop: exact softmax attention over a sequence split across MPI ranks.

Every rank keeps its queries and the online-softmax state at home. K and V
travel together in one packed buffer: at step s rank r holds the block that
rank (r - s) mod P started with. Before computing on that block the rank has
already posted the exchange that brings the next one, so the transfer runs
while the tile kernel works. After P steps every query has met every key.

Per step a rank computes 4 * Sq * Sk * D * H flops (fewer under a causal mask,
whose fully masked tiles are skipped) and sends 2 * Sk * Hkv * D elements; with
keys and values of different widths, 2 * Sq * Sk * (Dk + Dv) * H flops and
Sk * Hkv * (Dk + Dv) elements.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from typing import Callable, Optional

from mpi4py import MPI

from . import cost, reproducible_float32, softmax
from .arguments import RingArgs, agree, report, to_internal
from .layout import positions
from .mask import plan_steps, tile_modifiers
from .parallel import HeadGroups
from .reproducible import loop as reproducible_loop
from .ring import KVRing
from .runtime import interrupt
from .runtime.watchdog import watch
from .spec import AttentionSpec, spec_keywords

__all__ = ["ring_attention", "resumable_ring_attention"]


@spec_keywords
def ring_attention(
    q,
    k,
    v,
    comm: Optional[MPI.Comm] = None,
    *,
    causal: bool = False,
    layout: str = "zigzag",
    scale: Optional[float] = None,
    return_lse: bool = False,
    check_finite: bool = False,
    stats: Optional[dict] = None,
    on_step: Optional[Callable[[int, int], None]] = None,
    head_parallel: int = 1,
    window: Optional[tuple] = None,
    cu_seqlens=None,
    cu_seqlens_k=None,
    slices=None,
    on_tick: Optional[Callable[[int], None]] = None,
    reproducible: bool = False,
    spec: Optional[AttentionSpec] = None,
    **modifiers,
):
    """Exact softmax attention of this rank's queries against the whole sequence.

    Parameters
    ----------
    q : array (S_local, H, Dk) or (B, S_local, H, Dk)
        This rank's queries, laid out as ``ringmpi.shard(..., layout=layout)``.
        numpy arrays run on the CPU, CuPy arrays on the GPU.
    k : array (S_local, Hkv, Dk) or (B, S_local, Hkv, Dk)
    v : array (S_local, Hkv, Dv) or (B, S_local, Hkv, Dv)
        This rank's keys and values; H % Hkv == 0 (grouped-query attention). The
        value width Dv may differ from the key width Dk (multi-head latent
        attention, e.g. Dk = 192, Dv = 128, or one latent head with Dk = 576,
        Dv = 512); K and V still travel the ring in one message.
    comm : mpi4py.MPI.Comm, optional
        The ranks holding the sequence, in ring order. Default MPI.COMM_WORLD.
    causal : bool
        Query at global position i sees keys at positions <= i.
    layout : {"zigzag", "striped", "contiguous", "balanced"}
        How tokens are spread over ranks; must match how q, k, v were cut.
    scale : float, optional
        Score scale, default 1/sqrt(Dk).
    return_lse : bool
        Also return the log-sum-exp of the scores, (..., H, S_local).
    check_finite : bool
        Raise ValueError on every rank if any input holds NaN or Inf.
        Without it, NaN in an input propagates to the outputs it touches.
    stats : dict, optional
        Filled with compute_s, wait_s, total_s, flops (of the visible pairs, the
        same on every backend: :mod:`ringmpi.cost`), tile_flops (what the tiles
        computed, masked parts of their blocks included), steps (run), steps_computed
        (by this rank), steps_skipped (ring size - steps), steps_resumed (the
        ring step a resumed call started at, else 0), bytes_sent (K/V, this
        rank), alltoall_bytes (heads x ring), backend and tile (what ran:
        :meth:`ringmpi.backend.Backend.describe`).
    on_step : callable, optional
        Called as on_step(step, nsteps) after each ring step.
    on_tick : callable, optional
        Called as on_tick(step) (0-based) from the tile's progress callback,
        many times per ring step (the fused CPU tile: every 512 query rows of all
        heads), e.g. for a progress display. Must be cheap and must not raise.
    window : (left, right), optional
        Query at position i sees keys i - left <= j <= i + right (within its
        sequence, aligned bottom-right for cross-attention); -1 is unbounded.
        Under ``causal`` the right side is 0.
    cu_seqlens : int array, optional
        Global offsets [0, n1, n1+n2, ..., N] of packed sequences, the same on
        every rank: tokens attend only within their sequence; the layout applies
        within each (cut with ``shard(..., cu_seqlens=...)``).
    cu_seqlens_k : int array, optional
        Key/value offsets for cross-attention with packed sequences (default
        ``cu_seqlens``). q may hold a different total length than k/v
        (cross-attention, each cut by the same layout over its own length).
    slices : ringmpi.Slices, optional
        The whole mask as a union of slices of global positions (issue 41;
        :mod:`ringmpi.slices`), the same on every rank; leave ``causal``, ``window``
        and the offsets at their defaults. Numpy arrays only (the CPU tiles).
    head_parallel : int
        U > 1 runs heads x ring on P = U x R ranks (:mod:`ringmpi.parallel`): an
        all-to-all inside each group of U consecutive ranks turns sequence shards
        into head shards, the ring runs over the R groups. Cut the inputs with
        ``shard(..., head_parallel=U)``. numpy arrays only.
    reproducible : bool
        out and lse bitwise the same for the same global inputs whatever the number
        of ranks, the layout, the thread counts and the CPU ISA path (issue 40;
        :mod:`ringmpi.reproducible`, docs/reproducible.md): numpy arrays, forward,
        with softcap, ALiBi and sinks, no slices yet; slower than the default.
    {modifiers}
    spec : ringmpi.spec.AttentionSpec, optional
        All of causal, layout, scale, head_parallel, window, cu_seqlens,
        cu_seqlens_k, slices, reproducible and the score modifiers as one value (then leave
        those keywords at their defaults).

    Returns
    -------
    out : array (..., S_local, H, Dv), the dtype of q
    lse : array (..., H, S_local), float32 (float64 for float64 inputs); only
        with ``return_lse=True``.

    Raises
    ------
    KeyboardInterrupt
        On Ctrl-C, promptly (within one tile chunk), also from inside the C
        kernel; the ring's pending transfers are cancelled (:mod:`ringmpi.runtime.interrupt`).
    """
    t_start = time.perf_counter()
    comm = MPI.COMM_WORLD if comm is None else comm
    spec = AttentionSpec.of(
        spec,
        causal=causal,
        layout=layout,
        scale=scale,
        window=window,
        cu_seqlens=cu_seqlens,
        cu_seqlens_k=cu_seqlens_k,
        slices=slices,
        head_parallel=head_parallel,
        reproducible=reproducible,
        **modifiers,
    )
    arrays = {"q": q, "k": k, "v": v}
    args = agree(comm, spec, arrays, what="ring_attention", check_finite=check_finite)
    be = args.backend
    with HeadGroups(comm, args, q.shape[-2], k.shape[-2]) as groups:
        qi, ki, vi = (
            to_internal(be.xp, groups.scatter(_batched(x), kind), args.tile_dtype)
            for x, kind in ((q, "q"), (k, "kv"), (v, "kv"))
        )
        del arrays
        run = _loop
        if args.spec.reproducible:  # one pass with windows (the same guarantee) where it runs
            fast = any(
                test(args.spec, args.tile_dtype, args.nk)
                for test in (reproducible_float32.eligible, reproducible_float32.eligible_float64)
            )
            run = reproducible_float32.loop if fast else reproducible_loop
        out, lse, st = run(
            groups.ring, args, qi, ki, vi, on_step, on_tick, groups.heads, *_SEAM.get()
        )
        out, lse = groups.gather(out, "q"), groups.gather(lse, "lse")
    out = be.cast_out(out, args.in_dtype)
    if not args.batched:
        out, lse = out[0], lse[0]
    report(
        stats,
        t_start,
        **st,
        alltoall_bytes=groups.alltoall_bytes,
        backend=be.name,
        tile=be.describe(),
    )
    return (out, lse) if return_lse else out


# The checkpoint seam of the batch job: (on_state, start) of the resumable call in progress
# in this context, (None, None) otherwise. Set only by resumable_ring_attention.
_SEAM: ContextVar = ContextVar("ringmpi_checkpoint_seam", default=(None, None))


def resumable_ring_attention(q, k, v, comm=None, *, on_state=None, start=None, **kwargs):
    """:func:`ring_attention` that saves its state after each ring step and resumes from one.

    The checkpoint seam of the batch job (:mod:`ringmpi.job.output.checkpoint`); not
    part of ``import ringmpi``. Every other argument is that of :func:`ring_attention`.

    Parameters
    ----------
    on_state : callable, optional
        Called as ``on_state(done, acc, m, l)`` after each completed ring step (``done``
        = steps completed, 1..nsteps, the same on every rank) with this rank's running
        state itself, not a copy: acc (B, H, S, D), m and l (B, H, S) in the tile layout
        and accumulation dtype (device arrays on the GPU). Save, never modify.
    start : (done, acc, m, l), optional
        Resume a ring after ``done`` completed steps from a state saved by ``on_state``
        (same call, same ranks): the block this rank holds at step ``done`` is fetched
        by one exchange shifted by ``done`` and the ring goes on with the same tile calls
        on the same blocks in the same order, so out and lse are bitwise those of an
        uninterrupted call. ``done`` must be the same on every rank (agreed here: a
        ValueError on every rank otherwise).

    Pass ``on_state`` and/or ``start`` on every rank of the call or on none: a call
    using them adds one small allgather (the agreement on ``done``).
    """
    token = _SEAM.set((on_state, start))
    try:
        return ring_attention(q, k, v, comm, **kwargs)
    finally:
        _SEAM.reset(token)


def _batched(x):
    return x if x.ndim == 4 else x[None]


def _loop(
    comm, args: RingArgs, qi, ki, vi, on_step, on_tick, heads=slice(None), on_state=None, start=None
) -> tuple:
    """The forward ring over ``comm``: (out (B, S, H, Dv) in the accumulation dtype, lse, stats).

    Parameters
    ----------
    qi : (B, H, S, Dk) ; ki : (B, Hkv, S_k, Dk) ; vi : (B, Hkv, S_k, Dv)
        This ring position's queries and K/V block, in the tile layout and dtype.
    heads : slice
        The query heads of ``qi`` among the call's (heads x ring), for per-head options.
    on_state, start :
        The checkpoint seam: those of :func:`resumable_ring_attention`.
    """
    be, mask, layout = args.backend, args.mask, args.layout
    rank, size = comm.Get_rank(), comm.Get_size()
    plan = plan_steps(mask, rank, size, layout)
    masked = {} if plan.bounds is None else {"bounds": plan.bounds}
    masked.update(tile_modifiers(args.spec, mask, plan.q_pos, heads))
    b, h, _, d = qi.shape
    dv = vi.shape[-1]  # the value width: acc and out have it (Dv may differ from Dk)
    acc, m, l = softmax.init_state((b, h, qi.shape[2], dv), args.acc_dtype, be.xp)
    seam = start is not None or on_state is not None  # the same on every rank (documented)
    first = _resume_from(comm, start, plan.nsteps, (acc, m, l)) if seam else 0
    if first:
        acc, m, l = (be.xp.array(x, copy=True) for x in start[1:])  # the caller's stay as they are
    flops, tile_flops, compute_s, computed = 0, 0, 0.0, 0
    kv_ring = KVRing(comm, be, ki, vi, args.counts_k, plan.nsteps, first=first)
    with interrupt.catching(), kv_ring as kv:
        del ki, vi
        progress = kv.ring.test
        for step, src, kb, vb in kv:
            if on_tick is not None:

                def progress(step=step):
                    kv.ring.test()
                    on_tick(step)

            if plan.compute[step]:
                t0 = time.perf_counter()
                k_pos = positions(args.nk, src, size, layout, cu_seqlens=mask.cu_k, mask=mask)
                tile_flops += plan.tile_at(be.forward_tile, step)(
                    qi,
                    kb,
                    vb,
                    plan.q_pos,
                    k_pos,
                    acc,
                    m,
                    l,
                    scale=args.scale,
                    causal=args.causal,
                    progress=progress,
                    **masked,
                )
                compute_s += time.perf_counter() - t0
                pairs = plan.pairs(step, k_pos, args.causal)
                flops += cost.flops(pairs, d, h, b, dv=dv)
                computed += 1
            if on_state is not None:
                on_state(step + 1, acc, m, l)
            if on_step is not None:
                on_step(step + 1, plan.nsteps)
    sinks = args.spec.sinks
    out, lse = be.finish(acc, m, l, sinks=None if sinks is None else sinks[heads])
    stats = dict(
        compute_s=compute_s,
        wait_s=kv.ring.wait_s,
        flops=flops,
        tile_flops=tile_flops,
        steps=plan.nsteps,
        steps_computed=computed,
        steps_skipped=size - plan.nsteps,
        steps_resumed=first,
        bytes_sent=kv.bytes_sent,
    )
    return out, lse, stats


def _resume_from(comm, start, nsteps: int, state: tuple) -> int:
    """The ring step a resumed call starts at (0: from the start), agreed over ``comm``.

    Every rank must pass the same ``done`` (0 <= done <= nsteps) and a state of the
    shapes and dtypes of ``state`` (acc, m, l); otherwise every rank raises the same
    ValueError. One small allgather, only in calls that use the checkpoint seam.
    """
    done, why = 0, ""
    if start is not None:
        done = start[0]
        got = [
            (tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__)))
            for x in start[1:]
        ]
        want = [(tuple(x.shape), str(x.dtype)) for x in state]
        if type(done) is not int or not 0 <= done <= nsteps:
            why = f"start: ring step {done!r} is not in 0..{nsteps}"
        elif got != want:
            why = f"start: a state of (shape, dtype) {got}, the ring's is {want}"
    with watch("agreeing on the ring step to resume at with the other ranks"):
        got = comm.allgather((done, why))
    bad = [f"rank {r}: {w}" for r, (_, w) in enumerate(got) if w]
    if not bad and len({s for s, _ in got}) > 1:
        bad = [f"ranks resume at different ring steps {[s for s, _ in got]}"]
    if bad:
        raise ValueError("ring_attention: " + "; ".join(bad))
    return done
