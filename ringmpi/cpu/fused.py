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
import sys
import threading
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from .. import softmax
from ..partition import runs
from . import build as _build_mod
from . import numpy_tile
from .build import ISAS, build_library, host_isas, load_verified

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
]

#: query rows per block inside the kernel (rounded up to whole register strips). The packed
#: K/V of a head stream through L2 once per query block; 528 rows keep that traffic small
#: while the block's queries and state (2 x 528 x D elements) stay in L2. Measured on
#: AVX-512, N=8192, 1 thread: +7% (D=64) to +13% (D=128) over 64 rows (with BLOCK_K 512).
BLOCK_Q = 528


def _l2_bytes() -> Optional[int]:
    """Size of the first CPU's level-2 cache from sysfs, or None when unknown."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for idx in sorted(base.glob("index*")):
            level, kind = ((idx / f).read_text().strip() for f in ("level", "type"))
            if level == "2" and kind in ("Data", "Unified"):
                size = (idx / "size").read_text().strip().upper()
                mult = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
                return int(size.rstrip("KM")) * mult
    except (OSError, ValueError):
        pass
    return None


#: keys per block at D = 64 (scaled by 64/D, within [64, 512]): more keys per block amortize
#: the per-row softmax statistics; every row strip of a query block streams the block's packed
#: K and V (2 x keys x D float32) from L2, so they are sized to a quarter of L2: 512 keys on
#: 1 MiB (Zen 4, where 256 measured 0-2% slower), 256 on 512 KiB (Zen 1-3), 128 on 256 KiB
#: (Haswell to Skylake client); 512 when the L2 size is unknown
BLOCK_K = max(64, min(512, (_l2_bytes() or 1 << 20) // 2048 // 64 * 64))
#: query rows per kernel call when a progress callback must run between calls
CHUNK_Q = 512

_SOURCE_NAME = "cpu_tile.c"

# int progress(void): nonzero aborts the kernel call
_PROGRESS = ctypes.CFUNCTYPE(ctypes.c_int)


class _TileArgs(ctypes.Structure):
    """ctypes mirror of ``rm_tile_args`` in kernels/cpu_tile.c (checked by size at load)."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("qpos", ctypes.c_void_p),
        ("kpos", ctypes.c_void_p),
        ("acc", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("l", ctypes.c_void_p),
        ("B", ctypes.c_int64),
        ("H", ctypes.c_int64),
        ("Hkv", ctypes.c_int64),
        ("Sq", ctypes.c_int64),
        ("Sk", ctypes.c_int64),
        ("D", ctypes.c_int64),
        ("q0", ctypes.c_int64),
        ("q1", ctypes.c_int64),
        ("qcuts", ctypes.c_void_p),
        ("kcuts", ctypes.c_void_p),
        ("nqcuts", ctypes.c_int64),
        ("nkcuts", ctypes.c_int64),
        ("scale", ctypes.c_double),
        ("causal", ctypes.c_int64),
        ("bq", ctypes.c_int64),
        ("bk", ctypes.c_int64),
        ("progress", _PROGRESS),
        ("chunk", ctypes.c_int64),
        ("lo", ctypes.c_void_p),
        ("hi", ctypes.c_void_p),
        ("softcap", ctypes.c_double),
        ("slopes", ctypes.c_void_p),
        ("apos", ctypes.c_void_p),
    ]


_lock = threading.RLock()
_kernels: dict[str, Kernel] = {}
_failed: dict[str, BaseException] = {}
_default: Optional[Kernel] = None
_default_error: Optional[str] = None
_default_tried = False


# ---------------------------------------------------------------------------- kernels


def _cuts(pos: np.ndarray) -> np.ndarray:
    """Starts of the runs of evenly spaced positions, when there are few of them.

    Blocks never cross a cut, so causal skipping has tight bounds. Many tiny runs
    (arbitrary positions) would make tiny blocks: then blocks ignore runs and rely
    on the explicit per-element mask, which is correct for any positions.
    """
    r = runs(pos)
    if len(r) > max(4, len(pos) // 64):
        return np.zeros(0, dtype=np.int64)
    return np.array([a for a, _ in r[1:]], dtype=np.int64)


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _check_bounds(bounds: Optional[tuple], sq: int) -> tuple:
    """``bounds`` as two C-contiguous int64 arrays of ``sq`` rows, or (None, None)."""
    if bounds is None:
        return None, None
    try:
        lo, hi = bounds
    except (TypeError, ValueError):
        raise ValueError("bounds must be a pair (lo, hi) of int64 arrays") from None
    out = []
    for name, a in (("lo", lo), ("hi", hi)):
        a = np.asarray(a)
        if a.shape != (sq,) or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(
                f"bounds {name} must be an integer array of shape ({sq},) (one per query row), "
                f"got {a.dtype} {a.shape}"
            )
        out.append(np.ascontiguousarray(a, dtype=np.int64))
    return tuple(out)


def check_modifiers(softcap, alibi, h: int, sq: int) -> tuple:
    """Validated score modifiers for the C tiles: (softcap or 0.0, slopes or None, qa or None).

    Parameters
    ----------
    softcap : float, optional
        Finite and > 0 (scores become softcap * tanh(score / softcap)).
    alibi : (slopes (H,), qa (Sq,)), optional
        Finite per-query-head slopes and the query rows' int64 ALiBi positions (in key
        coordinates, see :mod:`ringmpi.tile`).
    h, sq : int
        Query heads and query rows of the tile.
    """
    cap = 0.0
    if softcap is not None:
        cap = float(softcap)
        if not (np.isfinite(cap) and cap > 0):
            raise ValueError(f"softcap must be a finite number > 0, got {softcap!r}")
    if alibi is None:
        return cap, None, None
    try:
        slopes, qa = alibi
    except (TypeError, ValueError):
        raise ValueError("alibi must be a pair (slopes (H,), qa (Sq,))") from None
    slopes = np.ascontiguousarray(slopes, dtype=np.float64)
    qa = np.asarray(qa)
    if slopes.shape != (h,) or not np.isfinite(slopes).all():
        raise ValueError(f"alibi slopes must be {h} finite numbers (one per query head)")
    if qa.shape != (sq,) or not np.issubdtype(qa.dtype, np.integer):
        raise ValueError(f"alibi positions must be an integer array of shape ({sq},)")
    return cap, slopes, np.ascontiguousarray(qa, dtype=np.int64)


def modifier_keywords(softcap, alibi) -> dict:
    """The modifier keywords to hand to the numpy tile: only those that are set."""
    kw = {} if softcap is None else {"softcap": softcap}
    if alibi is not None:
        kw["alibi"] = alibi
    return kw


class Kernel:
    """The fused tile compiled for one ISA path (see :func:`load`).

    Attributes
    ----------
    isa : str
        ``avx512``, ``avx2`` or ``scalar``, as reported by the compiled library.
    path : pathlib.Path
        The shared library.
    simd_width : int
        Vector width in bytes (64, 32, or 0 for scalar).
    """

    def __init__(self, path: Path):
        lib = load_verified(path)  # the file whose hash was checked, not the name
        lib.rm_isa_name.restype = ctypes.c_char_p
        lib.rm_simd_width_bytes.restype = ctypes.c_int
        lib.rm_tile_args_size.restype = ctypes.c_int64
        size = lib.rm_tile_args_size()
        # a build from before the score modifiers (jobs/kernel_ab.py's baseline) reads the
        # fields up to `hi` only: it runs plain calls and refuses modifiers
        self.modifiers = size == ctypes.sizeof(_TileArgs)
        if not self.modifiers and size != _TileArgs.softcap.offset:
            raise RuntimeError(f"{path}: rm_tile_args does not match fused._TileArgs")
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        for sfx in ("f32", "f64"):
            fn = getattr(lib, f"rm_forward_tile_{sfx}")
            fn.restype = i64
            fn.argtypes = [ctypes.POINTER(_TileArgs)]
            if self.modifiers:
                th = getattr(lib, f"rm_tanh_array_{sfx}")
                th.restype = None
                th.argtypes = [p, p, i64]
            fin = getattr(lib, f"rm_finalize_{sfx}")
            fin.restype = None
            fin.argtypes = [p] * 3 + [i64] * 4 + [p, p, ctypes.c_int]
        self._lib = lib
        self.path = path
        self.isa = lib.rm_isa_name().decode()
        self.simd_width = int(lib.rm_simd_width_bytes())

    def __repr__(self) -> str:
        return f"Kernel(isa={self.isa!r}, path={str(self.path)!r})"

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
        softcap: Optional[float] = None,
        alibi: Optional[tuple] = None,
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
                q, k, v, q_pos, k_pos, acc, m, l, scale=scale, causal=causal, progress=progress,
                bounds=bounds, **modifier_keywords(softcap, alibi),
            )  # fmt: skip
        bsz, h, sq, d = q.shape
        hkv, sk = k.shape[1], k.shape[2]
        if h % hkv:
            raise ValueError(f"query heads {h} not a multiple of key/value heads {hkv}")
        if sq == 0 or sk == 0:
            return 0
        q = np.ascontiguousarray(q)
        k = np.ascontiguousarray(k)
        v = np.ascontiguousarray(v)
        q_pos = np.ascontiguousarray(q_pos, dtype=np.int64)
        k_pos = np.ascontiguousarray(k_pos, dtype=np.int64)
        lo, hi = _check_bounds(bounds, sq)
        cap, slopes, apos = check_modifiers(softcap, alibi, h, sq)
        if not self.modifiers and (cap or slopes is not None):
            raise ValueError(f"{self.path}: a build without the score modifiers")
        qc, kc = _cuts(q_pos), _cuts(k_pos)
        fn = self._lib.rm_forward_tile_f32 if dt == np.float32 else self._lib.rm_forward_tile_f64
        # keys per block: packed K and V blocks (2 * bk * D elements) well within L2; a
        # multiple of 64 (every path's panel width), so all paths cut the same blocks
        bk = int(min(512, max(64, (BLOCK_K * 64) // max(d, 1) // 64 * 64)))
        # The kernel packs each K/V head once and calls back every CHUNK_Q query rows of all
        # heads (the same amount of work as CHUNK_Q rows of every head); an exception raised
        # by progress stops the kernel and is re-raised here.
        errors: list[BaseException] = []

        def _cb() -> int:
            try:
                progress()
            except BaseException as exc:  # noqa: BLE001 - re-raised after the kernel returns
                errors.append(exc)
                return 1
            return 0

        args = _TileArgs(
            q=_ptr(q), k=_ptr(k), v=_ptr(v), qpos=_ptr(q_pos), kpos=_ptr(k_pos),
            acc=_ptr(acc), m=_ptr(m), l=_ptr(l),
            B=bsz, H=h, Hkv=hkv, Sq=sq, Sk=sk, D=d, q0=0, q1=sq,
            qcuts=_ptr(qc), kcuts=_ptr(kc), nqcuts=len(qc), nkcuts=len(kc),
            scale=float(scale), causal=int(bool(causal)), bq=BLOCK_Q, bk=bk,
            progress=_PROGRESS(_cb) if progress is not None else _PROGRESS(),
            chunk=CHUNK_Q * bsz * h,
            lo=None if lo is None else _ptr(lo), hi=None if hi is None else _ptr(hi),
            softcap=cap, slopes=None if slopes is None else _ptr(slopes),
            apos=None if apos is None else _ptr(apos),
        )  # fmt: skip
        f = fn(ctypes.byref(args))
        if errors:
            raise errors[0]
        if f < 0:
            raise MemoryError("fused tile: out of memory for its work buffers")
        if progress is not None:
            progress()
        return int(f)

    def tanh(self, x: np.ndarray) -> np.ndarray:
        """The kernel's own vector tanh (softcap's) over a float32/float64 array, for tests.

        Parameters
        ----------
        x : (n,) float32 or float64
        """
        x = np.ascontiguousarray(x)
        if x.dtype not in (np.float32, np.float64) or x.ndim != 1:
            raise ValueError("tanh takes a 1-D float32 or float64 array")
        y = np.empty_like(x)
        fn = self._lib.rm_tanh_array_f32 if x.dtype == np.float32 else self._lib.rm_tanh_array_f64
        fn(_ptr(x), _ptr(y), len(x))
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
        fn(_ptr(acc), _ptr(m), _ptr(l), b, h, s, d, _ptr(out), _ptr(lse), int(bool(seq_major)))
        return out, lse


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
    name = _build_mod.resolve_isa(isa)
    with _lock:
        if name in _kernels:
            return _kernels[name]
        if name in _failed:
            raise _failed[name]
        try:
            kern = Kernel(build_library(_SOURCE_NAME, name))
            if kern.isa != name:  # e.g. a compiler that ignores the ISA flags
                raise RuntimeError(f"{kern.path} was built for {kern.isa!r}, not {name!r}")
        except Exception as exc:
            _failed[name] = exc
            raise
        _kernels[name] = kern
        return kern


def _default_kernel() -> Optional[Kernel]:
    """The kernel of ``$RINGMPI_CPU_ISA``, or None (with one warning) if it cannot be built.

    With ``auto``, a path that fails to build (say, a compiler too old for the host's
    AVX-512) gives way to the next narrower one, with one line on stderr. A bad
    ``$RINGMPI_CPU_ISA`` (unknown, or a path the host cannot execute) raises ValueError
    (on every call until it is fixed): a configuration error is not a reason to fall back.
    """
    global _default, _default_error, _default_tried
    if _default_tried:
        return _default
    name = _build_mod.resolve_isa(None)
    auto = _build_mod.isa_setting() in ("", "auto")
    with _lock:
        if not _default_tried:
            _default_tried = True
            errors = []
            for cand in host_isas()[host_isas().index(name) :] if auto else [name]:
                try:
                    _default = load(cand)
                    break
                except Exception as exc:  # no compiler, no write access, ...
                    errors.append(f"{type(exc).__name__}: {exc}")
            if errors:
                first = errors[0].strip().splitlines()[0]
                if _default is None:  # numpy fallback
                    _default_error = errors[0]
                    what = "fused CPU tile unavailable, using the numpy tile"
                else:
                    what = f"fused CPU tile: {name} path failed, using {_default.isa}"
                print(f"ringmpi: {what} ({first})", file=sys.stderr, flush=True)
        return _default


def available() -> bool:
    """True when the fused kernel is (or can be) compiled and loaded on this host."""
    return _default_kernel() is not None


def unavailable_reason() -> Optional[str]:
    """Why :func:`available` is False (None when it is True)."""
    _default_kernel()
    return _default_error


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
    softcap: Optional[float] = None,
    alibi: Optional[tuple] = None,
) -> int:
    """Fold one K/V block into the online-softmax state, in place (fused C kernel).

    The tile contract of :mod:`ringmpi.tile`, masks beyond causal (``bounds``: windows,
    packed sequences, cross-attention) included; the numpy tile runs instead for dtypes
    other than float32/float64 and when the kernel is unavailable. ``progress`` is
    called from inside the kernel every ``CHUNK_Q`` query rows of all heads, and once at
    the end.

    Returns the flops of the (query, key) pairs the kernel scored: per strip of query
    rows (6 on the vector paths, 4 scalar) and key block, the strip's rows times the keys
    from the first to the last one any of them sees; 4 D per pair and head. So every
    visible pair is counted and, with no mask, the result is 4 B H Sq Sk D, as the
    numpy tile's; under a mask it is usually below the numpy tile's count (which counts
    whole 256 x 256 blocks).

    The score modifiers of :mod:`ringmpi.tile` run in the kernel on every ISA path:
    ``softcap`` (s -> softcap * tanh(s / softcap), a vector tanh within a few ulps) and
    ``alibi=(slopes (H,), qa (Sq,))`` (s += -slopes[h] * abs(qa[i] - k_pos[j])), both before
    the mask; hidden keys stay hidden and skipped blocks stay skipped.
    """
    kern = _default_kernel()
    if kern is None:
        return numpy_tile.forward_tile(
            q, k, v, q_pos, k_pos, acc, m, l, scale=scale, causal=causal, progress=progress,
            bounds=bounds, **modifier_keywords(softcap, alibi),
        )  # fmt: skip
    return kern.forward_tile(
        q, k, v, q_pos, k_pos, acc, m, l, scale=scale, causal=causal, progress=progress,
        bounds=bounds, softcap=softcap, alibi=alibi,
    )  # fmt: skip


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
