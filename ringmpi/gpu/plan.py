"""Host-side launch plans of the CUDA tiles: block plan, launch order, flops (numpy only).

Every mask reaches the tiles as per-row bounds: query row i sees key j iff

    lo[i] <= k_pos[j] <= hi[i]        (global positions; lo[i] > hi[i]: no key)

given by ``bounds=(lo, hi)`` (windows, packed sequences, cross-attention: see
:mod:`ringmpi.mask`), or else lo = -inf and hi = q_pos (causal) or hi = +inf.

A tile kernel cuts the query rows into blocks of ``bm`` rows and the keys into
blocks of ``bn``. For every query block the plan gives the envelope

    lo_min, hi_max   over the rows that see some key: no row sees a key outside
    lo_max, hi_min   over all rows: every row sees every key inside

and for every key block its min/max position [klo, khi]. A (query block, key
block) pair is skipped when hi_max < klo or khi < lo_min (no row sees any key
of the block), computed without a per-element mask when lo_max <= klo and
khi <= hi_min, and masked per element otherwise. Positions need not be
contiguous (zigzag, striped, packed layouts): the tests are on the blocks'
min/max, so a pair is never skipped while one of its elements is visible.

Packed rows (``g`` > 1): the g query heads sharing one K/V head are packed, row
r of a group being position r // g of head r % g, so a block of ``bm`` rows
covers positions [r0 // g, (r0 + bm - 1) // g].
"""

from __future__ import annotations

from typing import Optional

import numpy as np

__all__ = ["POS_MIN", "POS_MAX", "row_bounds", "block_bounds", "host_plan", "tile_flops"]

POS_MIN = int(np.iinfo(np.int64).min)
POS_MAX = int(np.iinfo(np.int64).max)


def row_bounds(q_pos: np.ndarray, causal: bool, bounds: Optional[tuple] = None) -> tuple:
    """(lo, hi): the visible key positions of each query row, int64 arrays of shape (Sq,).

    Parameters
    ----------
    q_pos : (Sq,) int64
        Global query positions.
    causal : bool
        Without ``bounds``: key j visible iff k_pos[j] <= q_pos[i]; else every key.
    bounds : (lo, hi), optional
        Two integer arrays of shape (Sq,); when given, ``causal`` is ignored
        (the bounds already contain it).

    Raises
    ------
    ValueError
        If ``bounds`` is not two integer arrays of shape (Sq,).
    """
    q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
    if bounds is None:
        lo = np.full(len(q_pos), POS_MIN, dtype=np.int64)
        hi = q_pos if causal else np.full(len(q_pos), POS_MAX, dtype=np.int64)
        return lo, hi
    try:
        lo, hi = bounds
    except (TypeError, ValueError):
        raise ValueError("GPU tile: bounds must be a pair (lo, hi) of int64 arrays") from None
    lo, hi = np.asarray(lo), np.asarray(hi)
    for name, x in (("lo", lo), ("hi", hi)):
        if x.shape != q_pos.shape or not np.issubdtype(x.dtype, np.integer):
            raise ValueError(
                f"GPU tile: bounds {name} must be an integer array of shape {q_pos.shape}, "
                f"got {x.dtype} {x.shape}"
            )
    return np.ascontiguousarray(lo, dtype=np.int64), np.ascontiguousarray(hi, dtype=np.int64)


def block_bounds(pos: np.ndarray, bs: int) -> tuple:
    """(min, max) position of each block of ``bs`` consecutive rows, int64 arrays."""
    starts = np.arange(0, len(pos), bs)
    return np.minimum.reduceat(pos, starts), np.maximum.reduceat(pos, starts)


def _packed_reduce(ufunc, x: np.ndarray, first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """ufunc over x[first_j .. last_j] for each block j (consecutive, possibly equal firsts)."""
    # reduceat covers [first_j, first_{j+1}) (x[first_j] alone when they are equal);
    # last_j is first_{j+1} - 1 or first_{j+1}, so x[last_j] completes the range
    return ufunc(ufunc.reduceat(x, first), x[last])


def host_plan(
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    bm: int,
    bn: int,
    g: int,
    causal: bool,
    bounds: Optional[tuple] = None,
):
    """Block plan, launch order and computed (row, key) pairs of one tile call.

    Parameters
    ----------
    q_pos : (Sq,) int64 ; k_pos : (Sk,) int64
        Global positions, both non-empty, any order.
    bm, bn : int
        Rows per query block and keys per key block.
    g : int
        Query heads packed per row group (1: one head per row block).
    causal : bool
    bounds : (lo, hi), optional
        Per-row visible key positions, each (Sq,) int64 (see :func:`row_bounds`).

    Returns
    -------
    plan : (4 nqb + 2 nkb,) int64
        [lo_min, lo_max, hi_min, hi_max] (nqb each), then [klo, khi] (nkb each).
        A query block whose rows all see nothing has lo_min = POS_MAX and
        hi_max = POS_MIN (every pair skipped).
    order : (nqb,) int32
        Query blocks by decreasing number of computed keys (stable), the
        heaviest first; the identity when every block computes every key.
    pairs : int
        (row, key) pairs inside the computed block pairs of one row group
        (one head when g = 1).
    """
    q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
    k_pos = np.ascontiguousarray(k_pos, dtype=np.int64)
    lo, hi = row_bounds(q_pos, causal, bounds)
    sq, sk = len(q_pos), len(k_pos)
    rows = g * sq
    starts = np.arange(0, rows, bm)
    ends = np.minimum(starts + bm, rows)
    first, last = starts // g, (ends - 1) // g  # positions [first, last] of each block
    seen = lo <= hi  # rows that see some key position (empty rows do not widen the envelope)
    lo_min = _packed_reduce(np.minimum, np.where(seen, lo, POS_MAX), first, last)
    hi_max = _packed_reduce(np.maximum, np.where(seen, hi, POS_MIN), first, last)
    lo_max = _packed_reduce(np.maximum, lo, first, last)
    hi_min = _packed_reduce(np.minimum, hi, first, last)
    klo, khi = block_bounds(k_pos, bn)
    plan = np.concatenate((lo_min, lo_max, hi_min, hi_max, klo, khi)).astype(np.int64)
    # keys of the live key blocks (klo <= hi_max and khi >= lo_min) of each query block:
    # those with klo <= hi_max minus those with khi < lo_min (a subset when lo_min <= hi_max)
    nk = np.diff(np.append(np.arange(0, sk, bn), sk))
    by_lo, by_hi = np.argsort(klo, kind="stable"), np.argsort(khi, kind="stable")
    cum_lo = np.concatenate(([0], np.cumsum(nk[by_lo])))
    cum_hi = np.concatenate(([0], np.cumsum(nk[by_hi])))
    below = cum_lo[np.searchsorted(klo[by_lo], hi_max, side="right")]
    before = cum_hi[np.searchsorted(khi[by_hi], lo_min, side="left")]
    keys = np.where(lo_min <= hi_max, below - before, 0)
    order = np.argsort(-keys, kind="stable").astype(np.int32)
    return plan, order, int(np.dot(ends - starts, keys))


def tile_flops(
    kern,
    q_pos,
    k_pos,
    causal: bool,
    b: int,
    h: int,
    hkv: int,
    d: int,
    bounds: Optional[tuple] = None,
) -> int:
    """Flops the forward tile reports for one call with configuration ``kern``.

    4 * D per (query, key) pair inside the (query block, key block) pairs that
    the kernel computes (not skipped), over B batches and H heads.
    """
    if len(q_pos) == 0 or len(k_pos) == 0:
        return 0
    g = h // hkv if kern.packed else 1
    pairs = host_plan(q_pos, k_pos, kern.bm, kern.bn, g, causal, bounds)[2]
    return 4 * d * b * (hkv if kern.packed else h) * pairs
