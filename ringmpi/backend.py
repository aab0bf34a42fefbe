"""Choosing the tile backend from the array type.

numpy arrays run on the CPU: the fused C tile when it can be built and loaded,
the numpy tile otherwise (``RINGMPI_CPU_KERNEL=numpy|fused|auto`` forces one).
CuPy arrays run the CUDA tiles. There is no global switch inside the library.
A new kernel (a fused backward, a CUDA backward) is one more tile here and
nothing else: both ring loops only talk to :class:`Backend`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from . import softmax
from .cpu import numpy_tile
from .ring import Ring
from .tile import BackwardTile, ForwardTile

__all__ = ["Backend", "select", "is_cupy"]


@dataclass(frozen=True)
class Backend:
    """What the ring loops need from a tile backend."""

    name: str
    xp: Any  # array module: numpy or cupy
    forward_tile: ForwardTile
    backward_tile: Optional[BackwardTile]  # None: this backend has no backward tile yet
    tile_dtype: Callable[[Any], Any]  # dtype q/k/v are converted to for the tile
    acc_dtype: Callable[[Any], Any]  # dtype of the online-softmax state
    ring: Callable[..., Any]  # factory: comm -> Ring-like exchanger
    dtypes: tuple  # input dtype names accepted
    # output (B, S, H, D) in the accumulation dtype -> C-contiguous in the input dtype
    cast_out: Callable[[Any, Any], Any] = lambda o, dt: o.astype(dt, order="C", copy=False)
    # state (acc, m, l) -> (out (B, S, H, D), lse (B, H, S))
    finalize: Optional[Callable[..., Any]] = None
    # input array -> floating values (bfloat16 bit patterns held as uint16 -> float32)
    decode: Callable[[Any], Any] = lambda x: x

    def finish(self, acc, m, l):
        """Normalised output in sequence-major layout and the lse."""
        if self.finalize is not None:
            return self.finalize(acc, m, l)
        out, lse = softmax.finalize(acc, m, l, self.xp)
        return self.xp.moveaxis(out, -3, -2), lse


def is_cupy(x) -> bool:
    """True for a CuPy array (checked without importing CuPy)."""
    return type(x).__module__.split(".")[0] == "cupy"


_CPU_DTYPES = ("float16", "float32", "float64")


def _numpy_backend() -> Backend:
    cd = numpy_tile.compute_dtype
    return Backend(
        "numpy", np, numpy_tile.forward_tile, numpy_tile.backward_tile, cd, cd, Ring, _CPU_DTYPES
    )


def _fused_backend() -> Optional[Backend]:
    try:
        from .cpu import fused
    except ImportError:
        return None
    if not fused.available():
        return None
    from .cpu import fused_backward

    cd = numpy_tile.compute_dtype
    return Backend(
        "fused",
        np,
        fused.forward_tile,
        fused_backward.backward_tile,  # falls back to the numpy tile where it cannot run
        cd,
        cd,
        Ring,
        _CPU_DTYPES,
        finalize=lambda acc, m, l: fused.finalize(acc, m, l, seq_major=True),
    )


def _gpu_backend() -> Backend:
    import cupy

    from . import gpu

    return Backend(
        "gpu",
        cupy,
        gpu.forward_tile,
        gpu.backward_tile,
        gpu.tile_dtype,
        gpu.acc_dtype,
        gpu.GpuRing,
        # uint16 arrays are bfloat16 bit patterns (gpu.to_bf16_bits), for CuPy without bfloat16
        ("float16", "bfloat16", "uint16", "float32", "float64"),
        _gpu_cast_out,
        decode=_gpu_decode,
    )


def _gpu_decode(x):
    from . import gpu

    return gpu.from_bf16_bits(x) if str(x.dtype) == "uint16" else x


def _gpu_cast_out(out, dtype):
    from . import gpu

    if np.dtype(dtype) == np.uint16:  # bfloat16 bits in, bfloat16 bits out
        return gpu.to_bf16_bits(out)
    return out.astype(dtype, order="C", copy=False)


def select(x) -> Backend:
    """Backend for array ``x``: GPU for CuPy arrays, otherwise a CPU tile."""
    if is_cupy(x):
        return _gpu_backend()
    choice = os.environ.get("RINGMPI_CPU_KERNEL", "auto").lower()
    if choice not in ("auto", "fused", "numpy"):
        raise ValueError(f"RINGMPI_CPU_KERNEL must be auto, fused or numpy, not {choice!r}")
    if choice != "numpy":
        fused = _fused_backend()
        if fused is not None:
            return fused
        if choice == "fused":
            raise RuntimeError("RINGMPI_CPU_KERNEL=fused but the fused CPU tile is unavailable")
    return _numpy_backend()
