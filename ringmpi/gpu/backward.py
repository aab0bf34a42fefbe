"""GPU backward tile: CuPy + the CUDA kernels in kernels/attention_bwd.cu.

``backward_tile`` has the signature and semantics of
:func:`ringmpi.cpu.numpy_tile.backward_tile` (the specification; see the tile
contract in :mod:`ringmpi.tile`) for CuPy arrays in the head-major layout:

    q, dout (B, H, Sq, D)     any float dtype; rounded to k's dtype for the kernels
    k, v    (B, Hkv, Sk, D)   float16, bfloat16 (bits in uint16), float32 or float64
    lse, delta (B, H, Sq)     accumulation dtype (float32; float64 for float64 k)
    dq (B, H, Sq, D), dk, dv (B, Hkv, Sk, D)   accumulation dtype, C-contiguous, +=
    bounds = (lo, hi), optional: numpy int64 arrays (Sq,); query i sees key j iff
          lo[i] <= k_pos[j] <= hi[i] (lo[i] > hi[i]: no key, and lse[i] = -inf).
          When given, ``causal`` is ignored; without it: causal or every key.
    **modifiers: the score modifier keywords of :mod:`ringmpi.tile` (``softcap``,
          ``alibi``, ...), as in the forward (:func:`ringmpi.gpu.tile.forward_tile`); dS
          goes through their derivative (:mod:`ringmpi.scoremods`).

A (query block, key block) pair no row of the block sees is skipped in both
kernels; elements outside a row's [lo, hi] get P = 0 and so no gradient; a row
with lse = -inf contributes nothing (never NaN).

Two kernels run one after the other on the current stream: dK/dV (a CTA per
key block, looping over the query blocks of every query head that shares the
K/V head, so the GQA sum needs no atomics) and dQ (a CTA per query block,
looping over the key blocks). fp16/bf16 with D <= 128 run on tensor cores
(mma.sync m16n8k16, fp32 accumulation; P and dS rounded to 16 bits before
their products, as FlashAttention-2 does); fp32, fp64 and wider heads run on
the CUDA cores in the accumulation type. The backward ring passes q and dout
in the accumulation dtype; for 16-bit k they round back exactly when they came
from 16-bit inputs.

CuPy is imported lazily: importing this module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import numpy as np

from .. import scoremods
from . import configs, device, kernel_args, loader
from .kernel_args import acc_dtype, to_bf16_bits
from .sources import BACKWARD_FILES

__all__ = ["KERNEL_FILES", "kernel_names", "chosen", "backward_tile"]

KERNEL_FILES = BACKWARD_FILES  # its own module (shared code: kernels/attention_common.cuh)

# the launch code's names for the shared helpers of ringmpi.gpu.kernel_args
_check_state = kernel_args.check_state
_rows = kernel_args.checked_rows
_plan = kernel_args.device_plan
_device_pos = kernel_args.device_pos
_device_rows = kernel_args.device_rows
_rows16 = kernel_args.padded_rows
_storage = kernel_args.storage


def kernel_names() -> tuple:
    """Every backward template instantiation the backend may launch (NVRTC name expressions)."""
    return configs.backward_names()


def chosen(storage: str, d: int, dev: int) -> tuple:
    """(dK/dV, dQ) configurations for (storage, D) on device ``dev`` (the first that fit)."""
    device.check_arch(dev)
    return configs.select_backward(storage, d, device.smem_optin(dev))


@functools.cache
def _function(kern: configs.Config, dev: int):
    fn = loader.get_function(KERNEL_FILES, kern.expr, kernel_names())
    if kern.total > 48 * 1024:  # opt in: dynamic and static over the default 48 KiB
        fn.max_dynamic_shared_size_bytes = kern.smem
    return fn


def _as(x, dtype):
    """``x`` in the kernels' storage dtype (bfloat16 bits for uint16), C-contiguous."""
    import cupy

    if x.dtype == dtype:
        return cupy.ascontiguousarray(x)
    if np.dtype(dtype) == np.uint16:  # bfloat16 bit patterns
        return to_bf16_bits(x)
    return cupy.ascontiguousarray(x, dtype=dtype)


def backward_flops(
    kern_dq, q_pos, k_pos, causal: bool, b: int, h: int, d: int, bounds: Optional[tuple] = None
) -> int:
    """Flops ``backward_tile`` reports: 10 * D per pair in the dQ kernel's computed blocks."""
    from .plan import host_plan

    if len(q_pos) == 0 or len(k_pos) == 0:
        return 0
    pairs = host_plan(q_pos, k_pos, kern_dq.bm, kern_dq.bn, 1, causal, bounds)[2]
    return 10 * d * b * h * pairs


def backward_tile(
    q,
    k,
    v,
    dout,
    lse,
    delta,
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    dq,
    dk,
    dv,
    *,
    scale: float,
    causal: bool,
    progress: Optional[Callable[[], None]] = None,
    bounds: Optional[tuple] = None,
    **modifiers,
) -> int:
    """Add one K/V block's gradient contributions on the GPU, in place.

    Parameters
    ----------
    q, dout : cupy.ndarray (B, H, Sq, D)
    k, v : cupy.ndarray (B, Hkv, Sk, D), one dtype
    lse, delta : cupy.ndarray (B, H, Sq)
        Saved log-sum-exp (-inf: the row saw no key) and delta = sum(dout * out, -1).
    q_pos : numpy.ndarray (Sq,) int64 ; k_pos : numpy.ndarray (Sk,) int64
    dq : cupy.ndarray (B, H, Sq, D) ; dk, dv : cupy.ndarray (B, Hkv, Sk, D)
        Accumulators in :func:`ringmpi.gpu.tile.acc_dtype` of k's dtype, C-contiguous.
    scale : float
    causal : bool
        Key j visible to query i iff k_pos[j] <= q_pos[i] (ignored with ``bounds``).
    progress : callable, optional
        If given, called repeatedly until the kernels have finished (so MPI can
        progress a pending exchange); without it the launches are asynchronous.
    bounds : (lo, hi), optional
        numpy int64 arrays (Sq,): query i sees key j iff lo[i] <= k_pos[j] <= hi[i].
    **modifiers
        The tiles' score modifier keywords (:mod:`ringmpi.tile`, e.g. ``softcap=c``,
        ``alibi=(slopes (H,), qa (Sq,))``), checked and packed by
        :func:`ringmpi.scoremods.pack` as in the forward; dS is multiplied by their
        derivative d s'/d s (softcap: 1 - tanh^2; ALiBi: 1).

    Returns
    -------
    int
        10 * pairs * D * B * H over the (query block, key block) pairs of the
        dQ kernel that were not skipped.
    """
    import cupy

    bsz, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if k.shape != (bsz, hkv, sk, d) or v.shape != k.shape or hkv == 0 or h % hkv:
        raise ValueError(f"GPU backward tile: q {q.shape} does not match k {k.shape} / v {v.shape}")
    if dout.shape != q.shape:
        raise ValueError(f"GPU backward tile: dout {dout.shape} does not match q {q.shape}")
    if v.dtype != k.dtype:
        raise TypeError(f"GPU backward tile: k and v dtypes differ ({k.dtype}, {v.dtype})")
    if len(q_pos) != sq or len(k_pos) != sk:
        raise ValueError("GPU backward tile: q_pos/k_pos lengths do not match Sq/Sk")
    rows = _rows(bounds, q_pos)
    mods = scoremods.pack(modifiers, h, sq)  # the same checks as every tile's
    storage = _storage(k.dtype)
    adt = acc_dtype(k.dtype)
    for name, x, shape in (("lse", lse, q.shape[:3]), ("delta", delta, q.shape[:3])):
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"GPU backward tile: {name} has shape {x.shape}, expected {shape}")
    _check_state("dq", dq, q.shape, adt)
    _check_state("dk", dk, k.shape, adt)
    _check_state("dv", dv, k.shape, adt)
    if sq == 0 or sk == 0 or bsz == 0 or h == 0:
        return 0
    dev = device.current()
    k_dkdv, k_dq = chosen(storage, d, dev)
    q, dout = _as(q, k.dtype), _as(dout, k.dtype)
    lse = cupy.ascontiguousarray(lse, dtype=adt)
    delta = cupy.ascontiguousarray(delta, dtype=adt)
    if k_dq.mma:
        ld = -(-d // 8) * 8  # 16-byte rows for cp.async and ldmatrix
        q, k, v, dout = (_rows16(x, ld) for x in (q, k, v, dout))
    else:
        ld = d
        k, v = cupy.ascontiguousarray(k), cupy.ascontiguousarray(v)
    q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
    k_pos = np.ascontiguousarray(k_pos, dtype=np.int64)
    pos = (_device_pos(q_pos, dev), _device_pos(k_pos, dev))
    row_lo, row_hi = _device_rows(rows, dev)
    fscale = np.float64(scale) if adt == np.float64 else np.float32(scale)
    tail = tuple(np.int32(x) for x in (h, hkv, sq, sk, d, ld)) + (fscale, np.int32(causal))
    tail += kernel_args.modifier_args(mods, dev)  # mods, mparam, mpos

    env, _, _ = _plan(q_pos, k_pos, k_dkdv, 1, bool(causal), dev, rows)
    grid = (-(-sk // k_dkdv.bn), hkv, bsz)
    args = (q, k, v, dout, lse, delta, dk, dv, *pos, env, row_lo, row_hi, *tail)
    _function(k_dkdv, dev)(grid, (k_dkdv.threads,), args, shared_mem=k_dkdv.smem)

    env, _, pairs = _plan(q_pos, k_pos, k_dq, 1, bool(causal), dev, rows)
    grid = (-(-sq // k_dq.bm), h, bsz)
    args = (q, k, v, dout, lse, delta, dq, *pos, env, row_lo, row_hi, *tail)
    _function(k_dq, dev)(grid, (k_dq.threads,), args, shared_mem=k_dq.smem)

    if progress is not None:
        done = cupy.cuda.Event(block=False, disable_timing=True)
        done.record()
        progress()
        while not done.done:
            progress()
    return 10 * pairs * d * bsz * h
