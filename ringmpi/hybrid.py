"""Heads x ring ("Ulysses x ring"): an all-to-all inside head groups around the ring.

P = U x R ranks form a [R, U] grid (rank = r * U + u). The U ranks of a head
group hold consecutive parts of the group's tokens (``positions(...,
head_parallel=U)``). An all-to-all inside the group turns these sequence shards
into head shards: member u gets all the group's tokens for query heads
[u H/U, (u+1) H/U) and the K/V heads those read (split over the group when
Hkv % U == 0, replicated when U % Hkv == 0). The ring then runs over the R
groups with H/U heads each (messages U times smaller, R instead of P steps),
and a second all-to-all turns the result back into sequence shards. Backward:
the same on the way in; dK/dV of replicated K/V heads are summed on the way out.

Masks (``window``, ``cu_seqlens``, ``cu_seqlens_k``, cross-attention) pass
through unchanged: after the first all-to-all a group holds exactly the tokens
``positions(n, r, R, layout, cu_seqlens=...)`` of ring position r, which is what
the ring checks and masks by. q and k/v are cut over their own lengths (and
offsets), so their member counts differ under cross-attention.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from mpi4py import MPI

from .collective import first_error
from .grid import cart2
from .partition import counts

__all__ = ["ring_attention_hp", "ring_attention_backward_hp"]


class _Group:
    """The head group of this rank and the ring through the groups, plus the head split."""

    def __init__(self, comm, u: int, h: int, hkv: int):
        self.ring, self.head = cart2(comm, (comm.Get_size() // u, u))
        self.u, self.me = u, self.head.Get_rank()
        g = h // hkv
        self.q_heads = [slice(j * h // u, (j + 1) * h // u) for j in range(u)]
        self.kv_heads = [slice(sl.start // g, (sl.stop - 1) // g + 1) for sl in self.q_heads]

    def free(self) -> None:
        self.ring.Free()
        self.head.Free()

    def to_heads(self, x, heads: list, axis: int, cnt: list):
        """Sequence shard -> head shard: (B, s, Hx, D) (axis=1) or (B, Hx, s) (axis=2).

        ``cnt``: the tokens each member of the group holds (q's or k/v's counts).
        """
        parts = [np.ascontiguousarray(x[:, hs] if axis == 2 else x[:, :, hs]) for hs in heads]
        mine = heads[self.me].stop - heads[self.me].start
        shapes = []
        for j in range(self.u):
            shp = list(x.shape)
            shp[axis], shp[3 - axis] = cnt[j], mine
            shapes.append(shp)
        recv = self._exchange(parts, shapes, x.dtype)
        return np.concatenate(recv, axis=axis)

    def to_tokens(self, y, heads: list, h_total: int, axis: int, cnt: list, add: bool = False):
        """Head shard -> sequence shard; ``add`` sums the parts of replicated heads."""
        o = np.concatenate(([0], np.cumsum(cnt))).astype(int)
        if axis == 2:
            parts = [np.ascontiguousarray(y[:, :, o[j] : o[j + 1]]) for j in range(self.u)]
        else:
            parts = [np.ascontiguousarray(y[:, o[j] : o[j + 1]]) for j in range(self.u)]
        s = cnt[self.me]
        shapes = []
        for j in range(self.u):
            shp = list(y.shape)
            shp[axis], shp[3 - axis] = s, heads[j].stop - heads[j].start
            shapes.append(shp)
        recv = self._exchange(parts, shapes, y.dtype)
        shp = list(y.shape)
        shp[axis], shp[3 - axis] = s, h_total
        out = np.zeros(shp, dtype=y.dtype)
        for j, part in enumerate(recv):
            idx = (slice(None), heads[j]) if axis == 2 else (slice(None), slice(None), heads[j])
            out[idx] = out[idx] + part if add else part
        return out

    def _exchange(self, parts: list, shapes: list, dtype) -> list:
        isz = np.dtype(dtype).itemsize
        send = np.concatenate([p.reshape(-1) for p in parts]) if parts else np.zeros(0, dtype)
        scount = [p.size * isz for p in parts]
        rcount = [int(np.prod(s)) * isz for s in shapes]
        recv = np.empty(sum(rcount) // isz, dtype=dtype)
        sdisp = np.concatenate(([0], np.cumsum(scount)[:-1])).astype(int).tolist()
        rdisp = np.concatenate(([0], np.cumsum(rcount)[:-1])).astype(int).tolist()
        self.head.Alltoallv(
            [send.view(np.uint8), (scount, sdisp), MPI.BYTE],
            [recv.view(np.uint8), (rcount, rdisp), MPI.BYTE],
        )
        out, at = [], 0
        for shp in shapes:
            n = int(np.prod(shp))
            out.append(recv[at : at + n].reshape(shp))
            at += n
        return out


def _offsets_key(cu) -> Optional[tuple]:
    """``cu_seqlens`` as a comparable tuple (None stays None); ranks must agree on it."""
    return None if cu is None else tuple(int(x) for x in np.asarray(cu).reshape(-1))


def _agree(comm, q, k, u: int, layout: str, what: str, cu_q=None, cu_k=None) -> tuple:
    """Check the head-parallel call on every rank; return the group's q and k/v token counts."""
    size, rank = comm.Get_size(), comm.Get_rank()
    err = None
    if not isinstance(u, (int, np.integer)) or u < 1 or size % u:
        err = f"head_parallel={u!r} must be a positive divisor of the {size} ranks"
    elif not (hasattr(q, "ndim") and hasattr(k, "ndim")) or q.ndim not in (3, 4):
        err = "q, k, v must be numpy arrays (S, H, D) or (B, S, H, D)"
    elif type(q).__module__.split(".")[0] != "numpy":
        err = "head_parallel supports numpy arrays only for now"
    else:
        h, hkv = q.shape[-2], k.shape[-2]
        if h % u:
            err = f"H={h} query heads is not a multiple of head_parallel={u}"
        elif hkv < 1 or h % hkv:
            err = f"H={h} query heads is not a multiple of Hkv={hkv} key/value heads"
        elif hkv % u and u % hkv:
            err = f"Hkv={hkv} and head_parallel={u}: one must divide the other"
    cu_k = cu_q if cu_k is None else cu_k
    try:
        offs = (_offsets_key(cu_q), _offsets_key(cu_k))
    except (TypeError, ValueError):
        offs, err = None, err or "cu_seqlens / cu_seqlens_k must be integer arrays"
    view = None
    if not err:
        view = (q.ndim, q.shape[-2:], k.shape[-2:], str(q.dtype), int(q.shape[-3]),
                int(k.shape[-3]), offs)  # fmt: skip
    views = comm.allgather((err, view, u))
    msg = first_error([e for e, _, _ in views], what)
    if msg is None:
        first = views[0]
        for r, (_, v, ur) in enumerate(views):
            if ur != first[2] or v[:4] != first[1][:4]:
                msg = f"{what}: ranks disagree on head_parallel, shapes or dtype: rank 0 {first[1][:4]}, rank {r} {(v[:4], ur)}"  # noqa: E501
                break
            if v[6] != first[1][6]:
                msg = f"{what}: ranks disagree on cu_seqlens / cu_seqlens_k (rank 0 vs rank {r})"
                break
    want = {}
    if msg is None:
        for name, idx, cu in (("q", 4, cu_q), ("k/v", 5, cu_k)):
            n = sum(v[idx] for _, v, _ in views)
            try:
                want[name] = counts(n, size, layout, u, cu_seqlens=cu)
            except ValueError as e:
                msg = f"{what}: {e}"
                break
            bad = [r for r, (_, v, _) in enumerate(views) if v[idx] != want[name][r]]
            if bad:
                msg = (
                    f"{what}: rank {bad[0]} holds {views[bad[0]][1][idx]} {name} tokens, but "
                    f"layout {layout!r} with head_parallel={u} puts {int(want[name][bad[0]])} of "
                    f"n={n} there; cut the sequence with ringmpi.shard(x, comm, layout=..., "
                    f"head_parallel={u}{', cu_seqlens=...' if cu is not None else ''})"
                )
                break
    if msg is not None:
        raise ValueError(msg)
    g0 = rank - rank % u
    return [int(views[g0 + j][1][4]) for j in range(u)], [
        int(views[g0 + j][1][5]) for j in range(u)
    ]


def _batched(x):
    return x if x.ndim == 4 else x[None]


def ring_attention_hp(q, k, v, comm, u: int, *, layout: str, **kwargs):
    """:func:`ringmpi.ring_attention` with ``head_parallel=u`` (numpy arrays)."""
    from .attention import ring_attention

    cq, ck = kwargs.get("cu_seqlens"), kwargs.get("cu_seqlens_k")
    qc, kc = _agree(comm, q, k, u, layout, "ring_attention", cq, ck)
    h, hkv = q.shape[-2], k.shape[-2]
    grp = _Group(comm, u, h, hkv)
    try:
        qh = grp.to_heads(_batched(q), grp.q_heads, 1, qc)
        kh = grp.to_heads(_batched(k), grp.kv_heads, 1, kc)
        vh = grp.to_heads(_batched(v), grp.kv_heads, 1, kc)
        want_lse = kwargs.pop("return_lse", False)
        out, lse = ring_attention(qh, kh, vh, grp.ring, layout=layout, return_lse=True, **kwargs)
        out = grp.to_tokens(out, grp.q_heads, h, 1, qc)
        lse = grp.to_tokens(lse, grp.q_heads, h, 2, qc)
    finally:
        grp.free()
    if q.ndim == 3:
        out, lse = out[0], lse[0]
    return (out, lse) if want_lse else out


def ring_attention_backward_hp(
    dout, q, k, v, out, lse, comm, u: int, *, layout: str, stats: Optional[dict] = None, **kw
):
    """:func:`ringmpi.ring_attention_backward` with ``head_parallel=u`` (numpy arrays)."""
    from .backward import ring_attention_backward

    cq, ck = kw.get("cu_seqlens"), kw.get("cu_seqlens_k")
    qc, kc = _agree(comm, q, k, u, layout, "ring_attention_backward", cq, ck)
    h, hkv = q.shape[-2], k.shape[-2]
    acc = np.float64 if q.dtype == np.float64 else np.float32
    grp = _Group(comm, u, h, hkv)
    try:
        qs = [grp.to_heads(_batched(x), grp.q_heads, 1, qc) for x in (dout, q, out)]
        ks = [grp.to_heads(_batched(x), grp.kv_heads, 1, kc) for x in (k, v)]
        lh = grp.to_heads(lse if lse.ndim == 3 else lse[None], grp.q_heads, 2, qc)
        dq, dk, dv = ring_attention_backward(
            qs[0], qs[1], ks[0], ks[1], qs[2], lh, grp.ring, layout=layout, stats=stats, **kw
        )
        dq = grp.to_tokens(dq, grp.q_heads, h, 1, qc)
        # a replicated K/V head got gradient from several members: sum, in the accumulation dtype
        dk = grp.to_tokens(dk.astype(acc), grp.kv_heads, hkv, 1, kc, add=True).astype(k.dtype)
        dv = grp.to_tokens(dv.astype(acc), grp.kv_heads, hkv, 1, kc, add=True).astype(v.dtype)
    finally:
        grp.free()
    if q.ndim == 3:
        dq, dk, dv = dq[0], dk[0], dv[0]
    return dq, dk, dv
