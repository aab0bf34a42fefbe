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

:class:`HeadGroups` is a transform the ring loops apply around themselves
(``scatter`` on the way in, ``gather`` on the way out); with U = 1 it is the
identity and the ring is the caller's communicator. The loops themselves are
the same for every U, so on_step, on_tick and stats work alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np

from .collective import agree_views
from .runtime.watchdog import watch

__all__ = ["HeadGroups", "grid", "cart2"]


class HeadGroups:
    """Heads x ring around a ring loop: sequence shards <-> head shards inside each group.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        All P = U x R ranks.
    args : ringmpi.arguments.RingArgs
        The agreed call (``spec.head_parallel`` is U; ``members``/``members_k``
        are the q and k/v token counts of this rank's group members).
    h, hkv : int
        Query and key/value heads of the call.

    Attributes
    ----------
    ring : mpi4py.MPI.Comm
        The communicator the ring loop runs on: ``comm`` itself for U = 1, else the
        R ranks at this rank's head position, one per group (free with :meth:`close`).
    alltoall_bytes : int
        Bytes this rank sent in the all-to-alls so far.
    heads : slice
        The query heads this member's ring runs (all for U = 1): per-head options
        (``alibi_slopes``, ``sinks``) are split with it.
    """

    def __init__(self, comm, args, h: int, hkv: int):
        self.u = args.spec.head_parallel
        self.alltoall_bytes = 0
        self._cnt = {"q": args.members, "lse": args.members, "kv": args.members_k}
        self.heads = slice(None)
        if self.u == 1:
            self.ring, self.head, self.me = comm, None, 0
            return
        self.ring, self.head = cart2(comm, (comm.Get_size() // self.u, self.u))
        self.me = self.head.Get_rank()
        g = h // hkv
        q_heads = [slice(j * h // self.u, (j + 1) * h // self.u) for j in range(self.u)]
        kv_heads = [slice(sl.start // g, (sl.stop - 1) // g + 1) for sl in q_heads]
        self._heads = {"q": q_heads, "lse": q_heads, "kv": kv_heads}
        self.heads = q_heads[self.me]
        self._total = {"q": h, "lse": h, "kv": hkv}

    def close(self) -> None:
        """Free the group and ring communicators (nothing for U = 1)."""
        if self.head is not None:
            self.ring.Free()
            self.head.Free()
            self.head = None

    def __enter__(self) -> HeadGroups:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def scatter(self, x, kind: str):
        """Sequence shard -> head shard (the identity for U = 1).

        Parameters
        ----------
        x : array (B, s_member, Hx, D) for kind "q" or "kv", (B, H, s_member) for "lse"
            This rank's tokens of all heads.
        kind : {"q", "kv", "lse"}

        Returns
        -------
        array (B, s_group, Hx/U or the replicated K/V heads, D), or (B, H/U, s_group)
            All the group's tokens of this member's heads, in member order.
        """
        if self.u == 1:
            return x
        axis, heads, cnt = (2 if kind == "lse" else 1), self._heads[kind], self._cnt[kind]
        parts = [np.ascontiguousarray(x[:, hs] if axis == 2 else x[:, :, hs]) for hs in heads]
        mine = heads[self.me].stop - heads[self.me].start
        shapes = []
        for j in range(self.u):
            shp = list(x.shape)
            shp[axis], shp[3 - axis] = cnt[j], mine
            shapes.append(shp)
        return np.concatenate(self._exchange(parts, shapes, x.dtype), axis=axis)

    def gather(self, y, kind: str, add: bool = False):
        """Head shard -> sequence shard (inverse of :meth:`scatter`; identity for U = 1).

        ``add`` sums the parts of K/V heads that several members hold (their
        dK/dV contributions); pass ``y`` in the accumulation dtype for that.
        """
        if self.u == 1:
            return y
        axis, heads, cnt = (2 if kind == "lse" else 1), self._heads[kind], self._cnt[kind]
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
        shp[axis], shp[3 - axis] = s, self._total[kind]
        out = np.zeros(shp, dtype=y.dtype)
        for j, part in enumerate(recv):
            idx = (slice(None), heads[j]) if axis == 2 else (slice(None), slice(None), heads[j])
            out[idx] = out[idx] + part if add else part
        return out

    def _exchange(self, parts: list, shapes: list, dtype) -> list:
        from mpi4py import MPI

        isz = np.dtype(dtype).itemsize
        send = np.concatenate([p.reshape(-1) for p in parts]) if parts else np.zeros(0, dtype)
        scount = [p.size * isz for p in parts]
        rcount = [int(np.prod(s)) * isz for s in shapes]
        recv = np.empty(sum(rcount) // isz, dtype=dtype)
        sdisp = np.concatenate(([0], np.cumsum(scount)[:-1])).astype(int).tolist()
        rdisp = np.concatenate(([0], np.cumsum(rcount)[:-1])).astype(int).tolist()
        with watch("heads x ring: the all-to-all inside the head group"):
            self.head.Alltoallv(
                [send.view(np.uint8), (scount, sdisp), MPI.BYTE],
                [recv.view(np.uint8), (rcount, rdisp), MPI.BYTE],
            )
        self.alltoall_bytes += sum(scount) - scount[self.me]
        out, at = [], 0
        for shp in shapes:
            n = int(np.prod(shp))
            out.append(recv[at : at + n].reshape(shp))
            at += n
        return out


# ----------------------------------------------------------------------
# Two-dimensional process grids: several rings side by side.
#
# ``grid(comm, ring_size=R)`` lays the P ranks out as a 2-D Cartesian communicator
# with dims [P/R, R] (rank = g * R + r: each ring is R consecutive ranks, which
# keeps a ring inside a node where it fits) and returns the ring this rank
# belongs to and the communicator across rings (the ranks at the same ring
# position). :func:`ringmpi.ring_attention` takes any communicator, so many
# sequences run at once, one per ring::
#
#     ring, across = ringmpi.grid(MPI.COMM_WORLD, ring_size=4)
#     out = ringmpi.ring_attention(q, k, v, ring, causal=True)   # this ring's sequence


if TYPE_CHECKING:  # mpi4py.MPI is imported on use: `import ringmpi` binds grid() eagerly
    from mpi4py import MPI


def cart2(comm: MPI.Comm, dims: tuple) -> tuple:
    """Sub-communicators (along axis 0, along axis 1) of a [dims[0], dims[1]] Cartesian grid.

    Axis 1 is the fast one: rank = i * dims[1] + j. No reordering (token layouts
    are defined by rank). The periodic axis is the one the ring runs along.
    """
    cart = comm.Create_cart(list(dims), periods=[True, True], reorder=False)
    try:
        along0 = cart.Sub([True, False])  # fixed j, varying i
        along1 = cart.Sub([False, True])  # fixed i, varying j
    finally:
        cart.Free()
    return along0, along1


def grid(comm: Optional[MPI.Comm] = None, ring_size: Optional[int] = None) -> tuple:
    """Split ``comm`` into rings of ``ring_size`` ranks.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm, optional
        Default MPI.COMM_WORLD.
    ring_size : int, optional
        Ranks per ring R, a divisor of P (default P: one ring).

    Returns
    -------
    ring : mpi4py.MPI.Cartcomm
        The R ranks of this rank's ring, in ring order (rank g*R + r has ring rank r).
    across : mpi4py.MPI.Cartcomm
        The P/R ranks at this rank's ring position, one per ring (rank g).

    Raises
    ------
    ValueError
        On every rank, when the ranks disagree on R or R does not divide P.
    """
    from mpi4py import MPI

    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    size = comm.Get_size()
    r = size if ring_size is None else ring_size
    err = None
    if isinstance(r, bool) or not isinstance(r, int) or r < 1 or size % r:
        err = f"ring_size={r!r} must be a positive divisor of the {size} ranks"
    agree_views(comm, {"error": err, "ring_size": r}, "grid", ("ring_size",))
    across, ring = cart2(comm, (size // r, r))
    return ring, across
