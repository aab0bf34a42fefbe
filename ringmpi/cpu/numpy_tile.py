"""The numpy tiles, forward and backward: the specification every other tile matches.

Arrays and arguments follow the tile contract in :mod:`ringmpi.backend`; here q, k,
v and the state are in the compute dtype (float32, or float64 for float64 inputs).
Keys and values may differ in width (q, k: Dk; v, acc, dout: Dv).

For one query row with scores s_j = scale * q.k_j over the visible keys, the
update is the streaming softmax

    m'  = max(m, max_j s_j)
    acc = exp(m - m') acc + sum_j exp(s_j - m') v_j
    l   = exp(m - m') l   + sum_j exp(s_j - m')

For float32 inputs the scores and P are float32; acc and l are carried in float64
within a call, and P V is formed over runs of 128 keys (``PV_CHUNK``) at a time:
one float32 product over a whole key block rounds each small term against a
total that a few large ones dominate, an error the BLAS's summation order decides
(2.7x the dense float32 error at 262,144 keys with one OpenBLAS kernel, 1.9x with
another), and that grows with the key count once the values have a mean.

Causal: key j is visible to query i iff k_pos[j] <= q_pos[i]. The rows are cut
into runs of evenly spaced positions and then into blocks, so each block has
tight position bounds: a block pair with max(q_pos) < min(k_pos) is skipped
without computing anything, one with min(q_pos) >= max(k_pos) needs no mask.

Masks of slices: one layer of a union of slices (``bounds`` a
:class:`ringmpi.mask.Layer`) gives each row a key range unrelated to its
neighbours' (a global token next to a windowed one, block-sparse rows), so
blocks of positions would score whole blocks for a few visible keys. For it the
rows are grouped by their range instead: in key-position order a row's range is
an index range [a, b), the rows are taken in order of (a, b), and a group grows
while the pairs scored over the call's groups so far (each group's rows times
the union of their ranges) stay within 1 + ROW_SLACK of the visible pairs. The
running sums are those above. Calls without slices keep the blocks of positions.

Backward, for one head with P = softmax(scale * Q K^T) (rows normalised by the
saved log-sum-exp: P_ij = exp(scale * q_i.k_j - lse_i)), O = P V and upstream dO:

    delta_i = sum_d dO_id O_id            (= sum_j P_ij (dO V^T)_ij)
    dV      = P^T dO
    dS      = P * (dO V^T - delta)        (softmax Jacobian, row by row)
    dQ      = scale * dS K
    dK      = scale * dS^T Q

Score modifiers (keywords such as ``softcap`` and ``alibi``, see :mod:`ringmpi.backend`;
applied by :func:`ringmpi.scoremods.apply`) change the score before the mask:
with x = scale * q_i.k_j,

    s_ij = c * tanh(x / c)                          (softcap c)
    s_ij += -slope_h * abs(qa_i - k_pos_j)             (alibi (slopes, qa))

and the backward multiplies dS by ds/dx = 1 - tanh^2(x / c); ALiBi adds no
gradient term (the slopes are constants). Neither changes which keys are
visible, so the block skipping above is unchanged.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from .. import scoremods
from ..layout import runs
from ..mask import Layer

__all__ = [
    "compute_dtype",
    "forward_tile",
    "backward_tile",
    "blocks",
    "key_block",
    "BLOCK_Q",
    "BLOCK_K",
]


BLOCK_Q = 256
BLOCK_K = 1024
PV_CHUNK = 128  # keys per float32 P.V product, summed in float64 (forward)
ROW_SLACK = 1 / 16  # a layer's row group scores at most this share more than its visible pairs


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


def key_block(bounds) -> int:
    """Keys per block: narrower under window / packed masks, so skipping is finer."""
    return BLOCK_K if bounds is None else max(64, BLOCK_K // 4)


class _Visibility:
    """Which keys each query row sees: lo[i] <= k_pos[j] <= hi[i] (None: every key)."""

    def __init__(self, q_pos, causal: bool, bounds: Optional[tuple]):
        if bounds is None and causal:  # key j visible iff k_pos[j] <= q_pos[i]
            bounds = (np.full(len(q_pos), np.iinfo(np.int64).min, dtype=np.int64), q_pos)
        self.lo, self.hi = (None, None) if bounds is None else bounds

    def rows(self, qa: int, qb: int) -> None:
        """Select the query rows [qa, qb) for the block tests below."""
        if self.lo is not None:
            self.blo, self.bhi = self.lo[qa:qb], self.hi[qa:qb]
            self.lo_min, self.lo_max = self.blo.min(), self.blo.max()
            self.hi_min, self.hi_max = self.bhi.min(), self.bhi.max()

    def skip(self, klo: int, khi: int) -> bool:
        """No row of the block sees any key with position in [klo, khi]."""
        return self.lo is not None and (self.hi_max < klo or self.lo_min > khi)

    def bias(self, k_pos, klo: int, khi: int, dtype):
        """(n, nk) 0 / -inf where some pair is hidden; None when every pair is visible."""
        if self.lo is None or (self.lo_max <= klo and khi <= self.hi_min):
            return None
        vis = (self.blo[:, None] <= k_pos[None, :]) & (k_pos[None, :] <= self.bhi[:, None])
        return np.where(vis, 0.0, -np.inf).astype(dtype)


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
    bounds: Optional[tuple] = None,
    **modifiers,
) -> int:
    """Fold one K/V block into the online-softmax state, in place (see :mod:`ringmpi.backend`).

    Blocks of positions (:func:`_forward_blocks`), or for one layer of a mask of
    slices (``bounds`` a :class:`ringmpi.mask.Layer`) groups of rows by their
    key range (:func:`_forward_rows`).

    Returns the flops of the two matrix products (2 * pairs * (Dk + Dv) per head:
    4 * pairs * D for equal widths) over the blocks that were not skipped.
    """
    tile = _forward_rows if isinstance(bounds, Layer) else _forward_blocks
    return tile(
        q, k, v, q_pos, k_pos, acc, m, l,
        scale=scale, causal=causal, progress=progress, bounds=bounds, **modifiers,
    )  # fmt: skip


def _forward_blocks(
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
    bounds: Optional[tuple] = None,
    **modifiers,
) -> int:
    """:func:`forward_tile` over blocks of positions: BLOCK_Q query rows by key blocks.

    Every call without a :class:`ringmpi.mask.Layer` (causal, windows, packed
    sequences, cross-attention) runs here; returns the flops of the blocks scored.
    """
    bsz, h, sq, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    sk = k.shape[2]
    dv = v.shape[-1]  # the value width (Dv may differ from Dk = d)
    if sq == 0 or sk == 0:
        return 0
    # grouped views: query head h = hkv_index * g + group_index
    q5 = q.reshape(bsz, hkv, g, sq, d)
    acc5 = acc.reshape(bsz, hkv, g, sq, dv)
    m5 = m.reshape(bsz, hkv, g, sq)
    l5 = l.reshape(bsz, hkv, g, sq)
    kt = np.swapaxes(k, -1, -2)
    kblocks = list(blocks(k_pos, key_block(bounds)))
    vis = _Visibility(q_pos, causal, bounds)
    mods = scoremods.pack(modifiers, h, sq)
    wide = np.float64
    flops = 0
    for qa, qb, _, _ in blocks(q_pos, BLOCK_Q):
        n = qb - qa
        vis.rows(qa, qb)
        rows_qa = None if mods is None or mods.qpos is None else mods.qpos[qa:qb]
        qs = q5[:, :, :, qa:qb] * q.dtype.type(scale)  # (B, Hkv, G, n, D), contiguous
        qs2 = qs.reshape(bsz, hkv, g * n, d)
        # The running sums of this query block are float64 (see the module), P.V added
        # to them from products over PV_CHUNK keys. The block's state goes back at the
        # end, m with acc and l: a progress call that raises leaves each query block's
        # state either untouched or complete, never m ahead of acc and l.
        mo = m5[:, :, :, qa:qb].copy()
        lo = l5[:, :, :, qa:qb].astype(wide)
        ao = acc5[:, :, :, qa:qb].astype(wide)
        for ka, kb, klo, khi in kblocks:
            if vis.skip(klo, khi):
                continue  # every key of this block is hidden from every query
            s = qs2 @ kt[:, :, :, ka:kb]  # (B, Hkv, G*n, nk)
            s5 = s.reshape(bsz, hkv, g, n, kb - ka)
            scoremods.apply(s5, mods, rows_qa, k_pos[ka:kb], (hkv, g))
            bias = vis.bias(k_pos[ka:kb], klo, khi, s.dtype)
            if bias is not None:
                s5 += bias
            m_new = np.maximum(mo, s5.max(axis=-1))
            m_safe = np.where(np.isneginf(m_new), 0, m_new).astype(s.dtype)
            s5 -= m_safe[..., None]
            np.exp(s5, out=s5)
            alpha = np.exp(mo - m_safe)
            lo *= alpha
            lo += s5.sum(axis=-1)
            ao *= alpha[..., None]
            for c in range(ka, kb, PV_CHUNK):  # P.V over short runs of keys, see above
                pv = s[..., c - ka : c - ka + PV_CHUNK] @ v[:, :, c : min(c + PV_CHUNK, kb)]
                ao += pv.reshape(ao.shape)
            mo[...] = m_new
            flops += 2 * bsz * h * n * (kb - ka) * (d + dv)
            if progress is not None:
                progress()
        m5[:, :, :, qa:qb] = mo
        l5[:, :, :, qa:qb] = lo
        acc5[:, :, :, qa:qb] = ao
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
    bounds: Optional[tuple] = None,
    **modifiers,
) -> int:
    """Add one K/V block's gradient contributions, in place (see :mod:`ringmpi.backend`).

    Blocks of positions (:func:`_backward_blocks`), or for one layer of a mask of
    slices (``bounds`` a :class:`ringmpi.mask.Layer`) groups of rows by their
    key range (:func:`_backward_rows`).

    Returns the flops of the five matrix products (2 * pairs * (3 Dk + 2 Dv) per
    head: 10 * pairs * D for equal widths) over the blocks that were not skipped.
    """
    tile = _backward_rows if isinstance(bounds, Layer) else _backward_blocks
    return tile(
        q, k, v, dout, lse, delta, q_pos, k_pos, dq, dk, dv,
        scale=scale, causal=causal, progress=progress, bounds=bounds, **modifiers,
    )  # fmt: skip


def _backward_blocks(
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
    bounds: Optional[tuple] = None,
    **modifiers,
) -> int:
    """:func:`backward_tile` over blocks of positions: BLOCK_Q query rows by key blocks.

    Every call without a :class:`ringmpi.mask.Layer` runs here; returns the flops
    of the blocks scored.
    """
    bsz, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    dvw = v.shape[-1]  # the value width (Dv may differ from Dk = d)
    g = h // hkv
    if sq == 0 or sk == 0:
        return 0
    dt = dq.dtype.type
    # grouped views: query head h = hkv_index * g + group_index, so a (G, n)
    # block of rows flattens to G*n rows that all read the same K/V head
    q5 = q.reshape(bsz, hkv, g, sq, d)
    do5 = dout.reshape(bsz, hkv, g, sq, dvw)
    dq5 = dq.reshape(bsz, hkv, g, sq, d)
    # p = exp(s - lse): a row with lse = -inf saw no key; +inf makes its p zero
    lse4 = np.where(np.isneginf(lse), np.inf, lse).astype(dt).reshape(bsz, hkv, g, sq)
    delta4 = delta.astype(dt, copy=False).reshape(bsz, hkv, g, sq)
    kblocks = list(blocks(k_pos, key_block(bounds)))
    vis = _Visibility(q_pos, causal, bounds)
    mods = scoremods.pack(modifiers, h, sq)
    flops = 0
    for qa, qb, _, _ in blocks(q_pos, BLOCK_Q):
        n = qb - qa
        vis.rows(qa, qb)
        rows_qa = None if mods is None or mods.qpos is None else mods.qpos[qa:qb]
        live = [kb for kb in kblocks if not vis.skip(kb[2], kb[3])]
        if not live:
            continue  # every key is hidden from every query of this block
        qs = (q5[:, :, :, qa:qb] * dt(scale)).reshape(bsz, hkv, g * n, d)
        dob = np.ascontiguousarray(do5[:, :, :, qa:qb]).reshape(bsz, hkv, g * n, dvw)
        lse_b = np.ascontiguousarray(lse4[..., qa:qb]).reshape(bsz, hkv, g * n, 1)
        delta_b = np.ascontiguousarray(delta4[..., qa:qb]).reshape(bsz, hkv, g * n, 1)
        dq_b = np.zeros((bsz, hkv, g * n, d), dtype=dt)
        for ka, kb, klo, khi in live:
            kk, vv = k[:, :, ka:kb], v[:, :, ka:kb]
            p = qs @ np.swapaxes(kk, -1, -2)  # scores, (B, Hkv, G*n, nk)
            p5 = p.reshape(bsz, hkv, g, n, kb - ka)
            dmod = scoremods.apply(p5, mods, rows_qa, k_pos[ka:kb], (hkv, g))
            bias = vis.bias(k_pos[ka:kb], klo, khi, dt)
            if bias is not None:
                p5 += bias
            p -= lse_b
            np.exp(p, out=p)  # probabilities, masked entries exactly 0
            dv[:, :, ka:kb] += np.swapaxes(p, -1, -2) @ dob
            ds = dob @ np.swapaxes(vv, -1, -2)  # dP = dO V^T
            ds -= delta_b
            ds *= p  # dS = P * (dP - delta); scale is folded into qs and dq
            if dmod is not None:  # through the modifiers: dS times d s'/d s (softcap: 1 - tanh^2)
                ds.reshape(p5.shape)[...] *= dmod
            dq_b += ds @ kk
            dk[:, :, ka:kb] += np.swapaxes(ds, -1, -2) @ qs
            flops += 2 * bsz * h * n * (kb - ka) * (3 * d + 2 * dvw)
            if progress is not None:
                progress()
        dq5[:, :, :, qa:qb] += dt(scale) * dq_b.reshape(bsz, hkv, g, n, d)
    return flops


class _Keys:
    """A K/V block in key-position order, for one layer's rows: index ranges, not positions.

    ``k_pos`` is sorted in every layout, but the contract does not promise it: an
    unsorted block is read through its sorting permutation (gathered per chunk).
    In sorted order one row's range lo <= k_pos <= hi is the index range
    [a, b) (b <= a: no key).
    """

    def __init__(self, k_pos: np.ndarray, bounds: tuple):
        k_pos = np.asarray(k_pos)
        self.order = None
        if len(k_pos) > 1 and bool((k_pos[1:] < k_pos[:-1]).any()):
            self.order = np.argsort(k_pos, kind="stable")
            k_pos = k_pos[self.order]
        self.pos = k_pos
        lo, hi = bounds
        self.a = np.searchsorted(k_pos, np.asarray(lo), side="left")
        self.b = np.searchsorted(k_pos, np.asarray(hi), side="right")

    def at(self, c0: int, c1: int):
        """Keys [c0, c1) of the sorted order: a slice (a view) or the gathered indices."""
        return slice(c0, c1) if self.order is None else self.order[c0:c1]


def _row_groups(a: np.ndarray, b: np.ndarray, slack: float = ROW_SLACK, cap: int = BLOCK_Q):
    """Groups of rows scored together: [(rows, ka, kb)], rows sorted, keys [ka, kb).

    The rows that see a key (b > a), in order of (a, b), each group a run of them
    of at most ``cap`` rows scored over the rectangle rows x [min a, max b). A
    group takes the next row while the pairs scored so far, this group's
    rectangle included, stay within (1 + ``slack``) of the visible pairs of the
    rows so far: the call's work never exceeds (1 + ``slack``) times its visible
    pairs, and what groups of rows sharing a range (global tokens, a block row of
    a block-sparse mask) save pays for wider groups on a diagonal or a window.
    """
    live = np.flatnonzero(b > a)
    if len(live) == 0:
        return []
    order = live[np.lexsort((b[live], a[live]))]
    al, bl = a[order].tolist(), b[order].tolist()
    out = []
    s, ka, kb, seen = 0, al[0], bl[0], bl[0] - al[0]
    done_area = done_seen = 0  # the closed groups' scored and visible pairs
    for i in range(1, len(al)):
        bi = bl[i]
        wide, w = (kb if kb >= bi else bi), bi - al[i]
        area = done_area + (i - s + 1) * (wide - ka)
        if i - s < cap and area <= (1 + slack) * (done_seen + seen + w):
            kb, seen = wide, seen + w
        else:
            out.append((np.sort(order[s:i]), ka, kb))
            done_area += (i - s) * (kb - ka)
            done_seen += seen
            s, ka, kb, seen = i, al[i], bl[i], w
    out.append((np.sort(order[s:]), ka, kb))
    return out


def _rows(rows: np.ndarray):
    """The sorted row indices ``rows`` as a slice where they are consecutive (views)."""
    first, last = int(rows[0]), int(rows[-1])
    return slice(first, last + 1) if last - first + 1 == len(rows) else rows


def _chunk_bias(ra, rb, c0: int, c1: int, dtype):
    """(n, c1 - c0) 0 / -inf for keys [c0, c1) of rows seeing [ra, rb); None: all visible."""
    if ra.max() <= c0 and rb.min() >= c1:
        return None
    j = np.arange(c0, c1)
    vis = (ra[:, None] <= j[None, :]) & (j[None, :] < rb[:, None])
    return np.where(vis, 0.0, -np.inf).astype(dtype)


def _forward_rows(
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
    bounds: Optional[tuple] = None,
    **modifiers,
) -> int:
    """:func:`forward_tile` for one layer of a mask of slices: rows grouped by key range.

    Each group of :func:`_row_groups` scores its rows against the union of their
    key ranges, BLOCK_K keys at a time, with the same float64 running sums and
    PV_CHUNK products as :func:`_forward_blocks` (``causal`` is ignored: the
    layer's ranges say it all). Returns the flops of the pairs scored, within
    (1 + ROW_SLACK) of the visible pairs.
    """
    bsz, h, sq, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    dv = v.shape[-1]
    if sq == 0 or k.shape[2] == 0:
        return 0
    q5 = q.reshape(bsz, hkv, g, sq, d)
    acc5 = acc.reshape(bsz, hkv, g, sq, dv)
    m5 = m.reshape(bsz, hkv, g, sq)
    l5 = l.reshape(bsz, hkv, g, sq)
    keys = _Keys(k_pos, bounds)
    mods = scoremods.pack(modifiers, h, sq)
    wide = np.float64
    flops = 0
    for rows, ka, kb in _row_groups(keys.a, keys.b):
        n, sel = len(rows), _rows(rows)
        ra, rb = keys.a[sel], keys.b[sel]
        rows_qa = None if mods is None or mods.qpos is None else mods.qpos[sel]
        qs2 = (q5[:, :, :, sel] * q.dtype.type(scale)).reshape(bsz, hkv, g * n, d)
        # the group's state goes back whole at its end (see _forward_blocks)
        mo = m5[:, :, :, sel].copy()
        lo = l5[:, :, :, sel].astype(wide)
        ao = acc5[:, :, :, sel].astype(wide)
        for c0 in range(ka, kb, BLOCK_K):
            c1 = min(c0 + BLOCK_K, kb)
            at = keys.at(c0, c1)
            vc = v[:, :, at]
            s = qs2 @ np.swapaxes(k[:, :, at], -1, -2)  # (B, Hkv, G*n, nk)
            s5 = s.reshape(bsz, hkv, g, n, c1 - c0)
            scoremods.apply(s5, mods, rows_qa, keys.pos[c0:c1], (hkv, g))
            bias = _chunk_bias(ra, rb, c0, c1, s.dtype)
            if bias is not None:
                s5 += bias
            m_new = np.maximum(mo, s5.max(axis=-1))
            m_safe = np.where(np.isneginf(m_new), 0, m_new).astype(s.dtype)
            s5 -= m_safe[..., None]
            np.exp(s5, out=s5)
            alpha = np.exp(mo - m_safe)
            lo *= alpha
            lo += s5.sum(axis=-1)
            ao *= alpha[..., None]
            for c in range(0, c1 - c0, PV_CHUNK):  # P.V over short runs of keys
                ao += (s[..., c : c + PV_CHUNK] @ vc[:, :, c : c + PV_CHUNK]).reshape(ao.shape)
            mo[...] = m_new
            flops += 2 * bsz * h * n * (c1 - c0) * (d + dv)
            if progress is not None:
                progress()
        m5[:, :, :, sel] = mo
        l5[:, :, :, sel] = lo
        acc5[:, :, :, sel] = ao
    return flops


def _backward_rows(
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
    bounds: Optional[tuple] = None,
    **modifiers,
) -> int:
    """:func:`backward_tile` for one layer of a mask of slices: rows grouped by key range.

    The groups of :func:`_forward_rows`, each against the union of its rows' key
    ranges, BLOCK_K keys at a time, with the products of :func:`_backward_blocks`.
    Returns the flops of the pairs scored, within (1 + ROW_SLACK) of the visible pairs.
    """
    bsz, h, sq, d = q.shape
    hkv = k.shape[1]
    dvw = v.shape[-1]
    g = h // hkv
    if sq == 0 or k.shape[2] == 0:
        return 0
    dt = dq.dtype.type
    q5 = q.reshape(bsz, hkv, g, sq, d)
    do5 = dout.reshape(bsz, hkv, g, sq, dvw)
    dq5 = dq.reshape(bsz, hkv, g, sq, d)
    lse4 = lse.reshape(bsz, hkv, g, sq)
    delta4 = delta.reshape(bsz, hkv, g, sq)
    keys = _Keys(k_pos, bounds)
    mods = scoremods.pack(modifiers, h, sq)
    flops = 0
    for rows, ka, kb in _row_groups(keys.a, keys.b):
        n, sel = len(rows), _rows(rows)
        ra, rb = keys.a[sel], keys.b[sel]
        rows_qa = None if mods is None or mods.qpos is None else mods.qpos[sel]
        qs = (q5[:, :, :, sel] * dt(scale)).reshape(bsz, hkv, g * n, d)
        dob = np.ascontiguousarray(do5[:, :, :, sel]).reshape(bsz, hkv, g * n, dvw)
        # p = exp(s - lse): a row with lse = -inf saw no key; +inf makes its p zero
        lse_b = lse4[..., sel]
        lse_b = np.where(np.isneginf(lse_b), np.inf, lse_b).astype(dt).reshape(bsz, hkv, g * n, 1)
        delta_b = delta4[..., sel].astype(dt).reshape(bsz, hkv, g * n, 1)
        dq_b = np.zeros((bsz, hkv, g * n, d), dtype=dt)
        for c0 in range(ka, kb, BLOCK_K):
            c1 = min(c0 + BLOCK_K, kb)
            at = keys.at(c0, c1)
            kk, vv = k[:, :, at], v[:, :, at]
            p = qs @ np.swapaxes(kk, -1, -2)  # scores, (B, Hkv, G*n, nk)
            p5 = p.reshape(bsz, hkv, g, n, c1 - c0)
            dmod = scoremods.apply(p5, mods, rows_qa, keys.pos[c0:c1], (hkv, g))
            bias = _chunk_bias(ra, rb, c0, c1, dt)
            if bias is not None:
                p5 += bias
            p -= lse_b
            np.exp(p, out=p)  # probabilities, masked entries exactly 0
            dv[:, :, at] += np.swapaxes(p, -1, -2) @ dob
            ds = dob @ np.swapaxes(vv, -1, -2)  # dP = dO V^T
            ds -= delta_b
            ds *= p  # dS = P * (dP - delta); scale is folded into qs and dq
            if dmod is not None:
                ds.reshape(p5.shape)[...] *= dmod
            dq_b += ds @ kk
            dk[:, :, at] += np.swapaxes(ds, -1, -2) @ qs
            flops += 2 * bsz * h * n * (c1 - c0) * (3 * d + 2 * dvw)
            if progress is not None:
                progress()
        dq5[:, :, :, sel] += dt(scale) * dq_b.reshape(bsz, hkv, g, n, d)
    return flops
