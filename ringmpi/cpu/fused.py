"""Fused CPU tile: a C kernel compiled on first use, same semantics as ``ringmpi.cpu.numpy_tile``.

The kernel (``kernels/cpu_tile.c``) computes scores, the mask, the online
softmax and the P.V product in one pass over cache-sized blocks, so no (Sq, Sk)
array is ever formed and exp runs as a vector polynomial. It is compiled and
cached per ISA path by :mod:`ringmpi.cpu.build` (AVX-512, AVX2+FMA, scalar;
``$RINGMPI_CPU_ISA``). :func:`load` gives a :class:`Kernel` bound to any one path,
so several paths can be used (and tested) in one process; :func:`isa` names the
path the default kernel was compiled for.

If the default kernel cannot be built (no compiler, no write access, ...),
:func:`available` returns False, one line goes to stderr (once per process) and
callers use the numpy tile (:func:`ringmpi.cpu.numpy_tile.forward_tile`);
:func:`unavailable_reason` says why. Masks beyond causal (``bounds``: per-row
visible key ranges) run in the kernel too, with block and row-strip skipping.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from .. import scoremods, softmax
from . import numpy_tile
from .build import build_library
from .isa import ISAS, host_isas, l2_bytes
from .loader import (
    Library,
    Loader,
    TileArgs,
    check_bounds,
    check_mods,
    cuts,
    mod_arrays,
    progress_callback,
    ptr,
)

__all__ = [
    "ISAS",
    "Kernel",
    "available",
    "unavailable_reason",
    "forward_tile",
    "finalize",
    "library_path",
    "simd_width",
    "isa",
    "host_isas",
    "load",
    "build_library",
    "BLOCK_Q",
    "BLOCK_K",
    "CHUNK_Q",
    "LOADER",
]

#: query rows per block inside the kernel (rounded up to whole register strips). The packed
#: K/V of a head stream through L2 once per query block; 528 rows keep that traffic small
#: while the block's queries and state (2 x 528 x D elements) stay in L2. Measured on
#: AVX-512, N=8192, 1 thread: +7% (D=64) to +13% (D=128) over 64 rows (with BLOCK_K 512).
BLOCK_Q = 528

#: keys per block at D = 64 (scaled by 64/D, within [64, 512]): more keys per block amortize
#: the per-row softmax statistics; every row strip of a query block streams the block's packed
#: K and V (2 x keys x D float32) from L2, so they are sized to a quarter of L2: 512 keys on
#: 1 MiB (Zen 4, where 256 measured 0-2% slower), 256 on 512 KiB (Zen 1-3), 128 on 256 KiB
#: (Haswell to Skylake client); 512 when the L2 size is unknown
BLOCK_K = max(64, min(512, (l2_bytes() or 1 << 20) // 2048 // 64 * 64))
#: query rows per kernel call when a progress callback must run between calls
CHUNK_Q = 512


class Kernel(Library):
    """The fused tile compiled for one ISA path (see :func:`load`; attributes: :class:`Library`)."""

    SOURCE = "cpu_tile.c"
    ISA_SYMBOL = "rm_isa_name"
    WIDTH_SYMBOL = "rm_simd_width_bytes"

    def declare(self, lib: ctypes.CDLL) -> None:
        """Declare the tile's entry points; check ``rm_tile_args`` against :class:`TileArgs`."""
        lib.rm_tile_args_size.restype = ctypes.c_int64
        size = lib.rm_tile_args_size()
        # A build from before the score modifiers (benchmarks/kernel_ab.py's baseline) reads the
        # fields up to `hi` only; one from before the modifier seam has three fields of the
        # same size there, which a plain call's zeros (mods 0, NULL) leave off. Both run
        # plain calls only (mods = 0: every modifier refused).
        # A build from before keys and values of different widths (issue 42) ends at `mpos`:
        # it runs Dk == Dv only (``widths`` False).
        if size not in (ctypes.sizeof(TileArgs), TileArgs.Dv.offset, TileArgs.mods.offset):
            raise RuntimeError(f"{self.path}: rm_tile_args does not match loader.TileArgs")
        self.widths = size == ctypes.sizeof(TileArgs)
        self.mods = 0
        if size >= TileArgs.Dv.offset and hasattr(lib, "rm_tile_mods"):
            lib.rm_tile_mods.restype = ctypes.c_uint
            self.mods = int(lib.rm_tile_mods())
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        for sfx in ("f32", "f64"):
            fn = getattr(lib, f"rm_forward_tile_{sfx}")
            fn.restype = i64
            fn.argtypes = [ctypes.POINTER(TileArgs)]
            if hasattr(lib, f"rm_tanh_array_{sfx}"):
                th = getattr(lib, f"rm_tanh_array_{sfx}")
                th.restype = None
                th.argtypes = [p, p, i64]
            fin = getattr(lib, f"rm_finalize_{sfx}")
            fin.restype = None
            fin.argtypes = [p] * 3 + [i64] * 4 + [p, p, ctypes.c_int]

    def forward_tile(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        q_pos: np.ndarray,
        k_pos: np.ndarray,
        acc: np.ndarray,
        m: np.ndarray,
        l: np.ndarray,
        *,
        scale: float,
        causal: bool,
        progress: Optional[Callable[[], None]] = None,
        bounds: Optional[tuple] = None,
        **modifiers,
    ) -> int:
        """Fold one K/V block into the online-softmax state with this kernel.

        Same contract as the module's :func:`forward_tile`.
        """
        dt = q.dtype
        ok = (
            dt in (np.float32, np.float64)
            and k.dtype == dt
            and v.dtype == dt
            and all(a.dtype == dt and a.flags.c_contiguous for a in (acc, m, l))
        )
        if not ok:
            return numpy_tile.forward_tile(
                q,
                k,
                v,
                q_pos,
                k_pos,
                acc,
                m,
                l,
                scale=scale,
                causal=causal,
                progress=progress,
                bounds=bounds,
                **modifiers,
            )
        bsz, h, sq, d = q.shape
        hkv, sk = k.shape[1], k.shape[2]
        dv = v.shape[-1]  # the value width (acc has it too); d is the key width
        if h % hkv:
            raise ValueError(f"query heads {h} not a multiple of key/value heads {hkv}")
        if acc.shape[-1] != dv or k.shape[-1] != d:
            raise ValueError(f"fused tile: q, k {q.shape} {k.shape}, v {v.shape}, acc {acc.shape}")
        if dv != d and not self.widths:
            raise ValueError(f"{self.path}: a build without value widths other than D ({dv})")
        if sq == 0 or sk == 0:
            return 0
        q = np.ascontiguousarray(q)
        k = np.ascontiguousarray(k)
        v = np.ascontiguousarray(v)
        q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
        k_pos = np.ascontiguousarray(k_pos, dtype=np.int64)
        lo, hi = check_bounds(bounds, sq)
        mods = scoremods.pack(modifiers, h, sq)  # ValueError / TypeError: bad modifiers
        check_mods(mods, self.mods, self.path)
        bits, mparam, mpos = mod_arrays(mods, h, sq)
        qc, kc = cuts(q_pos), cuts(k_pos)
        fn = self._lib.rm_forward_tile_f32 if dt == np.float32 else self._lib.rm_forward_tile_f64
        # keys per block: packed K and V blocks (2 * bk * D elements) well within L2; a
        # multiple of 64 (every path's panel width), so all paths cut the same blocks
        # (of the mean width (Dk + Dv) / 2 when keys and values differ)
        dm = (d + dv) // 2
        bk = int(min(512, max(64, (BLOCK_K * 64) // max(dm, 1) // 64 * 64)))
        # The kernel packs each K/V head once and calls back every CHUNK_Q query rows of all
        # heads (the same amount of work as CHUNK_Q rows of every head); an exception raised
        # by progress stops the kernel and is re-raised here.
        cb, errors = progress_callback(progress)
        args = TileArgs(
            q=ptr(q),
            k=ptr(k),
            v=ptr(v),
            qpos=ptr(q_pos),
            kpos=ptr(k_pos),
            acc=ptr(acc),
            m=ptr(m),
            l=ptr(l),
            B=bsz,
            H=h,
            Hkv=hkv,
            Sq=sq,
            Sk=sk,
            D=d,
            q0=0,
            q1=sq,
            qcuts=ptr(qc),
            kcuts=ptr(kc),
            nqcuts=len(qc),
            nkcuts=len(kc),
            scale=float(scale),
            causal=int(bool(causal)),
            bq=BLOCK_Q,
            bk=bk,
            progress=cb,
            chunk=CHUNK_Q * bsz * h,
            lo=ptr(lo),
            hi=ptr(hi),
            mods=bits,
            mparam=ptr(mparam),
            mpos=ptr(mpos),
            Dv=dv,
        )
        f = fn(ctypes.byref(args))
        if errors:
            raise errors[0]
        if f < 0:
            raise MemoryError("fused tile: out of memory for its work buffers")
        if progress is not None:
            progress()
        return int(f)

    def tanh(self, x: np.ndarray) -> np.ndarray:
        """The kernel's own vector tanh (the score modifiers') over a float32/float64 array.

        For the accuracy tests.

        Parameters
        ----------
        x : (n,) float32 or float64
        """
        x = np.ascontiguousarray(x)
        if x.dtype not in (np.float32, np.float64) or x.ndim != 1:
            raise ValueError("tanh takes a 1-D float32 or float64 array")
        y = np.empty_like(x)
        fn = self._lib.rm_tanh_array_f32 if x.dtype == np.float32 else self._lib.rm_tanh_array_f64
        fn(ptr(x), ptr(y), len(x))
        return y

    def finalize(
        self, acc: np.ndarray, m: np.ndarray, l: np.ndarray, *, seq_major: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """Normalise the state with this kernel; same contract as the module's :func:`finalize`."""
        dt = acc.dtype
        if dt not in (np.float32, np.float64) or m.dtype != dt or l.dtype != dt:
            out, lse = softmax.finalize(acc, m, l)
            return (np.ascontiguousarray(np.moveaxis(out, -3, -2)) if seq_major else out), lse
        acc, m, l = (np.ascontiguousarray(a) for a in (acc, m, l))
        b, h, s, d = acc.shape
        out = np.empty((b, s, h, d) if seq_major else (b, h, s, d), dtype=dt)
        lse = np.empty((b, h, s), dtype=dt)
        fn = self._lib.rm_finalize_f32 if dt == np.float32 else self._lib.rm_finalize_f64
        fn(ptr(acc), ptr(m), ptr(l), b, h, s, d, ptr(out), ptr(lse), int(bool(seq_major)))
        return out, lse


#: the builds of the fused tile per ISA path and the default one
LOADER = Loader(Kernel, "fused CPU tile")


def load(isa: Optional[str] = None) -> Kernel:
    """The fused tile compiled for one ISA path (built or taken from the cache, memoized).

    Parameters
    ----------
    isa : str, optional
        ``auto`` (the widest path the host executes), ``avx512``, ``avx2`` or ``scalar``;
        default ``$RINGMPI_CPU_ISA`` (auto).

    Returns
    -------
    Kernel

    Raises
    ------
    ValueError
        Unknown path, or one the host cannot execute.
    FileNotFoundError, RuntimeError
        No compiler, or the build failed.
    """
    return LOADER.load(isa)


def _default_kernel() -> Optional[Kernel]:
    """The kernel of ``$RINGMPI_CPU_ISA``, or None (with one warning) (:meth:`Loader.default`)."""
    return LOADER.default()


def available() -> bool:
    """True when the fused kernel is (or can be) compiled and loaded on this host."""
    return _default_kernel() is not None


def unavailable_reason() -> Optional[str]:
    """Why :func:`available` is False (None when it is True)."""
    return LOADER.error()


def library_path() -> Optional[Path]:
    """Path of the default kernel's shared library, or None."""
    kern = _default_kernel()
    return kern.path if kern is not None else None


def simd_width() -> int:
    """Vector width of the default kernel, in bytes (64 AVX-512, 32 AVX2, 0 scalar)."""
    kern = _default_kernel()
    return kern.simd_width if kern is not None else 0


def isa() -> Optional[str]:
    """ISA path the default kernel was compiled for (``avx512``, ``avx2``, ``scalar``), or None."""
    kern = _default_kernel()
    return kern.isa if kern is not None else None


def forward_tile(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    acc: np.ndarray,
    m: np.ndarray,
    l: np.ndarray,
    *,
    scale: float,
    causal: bool,
    progress: Optional[Callable[[], None]] = None,
    bounds: Optional[tuple] = None,
    **modifiers,
) -> int:
    """Fold one K/V block into the online-softmax state, in place (fused C kernel).

    The tile contract of :mod:`ringmpi.tile`, masks beyond causal (``bounds``: windows,
    packed sequences, cross-attention) included; the numpy tile runs instead for dtypes
    other than float32/float64 and when the kernel is unavailable. ``progress`` is
    called from inside the kernel every ``CHUNK_Q`` query rows of all heads, and once at
    the end.

    Returns the flops of the (query, key) pairs the kernel scored: per strip of query
    rows (6 on the vector paths, 4 scalar) and key block, the strip's rows times the keys
    from the first to the last one any of them sees; 2 (Dk + Dv) per pair and head (4 D
    for equal widths). So every visible pair is counted and, with no mask, the result is
    2 B H Sq Sk (Dk + Dv), as the numpy tile's; under a mask it is usually below the
    numpy tile's count (which counts whole 256 x 256 blocks).

    The score modifiers (``**modifiers``: the tile keywords of :mod:`ringmpi.tile`, packed
    by :func:`ringmpi.scoremods.pack`, which refuses bad values with ValueError and unknown
    keywords with TypeError) run in the kernel on every ISA path, in slot order before the
    mask (their math: kernels/cpu_simd_type.h; transcendental ones by the kernel's vector
    functions, within a few ulps); hidden keys stay hidden and skipped blocks stay skipped.
    """
    kern = _default_kernel()
    if kern is None:
        return numpy_tile.forward_tile(
            q,
            k,
            v,
            q_pos,
            k_pos,
            acc,
            m,
            l,
            scale=scale,
            causal=causal,
            progress=progress,
            bounds=bounds,
            **modifiers,
        )
    return kern.forward_tile(
        q,
        k,
        v,
        q_pos,
        k_pos,
        acc,
        m,
        l,
        scale=scale,
        causal=causal,
        progress=progress,
        bounds=bounds,
        **modifiers,
    )


def finalize(
    acc: np.ndarray, m: np.ndarray, l: np.ndarray, *, seq_major: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Normalise the state in one pass: ``out = acc / l``, ``lse = m + log(l)``.

    Same result as :func:`ringmpi.softmax.finalize` (out bit for bit: IEEE division; lse to
    the last ulp of log): rows with ``l == 0`` give out 0 and lse -inf, NaN stays NaN.
    Falls back to it when the kernel is unavailable or the dtype is not float32/float64.

    Parameters
    ----------
    acc : (B, H, S, D) ; m, l : (B, H, S)
        State from :func:`forward_tile`, one dtype.
    seq_major : bool
        Write ``out`` as (B, S, H, D) C-contiguous (the layout of ``ring_attention``'s
        inputs), saving the transposing copy of ``moveaxis`` + ``ascontiguousarray``.

    Returns
    -------
    out : (B, H, S, D), or (B, S, H, D) with ``seq_major``
    lse : (B, H, S)
    """
    kern = _default_kernel()
    if kern is None:
        out, lse = softmax.finalize(acc, m, l)
        return (np.ascontiguousarray(np.moveaxis(out, -3, -2)) if seq_major else out), lse
    return kern.finalize(acc, m, l, seq_major=seq_major)
