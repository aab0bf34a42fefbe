"""Dense attention over a whole sequence: the ground truth for tests and ``ringmpi verify``.

float64 by default (the reference); ``dtype=np.float32`` gives the dense
low-precision peer that tolerances are measured against. Without ``block`` it
holds the full N x N score matrix; with ``block=R`` only R query rows' scores
at a time.
Shapes follow the package convention: q (S, H, D) or (B, S, H, D); k and v
(S, Hkv, D) or (B, S, Hkv, D) with H % Hkv == 0; lse (..., H, S).
"""

from __future__ import annotations

import numpy as np

from .mask import make_mask

__all__ = ["attention", "attention_backward"]


def _prepare(q, k, v, scale, dtype=np.float64):
    q = np.asarray(q, dtype=dtype)
    k = np.asarray(k, dtype=dtype)
    v = np.asarray(v, dtype=dtype)
    if q.ndim not in (3, 4) or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError("q, k, v must all be (S, H, D) or (B, S, H, D)")
    h, hkv = q.shape[-2], k.shape[-2]
    if h % hkv:
        raise ValueError(f"H={h} is not a multiple of Hkv={hkv}")
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else float(scale)
    # (..., S, H, D) -> (..., H, S, D); repeat each K/V head over its query group
    qh = np.moveaxis(q, -3, -2)
    kh = np.repeat(np.moveaxis(k, -3, -2), h // hkv, axis=-3)
    vh = np.repeat(np.moveaxis(v, -3, -2), h // hkv, axis=-3)
    return qh, kh, vh, scale, h // hkv


def _probs(qh, kh, scale, mask, row0: int = 0):
    """Probabilities and lse of query rows row0.. against all keys, masked by ``mask``."""
    s = qh.dtype.type(scale) * (qh @ np.swapaxes(kh, -1, -2))
    n_q, n_k = s.shape[-2:]
    if mask.causal or not mask.plain:
        lo, hi = mask.bounds(np.arange(row0, row0 + n_q))
        j = np.arange(n_k)[None, :]
        s = np.where((lo[:, None] <= j) & (j <= hi[:, None]), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    z = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(z > 0, e / z, 0)
        lse = np.where(z[..., 0] > 0, m[..., 0] + np.log(z[..., 0]), -np.inf)
    return p.astype(qh.dtype, copy=False), lse.astype(qh.dtype, copy=False)


def attention(
    q, k, v, causal: bool = False, scale: float | None = None, *, dtype=np.float64, block=None,
    window=None, cu_seqlens=None, cu_seqlens_k=None,
):  # fmt: skip
    """Dense softmax attention, computed in ``dtype``, with the masks of ``ring_attention``.

    Parameters
    ----------
    q : array (S, H, D) or (B, S, H, D)
    k, v : array (S, Hkv, D) or (B, S, Hkv, D)
    causal : bool
        Mask key j for query i when j > i (global token order).
    scale : float, optional
        Score scale, default 1/sqrt(D).
    dtype : numpy dtype
        Arithmetic precision (default float64: the reference).
    block : int, optional
        Compute this many query rows at a time (memory O(block x S)).
    window, cu_seqlens, cu_seqlens_k
        As in :func:`ringmpi.ring_attention` (:mod:`ringmpi.mask`); q may hold a
        different number of tokens than k and v (cross-attention, causal aligned
        bottom-right).

    Returns
    -------
    out : array in ``dtype``, shape of q; a row with no visible key is 0
    lse : array (..., H, S) in ``dtype``; -inf for a row with no visible key
    """
    qh, kh, vh, scale, _ = _prepare(q, k, v, scale, dtype)
    mask = make_mask(qh.shape[-2], kh.shape[-2], causal, window, cu_seqlens, cu_seqlens_k)
    s_len = qh.shape[-2]
    step = s_len if not block else int(block)
    outs, lses = [], []
    for a in range(0, max(s_len, 1), max(step, 1)):
        p, lse = _probs(qh[..., a : a + step, :], kh, scale, mask, row0=a)
        outs.append(p @ vh)
        lses.append(lse)
    out = np.concatenate(outs, axis=-2) if len(outs) > 1 else outs[0]
    lse = np.concatenate(lses, axis=-1) if len(lses) > 1 else lses[0]
    return np.moveaxis(out, -2, -3), lse


def attention_backward(
    dout, q, k, v, causal: bool = False, scale: float | None = None, *, dtype=np.float64,
    window=None, cu_seqlens=None, cu_seqlens_k=None,
):  # fmt: skip
    """Dense gradients of ``attention(q, k, v)[0]`` against ``dout``, computed in ``dtype``.

    With P = softmax(scale * Q K^T), O = P V and delta_i = sum_d dO_id O_id:
    dV = P^T dO, dS = P * (dO V^T - delta), dQ = scale * dS K, dK = scale * dS^T Q.
    Under GQA the gradient of a K/V head sums over the query heads that share it.

    Returns
    -------
    dq, dk, dv : arrays in ``dtype`` with the shapes of q, k, v.
    """
    qh, kh, vh, scale, group = _prepare(q, k, v, scale, dtype)
    mask = make_mask(qh.shape[-2], kh.shape[-2], causal, window, cu_seqlens, cu_seqlens_k)
    do = np.moveaxis(np.asarray(dout, dtype=dtype), -3, -2)
    p, _ = _probs(qh, kh, scale, mask)
    o = p @ vh
    delta = np.sum(do * o, axis=-1, keepdims=True)
    dv = np.swapaxes(p, -1, -2) @ do
    ds = p * (do @ np.swapaxes(vh, -1, -2) - delta)
    sc = qh.dtype.type(scale)
    dq = sc * (ds @ kh)
    dk = sc * (np.swapaxes(ds, -1, -2) @ qh)

    def fold(g):  # (..., H, S, D) -> (..., Hkv, S, D) summed over each group
        shp = g.shape
        g = g.reshape(*shp[:-3], shp[-3] // group, group, *shp[-2:]).sum(axis=-3)
        return np.moveaxis(g, -3, -2)

    return np.moveaxis(dq, -2, -3), fold(dk), fold(dv)
