"""The float32 reproducible forward's C kernel (``kernels/cpu_reproducible_float32.c``).

It computes what :mod:`ringmpi.reproducible_float32`'s numpy code computes for one K/V
block (the block partials of every row and their windowed level sums), bit for bit, on
every ISA path: compiled per path like the fused tiles (:mod:`ringmpi.cpu.build`: private
cache, verified load, ``$RINGMPI_CPU_ISA``) with ``-ffp-contract=off -fno-fast-math``
after ``$RINGMPI_CFLAGS``. ``$RINGMPI_CPU_KERNEL`` chooses between it and the numpy
code as for the float64 kernel (:func:`ringmpi.reproducible.choose_kernel`).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np

from .loader import Library, Loader, ptr

__all__ = ["Float32Kernel", "LOADER", "load", "default"]


class Float32Kernel(Library):
    """The float32 reproducible kernel compiled for one ISA path."""

    SOURCE = "cpu_reproducible_float32.c"
    ISA_SYMBOL = "rmf_isa_name"
    WIDTH_SYMBOL = "rmf_simd_width_bytes"
    EXTRA_FLAGS = ("-ffp-contract=off", "-fno-fast-math")

    def declare(self, lib: ctypes.CDLL) -> None:
        """Declare ``rmf_block`` and ``rmd_block`` (float64 inputs); ``tile_keys``: keys per
        global block; ``levels`` (``wide``: the float64 instance's panel keys, column width
        and levels)."""
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        for name in ("rmf_tile_keys", "rmf_panel_keys", "rmf_column_width", "rmf_levels"):
            getattr(lib, name).restype = i64
        self.tile_keys = int(lib.rmf_tile_keys())
        self.panel_keys = int(lib.rmf_panel_keys())
        self.column_width = int(lib.rmf_column_width())
        self.levels = int(lib.rmf_levels())
        for name in ("rmd_panel_keys", "rmd_column_width", "rmd_levels"):
            getattr(lib, name).restype = i64
        # the float64 instance of the pass (rmd_block): its panels, tiles and levels
        self.wide = dict(
            panel_keys=int(lib.rmd_panel_keys()),
            column_width=int(lib.rmd_column_width()),
            levels=int(lib.rmd_levels()),
        )
        for name in ("rmf_block", "rmd_block"):
            getattr(lib, name).restype = i64
            getattr(lib, name).argtypes = [p] * 6 + [i64] * 12 + [p] * 5 + [ctypes.c_double]
        lib.rmf_finish.restype = i64
        lib.rmf_finish.argtypes = [p] * 3 + [i64] * 4 + [p]
        lib.rmf_backward_width.restype = i64
        self.backward_width = int(lib.rmf_backward_width())
        lib.rmf_backward.restype = i64
        lib.rmf_backward.argtypes = [p] * 10 + [i64] * 14 + [p] * 12

    def pad_keys(self, k: np.ndarray, dtype=np.float32) -> np.ndarray:
        """k (B, Hkv, Sk, D) as ``dtype`` k^T panels (B, Hkv, Skp / W, D, W), zero padded.

        W = ``panel_keys`` (float64: ``wide["panel_keys"]``); Skp: Sk rounded up to whole
        blocks (``tile_keys``).
        """
        b, hkv, sk, d = k.shape
        w = self._sizes(dtype)["panel_keys"]
        skp = -(-sk // self.tile_keys) * self.tile_keys
        out = np.empty((b, hkv, skp // w, d, w), dtype=dtype)
        whole = sk // w  # panels of real keys only: one transposing copy each
        out[:, :, :whole] = np.swapaxes(k[:, :, : whole * w].reshape(b, hkv, whole, w, d), 3, 4)
        out[:, :, whole:] = 0.0  # the padding, and the last panel's real keys below
        if sk > whole * w:
            out[:, :, whole, :, : sk - whole * w] = np.swapaxes(k[:, :, whole * w : sk], 2, 3)
        return out

    def pad_values(self, v: np.ndarray, dtype=np.float32) -> np.ndarray:
        """v (B, Hkv, Sk, Dv) as ``dtype`` (B, Hkv, Skp, Dvp), zero padded to whole blocks and
        to whole tiles of ``column_width`` columns (float64: ``wide["column_width"]``)."""
        b, hkv, sk, dv = v.shape
        skp = -(-sk // self.tile_keys) * self.tile_keys
        w = self._sizes(dtype)["column_width"]
        out = np.empty((b, hkv, skp, -(-dv // w) * w), dtype=dtype)
        out[:, :, :sk, :dv] = v
        out[:, :, :sk, dv:] = 0.0
        out[:, :, sk:] = 0.0
        return out

    def block(self, qs, kt, vp, k_pos, lo, hi, state, *, sk: int, dv: int, rows: tuple,
              scale: float = 1.0) -> None:  # fmt: skip
        """One K/V block against the rows ``[rows[0], rows[1])`` of ``qs``.

        Parameters
        ----------
        qs : (B, H, Sq, D) float32, q x C rounded (:func:`ringmpi.reproducible_float32.loop`);
            or float64: q itself, for the float64 instance, whose scores are its chains
            times ``scale``
        kt : from :meth:`pad_keys`;  vp : from :meth:`pad_values`
        k_pos : (sk,) int64 consecutive global positions from a multiple of ``tile_keys``
        lo, hi : (L, Sq) int64 visible key ranges
        state : (ref (B, H, Sq), l_lev (B, H, Sq, F), o_lev (B, H, Sq, F, Dv), l_grid (F,),
            v_grid (B, Hkv, F, Dv)), float64 C-contiguous (updated in place)
        """
        ref, l_lev, o_lev, l_grid, v_grid = state
        b, h, sq, d = qs.shape
        hkv, skp, dvp = vp.shape[1], vp.shape[2], vp.shape[3]
        wide = qs.dtype == np.float64  # the float64 instance (rmd_block), else rmf_block
        nf = self._sizes(qs.dtype)["levels"]
        if ref.shape != (b, h, sq) or v_grid.shape != (b, hkv, nf, dv):
            raise ValueError("reproducible float32 kernel: windows or grids of the wrong shape")
        if lo.shape != hi.shape or lo.ndim != 2 or lo.shape[1] != sq:
            raise ValueError(f"reproducible float32 kernel: lo, hi of shape (L, {sq})")
        if l_lev.shape != (b, h, sq, nf) or o_lev.shape != (b, h, sq, nf, dv):
            raise ValueError("reproducible float32 kernel: level sums of the wrong shape")
        arrays = (qs, kt, vp, k_pos, lo, hi, ref, l_lev, o_lev, l_grid, v_grid)
        for a in arrays:
            if not a.flags.c_contiguous:
                raise ValueError("reproducible float32 kernel: arrays must be C-contiguous")
        want = (qs.dtype.type,) * 3 + (np.int64,) * 3 + (np.float64,) * 5
        if qs.dtype not in (np.float32, np.float64) or any(
            a.dtype != t for a, t in zip(arrays, want)
        ):
            raise ValueError("reproducible float32 kernel: wrong dtypes")
        rc = (self._lib.rmd_block if wide else self._lib.rmf_block)(
            ptr(qs), ptr(kt), ptr(vp), ptr(k_pos), ptr(lo), ptr(hi),
            len(lo), b, h, hkv, sq, sk, skp, d, dvp, dv, rows[0], rows[1],
            ptr(ref), ptr(l_lev), ptr(o_lev), ptr(l_grid), ptr(v_grid), float(scale),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"reproducible float32 kernel refused its arguments ({rc})")

    def _sizes(self, dtype) -> dict:
        """Panel keys, column width and levels of the instance for ``dtype`` inputs."""
        if np.dtype(dtype) == np.float64:
            return self.wide
        return dict(panel_keys=self.panel_keys, column_width=self.column_width,
                    levels=self.levels)  # fmt: skip

    def finish(self, o_lev, l, a=None) -> np.ndarray:
        """out (B, Sq, H, Dv) float32 from the levels ``o_lev`` (B, H, Sq, F, Dv) and the rows'
        ``l`` (and sink factors ``a``) of :func:`ringmpi.reproducible.denominators`: the bits
        of :func:`ringmpi.reproducible.finish` for float32 outputs, in one pass."""
        b, h, sq, nf, dv = o_lev.shape
        rows = [x for x in (l, a) if x is not None]
        if nf != self.levels or any(x.shape != (b, h, sq) for x in rows):
            raise ValueError("reproducible float32 kernel: levels or rows of the wrong shape")
        if any(x.dtype != np.float64 or not x.flags.c_contiguous for x in [o_lev, *rows]):
            raise ValueError("reproducible float32 kernel: finish takes C-contiguous float64")
        out = np.empty((b, sq, h, dv), dtype=np.float32)
        rc = self._lib.rmf_finish(ptr(o_lev), ptr(l), None if a is None else ptr(a), b, h, sq,
                                  dv, ptr(out))  # fmt: skip
        if rc != 0:
            raise ValueError(f"reproducible float32 kernel refused its arguments ({rc})")
        return out

    def backward(self, arrays, lo, hi, nrows: int, nkeys: int, kpos0: int, grids, dq_sums,
                 dk_sums, dv_sums) -> tuple:  # fmt: skip
        """One ring step of the float32 backward: what
        :func:`ringmpi.reproducible_float32.backward_step` does, the same arguments and bits.

        The row and key arrays' last axes must be padded with zeros to multiples of
        ``backward_width``; returns (pmax, pairs, cells).
        """
        qs, q, do, lh, ll, dl, k, v = arrays
        b, h, sq, dkp = qs.shape
        hkv, sk, dvp = k.shape[1], k.shape[2], v.shape[-1]
        nf = len(dq_sums)
        dk_w, dv_w = dq_sums[0].shape[-1], dv_sums[0].shape[-1]
        want = (
            (qs, (b, h, sq, dkp)), (q, (b, h, sq, dkp)), (do, (b, h, sq, dvp)),
            (lh, (b, h, sq)), (ll, (b, h, sq)), (dl, (b, h, sq)),
            (k, (b, hkv, sk, dkp)), (v, (b, hkv, sk, dvp)),
        )  # fmt: skip
        for a, shape in want:
            if a.shape != shape or a.dtype != np.float32 or not a.flags.c_contiguous:
                raise ValueError(
                    f"reproducible float32 backward: an array {a.shape} {a.dtype}, not "
                    f"C-contiguous float32 {shape}"
                )
        if dkp % self.backward_width or dvp % self.backward_width:
            raise ValueError(
                f"reproducible float32 backward: widths {dkp}, {dvp} not multiples of "
                f"{self.backward_width}"
            )
        if lo.shape != hi.shape or lo.ndim != 2 or lo.shape[1] != sq:
            raise ValueError(f"reproducible float32 backward: lo, hi of shape (L, {sq})")
        if (
            lo.dtype != np.int64
            or hi.dtype != np.int64
            or not (lo.flags.c_contiguous and hi.flags.c_contiguous)
        ):
            raise ValueError("reproducible float32 backward: lo, hi must be C-contiguous int64")
        strides = []
        for name, sums, shape in (
            ("dq", dq_sums, (b, h, nrows, dk_w)),
            ("dk", dk_sums, (b, hkv, nkeys, dk_w)),
            ("dv", dv_sums, (b, hkv, nkeys, dv_w)),
        ):
            if len(sums) != nf or any(x.shape != shape or x.strides != sums[0].strides
                                      for x in sums):  # fmt: skip
                raise ValueError(
                    f"reproducible float32 backward: {nf} {name} sums of shape {shape}, "
                    "one stride set"
                )
            x = sums[0]
            if x.dtype == np.float64 and x.size == 0:  # nothing is read or written (numpy
                strides.append((ctypes.c_int64 * 3)(0, 0, 0))  # gives such views any strides)
                continue
            if x.dtype != np.float64 or any(s % 8 for s in x.strides) or x.strides[-1] != 8:
                raise ValueError(
                    f"reproducible float32 backward: {name} sums float64, last axis contiguous"
                )
            if not all(y.flags.writeable for y in sums):
                raise ValueError(f"reproducible float32 backward: {name} sums are read-only")
            strides.append((ctypes.c_int64 * 3)(*(s // 8 for s in x.strides[:3])))
        for grid, shape in zip(grids, ((nf, b, h, dk_w), (nf, b, hkv, dk_w), (nf, b, hkv, dv_w))):
            if grid.shape != shape or grid.dtype != np.float64 or not grid.flags.c_contiguous:
                raise ValueError(f"reproducible float32 backward: grids of shape {shape}")
        folds = [(ctypes.c_void_p * nf)(*(x.ctypes.data for x in g))
                 for g in (dq_sums, dk_sums, dv_sums)]  # fmt: skip
        pmax, pairs, cells = ctypes.c_double(0.0), ctypes.c_int64(0), ctypes.c_int64(0)
        rc = self._lib.rmf_backward(
            *(ptr(a) for a in arrays), ptr(lo), ptr(hi),
            len(lo), b, h, hkv, sq, sk, dk_w, dkp, dv_w, dvp, nrows, nkeys, int(kpos0), nf,
            *(ptr(x) for x in grids),
            ctypes.addressof(folds[0]), ctypes.addressof(strides[0]),
            ctypes.addressof(folds[1]), ctypes.addressof(strides[1]),
            ctypes.addressof(folds[2]), ctypes.addressof(strides[2]),
            ctypes.addressof(pmax), ctypes.addressof(pairs), ctypes.addressof(cells),
        )  # fmt: skip
        if rc == -2:
            raise MemoryError("reproducible float32 backward: no scratch memory")
        if rc != 0:
            raise ValueError(f"reproducible float32 backward refused its arguments ({rc})")
        return float(pmax.value), int(pairs.value), int(cells.value)


LOADER = Loader(Float32Kernel, "reproducible float32 C kernel")


def load(isa: Optional[str] = None) -> Float32Kernel:
    """The kernel compiled for ISA path ``isa`` (default ``$RINGMPI_CPU_ISA``)."""
    return LOADER.load(isa)


def default() -> Optional[Float32Kernel]:
    """The kernel of ``$RINGMPI_CPU_ISA``, or None where it cannot be built."""
    return LOADER.default()
