"""Freed memory kept for the next batch, while the job runs (glibc's malloc).

Every batch allocates arrays of tens to hundreds of MiB: the read buffers, the
tile layout copies, the online-softmax state, the output. glibc serves each of
them with a fresh ``mmap`` and unmaps it on free, so the next batch faults every
page in again and the kernel zeroes it: on the 2,000-sequence log-normal set a
profile spent 12% of all CPU time in ``clear_page_erms`` (about 2 s per rank
of an 18 s job). While a job runs, :func:`keep_freed` has malloc take large
blocks from the heap (``M_MMAP_MAX`` 0) and never give its free top back
(``M_TRIM_THRESHOLD`` at its maximum), so the next batch reuses the pages the
last one freed. The peak is what it was (the same arrays live at the same
time); the process just does not shrink between batches. When the job ends
the defaults come back and the free memory is returned (``malloc_trim``).

``RINGMPI_KEEP_MEMORY=0`` leaves malloc alone. Other C libraries (musl, macOS)
have no such switches: nothing is changed there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Optional

from .. import env

__all__ = ["keep_freed", "HeapKeep"]

# mallopt parameters (malloc.h) and glibc's defaults for them
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_DEFAULT_TRIM, _DEFAULT_MMAP_MAX = 128 * 1024, 65536
_MAX_INT = 2**31 - 1


class HeapKeep:
    """What :func:`keep_freed` changed; :meth:`restore` puts glibc's defaults back."""

    def __init__(self, libc: Optional[ctypes.CDLL]) -> None:
        self._libc = libc

    @property
    def active(self) -> bool:
        return self._libc is not None

    def restore(self) -> None:
        libc, self._libc = self._libc, None
        if libc is None:
            return
        libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM)
        libc.malloc_trim(0)


def _glibc() -> Optional[ctypes.CDLL]:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        if not hasattr(libc, "gnu_get_libc_version"):  # glibc only: musl has other parameters
            return None
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed() -> HeapKeep:
    """Have malloc reuse freed blocks for the rest of the job (see the module); call
    ``restore()`` on the result when the job ends.
    """
    if not env.get("RINGMPI_KEEP_MEMORY"):
        return HeapKeep(None)
    libc = _glibc()
    if libc is None:
        return HeapKeep(None)
    if not libc.mallopt(_M_TRIM_THRESHOLD, _MAX_INT) or not libc.mallopt(_M_MMAP_MAX, 0):
        keep = HeapKeep(libc)
        keep.restore()
        return HeapKeep(None)
    return HeapKeep(libc)
