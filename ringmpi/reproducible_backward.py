"""Reproducible backward (issue 40): dq, dk, dv (dsinks) bitwise independent of P, layout, threads.

``ring_attention_backward(..., reproducible=True)`` replaces the backward ring loop of
:mod:`ringmpi.backward` by :func:`loop`. With the forward's out and lse (whatever
bits they have) the gradients are

- P_ij = :func:`~ringmpi.reproducible.det_exp` (s_ij - lse_i), s_ij the float64
  score chain of :func:`~ringmpi.reproducible.scores` (0 for an invisible key), then
  through the forward's softcap and ALiBi (:func:`modify_batched`, the operations of
  :func:`~ringmpi.reproducible.modify`),
- delta_i = ((dO_i0 O_i0 + dO_i1 O_i1) + ...) and dP_ij = ((dO_i0 v_j0 + ...) ...),
  both in index order in float64,
- dS_ij = P_ij (dP_ij - delta_i), times softcap's derivative 1 - t_ij^2 (t_ij the
  det_tanh value of the forward's score; ALiBi adds a constant: no factor),
- dQ_i = scale sum_j dS_ij k_j, dK_j = scale sum_i dS_ij q_i, dV_j = sum_i P_ij dO_i,
- with sinks, dsinks_h = -sum_i det_exp(sink_h - lse_i) delta_i over every batch and
  row (:func:`sink_grad`: the lse includes the sink, a key of value 0).

Both the query rows and the keys are dealt out in fixed global blocks of
:data:`~ringmpi.reproducible.KEY_BLOCK` positions (one ``Alltoallv`` each, like
:func:`~ringmpi.reproducible.deal_keys`), so every (query block, key block) tile is held
whole by one rank. A tile gives, in float64 and in a fixed order, the block partials
of the three sums: over its keys in key order (dQ) and over its rows in row order
(dK, dV). Each partial is split on fixed grids (:func:`~ringmpi.reproducible.grids`,
from global counts and global bounds of the summands found by exact maxima) into fold
parts whose sums are exact in float64 in any order: the dQ folds stay with the query
block, the dK/dV folds travel the ring with their K/V block and come home after P
hops. Each gradient row is then the fold sums added in fold order, times the scale,
rounded once to the input dtype, and dealt back to the rank and place the layout gives
it. dsinks sums per-row terms held by every rank: fold parts on grids of its own, one
exact ``Allreduce``, the folds added in fold order. Only elementwise numpy operations
(correctly rounded per element, whatever the shape, the threads or the SIMD loop) touch
a value; no BLAS, no ``np.exp``/``np.log``/``np.tanh``. A tile runs in the C kernel
``kernels/cpu_reproducible_backward.c`` (:mod:`ringmpi.cpu.fused_reproducible_backward`:
the same operations in the same order, the same bits on every ISA path) or, with
``RINGMPI_CPU_KERNEL=numpy`` or where it cannot be built, in :func:`_tile`, its oracle
(:func:`kernel`); both have the score modifiers.

Where the forward ran the float32 method (:func:`ringmpi.reproducible_float32.eligible`:
float32 values, no softcap, no ALiBi), the backward is that method's too: the blocks are
256 positions, the forward's float32 scores, P = exp2f of them against lse / ln 2, and
float32 fused multiply-add chains of 64 rows or keys per sub-tile
(:func:`ringmpi.reproducible_float32.backward_step`, the C kernel's ``rmf_backward``),
their block partials folded on the same grids (2 levels: the results are float32).
docs/reproducible.md has the argument and the limits.
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np
from mpi4py import MPI

from . import cost, reproducible_float32
from .arguments import report
from .cpu import fused_reproducible_backward, fused_reproducible_float32
from .layout import positions
from .parallel import HeadGroups
from .reproducible import (
    KEY_BLOCK,
    block_starts,
    choose_kernel,
    deal_rows,
    det_exp,
    det_tanh,
    fold_into,
    folds,
    grids,
    moves_nothing,
    score_modifiers,
    side_by_side,
    undeal_rows,
    visible_ranges,
)
from .runtime.watchdog import watch

__all__ = [
    "backward",
    "loop",
    "sink_grad",
    "kernel",
    "P_BOUND",
]

P_BOUND = 2.0  # the bound the grids assume for P = exp(s - lse); checked after the ring


def backward(comm, args, dout, q, k, v, out, lse, stats, t_start):
    """:func:`ringmpi.backward.ring_attention_backward` after its checks, in this mode.

    ``args``: what every rank agreed on (:func:`ringmpi.arguments.agree`); the arrays as
    the caller gave them. Returns (dq, dk, dv) with the shapes and dtypes of q, k, v,
    and dsinks (H,) in the accumulation dtype after them when the call has sinks (as the
    default mode); fills ``stats`` like the default mode.

    Heads x ring (``head_parallel`` = U > 1): each member runs :func:`loop` on its head
    group's ring for its query heads and the K/V heads they read. dq and dsinks of a
    head depend on nothing outside it; so do dk, dv where the K/V heads are split over
    the group (Hkv % U == 0). Where members share a K/V head (U % Hkv == 0, Hkv < U),
    each holds its heads' fold sums of its dk, dv on the grids of P = 1 (bounds joined
    over the members): their exact sum over the members is the P = 1 fold sum. The
    gradients are the P = 1 bits either way.
    """
    lse = np.asarray(lse)
    h, hkv = q.shape[-2], k.shape[-2]
    u = args.spec.head_parallel
    with HeadGroups(comm, args, h, hkv) as groups:
        share = None
        if u > 1 and hkv % u:  # K/V heads replicated: the members holding the same one
            share = groups.head.Split((groups.me * h // u) // (h // hkv), groups.me)
        kinds = ((q, "q"), (k, "kv"), (v, "kv"), (dout, "q"), (out, "q"))
        cut = [groups.scatter(x if x.ndim == 4 else x[None], kind) for x, kind in kinds]
        lse_g = groups.scatter(lse if lse.ndim == 3 else lse[None], "lse")
        inner = [np.moveaxis(x, -3, -2) for x in cut]
        del cut
        try:
            dq, dk, dv, st = loop(groups.ring, args, *inner, lse_g, heads=groups.heads,
                                  share=share, g_all=h // hkv, world=comm)  # fmt: skip
        finally:
            if share is not None:
                share.Free()
        # back to sequence shards: a permutation of the rounded gradients (heads disjoint)
        grads = [groups.gather(np.moveaxis(g, -2, -3), kind)
                 for g, kind in ((dq, "q"), (dk, "kv"), (dv, "kv"))]  # fmt: skip
        if args.spec.sinks is not None:  # this member's heads, then every head in order
            ds = sink_grad(groups.ring, args, inner[3], inner[4], lse_g, groups.heads, comm)
            grads.append(ds if u == 1 else np.concatenate(groups.head.allgather(ds)))
    out_ = []
    for g, like in zip(grads[:3], (q, k, v)):
        g = np.ascontiguousarray(g)
        out_.append(g if like.ndim == 4 else g[0])
    st["alltoall_bytes"] += groups.alltoall_bytes
    report(stats, t_start, **st, backend=args.backend.name)
    return (*out_, *grads[3:])


def sink_grad(comm, args, dout, out, lse, heads=slice(None), world=None):
    """dsinks (H,) in the accumulation dtype, the same bits on every rank for every P.

    dsinks_h = -sum over batches and rows i of t_i, t_i = det_exp(sink_h - lse_i) delta_i
    (the sink is a key of value 0 whose probability the forward's lse includes; delta_i
    the fixed chain of :func:`loop`). Each t_i is a function of row i's values alone.
    The rows lie on every rank, so the sum is made exact: each rank splits its t_i on
    fixed grids (:func:`~ringmpi.reproducible.grids`, from the global count B Nq and the
    exact global max |t| per head, an ``Allreduce(MAX)``) and sums the fold parts
    exactly; an ``Allreduce(SUM)`` of the fold sums is exact in any order (every partial
    sum of fold parts is); the folds are then added in fold order, negated and rounded
    once.

    Parameters
    ----------
    dout, out : (B, H, S, Dv) ; lse : (B, H, S)
        This rank's rows as the caller gave them (the first ``len(q_pos)`` real).
    heads : slice
        The call's heads that ``dout`` holds (heads x ring): dsinks of those.
    world : mpi4py.MPI.Comm, optional
        Every rank of the call (default ``comm``): the bound check fails on all together.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    mask = args.mask
    nq = int(args.n)
    nql = len(positions(nq, rank, size, args.layout, cu_seqlens=mask.cu_q, mask=mask))
    b = dout.shape[0]
    sinks = np.asarray(args.spec.sinks, dtype=np.float64)[heads]  # the heads of dout
    do64, o64 = (np.asarray(x, dtype=np.float64)[:, :, :nql] for x in (dout, out))
    delta = _row_dot(do64, o64)  # loop's chain: the same numbers
    with np.errstate(invalid="ignore", over="ignore"):
        p = det_exp(sinks[None, :, None] - np.asarray(lse, dtype=np.float64)[:, :, :nql])
    term = p * delta  # (B, H, nql)
    term = np.moveaxis(term, 1, 0).reshape(len(sinks), b * nql)  # (H, rows)
    top = np.zeros((2, len(sinks)))  # max P_sink (the bound loop checks), max |t|
    if term.shape[1]:
        top[0], top[1] = p.max(axis=(0, 2)), np.abs(term).max(axis=1)
    comm.Allreduce(MPI.IN_PLACE, top, op=MPI.MAX)
    if world is not None and world is not comm:  # the other head groups' verdicts too
        top[0] = world.allreduce(float(top[0].max()) if top.shape[1] else 0.0, op=MPI.MAX)
    if top.shape[1] and top[0].max() > P_BOUND:  # NaN passes (and gives NaN), as in loop
        raise ValueError(
            "ring_attention_backward(reproducible=True): exp(sink - lse) reached "
            f"{top[0].max():.3g} > {P_BOUND}: lse is not the forward's log-sum-exp of these inputs"
        )
    n = max(b * nq, 1)
    nf = folds(n, np.float64)
    parts = np.zeros((nf, len(sinks)))
    fold_into(term, [c[:, None] for c in grids(n, top[1], nf)], list(parts), 1)
    comm.Allreduce(MPI.IN_PLACE, parts, op=MPI.SUM)  # exact: multiples of each fold's quantum
    return (-_total(list(parts))).astype(args.acc_dtype)


def _chain(w, x, axis_rows: bool):
    """Block partials of ``w``-weighted rows of ``x`` in a fixed order, in float64.

    ``axis_rows`` False: out[..., i, :] = ((w_i0 x_0 + w_i1 x_1) + ...) over keys j
    (w (..., r, c), x (..., c, D)); True: out[..., j, :] = ((w_0j x_0 + w_1j x_1) + ...)
    over rows i (x (..., r, D)). Elementwise operations only (one product and one
    addition per term, each correctly rounded: the memory layout changes no bit).
    """
    if axis_rows:
        ws = np.ascontiguousarray(np.moveaxis(w, -2, 0))[..., None]  # (r, ..., c, 1)
    else:
        ws = np.ascontiguousarray(np.moveaxis(w, -1, 0))[..., None]  # (c, ..., r, 1)
    xs = np.ascontiguousarray(np.moveaxis(x, -2, 0))[..., None, :]  # (n, ..., 1, D)
    return _terms(ws, xs)


def _dots(a, b):
    """(..., r, c) float64 chains ((a_0 b_0 + a_1 b_1) + ...) over the last axis (index order).

    The operations of :func:`ringmpi.reproducible.scores` with the scale 1, batched over
    the leading axes (each entry the same number whatever the shape of the call).
    """
    at = np.ascontiguousarray(np.moveaxis(a, -1, 0))[..., None]  # (D, ..., r, 1)
    bt = np.ascontiguousarray(np.moveaxis(b, -1, 0))[..., None, :]  # (D, ..., 1, c)
    return _terms(at, bt)


def _terms(a, b):
    """((a_0 b_0 + a_1 b_1) + a_2 b_2) + ... over the first axis, broadcast elementwise.

    One correctly rounded product and one addition per term, in index order, into a
    buffer reused for the products: each entry is the same number whatever the shape.
    """
    s = a[0] * b[0]
    tmp = np.empty_like(s)
    for j in range(1, len(a)):
        np.multiply(a[j], b[j], out=tmp)
        s += tmp
    return s


def _row_dot(a, b):
    """(...,) float64 chains ((a_0 b_0 + a_1 b_1) + ...) over the last axis, in index order.

    ``a`` (B, H, n, D), ``b`` broadcasting to it. Rows in chunks, so the column passes of a
    chunk stay in the caches (the same operations per row)."""
    a = np.asarray(a)
    b = np.broadcast_to(b, a.shape)
    out = np.empty(a.shape[:3])
    for r0 in range(0, a.shape[2], 2048):
        out[:, :, r0 : r0 + 2048] = _row_dot_chunk(a[:, :, r0 : r0 + 2048], b[:, :, r0 : r0 + 2048])
    return out


def _row_dot_chunk(a, b):
    """:func:`_row_dot` of one chunk: column by column, one product and one addition each."""
    s = a[..., 0] * b[..., 0]
    tmp = np.empty_like(s)
    for j in range(1, a.shape[-1]):
        np.multiply(a[..., j], b[..., j], out=tmp)
        s += tmp
    return s


def loop(comm, args, q, k, v, dout, out, lse, heads=slice(None), share=None, g_all=None,
         world=None) -> tuple:  # fmt: skip
    """The reproducible backward over ``comm``: (dq, dk, dv, stats) in the tile layout.

    Parameters
    ----------
    q : (B, H, S, Dk) ; dout, out : (B, H, S, Dv) ; lse : (B, H, S)
        This rank's query rows in the layout's order (any float dtype; used as float64).
    k : (B, Hkv, S_k, Dk) ; v : (B, Hkv, S_k, Dv)
        This rank's keys and values.
    heads : slice
        The query heads of ``q`` among the call's (heads x ring), for the per-head ALiBi
        slopes.
    share : mpi4py.MPI.Comm, optional
        Heads x ring with K/V heads replicated over the group: the members holding the
        same K/V heads (and key blocks). Their bounds are joined (so the grids are those
        of P = 1) and their dK/dV fold sums added, exactly, before the totals.
    g_all : int, optional
        Query heads per K/V head in the whole call (default H / Hkv here): the grids'
        summand count.
    world : mpi4py.MPI.Comm, optional
        Every rank of the call (default ``comm``): the bound check fails on all together.

    Returns
    -------
    dq (B, H, S, Dk), dk (B, Hkv, S_k, Dk), dv (B, Hkv, S_k, Dv) in the input dtype (each
    rounded once from float64), stats : dict.
    """
    t_wait = 0.0
    rank, size = comm.Get_rank(), comm.Get_size()
    mask, layout = args.mask, args.layout
    dtype = np.dtype(args.in_dtype)
    b, h, sq, dk_w = q.shape
    hkv, sk, dv_w = k.shape[1], k.shape[2], v.shape[-1]
    g = h // hkv
    kh = np.arange(h) // g
    nq, nk = int(args.n), int(args.nk)
    q_pos = positions(nq, rank, size, layout, cu_seqlens=mask.cu_q, mask=mask)
    k_pos = positions(nk, rank, size, layout, cu_seqlens=mask.cu_k, mask=mask)
    nql, nkl = len(q_pos), len(k_pos)
    # the forward's scores: float32 chains where its float32 method ran (the same test);
    # then the float32 backward (reproducible_float32.backward_step) on its 256-position blocks
    narrow, blk = None, KEY_BLOCK
    if reproducible_float32.eligible(args.spec, args.tile_dtype, nk):
        narrow = float(np.float32(float(args.scale) * reproducible_float32.LOG2E))
        blk = reproducible_float32.BLOCK

    # delta_i: a fixed chain per row, the same number on whichever rank the row is
    do64 = np.asarray(dout, dtype=np.float64)[:, :, :nql]
    delta = _row_dot(do64, np.asarray(out, dtype=np.float64)[:, :, :nql])

    # the query rows (q | dO | lse | delta) and the keys (k | v) dealt out in global blocks,
    # each row's columns side by side: float64, or for the float32 method the float32
    # columns its kernel takes (q | dO | lh | ll | float32(delta), made per row before the
    # deal: the same numbers on whichever rank; half the bytes)
    if narrow is None:
        row_dtype = np.float64
        cols = [q, do64, np.asarray(lse)[..., None], delta[..., None]]
    else:
        row_dtype = np.float32
        lh, ll = reproducible_float32.split_lse(np.asarray(lse)[:, :, :nql])
        cols = [q, dout, lh[..., None], ll[..., None], delta.astype(np.float32)[..., None]]
    qrows = side_by_side(cols, nql, row_dtype)  # (nql, B, H, W)
    wq = h * qrows.shape[-1]
    mine_q, q_mine, back_q = deal_rows(comm, qrows.reshape(nql, b * wq), q_pos, nq,
                                       balanced=True, block=blk)  # fmt: skip
    cq = len(q_mine)
    qd = np.moveaxis(mine_q.reshape(cq, b, h, qrows.shape[-1]), 0, 2)  # (B, H, cq, W)
    qq, qdo = qd[..., :dk_w], qd[..., dk_w : dk_w + dv_w]
    qlse, qdelta = qd[..., dk_w + dv_w], qd[..., -1]
    krows = side_by_side([k, v], nkl, row_dtype).reshape(nkl, b * hkv * (dk_w + dv_w))
    mine_k, k_mine, back_k = deal_rows(comm, krows, k_pos, nk, block=blk)
    ck = len(k_mine)
    k_starts = block_starts(nk, size, blk)
    k_counts = [k_starts[r + 1] - k_starts[r] for r in range(size)]

    # global bounds (exact maxima, the same for every P): |k|, |v| per (batch, kv head,
    # column); |q|, |dO| per (batch, kv head, column) over the group's heads and all rows
    kvd = mine_k.reshape(ck, b, hkv, dk_w + dv_w)
    grp = np.abs(qd[..., : dk_w + dv_w]).reshape(b, hkv, g * cq, dk_w + dv_w)
    maxima = np.zeros((2, b, hkv, dk_w + dv_w))
    if ck:
        maxima[0] = np.abs(kvd).max(axis=0)
    if cq:
        maxima[1] = grp.max(axis=2)
    comm.Allreduce(MPI.IN_PLACE, maxima, op=MPI.MAX)
    if share is not None:  # |q|, |dO| of the heads the other members hold
        share.Allreduce(MPI.IN_PLACE, maxima, op=MPI.MAX)
    kmax, vmax = maxima[0, ..., :dk_w], maxima[0, ..., dk_w:]
    qmax, domax = maxima[1, ..., :dk_w], maxima[1, ..., dk_w:]
    # |dS_ij| <= P_BOUND (|dP_ij| + |delta_i|) with |dP_ij| <= sum_d |dO_id| max|v_d|:
    # twice that per (batch, kv head) leaves room for the roundings of the bound itself
    a = _row_dot(np.abs(qdo), vmax[:, kh, None, :]) + np.abs(qdelta)  # (B, H, cq)
    sb = np.zeros((b, hkv))
    if cq:
        sb = a.reshape(b, hkv, g * cq).max(axis=2)
    comm.Allreduce(MPI.IN_PLACE, sb, op=MPI.MAX)
    if share is not None:
        share.Allreduce(MPI.IN_PLACE, sb, op=MPI.MAX)
    sb = 2.0 * P_BOUND * sb

    # the grids: dQ sums at most blk nb_k summands per row; dK and dV blk nb_q x G per key
    n_k = -(-nk // blk) * blk
    n_q = -(-nq // blk) * blk * (g if g_all is None else g_all)
    # float32 gradients of the float32 method: the folds of float32 results (2 up to 2^24)
    kind = np.float64 if narrow is None else np.float32
    nf = max(folds(n_k, kind), folds(n_q, kind))
    q_grid = [c[:, kh, None, :] for c in grids(n_k, sb[..., None] * kmax, nf)]
    k_grid = [c[:, :, None, None, :] for c in grids(n_q, sb[..., None] * qmax, nf)]
    v_grid = [c[:, :, None, None, :] for c in grids(n_q, P_BOUND * domax, nf)]

    # the fold sums of a row (of a key) side by side: F levels far apart (at power-of-two
    # distances) made the folds' additions miss the caches
    dq_all = np.zeros((b, h, cq, nf, dk_w))
    dq_parts = [dq_all[..., f, :] for f in range(nf)]
    # the travelling package of a K/V block: per key (B, Hkv, Dk | Dv) for k | v, then the
    # block's fold sums (B, Hkv, keys, F, Dk | Dv) for dk | dv: they go round the ring with it
    wk = b * hkv * (dk_w + dv_w)
    cmax = max(k_counts)
    nkv = cmax * wk
    pkg = np.zeros(nkv + b * hkv * cmax * nf * (dk_w + dv_w))
    pkg[: ck * wk] = mine_k.reshape(-1)
    spare = np.empty_like(pkg) if size > 1 else None
    del mine_k, krows, qrows, mine_q

    # visible key ranges of each dealt query row (the mask is a function of positions)
    lo, hi, _ = visible_ranges(mask, q_mine)
    # softcap and ALiBi (the forward's, on the dealt rows' positions); sinks: sink_grad
    cap, slopes, qa = score_modifiers(args.spec, mask, q_mine, heads, h)
    if narrow is None:
        tile, tile_name = _tile_function()
        mods = (cap, slopes, qa) if cap is not None or slopes is not None else None
        run_step = partial(_step64, tile, (qq, qdo, qlse, qdelta), lo, hi, kh, args.scale,
                           (q_grid, k_grid, v_grid), mods, dq_parts)  # fmt: skip
    else:
        tile32, tile_name, rows32 = _float32_rows(qd, dk_w, dv_w, lo, hi, narrow)
        grids32 = tuple(np.ascontiguousarray(np.stack([x.reshape(x.shape[:2] + x.shape[-1:])
                                                       for x in grid]))
                        for grid in (q_grid, k_grid, v_grid))  # fmt: skip
        run_step = partial(_step32, tile32, rows32, grids=grids32, dq_parts=dq_parts)
    p_max = 0.0
    pairs, tiles, compute_s = 0, 0, 0.0
    prev, nxt = (rank - 1) % size, (rank + 1) % size
    for step in range(size):
        src = (rank - step) % size
        cnt, kstart = k_counts[src], k_starts[src]
        t0 = time.perf_counter()
        kv = pkg[: cnt * wk].reshape(cnt, b, hkv, dk_w + dv_w)
        kt = np.moveaxis(kv[..., :dk_w], 0, 2)  # (B, Hkv, cnt, Dk) views
        vt = np.moveaxis(kv[..., dk_w:], 0, 2)
        fk = pkg[nkv:].reshape(b, hkv, cmax, nf, dk_w + dv_w)[:, :, :cnt]
        dk_f = [fk[..., f, :dk_w] for f in range(nf)]  # (B, Hkv, cnt, Dk) views
        dv_f = [fk[..., f, dk_w:] for f in range(nf)]
        pm, pr, tl = run_step(kt, vt, kstart, dk_f, dv_f)
        p_max, pairs, tiles = max(p_max, pm), pairs + pr, tiles + tl
        compute_s += time.perf_counter() - t0
        if size > 1:  # the block and its folds to the next rank; after P hops it is home
            t0 = time.perf_counter()
            with watch(f"reproducible backward step {step}: the K/V block from rank {prev}"):
                comm.Sendrecv(pkg, dest=nxt, sendtag=7340, recvbuf=spare, source=prev,
                              recvtag=7340)  # fmt: skip
            pkg, spare = spare, pkg
            t_wait += time.perf_counter() - t0

    # the bound the grids assumed: checked on every rank (a maximum, the same everywhere)
    worst = np.array([p_max])
    (comm if world is None else world).Allreduce(MPI.IN_PLACE, worst, op=MPI.MAX)
    if worst[0] > P_BOUND:  # NaN inputs pass (and give NaN), as in the default mode
        raise ValueError(
            "ring_attention_backward(reproducible=True): exp(s - lse) reached "
            f"{worst[0]:.3g} > {P_BOUND}: lse is not the forward's log-sum-exp of these inputs"
        )

    # each row: the fold sums in fold order, times the scale, rounded once; dealt back
    # (rounded to the input dtype before they are dealt back: elementwise, the same bits)
    dq = _total_in_place(dq_parts)
    dq *= args.scale
    dq = _rows_back(comm, dq, back_q, dtype)  # (B, H, nql, Dk)
    fk = pkg[nkv:].reshape(b, hkv, cmax, nf, dk_w + dv_w)
    if share is not None:  # the other members' heads' parts of the same keys: exact sums
        folds_here = np.ascontiguousarray(fk)
        share.Allreduce(MPI.IN_PLACE, folds_here, op=MPI.SUM)
        fk = folds_here
    dkv = _total_in_place([fk[:, :, :ck, f] for f in range(nf)])
    dkv[..., :dk_w] *= args.scale
    dkv = _rows_back(comm, dkv, back_k, dtype)  # (B, Hkv, nkl, Dk + Dv)
    grads = []
    for x, full in ((dq, sq), (dkv[..., :dk_w], sk), (dkv[..., dk_w:], sk)):
        out = np.empty(x.shape[:2] + (full,) + x.shape[3:], dtype)
        out[:, :, : x.shape[2]] = x  # rounded to dtype here where no row travelled
        out[:, :, x.shape[2] :] = 0  # rows past the layout's positions (padding): no gradient
        grads.append(out)
    stats = dict(
        compute_s=compute_s,
        wait_s=t_wait,
        flops=cost.flops(pairs, dk_w, h, b, backward=True, dv=dv_w),
        tile_flops=cost.flops(tiles, dk_w, h, b, backward=True, dv=dv_w),
        steps=size,
        steps_computed=size,
        steps_skipped=0,
        bytes_sent=(size - 1) * pkg.nbytes if size > 1 else 0,
        alltoall_bytes=np.dtype(row_dtype).itemsize * (wq * b * nql + wk * nkl) * 2,
        tile=tile_name,
    )
    return (*grads, stats)


def _rows_back(comm, x, back, dtype):
    """``x`` (B, H, c, W) float64, one row per dealt position, rounded to ``dtype`` and
    dealt back (:func:`~ringmpi.reproducible.undeal_rows`): (B, H, n, W) in the order of
    this rank's positions. Where nothing travels (:func:`~ringmpi.reproducible.moves_nothing`)
    ``x`` comes back as it is (a view, rounded by whoever copies it): no row transposes."""
    if moves_nothing(comm, back):
        return x
    b, h, c, w = x.shape
    rows = np.moveaxis(x, 2, 0).astype(dtype, order="C")  # (c, B, H, W) rows, one pass
    rows = undeal_rows(comm, rows.reshape(c, b * h * w), back)
    return np.moveaxis(rows.reshape(-1, b, h, w), 0, 2)


def _float32_rows(qd, dk_w: int, dv_w: int, lo, hi, narrow: float) -> tuple:
    """The dealt rows as the float32 backward's tile takes them, and the tile function.

    ``qd`` (B, H, cq, Dk + Dv + 3) float32: q | dO | lh | ll | float32(delta) per dealt
    row; ``lo``, ``hi`` (L, cq) their visible ranges.
    Returns (the tile function: the float32 kernel's ``backward`` or its oracle
    :func:`ringmpi.reproducible_float32.backward_step`, its name for the stats, the rows:
    (qs, q, dO, lh, ll, dl) float32 with zero rows to a multiple of 64 and zero columns to
    the kernel's width, lo and hi likewise (padding rows see nothing), the row count, the
    column width)).
    """
    kern = choose_kernel(fused_reproducible_float32, "reproducible float32 C kernel",
                         reproducible_float32.BLOCK)  # fmt: skip
    width = 1 if kern is None else kern.backward_width
    cq = qd.shape[2]
    chain = reproducible_float32.CHAIN
    cqp = -(-cq // chain) * chain
    dkp, dvp = -(-dk_w // width) * width, -(-dv_w // width) * width

    q32 = _pad32(qd[..., :dk_w], cqp, dkp)
    qs32 = q32 * np.float32(narrow)  # the forward's qs: a float32 product (0 stays 0)
    at = dk_w + dv_w
    arrays = (qs32, q32, _pad32(qd[..., dk_w:at], cqp, dvp), _pad32(qd[..., at], cqp),
              _pad32(qd[..., at + 1], cqp), _pad32(qd[..., at + 2], cqp))  # fmt: skip
    lo_p = np.ones((len(lo), cqp), dtype=np.int64)
    hi_p = np.zeros((len(lo), cqp), dtype=np.int64)
    lo_p[:, :cq], hi_p[:, :cq] = lo, hi
    if kern is None:
        tile, name = reproducible_float32.backward_step, "reproducible numpy float32"
    else:
        tile, name = kern.backward, f"reproducible C {kern.isa} float32"
    return tile, name, (arrays, lo_p, hi_p, cq, width)


def _step64(tile, rows, lo, hi, kh, scale: float, consts, mods, dq_parts, kt, vt, kstart: int,
            dk_f, dv_f) -> tuple:  # fmt: skip
    """One ring step of the float64 method: every visible (64-row, 64-key) tile by ``tile``.

    ``rows``: (q, dO, lse, delta) of the dealt rows; ``lo``, ``hi`` their visible ranges;
    ``kh`` (H,) the K/V head of each query head; ``consts``: the grids; ``mods``: None or
    (softcap, ALiBi slopes, the rows' ALiBi positions); ``kt``, ``vt``, ``kstart``, ``dk_f``,
    ``dv_f`` as :func:`_step32` takes them. Returns (the largest p, the visible pairs, the
    tiles' row x key count).
    """
    qq, qdo, qlse, qdelta = rows
    cq, cnt = qq.shape[2], kt.shape[2]
    p_max, pairs, tiles = 0.0, 0, 0
    for c0 in range(0, cnt, KEY_BLOCK):  # kstart is a block's first key
        c1 = min(cnt, c0 + KEY_BLOCK)
        kp = np.arange(kstart + c0, kstart + c1, dtype=np.int64)
        kb = np.ascontiguousarray(kt[:, kh, c0:c1])  # (B, H, c, Dk)
        vb = np.ascontiguousarray(vt[:, kh, c0:c1])
        for r0 in range(0, cq, KEY_BLOCK):  # whole blocks: a block starts at each r0
            r1 = min(cq, r0 + KEY_BLOCK)
            vis = ((kp >= lo[:, r0:r1, None]) & (kp <= hi[:, r0:r1, None])).any(axis=0)
            if not vis.any():
                continue
            m = None
            if mods is not None:
                cap, slopes, qa = mods
                m = (cap, slopes, None if qa is None else qa[r0:r1], kp)
            pmax = tile(qq[:, :, r0:r1], qdo[:, :, r0:r1], qlse[:, :, r0:r1],
                        qdelta[:, :, r0:r1], kb, vb, vis, scale, consts,
                        [x[:, :, r0:r1] for x in dq_parts], [x[:, :, c0:c1] for x in dk_f],
                        [x[:, :, c0:c1] for x in dv_f], kt.shape[1], mods=m)  # fmt: skip
            p_max = max(p_max, pmax)
            pairs += int(vis.sum())
            tiles += (r1 - r0) * (c1 - c0)
    return p_max, pairs, tiles


def _step32(tile, rows, kt, vt, kstart: int, dk_f, dv_f, *, grids, dq_parts) -> tuple:
    """One ring step of the float32 backward (the kernel's or the oracle's ``backward_step``).

    ``rows``: from :func:`_float32_rows`; ``kt`` (B, Hkv, cnt, Dk), ``vt`` (B, Hkv, cnt,
    Dv): the K/V block held now, its first key at the global position ``kstart`` (a
    block's first); ``dk_f``, ``dv_f``: its travelling fold sums. Returns (the largest p,
    the visible pairs, the tiles' row x key count).
    """
    arrays, lo, hi, cq, width = rows
    chain = reproducible_float32.CHAIN
    cnt = kt.shape[2]
    ckp = -(-cnt // chain) * chain
    k32 = _pad32(kt, ckp, -(-kt.shape[-1] // width) * width)
    v32 = _pad32(vt, ckp, -(-vt.shape[-1] // width) * width)
    return tile(arrays + (k32, v32), lo, hi, cq, cnt, kstart, grids, dq_parts, dk_f, dv_f)


def _pad32(x, n: int, width=None):
    """``x`` (B, H, m[, D]) as float32 (B, H, n[, width]): zero rows past m, zero columns
    past D (the float32 kernel's padding; exact for float32 values)."""
    out = np.zeros(x.shape[:2] + (n,) + (() if width is None else (width,)), dtype=np.float32)
    if width is None:
        out[:, :, : x.shape[2]] = x
    else:
        out[:, :, : x.shape[2], : x.shape[3]] = x
    return out


def kernel():
    """The backward's C kernel of ``$RINGMPI_CPU_KERNEL`` / ``$RINGMPI_CPU_ISA``, or None.

    The rules of :func:`ringmpi.reproducible.kernel`: ``numpy``: None (:func:`_tile`, the
    oracle); ``auto``: the kernel where it builds, else None; ``fused``: the kernel, or
    RuntimeError. Both give the same bits.
    """
    return choose_kernel(fused_reproducible_backward, "reproducible backward C kernel")


def _tile_function():
    """(the tile function, its name for the stats): the C kernel's tile, or :func:`_tile`.

    Both take the same arguments (the score modifiers included) and give the same bits;
    the C kernel's runs the tile's chains as one compiled loop nest instead of numpy
    passes over (B, H, 64, 64) arrays.
    """
    kern = kernel()
    if kern is None:
        return _tile, "reproducible numpy"
    return kern.tile, f"reproducible C {kern.isa}"


def _total(parts):
    """(f_1 + f_2) + f_3 ...: the fold sums added in fold order (a fixed sequence), a new
    float64 array."""
    return _total_in_place([np.array(parts[0], dtype=np.float64), *parts[1:]])


def _total_in_place(parts):
    """:func:`_total` made in the first part (a float64 view, overwritten): the same
    additions in the same order, without a new array of the largest size."""
    acc = parts[0]
    for x in parts[1:]:
        acc += x
    return acc


def _tile(q, do, lse, delta, k, v, vis, scale, consts, dq_sums, dk_sums, dv_sums, hkv,
          mods=None):  # fmt: skip
    """One (query block, key block) tile for every batch and head; returns max P.

    q (B, H, r, Dk), do (B, H, r, Dv), lse and delta (B, H, r), k (B, H, c, Dk) and
    v (B, H, c, Dv) (the K/V head of each query head), vis (r, c). Adds the fold parts
    of the tile's block partials into ``dq_sums`` (per fold (B, H, r, Dk)), ``dk_sums``
    and ``dv_sums`` (per fold (B, Hkv, c, D): the group's heads summed exactly).
    ``mods``: None, or the score modifiers (softcap or None, ALiBi slopes (H,) or None,
    the rows' ALiBi positions (r,) or None, the keys' positions (c,)) for
    :func:`modify_batched`.
    """
    q_grid, k_grid, v_grid = consts
    b, h, r, _ = q.shape
    c = k.shape[2]
    s = scores_batched(q, k, scale)  # (B, H, r, c): the forward's score of each pair
    dmod = None if mods is None else modify_batched(s, *mods)
    with np.errstate(invalid="ignore", over="ignore"):
        t = np.where(vis, s - lse[..., None], -np.inf)
        p = det_exp(t)  # 0 for an invisible key
    dp = _dots(do, v)
    ds = p * (dp - delta[..., None])
    if dmod is not None:  # the gradient through softcap: d s / d x = 1 - tanh^2 (<= 1)
        ds *= dmod
    pmax = float(p.max()) if p.size else 0.0
    g = h // hkv
    fold_into(_chain(ds, k, False)[None], q_grid, dq_sums, 0, scratch=True)
    dkb = _chain(ds, q, True).reshape(b, hkv, g, c, -1)
    fold_into(dkb, k_grid, dk_sums, 2, scratch=True)
    dvb = _chain(p, do, True).reshape(b, hkv, g, c, -1)
    fold_into(dvb, v_grid, dv_sums, 2, scratch=True)
    return pmax


def scores_batched(q, k, scale: float):
    """(..., r, c) scores of :func:`ringmpi.reproducible.scores`, batched over leading axes.

    ((q_0 k_0 + q_1 k_1) + ...) in float64, then times ``scale``: per entry the
    operations of :func:`~ringmpi.reproducible.scores`, so the same numbers.
    """
    s = _dots(q, k)
    s *= scale
    return s


def modify_batched(s, cap, slopes, qa, kp):
    """The forward's score modifiers on (B, H, r, c) scores ``s`` in place; d s'/d s or None.

    Per entry the operations of :func:`ringmpi.reproducible.modify` (so the forward's
    numbers): softcap t = det_tanh(x (1 / cap)), s = cap t, then ALiBi
    s = s - slope_h |qa_i - k_j| (the distance exact in float64, the product rounded
    once). Returns softcap's derivative 1 - t t (B, H, r, c), a fixed elementwise
    sequence in [0, 1], or None without softcap (ALiBi adds a constant: derivative 1).

    Parameters
    ----------
    cap : float or None ; slopes : (H,) float64 or None
    qa : (r,) int64 ALiBi query positions (None without ALiBi) ; kp : (c,) int64 key positions
    """
    dmod = None
    if cap is not None:
        t = det_tanh(s * (1.0 / cap))
        np.multiply(cap, t, out=s)
        dmod = 1.0 - t * t
    if slopes is not None:
        dist = np.abs(qa[:, None] - kp[None, :]).astype(np.float64)
        s -= slopes[:, None, None] * dist
    return dmod
