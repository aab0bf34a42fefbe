"""Reproducible mode, one pass (issue 40): float32 chains, exact sums in float64.

Float64 inputs run the same pass in float64 (:func:`eligible_float64`: the float64
method's scores s = chain x scale and ``det_exp``, p = det_exp(s - r ln 2) with
r = ceil(max s / ln 2), multiply-then-add chains, :data:`FOLDS64` levels); what follows
describes the float32 pass, the float64 one differs only there.

:func:`ringmpi.reproducible.loop` hands a forward to :func:`loop` here when
:func:`eligible` says so: float32 (or narrower) inputs, no softcap, no ALiBi. The
result is bitwise independent of P, the layout, the threads and the ISA path, like
the float64 method of :mod:`ringmpi.reproducible`, but at the default mode's speed:
the scores and the block sums are float32 arithmetic (fused multiply-adds where the
vector paths have them), and there is no pass for the row maxima.

For each query row and global key block c (the positions [256 c, 256 c + 256),
:data:`BLOCK`; the keys are dealt out in whole blocks by
:func:`ringmpi.reproducible.deal_keys`):

1. t_j = (((qs_0 k_0 + 0) + qs_1 k_1) + ...) over the head dim in index order, each
   step one float32 fused multiply-add (:func:`fma32`), with qs = q x C rounded to
   float32 and C = scale x log2(e) rounded to float32: the score in base 2. An
   invisible key (and the block's padding past the last key) has t = -inf.
2. m = the block's maximum t over the row's visible keys (NaN wins), r = ceil(m) (an
   integer, exact; -0 made +0), p_j = :func:`exp2f` (t_j - r): every p <= 1 and the
   largest > 1/2.
3. The block's sums in four chains of :data:`CHAIN` keys: per chain a fixed tree sum
   of its p (:func:`tree64`) and o_d = fma(p_63, v_63d, ... fma(p_0, v_0d, 0)) in key
   order, both float32; then lb = ((l_0 + l_1) + l_2) + l_3 and ob likewise, in float64.
4. The block partial (lb, ob) counts 2^r (lb, ob). Its window is R_w = 32 ceil(r / 32)
   (:data:`WINDOW`): the partial is scaled by 2^(r - R_w) (exact) and split on the
   window's fixed grids into :data:`FOLDS` parts (level f has the quantum
   q_f = 2^(E - 50 - 32 f) relative to 2^R_w, E from the summand bound and the global
   block count, :func:`window_grids`). Each row keeps one window R and its level sums:
   a block of a lower window R_w = R - 32 k adds its level-f part, scaled by 2^(-32 k),
   to level f + k (the same quantum: exact), and drops the parts beyond the last
   level; a block of a higher window first moves the row's levels down by k (scaled
   by 2^(-32 k), the last ones dropped). Every level sum is exact, so the result is a
   function of the set of block partials and of the row's final window (the window of
   its largest r: a maximum), not of the order in which they came.

At the end l = (L_0 + L_1) + L_2 and o likewise (float64), and
:func:`ringmpi.reproducible.finish` makes out = o / l and lse = R ln 2 + log(l), the
sinks joined as in the float64 method. The C kernel ``kernels/cpu_reproducible_float32.c``
(:mod:`ringmpi.cpu.fused_reproducible_float32`) performs these operations; the numpy
code here is its oracle (``RINGMPI_CPU_KERNEL=numpy``). The backward of these calls
(:func:`backward_step`, called by :mod:`ringmpi.reproducible_backward`) takes the same
scores in float32 chains on 256-position blocks of rows and keys. docs/reproducible.md
has the argument and the error bounds.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from . import cost
from .cpu import fused_reproducible_float32
from .layout import positions
from .mask import plan_steps
from .reproducible import (
    EXP_INVLN2,
    EXP_LN2HI,
    EXP_LN2LO,
    choose_kernel,
    deal_keys,
    denominators,
    det_exp,
    finish,
    fold_into,
    log_sum_exp,
    sees,
    visible_ranges,
)
from .ring import KVRing

__all__ = [
    "BLOCK",
    "CHAIN",
    "WINDOW",
    "FOLDS",
    "FOLDS64",
    "eligible",
    "eligible_float64",
    "fma32",
    "exp2f",
    "tree64",
    "window_grids",
    "loop",
    "split_lse",
    "backward_step",
]

BLOCK = 256  # keys per global key block of this method (the C kernel's RMF_BK)
CHAIN = 64  # keys per float32 chain of a block's sums
WINDOW = 32  # the windows of the row references, in powers of two
FOLDS = 3  # levels kept: the dropped parts are at most 2^(2b - 71) of a row's l (b: bits of nb)
MAX_BITS = 51 - WINDOW  # block counts below 2^MAX_BITS keep every level sum exact
# query rows per kernel call: the bits do not depend on it. Each call streams every K/V block
# once per head, so a chunk of 96 rows cost 1.5 times the default mode's forward at N = 8,192
# (D = 64 and 128); 192 to 768 rows, about 1.25 (their levels, 3 Dv float64 a row, still
# mostly in L2 at 384)
_ROWS = 384
_E_MIN = -800  # lowest top-level exponent: every quantum, shifted, stays a normal float64
LOG2E = float.fromhex("0x1.71547652b82fep+0")
LN2 = float.fromhex("0x1.62e42fefa39efp-1")
_MAGIC32 = np.float32(12582912.0)  # 1.5 * 2^23: adding it rounds a float32 to an integer
# 2^f = e^(f ln 2) on [-1/2, 1/2]: its Taylor coefficients (ln 2)^k / k!, rounded to float32
# (the C kernel's rmf_c; written out, so that no libm or numpy log computes them)
_EXP2_C = [np.float32(float.fromhex(x)) for x in (
    "0x1p+0", "0x1.62e43p-1", "0x1.ebfbep-3", "0x1.c6b08ep-5",
    "0x1.3b2ab6p-7", "0x1.5d87fep-10", "0x1.430912p-13", "0x1.ffcbfcp-17",
)]  # fmt: skip
_EXP2_MIN = np.float32(-125.0)  # below: 0 (a weight under 2^-125 of the block's largest)
FOLDS64 = 4  # levels of the float64 inputs' sums: the dropped parts at most 2^(2b - 103) of l


def eligible(spec, dtype, nk: int) -> bool:
    """Whether the forward of ``spec`` on inputs of ``dtype`` with ``nk`` keys runs here.

    Float32 (or narrower) inputs, no softcap and no ALiBi (the sinks are fine), fewer
    than 2^MAX_BITS global key blocks. A function of the call's options and global
    shapes: the same on every rank for every P.
    """
    return np.dtype(dtype).itemsize <= 4 and _plain(spec, nk)


def eligible_float64(spec, dtype, nk: int) -> bool:
    """Whether the forward of ``spec`` on ``dtype`` inputs runs this method in float64.

    Float64 inputs and the rest of :func:`eligible`'s conditions: the same pass with
    float64 chains and :data:`FOLDS64` levels.
    """
    return np.dtype(dtype) == np.float64 and _plain(spec, nk)


def _plain(spec, nk: int) -> bool:
    """No softcap, no ALiBi, and fewer than 2^MAX_BITS global key blocks."""
    nb = -(-int(nk) // BLOCK)
    return spec.softcap is None and spec.alibi_slopes is None and nb.bit_length() <= MAX_BITS


def fma32(a, b, c):
    """round_float32(a b + c), one rounding, for float32 a, b, c (a fused multiply-add).

    a b is exact in float64 (24 + 24 significant bits); s = a b + c is rounded in
    float64 with its error e exact (Knuth's TwoSum); rounding s to odd where e != 0
    (the neighbour of s toward e when s's last bit is even) then to float32 gives the
    correctly rounded result (53 >= 24 + 2 bits: no double rounding). NaN and inf pass
    as in float64.
    """
    a64 = np.asarray(a, dtype=np.float64)
    p = a64 * np.asarray(b, dtype=np.float64)
    c64 = np.asarray(c, dtype=np.float64)
    s = p + c64
    bb = s - p
    e = (p - (s - bb)) + (c64 - bb)
    bits = s.view(np.int64) if s.ndim else np.asarray(s).reshape(1).view(np.int64)
    with np.errstate(invalid="ignore"):
        fix = (e != 0) & ((bits & 1) == 0) & np.isfinite(s)
        step = np.where((e > 0) == (s > 0), 1, -1)
    out = np.where(fix, (bits + step).view(np.float64).reshape(s.shape), s)
    return out.astype(np.float32)


def exp2f(x):
    """2^x for float32 x <= 0 (or NaN), in float32, the C kernel's operations (rmf_exp2).

    n = round(x) (adding and subtracting 1.5 x 2^23), f = x - n in [-1/2, 1/2] (exact),
    2^f by the degree-7 Taylor polynomial of e^(f ln 2) (float32 coefficients, Horner's
    rule, one :func:`fma32` per step), times 2^n from the exponent bits (exact).
    0 for x < -125 (and -inf); NaN stays NaN.
    """
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        low = x < _EXP2_MIN
        xc = np.where(low | np.isnan(x), np.float32(0.0), x).astype(np.float32)
        n = (xc + _MAGIC32) - _MAGIC32
        f = xc - n
        p = fma32(_EXP2_C[7], f, _EXP2_C[6])
        for c in _EXP2_C[5::-1]:
            p = fma32(p, f, c)
        two_n = ((n.astype(np.int32) + 127) << 23).view(np.float32)
        y = p * two_n
    return np.where(low, np.float32(0.0), np.where(np.isnan(x), x, y)).astype(np.float32)


def tree64(p):
    """The sum of 64 float32 values along the last axis, in the kernel's fixed tree.

    a = ((p[0:16] + p[16:32]) + p[32:48]) + p[48:64] lane by lane, then halves added
    (16 -> 8 -> 4 -> 2 -> 1): a fixed sequence of float32 additions.
    """
    a = (p[..., 0:16] + p[..., 16:32]) + p[..., 32:48]
    a = a + p[..., 48:64]
    while a.shape[-1] > 1:
        w = a.shape[-1] // 2
        a = a[..., :w] + a[..., w:]
    return a[..., 0]


def window_grids(nb: int, bound, nfolds: int = FOLDS):
    """The ``nfolds`` splitting constants of the block partials, relative to their window.

    A block partial scaled to its window is at most 2^9 bound (256 weights <= 1, and a
    float32 chain's rounding); with 2^e > bound and b the bits of ``nb`` (the global
    block count), level f has the constant c_f = 1.5 * 2^(E + 2 - 32 f) with
    E = max(e + 9 + b, _E_MIN), whose quantum is q_f = 2^(E - 50 - 32 f). A part of
    level f >= 1 is at most q_(f-1) / 2 = 2^31 q_f and a level holds at most ``nb``
    parts, so with b <= 19 every level sum is a multiple of q_f below 2^51 q_f: exact.

    Returns a float64 array of shape (nfolds,) + shape of ``bound``.
    """
    bits = max(int(nb), 1).bit_length()
    _, e = np.frexp(np.asarray(bound, dtype=np.float64))
    e = np.maximum(e.astype(np.int64) + 9 + bits, _E_MIN)
    return np.stack([np.ldexp(1.5, e + 2 - WINDOW * f) for f in range(nfolds)])


def loop(comm, args, qi, ki, vi, on_step, on_tick, heads=slice(None), on_state=None, start=None):
    """The float32 reproducible forward over ``comm``: (out, lse, stats).

    What :func:`ringmpi.reproducible.loop` returns (and refuses: the checkpoint seam),
    for the calls :func:`eligible` accepts. One pass over the ring: ``on_step`` counts
    its ``P`` steps.
    """
    if on_state is not None or start is not None:  # the same on every rank (documented)
        raise ValueError("ring_attention: reproducible=True cannot be checkpointed or resumed yet")
    mask, layout = args.mask, args.layout
    rank, size = comm.Get_rank(), comm.Get_size()
    plan = plan_steps(mask, rank, size, layout)
    lo, hi, span = visible_ranges(mask, plan.q_pos)
    b, h, sq, d = qi.shape
    hkv, dv = ki.shape[1], vi.shape[-1]
    nk = int(args.nk)
    nb = -(-nk // BLOCK)
    scale = float(args.scale)
    wt = np.dtype(np.float64 if eligible_float64(args.spec, args.tile_dtype, nk) else np.float32)
    nf = FOLDS64 if wt == np.float64 else FOLDS
    if wt == np.float32:  # the chains are the scores in base 2: qs = q x C, rounded once
        qs = np.ascontiguousarray(np.asarray(qi, dtype=np.float32) * np.float32(scale * LOG2E))
    else:  # float64: the chains are of q itself, times the scale after (as reproducible.scores)
        qs = np.ascontiguousarray(qi, dtype=np.float64)
    kern = choose_kernel(fused_reproducible_float32, "reproducible float32 C kernel", BLOCK)
    sinks = args.spec.sinks
    sinks = None if sinks is None else np.asarray(sinks, dtype=np.float64)[heads]

    k_mine = positions(nk, rank, size, layout, cu_seqlens=mask.cu_k, mask=mask)
    kd, vd, starts, counts = deal_keys(comm, ki, vi, k_mine, nk, block=BLOCK)
    kd = np.asarray(kd, dtype=wt)
    vd = np.ascontiguousarray(vd, dtype=wt)
    vmax = np.abs(vd).max(axis=2).astype(np.float64) if vd.shape[2] else np.zeros((b, hkv, dv))
    comm.Allreduce(MPI.IN_PLACE, vmax, op=MPI.MAX)
    l_grid = np.ascontiguousarray(window_grids(nb, np.float64(1.0), nf))  # (F,)
    v_grid = np.ascontiguousarray(np.moveaxis(window_grids(nb, vmax, nf), 0, 2))  # (B, Hkv, F, Dv)

    ref = np.full((b, h, sq), -np.inf)  # each row's window (+inf: a NaN score was seen)
    l_lev = np.zeros((b, h, sq, nf))  # a row's levels side by side (the kernel's layout)
    o_lev = np.zeros((b, h, sq, nf, dv))
    state = (ref, l_lev, o_lev, l_grid, v_grid)
    stats = dict(compute_s=0.0, wait_s=0.0, flops=0, tile_flops=0, bytes_sent=0)
    computed = 0
    kv_ring = KVRing(comm, args.backend, kd, vd, counts, size)
    with kv_ring as kv:
        for step, src, kb, vb in kv:
            k_pos = np.arange(starts[src], starts[src] + counts[src], dtype=np.int64)
            if sees(span, k_pos):
                t0 = time.perf_counter()
                if kern is not None:
                    kt, vp = kern.pad_keys(kb, wt), kern.pad_values(vb, wt)
                for r0 in range(0, sq, _ROWS):
                    if on_tick is not None:
                        on_tick(step)
                    rows = (r0, min(sq, r0 + _ROWS))
                    if kern is not None:
                        kern.block(qs, kt, vp, k_pos, lo, hi, state, sk=len(k_pos), dv=dv,
                                   rows=rows, scale=scale)  # fmt: skip
                    else:
                        _numpy_block(qs, kb, vb, k_pos, lo, hi, state, rows, scale)
                stats["compute_s"] += time.perf_counter() - t0
                pairs = plan.pairs(step, k_pos, args.causal)
                stats["flops"] += cost.flops(pairs, d, h, b, dv=dv)
                stats["tile_flops"] += 2 * sq * len(k_pos) * (d + dv) * h * b
                computed += 1
            if on_step is not None:
                on_step(step + 1, size)
    stats["wait_s"] += kv.ring.wait_s
    stats["bytes_sent"] += kv.bytes_sent
    bad = ref == np.inf
    if wt == np.float64:
        _near_one(ref, l_lev, o_lev)
    m = np.where(bad, np.nan, ref * LN2)
    l_lev[..., 0][bad] = np.nan
    if kern is not None and wt == np.float32 == np.dtype(args.acc_dtype):  # one pass, same bits
        l, a, m = denominators(np.moveaxis(l_lev, 3, 0), m, sinks)
        out, lse = kern.finish(o_lev, np.ascontiguousarray(l), a), log_sum_exp(l, m, np.float32)
    else:
        out, lse = finish(np.moveaxis(l_lev, 3, 0), np.moveaxis(o_lev, 3, 0), m, args.acc_dtype,
                          sinks)  # fmt: skip
    stats.update(
        steps=size,
        steps_computed=computed,
        steps_skipped=0,
        steps_resumed=0,
        reproducible_kernel=(f"C {kern.isa}" if kern is not None else "numpy") + f" {wt.name}",
    )
    return out, lse, stats


def _near_one(ref, l_lev, o_lev) -> None:
    """Each row's sums rescaled by 2^-e, e the exponent of its l, and its reference R made
    R + e (in place), so that lse = R ln 2 + log(l) adds two numbers of the row's own size.

    After the ring R is a window (a multiple of 32) and l may be as small as 2^-33: then
    R ln 2 and log(l) are large and opposite, and their sum lost float64 bits that the
    backward's dv showed (7 times the default's error with masks of slices, P = 2). The
    scaling is by a power of two, so o / l keeps its bits; l is the levels' sum in
    :func:`~ringmpi.reproducible.finish`'s order, P-independent like them.
    """
    l_tot = l_lev[..., 0].copy()
    for f in range(1, l_lev.shape[-1]):
        l_tot += l_lev[..., f]
    ok = np.isfinite(ref) & np.isfinite(l_tot) & (l_tot > 0)
    e = np.where(ok, np.frexp(np.where(ok, l_tot, 1.0))[1], 0)
    down = np.ldexp(1.0, -e)
    l_lev *= down[..., None]
    o_lev *= down[..., None, None]
    ref += e


def _numpy_block(qs, kb, vb, k_pos, lo, hi, state, rows, scale: float = 1.0) -> None:
    """One K/V block (whole global blocks) against the rows ``rows``: the kernel's oracle.

    ``qs`` float32: q x C, the chains' steps :func:`fma32`, the scores in base 2. Or float64:
    q itself, a multiply and then an add per step, s = chain x ``scale`` (the float64
    method's :func:`~ringmpi.reproducible.scores`), r = ceil(max s / ln 2) and
    p = det_exp((s - r ln2_hi) - r ln2_lo).
    """
    wt = qs.dtype.type
    step = (lambda x, y, a: a + x * y) if wt == np.float64 else fma32
    b, h, _, d = qs.shape
    g = h // kb.shape[1]
    dv = vb.shape[-1]
    r0, r1 = rows
    for k0 in range(0, len(k_pos), BLOCK):  # k_pos[0] is a block's first key
        k1 = min(len(k_pos), k0 + BLOCK)
        kp = np.full(BLOCK, -1, dtype=np.int64)
        kp[: k1 - k0] = k_pos[k0:k1]
        vis = ((kp >= lo[:, r0:r1, None]) & (kp <= hi[:, r0:r1, None])).any(axis=0)
        vis[:, k1 - k0 :] = False
        if not vis.any():
            continue
        for bb in range(b):
            for hh in range(h):
                kh = hh // g
                kblk = np.zeros((BLOCK, d), dtype=wt)
                kblk[: k1 - k0] = kb[bb, kh, k0:k1]
                vblk = np.zeros((BLOCK, dv), dtype=wt)
                vblk[: k1 - k0] = vb[bb, kh, k0:k1]
                t = np.zeros((r1 - r0, BLOCK), dtype=wt)
                for x in range(d):
                    t = step(qs[bb, hh, r0:r1, x, None], kblk[None, :, x], t)
                t = np.where(vis, t, wt(-np.inf))
                m = t.max(axis=1)  # NaN propagates
                live = m != -np.inf
                if not live.any():
                    continue
                with np.errstate(invalid="ignore"):
                    if wt == np.float64:
                        r = np.ceil((m * scale) * EXP_INVLN2) + 0.0  # -0 -> +0
                        rl = np.where(live, r, 0.0)[:, None]
                        p = det_exp(((t * scale) - rl * EXP_LN2HI) - rl * EXP_LN2LO)
                    else:
                        r = np.ceil(m) + wt(0.0)  # -0 -> +0 (the maximum of +-0 is either)
                        p = exp2f(t - np.where(live, r, wt(0))[:, None])
                p = np.where(live[:, None], p, wt(0))
                lsub = tree64(p.reshape(-1, BLOCK // CHAIN, CHAIN))  # (rows, 4)
                lb = lsub[:, 0].astype(np.float64)
                ob = None
                for c in range(BLOCK // CHAIN):
                    a = np.zeros((r1 - r0, dv), dtype=wt)
                    for j in range(c * CHAIN, (c + 1) * CHAIN):
                        a = step(p[:, j, None], vblk[None, j, :], a)
                    if c:
                        lb = lb + lsub[:, c].astype(np.float64)
                        ob = ob + a.astype(np.float64)
                    else:
                        ob = a.astype(np.float64)
                fold_rows(state, bb, hh, kh, np.arange(r0, r1)[live], r.astype(np.float64)[live],
                          lb[live], ob[live])  # fmt: skip


def fold_rows(state, bb, hh, kh, rows, r, lb, ob) -> None:
    """Add the block partials (lb, ob) x 2^r of ``rows`` to their windowed level sums.

    ``r`` (n,) float64 integers (NaN: a NaN score); ``lb`` (n,), ``ob`` (n, Dv) float64.
    The operations of the kernel's rmf_fold, row by row (the rows are independent).
    """
    ref, l_lev, o_lev, l_grid, v_grid = state
    nf = l_lev.shape[-1]  # FOLDS, or FOLDS64 for float64 inputs
    R = ref[bb, hh, rows]
    L = np.moveaxis(l_lev[bb, hh, rows], 1, 0)  # (F, n): a copy (rows is an index array)
    O = np.moveaxis(o_lev[bb, hh, rows], 1, 0)  # (F, n, Dv)
    nan = np.isnan(r) | (R == np.inf)
    R = np.where(nan, np.inf, R)
    ok = ~nan
    rs = np.where(ok, r, 0.0)
    rw = WINDOW * np.ceil(rs / WINDOW)
    up = ok & ~(R >= rw)  # a higher window: the row's levels move down
    k = np.where(R == -np.inf, nf, np.where(up, (rw - np.where(up, R, 0.0)) / WINDOW, 0))
    k = np.minimum(k, nf).astype(np.int64)
    for f in range(nf - 1, -1, -1):
        src = f - k
        take = up & (src >= 0)
        sc = np.ldexp(1.0, -WINDOW * k)
        lv = np.where(take, L[np.clip(src, 0, None), np.arange(len(rows))] * sc, 0.0)
        ov = np.where(take[:, None], O[np.clip(src, 0, None), np.arange(len(rows))] * sc[:, None],
                      0.0)  # fmt: skip
        L[f] = np.where(up, lv, L[f])
        O[f] = np.where(up[:, None], ov, O[f])
    R = np.where(up, rw, R)
    kk = np.where(ok, (np.where(ok, R, 0.0) - rw) / WINDOW, nf).astype(np.int64)
    sc = np.ldexp(1.0, (rs - rw).astype(np.int64))
    xl = lb * sc
    xo = ob * sc[:, None]
    down = np.ldexp(1.0, -WINDOW * np.minimum(kk, nf))
    for f in range(nf):
        hl = (xl + l_grid[f]) - l_grid[f]
        ho = (xo + v_grid[bb, kh, f]) - v_grid[bb, kh, f]
        lev = f + kk
        for t in range(nf):
            at = ok & (lev == t)
            L[t] = np.where(at, L[t] + hl * down, L[t])
            O[t] = np.where(at[:, None], O[t] + ho * down[:, None], O[t])
        xl = xl - hl
        xo = xo - ho
    ref[bb, hh, rows] = R
    l_lev[bb, hh, rows] = np.moveaxis(L, 0, 1)
    o_lev[bb, hh, rows] = np.moveaxis(O, 0, 1)


def split_lse(lse):
    """(lh, ll) float32: lse / ln 2 (float64) as a sum of two float32 (the backward's rows).

    lh = float32(L), ll = float32(L - lh) with L = lse / ln 2 in float64; ll = 0 where L
    is not finite (an lse of -inf gives u = +inf below, refused; NaN stays NaN).
    """
    big = np.asarray(lse, dtype=np.float64) / LN2
    lh = big.astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        ll = np.where(np.isfinite(lh), big - lh.astype(np.float64), 0.0).astype(np.float32)
    return lh, ll


def backward_step(arrays, lo, hi, nrows: int, nkeys: int, kpos0: int, grids, dq_sums, dk_sums,
                  dv_sums) -> tuple:  # fmt: skip
    """One ring step of the float32 backward: the C kernel's oracle.

    Every (row block, key block) tile of :data:`BLOCK` rows of the dealt rows 0 ..
    ``nrows`` - 1 (whole global blocks, from a block's first) and :data:`BLOCK` keys of the
    keys 0 .. ``nkeys`` - 1 (at the consecutive global positions from ``kpos0``, a
    block's first) in which a row's ranges (``lo``, ``hi``) meet the block's positions,
    by :func:`_backward_tile`. ``dq_sums``: F arrays (B, H, nrows, Dk); ``dk_sums``,
    ``dv_sums``: F arrays (B, Hkv, nkeys, Dk | Dv). Returns (the largest p, NaN if one
    is; the visible pairs; the tiles' rows x keys).
    """
    p_max, pairs, cells, nan = 0.0, 0, 0, False
    for r0 in range(0, nrows, BLOCK):
        nr = min(BLOCK, nrows - r0)
        ok = lo[:, r0 : r0 + nr] <= hi[:, r0 : r0 + nr]
        if not ok.any():
            continue
        blo, bhi = lo[:, r0 : r0 + nr][ok].min(), hi[:, r0 : r0 + nr][ok].max()
        for c0 in range(0, nkeys, BLOCK):
            nk = min(BLOCK, nkeys - c0)
            if blo > kpos0 + c0 + nk - 1 or bhi < kpos0 + c0:
                continue
            pm, pr = _backward_tile(arrays, lo, hi, (r0, nr), (c0, nk), kpos0 + c0, grids,
                                    [x[:, :, r0 : r0 + nr] for x in dq_sums],
                                    [x[:, :, c0 : c0 + nk] for x in dk_sums],
                                    [x[:, :, c0 : c0 + nk] for x in dv_sums])  # fmt: skip
            nan |= pm != pm
            p_max = max(p_max, pm)
            pairs += pr
            cells += nr * nk
    return (float("nan") if nan else p_max), pairs, cells


def _backward_tile(arrays, lo, hi, rows, keys, kpos0, grids, dq_sums, dk_sums, dv_sums):
    """One (query block, key block) tile of the float32 backward (:func:`backward_step`).

    Per batch and head, rows and keys in chains of :data:`CHAIN` (a block's rows from its
    first, its keys likewise; past the last one, zero padding that no row sees):
    t_ij = the forward's float32 score chain (:func:`fma32` over the head dim from +0 of
    qs_i = q_i x C and k_j); u_ij = min((t_ij - lh_i) - ll_i, 2) (:func:`split_lse`);
    p_ij = :func:`exp2f` (u_ij) where row i sees key j, else 0; dp_ij = the fma chain of
    dO_i . v_j; ds_ij = p_ij (dp_ij - dl_i) (dl = delta rounded to float32), all float32.
    Per sub-tile (row chain a, key chain c) in which some row sees some key, float32 fma
    chains from +0 in index order: dq over the chain's keys of ds_ij k_j; dk over its rows
    of ds_ij q_i; dv of p_ij dO_i. The block partials are float64 sums from +0 in chain
    order (skipped sub-tiles add nothing; they would add +0), folded on ``grids`` into the
    fold sums (:func:`ringmpi.reproducible.fold_into`: exact, so any order of heads).

    Parameters
    ----------
    arrays : (qs, q, do, lh, ll, dl, k, v)
        float32: qs, q (B, H, Sq, >= Dk); do (B, H, Sq, >= Dv); lh, ll, dl (B, H, Sq);
        k (B, Hkv, Sk, >= Dk), v (B, Hkv, Sk, >= Dv); zero rows and keys past the tile's
        up to the next multiple of :data:`CHAIN`.
    lo, hi : (L, Sq) int64
        Row i sees position p when lo[l, i] <= p <= hi[l, i] for some l.
    rows, keys : (first, count)
        The tile's rows of the row arrays and keys of the key arrays (counts <= BLOCK).
    kpos0 : int
        The global position of the tile's first key (its keys are consecutive).
    grids : (q (F, B, H, Dk), k (F, B, Hkv, Dk), v (F, B, Hkv, Dv)) float64
    dq_sums : F arrays (B, H, nr, Dk) ; dk_sums, dv_sums : F arrays (B, Hkv, nk, Dk | Dv)
        The fold sums of the tile's rows and keys, added to.

    Returns
    -------
    (pmax, pairs): the largest p (NaN if one is), the visible (row, key) pairs.
    """
    qs, q, do, lh, ll, dl, k, v = arrays
    (row0, nr), (key0, nk) = rows, keys
    b, h = qs.shape[:2]
    hkv = k.shape[1]
    g = h // hkv
    dk_w, dv_w = dq_sums[0].shape[-1], dv_sums[0].shape[-1]
    na, nc = -(-nr // CHAIN), -(-nk // CHAIN)
    rr, cc = na * CHAIN, nc * CHAIN
    if nr == 0 or nk == 0 or b == 0:
        return 0.0, 0
    rs = slice(row0, row0 + rr)
    kh = np.arange(h) // g
    qs_t, q_t, do_t = qs[:, :, rs, :dk_w], q[:, :, rs, :dk_w], do[:, :, rs, :dv_w]
    kt = k[:, :, key0 : key0 + cc, :dk_w][:, kh]  # (B, H, C, Dk)
    vt = v[:, :, key0 : key0 + cc, :dv_w][:, kh]
    pos = kpos0 + np.arange(cc, dtype=np.int64)
    vis = ((pos >= lo[:, rs, None]) & (pos <= hi[:, rs, None])).any(axis=0)
    vis[nr:] = False
    vis[:, nk:] = False
    sub = vis.reshape(na, CHAIN, nc, CHAIN).any(axis=(1, 3))
    if not sub.any():
        return 0.0, 0
    t = np.zeros((b, h, rr, cc), dtype=np.float32)
    for x in range(dk_w):
        t = fma32(qs_t[..., :, x, None], kt[..., None, :, x], t)
    with np.errstate(invalid="ignore", over="ignore"):
        u = (t - lh[:, :, rs, None]) - ll[:, :, rs, None]
        u = np.where(u > np.float32(2.0), np.float32(2.0), u).astype(np.float32)
        p = np.where(vis, exp2f(u), np.float32(0.0)).astype(np.float32)
    dp = np.zeros((b, h, rr, cc), dtype=np.float32)
    for x in range(dv_w):
        dp = fma32(do_t[..., :, x, None], vt[..., None, :, x], dp)
    with np.errstate(invalid="ignore", over="ignore"):
        ds = p * (dp - dl[:, :, rs, None])
    pmax = float(p.max())
    dq64 = np.zeros((b, h, rr, dk_w))
    for c in range(nc):
        acc = np.zeros((b, h, rr, dk_w), dtype=np.float32)
        for j in range(c * CHAIN, (c + 1) * CHAIN):
            acc = fma32(ds[..., :, j, None], kt[..., j, None, :], acc)
        live = np.repeat(sub[:, c], CHAIN)[:, None]
        dq64 = dq64 + np.where(live, acc.astype(np.float64), 0.0)
    dk64 = np.zeros((b, h, cc, dk_w))
    dv64 = np.zeros((b, h, cc, dv_w))
    for a in range(na):
        acc_k = np.zeros((b, h, cc, dk_w), dtype=np.float32)
        acc_v = np.zeros((b, h, cc, dv_w), dtype=np.float32)
        for i in range(a * CHAIN, (a + 1) * CHAIN):
            acc_k = fma32(ds[..., i, :, None], q_t[..., i, None, :], acc_k)
            acc_v = fma32(p[..., i, :, None], do_t[..., i, None, :], acc_v)
        live = np.repeat(sub[a], CHAIN)[:, None]
        dk64 = dk64 + np.where(live, acc_k.astype(np.float64), 0.0)
        dv64 = dv64 + np.where(live, acc_v.astype(np.float64), 0.0)
    qg, kg, vg = grids
    fold_into(dq64[:, :, :nr][None], [x[:, :, None, :] for x in qg], dq_sums, 0, scratch=True)
    for part, grid, sums in ((dk64, kg, dk_sums), (dv64, vg, dv_sums)):
        x = np.ascontiguousarray(part[:, :, :nk]).reshape(b, hkv, g, nk, -1)
        fold_into(x, [y[:, :, None, None, :] for y in grid], sums, 2, scratch=True)
    return pmax, int(vis.sum())
