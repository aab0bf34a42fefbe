"""CPU tile backend in numpy: the specification every other tile backend matches.

A *tile call* takes this rank's queries and one visiting K/V block and folds
the block into the running online-softmax state. Internal layout is head-major:

    q    (B, H,   Sq, D)   compute dtype (float32 or float64)
    k, v (B, Hkv, Sk, D)   same dtype; query head h reads K/V head h // (H/Hkv)
    q_pos (Sq,), k_pos (Sk,)  int64 global token positions
    acc  (B, H, Sq, D), m (B, H, Sq), l (B, H, Sq)   state, compute dtype

For one query row with scores s_j = scale * q.k_j over the visible keys, the
update is the streaming softmax

    m'  = max(m, max_j s_j)
    acc = exp(m - m') acc + sum_j exp(s_j - m') v_j
    l   = exp(m - m') l   + sum_j exp(s_j - m')

Causal: key j is visible to query i iff k_pos[j] <= q_pos[i]. The rows are cut
into runs of evenly spaced positions and then into blocks, so each block has
tight position bounds: a block pair with max(q_pos) < min(k_pos) is skipped
without computing anything, one with min(q_pos) >= max(k_pos) needs no mask.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from .partition import runs

__all__ = ["compute_dtype", "forward_tile", "BLOCK_Q", "BLOCK_K"]

BLOCK_Q = 256
BLOCK_K = 1024


def compute_dtype(dtype) -> np.dtype:
    """Accumulation dtype for an input dtype: float64 stays, the rest use float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def blocks(pos: np.ndarray, size: int):
    """Yield (start, stop, min_pos, max_pos) blocks of at most ``size`` rows inside runs."""
    for a, b in runs(pos):
        for s in range(a, b, size):
            e = min(s + size, b)
            lo, hi = int(pos[s]), int(pos[e - 1])
            yield s, e, min(lo, hi), max(lo, hi)


def forward_tile(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    acc: np.ndarray,
    m: np.ndarray,
    l: np.ndarray,
    *,
    scale: float,
    causal: bool,
    progress: Optional[Callable[[], None]] = None,
) -> int:
    """Fold one K/V block into the online-softmax state, in place.

    Parameters
    ----------
    q : (B, H, Sq, D) ; k, v : (B, Hkv, Sk, D) ; q_pos : (Sq,) ; k_pos : (Sk,)
    acc : (B, H, Sq, D) ; m, l : (B, H, Sq)
        State, updated in place.
    scale : float
    causal : bool
    progress : callable, optional
        Called between blocks (lets MPI progress a pending exchange).

    Returns
    -------
    int
        Floating-point operations spent on the two matrix products
        (4 * pairs * D), counting only blocks that were not skipped.
    """
    bsz, h, sq, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    sk = k.shape[2]
    if sq == 0 or sk == 0:
        return 0
    # grouped views: query head h = hkv_index * g + group_index
    q5 = q.reshape(bsz, hkv, g, sq, d)
    acc5 = acc.reshape(bsz, hkv, g, sq, d)
    m5 = m.reshape(bsz, hkv, g, sq)
    l5 = l.reshape(bsz, hkv, g, sq)
    kt = np.swapaxes(k, -1, -2)
    kblocks = list(blocks(k_pos, BLOCK_K))
    flops = 0
    for qa, qb, qlo, qhi in blocks(q_pos, BLOCK_Q):
        n = qb - qa
        qs = q5[:, :, :, qa:qb] * q.dtype.type(scale)  # (B, Hkv, G, n, D), contiguous
        qs2 = qs.reshape(bsz, hkv, g * n, d)
        mo = m5[:, :, :, qa:qb]
        lo = l5[:, :, :, qa:qb]
        ao = acc5[:, :, :, qa:qb]
        for ka, kb, klo, khi in kblocks:
            if causal and qhi < klo:
                continue  # every key is in the future of every query
            s = qs2 @ kt[:, :, :, ka:kb]  # (B, Hkv, G*n, nk)
            s5 = s.reshape(bsz, hkv, g, n, kb - ka)
            if causal and qlo < khi:
                bias = np.where(q_pos[qa:qb, None] >= k_pos[None, ka:kb], 0.0, -np.inf)
                s5 += bias.astype(s.dtype)
            m_new = np.maximum(mo, s5.max(axis=-1))
            m_safe = np.where(np.isneginf(m_new), 0, m_new).astype(s.dtype)
            s5 -= m_safe[..., None]
            np.exp(s5, out=s5)
            alpha = np.exp(mo - m_safe)
            lo *= alpha
            lo += s5.sum(axis=-1)
            ao *= alpha[..., None]
            ao += (s @ v[:, :, ka:kb]).reshape(bsz, hkv, g, n, d)
            mo[...] = m_new
            flops += 4 * bsz * h * n * (kb - ka) * d
            if progress is not None:
                progress()
    return flops
