"""The one-file output's parallel HDF5 transfers: token selections and collective I/O.

A rank's tokens of a sequence are a few arithmetic runs of global positions
(:func:`ringmpi.job.reader.local_runs`); :func:`selection` turns them into one
file dataspace (hyperslabs OR-ed together) and :func:`collective_io` writes (or
reads) them in one collective MPI-IO call. Used by :mod:`ringmpi.job.mpio`.
"""

from __future__ import annotations

import zlib
from typing import Optional

import numpy as np

from .reader import local_runs

__all__ = ["crc", "runs", "selection", "dxpl", "collective_io"]


def crc(*arrays) -> int:
    """CRC-32 of the arrays' bytes, one after another (the markers' checksums)."""
    crc = 0
    for a in arrays:
        crc = zlib.crc32(memoryview(np.ascontiguousarray(a)).cast("B"), crc)
    return crc


def runs(pos: np.ndarray) -> list:
    """Sorted positions as arithmetic runs (first, count, step)."""
    return [(first, cnt, step) for first, cnt, step, _ in local_runs(pos)]


def selection(dset, lead: tuple, pos: np.ndarray, axis: int):
    """File dataspace selecting tokens ``pos`` (sorted) along ``axis``, at index ``lead``."""
    import h5py

    space = dset.id.get_space()
    space.select_none()
    shape = dset.shape
    for first, cnt, step in runs(pos):
        start = [0] * len(shape)
        count = [1] * len(shape)
        block = list(shape)
        for d, b in enumerate(lead):
            start[d], block[d] = b, 1
        start[axis], count[axis], block[axis] = first, cnt, 1
        stride = [1] * len(shape)
        stride[axis] = max(step, 1)
        space.select_hyperslab(
            tuple(start), tuple(count), tuple(stride), tuple(block), op=h5py.h5s.SELECT_OR
        )
    return space


def dxpl():
    """A collective MPI-IO transfer property list."""
    import h5py

    dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
    dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_COLLECTIVE)  # filtered (compressed) writes need it
    return dxpl


def collective_io(dset, lead: tuple, pos: np.ndarray, axis: int, arr: Optional[np.ndarray]):
    """Collective write of ``arr`` (or read, ``arr`` None) at tokens ``pos`` of ``dset``."""
    import h5py

    fspace = selection(dset, lead, pos, axis)
    shape = list(dset.shape[len(lead) :])
    shape[axis - len(lead)] = len(pos)
    buf = np.empty(shape, dtype=dset.dtype) if arr is None else np.ascontiguousarray(arr)
    mem = buf
    mspace = h5py.h5s.create_simple(tuple(shape) if buf.size else (1,))
    if not buf.size:  # a rank without tokens still takes part in the collective call
        mspace.select_none()
        mem = np.zeros(1, dtype=dset.dtype)
    if arr is None:
        dset.id.read(mspace, fspace, mem, dxpl=dxpl())
    else:
        dset.id.write(mspace, fspace, mem, dxpl=dxpl())
    return buf
