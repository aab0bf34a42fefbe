"""Fused CPU tile: a C kernel compiled on first use, same semantics as ``ringmpi.cpu``.

The kernel (``kernels/cpu_tile.c``) computes scores, the causal mask, the online
softmax and the P.V product in one pass over cache-sized blocks, so no (Sq, Sk)
array is ever formed and exp runs as a vector polynomial. It is built with the
system C compiler (``$CC``, else ``cc``/``gcc``) with ``-O3 -march=native`` (no
``-ffast-math``: inf and NaN keep their IEEE meaning) and cached on disk under
``$RINGMPI_CACHE_DIR`` (default ``~/.cache/ringmpi``). The cache key hashes the
source, the compiler's identity, the flags and the host CPU's feature flags, so a
shared home directory on a heterogeneous cluster gets one build per CPU type.
Concurrent builds by several MPI ranks are safe: each compiles to a private
temporary name and renames it into place atomically.

If no compiler works, :func:`available` returns False and callers use the numpy
tile (:func:`ringmpi.cpu.forward_tile`); :func:`unavailable_reason` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from . import cpu, softmax
from .partition import runs

__all__ = [
    "available",
    "unavailable_reason",
    "forward_tile",
    "finalize",
    "library_path",
    "simd_width",
    "BLOCK_Q",
    "BLOCK_K",
    "CHUNK_Q",
]

#: query rows per block inside the kernel (rounded up to whole 6-row strips). The packed K/V
#: of a head stream through L2 once per query block; 528 rows keep that traffic small while
#: the block's queries and state (2 x 528 x D elements) stay in L2. Measured on AVX-512,
#: N=8192, 1 thread: +7% (D=64) to +13% (D=128) over 64 rows (with BLOCK_K 512 vs 256).
BLOCK_Q = 528
#: keys per block at D = 64 (scaled by 64/D, within [64, 512]): more keys per block amortize
#: the per-row softmax statistics; the strip's K and V blocks stream from L2
BLOCK_K = 512
#: query rows per kernel call when a progress callback must run between calls
CHUNK_Q = 512

FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=fast"]
# extra flags for experiments (e.g. "-DRM_R=6"); part of the cache key
FLAGS += os.environ.get("RINGMPI_CFLAGS", "").split()
_SOURCE_NAME = "cpu_tile.c"

# int progress(void): nonzero aborts the kernel call
_PROGRESS = ctypes.CFUNCTYPE(ctypes.c_int)

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_lib_path: Optional[Path] = None
_error: Optional[str] = None
_tried = False


def _source_path(source_name: str = _SOURCE_NAME) -> Path:
    """Find kernels/<source_name>: $RINGMPI_KERNEL_DIR, the source tree, or the package."""
    here = Path(__file__).resolve().parent
    candidates = []
    if os.environ.get("RINGMPI_KERNEL_DIR"):
        candidates.append(Path(os.environ["RINGMPI_KERNEL_DIR"]) / source_name)
    candidates += [here.parent / "kernels" / source_name, here / "kernels" / source_name]
    for c in candidates:
        if c.is_file():
            return c
    raise FileNotFoundError(f"{source_name} not found in " + ", ".join(map(str, candidates)))


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name.split()[0]):
            return name
    raise FileNotFoundError("no C compiler found (set $CC)")


def _cpu_flags() -> str:
    """Host CPU identity for the cache key: -march=native depends on it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    d = os.environ.get("RINGMPI_CACHE_DIR")
    return Path(d) if d else Path.home() / ".cache" / "ringmpi"


def _build() -> Path:
    return build_library(_SOURCE_NAME)


def build_library(source_name: str) -> Path:
    """Compile kernels/<source_name> (or reuse the cached build); return the library path.

    Same compiler, flags (``FLAGS``, including ``$RINGMPI_CFLAGS``) and cache key scheme
    for every kernel source; the library is named after the source's stem.
    """
    src = _source_path(source_name)
    stem = Path(source_name).stem
    cc = _compiler()
    version = subprocess.run(
        [*cc.split(), "--version"], capture_output=True, text=True, timeout=60
    ).stdout
    key = hashlib.sha256()
    for part in (src.read_bytes(), cc.encode(), version.encode(), " ".join(FLAGS).encode()):
        key.update(part)
        key.update(b"\0")
    key.update(_cpu_flags().encode())
    key.update(platform.machine().encode())
    out_dir = _cache_dir()
    target = out_dir / f"{stem}-{key.hexdigest()[:24]}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run(
            [*cc.split(), *FLAGS, "-o", tmp, str(src), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {src} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp, target)  # atomic: concurrent ranks see a complete file or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> Optional[ctypes.CDLL]:
    global _lib, _lib_path, _error, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        try:
            path = _build()
            lib = ctypes.CDLL(str(path))
            p, i64 = ctypes.c_void_p, ctypes.c_int64
            for sfx in ("f32", "f64"):
                fn = getattr(lib, f"rm_forward_tile_{sfx}")
                fn.restype = i64
                fn.argtypes = [p] * 8 + [i64] * 8 + [p, i64, p, i64, ctypes.c_double]
                fn.argtypes += [ctypes.c_int, i64, i64, _PROGRESS, i64]
                fin = getattr(lib, f"rm_finalize_{sfx}")
                fin.restype = None
                fin.argtypes = [p] * 3 + [i64] * 4 + [p, p, ctypes.c_int]
            lib.rm_simd_width_bytes.restype = ctypes.c_int
            _lib, _lib_path = lib, path
        except Exception as exc:  # no compiler, no write access, ...: numpy fallback
            _error = f"{type(exc).__name__}: {exc}"
        return _lib


def available() -> bool:
    """True when the fused kernel is (or can be) compiled and loaded on this host."""
    return _load() is not None


def unavailable_reason() -> Optional[str]:
    """Why :func:`available` is False (None when it is True)."""
    _load()
    return _error


def library_path() -> Optional[Path]:
    """Path of the loaded shared library, or None."""
    _load()
    return _lib_path


def simd_width() -> int:
    """Vector width the kernel was built for, in bytes (64 AVX-512, 32 AVX2, 0 scalar)."""
    lib = _load()
    return int(lib.rm_simd_width_bytes()) if lib is not None else 0


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
) -> int:
    """Fold one K/V block into the online-softmax state, in place (fused C kernel).

    Same contract as :func:`ringmpi.cpu.forward_tile`; falls back to it for
    dtypes other than float32/float64 or when the kernel is unavailable.

    Parameters
    ----------
    q : (B, H, Sq, D) ; k, v : (B, Hkv, Sk, D) ; q_pos : (Sq,) ; k_pos : (Sk,)
    acc : (B, H, Sq, D) ; m, l : (B, H, Sq)
        State in the dtype of q, C-contiguous, updated in place.
    scale : float
    causal : bool
    progress : callable, optional
        Called from inside the kernel after every ``CHUNK_Q`` query rows of all heads
        (``CHUNK_Q * B * H`` rows of single heads), and once at the end.

    Returns
    -------
    int
        Flops of the two matrix products over the blocks the kernel computed
        (4 * nq * nk * D per block and head; skipped blocks count 0).
    """
    dt = q.dtype
    lib = _load()
    ok = (
        lib is not None
        and dt in (np.float32, np.float64)
        and k.dtype == dt
        and v.dtype == dt
        and all(a.dtype == dt and a.flags.c_contiguous for a in (acc, m, l))
    )
    if not ok:
        return cpu.forward_tile(
            q, k, v, q_pos, k_pos, acc, m, l, scale=scale, causal=causal, progress=progress
        )
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
    qc, kc = _cuts(q_pos), _cuts(k_pos)
    fn = lib.rm_forward_tile_f32 if dt == np.float32 else lib.rm_forward_tile_f64
    # keys per block: packed K and V blocks (2 * bk * D elements) well within L2
    bk = int(min(512, max(64, (BLOCK_K * 64) // max(d, 1))))
    # The kernel packs each K/V head once and calls back every CHUNK_Q query rows of all
    # heads (the same amount of work as CHUNK_Q rows of every head); an exception raised by
    # progress stops the kernel and is re-raised here.
    errors: list[BaseException] = []

    def _cb() -> int:
        try:
            progress()
        except BaseException as exc:  # noqa: BLE001 - re-raised after the kernel returns
            errors.append(exc)
            return 1
        return 0

    cb = _PROGRESS(_cb) if progress is not None else _PROGRESS()
    f = fn(
        _ptr(q), _ptr(k), _ptr(v), _ptr(q_pos), _ptr(k_pos), _ptr(acc), _ptr(m), _ptr(l),
        bsz, h, hkv, sq, sk, d, 0, sq,
        _ptr(qc), len(qc), _ptr(kc), len(kc), float(scale), int(bool(causal)), BLOCK_Q, bk,
        cb, CHUNK_Q * bsz * h,
    )  # fmt: skip
    if errors:
        raise errors[0]
    if f < 0:
        raise MemoryError("fused tile: out of memory for its work buffers")
    if progress is not None:
        progress()
    return int(f)


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
    lib = _load()
    dt = acc.dtype
    if lib is None or dt not in (np.float32, np.float64) or m.dtype != dt or l.dtype != dt:
        out, lse = softmax.finalize(acc, m, l)
        return (np.ascontiguousarray(np.moveaxis(out, -3, -2)) if seq_major else out), lse
    acc, m, l = (np.ascontiguousarray(a) for a in (acc, m, l))
    b, h, s, d = acc.shape
    out = np.empty((b, s, h, d) if seq_major else (b, h, s, d), dtype=dt)
    lse = np.empty((b, h, s), dtype=dt)
    fn = lib.rm_finalize_f32 if dt == np.float32 else lib.rm_finalize_f64
    fn(_ptr(acc), _ptr(m), _ptr(l), b, h, s, d, _ptr(out), _ptr(lse), int(bool(seq_major)))
    return out, lse
