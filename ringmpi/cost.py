"""The cost model in one place: flops of visible pairs, bytes on the wire.

What a tile computes depends on its blocking (the numpy tile scores whole 256 x
1024 blocks of a masked tile, or for a mask of slices groups of rows over the
union of their key ranges, the fused C tile strips of 6 rows, the CUDA tile its
own blocks), so the flops a tile returns differ between backends for the
same call. The numbers here count the work the mask asks for, the same on every
backend:

    forward:   4 D per visible (query, key) pair and query head   (QK^T and PV)
    backward: 10 D per visible pair and query head                (five products)
    ring step: 2 Sk Hkv D elements of K/V (backward: the dK/dV accumulators too)

With keys of width Dk and values of width Dv (multi-head latent attention):
forward 2 (Dk + Dv), backward 2 (3 Dk + 2 Dv) per pair and head, and Sk Hkv
(Dk + Dv) elements per ring step.

``stats["flops"]`` of :func:`ringmpi.ring_attention` and of the backward is this
count; ``stats["tile_flops"]`` is what the tiles reported (>= flops: it includes
the masked part of the blocks they scored).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

__all__ = [
    "visible_pairs",
    "mask_pairs",
    "row_pairs",
    "rank_pairs",
    "imbalance",
    "imbalances",
    "FORWARD_PER_PAIR",
    "BACKWARD_PER_PAIR",
    "flops",
    "kv_bytes",
]

FORWARD_PER_PAIR = 4  # x D per query head: s = q.k (2 D) and acc += p v (2 D)
BACKWARD_PER_PAIR = 10  # x D per query head: s, dP = dO.v, dV, dQ, dK (2 D each)


def visible_pairs(
    q_pos: np.ndarray, k_pos: np.ndarray, causal: bool, bounds: Optional[tuple] = None
) -> int:
    """Number of (query, key) pairs a tile call must score.

    Parameters
    ----------
    q_pos : (Sq,) int ; k_pos : (Sk,) int
        Global token positions of the queries and of the visiting keys (any order).
    causal : bool
        Key j visible to query i iff k_pos[j] <= q_pos[i] (when ``bounds`` is None).
    bounds : ((Sq,), (Sq,)) int, optional
        The tile contract's ``bounds=(lo, hi)``: key j visible to query i iff
        lo[i] <= k_pos[j] <= hi[i]; replaces ``causal``.
    """
    sq, sk = len(q_pos), len(k_pos)
    if sq == 0 or sk == 0:
        return 0
    if bounds is None and not causal:
        return sq * sk
    ks = np.sort(np.asarray(k_pos, dtype=np.int64))
    if bounds is None:
        return int(np.searchsorted(ks, np.asarray(q_pos, dtype=np.int64), side="right").sum())
    lo, hi = (np.asarray(b, dtype=np.int64) for b in bounds)
    n = np.searchsorted(ks, hi, side="right") - np.searchsorted(ks, lo, side="left")
    return int(np.maximum(n, 0).sum())


def mask_pairs(mask, block: int = 1 << 20) -> int:
    """Number of (query, key) pairs a whole :class:`ringmpi.mask.Mask` leaves visible.

    O(nq) time and memory per ``block`` query rows: the count of a whole sequence
    (what :func:`visible_pairs` gives summed over every tile call of a ring).
    """
    if getattr(mask, "slices", None) is not None:  # a union of slices: overlaps counted once
        return mask.slices.pairs(mask.nq)
    if mask.plain:
        n = mask.nq
        return n * (n + 1) // 2 if mask.causal else n * n
    total = 0
    for a in range(0, mask.nq, block):
        lo, hi = mask.bounds(np.arange(a, min(mask.nq, a + block), dtype=np.int64))
        total += int(np.maximum(hi - lo + 1, 0).sum())
    return total


def row_pairs(mask, q_pos: np.ndarray, block: int = 1 << 16) -> np.ndarray:
    """Visible keys of each query in ``q_pos`` under ``mask``: int64 (len(q_pos),).

    The sum of the lengths of the query's key ranges (:meth:`ringmpi.mask.Mask.layers`:
    disjoint, so each pair counts once), ``block`` queries at a time.
    """
    q_pos = np.asarray(q_pos, dtype=np.int64)
    out = np.zeros(len(q_pos), dtype=np.int64)
    for a in range(0, len(q_pos), block):
        for lo, hi in mask.layers(q_pos[a : a + block]):
            out[a : a + block] += np.maximum(np.asarray(hi) - np.asarray(lo) + 1, 0)
    return out


def rank_pairs(mask, size: int, layout: str) -> np.ndarray:
    """Visible pairs each of ``size`` ranks scores under ``layout``: int64 (size,) (issue 41).

    A rank scores its own queries against every key (the keys travel), so its work
    is the visible keys of the queries the layout gives it; the entries sum to
    :func:`mask_pairs`.
    """
    from .layout import positions

    return np.array(
        [
            int(
                row_pairs(
                    mask, positions(mask.nq, r, size, layout, cu_seqlens=mask.cu_q, mask=mask)
                ).sum()
            )
            for r in range(size)
        ],
        dtype=np.int64,
    )


def imbalance(mask, size: int, layout: str) -> float:
    """The slowest rank's visible pairs over the mean of all ranks (1.0: perfectly even).

    The work model of :func:`rank_pairs` (pairs, no timing); 1.0 for a mask with
    no visible pair.
    """
    per = rank_pairs(mask, size, layout)
    total = int(per.sum())
    return 1.0 if total == 0 else float(per.max()) * size / total


def imbalances(mask, size: int) -> dict:
    """{layout: :func:`imbalance`} for every layout (issue 41), the mask-free ones first."""
    from .layout import LAYOUTS, MASK_LAYOUTS

    return {lay: imbalance(mask, size, lay) for lay in LAYOUTS + MASK_LAYOUTS}


def flops(
    pairs: float,
    d: int,
    heads: int,
    batch: int = 1,
    backward: bool = False,
    dv: Optional[int] = None,
) -> float:
    """Model flops of ``pairs`` visible pairs for ``batch`` x ``heads`` query heads of dim ``d``.

    ``dv``: the value width where it differs from the key width ``d`` (issue 42):
    the products over keys (q.k; backward also dQ = dS K, dK = dS^T Q) take 2 d
    each, those over values (P V; backward dP = dO V^T, dV = P^T dO) 2 dv each, so
    forward 2 (d + dv) and backward 2 (3 d + 2 dv) per pair and head, which are
    4 d and 10 d for dv = d. An int when the arguments are ints (what ``stats``
    reports), else a float (the planner's averages).
    """
    if dv is None or dv == d:
        per = BACKWARD_PER_PAIR if backward else FORWARD_PER_PAIR
        return per * pairs * d * heads * batch
    per_d = 2 * (3 * d + 2 * dv) if backward else 2 * (d + dv)
    return per_d * pairs * heads * batch


def kv_bytes(
    sk: int, hkv: int, d: int, itemsize: int, batch: int = 1, dv: Optional[int] = None
) -> int:
    """Bytes of one travelling K/V block: Sk Hkv (Dk + Dv) elements (K and V packed).

    ``d`` is the key width Dk, ``dv`` the value width (default ``d``: 2 Sk Hkv D).
    """
    dv = d if dv is None else dv
    return batch * sk * hkv * (d + dv) * itemsize
