"""Dense attention in float64 over a whole sequence: the ground truth for tests.

Holds the full N x N score matrix, so use it only where that fits in memory.
Shapes follow the package convention: q (S, H, D) or (B, S, H, D); k and v
(S, Hkv, D) or (B, S, Hkv, D) with H % Hkv == 0; lse (..., H, S).
"""

from __future__ import annotations

import numpy as np

__all__ = ["attention", "attention_backward"]


def _prepare(q, k, v, scale):
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
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


def _probs(qh, kh, scale, causal):
    s = scale * (qh @ np.swapaxes(kh, -1, -2))
    if causal:
        n_q, n_k = s.shape[-2:]
        s = np.where(np.tril(np.ones((n_q, n_k), dtype=bool)), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    z = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(z > 0, e / z, 0.0)
        lse = np.where(z[..., 0] > 0, m[..., 0] + np.log(z[..., 0]), -np.inf)
    return p, lse


def attention(q, k, v, causal: bool = False, scale: float | None = None):
    """Dense softmax attention in float64.

    Parameters
    ----------
    q : array (S, H, D) or (B, S, H, D)
    k, v : array (S, Hkv, D) or (B, S, Hkv, D)
    causal : bool
        Mask key j for query i when j > i (global token order).
    scale : float, optional
        Score scale, default 1/sqrt(D).

    Returns
    -------
    out : float64 array, shape of q
    lse : float64 array (..., H, S)
    """
    qh, kh, vh, scale, _ = _prepare(q, k, v, scale)
    p, lse = _probs(qh, kh, scale, causal)
    out = np.moveaxis(p @ vh, -2, -3)
    return out, lse


def attention_backward(dout, q, k, v, causal: bool = False, scale: float | None = None):
    """Dense float64 gradients of ``attention(q, k, v)[0]`` against ``dout``.

    With P = softmax(scale * Q K^T), O = P V and delta_i = sum_d dO_id O_id:
    dV = P^T dO, dS = P * (dO V^T - delta), dQ = scale * dS K, dK = scale * dS^T Q.
    Under GQA the gradient of a K/V head sums over the query heads that share it.

    Returns
    -------
    dq, dk, dv : float64 arrays with the shapes of q, k, v.
    """
    qh, kh, vh, scale, group = _prepare(q, k, v, scale)
    do = np.moveaxis(np.asarray(dout, dtype=np.float64), -3, -2)
    p, _ = _probs(qh, kh, scale, causal)
    o = p @ vh
    delta = np.sum(do * o, axis=-1, keepdims=True)
    dv = np.swapaxes(p, -1, -2) @ do
    ds = p * (do @ np.swapaxes(vh, -1, -2) - delta)
    dq = scale * (ds @ kh)
    dk = scale * (np.swapaxes(ds, -1, -2) @ qh)

    def fold(g):  # (..., H, S, D) -> (..., Hkv, S, D) summed over each group
        shp = g.shape
        g = g.reshape(*shp[:-3], shp[-3] // group, group, *shp[-2:]).sum(axis=-3)
        return np.moveaxis(g, -3, -2)

    return np.moveaxis(dq, -2, -3), fold(dk), fold(dv)
