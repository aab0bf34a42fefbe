"""Two-dimensional process grids: several rings side by side.

``grid(comm, ring_size=R)`` lays the P ranks out as a 2-D Cartesian communicator
with dims [P/R, R] (rank = g * R + r: each ring is R consecutive ranks, which
keeps a ring inside a node where it fits) and returns the ring this rank
belongs to and the communicator across rings (the ranks at the same ring
position). :func:`ringmpi.ring_attention` takes any communicator, so many
sequences run at once, one per ring::

    ring, across = ringmpi.grid(MPI.COMM_WORLD, ring_size=4)
    out = ringmpi.ring_attention(q, k, v, ring, causal=True)   # this ring's sequence
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .collective import agree_views

if TYPE_CHECKING:  # mpi4py.MPI is imported on use: `import ringmpi` binds grid() eagerly
    from mpi4py import MPI

__all__ = ["grid", "cart2"]


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
