"""Dense attention over a whole sequence: the ground truth for tests and ``ringmpi verify``.

float64 by default (the reference); ``dtype=np.float32`` gives the dense
low-precision peer that tolerances are measured against. Without ``block`` it
holds the full N x N score matrix; with ``block=R`` only R query rows' scores
at a time.
Shapes follow the package convention: q (S, H, D) or (B, S, H, D); k and v
(S, Hkv, D) or (B, S, Hkv, D) with H % Hkv == 0; lse (..., H, S). Keys and values
may differ in width: q and k have Dk, v and the output Dv (multi-head latent
attention); the scale defaults to 1/sqrt(Dk).

Score modifiers, in this order (FlashAttention's and gpt-oss's conventions):
with x_ij = scale * q_i.k_j, ``softcap`` c gives s_ij = c * tanh(x_ij / c);
``alibi_slopes`` adds -slope_h * abs(qa_i - j) (qa: :meth:`ringmpi.mask.Mask.alibi_positions`);
the mask hides keys; ``sinks`` add exp(sink_h) to each row's softmax
denominator (a virtual key with value 0), so lse includes it and a row with
no visible key gets out 0 and lse = sink_h.
"""

from __future__ import annotations

import numpy as np

from . import scoremods
from .mask import make_mask
from .slices import Slices

__all__ = ["attention", "attention_backward"]


def _prepare(q, k, v, scale, dtype=np.float64):
    q = np.asarray(q, dtype=dtype)
    k = np.asarray(k, dtype=dtype)
    v = np.asarray(v, dtype=dtype)
    if q.ndim not in (3, 4) or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError("q, k, v must all be (S, H, D) or (B, S, H, D)")
    h, hkv = q.shape[-2], k.shape[-2]
    if k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q {q.shape}, k {k.shape}, v {v.shape}: q and k must share the key width Dk, "
            "k and v every axis but the last"
        )
    if h % hkv:
        raise ValueError(f"H={h} is not a multiple of Hkv={hkv}")
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else float(scale)
    # (..., S, H, D) -> (..., H, S, D); repeat each K/V head over its query group
    qh = np.moveaxis(q, -3, -2)
    kh = np.repeat(np.moveaxis(k, -3, -2), h // hkv, axis=-3)
    vh = np.repeat(np.moveaxis(v, -3, -2), h // hkv, axis=-3)
    return qh, kh, vh, scale, h // hkv


def _modifiers(h: int, modifiers: dict, sinks):
    """(the score modifiers' block or None, the sinks as float64 (H,) or None)."""
    sink = None
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float64).reshape(-1)
        if sink.shape != (h,) or not np.isfinite(sink).all():
            raise ValueError(f"sinks must hold H={h} finite numbers, got shape {sink.shape}")
    return scoremods.of_spec(modifiers, h), sink


def _explicit(mask, nq: int, nk: int, causal, window, cu_seqlens):
    """An explicit mask as a bool (nq, nk) array (True: visible), or None; ValueError if bad."""
    if mask is None:
        return None
    if causal or window is not None or cu_seqlens is not None:
        raise ValueError("mask is the whole mask: leave causal, window and cu_seqlens unset")
    if isinstance(mask, Slices):
        return mask.to_dense(nq, nk)
    dense = np.asarray(mask)
    if dense.dtype != bool or dense.shape != (nq, nk):
        raise ValueError(
            f"mask must be a Slices or a bool ({nq}, {nk}) array, got {dense.dtype} {dense.shape}"
        )
    return dense


def _probs(qh, kh, scale, mask, row0: int = 0, mods=(None, None), dense=None):
    """Probabilities, lse and the modifiers' d s'/d s (or None) of rows row0.. vs all keys.

    ``dense``: an explicit bool (nq, nk) mask of all rows, replacing ``mask``'s ranges.
    """
    tm, sinks = mods
    s = qh.dtype.type(scale) * (qh @ np.swapaxes(kh, -1, -2))
    n_q, n_k = s.shape[-2:]
    rows = np.arange(row0, row0 + n_q)
    dmod = None
    if tm is not None:
        qa = mask.alibi_positions(rows)
        dmod = scoremods.apply(s, tm, qa, np.arange(n_k), (s.shape[-3],))
    if dense is not None:
        s = np.where(dense[row0 : row0 + n_q], s, -np.inf)
    elif mask.causal or not mask.plain:
        lo, hi = mask.bounds(rows)
        j = np.arange(n_k)[None, :]
        s = np.where((lo[:, None] <= j) & (j <= hi[:, None]), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:  # the sink is one more logit of each row
        m = np.maximum(m, sinks.astype(s.dtype)[:, None, None])
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    z = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        z = z + np.exp(sinks.astype(s.dtype)[:, None, None] - m)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(z > 0, e / z, 0)
        lse = np.where(z[..., 0] > 0, m[..., 0] + np.log(z[..., 0]), -np.inf)
    return p.astype(qh.dtype, copy=False), lse.astype(qh.dtype, copy=False), dmod


def attention(
    q,
    k,
    v,
    causal: bool = False,
    scale: float | None = None,
    *,
    dtype=np.float64,
    block=None,
    window=None,
    cu_seqlens=None,
    cu_seqlens_k=None,
    sinks=None,
    mask=None,
    **modifiers,
):
    """Dense softmax attention, computed in ``dtype``, with the masks of ``ring_attention``.

    Parameters
    ----------
    q : array (S, H, Dk) or (B, S, H, Dk)
    k : array (S, Hkv, Dk) or (B, S, Hkv, Dk)
    v : array (S, Hkv, Dv) or (B, S, Hkv, Dv)
    causal : bool
        Mask key j for query i when j > i (global token order).
    scale : float, optional
        Score scale, default 1/sqrt(Dk).
    dtype : numpy dtype
        Arithmetic precision (default float64: the reference).
    block : int, optional
        Compute this many query rows at a time (memory O(block x S)).
    window, cu_seqlens, cu_seqlens_k
        As in :func:`ringmpi.ring_attention` (:mod:`ringmpi.mask`); q may hold a
        different number of tokens than k and v (cross-attention, causal aligned
        bottom-right).
    sinks : float array (H,), optional
        Per-head sink logits added to each row's softmax denominator.
    mask : bool array (Sq, Sk) or ringmpi.Slices, optional
        An explicit mask, True where query i sees key j (a :class:`ringmpi.slices.Slices`
        becomes :meth:`~ringmpi.slices.Slices.to_dense`); the whole mask, without
        causal, window or cu_seqlens (issue 41).
    **modifiers
        The score modifiers by spec field name (:mod:`ringmpi.scoremods`):
        ``softcap`` (float > 0: scores become softcap * tanh(score / softcap)),
        ``alibi_slopes`` (float array (H,): the score gains -slope_h * abs(qa_i - j)),
        applied in that order before the mask (module docstring).

    Returns
    -------
    out : array in ``dtype``, (..., S, H, Dv); a row with no visible key is 0
    lse : array (..., H, S) in ``dtype``; -inf for a row with no visible key
        (sink_h with sinks)
    """
    qh, kh, vh, scale, _ = _prepare(q, k, v, scale, dtype)
    mods = _modifiers(qh.shape[-3], modifiers, sinks)
    dense = _explicit(mask, qh.shape[-2], kh.shape[-2], causal, window, cu_seqlens)
    mask = make_mask(qh.shape[-2], kh.shape[-2], causal, window, cu_seqlens, cu_seqlens_k)
    s_len = qh.shape[-2]
    step = s_len if not block else int(block)
    outs, lses = [], []
    for a in range(0, max(s_len, 1), max(step, 1)):
        p, lse, _ = _probs(qh[..., a : a + step, :], kh, scale, mask, a, mods, dense)
        outs.append(p @ vh)
        lses.append(lse)
    out = np.concatenate(outs, axis=-2) if len(outs) > 1 else outs[0]
    lse = np.concatenate(lses, axis=-1) if len(lses) > 1 else lses[0]
    return np.moveaxis(out, -2, -3), lse


def attention_backward(
    dout,
    q,
    k,
    v,
    causal: bool = False,
    scale: float | None = None,
    *,
    dtype=np.float64,
    window=None,
    cu_seqlens=None,
    cu_seqlens_k=None,
    sinks=None,
    mask=None,
    **modifiers,
):
    """Dense gradients of ``attention(q, k, v)[0]`` against ``dout``, computed in ``dtype``.

    With P = softmax(scale * Q K^T), O = P V and delta_i = sum_d dO_id O_id:
    dV = P^T dO, dS = P * (dO V^T - delta), dQ = scale * dS K, dK = scale * dS^T Q.
    Under GQA the gradient of a K/V head sums over the query heads that share it.
    With ``softcap`` dS is multiplied by 1 - tanh^2(x / c); with ``sinks``
    (P includes the sink's share, of value 0) dsinks_h = -sum_i P_i,sink delta_i
    over every batch and row. ``alibi_slopes``, ``softcap``, ``sinks`` and an
    explicit ``mask`` as in :func:`attention`.

    Returns
    -------
    dq, dk, dv : arrays in ``dtype`` with the shapes of q, k, v.
    dsinks : array (H,) in ``dtype``; only when ``sinks`` is given.
    """
    qh, kh, vh, scale, group = _prepare(q, k, v, scale, dtype)
    mods = _modifiers(qh.shape[-3], modifiers, sinks)
    dense = _explicit(mask, qh.shape[-2], kh.shape[-2], causal, window, cu_seqlens)
    mask = make_mask(qh.shape[-2], kh.shape[-2], causal, window, cu_seqlens, cu_seqlens_k)
    do = np.moveaxis(np.asarray(dout, dtype=dtype), -3, -2)
    p, lse, dmod = _probs(qh, kh, scale, mask, mods=mods, dense=dense)
    o = p @ vh
    delta = np.sum(do * o, axis=-1, keepdims=True)
    dv = np.swapaxes(p, -1, -2) @ do
    ds = p * (do @ np.swapaxes(vh, -1, -2) - delta)
    if dmod is not None:  # through the modifiers (softcap: 1 - tanh^2)
        ds = ds * dmod
    sc = qh.dtype.type(scale)
    dq = sc * (ds @ kh)
    dk = sc * (np.swapaxes(ds, -1, -2) @ qh)

    def fold(g):  # (..., H, S, D) -> (..., Hkv, S, D) summed over each group
        shp = g.shape
        g = g.reshape(*shp[:-3], shp[-3] // group, group, *shp[-2:]).sum(axis=-3)
        return np.moveaxis(g, -3, -2)

    grads = np.moveaxis(dq, -2, -3), fold(dk), fold(dv)
    if mods[1] is None:
        return grads
    p_sink = np.exp(mods[1].astype(lse.dtype)[:, None] - lse)  # (..., H, S)
    dsinks = -(p_sink * delta[..., 0]).reshape(-1, *p_sink.shape[-2:]).sum(axis=(0, 2))
    return (*grads, dsinks)
