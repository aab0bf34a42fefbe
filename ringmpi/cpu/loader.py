"""Loading the fused CPU kernels: one per-ISA library class and loader for both tiles.

Both fused kernels (``kernels/cpu_tile.c``, the forward, and ``kernels/cpu_backward.c``)
are compiled per ISA path by :func:`ringmpi.cpu.build.build_library` and loaded through
:func:`ringmpi.cpu.cache.load_verified`. This module holds what their Python sides share:

* :class:`Library`: one build of one kernel for one ISA path (its ``isa``, ``path`` and
  vector width, checked against the path asked for); :class:`ringmpi.cpu.fused.Kernel`
  and :class:`ringmpi.cpu.fused_backward.BackwardKernel` declare their entry points on it;
* :class:`Loader`: the memoized builds of one kernel class per ISA path and the default
  one (``$RINGMPI_CPU_ISA``; with ``auto`` a path that fails to build gives way to the
  next narrower one, and when none builds the callers use the numpy tiles);
* the C side's calling conventions: :class:`TileArgs` (the forward's argument struct),
  :data:`PROGRESS` and :func:`progress_callback` (the progress callback that stops a
  kernel and re-raises its exception), the argument checks both tiles apply
  (:func:`cuts`, :func:`check_bounds`) and the score modifiers' three kernel arguments
  (:func:`mod_arrays`: ``(mods, mparam, mpos)`` of a :class:`ringmpi.scoremods.TileMods`,
  :func:`check_mods`: refused when a build lacks one of them).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..layout import runs
from ..scoremods import NMODS, TileMods
from .build import build_library
from .cache import load_verified
from .isa import host_isas, isa_setting, resolve_isa

__all__ = [
    "PROGRESS",
    "TileArgs",
    "Library",
    "Loader",
    "ptr",
    "cuts",
    "check_bounds",
    "mod_arrays",
    "check_mods",
    "progress_callback",
]

#: ``int progress(void)``: a nonzero return stops the kernel call
PROGRESS = ctypes.CFUNCTYPE(ctypes.c_int)


class TileArgs(ctypes.Structure):
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
        ("progress", PROGRESS),
        ("chunk", ctypes.c_int64),
        ("lo", ctypes.c_void_p),
        ("hi", ctypes.c_void_p),
        ("mods", ctypes.c_uint32),
        ("mparam", ctypes.c_void_p),
        ("mpos", ctypes.c_void_p),
        ("Dv", ctypes.c_int64),
    ]


def ptr(a: Optional[np.ndarray]) -> Optional[int]:
    """The address of array ``a``'s data (None for None: a NULL pointer)."""
    return None if a is None else a.ctypes.data


def cuts(pos: np.ndarray) -> np.ndarray:
    """Starts of the runs of evenly spaced positions, when there are few of them.

    The kernels' blocks never cross a cut, so causal skipping has tight bounds. Many tiny
    runs (arbitrary positions) would make tiny blocks: then blocks ignore runs and rely
    on the explicit per-element mask, which is correct for any positions.

    Parameters
    ----------
    pos : (S,) int64
        Token positions of the tile's rows or keys.
    """
    r = runs(pos)
    if len(r) > max(4, len(pos) // 64):
        return np.zeros(0, dtype=np.int64)
    return np.array([a for a, _ in r[1:]], dtype=np.int64)


def check_bounds(bounds: Optional[tuple], sq: int) -> tuple:
    """``bounds`` as two C-contiguous int64 arrays of ``sq`` rows, or (None, None).

    Parameters
    ----------
    bounds : ((Sq,), (Sq,)) integer arrays, optional
        Per-row visible key ranges (lo, hi) of :mod:`ringmpi.mask`.
    sq : int
        Query rows of the tile.
    """
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


def mod_arrays(mods: Optional[TileMods], h: int, sq: int) -> tuple:
    """The score modifiers' kernel arguments ``(mods, mparam, mpos)`` as (int, arrays).

    ``mparam`` (H, NMODS) float64 and ``mpos`` (Sq,) int64 are C-contiguous (or None: a
    NULL pointer); the caller keeps them alive while the kernel runs and passes
    :func:`ptr` of each. Without modifiers: ``(0, None, None)``.

    Parameters
    ----------
    mods : TileMods, optional
        The block of :func:`ringmpi.scoremods.pack` for this call.
    h, sq : int
        Query heads and query rows of the tile (the kernels read ``mparam`` rows
        ``0..h-1`` and ``mpos[0..sq-1]``).
    """
    if mods is None or not mods.bits:
        return 0, None, None
    params = np.ascontiguousarray(mods.params, dtype=np.float64)
    if params.shape != (h, NMODS):
        raise ValueError(f"score modifier parameters {params.shape}, expected ({h}, {NMODS})")
    qpos = mods.qpos
    if qpos is not None:
        qpos = np.ascontiguousarray(qpos, dtype=np.int64)
        if qpos.shape != (sq,):
            raise ValueError(f"score modifier positions {qpos.shape}, expected ({sq},)")
    return int(mods.bits), params, qpos


def check_mods(mods: Optional[TileMods], have: int, what) -> None:
    """ValueError when ``mods`` uses a slot that a build lacks.

    Parameters
    ----------
    mods : TileMods, optional
    have : int
        The build's slots (bit ``slot`` set: implemented; 0 for builds from before the
        score modifiers, such as benchmarks/kernel_ab.py's baselines).
    what : object
        The build, for the message.
    """
    if mods is not None and mods.bits & ~have:
        lack = [m.field for m in mods.active() if not have >> m.slot & 1]
        raise ValueError(f"{what}: a build without the score modifiers {', '.join(lack)}")


def progress_callback(progress: Optional[Callable[[], None]]) -> tuple:
    """The C callback for ``progress`` and the list its exceptions go to: (callback, errors).

    The callback returns 1 (stop) when ``progress`` raises and keeps the exception in
    ``errors``, to be re-raised once the kernel has returned; without ``progress`` it is
    the NULL callback.

    Parameters
    ----------
    progress : callable, optional
        Called with no arguments from inside the kernel.
    """
    errors: list[BaseException] = []
    if progress is None:
        return PROGRESS(), errors

    def _cb() -> int:
        try:
            progress()
        except BaseException as exc:  # noqa: BLE001 - re-raised after the kernel returns
            errors.append(exc)
            return 1
        return 0

    return PROGRESS(_cb), errors


class Library:
    """One build of a fused kernel for one ISA path (a base class, see :class:`Loader`).

    Subclasses name their ``SOURCE`` (under ``kernels/``), the C functions that report the
    build's ISA path and vector width (``ISA_SYMBOL``, ``WIDTH_SYMBOL``), and declare their
    entry points in :meth:`declare`.

    Attributes
    ----------
    isa : str
        ``avx512``, ``avx2`` or ``scalar``, as reported by the compiled library (from its
        vector width for builds that predate ``ISA_SYMBOL``).
    path : pathlib.Path
        The shared library.
    simd_width : int
        Vector width in bytes (64, 32, or 0 for scalar).
    mods : int
        The score-modifier slots the build implements (bit ``slot`` set; set by
        :meth:`declare`; 0 for builds from before the modifier seam, such as
        benchmarks/kernel_ab.py's baselines, which run plain calls only).
    """

    SOURCE = ""
    EXTRA_FLAGS: tuple = ()  # compiler flags after $RINGMPI_CFLAGS (build_library)
    mods = 0
    ISA_SYMBOL = ""
    WIDTH_SYMBOL = ""

    def __init__(self, path: Path):
        lib = load_verified(path)  # the file whose hash was checked, not the name
        width = getattr(lib, self.WIDTH_SYMBOL)
        width.restype = ctypes.c_int
        self.simd_width = int(width())
        if hasattr(lib, self.ISA_SYMBOL):
            getattr(lib, self.ISA_SYMBOL).restype = ctypes.c_char_p
            self.isa = getattr(lib, self.ISA_SYMBOL)().decode()
        else:
            self.isa = {64: "avx512", 32: "avx2"}.get(self.simd_width, "scalar")
        self._lib = lib
        self.path = Path(path)
        self.declare(lib)

    def declare(self, lib: ctypes.CDLL) -> None:
        """Declare the argument and result types of the kernel's entry points on ``lib``."""

    @classmethod
    def build(cls, isa: str):
        """Compile (or take from the cache) ``SOURCE`` for path ``isa`` and load it."""
        kern = cls(build_library(cls.SOURCE, isa, cls.EXTRA_FLAGS))
        if kern.isa != isa:  # e.g. a compiler that ignores the ISA flags
            raise RuntimeError(f"{kern.path} was built for {kern.isa!r}, not {isa!r}")
        return kern

    def __repr__(self) -> str:
        return f"{type(self).__name__}(isa={self.isa!r}, path={str(self.path)!r})"


class Loader:
    """The builds of one :class:`Library` subclass per ISA path, and the default one.

    Parameters
    ----------
    cls : type
        The :class:`Library` subclass.
    what : str
        Its name in messages (``"fused CPU tile"``).
    warn : bool
        Print one line to stderr when the default falls back to a narrower path or to
        the numpy tile.
    """

    def __init__(self, cls: type, what: str, *, warn: bool = True):
        self.cls, self.what, self.warn = cls, what, warn
        self._lock = threading.RLock()
        self._kernels: dict = {}
        self._failed: dict = {}
        self.forget()

    def forget(self) -> None:
        """Forget the default kernel, so that the next use reads ``$RINGMPI_CPU_ISA`` again."""
        self._default = None
        self._default_error: Optional[str] = None
        self._default_tried = False

    def load(self, isa: Optional[str] = None):
        """The kernel compiled for one ISA path (built or taken from the cache, memoized).

        Parameters
        ----------
        isa : str, optional
            ``auto`` (the widest path the host executes), ``avx512``, ``avx2`` or
            ``scalar``; default ``$RINGMPI_CPU_ISA`` (auto).

        Raises
        ------
        ValueError
            Unknown path, or one the host cannot execute.
        FileNotFoundError, RuntimeError
            No compiler, or the build failed (remembered: raised again on the next call).
        """
        name = resolve_isa(isa)
        with self._lock:
            if name in self._kernels:
                return self._kernels[name]
            if name in self._failed:
                raise self._failed[name]
            try:
                kern = self.cls.build(name)
            except Exception as exc:
                self._failed[name] = exc
                raise
            self._kernels[name] = kern
            return kern

    def default(self):
        """The kernel of ``$RINGMPI_CPU_ISA``, or None if it cannot be built.

        With ``auto``, a path that fails to build (say, a compiler too old for the host's
        AVX-512) gives way to the next narrower one. A bad ``$RINGMPI_CPU_ISA`` (unknown,
        or a path the host cannot execute) raises ValueError (on every call until it is
        fixed): a configuration error is not a reason to fall back.
        """
        if self._default_tried:
            return self._default
        name = resolve_isa(None)
        auto = isa_setting() in ("", "auto")
        with self._lock:
            if not self._default_tried:
                self._default_tried = True
                errors = []
                for cand in host_isas()[host_isas().index(name) :] if auto else [name]:
                    try:
                        self._default = self.load(cand)
                        break
                    except Exception as exc:  # no compiler, no write access, ...
                        errors.append(f"{type(exc).__name__}: {exc}")
                if errors:
                    first = errors[0].strip().splitlines()[0]
                    if self._default is None:  # numpy fallback
                        self._default_error = errors[0]
                        note = f"{self.what} unavailable, using the numpy tile"
                    else:
                        note = f"{self.what}: {name} path failed, using {self._default.isa}"
                    if self.warn:
                        print(f"ringmpi: {note} ({first})", file=sys.stderr, flush=True)
            return self._default

    @contextmanager
    def pinned(self, isa: str):
        """A ``with`` block in which the default kernel is the build for path ``isa``.

        What ``$RINGMPI_CPU_ISA=isa`` selects in a fresh process, for tests that run the
        module-level tiles (and the backends built on them) on every path in one process;
        the previous default is restored afterwards.

        Parameters
        ----------
        isa : str
            ``avx512``, ``avx2`` or ``scalar`` (one the host executes).
        """
        kern = self.load(isa)
        with self._lock:
            saved = (self._default, self._default_error, self._default_tried)
            self._default, self._default_error, self._default_tried = kern, None, True
        try:
            yield kern
        finally:
            with self._lock:
                self._default, self._default_error, self._default_tried = saved

    def error(self) -> Optional[str]:
        """Why there is no default kernel (None when there is one)."""
        self.default()
        return self._default_error
