"""Online softmax: the state carried between ring steps, and how to merge it.

For one query row the attention over a set of keys is fully described by
``(o, lse)``: the normalised output and the log of the softmax denominator.
Two such partial results over disjoint key sets combine exactly:

    lse = log(exp(lse1) + exp(lse2))
    o   = exp(lse1 - lse) * o1 + exp(lse2 - lse) * o2

The tile kernels keep the equivalent unnormalised state ``(acc, m, l)`` with
``acc = sum_j exp(s_j - m) v_j`` and ``l = sum_j exp(s_j - m)``; ``finalize``
turns it into ``(o, lse)``. A row that saw no key has ``l = 0``: its output is
0 and its lse is -inf, never NaN. A NaN that reached the state (NaN input)
stays NaN in the rows it touched.
"""

from __future__ import annotations

import numpy as np

__all__ = ["init_state", "finalize", "merge", "add_sinks"]


def init_state(shape_q: tuple, dtype, xp=np):
    """Empty state for queries of internal shape (B, H, S, D), D the output (value) width.

    Returns ``acc`` (B, H, S, D) zeros, ``m`` (B, H, S) -inf, ``l`` (B, H, S) zeros.
    """
    b, h, s, d = shape_q
    acc = xp.zeros((b, h, s, d), dtype=dtype)
    m = xp.full((b, h, s), -xp.inf, dtype=dtype)
    l = xp.zeros((b, h, s), dtype=dtype)
    return acc, m, l


def finalize(acc, m, l, xp=np):
    """Normalise the state: ``out = acc / l`` and ``lse = m + log(l)``.

    Rows with ``l == 0`` (no visible key) give out 0 and lse -inf.
    """
    seen = l != 0  # a NaN row stays NaN: NaN inputs are never silently zeroed
    safe_l = xp.where(seen, l, 1)
    out = acc / safe_l[..., None]
    out = xp.where(seen[..., None], out, 0)
    with np.errstate(divide="ignore"):
        lse = xp.where(seen, m + xp.log(safe_l), -xp.inf)
    return out, lse


def merge(o1, lse1, o2, lse2, xp=np):
    """Combine two normalised partial attentions over disjoint key sets.

    Parameters
    ----------
    o1, o2 : array (..., S, D)
    lse1, lse2 : array (..., S)

    Returns
    -------
    (o, lse) with the same shapes. Rows where both inputs are empty stay empty.
    """
    lse = xp.logaddexp(lse1, lse2)
    finite = xp.isfinite(lse)
    ref = xp.where(finite, lse, 0)
    w1 = xp.where(finite, xp.exp(lse1 - ref), 0)
    w2 = xp.where(finite, xp.exp(lse2 - ref), 0)
    return w1[..., None] * o1 + w2[..., None] * o2, lse


def add_sinks(out, lse, sinks, xp=np):
    """Fold per-head sink logits into a finished attention: one more key of value 0 per row.

    With lse' = logaddexp(lse, sink_h) the output scales by exp(lse - lse'); a
    row with no visible key (lse = -inf) gets out 0 and lse' = sink_h.

    Parameters
    ----------
    out : array (B, S, H, D)
        Normalised output, sequence-major.
    lse : array (B, H, S)
    sinks : array (H,)
        Sink logits of these heads, in the dtype of lse.

    Returns
    -------
    (out, lse) with the same shapes and dtypes.
    """
    sink = xp.asarray(sinks, dtype=lse.dtype).reshape(1, -1, 1)
    new = xp.logaddexp(lse, sink)
    w = xp.exp(lse - new)  # (B, H, S); 0 for an empty row
    return out * xp.moveaxis(w, -1, -2)[..., None], new
