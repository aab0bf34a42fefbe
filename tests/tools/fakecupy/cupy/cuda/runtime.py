"""cupy.cuda.runtime of the stand-in: device facts and memcpyAsync (host memory only)."""

from __future__ import annotations

import ctypes
import os

__all__ = [
    "CUDARuntimeError",
    "getDeviceCount",
    "getDeviceProperties",
    "runtimeGetVersion",
    "memcpyAsync",
    "deviceSynchronize",
    "memcpyHostToDevice",
    "memcpyDeviceToHost",
    "memcpyDeviceToDevice",
    "memcpyHostToHost",
    "memcpyDefault",
    "PROPS",
]

memcpyHostToHost, memcpyHostToDevice, memcpyDeviceToHost = 0, 1, 2
memcpyDeviceToDevice, memcpyDefault = 3, 4


class CUDARuntimeError(RuntimeError):
    """As cupy_backends' CUDARuntimeError."""


# an H200-like device; tests change entries (sharedMemPerBlockOptin: the config choice)
PROPS = {
    "name": b"ringmpi CPU stand-in (not a GPU)",
    "major": 9,
    "minor": 0,
    "sharedMemPerBlock": 48 * 1024,
    "sharedMemPerBlockOptin": 232448,
    "multiProcessorCount": 132,
    "totalGlobalMem": 141 * 2**30,
}


def getDeviceCount() -> int:
    """``CUPY_STANDIN_DEVICES`` (default 1) devices."""
    return int(os.environ.get("CUPY_STANDIN_DEVICES", "1"))


def getDeviceProperties(device: int) -> dict:
    if not 0 <= int(device) < getDeviceCount():
        raise CUDARuntimeError(f"cudaErrorInvalidDevice: device {device}")
    return dict(PROPS)


def runtimeGetVersion() -> int:
    return 13000


def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int) -> None:
    """Copy ``size`` bytes between host addresses, in the order of stream ``stream``."""
    from . import Stream

    if kind not in (0, 1, 2, 3, 4):
        raise CUDARuntimeError(f"cudaErrorInvalidMemcpyDirection: {kind}")
    s = Stream._all.get(int(stream))
    if s is None:
        raise CUDARuntimeError(f"cudaErrorInvalidResourceHandle: stream {stream}")
    s.enqueue(lambda: ctypes.memmove(int(dst), int(src), int(size)))


def deviceSynchronize() -> None:
    from . import Device

    Device().synchronize()
