"""Distributed decode: a few new query tokens against a key/value cache sharded over the ranks.

No K/V moves. Every rank attends the queries (the same on every rank) to its own
cache shard, which gives a partial output and log-sum-exp per query row; the
partials are combined with the online-softmax merge rule

    lse = logaddexp(lse_1, lse_2),  out = exp(lse_1 - lse) out_1 + exp(lse_2 - lse) out_2

by an MPI reduction with a user-defined operator (a tree: log2 P rounds of
(Dv + 1) values per row) to rank 0, then broadcast, so every rank ends with the
same exact output. Cost per rank: 2 Sq Sk_local (Dk + Dv) H flops and
2 log2(P) Sq H (Dv + 1) elements on the wire, against a ring pass's P - 1
messages of whole cache blocks.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from mpi4py import MPI

from . import scoremods, softmax
from .arguments import agree
from .backend import is_cupy
from .runtime.watchdog import watch
from .spec import AttentionSpec, spec_keywords

__all__ = ["decode_attention"]


#: the score modifiers decode applies: every tile modifier of the registry that needs no
#: token positions, and the sinks (folded in once after the merge); the others
#: (alibi_slopes) are refused on every rank
DECODE_MODIFIERS = tuple(m.field for m in scoremods.MODS if not m.positions) + ("sinks",)


@spec_keywords
def decode_attention(
    q,
    k,
    v,
    comm: Optional[MPI.Comm] = None,
    *,
    scale: Optional[float] = None,
    return_lse: bool = False,
    **modifiers,
):
    """Attention of a few queries against a cache sharded over the ranks; exact on every rank.

    Parameters
    ----------
    q : array (Sq, H, Dk) or (B, Sq, H, Dk)
        The new query tokens, the same on every rank.
    k : array (Sk_local, Hkv, Dk) or (B, Sk_local, Hkv, Dk)
    v : array (Sk_local, Hkv, Dv) or (B, Sk_local, Hkv, Dv)
        This rank's part of the cached keys and values, any count (even zero);
        which cache positions a rank holds does not matter (no mask). The value
        width Dv may differ from the key width Dk: a sharded latent cache of
        absorbed multi-head latent attention is k = the latent and rotary key
        (Hkv = 1, Dk = 576), v = the latent (Dv = 512).
    comm : mpi4py.MPI.Comm, optional
        Default MPI.COMM_WORLD.
    scale : float, optional
        Score scale, default 1/sqrt(Dk).
    return_lse : bool
        Also return the log-sum-exp over the whole cache, (..., H, Sq).
    {modifiers}

    Returns
    -------
    out : array (..., Sq, H, Dv), the dtype of q (identical on every rank)
    lse : array (..., H, Sq), float32 (float64 for float64 inputs); with ``return_lse``.

    Notes
    -----
    Of the score modifiers, decode applies ``softcap`` and ``sinks`` (folded in
    once after the merge); any other (``alibi_slopes``: it needs token positions,
    which the cache shards here have not) is refused with a ValueError on every rank.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    spec = AttentionSpec(scale=scale, **modifiers)
    args = agree(
        comm, spec, {"q": q, "k": k, "v": v}, what="decode_attention", decode=DECODE_MODIFIERS
    )
    be, d, sc = args.backend, v.shape[-1], args.scale  # d: the value width (out's last axis)
    mods = scoremods.of_spec({f: getattr(args.spec, f) for f in DECODE_MODIFIERS[:-1]}, q.shape[-2])
    out, lse = _partial(be.xp, q, k, v, sc, args.acc_dtype, mods)  # (B, H, Sq, Dv), (B, H, Sq)
    if is_cupy(out):
        out, lse = out.get(), lse.get()
    sq = out.shape[2]
    b, h = out.shape[:2]
    dt = out.dtype
    rows = np.empty((b * h * sq, d + 1), dtype=dt)
    rows[:, 0] = lse.reshape(-1)
    rows[:, 1:] = out.reshape(-1, d)
    merged = _merge(comm, rows)
    lse = merged[:, 0].reshape(b, h, sq)
    out = np.ascontiguousarray(np.moveaxis(merged[:, 1:].reshape(b, h, sq, d), 1, 2))
    if args.spec.sinks is not None:  # one virtual key per head, counted once (not per rank)
        out, lse = softmax.add_sinks(out, lse, args.spec.sinks)
    out = be.cast_out(be.xp.asarray(out), q.dtype)
    lse = be.xp.asarray(lse)
    if q.ndim == 3:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


def _partial(xp, q, k, v, scale: float, acc_dtype, mods: Optional[scoremods.TileMods] = None):
    """This rank's normalised attention of q against its cache shard, and the lse.

    Computed straight from the (B?, S, H, D) layout: the cache is read once, in
    place (strided matrix products), never transposed or packed; the scores are
    only (B, H, Sq, Sk_local), small for a few queries.
    """
    q4, k4, v4 = (x if x.ndim == 4 else x[None] for x in (q, k, v))
    b, sq, h, d = q4.shape
    hkv, sk, dv = k4.shape[2], k4.shape[1], v4.shape[-1]
    g = h // hkv
    if sk == 0:
        return xp.zeros((b, h, sq, dv), acc_dtype), xp.full((b, h, sq), -xp.inf, acc_dtype)
    qg = xp.ascontiguousarray(
        (q4.astype(acc_dtype) * acc_dtype.type(scale))
        .reshape(b, sq, hkv, g, d)
        .transpose(0, 2, 3, 1, 4)
    ).reshape(b, hkv, g * sq, d)
    kt = k4.astype(acc_dtype, copy=False).transpose(0, 2, 3, 1)  # (B, Hkv, D, Sk), a view
    vv = v4.astype(acc_dtype, copy=False).transpose(0, 2, 1, 3)  # (B, Hkv, Sk, Dv), a view
    s = qg @ kt  # (B, Hkv, G*Sq, Sk)
    # the registry's math, on the scores' heads (Hkv, G); no position modifier comes here
    scoremods.apply(s.reshape(b, hkv, g, sq, sk), mods, None, None, (hkv, g), xp=xp)
    m = s.max(axis=-1, keepdims=True)
    s -= m
    xp.exp(s, out=s)
    lsum = s.sum(axis=-1, keepdims=True)
    out = (s @ vv) / lsum
    lse = (m + xp.log(lsum))[..., 0]
    return out.reshape(b, h, sq, dv), lse.reshape(b, h, sq)


def _merge(comm, rows: np.ndarray) -> np.ndarray:
    """Online-softmax merge of every rank's (lse, out) rows: reduce to rank 0, then broadcast."""
    if comm.Get_size() == 1:
        return rows
    width, dt = rows.shape[1], rows.dtype
    base = MPI.DOUBLE if dt == np.float64 else MPI.FLOAT
    row_type = base.Create_contiguous(width).Commit()

    def combine(inmem, inoutmem, _datatype):
        a = np.frombuffer(inmem, dtype=dt).reshape(-1, width)
        c = np.frombuffer(inoutmem, dtype=dt).reshape(-1, width)
        o, lse = softmax.merge(a[:, 1:], a[:, 0], c[:, 1:], c[:, 0])
        c[:, 0] = lse
        c[:, 1:] = o

    op = MPI.Op.Create(combine, commute=True)
    try:
        result = np.empty_like(rows)
        with watch("decode_attention: the merge reduction with the other ranks"):
            comm.Reduce([rows, len(rows), row_type], [result, len(rows), row_type], op=op, root=0)
            comm.Bcast([result, len(rows), row_type], root=0)
    finally:
        op.Free()
        row_type.Free()
    return result
