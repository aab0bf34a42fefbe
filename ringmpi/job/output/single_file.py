"""One output file written by all ranks together: parallel HDF5 (h5py's driver "mpio").

``ringmpi run --output-mode single`` (and ``auto`` where h5py has MPI) writes
``OUT.h5`` itself instead of per-rank part files and a virtual-dataset file:

    OUT.h5.parts/manifest.json        what the run is, for --resume (as for part files)
    OUT.h5.parts/single.h5.tmp        the file being written, renamed to OUT.h5 when complete
    OUT.h5.parts/s000003.done         JSON marker: sequence 3 written and flushed by every rank

The file has the groups, datasets (``out`` (S, H, D), ``lse`` (H, S), or with a
leading batch axis), attributes, dimension labels and NaN fill value of the
part-file output; with ``--compress`` the datasets are chunked with shuffle and
the filter. Every dataset is created collectively when the file is created, so
later writes touch only raw data (and, compressed, the chunk index). Per
sequence every rank writes its own tokens in one collective H5Dwrite per dataset
(the file selection is the union of its position runs, whatever the layout),
then the file is flushed (MPI_File_sync) and the ring's rank 0 writes the marker
holding each rank's token count and CRC32 of the positions and of the bytes it
wrote. A marker therefore certifies data that reached the file; ``--resume``
reopens the temporary file, reads every marked sequence's rows back on each rank
and keeps only those whose CRC32 still matches: a crash mid-sequence leaves no
marker (or one that no longer matches) and that sequence is written again. A
temporary file HDF5 cannot reopen is started afresh. When every sequence is
written the file is closed collectively, fsync'ed and renamed by rank 0.

No time stamps are stored (``track_times`` off for groups and datasets), so an
interrupted and resumed run writes the same bytes as an uninterrupted one (for
uncompressed output; compressed chunks may land elsewhere in the file, the
values are the same).

Needs h5py built with MPI on the same MPI library as mpi4py (:func:`~.mpio_status`);
one ring of all ranks (``--ring-size`` equal to the number of ranks).
"""

from __future__ import annotations

import os
import sys
import time
import zlib
from typing import Optional

import numpy as np

from ...collective import run_everywhere, run_on_root
from ...layout import local_runs, positions
from ...runtime import faults
from ...runtime.files import fsync_path, write_json
from ...runtime.watchdog import watch
from ..plan import InputError, layout_mask, value_width
from .layout import label_dims, unlock_output, write_offsets
from .parts import OutputStore

__all__ = [
    "SingleFileStore",
    "crc",
    "runs",
    "selection",
    "dxpl",
    "collective_io",
]

EXIT_IO = 1  # exit status of a job aborted by a failed parallel-HDF5 step
TMP_NAME = "single.h5.tmp"


class SingleFileStore(OutputStore):
    """Collective writer of one HDF5 output file (driver "mpio"); interface of OutputStore.

    Parameters are those of :class:`ringmpi.job.output.parts.OutputStore`; ``ring`` must be
    ``comm`` (one ring). ``meta`` gains ``"output": "single"``, so ``--resume``
    never mixes the two modes.
    """

    mode = "single"

    def __init__(self, path, comm, plan, meta, **kw):
        super().__init__(path, comm, plan, dict(meta, output="single"), **kw)
        if self.ring is not comm:
            raise InputError("--output-mode single needs one ring of all ranks")
        self.tmp = os.path.join(self.parts, TMP_NAME)
        self.f = None
        self.complete = False

    # -- layout of the file ------------------------------------------------------
    def _where(self, i: int):
        """(h5py node, leading index) of sequence ``i``'s ``out`` and ``lse``."""
        if self.plan.structure == "batch":
            return self.f, (i,)
        g = self.plan.sequences[i].group
        return (self.f[g] if g else self.f), ()

    def _dset_kw(self, shape: tuple, axis: int, dtype) -> dict:
        """Creation options: no time stamp, NaN fill; compressed: ~1 MiB chunks along tokens."""
        kw = {"track_times": False, "fillvalue": np.dtype(dtype).type(np.nan)}
        if self.compress:
            batch = self.plan.structure == "batch"
            other = [s for k, s in enumerate(shape) if k != axis and not (batch and k == 0)]
            per_token = np.dtype(dtype).itemsize * int(np.prod(other))
            rows = int(max(1, min(shape[axis], (1 << 20) // max(per_token, 1))))
            chunks = [rows if k == axis else s for k, s in enumerate(shape)]
            if batch:
                chunks[0] = 1
            kw.update(chunks=tuple(chunks), shuffle=True, compression=self.compress)
        return kw

    def _group(self, name: str):
        """Create group ``name`` (and its parents) without time stamps; return it."""
        import h5py

        node = self.f
        for part in [p for p in name.split("/") if p]:
            if part not in node:
                gcpl = h5py.h5p.create(h5py.h5p.GROUP_CREATE)
                gcpl.set_obj_track_times(False)
                h5py.h5g.create(node.id, part.encode(), gcpl=gcpl)
            node = node[part]
        return node

    def _create(self) -> None:
        """Create the temporary file with every group, dataset and attribute (collective)."""
        import h5py

        plan = self.plan
        h, d = plan.heads, value_width(plan)  # out has the value width
        dt = np.dtype(plan.dtype)
        lt = np.dtype(np.float64 if dt == np.float64 else np.float32)
        fapl_kw = {"driver": "mpio", "comm": self.comm, "libver": "earliest"}
        self.f = f = h5py.File(self.tmp, "w", **fapl_kw)
        for key, val in self.attrs.items():
            f.attrs[key] = val
        f.attrs["structure"] = plan.structure
        if plan.structure == "batch":
            b, s = len(plan.sequences), plan.sequences[0].length
            f.create_dataset("out", (b, s, h, d), dt, **self._dset_kw((b, s, h, d), 1, dt))
            f.create_dataset("lse", (b, h, s), lt, **self._dset_kw((b, h, s), 2, lt))
            label_dims(f, batch=True)
        else:
            for seq in plan.sequences:
                node = self._group(seq.group) if seq.group else f
                s = seq.length
                node.create_dataset("out", (s, h, d), dt, **self._dset_kw((s, h, d), 0, dt))
                node.create_dataset("lse", (h, s), lt, **self._dset_kw((h, s), 1, lt))
                label_dims(node, batch=False)
        write_offsets(f, plan)  # every rank, same data (collective metadata)
        f.flush()

    # -- start ----------------------------------------------------------------------
    def _my_positions(self, i: int) -> np.ndarray:
        seq = self.plan.sequences[i]
        mask = layout_mask(seq, self.layout)
        return positions(
            seq.length, self.rank, self.size, self.layout, cu_seqlens=seq.cu_seqlens, mask=mask
        )

    def _marker_ok(self, marker, i: int) -> bool:
        """Is ``marker`` a one-file marker of sequence ``i`` with one entry per rank?"""
        if not isinstance(marker, dict):
            return False
        ranks = marker.get("ranks")
        return (
            marker.get("sequence") == self.plan.sequences[i].name
            and marker.get("output") == "single"
            and isinstance(ranks, list)
            and len(ranks) == self.size
        )

    def _new_tmp(self) -> None:
        """Create the (empty) temporary file exclusively: HDF5 then opens this file, ours."""
        if os.path.lexists(self.tmp):
            os.remove(self.tmp)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        os.close(os.open(self.tmp, flags, 0o644))

    def _state_root(self, resume: bool) -> tuple:
        """Rank 0: prepare the directory (as for part files); what exists of the file."""
        markers = self._prepare_root(resume)
        if not resume:
            self._new_tmp()
            return {}, "create"
        if os.path.islink(self.tmp):
            os.remove(self.tmp)  # never reopen through a symlink
        if os.path.exists(self.tmp):
            return markers, "reopen"
        n = len(self.plan.sequences)
        if os.path.isfile(self.path) and sorted(markers) == list(range(n)):
            return markers, "complete"
        # no temporary file (or no complete output): nothing written survives
        for i in markers:
            os.remove(os.path.join(self.parts, f"s{i:06d}.done"))
        self._new_tmp()
        return {}, "create"

    def open(self, resume: bool = False) -> set:
        """Create (or, with ``resume``, reopen) the file; return the indices already done."""
        comm = self.comm
        markers, state = run_on_root(comm, self._state_root, resume)

        def visible():
            if not os.path.isfile(os.path.join(self.parts, "manifest.json")):
                raise InputError(
                    f"{self.parts}: not visible on rank {self.rank} "
                    "(the output must be on a file system shared by all ranks)"
                )

        run_everywhere(comm, visible)
        if state == "complete":
            self.complete = True
            return set(markers)
        if state == "reopen":
            import h5py

            def reopen():
                self.f = h5py.File(self.tmp, "r+", driver="mpio", comm=comm)

            try:
                with watch("reopening the output file collectively"):
                    run_everywhere(comm, reopen)
            except InputError:
                raise
            except Exception:  # noqa: BLE001 - a torn temporary file: start it again
                if self.f is not None:
                    self.f.close()
                self.f = None
                state, markers = "create", {}
                run_on_root(comm, self._discard, list(range(len(self.plan.sequences))))
        if state == "create":
            self._run_io(self._create, "cannot create output")
            return set()
        ok = np.array([self._intact(i, m) for i, m in sorted(markers.items())], dtype=np.int32)
        if len(ok):
            from mpi4py import MPI

            comm.Allreduce(MPI.IN_PLACE, ok, op=MPI.MIN)
        good = {i for i, g in zip(sorted(markers), ok.tolist()) if g}
        run_on_root(comm, self._discard, sorted(set(markers) - good))
        return good

    def _discard(self, indices: list) -> None:
        """Rank 0: remove the markers of ``indices`` (and a temporary file HDF5 cannot open)."""
        for i in indices:
            p = os.path.join(self.parts, f"s{i:06d}.done")
            if os.path.exists(p):
                os.remove(p)
        if self.f is None and os.path.exists(self.tmp):
            os.remove(self.tmp)

    def _intact(self, i: int, marker: dict) -> bool:
        """Does this rank's part of marked sequence ``i`` read back with the marker's CRC32?"""
        try:
            n, crc_pos, crc_data = marker["ranks"][self.rank]
        except (KeyError, IndexError, TypeError, ValueError):
            n = crc_pos = crc_data = None
        pos = np.sort(self._my_positions(i))
        node, lead = self._where(i)
        with watch(f"reading back sequence {i} collectively"):
            out = collective_io(node["out"], lead, pos, len(lead), None)
            lse = collective_io(node["lse"], lead, pos, len(lead) + 1, None)
        return n == len(pos) and crc_pos == crc(pos) and crc_data == crc(out, lse)

    # -- one sequence ----------------------------------------------------------------------
    def _run_io(self, fn, what: str, *args):
        """Run a collective parallel-HDF5 step; a failure on any rank aborts the job.

        A failure cannot be agreed on like other errors: the other ranks may be
        blocked inside the same collective HDF5 call (a full disk fails the fill of a
        new dataset, or a write, on one rank only). So the failing rank prints one
        line and calls MPI_Abort: non-zero exit, no hang, nothing under the final
        name (the unfinished file stays in the parts folder for --resume).
        """
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - any failure inside a collective HDF5 call
            text = f"{type(e).__name__}: {e}".splitlines()[0]
            sys.stderr.write(
                f"ringmpi: error on rank {self.rank}: {self.path}: {what} ({text}); aborting "
                f"the job: nothing under the final name, the unfinished file is {self.tmp}\n"
            )
            sys.stderr.flush()
            time.sleep(0.3)  # let the launcher forward the line before the abort
            self.comm.Abort(EXIT_IO)
            raise  # pragma: no cover - Abort does not return

    def write(self, i: int, pos: np.ndarray, out: np.ndarray, lse: np.ndarray) -> None:
        """Write this rank's tokens of sequence ``i``, flush, then mark it done (collective).

        Parameters
        ----------
        pos : int64 array (n,)
            Global positions of this rank's tokens (any order).
        out : array (n, H, D)
        lse : array (H, n)
        """
        order = np.argsort(pos, kind="stable")
        pos = np.asarray(pos)[order]
        node, lead = self._where(i)
        do, dl = node["out"], node["lse"]
        out = np.asarray(out)[order].astype(do.dtype, copy=False)
        lse = np.asarray(lse)[:, order].astype(dl.dtype, copy=False)

        def rows():
            with watch(f"the collective HDF5 write of sequence {i}"):
                collective_io(do, lead, pos, len(lead), out)
                collective_io(dl, lead, pos, len(lead) + 1, lse)
                faults.rows_written(self.rank, i)
                self.f.flush()  # MPI_File_sync: the rows are in the file before any marker
            return [len(pos), crc(pos), crc(out, lse)]

        info = self._run_io(rows, f"cannot write sequence {self.plan.sequences[i].name}")
        infos = self.comm.gather(info, root=0)
        marker = {"sequence": self.plan.sequences[i].name, "ranks": infos, "output": "single"}
        path = os.path.join(self.parts, f"s{i:06d}.done")
        run_on_root(self.comm, write_json, path, marker)

    def write_batch(self, items: list) -> None:
        """Write a batch's sequences one collective write each (every one flushed and marked).

        One file holds every sequence here, so a batch saves no files; the
        per-sequence markers keep --resume exact (a batch's write is not one step).
        """
        for i, pos, out, lse in items:
            self.write(i, pos, out, lse)

    # -- end ---------------------------------------------------------------------------------
    def finish(self) -> None:
        """Close the file collectively; rank 0 fsyncs it and renames it into place."""
        if self.complete:
            unlock_output(self.parts)
            return
        self._run_io(self.f.close, "cannot close output")
        self.f = None

        def rename():
            try:
                fsync_path(self.tmp)
                os.replace(self.tmp, self.path)
                fsync_path(os.path.dirname(self.path))
            except OSError as e:
                raise InputError(f"{self.path}: cannot write output ({e.strerror or e})") from e

        run_on_root(self.comm, rename)
        unlock_output(self.parts)  # a no-op where this process holds no lock


# ----------------------------------------------------------------------
# The one-file output's parallel HDF5 transfers: token selections and collective I/O.
#
# A rank's tokens of a sequence are a few arithmetic runs of global positions
# (:func:`ringmpi.layout.local_runs`); :func:`selection` turns them into one
# file dataspace (hyperslabs OR-ed together) and :func:`collective_io` writes (or
# reads) them in one collective MPI-IO call. Used by :mod:`ringmpi.job.output.single_file`.


def crc(*arrays) -> int:
    """CRC-32 of the arrays' bytes, one after another (the markers' checksums)."""
    crc = 0
    for a in arrays:
        crc = zlib.crc32(memoryview(np.ascontiguousarray(a)).cast("B"), crc)
    return crc


def runs(pos: np.ndarray) -> list:
    """Sorted positions as arithmetic runs (first, count, step)."""
    return [(first, cnt, step) for first, cnt, step, _ in local_runs(pos)]


def selection(dset, lead: tuple, pos: np.ndarray, axis: int):
    """File dataspace selecting tokens ``pos`` (sorted) along ``axis``, at index ``lead``."""
    import h5py

    space = dset.id.get_space()
    space.select_none()
    shape = dset.shape
    for first, cnt, step in runs(pos):
        start = [0] * len(shape)
        count = [1] * len(shape)
        block = list(shape)
        for d, b in enumerate(lead):
            start[d], block[d] = b, 1
        start[axis], count[axis], block[axis] = first, cnt, 1
        stride = [1] * len(shape)
        stride[axis] = max(step, 1)
        space.select_hyperslab(
            tuple(start), tuple(count), tuple(stride), tuple(block), op=h5py.h5s.SELECT_OR
        )
    return space


def dxpl():
    """A collective MPI-IO transfer property list."""
    import h5py

    dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
    dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_COLLECTIVE)  # filtered (compressed) writes need it
    return dxpl


def collective_io(dset, lead: tuple, pos: np.ndarray, axis: int, arr: Optional[np.ndarray]):
    """Collective write of ``arr`` (or read, ``arr`` None) at tokens ``pos`` of ``dset``."""
    import h5py

    fspace = selection(dset, lead, pos, axis)
    shape = list(dset.shape[len(lead) :])
    shape[axis - len(lead)] = len(pos)
    buf = np.empty(shape, dtype=dset.dtype) if arr is None else np.ascontiguousarray(arr)
    mem = buf
    mspace = h5py.h5s.create_simple(tuple(shape) if buf.size else (1,))
    if not buf.size:  # a rank without tokens still takes part in the collective call
        mspace.select_none()
        mem = np.zeros(1, dtype=dset.dtype)
    if arr is None:
        dset.id.read(mspace, fspace, mem, dxpl=dxpl())
    else:
        dset.id.write(mspace, fspace, mem, dxpl=dxpl())
    return buf
