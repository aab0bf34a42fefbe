"""Token layouts: which global tokens each rank of the ring holds.

Three layouts map the N tokens of a sequence onto P ranks:

* ``contiguous``: rank r holds one block of consecutive tokens. Simple, but
  under a causal mask the last rank does P times the work of the first.
* ``zigzag``: the sequence is cut into 2P chunks; rank r holds chunks r and
  2P-1-r, so every rank owns one "early" and one "late" chunk and the causal
  work is balanced.
* ``striped``: token t lives on rank t mod P; every rank sees the same mix of
  early and late tokens.
* ``balanced`` (issue 41): blocks of tokens are dealt to the ranks by the work
  the mask gives their queries (visible pairs), greedy longest-processing-time
  first, so every rank scores about the same number of pairs under any mask
  (a union of slices, causal, a window, packed sequences). It is computed from
  the mask itself (identical on every rank, no communication), so it needs the
  mask wherever the token map is asked for (``mask=`` of :func:`positions`,
  ``causal=`` / ``window=`` / ``slices=`` or ``mask=`` of :func:`shard` and
  :func:`gather`). Ranks may hold different numbers of tokens. Under
  cross-attention the queries are dealt so and the keys cut contiguously.

Any N >= 1 works with any P >= 1: chunk sizes differ by at most one token and
a rank may hold no token at all.

Packed sequences (``cu_seqlens``, FlashAttention's varlen convention: global
offsets [0, n1, n1+n2, ..., N]): the layout applies within each sequence, so
every sequence's causal work is balanced over the ranks, whatever its length.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Optional

import numpy as np

if TYPE_CHECKING:  # mpi4py.MPI is imported on use: token maps need no MPI
    from mpi4py import MPI

__all__ = [
    "LAYOUTS",
    "MASK_LAYOUTS",
    "BALANCED_BLOCK",
    "balanced_map",
    "positions",
    "counts",
    "split_sizes",
    "check_layout",
    "check_cu_seqlens",
    "shard",
    "gather",
    "local_runs",
]

LAYOUTS = ("contiguous", "zigzag", "striped")  # the layouts that need no mask
MASK_LAYOUTS = ("balanced",)  # the layouts computed from the mask (issue 41)
BALANCED_BLOCK = 64  # tokens per block the balanced layout deals (heavy blocks are split)


def check_layout(layout: str) -> str:
    """Return ``layout`` if it names a known layout, else raise ValueError."""
    if layout not in LAYOUTS + MASK_LAYOUTS:
        raise ValueError(
            f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS + MASK_LAYOUTS)}"
        )
    return layout


def split_sizes(n: int, parts: int) -> np.ndarray:
    """Sizes of ``parts`` near-equal pieces of ``n`` items (the first ones one larger)."""
    base, rem = divmod(n, parts)
    sizes = np.full(parts, base, dtype=np.int64)
    sizes[:rem] += 1
    return sizes


def check_cu_seqlens(cu_seqlens, n: int) -> np.ndarray:
    """``cu_seqlens`` as int64 offsets [0, ..., n], non-decreasing; ValueError otherwise."""
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or len(cu) < 2 or cu.dtype.kind not in "iu":
        raise ValueError(f"cu_seqlens must be a 1-D integer array [0, ..., N], got {cu!r}")
    cu = cu.astype(np.int64)
    if cu[0] != 0 or cu[-1] != n or (np.diff(cu) < 0).any():
        raise ValueError(
            f"cu_seqlens must start at 0, never decrease and end at N={n}: got {cu.tolist()[:8]}"
            + (" ..." if len(cu) > 8 else "")
        )
    return cu


def _check_args(n: int, rank: int, size: int) -> None:
    if int(n) != n or n < 0:
        raise ValueError(f"sequence length must be a non-negative integer, got {n!r}")
    if int(size) != size or size < 1:
        raise ValueError(f"number of ranks must be >= 1, got {size!r}")
    if int(rank) != rank or not 0 <= rank < size:
        raise ValueError(f"rank {rank!r} is outside 0..{size - 1}")


def _head_parallel(size: int, head_parallel: int) -> int:
    u = int(head_parallel)
    if u != head_parallel or u < 1 or size % u:
        raise ValueError(
            f"head_parallel={head_parallel!r} must be a positive divisor of {size} ranks"
        )
    return u


def positions(
    n: int,
    rank: int,
    size: int,
    layout: str = "zigzag",
    head_parallel: int = 1,
    cu_seqlens=None,
    mask=None,
) -> np.ndarray:
    """Global token indices held by ``rank``, in the order the rank stores them.

    Parameters
    ----------
    n : int
        Global sequence length (>= 0).
    rank, size : int
        This rank and the number of ranks.
    layout : {"contiguous", "zigzag", "striped", "balanced"}
        Token layout.
    head_parallel : int
        U > 1: ranks form size/U groups of U consecutive ranks (rank = r * U + u);
        the layout spreads the tokens over the size/U ring positions r, and member u
        of a group holds the u-th contiguous part of its group's tokens (the
        sequence shards an all-to-all turns into head shards, see
        :func:`ringmpi.ring_attention`'s ``head_parallel``).
    cu_seqlens : int array, optional
        Offsets [0, n1, n1+n2, ..., n] of packed sequences: the layout applies
        within each sequence (positions are still global). Ignored by
        ``balanced``, which takes them from ``mask``.
    mask : ringmpi.mask.Mask, optional
        The call's mask (:func:`ringmpi.mask.mask_of`); needed by ``balanced``
        (ValueError without it), ignored by the other layouts.

    Returns
    -------
    numpy.ndarray
        int64 array of shape (count,), count >= 0.
    """
    _check_args(n, rank, size)
    check_layout(layout)
    u = _head_parallel(size, head_parallel)
    if u > 1:
        group = positions(
            n, int(rank) // u, int(size) // u, layout, cu_seqlens=cu_seqlens, mask=mask
        )
        sizes = split_sizes(len(group), u)
        start = int(sizes[: int(rank) % u].sum())
        return group[start : start + sizes[int(rank) % u]]
    if layout in MASK_LAYOUTS:
        return _balanced(mask, n, cu_seqlens, int(size))[int(rank)].copy()
    if size == 1:  # every layout: the one rank holds the tokens in order
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, n)
        return np.arange(int(n), dtype=np.int64)
    if cu_seqlens is not None:
        cu = check_cu_seqlens(cu_seqlens, n)
        parts = [positions(int(b - a), rank, size, layout) + a for a, b in zip(cu[:-1], cu[1:])]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    n, rank, size = int(n), int(rank), int(size)
    if layout == "striped":
        return np.arange(rank, n, size, dtype=np.int64)
    if layout == "contiguous":
        sizes = split_sizes(n, size)
        start = int(sizes[:rank].sum())
        return np.arange(start, start + sizes[rank], dtype=np.int64)
    sizes = split_sizes(n, 2 * size)
    starts = np.concatenate(([0], np.cumsum(sizes)))
    a, b = rank, 2 * size - 1 - rank
    return np.concatenate(
        (
            np.arange(starts[a], starts[a + 1], dtype=np.int64),
            np.arange(starts[b], starts[b + 1], dtype=np.int64),
        )
    )


def counts(
    n: int,
    size: int,
    layout: str = "zigzag",
    head_parallel: int = 1,
    cu_seqlens=None,
    mask=None,
) -> np.ndarray:
    """Number of tokens each rank holds: int64 array of shape (size,) (``mask`` as in positions)."""
    _check_args(n, 0, size)
    check_layout(layout)
    u = _head_parallel(size, head_parallel)
    if u > 1:
        per_group = counts(n, size // u, layout, cu_seqlens=cu_seqlens, mask=mask)
        return np.concatenate([split_sizes(int(c), u) for c in per_group])
    if layout in MASK_LAYOUTS:
        parts = _balanced(mask, n, cu_seqlens, int(size))
        return np.array([len(p) for p in parts], dtype=np.int64)
    if size == 1:
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, n)
        return np.array([int(n)], dtype=np.int64)
    if cu_seqlens is not None:
        cu = check_cu_seqlens(cu_seqlens, n)
        total = np.zeros(size, dtype=np.int64)
        for a, b in zip(cu[:-1], cu[1:]):
            total += counts(int(b - a), size, layout)
        return total
    if layout == "striped":
        return np.array([len(range(r, n, size)) for r in range(size)], dtype=np.int64)
    if layout == "contiguous":
        return split_sizes(n, size)
    s = split_sizes(n, 2 * size)
    return s[:size] + s[::-1][:size]


def _same_offsets(a, b) -> bool:
    return (a is None and b is None) or (
        a is not None and b is not None and np.array_equal(np.asarray(a), np.asarray(b))
    )


def _balanced(mask, n: int, cu_seqlens, size: int) -> list:
    """The ``balanced`` token map of the ``n`` tokens with offsets ``cu_seqlens`` under ``mask``.

    Self-attention (queries and keys the same tokens): :func:`balanced_map`. For
    cross-attention the queries (n, offsets = the mask's) get :func:`balanced_map`
    and the keys (n, offsets = the mask's key side) are cut into ``size``
    contiguous parts: a rank's work is set by its queries, the keys travel. One
    clear ValueError when the mask is missing or the tokens are neither side.
    """
    if mask is None:
        raise ValueError(
            "layout 'balanced' is computed from the mask: pass it (shard/gather: causal=, "
            "window=, slices= and cu_seqlens=, the same as the attention call, or mask=; "
            "positions/counts: mask=ringmpi.mask.mask_of(spec, nq, nk))"
        )
    n = int(n)
    if mask.nq == mask.nk and _same_offsets(mask.cu_q, mask.cu_k):  # self-attention
        if n != mask.nq:
            raise ValueError(
                f"layout 'balanced': the mask is over {mask.nq} tokens, the sequence has {n}"
            )
        return balanced_map(mask, size)
    if n == mask.nq and _same_offsets(cu_seqlens, mask.cu_q):
        return balanced_map(mask, size)
    if n == mask.nk and _same_offsets(cu_seqlens, mask.cu_k):
        sizes = split_sizes(n, size)
        ends = np.cumsum(sizes)
        return [np.arange(e - c, e, dtype=np.int64) for c, e in zip(sizes, ends)]
    raise ValueError(
        f"layout 'balanced': {n} tokens"
        + ("" if cu_seqlens is None else " with these cu_seqlens")
        + f" are neither the mask's {mask.nq} queries nor its {mask.nk} keys "
        "(cut the keys of packed cross-attention with cu_seqlens=cu_seqlens_k)"
    )


_BALANCED_CACHE: dict = {}


def _mask_key(mask) -> tuple:
    cu_q, cu_k = (None if c is None else tuple(int(x) for x in c) for c in (mask.cu_q, mask.cu_k))
    return (mask.nq, mask.nk, bool(mask.causal), mask.window, cu_q, cu_k, mask.slices)


def balanced_map(mask, size: int, block: int = BALANCED_BLOCK) -> list:
    """The ``balanced`` layout (issue 41): each rank's tokens, by the mask's visible-pair cost.

    The sequence is cut into blocks of ``block`` tokens; a block whose queries see
    more than 1/(32 size) of all visible pairs is halved until it does not (or holds
    one token), so no block is too heavy to balance. Blocks go, heaviest first
    (ties: the earlier block), to the rank with the fewest pairs so far (ties: the
    fewer tokens, then the lower rank): greedy longest-processing-time, in exact
    integer arithmetic, so every rank computes the same map from the agreed mask.
    Each rank stores its tokens in increasing position order.

    Parameters
    ----------
    mask : ringmpi.mask.Mask
        The mask; its queries are dealt (for self-attention they are also the keys).
    size : int
        Number of ring positions.
    block : int
        Tokens per block before heavy blocks are split.

    Returns
    -------
    list of ``size`` int64 arrays of global positions (some may be empty).
    """
    import heapq

    from .cost import row_pairs

    if int(block) != block or block < 1:
        raise ValueError(f"balanced layout: block must be a positive integer, got {block!r}")
    key = (int(size), int(block), _mask_key(mask))
    if key in _BALANCED_CACHE:
        return _BALANCED_CACHE[key]
    n = mask.nq
    cum = np.concatenate(([0], np.cumsum(row_pairs(mask, np.arange(n, dtype=np.int64)))))
    total = int(cum[-1])
    todo = [(a, min(a + block, n)) for a in range(0, n, block)][::-1]
    blocks = []  # (cost, start, stop)
    while todo:
        a, b = todo.pop()
        c = int(cum[b] - cum[a])
        if b - a > 1 and c * 32 * size > total:
            mid = (a + b) // 2
            todo.extend(((mid, b), (a, mid)))
        else:
            blocks.append((c, a, b))
    blocks.sort(key=lambda x: (-x[0], x[1]))
    heap = [(0, 0, r) for r in range(size)]  # (pairs, tokens, rank)
    owned: list = [[] for _ in range(size)]
    for c, a, b in blocks:
        load, tok, r = heapq.heappop(heap)
        owned[r].append((a, b))
        heapq.heappush(heap, (load + c, tok + b - a, r))
    out = []
    for blk in owned:
        blk.sort()
        parts = [np.arange(a, b, dtype=np.int64) for a, b in blk]
        pos = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        pos.flags.writeable = False  # shared through the cache
        out.append(pos)
    if len(_BALANCED_CACHE) >= 16:
        _BALANCED_CACHE.pop(next(iter(_BALANCED_CACHE)))
    _BALANCED_CACHE[key] = out
    return out


def runs(pos: np.ndarray) -> list[tuple[int, int]]:
    """Split a position array into maximal runs with a constant positive stride.

    Returns a list of (start, stop) index pairs covering ``pos`` in order. Greedy:
    a run takes every following position that keeps its stride, so a run that ends
    where the next begins (packed sequences under the striped layout) costs one
    run, not one per token; the number of runs is about the number of stride
    changes. Tiles cut inside one run have tight [min, max] position bounds,
    which is what tile skipping needs. Positions that do not increase are runs of
    one.
    """
    pos = np.asarray(pos)
    n = len(pos)
    if n <= 1:
        return [(0, n)] if n else []
    d = np.diff(pos)
    chg = (np.flatnonzero(d[1:] != d[:-1]) + 1).tolist()
    out, i = [], 0  # i: first position not yet in a run
    for s, e in zip([0, *chg], [*chg, len(d)]):  # d[s:e] equal: points s..e evenly spaced
        start = max(i, s)
        if start >= e:  # at most point e is left: it starts the next run
            continue
        if d[s] <= 0:  # not increasing: each point on its own
            out.extend((j, j + 1) for j in range(start, e))
            i = e
            continue
        out.append((start, e + 1))
        i = e + 1
    if i < n:
        out.append((i, n))
    return out


# ----------------------------------------------------------------------
# Moving whole arrays to and from the per-rank token layouts.


def _token_axis(x, axis: int, who: str) -> int:
    """``axis`` as a non-negative index into ``x``'s dimensions, or one clear ValueError."""
    nd = np.ndim(x)
    if not -nd <= axis < nd:
        raise ValueError(
            f"{who}: the token axis {axis} does not exist in an array of shape "
            f"{tuple(np.shape(x))} ({nd}-D); attention arrays are (S, H, D) or (B, S, H, D) "
            "(add a head axis with x[:, None], or give axis=)"
        )
    return axis % nd


def shard(
    x,
    comm: Optional[MPI.Comm] = None,
    layout: str = "zigzag",
    axis: int = -3,
    head_parallel: int = 1,
    cu_seqlens=None,
    *,
    causal=None,
    window=None,
    slices=None,
    mask=None,
):
    """This rank's tokens of a global array that every rank holds.

    Parameters
    ----------
    x : array (..., N, ...)
        The whole sequence; ``axis`` is the token axis (default -3: (S, H, D)).
    comm : mpi4py.MPI.Comm, optional
        Default MPI.COMM_WORLD.
    layout : {"zigzag", "striped", "contiguous", "balanced"}
    head_parallel : int
        As in :func:`ringmpi.positions`.
    cu_seqlens : int array, optional
        Packed sequences: the layout applies within each (as in :func:`ringmpi.positions`).
    causal, window, slices :
        The mask of a self-attention call, for ``layout="balanced"``; give at least
        one of them (``causal=False`` for full attention), exactly as the call will.
        Ignored by the other layouts.
    mask : ringmpi.mask.Mask, optional
        Instead of those, the whole mask (``ringmpi.mask.mask_of(spec, nq, nk)``):
        needed for cross-attention, whose queries and keys (``cu_seqlens=`` the key
        offsets when packed) are cut by the same mask.

    Returns
    -------
    array with ``len(positions(N, rank, size, layout, head_parallel))`` tokens on ``axis``,
    in the order the rank stores them.
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    ax = _token_axis(x, axis, "shard")
    n = x.shape[ax]
    # (H, S, D) given as (S, H, D): "heads" many times the "tokens" (tiny test inputs aside)
    if x.ndim >= 3 and ax == x.ndim - 3 and x.shape[-2] >= max(64, 4 * n):
        warnings.warn(
            f"shard: x {tuple(x.shape)} has {n} tokens but {x.shape[-2]} heads: ringmpi "
            "is token-major, (S, H, D); if the data is head-major (H, S, D), transpose it "
            "(np.swapaxes(x, -3, -2)) or the heads are taken as tokens",
            stacklevel=2,
        )
    mask = _shard_mask(layout, n, cu_seqlens, causal, window, slices, mask)
    idx = positions(
        n, comm.Get_rank(), comm.Get_size(), layout, head_parallel, cu_seqlens, mask=mask
    )
    return x.take(idx, axis=ax)


def _shard_mask(layout: str, n: int, cu_seqlens, causal, window, slices, mask=None):
    """The mask ``balanced`` deals by (None for the other layouts), from shard's keywords."""
    if check_layout(layout) not in MASK_LAYOUTS:
        return None
    if mask is not None:
        if causal is not None or window is not None or slices is not None:
            raise ValueError("shard/gather: give mask= or causal=/window=/slices=, not both")
        return mask
    if causal is None and window is None and slices is None and cu_seqlens is None:
        raise ValueError(
            "layout 'balanced' is computed from the mask: give shard/gather the attention "
            "call's causal=, window=, slices= and cu_seqlens= (causal=False for full attention)"
        )
    from .mask import mask_of
    from .spec import AttentionSpec

    spec = AttentionSpec(causal=bool(causal), window=window, cu_seqlens=cu_seqlens, slices=slices)
    return mask_of(spec, n, n)


def gather(
    x_local,
    n: int,
    comm: Optional[MPI.Comm] = None,
    layout: str = "zigzag",
    axis: int = -3,
    head_parallel: int = 1,
    cu_seqlens=None,
    *,
    causal=None,
    window=None,
    slices=None,
    mask=None,
):
    """The global array in token order, on every rank (inverse of ``shard``).

    Parameters
    ----------
    x_local : numpy array with this rank's tokens on ``axis``
    n : int
        Global sequence length.
    causal, window, slices, mask :
        The mask, for ``layout="balanced"`` (as in :func:`shard`).

    Returns
    -------
    numpy array with ``n`` tokens on ``axis``. Holds the whole sequence: meant
    for tests and small problems, not for the long-sequence path.
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    x_local = np.asarray(x_local.get() if hasattr(x_local, "get") else x_local)
    size = comm.Get_size()
    ax = _token_axis(x_local, axis, "gather")  # the same on every rank: before the collective
    mask = _shard_mask(layout, n, cu_seqlens, causal, window, slices, mask)  # same everywhere
    parts = comm.allgather(x_local)
    shape = list(x_local.shape)
    shape[ax] = n
    out = np.empty(shape, dtype=x_local.dtype)
    for r, part in enumerate(parts):
        idx = positions(n, r, size, layout, head_parallel, cu_seqlens, mask=mask)
        if part.shape[ax] != len(idx):
            raise ValueError(
                f"gather: rank {r} holds {part.shape[ax]} tokens, layout {layout!r} "
                f"gives it {len(idx)} of n={n}"
            )
        np.moveaxis(out, ax, 0)[idx] = np.moveaxis(part, ax, 0)
    return out


def local_runs(pos: np.ndarray) -> list:
    """Increasing positions as (first_token, count, step, dest_offset) arithmetic runs.

    The runs of :func:`ringmpi.layout.runs` (greedy: about one per stride change).
    """
    pos = np.asarray(pos, dtype=np.int64)
    if len(pos) > 1 and (np.diff(pos) <= 0).any():
        raise ValueError("local_runs needs strictly increasing positions")
    return [
        (int(pos[a]), b - a, int(pos[a + 1] - pos[a]) if b - a > 1 else 1, a) for a, b in runs(pos)
    ]
