"""Host-side launch plans of the CUDA tiles: block bounds, launch order, flops (numpy only).

A tile kernel cuts the query rows into blocks of ``bm`` rows and the keys into
blocks of ``bn``; under a causal mask a (query block, key block) pair whose
keys all lie in the future of its queries is skipped. The kernels get the
min/max position of every block (``bounds``) and, for the packed kernels, the
order in which to walk the query blocks.

Packed rows (``g`` > 1): the g query heads sharing one K/V head are packed, row
r of a group being position r // g of head r % g, so a block of ``bm`` rows
covers positions [r0 // g, (r0 + bm - 1) // g].
"""

from __future__ import annotations

import numpy as np

__all__ = ["block_bounds", "host_plan", "tile_flops"]


def block_bounds(pos: np.ndarray, bs: int) -> tuple:
    """(min, max) position of each block of ``bs`` consecutive rows, int64 arrays."""
    starts = np.arange(0, len(pos), bs)
    return np.minimum.reduceat(pos, starts), np.maximum.reduceat(pos, starts)


def host_plan(q_pos: np.ndarray, k_pos: np.ndarray, bm: int, bn: int, g: int, causal: bool):
    """Bounds, launch order and computed (row, key) pairs of one tile call.

    Parameters
    ----------
    q_pos : (Sq,) int64 ; k_pos : (Sk,) int64
        Global positions, both non-empty.
    bm, bn : int
        Rows per query block and keys per key block.
    g : int
        Query heads packed per row group (1: one head per row block).
    causal : bool

    Returns
    -------
    bounds : (2 nqb + 2 nkb,) int64
        [qlo(nqb), qhi(nqb), klo(nkb), khi(nkb)].
    order : (nqb,) int32
        Query blocks by decreasing number of computed keys (stable), the
        heaviest first; identity when not causal.
    pairs : int
        (row, key) pairs inside the computed block pairs of one row group
        (one head when g = 1).
    """
    q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
    k_pos = np.ascontiguousarray(k_pos, dtype=np.int64)
    sq, sk = len(q_pos), len(k_pos)
    rows = g * sq
    starts = np.arange(0, rows, bm)
    ends = np.minimum(starts + bm, rows)
    first, last = starts // g, (ends - 1) // g  # positions [first, last] of each block
    # reduceat covers [first_j, first_{j+1}); last_j is first_{j+1} - 1 or first_{j+1}
    qlo = np.minimum(np.minimum.reduceat(q_pos, first), q_pos[last])
    qhi = np.maximum(np.maximum.reduceat(q_pos, first), q_pos[last])
    klo, khi = block_bounds(k_pos, bn)
    bounds = np.concatenate((qlo, qhi, klo, khi)).astype(np.int64)
    if causal:
        nk = np.diff(np.append(np.arange(0, sk, bn), sk))
        srt = np.argsort(klo, kind="stable")
        cum = np.concatenate(([0], np.cumsum(nk[srt])))
        keys = cum[np.searchsorted(klo[srt], qhi, side="right")]  # keys of blocks with klo <= qhi
        order = np.argsort(-keys, kind="stable").astype(np.int32)
    else:
        keys = np.full(len(starts), sk)
        order = np.arange(len(starts), dtype=np.int32)
    return bounds, order, int(np.dot(ends - starts, keys))


def tile_flops(kern, q_pos, k_pos, causal: bool, b: int, h: int, hkv: int, d: int) -> int:
    """Flops the forward tile reports for one call with configuration ``kern``.

    4 * D per (query, key) pair inside the (query block, key block) pairs that
    the kernel computes (not skipped), over B batches and H heads.
    """
    if len(q_pos) == 0 or len(k_pos) == 0:
        return 0
    g = h // hkv if kern.packed else 1
    pairs = host_plan(q_pos, k_pos, kern.bm, kern.bn, g, causal)[2]
    return 4 * d * b * (hkv if kern.packed else h) * pairs
