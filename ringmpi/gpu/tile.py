"""GPU tile backend: CuPy + the CUDA kernels in kernels/attention_fwd.cu.

``forward_tile`` has the signature and semantics of :func:`ringmpi.cpu.numpy_tile.forward_tile`
(the specification) for CuPy arrays in the internal head-major layout:

    q     (B, H,   Sq, D)   float16, bfloat16, float32 or float64
    k, v  (B, Hkv, Sk, D)   same dtype; query head h reads K/V head h // (H // Hkv)
    q_pos (Sq,), k_pos (Sk,)  numpy int64 global positions
    acc   (B, H, Sq, D), m, l (B, H, Sq)   CuPy, float32 (float64 for float64 inputs)

bfloat16: CuPy arrays of dtype ``bfloat16`` (where CuPy has it) or ``uint16``
arrays holding the bfloat16 bit patterns (:func:`to_bf16_bits` makes them) both
run the bf16 kernel. fp16/bf16 with D <= 128 run on tensor cores
(mma.sync m16n8k16, fp32 accumulation); wider heads and fp32/fp64 run the
CUDA-core kernel. Any D <= 256 works.

CuPy is imported lazily: importing this module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Optional

import numpy as np

from . import configs, device, loader

__all__ = [
    "CONFIG_ENV",
    "KERNEL_FILE",
    "kernel_names",
    "forward_tile",
    "tile_dtype",
    "acc_dtype",
    "to_bf16_bits",
    "from_bf16_bits",
]

KERNEL_FILE = "attention_fwd.cu"
CONFIG_ENV = "RINGMPI_GPU_CONFIG"  # force one configuration by name (configs.Config.name)
MAX_D = configs.MAX_D


def kernel_names() -> tuple:
    """Every forward template instantiation the backend may launch (NVRTC name expressions)."""
    return configs.forward_names()


def _dtype_name(dtype) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:  # e.g. a CuPy-only bfloat16 type
        return getattr(dtype, "name", getattr(dtype, "__name__", str(dtype)))


def _storage(dtype) -> str:
    name = _dtype_name(dtype)
    kinds = {"float16": "half_t", "bfloat16": "bf16_t", "uint16": "bf16_t"}
    kinds.update(float32="float", float64="double")
    if name not in kinds:
        raise TypeError(f"GPU tile: unsupported dtype {name}")
    return kinds[name]


def _select(storage: str, d: int, smem_limit: int) -> configs.Config:
    """The forward configuration: ``RINGMPI_GPU_CONFIG`` if set, else the first that fits."""
    return configs.select_forward(storage, d, smem_limit, os.environ.get(CONFIG_ENV, "").strip())


def tile_dtype(dtype):
    """Dtype q/k/v are kept in for the kernels: the input dtype, float32 for others."""
    name = _dtype_name(dtype)
    if name in ("float16", "uint16", "float32", "float64"):
        return np.dtype(name)
    if name == "bfloat16":
        return dtype  # CuPy's own bfloat16 type, where it has one
    return np.dtype(np.float32)


def acc_dtype(dtype):
    """Accumulation dtype of the state: float64 for float64 inputs, float32 otherwise."""
    name = _dtype_name(dtype)
    return np.dtype(np.float64) if name == "float64" else np.dtype(np.float32)


def _xp(x):
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def to_bf16_bits(x):
    """float array (numpy or CuPy) -> uint16 bfloat16 bits, round to nearest even.

    Finite values round to nearest even (overflow gives +-inf, as IEEE does);
    infinities stay infinite and every NaN becomes a quiet NaN of the same sign.
    """
    xp = _xp(x)
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    # add 0x7fff plus the lowest kept bit, then keep the upper half
    r = ((u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16).astype(xp.uint16)
    # NaN (exponent all ones, mantissa non-zero): the rounding above could carry
    # into the sign or clear the mantissa, so keep sign + exponent and set the quiet bit
    nan = (u & xp.uint32(0x7FFFFFFF)) > xp.uint32(0x7F800000)
    quiet = ((u >> 16) | xp.uint32(0x0040)).astype(xp.uint16)
    return xp.where(nan, quiet, r)


def from_bf16_bits(u):
    """uint16 bfloat16 bits (numpy or CuPy) -> float32, exactly."""
    xp = _xp(u)
    return (xp.asarray(u).astype(xp.uint32) << 16).view(xp.float32)


# ----------------------------------------------------------------------------
# host-side plan: block bounds (for skipping) and the flop count, cached
# ----------------------------------------------------------------------------
def block_bounds(pos: np.ndarray, bs: int) -> tuple:
    """(min, max) position of each block of ``bs`` consecutive rows, int64 arrays."""
    starts = np.arange(0, len(pos), bs)
    return np.minimum.reduceat(pos, starts), np.maximum.reduceat(pos, starts)


def visible_pairs(q_pos: np.ndarray, k_pos: np.ndarray, bm: int, bn: int, causal: bool) -> int:
    """Query-key pairs inside the (bm x bn) blocks the kernel computes (not skipped)."""
    sq, sk = len(q_pos), len(k_pos)
    if not causal:
        return sq * sk
    qhi = block_bounds(q_pos, bm)[1]
    klo = block_bounds(k_pos, bn)[0]
    nq = np.diff(np.append(np.arange(0, sq, bm), sq))
    nk = np.diff(np.append(np.arange(0, sk, bn), sk))
    order = np.argsort(klo, kind="stable")
    cum = np.concatenate(([0], np.cumsum(nk[order])))
    # keys in blocks with klo <= qhi are computed for that q block
    return int(np.dot(nq, cum[np.searchsorted(klo[order], qhi, side="right")]))


def tile_flops(kern, q_pos, k_pos, causal: bool, b: int, h: int, hkv: int, d: int) -> int:
    """Flops ``forward_tile`` reports for one call with configuration ``kern``.

    4 * D per (query, key) pair inside the (query block, key block) pairs that
    the kernel computes (those not skipped), over B batches and H heads.
    """
    q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
    k_pos = np.ascontiguousarray(k_pos, dtype=np.int64)
    return 4 * d * b * h * visible_pairs(q_pos, k_pos, kern.bm, kern.bn, causal)


@functools.lru_cache(maxsize=128)
def _device_pos_cached(dev: int, data: bytes):
    import cupy

    return cupy.asarray(np.frombuffer(data, dtype=np.int64))


def _device_pos(pos: np.ndarray, dev: int):
    """Device copy of an int64 position array, cached by content and device."""
    return _device_pos_cached(dev, pos.tobytes())


@functools.lru_cache(maxsize=256)
def _plan_cached(dev: int, qb: bytes, kb: bytes, bm: int, bn: int, causal: bool):
    import cupy

    q_pos, k_pos = np.frombuffer(qb, dtype=np.int64), np.frombuffer(kb, dtype=np.int64)
    qlo, qhi = block_bounds(q_pos, bm)
    klo, khi = block_bounds(k_pos, bn)
    bounds = cupy.asarray(np.concatenate((qlo, qhi, klo, khi)).astype(np.int64))
    return bounds, visible_pairs(q_pos, k_pos, bm, bn, causal)


def _plan(q_pos: np.ndarray, k_pos: np.ndarray, kern: configs.Config, causal: bool, dev: int):
    """(device block bounds, visible pairs) for a tile call, cached by content."""
    return _plan_cached(dev, q_pos.tobytes(), k_pos.tobytes(), kern.bm, kern.bn, causal)


@functools.cache
def _function(kern: configs.Config, dev: int):
    fn = loader.get_function(KERNEL_FILE, kern.expr, kernel_names())
    if kern.smem > 48 * 1024:  # opt in to more than the default 48 KiB
        fn.max_dynamic_shared_size_bytes = kern.smem
    return fn


def _rows16(x, ld: int):
    """Contiguous, 16-byte aligned copy of ``x`` with rows zero-padded to ``ld`` (if needed)."""
    import cupy

    if x.shape[-1] != ld:
        out = cupy.zeros(x.shape[:-1] + (ld,), dtype=x.dtype)
        out[..., : x.shape[-1]] = x
        return out
    if not x.flags.c_contiguous or x.data.ptr % 16:
        return x.copy()  # CuPy allocations are 256-byte aligned
    return x


def _check_state(name, x, shape, dtype) -> None:
    if tuple(x.shape) != tuple(shape) or x.dtype != dtype or not x.flags.c_contiguous:
        raise ValueError(
            f"GPU tile: {name} must be a C-contiguous {dtype} array of shape {tuple(shape)}, "
            f"got {x.dtype} {tuple(x.shape)}"
        )


def forward_tile(
    q,
    k,
    v,
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    acc,
    m,
    l,
    *,
    scale: float,
    causal: bool,
    progress: Optional[Callable[[], None]] = None,
) -> int:
    """Fold one K/V block into the online-softmax state on the GPU, in place.

    Parameters
    ----------
    q : cupy.ndarray (B, H, Sq, D)
    k, v : cupy.ndarray (B, Hkv, Sk, D), same dtype as q
    q_pos : numpy.ndarray (Sq,) int64 ; k_pos : numpy.ndarray (Sk,) int64
        Global token positions.
    acc : cupy.ndarray (B, H, Sq, D) ; m, l : cupy.ndarray (B, H, Sq)
        State in :func:`acc_dtype`, C-contiguous, updated in place.
    scale : float
    causal : bool
    progress : callable, optional
        If given, called repeatedly until the kernel has finished (so MPI can
        progress a pending exchange); forward_tile then returns after the
        kernel. Without it the launch is asynchronous on the current stream.

    Returns
    -------
    int
        4 * pairs * D * B * H over the (query block, key block) pairs that
        were not skipped.
    """
    import cupy

    bsz, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if k.shape != (bsz, hkv, sk, d) or v.shape != k.shape or hkv == 0 or h % hkv:
        raise ValueError(f"GPU tile: q {q.shape} does not match k {k.shape} / v {v.shape}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"GPU tile: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if len(q_pos) != sq or len(k_pos) != sk:
        raise ValueError("GPU tile: q_pos/k_pos lengths do not match Sq/Sk")
    adt = acc_dtype(q.dtype)
    _check_state("acc", acc, q.shape, adt)
    _check_state("m", m, q.shape[:3], adt)
    _check_state("l", l, q.shape[:3], adt)
    if sq == 0 or sk == 0 or bsz == 0 or h == 0:
        return 0
    dev = device.current()
    device.check_arch(dev)
    kern = _select(_storage(q.dtype), d, device.smem_optin(dev))
    if kern.mma:
        ld = -(-d // 8) * 8  # 16-byte rows for cp.async
        q, k, v = _rows16(q, ld), _rows16(k, ld), _rows16(v, ld)
    else:
        ld = d
        q, k, v = (cupy.ascontiguousarray(x) for x in (q, k, v))
    q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
    k_pos = np.ascontiguousarray(k_pos, dtype=np.int64)
    bounds, pairs = _plan(q_pos, k_pos, kern, bool(causal), dev)
    fscale = np.float64(scale) if adt == np.float64 else np.float32(scale)
    args = (q, k, v, acc, m, l, _device_pos(q_pos, dev), _device_pos(k_pos, dev), bounds)
    args += tuple(np.int32(x) for x in (h, hkv, sq, sk, d, ld)) + (fscale, np.int32(causal))
    grid = (-(-sq // kern.bm), h, bsz)
    _function(kern, dev)(grid, (kern.threads,), args, shared_mem=kern.smem)
    if progress is not None:
        done = cupy.cuda.Event(block=False, disable_timing=True)
        done.record()
        progress()
        while not done.done:
            progress()
    return 4 * pairs * d * bsz * h
