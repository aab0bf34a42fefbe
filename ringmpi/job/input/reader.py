"""Reading one rank's tokens of a sequence from the HDF5 shards, never more than its share.

Each rank reads only its own tokens with hyperslab selections: one slice per
file for the contiguous layout, two for zigzag, one strided selection (or
subsampled contiguous blocks) for striped. Packed sequences (``cu_seqlens``)
give one run per packed sequence and layout chunk: those are read as unions of
hyperslabs, one read per file (per ``UNION_RUNS`` runs). No rank reads or
allocates a whole sequence. Queries and keys/values are placed by the layout
over their own lengths (cross-attention). Rows of contiguous datasets (the
usual case) skip HDF5: their byte ranges are queued and read together, a
batch's members at once (:mod:`ringmpi.job.input.reader`, by ``O_DIRECT`` where the
file system takes it); chunked, compressed, byte-swapped or strided data goes
through HDF5 as described.

The batch job reads the next sequence in a daemon thread (:func:`in_background`):
a read stuck in the file system (a hung NFS server) neither keeps the process
alive at exit nor blocks a SIGTERM; the job waits for it under the watchdog,
which the reader's ``progress`` time (after every read) keeps moving.
``RINGMPI_TEST_READ_STALL_S`` (:mod:`ringmpi.runtime.faults`) emulates such a stuck
read for the tests.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional

import numpy as np

from ...layout import local_runs, positions
from ...rope import apply_rope, positions_in_sequence
from ...runtime import direct_io, faults
from ..plan import Plan, SeqInfo, fail, layout_mask, value_width
from .files import open_input

__all__ = ["Reader", "in_background", "abandon", "UNION_RUNS", "RawReads"]

UNION_RUNS = 64  # unit-stride hyperslabs OR-ed into one selection (measured best: 16-256)
SLAB_BYTES = 256 << 20  # one HDF5 read at most (contiguous runs), so progress is seen


def _project(x64: np.ndarray, w: dict, name: str) -> np.ndarray:
    """x (n, F) @ w{name} (F, width) + b{name} (width,) when the weights file has biases."""
    y = x64 @ w["w" + name]
    b = w.get("b" + name)
    return y if b is None else y + b


class Reader:
    """Reads one rank's tokens of each sequence, never more than its share.

    Parameters
    ----------
    plan : Plan
    rank, size : int
        This rank and the ring size.
    layout : str
        Token layout (see :mod:`ringmpi.layout`).
    strided : {"auto", "hyperslab", "blocks"}
        How a strided (striped layout) selection is read: one strided hyperslab
        per file, or contiguous blocks of ``block_bytes`` subsampled in memory.
        "auto" (default) picks the faster one measured here (benchmarks/read_throughput.py):
        hyperslab for contiguous storage (742 vs 618 MB/s per rank at P=2, cold),
        blocks for chunked/compressed storage (101 vs 32 MB/s), where a strided
        selection makes HDF5 walk every chunk element by element.

    rope : (theta, scale), optional
        Rotate the projected q and k (features inputs) at each token's global
        position (within its packed sequence) with :func:`ringmpi.rope.apply_rope`.
    """

    def __init__(
        self,
        plan: Plan,
        rank: int,
        size: int,
        layout: str,
        strided: str = "auto",
        block_bytes: int = 32 << 20,
        rope: Optional[tuple] = None,
    ):
        self.plan, self.rank, self.size, self.layout = plan, rank, size, layout
        self.strided, self.block_bytes = strided, block_bytes
        self.rope = rope
        self._files: dict = {}
        self.raw = RawReads(plan.files, self._file)  # contiguous datasets: no HDF5 call
        self._weights = None
        self.bytes_read = 0
        self.progress = time.monotonic()  # when the last HDF5 read finished (monotonic)

    def close(self) -> None:
        """Close the open input files."""
        self.raw.close()
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _file(self, i: int):
        if i not in self._files:
            self._files[i] = open_input(self.plan.files[i])
        return self._files[i]

    def positions(self, seq: SeqInfo) -> np.ndarray:
        """Global query positions this rank holds, shape (n_local,)."""
        mask = layout_mask(seq, self.layout)
        return positions(
            seq.length, self.rank, self.size, self.layout, cu_seqlens=seq.cu_seqlens, mask=mask
        )

    def positions_k(self, seq: SeqInfo) -> np.ndarray:
        """Global key/value positions this rank holds, shape (n_local_k,)."""
        cu_k = seq.cu_seqlens if seq.cu_seqlens_k is None else seq.cu_seqlens_k
        mask = layout_mask(seq, self.layout)
        return positions(
            seq.length_k, self.rank, self.size, self.layout, cu_seqlens=cu_k, mask=mask
        )

    def _read_rows(self, seq: SeqInfo, name: str, pos: np.ndarray, dest: np.ndarray) -> None:
        """Fill ``dest`` (n_local, ...) with rows ``pos`` of dataset ``name`` across the shards."""
        kv = name in ("k", "v", "x_kv")
        offsets = seq.offsets_k if kv else seq.offsets
        lengths = seq.lengths if (not kv or seq.lengths_k is None) else seq.lengths_k
        if seq.packed:
            self._read_union(seq, name, pos, dest, offsets, lengths)
            return
        raw = seq.batch is None
        for g0, cnt, step, o in local_runs(pos):
            for i, (f0, n) in enumerate(zip(offsets.tolist(), lengths)):
                # indices t of the run g0 + step*t that fall in [f0, f0 + n)
                lo = max(0, -(-(f0 - g0) // step))
                hi = min(cnt, -(-(f0 + n - g0) // step))
                if lo >= hi:
                    continue
                path = f"{seq.group}/{name}" if seq.group else name
                s0 = g0 + step * lo - f0
                part = dest[o + lo : o + hi]
                if raw and step == 1 and self.raw.add(seq, i, name, s0, part):
                    continue  # read by flush()
                # HDF5 reads into C-contiguous arrays only (a head-major buffer's view: a copy)
                into = part if part.flags.c_contiguous else np.empty(part.shape, part.dtype)
                whole = step == 1 and s0 == 0 and hi - lo == n and seq.batch is None
                whole = whole and into.nbytes <= SLAB_BYTES
                if not (whole and self._read_whole(i, path, into, name)):
                    ds = self._file(i)[path]
                    self._read_slice(ds, seq.batch, s0, hi - lo, step, into, i, name)
                if into is not part:
                    part[...] = into

    def _read_whole(self, i: int, path: str, dest: np.ndarray, name: str) -> bool:
        """All of dataset ``path`` of shard ``i`` into ``dest`` in one low-level call (a rank
        holding whole sequences: 75 vs 300 us of Dataset + read_direct for (128, 4, 64)
        float32); False (nothing read) when the shapes differ."""
        from h5py import h5d, h5s

        try:
            dsid = h5d.open(self._file(i).id, path.encode())
            if tuple(dsid.shape) != dest.shape or not dest.flags.c_contiguous:
                return False
            dsid.read(h5s.ALL, h5s.ALL, dest)
        except (OSError, RuntimeError, ValueError, TypeError, KeyError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            fail(self.plan.files[i], f"cannot read dataset '{name}' ({msg})")
        self.bytes_read += dest.nbytes
        self.progress = time.monotonic()
        return True

    def _read_union(self, seq, name, pos, dest, offsets, lengths) -> None:
        """Packed sequences: per file, the rows ``pos`` as unions of unit-stride hyperslabs.

        ``pos`` is increasing (the layout keeps each rank's positions in order), so
        HDF5 returns a union's rows in the order of ``dest``. Up to ``UNION_RUNS``
        unit-stride runs go into one selection; a strided run (striped layout) is
        read on its own, since HDF5 builds unions of strided hyperslabs element
        by element (measured: 1M tokens in 10k packed sequences, 4 ranks, striped:
        12.8 s with unions of 256 runs, 0.4 s per run; zigzag: 1.7 s with unions
        of 256 runs vs 2.5 s per run through read_direct).
        """
        from h5py import h5s

        path = f"{seq.group}/{name}" if seq.group else name
        for i, (f0, n) in enumerate(zip(offsets.tolist(), lengths)):
            a, b = np.searchsorted(pos, [f0, f0 + n])
            if a >= b:
                continue
            ds = self._file(i)[path]
            rest = tuple(ds.shape[1:])
            ones, zeros = (1,) * len(rest), (0,) * len(rest)
            runs_ = local_runs(pos[a:b] - f0)
            if all(r[2] == 1 or r[1] == 1 for r in runs_) and all(
                self.raw.add(seq, i, name, s0, dest[a + o : a + o + cnt]) for s0, cnt, _, o in runs_
            ):  # unit-stride runs of a contiguous dataset: read by flush()
                continue
            groups, cur = [], []
            for r in runs_:
                if r[2] > 1 and r[1] > 1:  # strided: alone
                    groups += [cur, [r]] if cur else [[r]]
                    cur = []
                else:
                    cur.append(r)
                    if len(cur) == UNION_RUNS:
                        groups.append(cur)
                        cur = []
            if cur:
                groups.append(cur)
            try:
                fspace = ds.id.get_space()
                for part in groups:
                    fspace.select_none()
                    for s0, cnt, step, _ in part:
                        st = step if cnt > 1 else 1
                        fspace.select_hyperslab(
                            (s0,) + zeros,
                            (cnt,) + ones,
                            (st,) + ones,
                            (1,) + rest,
                            op=h5s.SELECT_OR,
                        )
                    lo = a + part[0][3]
                    out = dest[lo : a + part[-1][3] + part[-1][1]]
                    into = out if out.flags.c_contiguous else np.empty(out.shape, out.dtype)
                    ds.id.read(h5s.create_simple(out.shape), fspace, into)
                    if into is not out:
                        out[...] = into
                    self.bytes_read += out.nbytes
                    self.progress = time.monotonic()
            except (OSError, RuntimeError, ValueError, TypeError) as e:
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                fail(self.plan.files[i], f"cannot read dataset '{name}' ({msg})")

    def _read_slice(self, ds, batch, s0, cnt, step, dest, i, name) -> None:
        def sel(a, b, st):
            sl = slice(a, b, st)
            return np.s_[batch, sl] if batch is not None else np.s_[sl]

        try:
            mode = self.strided
            if mode == "auto":  # measured: strided selections over chunked data are slow
                mode = "hyperslab" if ds.chunks is None else "blocks"
            if step == 1 or mode == "hyperslab":
                # slabs of SLAB_BYTES: the watchdog sees progress at least that often
                rows = max(1, SLAB_BYTES // max(1, dest[0].nbytes))
                for t in range(0, cnt, rows):
                    k = min(rows, cnt - t)
                    a = s0 + step * t
                    ds.read_direct(dest[t : t + k], source_sel=sel(a, a + step * (k - 1) + 1, step))
                    self.bytes_read += dest[t : t + k].nbytes
                    self.progress = time.monotonic()
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
                self.progress = time.monotonic()
        except (OSError, RuntimeError, ValueError, TypeError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            fail(self.plan.files[i], f"cannot read dataset '{name}' ({msg})")

    def _load_weights(self) -> dict:
        if self._weights is None:
            f = open_input(self.plan.weights)
            try:
                names = ("wq", "wk", "wv") + tuple(b for b in ("bq", "bk", "bv") if b in f)
                self._weights = {n: np.asarray(f[n][...], dtype=np.float64) for n in names}
            finally:
                f.close()
        return self._weights

    def read(self, seq: SeqInfo, check_finite: bool = True, into: Optional[tuple] = None) -> tuple:
        """Read this rank's q (n, H, D), k and v (n_k, Hkv, D) of ``seq`` in the input dtype.

        For features inputs, x (n, F) (and x_kv (n_k, F) for cross-attention) is
        read and projected in float64 on this rank only (x @ w + b, with biases
        when the weights file has them), rotated (``rope``) in float64, then
        rounded to the input dtype. ``into``: (q, k, v) arrays of those shapes
        and dtype (e.g. views of a batch's buffers) that receive the values and
        are returned.
        """
        return self.read_many([seq], check_finite, [into])[0]

    def read_many(self, seqs: list, check_finite: bool = True, intos=None) -> list:
        """:meth:`read` of each of ``seqs`` (``intos``: their ``into``), the contiguous
        datasets' rows of all of them fetched together (:class:`RawReads`)."""
        self.progress = time.monotonic()
        got = [self._fill(s, into) for s, into in zip(seqs, intos or [None] * len(seqs))]
        self._flush()
        if check_finite:
            for s, (_, arrays, pos, pos_k) in zip(seqs, got):
                self._check_finite(s, arrays, pos, pos_k)
        return [qkv for qkv, *_ in got]

    def _flush(self) -> None:
        """Read what :class:`RawReads` queued; a failure names the file."""
        err = self.raw.flush(self._moved)
        if err is not None:
            i, e = err
            fail(self.plan.files[i], f"cannot read its data ({e.strerror or e})")

    def _moved(self, nbytes: int) -> None:
        self.bytes_read += nbytes
        self.progress = time.monotonic()

    def _fill(self, seq: SeqInfo, into: Optional[tuple]) -> tuple:
        """((q, k, v), {name: array read}, pos, pos_k); raw reads stay queued (qkv inputs)."""
        plan = self.plan
        faults.read(self.rank)
        pos, pos_k = self.positions(seq), self.positions_k(seq)
        n, nk, h, hkv, d = len(pos), len(pos_k), plan.heads, plan.kv_heads, plan.head_dim
        dv = value_width(plan)  # the value width (Dv may differ from Dk = d)
        dt = np.dtype(plan.dtype)
        if plan.mode == "features":
            x = np.empty((n, plan.features), dt)
            self._read_rows(seq, "x", pos, x)
            arrays = {"x": x}
            xk = x
            if seq.x_kv:
                xk = np.empty((nk, plan.features), dt)
                self._read_rows(seq, "x_kv", pos_k, xk)
                arrays["x_kv"] = xk
            self._flush()  # the projection needs them now
            w = self._load_weights()
            x64, xk64 = x.astype(np.float64), xk.astype(np.float64)
            q = _project(x64, w, "q").reshape(n, h, d)
            k = _project(xk64, w, "k").reshape(nk, hkv, d)
            v = _project(xk64, w, "v").astype(dt).reshape(nk, hkv, dv)
            if self.rope is not None:
                theta, scale = self.rope
                cu_k = seq.cu_seqlens if seq.cu_seqlens_k is None else seq.cu_seqlens_k
                q = apply_rope(q, positions_in_sequence(pos, seq.cu_seqlens), theta, scale)
                k = apply_rope(k, positions_in_sequence(pos_k, cu_k), theta, scale)
            q, k = q.astype(dt), k.astype(dt)
            if into is not None:
                for dst, src in zip(into, (q, k, v)):
                    dst[...] = src
                q, k, v = into
        else:
            want = ((n, h, d), (nk, hkv, d), (nk, hkv, dv))
            q, k, v = into if into is not None else (np.empty(w, dt) for w in want)
            if (q.shape, k.shape, v.shape) != want or {q.dtype, k.dtype, v.dtype} != {dt}:
                raise ValueError(f"into= must be arrays of shapes {want} and dtype {dt}")
            for name, a in (("q", q), ("k", k), ("v", v)):
                self._read_rows(seq, name, pos if name == "q" else pos_k, a)
            arrays = {"q": q, "k": k, "v": v}
        return (q, k, v), arrays, pos, pos_k

    def _check_finite(self, seq: SeqInfo, arrays: dict, pos, pos_k) -> None:
        for name, a in arrays.items():
            bad = ~np.isfinite(a)
            if bad.any():
                kv = name in ("k", "v", "x_kv")
                t = int((pos_k if kv else pos)[np.argwhere(bad)[0][0]])
                offs = seq.offsets_k if kv else seq.offsets
                fi = int(np.searchsorted(offs, t, side="right") - 1)
                fail(
                    self.plan.files[fi],
                    f"sequence {seq.name}: '{name}' holds NaN or Inf (token {t})",
                )


# ----------------------------------------------------------------------
# The batch job's background reads: a daemon thread per read, and a sure exit when one sticks.
#
# A read stuck in the file system (a hung NFS server) must neither keep the
# process alive at exit nor block a SIGTERM: :func:`in_background` runs each read
# in a daemon thread, and :func:`abandon` makes sure the process still ends when
# such a read is left behind.


def in_background(fn, *args) -> Future:
    """Call ``fn(*args)`` in a new daemon thread; its Future (result or exception).

    A daemon thread, not a ThreadPoolExecutor's worker: those are joined when the
    interpreter exits, so a read stuck in the file system would keep the process
    (and the MPI job) alive forever after a SIGTERM.
    """
    fut: Future = Future()

    def work():
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            fut.set_exception(e)

    threading.Thread(target=work, name="ringmpi-read", daemon=True).start()
    return fut


def abandon(code: int, pending: list, grace: float = 30.0) -> None:
    """Reads are left running, maybe stuck in HDF5: make sure the process still ends.

    A stuck reader holds h5py's global lock, so freeing any h5py object at
    interpreter exit (or in a garbage collection) would wait for it forever. While
    a read of ``pending`` is unfinished, the process ends at exit with
    ``os._exit(code)`` (stdout and stderr flushed) before those objects are
    collected, and a daemon timer does the same after ``grace`` seconds should the
    main thread get stuck on the lock first. Once the reads have finished, neither
    does anything.

    Parameters
    ----------
    code : int
        The exit status (128 + the signal number after a SIGTERM/SIGINT).
    pending : list of concurrent.futures.Future
        The reads left running.
    grace : float
        Seconds before the timer ends the process regardless.
    """
    import atexit
    import sys

    def bye():
        if all(f.done() for f in pending):
            return
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)

    atexit.register(bye)
    timer = threading.Timer(grace, bye)
    timer.daemon = True
    timer.start()


# ----------------------------------------------------------------------
# Reads of contiguous input datasets straight from the file: queued, then gathered.
#
# The plan records where each contiguous dataset's bytes lie in its file
# (:func:`raw_offset`: contiguous storage of exactly its
# elements, in the machine's byte order, inside the file, checked by the scan).
# Rows of such a dataset are bytes ``[offset + row0 * row, ...)``, so the reader
# does not need HDF5 to fetch them: :class:`RawReads` queues every range a batch
# needs (all members, q, k and v) and :meth:`RawReads.flush` reads each file's
# ranges in as few transfers as their layout allows
# (:func:`ringmpi.runtime.direct_io.gather`): by ``O_DIRECT`` where the file system takes
# it and the batch is a megabyte or more, else with ordinary reads on the
# descriptor h5py opened (the file the trust checks accepted).
#
# Measured on the 2,000-sequence benchmark set (2 ranks, rings of one): HDF5's
# reads cost each rank about a second of CPU per GB (the page cache), about as
# much as the tiles lose to it; gathered direct reads cost a memory copy.


class RawReads:
    """The raw reads of one :class:`ringmpi.job.input.reader.Reader`.

    Parameters
    ----------
    paths : list of str
        The input files (the plan's).
    h5file : callable
        ``h5file(i)``: the open h5py File of shard ``i`` (the reader's, trust-checked).
    """

    def __init__(self, paths: list, h5file: Callable) -> None:
        self.paths, self.h5file = paths, h5file
        self.pending: dict = {}  # shard -> [(offset, dest), ...]
        self.direct: dict = {}  # shard -> O_DIRECT descriptor of the same file, or None
        self.sec2: dict = {}  # shard -> h5py reads it with the POSIX driver (a plain fd)

    def add(self, seq, i: int, name: str, row0: int, dest: np.ndarray) -> bool:
        """Queue rows ``[row0, row0 + len(dest))`` of dataset ``name`` of ``seq`` in shard ``i``
        into ``dest`` (any strides: a head-major buffer's token-major view takes them
        transposed); False (nothing queued) when their bytes' place is not known."""
        storage = seq.storage
        if storage is None:
            return False
        off = storage[i].get(name)
        if off is None:
            return False
        if i not in self.sec2:
            self.sec2[i] = self.h5file(i).driver == "sec2"
        if not self.sec2[i]:
            return False
        if len(dest):
            self.pending.setdefault(i, []).append((off + row0 * dest[0].nbytes, dest))
        return True

    def flush(self, progress: Callable[[int], None]) -> Optional[tuple]:
        """Read everything queued; ``progress(nbytes)`` after every transfer.

        Returns None, or (shard, OSError) for the first shard whose read failed (the
        caller names the file).
        """
        pending, self.pending = self.pending, {}
        for i, ranges in pending.items():
            total = sum(d.nbytes for _, d in ranges)
            fd = self._direct_fd(i) if total >= direct_io.MIN_BYTES else None
            try:
                if fd is not None:
                    try:
                        direct_io.gather(fd, ranges, True, progress=lambda: progress(0))
                        progress(total)
                        continue
                    except direct_io.DirectUnsupported:
                        os.close(fd)
                        self.direct[i] = None
                plain = self.h5file(i).id.get_vfd_handle()
                direct_io.gather(plain, ranges, False, progress=lambda: progress(0))
                progress(total)
            except OSError as e:
                return i, e
        return None

    def _direct_fd(self, i: int) -> Optional[int]:
        """An ``O_DIRECT`` descriptor of shard ``i`` (the very file h5py has open), or None."""
        if i not in self.direct:
            like = self.h5file(i).id.get_vfd_handle()
            self.direct[i] = direct_io.open_read(self.paths[i], like)
        return self.direct[i]

    def close(self) -> None:
        """Close the ``O_DIRECT`` descriptors (the h5py files are the reader's)."""
        for fd in self.direct.values():
            if fd is not None:
                os.close(fd)
        self.direct.clear()
        self.pending.clear()
