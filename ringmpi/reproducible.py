"""Reproducible mode (issue 40): out and lse bitwise independent of P, layout, threads, ISA.

``ring_attention(..., reproducible=True)`` replaces the forward ring loop of
:mod:`ringmpi.attention` by :func:`loop`. The keys and values are first dealt out
again in whole global key blocks of :data:`KEY_BLOCK` positions (:func:`deal_keys`,
one ``Alltoallv``), then two passes go over the ring:

1. Each row's global maximum score M (a maximum is exact, so its value does not
   depend on which rank saw which key, or in what order).
2. For each (row, key block): the block sums lb = p_0 + p_1 + ... and
   ob = p_0 v_0 + p_1 v_1 + ... in key order, p = :func:`det_exp` (s - M); each
   block sum is split on fixed grids (:func:`grids`, from the global key count and a
   global bound: 1 for p, the global max |v| of each (batch, kv head, column) for
   p v) into :func:`folds` parts whose sums over any set of blocks are exact in
   float64. The fold sums are added in a fixed order at the end: out = o / l rounded
   once to the output dtype, lse = M + :func:`det_log` (l).

A score is a fixed sequence of float64 operations over the head dim (:func:`scores`),
then through the score modifiers softcap (:func:`det_tanh`) and ALiBi (:func:`modify`),
the same number whatever the shape of the call it is part of. The sinks join the
maximum and the denominator once per row, after the exact fold sums (`finish`).
The work runs in the C kernel ``kernels/cpu_reproducible.c``
(:mod:`ringmpi.cpu.fused_reproducible`, every ISA path), or, with
``RINGMPI_CPU_KERNEL=numpy`` or where it cannot be built, in this module's numpy code,
its oracle: the same operations, the same bits. Neither the numpy tile nor the fused
tiles run in this mode, and no numpy transcendental (``np.exp``, ``np.log``,
``np.tanh``: their SIMD loops differ between CPU feature sets) touches a value.
docs/reproducible.md has the argument and the limits.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from . import cost
from .cpu import fused_reproducible
from .layout import positions
from .mask import plan_steps
from .ring import KVRing
from .runtime import env

__all__ = [
    "FOLDS",
    "refusals",
    "scores",
    "det_exp",
    "det_log",
    "det_tanh",
    "modify",
    "score_modifiers",
    "choose_kernel",
    "folds",
    "grids",
    "fold_into",
    "loop",
    "deal_keys",
    "block_owners",
    "deal_rows",
    "undeal_rows",
    "block_starts",
    "side_by_side",
    "moves_nothing",
    "finish",
    "denominators",
    "log_sum_exp",
    "visible_ranges",
    "sees",
]

FOLDS = 3  # each fold keeps about 51 - log2(nk) more bits of every summand

# det_exp's constants: kernels/cpu_reproducible.c (RMR_*) holds the same doubles
_EXP_SHIFT = float.fromhex("0x1.8p52")  # adding it rounds to an integer
EXP_INVLN2 = float.fromhex("0x1.71547652b82fep+0")  # 1 / ln 2 (the float32 method's float64
# instance reduces its scores by the same three constants)
EXP_LN2HI = float.fromhex("0x1.62e42fee00000p-1")  # 32 significant bits
EXP_LN2LO = float.fromhex("0x1.a39ef35793c76p-33")
_SQRT_HALF = float.fromhex("0x1.6a09e667f3bcdp-1")
_EXP_TMIN = -345.0  # e^-345 < 2^-497: such a weight is 0 by definition (no subnormal p v)
_EXP_C = [float.fromhex(x) for x in (
    "0x1.0000000000000p+0", "0x1.0000000000000p+0", "0x1.0000000000000p-1",
    "0x1.5555555555555p-3", "0x1.5555555555555p-5", "0x1.1111111111111p-7",
    "0x1.6c16c16c16c17p-10", "0x1.a01a01a01a01ap-13", "0x1.a01a01a01a01ap-16",
    "0x1.71de3a556c734p-19", "0x1.27e4fb7789f5cp-22", "0x1.ae64567f544e4p-26",
    "0x1.1eed8eff8d898p-29",
)]  # fmt: skip
_ROWS = 256  # query rows per chunk: memory only, the bits do not depend on it
KEY_BLOCK = 64  # keys per global key block: the unit of the partial sums (the C kernel's RMR_BK)
_E_MIN = -960  # lowest grid exponent: keeps every constant and quantum a normal float64


def refusals(spec, xp, *, backward: bool = False, tiles: bool = True) -> list:
    """Why a call with ``spec.reproducible`` cannot run (empty: it can, or the mode is off).

    For :meth:`ringmpi.backend.Backend.supports`; ``xp`` is the backend's array module.
    ``backward``: the same limits as the forward's (every mask, score modifier and heads x
    ring runs in both; ringmpi.reproducible_backward).
    """
    if not getattr(spec, "reproducible", False):
        return []
    why = []
    if xp is not np:
        why.append(
            "reproducible=True (the GPU kernels sum in an order that depends on the block "
            "split and the launch configuration; the mode runs on numpy arrays only)"
        )
    if not tiles:
        why.append("reproducible=True in decode (not written yet)")
    return why


def scores(q, k, scale: float):
    """(rows, keys) float64 scores ``scale * q . k``, summed over D in index order.

    Each entry is ((q0 k0 + q1 k1) + q2 k2) + ... in float64, then times scale:
    elementwise operations only, so an entry does not depend on the other rows
    or keys in the call (a BLAS product may).

    Parameters
    ----------
    q : (rows, D) float64 ; k : (keys, D) float64
    """
    qt, kt = np.ascontiguousarray(q.T), np.ascontiguousarray(k.T)
    s = np.multiply(qt[0, :, None], kt[0, None, :])
    tmp = np.empty_like(s)
    for j in range(1, len(qt)):
        np.multiply(qt[j, :, None], kt[j, None, :], out=tmp)
        s += tmp
    s *= scale
    return s


def det_exp(t):
    """exp(t) for float64 t <= 0 (or NaN) by a fixed sequence of IEEE operations.

    The same operations as ``rmr_exp`` of kernels/cpu_reproducible.c: n = round(t / ln 2)
    (adding and subtracting 1.5 * 2^52), r = (t - n ln2_hi) - n ln2_lo, a degree-12
    Taylor polynomial by Horner's rule, times 2^n (exact); 0 below t = -708 (far below
    the last fold's quantum: such a weight never reaches a sum). Not ``np.exp``, whose
    SIMD loops differ between CPU feature sets and numpy versions.
    """
    t = np.asarray(t, dtype=np.float64)
    tc = np.where(t < _EXP_TMIN, _EXP_TMIN, t)  # NaN stays NaN
    tc = np.where(tc == tc, tc, 0.0)
    n = (tc * EXP_INVLN2 + _EXP_SHIFT) - _EXP_SHIFT
    r = (tc - n * EXP_LN2HI) - n * EXP_LN2LO
    p = _EXP_C[12] * r + _EXP_C[11]
    for c in _EXP_C[10::-1]:
        p = p * r + c
    y = p * np.ldexp(1.0, n.astype(np.int64))
    return np.where(t < _EXP_TMIN, 0.0, np.where(t == t, y, t))


def det_tanh(x):
    """tanh(x) for float64 x by a fixed sequence of IEEE operations (the softcap's).

    The same operations as ``rmr_tanh8`` of kernels/cpu_reproducible.c. With a = |x| and
    t = -2a (exact), clamped below at -345 (tanh is 1 to the last bit long before):
    u = e^t - 1 = (2^n - 1) + 2^n (r Q(r)), n and r the reduction of :func:`det_exp`
    and r Q(r) = r + r^2/2 + ... + r^12/12! (det_exp's Taylor coefficients but the
    first, by Horner's rule). For |t| < ln2 / 2, n = 0 and r = t exactly, so u = r Q(r)
    keeps its relative precision however small a is (the form 1 - e^t loses it near 0);
    beyond, 2^n - 1 <= -1/2 is exact and the one addition rounds once. Then
    tanh a = -u / (2 + u) and the sign of x by ``copysign`` (exact): tanh(+-0) = +-0,
    NaN propagates. Error: a few units in the last place (the test measures it against
    ``np.tanh`` in ``test_det_tanh_accuracy_and_edges``). Not ``np.tanh``, whose SIMD loops differ
    between CPU feature sets.
    """
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):  # |x| > 2^1022: t = -inf, clamped
        t = -2.0 * np.abs(x)
    tc = np.where(t < _EXP_TMIN, _EXP_TMIN, t)  # NaN stays NaN
    tc = np.where(tc == tc, tc, 0.0)
    n = (tc * EXP_INVLN2 + _EXP_SHIFT) - _EXP_SHIFT
    r = (tc - n * EXP_LN2HI) - n * EXP_LN2LO
    p = _EXP_C[12] * r + _EXP_C[11]
    for c in _EXP_C[10:0:-1]:
        p = p * r + c
    two_n = np.ldexp(1.0, n.astype(np.int64))
    u = (two_n - 1.0) + two_n * (r * p)
    y = (-u) / (2.0 + u)
    y = np.where(x == x, y, x)
    return np.copysign(y, x)


def modify(s, cap, slope, qa, k_pos):
    """The score modifiers on the float64 scaled scores ``s`` (rows, keys), as the kernel.

    In the order of :mod:`ringmpi.reference`: softcap ``cap`` (None: off) gives
    s = cap * det_tanh(s * (1 / cap)) (1 / cap rounded once, as the default mode's C
    tiles do: no division per score); ALiBi ``slope`` (None: off) then subtracts
    slope * |qa_i - k_j|, the distance converted to float64 (exact) and the product
    rounded once. Each entry stays a function of its (row, key) alone.

    Parameters
    ----------
    s : (rows, keys) float64, modified in place and returned
    qa : (rows,) int64 ALiBi query positions ; k_pos : (keys,) int64
    """
    if cap is not None:
        s[...] = cap * det_tanh(s * (1.0 / cap))
    if slope is not None:
        dist = np.abs(qa[:, None] - k_pos[None, :]).astype(np.float64)
        s -= slope * dist
    return s


def det_log(x):
    """log(x) for positive float64 x by a fixed sequence of IEEE operations.

    Not ``np.log``, whose SIMD loops give other bits on other CPU feature sets. x = m 2^e
    with m in [sqrt(1/2), sqrt(2)) (frexp: exact), s = (m - 1) / (m + 1) (|s| < 0.172),
    log m = 2 (s + s^3/3 + ... + s^21/21) (truncation below 1e-19 relative), and
    log x = e ln2_hi + (e ln2_lo + log m). NaN propagates.
    """
    x = np.asarray(x, dtype=np.float64)
    m, e = np.frexp(x)
    low = m < _SQRT_HALF
    m = np.where(low, m * 2.0, m)
    e = (e - low).astype(np.float64)
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    acc = np.full_like(s, 1.0 / 21.0)
    for k in range(19, 0, -2):
        acc = acc * s2 + 1.0 / k
    logm = 2.0 * (s * acc)
    return e * EXP_LN2HI + (e * EXP_LN2LO + logm)


def folds(nk: int, dtype) -> int:
    """How many folds the sums of a call keep: the fewest whose dropped remainder is
    below 2^-30 (float32 results) or 2^-60 (float64) of the summands' bound.

    Fold f's grid exponent is E_1 - (f - 1)(51 - b) with E_1 = e + b (b: the bits of
    ``nk``, 2^e: the bound), so dropping the remainder after F folds costs at most
    nk 2^(E_F - 51) <= 2^(e + (F + 1) b - 51 F). A function of the global key count
    and the dtype only: the same on every rank for every P.
    """
    b = max(int(nk), 1).bit_length()
    want = 30 if np.dtype(dtype).itemsize <= 4 else 60
    f = 2
    while (f + 1) * b - 51 * f > -want and f < 4:
        f += 1
    return f


def grids(nk: int, bound, nfolds: int = FOLDS) -> list:
    """The ``FOLDS`` splitting constants for sums of at most ``nk`` summands |x| <= bound.

    Fold f has a grid exponent E_f with nk * bound_f < 2^E_f and the constant
    c_f = 1.5 * 2^(E_f + 2), whose float64 spacing is q_f = 2^(E_f - 50): for
    |x| <= 2^E_f, (c_f + x) - c_f is x rounded to a multiple of q_f, exactly, and
    x minus it is exact too (|residual| <= q_f / 2, the next fold's bound). A sum of
    at most nk such parts is a multiple of q_f below 2^(E_f + 1): 51 bits, exact
    in float64 whatever the order or grouping.

    Parameters
    ----------
    nk : int
        The most summands one sum can have (the global key count).
    bound : float64 array
        An upper bound of the summands' magnitudes, per sum group (broadcasts).

    Returns
    -------
    list of float64 arrays (shape of ``bound``), one per fold (``nfolds``).
    """
    bits = max(int(nk), 1).bit_length()  # nk <= 2^bits
    _, e = np.frexp(np.asarray(bound, dtype=np.float64))  # bound < 2^e
    e = np.maximum(e.astype(np.int64) + bits, _E_MIN)
    out = []
    for _ in range(nfolds):
        out.append(np.ldexp(1.5, e + 2))
        e = np.maximum(e - 51 + bits, _E_MIN)
    return out


def fold_into(x, consts: list, sums: list, axis: int, scratch: bool = False) -> None:
    """Add the fold parts of the float64 summands ``x``, summed over ``axis``, into ``sums``.

    ``consts[f]`` broadcasts against ``x``; ``sums[f]`` has the shape of ``x`` summed
    over ``axis``. Every addition here is exact (:func:`grids`), so the order of
    numpy's sums and of the calls does not change the result. ``scratch``: ``x`` may
    be overwritten (it is a temporary of the caller).
    """
    hi = np.empty_like(x)
    last = len(consts) - 1
    for f, (c, acc) in enumerate(zip(consts, sums)):
        np.add(x, c, out=hi)
        hi -= c
        acc += hi.sum(axis=axis)
        if f < last:  # the last fold's remainder is dropped (the method's error)
            if scratch:
                x -= hi
            else:
                x, scratch = x - hi, True


def loop(comm, args, qi, ki, vi, on_step, on_tick, heads=slice(None), on_state=None, start=None):
    """The reproducible forward over ``comm``: (out (B, S, H, Dv), lse (B, H, S), stats).

    The signature and the results of :func:`ringmpi.attention._loop` (out in the
    accumulation dtype, rounded once from float64; lse likewise); ``on_step`` counts
    the steps of both passes (``nsteps`` = 2 x the ring steps). The checkpoint
    seam (``on_state``, ``start``) is refused: the state of this mode is not the
    online-softmax state the batch job saves.
    """
    if on_state is not None or start is not None:  # the same on every rank (documented)
        raise ValueError("ring_attention: reproducible=True cannot be checkpointed or resumed yet")
    mask, layout = args.mask, args.layout
    rank, size = comm.Get_rank(), comm.Get_size()
    plan = plan_steps(mask, rank, size, layout)  # for the query positions and the pair count
    lo, hi, span = visible_ranges(mask, plan.q_pos)
    b, h, sq, d = qi.shape
    hkv, dv = ki.shape[1], vi.shape[-1]  # dv: the value width (issue 42)
    q64 = np.ascontiguousarray(qi, dtype=np.float64)
    nk = int(args.nk)
    n_sum = -(-nk // KEY_BLOCK) * KEY_BLOCK  # the grids' summand count (see grids)
    nf = folds(n_sum, qi.dtype)
    kern = kernel()
    mods = score_modifiers(args.spec, mask, plan.q_pos, heads, h)
    sinks = args.spec.sinks
    sinks = None if sinks is None else np.asarray(sinks, dtype=np.float64)[heads]

    # the keys dealt out again in whole global blocks (deal_keys): the unit of the partial sums
    k_mine = positions(nk, rank, size, layout, cu_seqlens=mask.cu_k, mask=mask)
    kd, vd, starts, counts = deal_keys(comm, ki, vi, k_mine, nk)

    # the global bound of |v| per (batch, kv head, column): a maximum, the same for every P
    vmax = np.abs(vd).max(axis=2).astype(np.float64) if vd.shape[2] else np.zeros((b, hkv, dv))
    comm.Allreduce(MPI.IN_PLACE, vmax, op=MPI.MAX)
    # block sums: at most n_sum / KEY_BLOCK summands, each at most KEY_BLOCK x the bound
    v_grid = np.stack(grids(n_sum, vmax, nf))  # (F, B, Hkv, Dv)
    l_grid = np.array(grids(n_sum, np.float64(1.0), nf))  # (F,): exp(s - M) <= 1

    m = np.full((b, h, sq), -np.inf)
    l_parts = np.zeros((nf, b, h, sq))
    o_parts = np.zeros((nf, b, h, sq, dv))
    stats = dict(compute_s=0.0, wait_s=0.0, flops=0, tile_flops=0, bytes_sent=0)
    computed = 0

    def tick(step):
        if on_tick is not None:
            on_tick(step)

    for pass_ in (0, 1):
        kv_ring = KVRing(comm, args.backend, kd, vd, counts, size)
        with kv_ring as kv:
            for step, src, kb, vb in kv:
                k_pos = np.arange(starts[src], starts[src] + counts[src], dtype=np.int64)
                if sees(span, k_pos):
                    t0 = time.perf_counter()
                    v64 = np.ascontiguousarray(vb, dtype=np.float64) if pass_ else None
                    state = (m, l_grid, v_grid, l_parts, o_parts)
                    if kern is not None:
                        _kernel_block(kern, q64, kb, v64, k_pos, lo, hi, args.scale, state, tick,
                                      step, pass_, mods)  # fmt: skip
                    else:
                        _numpy_block(q64, kb, v64, k_pos, lo, hi, args.scale, state, tick, step,
                                     pass_, mods)  # fmt: skip
                    stats["compute_s"] += time.perf_counter() - t0
                    if pass_:
                        pairs = plan.pairs(step, k_pos, args.causal)
                        stats["flops"] += cost.flops(pairs, d, h, b, dv=dv)
                        stats["tile_flops"] += 2 * sq * len(k_pos) * (d + dv) * h * b
                        computed += 1
                if on_step is not None:
                    on_step(pass_ * size + step + 1, 2 * size)
        stats["wait_s"] += kv.ring.wait_s
        stats["bytes_sent"] += kv.bytes_sent
    out, lse = finish(l_parts, o_parts, m, args.acc_dtype, sinks)
    stats.update(
        steps=size,
        steps_computed=computed,
        steps_skipped=0,
        steps_resumed=0,
        reproducible_kernel=f"C {kern.isa}" if kern is not None else "numpy",
    )
    return out, lse, stats


def visible_ranges(mask, q_pos):
    """(lo, hi, span): the rows' visible key ranges and the span any of them sees.

    lo, hi (L, n) int64: row i sees key position p when lo[t, i] <= p <= hi[t, i] for
    some layer t (one layer, or a mask of slices' sorted disjoint intervals: each key
    once, in key order); span: (first, last) position some row sees, or None.
    """
    n = len(q_pos)
    layers = mask.layers(q_pos) or [(np.ones(n), np.zeros(n))]
    lo, hi = (np.ascontiguousarray(np.stack(x), dtype=np.int64) for x in zip(*layers))
    seen = lo <= hi
    span = (int(lo[seen].min()), int(hi[seen].max())) if seen.any() else None
    return lo, hi, span


def sees(span, k_pos) -> bool:
    """Whether a row of ``span`` (:func:`visible_ranges`) may see one of the sorted keys."""
    return span is not None and len(k_pos) > 0 and k_pos[0] <= span[1] and k_pos[-1] >= span[0]


def deal_keys(comm, k, v, pos, nk: int, block: int = KEY_BLOCK):
    """The keys and values dealt out in whole global key blocks: (k, v, starts, counts).

    Block c holds the keys at positions [block c, block c + block) (``block``: by default
    :data:`KEY_BLOCK`; :mod:`ringmpi.reproducible_float32` deals blocks of 256); rank r
    gets the blocks [r nb / P, (r + 1) nb / P) (nb blocks, :func:`block_owners`), so every
    block lies whole on one rank and a block's partial sums are computed by the same code
    on the same keys in the same order for every P and layout. The rows travel by
    :func:`deal_rows` (each key moves at most once), before the ring. Where every rank
    already holds its blocks in position order (one rank; a contiguous layout on block
    boundaries), nothing is copied: ``k`` and ``v`` come back as views.

    Parameters
    ----------
    k : (B, Hkv, S, Dk), v : (B, Hkv, S, Dv)
        This rank's keys and values (the first ``len(pos)`` along S are real).
    pos : (n,) int
        Their global positions (a partition of 0..nk-1 over the ranks).

    Returns
    -------
    k (B, Hkv, count, Dk), v (B, Hkv, count, Dv) of this rank's blocks in position order;
    starts, counts: lists over ranks (rank r holds positions starts[r] + 0..counts[r]-1).
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    starts = block_starts(nk, size, block)
    counts = [starts[r + 1] - starts[r] for r in range(size)]
    pos = np.asarray(pos, dtype=np.int64)
    n = len(pos)
    in_place = n == counts[rank] and _identity(pos - starts[rank])
    if size > 1:  # every rank's answer: all skip the exchange, or none
        in_place = comm.allreduce(in_place, op=MPI.LAND)
    if in_place:
        return k[:, :, :n], v[:, :, :n], starts[:-1], counts
    b, hkv, _, dk = k.shape
    dv = v.shape[-1]
    rows = side_by_side([k, v], n, np.result_type(k.dtype, v.dtype))
    mine = deal_rows(comm, rows.reshape(n, b * hkv * (dk + dv)), pos, nk, block=block)[0]
    mine = mine.reshape(counts[rank], b, hkv, dk + dv)  # each row: k (B, Hkv, Dk), then v
    kd = np.ascontiguousarray(np.moveaxis(mine[..., :dk], 0, 2), dtype=k.dtype)  # exact
    vd = np.ascontiguousarray(np.moveaxis(mine[..., dk:], 0, 2), dtype=v.dtype)
    return kd, vd, starts[:-1], counts


def block_starts(n: int, size: int, block: int = KEY_BLOCK) -> list:
    """Rank r holds the global blocks [r nb / P, (r + 1) nb / P): their first positions."""
    nb = -(-n // block)
    return [min(r * nb // size * block, n) for r in range(size + 1)]


def block_owners(n: int, size: int, balanced: bool = False, block: int = KEY_BLOCK):
    """(nb,) the rank that holds each global block of ``block`` positions (nb = ceil(n / block)).

    Not balanced: rank r holds the blocks [r nb / P, (r + 1) nb / P) (as
    :func:`ringmpi.reproducible.deal_keys`). Balanced: the blocks cut into 2P runs
    [i nb / 2P, (i + 1) nb / 2P) and rank r holding runs r and 2P - 1 - r (a zigzag
    of blocks: under a causal mask every rank gets early and late rows). The choice
    moves work between ranks, never a bit.
    """
    nb = -(-n // block)
    c = np.arange(nb, dtype=np.int64)
    if not balanced:
        return np.searchsorted(np.arange(size) * nb // size, c, side="right") - 1
    run = np.searchsorted(np.arange(2 * size) * nb // (2 * size), c, side="right") - 1
    return np.where(run < size, run, 2 * size - 1 - run)


def deal_rows(comm, rows, pos, n: int, balanced: bool = False, block: int = KEY_BLOCK):
    """Rows (one per global position) dealt out in whole global blocks of ``block`` positions.

    Rank r gets the blocks :func:`block_owners` gives it, rows in position order.

    Parameters
    ----------
    rows : (len(pos), W) array
        This rank's rows, one per global position ``pos`` (any dtype: its bits travel).
    pos : (len(rows),) int
        Their global positions (a partition of 0..n-1 over the ranks).
    n : int
        The number of positions.
    balanced : bool
        :func:`block_owners`'s choice.

    Returns
    -------
    mine : (count, W) of ``rows``' dtype
        The rows of this rank's blocks, in position order.
    mine_pos : (count,) int64
        Their positions: whole blocks, ascending (each starts at a multiple of ``block``).
    back : tuple
        What :func:`undeal_rows` needs to send rows of ``mine``'s shape back.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    owner = block_owners(n, size, balanced, block)
    blocks = np.flatnonzero(owner == rank)
    mine_pos = np.arange(n, dtype=np.int64)[np.isin(np.arange(n) // block, blocks)]
    pos = np.asarray(pos, dtype=np.int64)
    width = rows.shape[1]
    dest = owner[pos // block] if len(pos) else np.zeros(0, dtype=np.int64)
    order = np.argsort(dest, kind="stable")
    send_n = np.bincount(dest, minlength=size).astype(np.int64)
    recv_n = np.array(comm.alltoall(send_n.tolist()), dtype=np.int64)
    sd = np.concatenate([[0], np.cumsum(send_n)[:-1]]).astype(np.int64)
    rd = np.concatenate([[0], np.cumsum(recv_n)[:-1]]).astype(np.int64)
    # the permutations are often the identity (one rank, or rows already in block order)
    sendbuf = np.ascontiguousarray(rows if _identity(order) else rows[order])
    got = _exchange(comm, sendbuf, (send_n, sd), (recv_n, rd))
    got_pos = _exchange(comm, np.ascontiguousarray(pos[order])[:, None], (send_n, sd),
                        (recv_n, rd))[:, 0]  # fmt: skip
    idx = np.searchsorted(mine_pos, got_pos)
    if _identity(idx):
        mine = got
    else:
        mine = np.empty((len(mine_pos), width), dtype=rows.dtype)
        mine[idx] = got
    return mine, mine_pos, (send_n, sd, recv_n, rd, order, idx)


def undeal_rows(comm, mine, back):
    """The inverse of :func:`deal_rows`: rows of this rank's blocks back to their owners.

    Returns (len(pos), W) rows in the order of the ``pos`` given to :func:`deal_rows`.
    """
    send_n, sd, recv_n, rd, order, idx = back
    # the permutations are often the identity (one rank, or rows already in block order)
    sendbuf = np.ascontiguousarray(mine if _identity(idx) else mine[idx])
    out = _exchange(comm, sendbuf, (recv_n, rd), (send_n, sd))
    if _identity(order):
        return out
    res = np.empty_like(out)
    res[order] = out
    return res


def moves_nothing(comm, back) -> bool:
    """Whether :func:`undeal_rows` with ``back`` (from :func:`deal_rows`) leaves every row
    where it is: one rank, and both permutations the identity."""
    return comm.Get_size() == 1 and _identity(back[4]) and _identity(back[5])


def _exchange(comm, rows, send, recv):
    """``rows`` (C-contiguous (n, W)) to the ranks and rows from them: ``send`` = (counts,
    first rows) per destination, ``recv`` likewise per source. The bits travel as unsigned
    integers of the item's size (float16, bfloat16 too); on one rank every row stays (no
    copy)."""
    if comm.Get_size() == 1:
        return rows
    width = rows.shape[1]
    raw = np.dtype(f"u{rows.dtype.itemsize}")
    got = np.empty((int(recv[0].sum()), width), dtype=rows.dtype)
    comm.Alltoallv([rows.view(raw), (send[0] * width, send[1] * width)],
                   [got.view(raw), (recv[0] * width, recv[1] * width)])  # fmt: skip
    return got


def side_by_side(cols, n: int, dtype):
    """(n, B, H, sum of widths) rows of ``dtype``: each (B, H, >= n, w) column group's first
    ``n`` rows, converted once (one pass per group, no intermediate copies)."""
    b, h = cols[0].shape[:2]
    out = np.empty((n, b, h, sum(c.shape[-1] for c in cols)), dtype=dtype)
    at = 0
    for c in cols:
        w = c.shape[-1]
        out[..., at : at + w] = np.moveaxis(c[:, :, :n], 2, 0)
        at += w
    return out


def _identity(perm) -> bool:
    """Whether the index array ``perm`` is 0, 1, 2, ... (a permutation that moves nothing)."""
    return bool(np.array_equal(perm, np.arange(len(perm))))


def kernel():
    """The reproducible C kernel of ``$RINGMPI_CPU_KERNEL`` / ``$RINGMPI_CPU_ISA``, or None.

    ``numpy``: None (the numpy code, the oracle); ``auto``: the kernel where it builds,
    else None; ``fused``: the kernel, or RuntimeError. Both give the same bits.
    """
    return choose_kernel(fused_reproducible, "reproducible C kernel")


def choose_kernel(module, what: str, block: int = KEY_BLOCK):
    """``module.default()`` (a C kernel of this mode) by ``$RINGMPI_CPU_KERNEL``, or None.

    ``numpy``: None; ``auto``: the kernel where it builds, else None; ``fused``: the
    kernel, or RuntimeError naming ``what`` and why it is unavailable. A kernel built
    for other blocks than ``block`` is a RuntimeError (its bits would differ).
    """
    choice = env.get("RINGMPI_CPU_KERNEL")
    if choice == "numpy":
        return None
    kern = module.default()
    if kern is not None and kern.tile_keys != block:
        raise RuntimeError(f"{kern.path}: blocks of {kern.tile_keys} keys, not {block}")
    if kern is None and choice == "fused":
        raise RuntimeError(
            f"RINGMPI_CPU_KERNEL=fused but the {what} is unavailable: {module.LOADER.error()}"
        )
    return kern


def score_modifiers(spec, mask, q_pos, heads, h: int) -> tuple:
    """(softcap or None, ALiBi slopes (H,) float64 or None, ALiBi query positions or None).

    The score modifiers of ``spec`` for the query heads ``heads`` (``h`` of them) and the
    rows at the global positions ``q_pos``; the sinks are not among them (`finish`).
    """
    cap = None if spec.softcap is None else float(spec.softcap)
    slopes, qa = None, None
    if spec.alibi_slopes is not None:
        slopes = np.ascontiguousarray(np.asarray(spec.alibi_slopes, dtype=np.float64)[heads])
        if slopes.shape != (h,):
            raise ValueError(f"alibi_slopes: {slopes.shape[0]} slopes for {h} query heads")
        qa = np.ascontiguousarray(mask.alibi_positions(q_pos), dtype=np.int64)
    return cap, slopes, qa


def _kernel_block(kern, q64, kb, v64, k_pos, lo, hi, scale, state, tick, step, pass_,
                  mods) -> None:  # fmt: skip
    """One K/V block, both passes' work, by the C kernel (in chunks of rows between ticks)."""
    m, l_grid, v_grid, l_parts, o_parts = state
    kt = kern.pad_keys(np.asarray(kb, dtype=np.float64))
    consts = (l_grid, v_grid, l_parts, o_parts) if pass_ else None
    sq = q64.shape[2]
    narrow = kb.dtype.itemsize <= 4  # q and k float32 values: exact products (rmr_scores)
    for r0 in range(0, sq, _ROWS):
        tick(step)
        kern.block(q64, kt, v64, k_pos, lo, hi, scale, m, sk=len(k_pos),
                   rows=(r0, min(sq, r0 + _ROWS)), consts=consts, narrow=narrow,
                   mods=mods)  # fmt: skip


def _numpy_block(q64, kb, v64, k_pos, lo, hi, scale, state, tick, step, pass_, mods) -> None:
    """One K/V block by numpy: the oracle of the C kernel (the same operations).

    lo, hi : (L, Sq) int64: row i sees key p when lo[t, i] <= p <= hi[t, i] for some t.
    """
    m, l_grid, v_grid, l_parts, o_parts = state
    cap, slopes, qa = mods
    b, h, sq, _ = q64.shape
    g = h // kb.shape[1]
    k64 = kb.astype(np.float64)
    for r0 in range(0, sq, _ROWS):
        r1 = min(sq, r0 + _ROWS)
        tick(step)
        for k0 in range(0, len(k_pos), KEY_BLOCK):  # k_pos[0] is a block's first key
            k1 = min(len(k_pos), k0 + KEY_BLOCK)
            kp = k_pos[k0:k1]
            vis = ((kp >= lo[:, r0:r1, None]) & (kp <= hi[:, r0:r1, None])).any(axis=0)
            if not vis.any():
                continue
            for bb in range(b):
                for hh in range(h):
                    kh = hh // g
                    s = scores(q64[bb, hh, r0:r1], k64[bb, kh, k0:k1], scale)
                    if cap is not None or slopes is not None:
                        slope = None if slopes is None else slopes[hh]
                        modify(s, cap, slope, None if qa is None else qa[r0:r1], kp)
                    if pass_ == 0:
                        s[~vis] = -np.inf
                        np.maximum(m[bb, hh, r0:r1], s.max(axis=1), out=m[bb, hh, r0:r1])
                        continue
                    with np.errstate(invalid="ignore", over="ignore"):
                        p = np.where(vis, det_exp(s - m[bb, hh, r0:r1, None]), 0.0)
                    lb, ob = block_sums(p, v64[bb, kh, k0:k1])
                    fold_into(lb[:, None], list(l_grid), [x[bb, hh, r0:r1] for x in l_parts], 1)
                    fold_into(
                        ob[:, None, :],
                        [c[bb, kh] for c in v_grid],
                        [x[bb, hh, r0:r1] for x in o_parts],
                        1,
                        scratch=True,
                    )


def block_sums(p, v):
    """(rows,) sums of p and (rows, Dv) sums of p v over one key block, in key order.

    ``lb = ((p_0 + p_1) + p_2) + ...``, ``ob = ((p_0 v_0 + p_1 v_1) + p_2 v_2) + ...``:
    a fixed sequence of operations on the block's keys, as in the C kernel.

    Parameters
    ----------
    p : (rows, keys) float64 weights (0 for an invisible key) ; v : (keys, Dv) float64
    """
    lb = p[:, 0].copy()
    ob = p[:, 0, None] * v[0]
    for j in range(1, p.shape[1]):
        lb = lb + p[:, j]
        ob = ob + p[:, j, None] * v[j]
    return lb, ob


def finish(l_parts, o_parts, m, dtype, sinks=None):
    """out (B, S, H, D) and lse (B, H, S) in ``dtype`` from the fold sums, added in fold order.

    ``l_parts`` (F, B, H, S) and ``o_parts`` (F, B, H, S, D) float64 arrays: their first
    fold is overwritten (the sums are made in place: no copies of the largest arrays).
    ``sinks`` (H,) float64: each row's sink logit joins the maximum and the denominator
    here, once per row: with M' = max(M, sink_h), a = det_exp(M - M') and
    b = det_exp(sink_h - M') (one of them is 1), l' = l a + b, o' = o a, out = o' / l'
    and lse = M' + det_log(l'). Where the sink is not above M, a = 1 and o, l are
    used as they are (exact products). A row with no visible key gets out 0 and
    lse = sink_h. :func:`denominators` and :func:`log_sum_exp` are its row-wise steps.
    """
    l, a, m = denominators(l_parts, m, sinks)
    o = o_parts[0]  # ((o_1 + o_2) + o_3) ...: a fixed order
    for y in o_parts[1:]:
        o += y
    if a is not None:
        o *= a[..., None]
    seen = l > 0
    np.divide(o, np.where(seen, l, 1.0)[..., None], out=o)
    o[~seen] = 0.0
    out = np.moveaxis(o, 1, 2).astype(dtype, order="C")
    return out, log_sum_exp(l, m, dtype)


def denominators(l_parts, m, sinks=None):
    """(l, a, m) of :func:`finish`: each row's l = ((l_1 + l_2) + l_3) ... (in place in
    ``l_parts[0]``), with the sink joined (l' = l a + b) where ``sinks`` is given; the
    factor a of the row's o (None: no sinks) and the maximum M' (``m`` without sinks)."""
    l = l_parts[0]
    for x in l_parts[1:]:
        l += x
    if sinks is None:
        return l, None, m
    sink = np.broadcast_to(sinks[None, :, None], m.shape)
    with np.errstate(invalid="ignore"):
        top = np.maximum(m, sink)  # NaN propagates
        a, b = det_exp(m - top), det_exp(sink - top)
    l *= a  # l a + b: the product rounded, then the sum
    l += b
    return l, a, top


def log_sum_exp(l, m, dtype):
    """lse = M + det_log(l) in ``dtype`` (:func:`finish`): -inf where no key was seen, NaN
    where l is NaN."""
    seen = l > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(seen, m + det_log(np.where(seen, l, 1.0)), -np.inf)
    lse = np.where(np.isnan(l), np.nan, lse)
    return lse.astype(dtype)
