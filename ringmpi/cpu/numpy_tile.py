"""The numpy tiles, forward and backward: the specification every other tile matches.

Arrays and arguments follow the tile contract in :mod:`ringmpi.tile`; here q, k,
v and the state are in the compute dtype (float32, or float64 for float64 inputs).

For one query row with scores s_j = scale * q.k_j over the visible keys, the
update is the streaming softmax

    m'  = max(m, max_j s_j)
    acc = exp(m - m') acc + sum_j exp(s_j - m') v_j
    l   = exp(m - m') l   + sum_j exp(s_j - m')

Causal: key j is visible to query i iff k_pos[j] <= q_pos[i]. The rows are cut
into runs of evenly spaced positions and then into blocks, so each block has
tight position bounds: a block pair with max(q_pos) < min(k_pos) is skipped
without computing anything, one with min(q_pos) >= max(k_pos) needs no mask.

Backward, for one head with P = softmax(scale * Q K^T) (rows normalised by the
saved log-sum-exp: P_ij = exp(scale * q_i.k_j - lse_i)), O = P V and upstream dO:

    delta_i = sum_d dO_id O_id            (= sum_j P_ij (dO V^T)_ij)
    dV      = P^T dO
    dS      = P * (dO V^T - delta)        (softmax Jacobian, row by row)
    dQ      = scale * dS K
    dK      = scale * dS^T Q
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from ..partition import runs

__all__ = ["compute_dtype", "forward_tile", "backward_tile", "blocks", "BLOCK_Q", "BLOCK_K"]

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
    """Fold one K/V block into the online-softmax state, in place (see :mod:`ringmpi.tile`).

    Returns the flops of the two matrix products (4 * pairs * D per head) over
    the blocks that were not skipped.
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


def backward_tile(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    dout: np.ndarray,
    lse: np.ndarray,
    delta: np.ndarray,
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    dq: np.ndarray,
    dk: np.ndarray,
    dv: np.ndarray,
    *,
    scale: float,
    causal: bool,
    progress: Optional[Callable[[], None]] = None,
) -> int:
    """Add one K/V block's gradient contributions, in place (see :mod:`ringmpi.tile`).

    Returns the flops of the five matrix products (10 * pairs * D per head) over
    the blocks that were not skipped.
    """
    bsz, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = h // hkv
    if sq == 0 or sk == 0:
        return 0
    dt = dq.dtype.type
    # grouped views: query head h = hkv_index * g + group_index, so a (G, n)
    # block of rows flattens to G*n rows that all read the same K/V head
    q5 = q.reshape(bsz, hkv, g, sq, d)
    do5 = dout.reshape(bsz, hkv, g, sq, d)
    dq5 = dq.reshape(bsz, hkv, g, sq, d)
    # p = exp(s - lse): a row with lse = -inf saw no key; +inf makes its p zero
    lse4 = np.where(np.isneginf(lse), np.inf, lse).astype(dt).reshape(bsz, hkv, g, sq)
    delta4 = delta.astype(dt, copy=False).reshape(bsz, hkv, g, sq)
    kblocks = list(blocks(k_pos, BLOCK_K))
    flops = 0
    for qa, qb, qlo, qhi in blocks(q_pos, BLOCK_Q):
        n = qb - qa
        live = [kb for kb in kblocks if not (causal and qhi < kb[2])]
        if not live:
            continue  # every key of this block is in the future of every query
        qs = (q5[:, :, :, qa:qb] * dt(scale)).reshape(bsz, hkv, g * n, d)
        dob = np.ascontiguousarray(do5[:, :, :, qa:qb]).reshape(bsz, hkv, g * n, d)
        lse_b = np.ascontiguousarray(lse4[..., qa:qb]).reshape(bsz, hkv, g * n, 1)
        delta_b = np.ascontiguousarray(delta4[..., qa:qb]).reshape(bsz, hkv, g * n, 1)
        dq_b = np.zeros((bsz, hkv, g * n, d), dtype=dt)
        for ka, kb, _klo, khi in live:
            kk, vv = k[:, :, ka:kb], v[:, :, ka:kb]
            p = qs @ np.swapaxes(kk, -1, -2)  # scores, (B, Hkv, G*n, nk)
            if causal and qlo < khi:
                bias = np.where(q_pos[qa:qb, None] >= k_pos[None, ka:kb], 0.0, -np.inf)
                p.reshape(bsz, hkv, g, n, kb - ka)[...] += bias.astype(dt)
            p -= lse_b
            np.exp(p, out=p)  # probabilities, masked entries exactly 0
            dv[:, :, ka:kb] += np.swapaxes(p, -1, -2) @ dob
            ds = dob @ np.swapaxes(vv, -1, -2)  # dP = dO V^T
            ds -= delta_b
            ds *= p  # dS = P * (dP - delta); scale is folded into qs and dq
            dq_b += ds @ kk
            dk[:, :, ka:kb] += np.swapaxes(ds, -1, -2) @ qs
            flops += 10 * bsz * h * n * (kb - ka) * d
            if progress is not None:
                progress()
        dq5[:, :, :, qa:qb] += dt(scale) * dq_b.reshape(bsz, hkv, g, n, d)
    return flops
