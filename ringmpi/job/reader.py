"""Reading one rank's tokens of a sequence from the HDF5 shards, never more than its share.

Each rank reads only its own tokens with hyperslab selections: one slice per
file for the contiguous layout, two for zigzag, one strided selection (or
subsampled contiguous blocks) for striped. No rank reads or allocates a whole
sequence.
"""

from __future__ import annotations

import numpy as np

from ..partition import positions, runs
from .schema import Plan, SeqInfo, fail, open_input

__all__ = ["Reader", "local_runs"]


def local_runs(pos: np.ndarray) -> list:
    """This rank's positions as (first_token, count, step, dest_offset) arithmetic runs."""
    out = []
    for a, b in runs(pos):
        step = int(pos[a + 1] - pos[a]) if b - a > 1 else 1
        out.append((int(pos[a]), b - a, step, a))
    return out


class Reader:
    """Reads one rank's tokens of each sequence, never more than its share.

    Parameters
    ----------
    plan : Plan
    rank, size : int
        This rank and the ring size.
    layout : str
        Token layout (see :mod:`ringmpi.partition`).
    strided : {"auto", "hyperslab", "blocks"}
        How a strided (striped layout) selection is read: one strided hyperslab
        per file, or contiguous blocks of ``block_bytes`` subsampled in memory.
        "auto" (default) picks the faster one measured here (jobs/read_throughput.py):
        hyperslab for contiguous storage (742 vs 618 MB/s per rank at P=2, cold),
        blocks for chunked/compressed storage (101 vs 32 MB/s), where a strided
        selection makes HDF5 walk every chunk element by element.
    """

    def __init__(
        self,
        plan: Plan,
        rank: int,
        size: int,
        layout: str,
        strided: str = "auto",
        block_bytes: int = 32 << 20,
    ):
        self.plan, self.rank, self.size, self.layout = plan, rank, size, layout
        self.strided, self.block_bytes = strided, block_bytes
        self._files: dict = {}
        self._weights = None
        self.bytes_read = 0

    def close(self) -> None:
        """Close the open input files."""
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _file(self, i: int):
        if i not in self._files:
            self._files[i] = open_input(self.plan.files[i])
        return self._files[i]

    def positions(self, seq: SeqInfo) -> np.ndarray:
        """Global token positions this rank holds, shape (n_local,)."""
        return positions(seq.length, self.rank, self.size, self.layout)

    def _read_rows(self, seq: SeqInfo, name: str, pos: np.ndarray, dest: np.ndarray) -> None:
        """Fill ``dest`` (n_local, ...) with rows ``pos`` of dataset ``name`` across the shards."""
        offsets = seq.offsets
        for g0, cnt, step, o in local_runs(pos):
            for i, (f0, n) in enumerate(zip(offsets.tolist(), seq.lengths)):
                # indices t of the run g0 + step*t that fall in [f0, f0 + n)
                lo = max(0, -(-(f0 - g0) // step))
                hi = min(cnt, -(-(f0 + n - g0) // step))
                if lo >= hi:
                    continue
                node = self._file(i)
                ds = node[f"{seq.group}/{name}" if seq.group else name]
                s0 = g0 + step * lo - f0
                self._read_slice(ds, seq.batch, s0, hi - lo, step, dest[o + lo : o + hi], i, name)

    def _read_slice(self, ds, batch, s0, cnt, step, dest, i, name) -> None:
        def sel(a, b, st):
            sl = slice(a, b, st)
            return np.s_[batch, sl] if batch is not None else np.s_[sl]

        try:
            mode = self.strided
            if mode == "auto":  # measured: strided selections over chunked data are slow
                mode = "hyperslab" if ds.chunks is None else "blocks"
            if step == 1 or mode == "hyperslab":
                ds.read_direct(dest, source_sel=sel(s0, s0 + step * (cnt - 1) + 1, step))
                self.bytes_read += dest.nbytes
                return
            # contiguous blocks covering `per` strided rows each, subsampled in memory
            row = max(1, dest[0].nbytes)
            per = max(1, self.block_bytes // (row * step))
            buf = np.empty((per * step,) + dest.shape[1:], dest.dtype)
            for t in range(0, cnt, per):
                k = min(per, cnt - t)
                a = s0 + step * t
                span = step * (k - 1) + 1
                ds.read_direct(buf[:span], source_sel=sel(a, a + span, 1))
                dest[t : t + k] = buf[:span:step]
                self.bytes_read += buf[:span].nbytes
        except (OSError, RuntimeError, ValueError, TypeError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            fail(self.plan.files[i], f"cannot read dataset '{name}' ({msg})")

    def _load_weights(self) -> dict:
        if self._weights is None:
            f = open_input(self.plan.weights)
            try:
                self._weights = {
                    n: np.asarray(f[n][...], dtype=np.float64) for n in ("wq", "wk", "wv")
                }
            finally:
                f.close()
        return self._weights

    def read(self, seq: SeqInfo, check_finite: bool = True) -> tuple:
        """Read this rank's q (n, H, D), k and v (n, Hkv, D) of ``seq`` in the input dtype.

        For features inputs, x (n, F) is read and projected in float64 on this
        rank only, then rounded to the input dtype.
        """
        plan = self.plan
        pos = self.positions(seq)
        n, h, hkv, d = len(pos), plan.heads, plan.kv_heads, plan.head_dim
        dt = np.dtype(plan.dtype)
        if plan.mode == "features":
            x = np.empty((n, plan.features), dt)
            self._read_rows(seq, "x", pos, x)
            w = self._load_weights()
            x64 = x.astype(np.float64)
            q = (x64 @ w["wq"]).astype(dt).reshape(n, h, d)
            k = (x64 @ w["wk"]).astype(dt).reshape(n, hkv, d)
            v = (x64 @ w["wv"]).astype(dt).reshape(n, hkv, d)
            arrays = {"x": x}
        else:
            q = np.empty((n, h, d), dt)
            k = np.empty((n, hkv, d), dt)
            v = np.empty((n, hkv, d), dt)
            for name, a in (("q", q), ("k", k), ("v", v)):
                self._read_rows(seq, name, pos, a)
            arrays = {"q": q, "k": k, "v": v}
        if check_finite:
            for name, a in arrays.items():
                bad = ~np.isfinite(a)
                if bad.any():
                    t = int(pos[np.argwhere(bad)[0][0]])
                    fi = int(np.searchsorted(seq.offsets, t, side="right") - 1)
                    fail(
                        plan.files[fi],
                        f"sequence {seq.name}: '{name}' holds NaN or Inf (token {t})",
                    )
        return q, k, v
