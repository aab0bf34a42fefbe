"""Facts about the current CUDA device that the tiles depend on, cached per device id.

CuPy is imported lazily (only when asked about a device).
"""

from __future__ import annotations

import functools

__all__ = ["current", "props", "smem_optin", "name", "check_arch"]

MIN_CC = 80  # mma.sync bf16, ldmatrix and cp.async need sm_80


def current() -> int:
    """Id of the current CuPy device."""
    import cupy

    return cupy.cuda.Device().id


@functools.cache
def props(dev: int) -> dict:
    """``cudaGetDeviceProperties`` of device ``dev`` (a dict, as CuPy returns it)."""
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(dev)


def smem_optin(dev: int) -> int:
    """Largest dynamic shared memory one block may opt in to, in bytes."""
    p = props(dev)
    return int(p.get("sharedMemPerBlockOptin") or p["sharedMemPerBlock"])


def name(dev: int) -> str:
    """Marketing name of device ``dev`` (e.g. ``NVIDIA H200``)."""
    n = props(dev)["name"]
    return n.decode() if isinstance(n, bytes) else str(n)


@functools.cache
def check_arch(dev: int) -> int:
    """Compute capability as an int (e.g. 90); raises RuntimeError below sm_80."""
    p = props(dev)
    cc = 10 * int(p["major"]) + int(p["minor"])
    if cc < MIN_CC:
        raise RuntimeError(
            f"ringmpi GPU tiles need compute capability 8.0 or newer (mma.sync, cp.async); "
            f"device {dev} ({name(dev)}) is {cc // 10}.{cc % 10}"
        )
    return cc
