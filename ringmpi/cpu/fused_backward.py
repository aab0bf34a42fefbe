"""Fused CPU backward tile: a C kernel compiled on first use, same semantics as the numpy tile.

The kernel (``kernels/cpu_backward.c``) recomputes the probabilities of a (query block, K/V
block) pair and forms all five products of the attention backward pass in one pass over
cache-sized blocks (FlashAttention-2's order: key blocks outside, their dK/dV accumulators
in cache while the query strips stream past), so no (Sq, Sk) array is formed and exp runs as
a vector polynomial. It is compiled and cached like the forward tile
(:func:`ringmpi.cpu.build.build_library`: same compiler, flags including ``$RINGMPI_CFLAGS``,
and cache key scheme).

:func:`backward_tile` has the signature of :func:`ringmpi.cpu.numpy_tile.backward_tile` (the
specification) and falls back to it when the kernel is unavailable or the accumulators are
not float32/float64 C-contiguous arrays. Masks beyond causal (windows, packed sequences,
cross-attention: per-row key ranges ``bounds=(lo, hi)``, see :mod:`ringmpi.mask`) run in the
kernel too: block pairs outside every row's range are skipped, per-element tests only where
a block pair is partly visible.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np

from .. import scoremods
from . import numpy_tile as _spec
from .loader import (
    PROGRESS,
    Library,
    Loader,
    check_bounds,
    check_mods,
    cuts,
    mod_arrays,
    progress_callback,
    ptr,
)

__all__ = [
    "available",
    "unavailable_reason",
    "library_path",
    "simd_width",
    "backward_tile",
    "backward_tile_with",
    "open_library",
    "BackwardKernel",
    "LOADER",
    "spec_flops",
    "BLOCK_Q",
    "BLOCK_K",
    "CHUNK_PAIRS",
    "WIDTHS_MISSING",
]

#: why this backward tile refuses keys and values of different widths (Dk != Dv, issue 42);
#: "": it takes them (``Backend.supports`` names a non-empty reason)
WIDTHS_MISSING = ""

#: query rows per block (rounded up to whole register strips): the reduction length of the
#: dK/dV products; the block's P and dS (BLOCK_Q x BLOCK_K) stay in L2
BLOCK_Q = 96
#: keys per block up to D = 128 (scaled by 128/D above, at least 32; rounded up to whole
#: panels): the block's packed K^T, V^T, K and its dK, dV accumulators (5 x BLOCK_K x D
#: elements) stay in L2 while the query blocks stream past. Measured (CPU time, N=4096,
#: 1 thread, AVX-512): 256 keys vs 128 +2-4% at D=64; at D=128 256 vs 64 keys +15%.
BLOCK_K = 256
#: the kernel calls ``progress`` after every this many (query row, key) pairs of single
#: heads (about 0.7 GFLOP at D = 64)
CHUNK_PAIRS = 1 << 20


class BackwardKernel(Library):
    """The fused backward tile compiled for one ISA path (``LOADER.load(isa)``, a Library)."""

    SOURCE = "cpu_backward.c"
    ISA_SYMBOL = "rm_backward_isa_name"
    WIDTH_SYMBOL = "rm_backward_simd_width_bytes"

    def declare(self, lib: ctypes.CDLL) -> None:
        """Declare ``rm_backward_tile_f32/_f64`` (positional arguments) on ``lib``.

        Sets ``lib.ringmpi_mods`` (the build's score-modifier slots, :attr:`mods`) and
        ``lib.ringmpi_plain`` (the trailing arguments of a call without modifiers).
        """
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        # The modifier arguments (mods, mparam, mpos) come last. Builds from before the
        # modifier seam end in three others, builds from before the score modifiers
        # (benchmarks/kernel_ab.py's baselines) in none: both run plain calls only.
        self.mods, tail, plain = 0, [], ()
        if hasattr(lib, "rm_backward_mods"):
            lib.rm_backward_mods.restype = ctypes.c_uint
            self.mods = int(lib.rm_backward_mods())
            tail, plain = [ctypes.c_uint, p, p], (0, None, None)
        elif hasattr(lib, "rm_backward_modifiers"):
            tail, plain = [ctypes.c_double, p, p], (0.0, None, None)
        # A build that takes the value width Dv (issue 42) has it as the last argument.
        self.widths = hasattr(lib, "rm_backward_widths") and bool(tail)
        if self.widths:
            tail = tail + [i64]
        for sfx in ("f32", "f64"):
            fn = getattr(lib, f"rm_backward_tile_{sfx}")
            fn.restype = i64
            fn.argtypes = [p] * 11 + [i64] * 6 + [p, i64, p, i64, p, p, ctypes.c_double]
            fn.argtypes += [ctypes.c_int, i64, i64, PROGRESS, i64] + tail
        lib.ringmpi_mods, lib.ringmpi_plain = self.mods, plain
        lib.ringmpi_widths = self.widths


#: the builds of the backward tile per ISA path and the default one (no stderr line of its
#: own: the forward tile's loader already says when the kernels fall back)
LOADER = Loader(BackwardKernel, "fused backward tile", warn=False)


def open_library(path: Path) -> ctypes.CDLL:
    """Load a build of ``kernels/cpu_backward.c`` and declare its entry points.

    :func:`backward_tile` uses the build of ``$RINGMPI_CPU_ISA`` (:data:`LOADER`); other
    builds (another ISA, forced by ``$RINGMPI_CFLAGS``, another revision's source) can be
    loaded side by side and called through :func:`backward_tile_with`.

    Parameters
    ----------
    path : pathlib.Path
        A library returned by :func:`ringmpi.cpu.build.build_library`.
    """
    return BackwardKernel(path)._lib


def available() -> bool:
    """True when the fused backward kernel is (or can be) compiled and loaded on this host."""
    return LOADER.default() is not None


def unavailable_reason() -> Optional[str]:
    """Why :func:`available` is False (None when it is True)."""
    return LOADER.error()


def library_path() -> Optional[Path]:
    """Path of the loaded shared library, or None."""
    kern = LOADER.default()
    return kern.path if kern is not None else None


def simd_width() -> int:
    """Vector width the kernel was built for, in bytes (64 AVX-512, 32 AVX2, 0 scalar)."""
    kern = LOADER.default()
    return kern.simd_width if kern is not None else 0


def spec_flops(
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    *,
    causal: bool,
    batch: int,
    heads: int,
    d: int,
    bounds: Optional[tuple] = None,
    dv: Optional[int] = None,
) -> int:
    """Flops the numpy tile reports for these positions: 10 * nq * nk * D per live block pair
    (2 * nq * nk * (3 Dk + 2 Dv) with values of another width).

    Uses the numpy tile's own blocks (``ringmpi.cpu.numpy_tile`` BLOCK_Q query rows, and
    BLOCK_K keys or fewer under ``bounds``, inside runs of evenly spaced positions) and its
    skipping rule, vectorised, so backends report identical work.

    Parameters
    ----------
    q_pos : (Sq,) ; k_pos : (Sk,)
        int64 global token positions.
    causal : bool
    batch, heads, d : int
        B, query heads H and head dimension D (the key width).
    bounds : ((Sq,), (Sq,)) int64, optional
        Per-row visible key ranges (they replace ``causal``, as in the numpy tile).
    dv : int, optional
        The value width, default ``d``.

    Returns
    -------
    int
    """
    qb = np.array(list(_spec.blocks(q_pos, _spec.BLOCK_Q)), dtype=np.int64).reshape(-1, 4)
    kb = np.array(list(_spec.blocks(k_pos, _spec.key_block(bounds))), dtype=np.int64)
    kb = kb.reshape(-1, 4)
    nq, nk = qb[:, 1] - qb[:, 0], kb[:, 1] - kb[:, 0]
    if len(nq) == 0 or len(nk) == 0:
        return 0
    if bounds is not None:
        # a key block is skipped when every row's range ends before it or starts after it
        lo_min = np.minimum.reduceat(np.asarray(bounds[0], dtype=np.int64), qb[:, 0])
        hi_max = np.maximum.reduceat(np.asarray(bounds[1], dtype=np.int64), qb[:, 0])
        live = np.empty(len(nq), dtype=np.int64)
        step = max(1, (1 << 22) // len(nk))  # query blocks per pass: bounded temporaries
        for a in range(0, len(nq), step):
            hit = (hi_max[a : a + step, None] >= kb[None, :, 2]) & (
                lo_min[a : a + step, None] <= kb[None, :, 3]
            )
            live[a : a + step] = hit.astype(np.int64) @ nk
    elif causal:
        # keys of the blocks whose smallest position is <= the query block's largest
        order = np.argsort(kb[:, 2], kind="stable")
        csum = np.concatenate([[0], np.cumsum(nk[order])])
        live = csum[np.searchsorted(kb[order, 2], qb[:, 3], side="right")]
    else:
        live = np.full(len(nq), nk.sum())
    per = 10 * d if dv is None or dv == d else 2 * (3 * d + 2 * dv)
    return int(batch * heads * per * int(np.dot(nq, live)))


def backward_tile(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    dout: np.ndarray,
    lse: np.ndarray,
    delta: np.ndarray,
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    dq: np.ndarray,
    dk: np.ndarray,
    dv: np.ndarray,
    *,
    scale: float,
    causal: bool,
    progress: Optional[Callable[[], None]] = None,
    bounds: Optional[tuple] = None,
    **modifiers,
) -> int:
    """Add the gradients from one (query block, K/V block) pair, in place (fused C kernel).

    Same contract as :func:`ringmpi.cpu.numpy_tile.backward_tile`; falls back to it when the kernel
    is unavailable or dq, dk, dv are not float32/float64 C-contiguous arrays of one dtype.
    Inputs of another dtype or layout are converted to the accumulators' dtype first.

    Parameters
    ----------
    q, dout : (B, H, Sq, D)
        Queries and the upstream gradient of the output.
    k, v : (B, Hkv, Sk, D)
        The visiting keys and values; query head h reads K/V head h // (H/Hkv).
    lse : (B, H, Sq)
        Log-sum-exp of the scores over all keys; -inf marks a row with no visible key, which
        gets no gradient.
    delta : (B, H, Sq)
        Row sums of dout * out.
    q_pos : (Sq,) ; k_pos : (Sk,)
        int64 global token positions.
    dq : (B, H, Sq, D) ; dk, dv : (B, Hkv, Sk, D)
        Accumulators, updated in place (dk and dv sum over the query heads of each group).
    scale : float
    causal : bool
        Key j is visible to query i iff k_pos[j] <= q_pos[i]; block pairs with no visible
        key are skipped.
    progress : callable, optional
        Called from inside the kernel after every ``CHUNK_PAIRS`` (query row, key) pairs of
        single heads, and once at the end; an exception it raises stops the kernel and
        propagates (the accumulators are then partly updated).

    bounds : ((Sq,), (Sq,)) int64, optional
        Masks beyond causal: key j is visible to query i iff lo[i] <= k_pos[j] <= hi[i]
        (global key positions; lo > hi: no visible key). They replace ``causal``, which
        :meth:`ringmpi.mask.Mask.bounds` folds in.
    **modifiers
        The score modifiers, as the tile keywords of :mod:`ringmpi.backend` (packed by
        :func:`ringmpi.scoremods.pack`: ValueError for bad values, TypeError for unknown
        keywords); dS gains the product of their derivatives d s'/d s.

    Returns
    -------
    int
        The numpy tile's flop count for the same call (:func:`spec_flops`: 10 * nq * nk * D
        per head and block pair the numpy tile computes). The kernel's own blocks are finer,
        so it skips more of a masked tile than that count says.
    """
    kern = LOADER.default()
    return backward_tile_with(
        kern,
        q,
        k,
        v,
        dout,
        lse,
        delta,
        q_pos,
        k_pos,
        dq,
        dk,
        dv,
        scale=scale,
        causal=causal,
        progress=progress,
        bounds=bounds,
        **modifiers,
    )


def backward_tile_with(
    lib: Union[ctypes.CDLL, BackwardKernel, None],
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    dout: np.ndarray,
    lse: np.ndarray,
    delta: np.ndarray,
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    dq: np.ndarray,
    dk: np.ndarray,
    dv: np.ndarray,
    *,
    scale: float,
    causal: bool,
    progress: Optional[Callable[[], None]] = None,
    bounds: Optional[tuple] = None,
    count: str = "spec",
    **modifiers,
) -> int:
    """:func:`backward_tile` with an explicit library (:func:`open_library`, or a
    :class:`BackwardKernel`); None: the numpy tile.

    ``count="kernel"`` returns the kernel's own flops instead of the numpy tile's
    (:func:`spec_flops`): 10 * nq * nk * D per head over the kernel's block pairs that hold a
    visible pair, which shows how much of a masked tile it skipped.
    """
    if isinstance(lib, BackwardKernel):
        lib = lib._lib
    if count not in ("spec", "kernel"):
        raise ValueError(f"count must be 'spec' or 'kernel', got {count!r}")
    dt = dq.dtype
    ok = (
        lib is not None
        and dt in (np.float32, np.float64)
        and all(a.dtype == dt and a.flags.c_contiguous for a in (dq, dk, dv))
    )
    if not ok:
        return _spec.backward_tile(
            q,
            k,
            v,
            dout,
            lse,
            delta,
            q_pos,
            k_pos,
            dq,
            dk,
            dv,
            scale=scale,
            causal=causal,
            progress=progress,
            bounds=bounds,
            **modifiers,
        )
    bsz, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    dvw = v.shape[-1] if v.ndim == 4 else d  # the value width (Dv may differ from Dk = d)
    if hkv == 0 or h % hkv:
        raise ValueError(f"query heads {h} not a multiple of key/value heads {hkv}")
    if dvw != d and not getattr(lib, "ringmpi_widths", False):
        raise ValueError(f"{lib._name}: a build without value widths other than D ({dvw})")
    shapes = {
        "dout": (dout, (bsz, h, sq, dvw)),
        "v": (v, (bsz, hkv, sk, dvw)),
        "lse": (lse, (bsz, h, sq)),
        "delta": (delta, (bsz, h, sq)),
        "q_pos": (q_pos, (sq,)),
        "k_pos": (k_pos, (sk,)),
        "dq": (dq, (bsz, h, sq, d)),
        "dk": (dk, (bsz, hkv, sk, d)),
        "dv": (dv, (bsz, hkv, sk, dvw)),
    }
    if k.shape[0] != bsz or k.shape[3] != d:
        raise ValueError(f"k has shape {k.shape}, expected ({bsz}, Hkv, Sk, {d})")
    for name, (a, want) in shapes.items():
        if tuple(a.shape) != want:
            raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {want}")
    lo, hi = check_bounds(bounds, sq)  # (None, None) without bounds
    mods = scoremods.pack(modifiers, h, sq)  # ValueError / TypeError: bad modifiers
    check_mods(mods, lib.ringmpi_mods, lib._name)
    bits, mparam, mpos = mod_arrays(mods, h, sq)
    tail = (bits, ptr(mparam), ptr(mpos)) if bits else lib.ringmpi_plain
    if lib.ringmpi_widths:
        tail = (*tail, dvw)
    if sq == 0 or sk == 0 or bsz == 0 or d == 0:
        return 0
    q, k, v, dout, lse, delta = (
        np.ascontiguousarray(a, dtype=dt) for a in (q, k, v, dout, lse, delta)
    )
    q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
    k_pos = np.ascontiguousarray(k_pos, dtype=np.int64)
    qc, kc = cuts(q_pos), cuts(k_pos)
    fn = lib.rm_backward_tile_f32 if dt == np.float32 else lib.rm_backward_tile_f64
    # keys per block (of the mean width (Dk + Dv) / 2 where keys and values differ)
    bk = int(max(32, min(BLOCK_K, (BLOCK_K * 128) // ((d + dvw) // 2))))
    cb, errors = progress_callback(progress)
    f = fn(
        ptr(q),
        ptr(k),
        ptr(v),
        ptr(dout),
        ptr(lse),
        ptr(delta),
        ptr(q_pos),
        ptr(k_pos),
        ptr(dq),
        ptr(dk),
        ptr(dv),
        bsz,
        h,
        hkv,
        sq,
        sk,
        d,
        ptr(qc),
        len(qc),
        ptr(kc),
        len(kc),
        ptr(lo),
        ptr(hi),
        float(scale),
        int(bool(causal)),
        BLOCK_Q,
        bk,
        cb,
        CHUNK_PAIRS,
        *tail,
    )
    if errors:
        raise errors[0]
    if f < 0:
        raise MemoryError("fused backward tile: out of memory for its work buffers")
    if progress is not None:
        progress()
    if count == "kernel":
        return int(f)
    masked = None if bounds is None else (lo, hi)
    return spec_flops(q_pos, k_pos, causal=causal, batch=bsz, heads=h, d=d, bounds=masked, dv=dvw)
