"""Moving whole arrays to and from the per-rank token layouts."""

from __future__ import annotations

import warnings
from typing import Optional

import numpy as np
from mpi4py import MPI

from .partition import positions

__all__ = ["shard", "gather"]


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
):
    """This rank's tokens of a global array that every rank holds.

    Parameters
    ----------
    x : array (..., N, ...)
        The whole sequence; ``axis`` is the token axis (default -3: (S, H, D)).
    comm : mpi4py.MPI.Comm, optional
        Default MPI.COMM_WORLD.
    layout : {"zigzag", "striped", "contiguous"}
    head_parallel : int
        As in :func:`ringmpi.positions`.
    cu_seqlens : int array, optional
        Packed sequences: the layout applies within each (as in :func:`ringmpi.positions`).

    Returns
    -------
    array with ``len(positions(N, rank, size, layout, head_parallel))`` tokens on ``axis``,
    in the order the rank stores them.
    """
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
    idx = positions(n, comm.Get_rank(), comm.Get_size(), layout, head_parallel, cu_seqlens)
    return x.take(idx, axis=ax)


def gather(
    x_local,
    n: int,
    comm: Optional[MPI.Comm] = None,
    layout: str = "zigzag",
    axis: int = -3,
    head_parallel: int = 1,
    cu_seqlens=None,
):
    """The global array in token order, on every rank (inverse of ``shard``).

    Parameters
    ----------
    x_local : numpy array with this rank's tokens on ``axis``
    n : int
        Global sequence length.

    Returns
    -------
    numpy array with ``n`` tokens on ``axis``. Holds the whole sequence: meant
    for tests and small problems, not for the long-sequence path.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    x_local = np.asarray(x_local.get() if hasattr(x_local, "get") else x_local)
    size = comm.Get_size()
    ax = _token_axis(x_local, axis, "gather")  # the same on every rank: before the collective
    parts = comm.allgather(x_local)
    shape = list(x_local.shape)
    shape[ax] = n
    out = np.empty(shape, dtype=x_local.dtype)
    for r, part in enumerate(parts):
        idx = positions(n, r, size, layout, head_parallel, cu_seqlens)
        if part.shape[ax] != len(idx):
            raise ValueError(
                f"gather: rank {r} holds {part.shape[ax]} tokens, layout {layout!r} "
                f"gives it {len(idx)} of n={n}"
            )
        np.moveaxis(out, ax, 0)[idx] = np.moveaxis(part, ax, 0)
    return out
