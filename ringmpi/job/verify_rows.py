"""The dense rows of ``ringmpi verify``: reference attention of chosen query rows, the row sample,
and the value-range check of every row (:mod:`ringmpi.job.verify` runs them)."""

from __future__ import annotations

import numpy as np

from .. import interrupt, reference, scoremods

__all__ = [
    "dense_head", "rows_attention", "default_sample_rows", "sample_rows_of", "range_bad",
    "ROWS", "SAMPLE_ROWS", "MIN_SAMPLE_ROWS", "SCORES", "BLOCK_ROWS", "RANGE_SLACK",
]  # fmt: skip

ROWS = 512  # query rows per block of the dense computation (full check of short sequences)
SAMPLE_ROWS = 2048  # most query rows per head checked in a longer sequence by default
MIN_SAMPLE_ROWS = 256  # fewest (the default is S / 128 between the two: a share of the run)
SCORES = 1 << 24  # score elements per block of rows (128 MiB in float64)
BLOCK_ROWS = 64  # query rows per block (measured: 64 rows x 65,536 keys as fast as 256)
# slack of the range check, relative to max|v|: rounding of the accumulation and output
RANGE_SLACK = {"float16": 4e-3, "float32": 1e-4, "float64": 1e-10}


def dense_head(q, k, v, causal: bool, scale: float, dtype) -> tuple:
    """Dense attention of one head, q, k, v (S, D), in ``dtype`` and blocks of query rows.

    Returns out (S, D) and lse (S,); a row with no visible key gives 0, -inf.
    """
    out, lse = reference.attention(
        q[:, None], k[:, None], v[:, None], causal, scale, dtype=dtype, block=ROWS
    )
    return out[:, 0], lse[0]


def rows_attention(
    q, k, v, rows: np.ndarray, causal: bool, scale: float, dtype, mask=None, on_block=None,
    mods=None, sink=None,
) -> tuple:  # fmt: skip
    """Dense attention of the query rows ``rows`` of one head against all S keys, in ``dtype``.

    Parameters
    ----------
    q : array (S, D)
    k, v : arrays (S_k, D)
    rows : int array (R,)
        Query rows (token positions) to compute.
    causal : bool
        Row i sees keys j <= i (ignored when ``mask`` is given).
    scale : float
    dtype : numpy dtype
        Arithmetic precision.
    mask : ringmpi.mask.Mask, optional
        Row i sees keys lo[i] <= j <= hi[i] of ``mask.bounds`` (window, packed, cross).
    on_block : callable(int), optional
        Called with the number of rows after each block of rows (progress).
    mods : ringmpi.scoremods.TileMods, optional
        This head's score modifiers (params (1, NMODS), :func:`ringmpi.scoremods.of_spec`),
        applied by :func:`ringmpi.scoremods.apply` (position modifiers use
        ``mask.alibi_positions``; ``mask`` is then needed).
    sink : float, optional
        This head's sink logit: the row's softmax denominator gains exp(sink).

    Only the keys some row of a block can see are computed (under causal, a block
    of rows up to r needs keys 0..r): a masked key adds exactly 0 to the sums.

    Returns
    -------
    out : (R, D) and lse : (R,) in ``dtype``; a row with no visible key gives 0, -inf.
    """
    dt = np.dtype(dtype)
    kd, vd = np.asarray(k, dt), np.asarray(v, dt)
    n = kd.shape[0]
    # at most BLOCK_ROWS rows per block: under causal, sorted rows then need few keys each
    block = max(1, min(BLOCK_ROWS, SCORES // max(1, n)))
    outs, lses = [], []
    for a in range(0, len(rows), block):
        interrupt.check()
        r = rows[a : a + block]
        j0, j1 = 0, n  # the keys any row of the block can see: [j0, j1)
        if mask is not None and not mask.plain:
            lo, hi = mask.bounds(r)
            j0, j1 = max(0, int(lo.min())), min(n, int(hi.max()) + 1)
            j1 = max(j0, j1)
        elif causal:
            j1 = min(n, int(r.max()) + 1)
        s = np.asarray(q[r], dt) @ kd[j0:j1].T
        s *= dt.type(scale)
        if mods is not None:
            qa = mask.alibi_positions(r) if mask is not None else r
            scoremods.apply(s, mods, qa, np.arange(j0, j1), ())
        # in place (measured 2.6x faster than np.where copies at 2048 rows x 65536 keys)
        if mask is not None and not mask.plain:
            j = np.arange(j0, j1)[None, :]
            np.putmask(s, (j < lo[:, None]) | (j > hi[:, None]), -np.inf)
        elif causal:  # keys up to min(r) are visible to every row of the block
            c = max(j0, int(r.min()) + 1)
            if c < j1:
                np.putmask(s[:, c - j0 :], np.arange(c, j1)[None, :] > r[:, None], -np.inf)
        m = s.max(axis=-1, keepdims=True) if j1 > j0 else np.zeros((len(r), 1), dt)
        if sink is not None:  # one more logit per row, of value 0
            m = np.maximum(m, dt.type(sink))
        m = np.where(np.isfinite(m), m, 0).astype(dt)
        s -= m
        e = np.exp(s, out=s)
        z = e.sum(axis=-1)
        if sink is not None:
            z += np.exp(dt.type(sink) - m[:, 0])
        with np.errstate(divide="ignore", invalid="ignore"):
            o = np.where(z[:, None] > 0, (e @ vd[j0:j1]) / z[:, None], 0)
            lse = np.where(z > 0, m[:, 0] + np.log(z), -np.inf)
        outs.append(o.astype(dt))
        lses.append(lse.astype(dt))
        if on_block is not None:
            on_block(len(r))
    if not outs:
        return np.zeros((0, q.shape[1]), dt), np.zeros(0, dt)
    return np.concatenate(outs), np.concatenate(lses)


def default_sample_rows(length: int) -> int:
    """Rows per head the sampled check uses by default for a sequence of ``length`` tokens."""
    return int(min(SAMPLE_ROWS, max(MIN_SAMPLE_ROWS, length // 128)))


def sample_rows_of(length: int, count: int, seed: int, seq_index: int, head: int) -> np.ndarray:
    """The sorted query rows the sampled check uses for one (sequence, head): all if count >= S."""
    if count >= length:
        return np.arange(length, dtype=np.int64)
    rng = np.random.default_rng([seed, seq_index, head])
    return np.sort(rng.choice(length, size=count, replace=False)).astype(np.int64)


def range_bad(v: np.ndarray, out: np.ndarray, lse: np.ndarray, causal: bool, slack: float,
               mask=None, sink: bool = False):  # fmt: skip
    """Rows whose output leaves the range of the visible value rows (or is not 0 when none is).

    Under a mask other than plain causal the range is that of the value rows of
    the query's packed sequence (the keys it may see lie there). With ``sink``
    (attention sinks: a virtual key of value 0) the range includes 0.
    """
    # min and max are exact in any dtype: no float64 copy (float16 in float32, for the slack)
    v64 = np.asarray(v, np.float32 if np.asarray(v).dtype == np.float16 else None)
    if mask is not None and not mask.plain:
        cu_k = mask.cu_k if mask.cu_k is not None else np.array([0, mask.nk], np.int64)
        cu_q = mask.cu_q if mask.cu_q is not None else np.array([0, mask.nq], np.int64)
        nseg = len(cu_k) - 1
        seg_lo = np.full((nseg, v64.shape[1]), np.inf)
        seg_hi = np.full((nseg, v64.shape[1]), -np.inf)
        full = np.flatnonzero(np.diff(cu_k) > 0)
        if len(full):
            seg_lo[full] = np.minimum.reduceat(v64, cu_k[full], axis=0)
            seg_hi[full] = np.maximum.reduceat(v64, cu_k[full], axis=0)
            # reduceat runs to the next index: an empty segment between two full ones is
            # skipped, so each full segment ends at its own end (the next full start)
        seg = np.searchsorted(cu_q, np.arange(mask.nq), side="right") - 1
        lo, hi = seg_lo[seg], seg_hi[seg]
    elif causal:
        lo = np.minimum.accumulate(v64, axis=0)
        hi = np.maximum.accumulate(v64, axis=0)
    else:
        lo = np.broadcast_to(v64.min(axis=0, initial=np.inf), v64.shape)
        hi = np.broadcast_to(v64.max(axis=0, initial=-np.inf), v64.shape)
    if sink:  # a convex combination of the visible values and the sink's 0
        lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)
    with np.errstate(invalid="ignore"):
        bad = ((out < lo - slack) | (out > hi + slack)).any(axis=1)
    none = np.isneginf(lse)  # no visible key: out must be 0
    bad = np.where(none, (out != 0).any(axis=1), bad)
    return bad
