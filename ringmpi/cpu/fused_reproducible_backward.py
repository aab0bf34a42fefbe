"""The reproducible backward's C kernel (``kernels/cpu_reproducible_backward.c``): loader, call.

The kernel computes one (query block, key block) tile of
:mod:`ringmpi.reproducible_backward` for every batch and head: the scores (through the
forward's softcap and ALiBi, when the call has them), P, dP and dS (times softcap's
derivative) of the tile and the fold parts of its three block partials (dQ over the
keys, dK and dV over the rows), added into the caller's fold sums. It does the
operations of the numpy code (``reproducible_backward._tile``, its oracle and fallback)
in the same order, so it gives the same bits, on every ISA path: it is compiled per
path like the other CPU kernels (:mod:`ringmpi.cpu.build`: private cache keyed on the
source and the shared header ``cpu_reproducible_math.h``, verified load,
``$RINGMPI_CPU_ISA``) with ``-ffp-contract=off -fno-fast-math`` after
``$RINGMPI_CFLAGS``, so no path fuses or reorders an operation. ``$RINGMPI_CPU_KERNEL``
picks it as it picks the forward's kernel (:func:`ringmpi.reproducible_backward.kernel`).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np

from .loader import Library, Loader, ptr

__all__ = ["ReproBackwardKernel", "LOADER", "load", "default"]


def _strides(a: np.ndarray, name: str) -> list:
    """The element strides of ``a``'s first three axes; ValueError unless ``a`` is float64,
    every stride is whole float64s and a fourth axis (if any) is contiguous."""
    if a.dtype != np.float64:
        raise ValueError(f"reproducible backward kernel: {name} must be float64, not {a.dtype}")
    if a.size == 0:  # nothing is read or written (numpy gives such views any strides)
        return [0, 0, 0]
    st = a.strides
    if any(s % 8 for s in st) or (a.ndim > 3 and a.shape[-1] > 1 and st[-1] != 8):
        raise ValueError(
            f"reproducible backward kernel: {name} needs float64 strides and a contiguous "
            f"last axis (strides {st})"
        )
    return [s // 8 for s in st[:3]]


def _modifiers(mods, h: int, r: int, c: int) -> tuple:
    """The kernel's view of ``mods`` (see :meth:`ReproBackwardKernel.tile`): (the mods bits,
    the cap (0.0 without softcap), the addresses of slopes, qa and kp (None without ALiBi),
    the arrays those addresses belong to). ValueError for a malformed tuple."""
    if mods is None:
        return 0, 0.0, (None, None, None), ()
    try:
        cap, slopes, qa, kp = mods
    except (TypeError, ValueError):
        raise ValueError(
            "reproducible backward kernel: mods is (cap, slopes, qa, kp) or None"
        ) from None
    flags, capv = 0, 0.0
    if cap is not None:
        capv = float(cap)
        if not capv > 0 or not np.isfinite(capv):  # the numpy code's 1 / cap: a finite cap > 0
            raise ValueError(f"reproducible backward kernel: softcap {cap} is not finite > 0")
        flags |= 1
    if slopes is None:
        return flags, capv, (None, None, None), ()
    slopes = np.ascontiguousarray(slopes, dtype=np.float64)
    if slopes.shape != (h,):
        raise ValueError(f"reproducible backward kernel: ALiBi slopes {slopes.shape}, not ({h},)")
    pos = []
    for name, x, n in (("qa", qa, r), ("kp", kp, c)):
        if x is None:
            raise ValueError(f"reproducible backward kernel: ALiBi needs {name}")
        x = np.asarray(x)
        if x.shape != (n,) or x.dtype.kind not in "iu":
            raise ValueError(
                f"reproducible backward kernel: ALiBi {name} {x.shape} {x.dtype}, not ({n},) int"
            )
        x = np.ascontiguousarray(x, dtype=np.int64)
        # the kernel's distance (qa - kp in float64) is numpy's integer one below 2^53
        if n and (int(x.max()) >= 2**53 or int(x.min()) <= -(2**53)):
            raise ValueError(f"reproducible backward kernel: ALiBi {name} beyond 2^53")
        pos.append(x)
    keep = (slopes, *pos)
    return flags | 2, capv, tuple(x.ctypes.data for x in keep), keep


class ReproBackwardKernel(Library):
    """The reproducible backward's tile kernel for one ISA path (attributes: :class:`Library`).

    ``tile_keys``: the most rows and keys one call takes (the global block, 64).
    """

    SOURCE = "cpu_reproducible_backward.c"
    ISA_SYMBOL = "rmb_isa_name"
    WIDTH_SYMBOL = "rmb_simd_width_bytes"
    EXTRA_FLAGS = ("-ffp-contract=off", "-fno-fast-math")

    def declare(self, lib: ctypes.CDLL) -> None:
        """Declare ``rmb_tile``; ``tile_keys``: the most rows and keys of a tile."""
        p, i64, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
        lib.rmb_tile_keys.restype = i64
        self.tile_keys = int(lib.rmb_tile_keys())
        lib.rmb_tile.restype = i64
        lib.rmb_tile.argtypes = [p] * 8 + [i64] * 8 + [f64, i64] + [p] * 7 + [i64, f64] + [p] * 3
        self._grids = None  # (the caller's grid lists, their stacked float64 arrays, pointers)

    def _stacked(self, consts: tuple, b: int, h: int, hkv: int, dk: int, dv: int) -> tuple:
        """The grids as C-contiguous (F, B, H, Dk), (F, B, Hkv, Dk), (F, B, Hkv, Dv) arrays,
        and their addresses.

        ``reproducible_backward.loop`` passes the same three lists for every tile of a
        call: they are stacked once (the cache keeps the lists alive, so their identity
        is a safe key; a caller must not change a list it has passed, nor its arrays).
        """
        cached = self._grids  # one read: another thread may replace it
        if cached is not None and all(x is y for x, y in zip(cached[0], consts)):
            return cached[1], cached[2]
        shapes = ((b, h, 1, dk), (b, hkv, 1, 1, dk), (b, hkv, 1, 1, dv))
        out = []
        for name, grid, shape in zip(("q", "k", "v"), consts, shapes):
            flat = shape[:2] + shape[-1:]
            try:
                parts = [np.broadcast_to(np.asarray(x, np.float64), shape) for x in grid]
            except ValueError:
                raise ValueError(
                    f"reproducible backward kernel: the {name} grids do not broadcast to {shape}"
                ) from None
            out.append(np.ascontiguousarray(np.stack([x.reshape(flat) for x in parts])))
        addr = [x.ctypes.data for x in out]
        self._grids = (tuple(consts), tuple(out), addr)
        return tuple(out), addr

    def tile(self, q, do, lse, delta, k, v, vis, scale, consts, dq_sums, dk_sums, dv_sums,
             hkv, mods=None) -> float:  # fmt: skip
        """One tile: what ``reproducible_backward._tile`` does, the same arguments and bits.

        Parameters
        ----------
        q : (B, H, r, Dk) ; do : (B, H, r, Dv) ; lse, delta : (B, H, r)
            The block's query rows (float64 views; the last axis contiguous), r <= 64.
        k : (B, H, c, Dk) ; v : (B, H, c, Dv)
            The key block, the K/V head of each query head, c <= 64 (an empty tile adds
            nothing and returns 0).
        vis : (r, c) bool
            Whether row i sees key j.
        scale : float
        consts : (q_grid, k_grid, v_grid)
            Lists of F grids (:func:`ringmpi.reproducible.grids`) broadcasting to
            (B, H, 1, Dk), (B, Hkv, 1, 1, Dk) and (B, Hkv, 1, 1, Dv).
        dq_sums : list of F (B, H, r, Dk) float64 ; dk_sums, dv_sums : lists of F
            (B, Hkv, c, Dk | Dv) float64
            The fold sums (views; every fold with the same strides), added to.
        hkv : int
            K/V heads (H is a multiple).
        mods : tuple, optional
            The score modifiers, as ``_tile`` takes them: (cap, slopes, qa, kp) with cap
            a float > 0 or None (no softcap), slopes (H,) float64 or None (no ALiBi), qa
            (r,) int64 the rows' ALiBi positions (None without ALiBi), kp (c,) int64 the
            keys' positions; None: no modifier.

        Returns
        -------
        float
            The largest P of the tile (NaN if one is NaN; +inf if a visible s - lse
            exceeds 709, where the numpy code's P is at least 8e307 too).
        """
        b, h, r, dk = q.shape
        c, dv = k.shape[2], v.shape[-1]
        flags, cap, mod_ptrs, keep = _modifiers(mods, h, r, c)
        nf = len(dq_sums)
        tk = self.tile_keys
        if not (0 <= r <= tk and 0 <= c <= tk) or h % hkv:
            raise ValueError(
                f"reproducible backward kernel: {r} rows x {c} keys (at most {tk} each), "
                f"{h} heads on {hkv} kv heads"
            )
        want = {
            "do": (do, (b, h, r, dv)),
            "lse": (lse, (b, h, r)),
            "delta": (delta, (b, h, r)),
            "k": (k, (b, h, c, dk)),
            "v": (v, (b, h, c, dv)),
        }
        for name, (a, shape) in want.items():
            if a.shape != shape:
                raise ValueError(f"reproducible backward kernel: {name} {a.shape}, not {shape}")
        vis = np.ascontiguousarray(vis, dtype=np.bool_)
        if vis.shape != (r, c):
            raise ValueError(f"reproducible backward kernel: vis {vis.shape}, not {(r, c)}")
        if not 1 <= nf <= 4 or len(dk_sums) != nf or len(dv_sums) != nf:
            raise ValueError(f"reproducible backward kernel: 1 to 4 folds, got {nf}")
        for name, sums, shape in (
            ("dq", dq_sums, (b, h, r, dk)),
            ("dk", dk_sums, (b, hkv, c, dk)),
            ("dv", dv_sums, (b, hkv, c, dv)),
        ):
            if any(x.shape != shape or x.strides != sums[0].strides for x in sums):
                raise ValueError(
                    f"reproducible backward kernel: {name} sums of shape {shape}, one stride set"
                )
            if not all(x.flags.writeable for x in sums):
                raise ValueError(f"reproducible backward kernel: {name} sums are read-only")
        named = (("q", q), ("do", do), ("lse", lse), ("delta", delta), ("k", k), ("v", v))
        named += (("dq", dq_sums[0]), ("dk", dk_sums[0]), ("dv", dv_sums[0]))
        st = (ctypes.c_int64 * 27)(*(s for name, a in named for s in _strides(a, name)))
        folds = [
            (ctypes.c_void_p * nf)(*(x.ctypes.data for x in group))
            for group in (dq_sums, dk_sums, dv_sums)
        ]
        grids, addr = self._stacked(consts, b, h, hkv, dk, dv)
        if any(len(g) != nf for g in grids):
            raise ValueError(f"reproducible backward kernel: {nf} folds, grids of another count")
        pmax = ctypes.c_double(0.0)
        rc = self._lib.rmb_tile(
            ptr(q), ptr(do), ptr(lse), ptr(delta), ptr(k), ptr(v), ctypes.addressof(st),
            ptr(vis), c, b, h, hkv, r, c, dk, dv, float(scale), nf, *addr,
            *(ctypes.addressof(x) for x in folds), ctypes.addressof(pmax),
            flags, cap, *mod_ptrs,
        )  # fmt: skip
        del keep  # the modifier arrays lived through the call
        if rc == -2:
            raise MemoryError("reproducible backward kernel: no scratch memory")
        if rc != 0:
            raise ValueError(f"reproducible backward kernel refused its arguments ({rc})")
        return float(pmax.value)


LOADER = Loader(ReproBackwardKernel, "reproducible backward C kernel")


def load(isa: Optional[str] = None) -> ReproBackwardKernel:
    """The kernel compiled for ISA path ``isa`` (default ``$RINGMPI_CPU_ISA``)."""
    return LOADER.load(isa)


def default() -> Optional[ReproBackwardKernel]:
    """The kernel of ``$RINGMPI_CPU_ISA``, or None where it cannot be built."""
    return LOADER.default()
