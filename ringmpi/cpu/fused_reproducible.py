"""The reproducible mode's C kernel (``kernels/cpu_reproducible.c``): its loader and one call.

The kernel computes what :mod:`ringmpi.reproducible`'s numpy code computes for one K/V
block (the row maxima of pass 0, the fold sums of pass 1), bit for bit, on every ISA
path: it is compiled per path like the fused tiles (:mod:`ringmpi.cpu.build`: private
cache, verified load, ``$RINGMPI_CPU_ISA``) with ``-ffp-contract=off -fno-fast-math``
after ``$RINGMPI_CFLAGS``, so no path fuses or reorders an operation.
``$RINGMPI_CPU_KERNEL=numpy`` runs the numpy code instead (the oracle); ``auto`` uses
the kernel when it builds, ``fused`` requires it.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np

from .loader import Library, Loader, ptr

__all__ = ["ReproKernel", "LOADER", "load", "default"]


class ReproKernel(Library):
    """The reproducible kernel compiled for one ISA path (attributes: :class:`Library`)."""

    SOURCE = "cpu_reproducible.c"
    ISA_SYMBOL = "rmr_isa_name"
    WIDTH_SYMBOL = "rmr_simd_width_bytes"
    EXTRA_FLAGS = ("-ffp-contract=off", "-fno-fast-math")

    def declare(self, lib: ctypes.CDLL) -> None:
        """Declare ``rmr_block``; ``tile_keys``: the keys per global key block."""
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.rmr_tile_keys.restype = i64
        self.tile_keys = int(lib.rmr_tile_keys())
        lib.rmr_panel_keys.restype = i64
        self.panel_keys = int(lib.rmr_panel_keys())
        lib.rmr_block.restype = i64
        lib.rmr_block.argtypes = (
            [p] * 6 + [i64] * 8 + [ctypes.c_double] + [i64] * 5 + [p] * 5
            + [i64, ctypes.c_double, p, p, i64]
        )  # fmt: skip

    def pad_keys(self, k: np.ndarray) -> np.ndarray:
        """k (B, Hkv, Sk, D) as the kernel's float64 k^T in panels (B, Hkv, Skp / W, D, W).

        W = ``panel_keys`` keys per panel, Skp a multiple of ``tile_keys`` (zero padded).
        """
        b, hkv, sk, d = k.shape
        w = self.panel_keys
        skp = -(-sk // self.tile_keys) * self.tile_keys
        kt = np.zeros((b, hkv, skp // w, d, w))
        full = np.zeros((b, hkv, skp, d))
        full[:, :, :sk] = k
        kt[...] = np.swapaxes(full.reshape(b, hkv, skp // w, w, d), 3, 4)
        return kt

    def block(
        self,
        q: np.ndarray,
        kt: np.ndarray,
        v: Optional[np.ndarray],
        k_pos: np.ndarray,
        lo: np.ndarray,
        hi: np.ndarray,
        scale: float,
        m: np.ndarray,
        *,
        sk: int,
        rows: tuple = (0, None),
        consts: Optional[tuple] = None,
        narrow: bool = False,
        mods: tuple = (None, None, None),
    ) -> None:
        """One K/V block against the rows ``q``: pass 0 (``consts`` None) or pass 1.

        Parameters
        ----------
        q : (B, H, Sq, D) float64, C-contiguous
        kt : (B, Hkv, Skp / W, D, W) float64 from :meth:`pad_keys`
        v : (B, Hkv, Sk, Dv) float64, C-contiguous (pass 1)
        k_pos : (Sk,) int64, contiguous from a multiple of ``tile_keys`` (whole key blocks)
        lo, hi : (Sq,) or (L, Sq) int64
            Row i sees key position p when lo[t, i] <= p <= hi[t, i] for a layer t (one
            layer for the single-range masks; :meth:`ringmpi.mask.Mask.layers` for slices).
        m : (B, H, Sq) float64 row maxima (updated by pass 0, read by pass 1)
        sk : int
            The real key count (``kt`` is padded).
        rows : (int, int or None)
            The rows ``[r0, r1)`` of ``q`` to compute (None: to the end).
        consts : (l_grid (F,), v_grid (F, B, Hkv, Dv), l_sums (F, B, H, Sq),
            o_sums (F, B, H, Sq, Dv)), float64 C-contiguous, for pass 1.
        narrow : bool
            Every value of q and kt is a float32 number: the scores may add each (exact)
            product by a fused multiply-add, which gives the same bits.
        mods : (softcap or None, slopes (H,) float64 or None, qa (Sq,) int64 or None)
            The score modifiers (:func:`ringmpi.reproducible.modify`): softcap, then
            ALiBi with the rows' ALiBi positions ``qa``.
        """
        b, h, sq, d = q.shape
        hkv, skp = kt.shape[1], kt.shape[2] * kt.shape[4]
        lo, hi = (x.reshape(-1, x.shape[-1]) for x in (lo, hi))
        if lo.shape != hi.shape or lo.shape[1] != sq or len(lo) < 1:
            raise ValueError(f"reproducible kernel: lo, hi of shape (L, {sq}), L >= 1")
        args = [q, kt, v, k_pos, lo, hi, m]
        if consts is None:
            folds, dv, lc, vc, ls, os_ = 1, 0, None, None, None, None
        else:
            lc, vc, ls, os_ = consts
            folds, dv = len(lc), os_.shape[-1]
            args += [lc, vc, ls, os_]
        cap, slopes, qa = mods
        bits = int(cap is not None) | int(slopes is not None) << 1
        if slopes is not None:
            good = slopes.shape == (h,) and slopes.dtype == np.float64 and qa is not None
            if not (good and qa.shape == (sq,) and qa.dtype == np.int64):
                raise ValueError("reproducible kernel: slopes (H,) and qa (Sq,) int64")
            args += [slopes, qa]
        for a in args:
            if a is not None and not (a.flags.c_contiguous and a.dtype.kind in "fi"):
                raise ValueError("reproducible kernel: arrays must be C-contiguous")
        rc = self._lib.rmr_block(
            ptr(q), ptr(kt), ptr(v), ptr(k_pos), ptr(lo), ptr(hi),
            b, h, hkv, sq, sk, skp, d, dv, float(scale), 0 if consts is None else 1, folds,
            rows[0], sq if rows[1] is None else rows[1], int(bool(narrow)),
            ptr(m), ptr(lc), ptr(vc), ptr(ls), ptr(os_),
            bits, 0.0 if cap is None else float(cap), ptr(slopes), ptr(qa), len(lo),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"reproducible kernel refused its arguments ({rc})")


LOADER = Loader(ReproKernel, "reproducible C kernel")


def load(isa: Optional[str] = None) -> ReproKernel:
    """The kernel compiled for ISA path ``isa`` (default ``$RINGMPI_CPU_ISA``)."""
    return LOADER.load(isa)


def default() -> Optional[ReproKernel]:
    """The kernel of ``$RINGMPI_CPU_ISA``, or None where it cannot be built."""
    return LOADER.default()
