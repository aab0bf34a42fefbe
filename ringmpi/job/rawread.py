"""Reads of contiguous input datasets straight from the file: queued, then gathered.

The plan records where each contiguous dataset's bytes lie in its file
(:func:`raw_offset`: contiguous storage of exactly its
elements, in the machine's byte order, inside the file, checked by the scan).
Rows of such a dataset are bytes ``[offset + row0 * row, ...)``, so the reader
does not need HDF5 to fetch them: :class:`RawReads` queues every range a batch
needs (all members, q, k and v) and :meth:`RawReads.flush` reads each file's
ranges in as few transfers as their layout allows
(:func:`ringmpi.direct_io.gather`): by ``O_DIRECT`` where the file system takes
it and the batch is a megabyte or more, else with ordinary reads on the
descriptor h5py opened (the file the trust checks accepted).

Measured on the 2,000-sequence benchmark set (2 ranks, rings of one): HDF5's
reads cost each rank about a second of CPU per GB (the page cache), about as
much as the tiles lose to it; gathered direct reads cost a memory copy.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import numpy as np

from .. import direct_io

__all__ = ["RawReads", "raw_offset"]


def raw_offset(ds) -> Optional[int]:
    """The file offset of dataset ``ds``'s bytes when they can be read as they lie: contiguous
    storage holding exactly its elements, in the machine's byte order; else None."""
    if ds.chunks is not None or not ds.dtype.isnative:
        return None
    try:
        off = ds.id.get_offset()
        if off is None or ds.id.get_storage_size() != ds.size * ds.dtype.itemsize:
            return None
    except (OSError, RuntimeError, ValueError):
        return None
    return int(off)


class RawReads:
    """The raw reads of one :class:`ringmpi.job.reader.Reader`.

    Parameters
    ----------
    paths : list of str
        The input files (the plan's).
    h5file : callable
        ``h5file(i)``: the open h5py File of shard ``i`` (the reader's, trust-checked).
    """

    def __init__(self, paths: list, h5file: Callable) -> None:
        self.paths, self.h5file = paths, h5file
        self.pending: dict = {}  # shard -> [(offset, dest), ...]
        self.direct: dict = {}  # shard -> O_DIRECT descriptor of the same file, or None
        self.sec2: dict = {}  # shard -> h5py reads it with the POSIX driver (a plain fd)

    def add(self, seq, i: int, name: str, row0: int, dest: np.ndarray) -> bool:
        """Queue rows ``[row0, row0 + len(dest))`` of dataset ``name`` of ``seq`` in shard ``i``
        into ``dest`` (any strides: a head-major buffer's token-major view takes them
        transposed); False (nothing queued) when their bytes' place is not known."""
        storage = seq.storage
        if storage is None:
            return False
        off = storage[i].get(name)
        if off is None:
            return False
        if i not in self.sec2:
            self.sec2[i] = self.h5file(i).driver == "sec2"
        if not self.sec2[i]:
            return False
        if len(dest):
            self.pending.setdefault(i, []).append((off + row0 * dest[0].nbytes, dest))
        return True

    def flush(self, progress: Callable[[int], None]) -> Optional[tuple]:
        """Read everything queued; ``progress(nbytes)`` after every transfer.

        Returns None, or (shard, OSError) for the first shard whose read failed (the
        caller names the file).
        """
        pending, self.pending = self.pending, {}
        for i, ranges in pending.items():
            total = sum(d.nbytes for _, d in ranges)
            fd = self._direct_fd(i) if total >= direct_io.MIN_BYTES else None
            try:
                if fd is not None:
                    try:
                        direct_io.gather(fd, ranges, True, progress=lambda: progress(0))
                        progress(total)
                        continue
                    except direct_io.DirectUnsupported:
                        os.close(fd)
                        self.direct[i] = None
                plain = self.h5file(i).id.get_vfd_handle()
                direct_io.gather(plain, ranges, False, progress=lambda: progress(0))
                progress(total)
            except OSError as e:
                return i, e
        return None

    def _direct_fd(self, i: int) -> Optional[int]:
        """An ``O_DIRECT`` descriptor of shard ``i`` (the very file h5py has open), or None."""
        if i not in self.direct:
            like = self.h5file(i).id.get_vfd_handle()
            self.direct[i] = direct_io.open_read(self.paths[i], like)
        return self.direct[i]

    def close(self) -> None:
        """Close the ``O_DIRECT`` descriptors (the h5py files are the reader's)."""
        for fd in self.direct.values():
            if fd is not None:
                os.close(fd)
        self.direct.clear()
        self.pending.clear()
