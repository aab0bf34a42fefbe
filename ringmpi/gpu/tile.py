"""GPU tile backend: CuPy + the CUDA kernels in kernels/attention_fwd.cu.

``forward_tile`` has the signature and semantics of :func:`ringmpi.cpu.numpy_tile.forward_tile`
(the specification) for CuPy arrays in the internal head-major layout:

    q     (B, H,   Sq, D)   float16, bfloat16, float32 or float64
    k, v  (B, Hkv, Sk, D)   same dtype; query head h reads K/V head h // (H // Hkv)
    q_pos (Sq,), k_pos (Sk,)  numpy int64 global positions
    acc   (B, H, Sq, D), m, l (B, H, Sq)   CuPy, float32 (float64 for float64 inputs)
    bounds = (lo, hi), optional: numpy int64 arrays (Sq,); query i sees key j iff
          lo[i] <= k_pos[j] <= hi[i] (lo[i] > hi[i]: no key). Windows, packed
          sequences and cross-attention arrive this way (:meth:`ringmpi.mask.Mask.bounds`);
          when given, ``causal`` is ignored. Without it: causal (k_pos[j] <= q_pos[i])
          or every key.

A (query block, key block) pair that no row of the block can see is skipped;
one that every row sees entirely runs without a per-element mask; the others
are masked per element (:mod:`ringmpi.gpu.plan`). A row that sees no key keeps
m = -inf, l = 0 and its acc (never NaN).

bfloat16: CuPy arrays of dtype ``bfloat16`` (where CuPy has it) or ``uint16``
arrays holding the bfloat16 bit patterns (:func:`to_bf16_bits` makes them) both
run the bf16 kernel. fp16/bf16 with D <= 128 run on tensor cores
(mma.sync m16n8k16, fp32 accumulation); wider heads and fp32/fp64 run the
CUDA-core kernel. Any D <= 256 works.

Configurations (:mod:`ringmpi.gpu.configs`): the tensor-core tiles come as
``m128n64``/``m128n32`` (128 query rows per CTA, GQA heads packed, heaviest
causal blocks first) and ``m64n64`` (the first kernel: 64 rows, no packing);
the CUDA-core tile in several ``simt<BM>x<BN>`` sizes. Only those that fit
the device's opt-in shared memory per block are considered; among them the
autotuner (:mod:`ringmpi.gpu.tune`) times each at first use and keeps the
fastest; ``RINGMPI_GPU_CONFIG=<name>`` forces one.

CuPy is imported lazily: importing this module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Optional

import numpy as np

from .. import scoremods
from . import configs, device, kernel_args, loader, tune
from .kernel_args import acc_dtype, to_bf16_bits
from .sources import FORWARD_FILE

__all__ = [
    "CONFIG_ENV",
    "KERNEL_FILE",
    "kernel_names",
    "forward_tile",
    "chosen",
]

KERNEL_FILE = FORWARD_FILE
CONFIG_ENV = "RINGMPI_GPU_CONFIG"  # force one configuration by name (configs.Config.name)
MAX_D = configs.MAX_D

# the launch code's names for the shared helpers of ringmpi.gpu.kernel_args
_check_state = kernel_args.check_state
_rows = kernel_args.checked_rows
_plan = kernel_args.device_plan
_device_pos = kernel_args.device_pos
_device_rows = kernel_args.device_rows
_rows16 = kernel_args.padded_rows
_storage = kernel_args.storage


def kernel_names() -> tuple:
    """Every forward template instantiation the backend may launch (NVRTC name expressions)."""
    return configs.forward_names()


# ----------------------------------------------------------------------------
# device-side plan and kernels, cached
# ----------------------------------------------------------------------------
@functools.cache
def _function(kern: configs.Config, dev: int):
    fn = loader.get_function(KERNEL_FILE, kern.expr, kernel_names())
    if kern.total > 48 * 1024:  # opt in: dynamic and static over the default 48 KiB
        fn.max_dynamic_shared_size_bytes = kern.smem
    return fn


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
    bounds: Optional[tuple] = None,
    **modifiers,
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
        Key j visible to query i iff k_pos[j] <= q_pos[i] (ignored with ``bounds``).
    progress : callable, optional
        If given, called repeatedly until the kernel has finished (so MPI can
        progress a pending exchange); forward_tile then returns after the
        kernel. Without it the launch is asynchronous on the current stream.
    bounds : (lo, hi), optional
        numpy int64 arrays (Sq,): query i sees key j iff lo[i] <= k_pos[j] <= hi[i]
        (lo[i] > hi[i]: no key; the row keeps m = -inf and l = 0).
    **modifiers
        The tiles' score modifier keywords (:mod:`ringmpi.tile`, e.g. ``softcap=c``,
        ``alibi=(slopes (H,), qa (Sq,))``), checked and packed by
        :func:`ringmpi.scoremods.pack` (ValueError for a bad value, TypeError for an
        unknown keyword); the kernels apply them before the mask.

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
    rows = _rows(bounds, q_pos)
    mods = scoremods.pack(modifiers, h, sq)  # the same checks as every tile's
    adt = acc_dtype(q.dtype)
    _check_state("acc", acc, q.shape, adt)
    _check_state("m", m, q.shape[:3], adt)
    _check_state("l", l, q.shape[:3], adt)
    if sq == 0 or sk == 0 or bsz == 0 or h == 0:
        return 0
    dev = device.current()
    kern = chosen(_storage(q.dtype), d, bool(causal), dev)
    flops = _launch(kern, q, k, v, q_pos, k_pos, acc, m, l, scale, bool(causal), dev, rows, mods)
    if progress is not None:
        done = cupy.cuda.Event(block=False, disable_timing=True)
        done.record()
        progress()
        while not done.done:
            progress()
    return flops


def _launch(
    kern, q, k, v, q_pos, k_pos, acc, m, l, scale, causal, dev, rows=None, mods=None
) -> int:
    """Enqueue configuration ``kern`` on the current stream; return the flops it computes.

    ``rows``: the (lo, hi) per-row bounds from :func:`_rows`, or None. ``mods``: the
    :class:`ringmpi.scoremods.TileMods` of the call, or None.
    """
    import cupy

    bsz, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if kern.mma:
        ld = -(-d // 8) * 8  # 16-byte rows for cp.async
        q, k, v = _rows16(q, ld), _rows16(k, ld), _rows16(v, ld)
    else:
        ld = d
        q, k, v = (cupy.ascontiguousarray(x) for x in (q, k, v))
    q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
    k_pos = np.ascontiguousarray(k_pos, dtype=np.int64)
    g = h // hkv
    env, order, pairs = _plan(q_pos, k_pos, kern, g, causal, dev, rows)
    pos = (_device_pos(q_pos, dev), _device_pos(k_pos, dev))
    ints = tuple(np.int32(x) for x in (h, hkv, sq, sk, d, ld))
    row_lo, row_hi = _device_rows(rows, dev)
    if kern.packed:  # 1-D grid over (q block in order, batch, K/V head)
        args = (q, k, v, acc, m, l, *pos, env, row_lo, row_hi, order, np.int32(bsz), *ints)
        args += (np.float32(scale), np.int32(causal))
        grid = (len(order) * bsz * hkv,)
        flops = 4 * pairs * d * bsz * hkv
    else:
        fscale = np.float64(scale) if acc.dtype == np.float64 else np.float32(scale)
        args = (q, k, v, acc, m, l, *pos, env, row_lo, row_hi, *ints, fscale, np.int32(causal))
        grid = (-(-sq // kern.bm), h, bsz)
        flops = 4 * pairs * d * bsz * h
    args += kernel_args.modifier_args(mods, dev)  # mods, mparam, mpos: always last
    _function(kern, dev)(grid, (kern.threads,), args, shared_mem=kern.smem)
    return flops


# shape class the autotuner times: B = 1, 8 query heads on 4 K/V heads, 2048 tokens
TUNE_SHAPE = (1, 8, 4, 2048)


def chosen(storage: str, d: int, causal: bool, dev: int) -> configs.Config:
    """The forward configuration for (storage, D, causal) on device ``dev``.

    ``RINGMPI_GPU_CONFIG`` if set; else the only one that fits the device's
    shared memory; else the autotuned fastest (timed at first use, cached per
    device name, dtype, D and causal: :mod:`ringmpi.gpu.tune`).
    """
    device.check_arch(dev)
    limit = device.smem_optin(dev)
    forced = os.environ.get(CONFIG_ENV, "").strip()
    if forced:
        return configs.select_forward(storage, d, limit, forced)
    cands = configs.forward_candidates(storage, d, limit)
    if len(cands) <= 1:
        return configs.select_forward(storage, d, limit)  # the one, or a clear error
    by_name = {c.name: c for c in cands}
    k = tune.key(device.name(dev), storage, d, causal)
    best = tune.choose(k, list(by_name), lambda n: _time_config(by_name[n], d, causal, dev))
    return by_name[best]


def _time_config(kern: configs.Config, d: int, causal: bool, dev: int, reps: int = 5) -> float:
    """Seconds per call of ``kern`` on the tuning shape (best of ``reps`` after a warm-up)."""
    import cupy

    from .. import softmax

    b, h, hkv, n = TUNE_SHAPE
    storage = kern.expr.split("<")[1].split(",")[0]
    dtype = {"half_t": np.float16, "bf16_t": np.uint16, "float": np.float32}.get(storage)
    dtype = np.float64 if storage == "double" else dtype
    rs = cupy.random.RandomState(1)
    xs = [rs.standard_normal(s, dtype=cupy.float32) for s in ((b, h, n, d), (b, hkv, n, d))]
    xs.append(rs.standard_normal((b, hkv, n, d), dtype=cupy.float32))
    xs = [to_bf16_bits(x) if dtype == np.uint16 else x.astype(dtype) for x in xs]
    acc, m, l = softmax.init_state(xs[0].shape, acc_dtype(dtype), cupy)
    pos = np.arange(n, dtype=np.int64)
    scale = 1.0 / np.sqrt(d)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    best = float("inf")
    for i in range(reps + 1):
        start.record()
        _launch(kern, *xs, pos, pos, acc, m, l, scale, causal, dev)
        stop.record()
        stop.synchronize()
        if i:  # the first call compiles and warms up
            best = min(best, cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return best
