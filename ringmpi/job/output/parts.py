"""HDF5 output: per-rank part files, completion markers, and one virtual-dataset file.

For ``-o OUT.h5`` the run writes, next to it, a directory ``OUT.h5.parts/``:

    manifest.json           what the run is (inputs, layout, ranks, ...), for --resume
    s000003.r00002.h5       rank 2's tokens of sequence 3: out (n, H, D), lse (H, n), pos (n,)
    s000003.done            JSON marker: sequence 3 complete on every rank (sizes, CRC32)

and, once every sequence is complete, ``OUT.h5`` itself: virtual datasets that
stitch the parts into global token order (``out`` (S, H, D) and ``lse`` (H, S),
with a leading batch axis or one group per sequence when the input had them).
No sequence is ever gathered on one rank; rank 0 writes only the mapping.
The virtual datasets have NaN as fill value: ``OUT.h5`` copied without its parts
reads NaN, never zeros (``ringmpi pack`` makes one self-contained file). Their
axes carry dimension labels, the file typed attributes (see :func:`attributes`).

``OUT.h5`` and the parts are a deterministic function of the inputs, the
options, the number of ranks and the software: no time stamp is stored in
them, so a resumed run writes the same bytes as an uninterrupted one (the time
of a run is in the summary JSON). An existing output is only replaced with
``overwrite`` (``--overwrite``) and only continued with ``--resume``.

Every file is written under a temporary name and renamed: a file under a final
name is always complete. Parts and markers are fsync'ed together at most every
``RINGMPI_FSYNC_S`` seconds (:meth:`OutputStore.sync`; the kernel is asked to
start writing each out at once) and always before the output is renamed into
place. A sequence counts as done only when its marker exists; ``--resume``
checks each rank's part against the marker (size and CRC32) and recomputes
anything missing or damaged. The computation is deterministic for
fixed inputs, layout and ranks, so a resumed run gives the same bytes.
Rank 0 starts or reopens the parts folder with :mod:`ringmpi.job.output.parts`.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from typing import Callable, Optional

import numpy as np

from ...collective import run_everywhere, run_on_root
from ...runtime import env
from ...runtime.files import exclusive_temp, fsync_path, write_json
from ..plan import InputError, Plan, value_width
from ..resources import joined
from .layout import crc32_of as _crc32
from .layout import (
    lock_output,
    marker_members,
    open_parts_dir,
    part_name,
    publish_vds,
    unlock_output,
    valid_marker,
    write_arrays,
    write_h5,
    write_vds,
)

__all__ = [
    "OutputStore",
    "fingerprint",
    "COMPRESSION",
    "OURS",
    "FORMAT",
    "plain_attrs",
    "prepare_parts",
    "resume_markers",
]

COMPRESSION = ("gzip", "lzf")


class OutputStore:
    """Collective writer of one run's output (every method is called on all ranks).

    Parameters
    ----------
    path : str
        Final output file (the virtual-dataset file).
    comm : mpi4py communicator or None
    plan : Plan
    meta : dict
        Run description from :func:`fingerprint`; stored in the manifest (what
        ``--resume`` compares).
    attrs : dict, optional
        Typed attributes of the output file (str, bool, int, float or lists of
        str): the run's options and provenance. Default: ``meta`` plus ``format``.
    overwrite : bool
        Replace an existing output (final file or parts of an unfinished run).
    compress : {None, "gzip", "lzf"}
        Compression of the part files (chunked, with the shuffle filter).
    """

    def __init__(
        self,
        path: str,
        comm,
        plan: Plan,
        meta: dict,
        attrs: Optional[dict] = None,
        overwrite: bool = False,
        compress: Optional[str] = None,
        ring=None,
        ring_sizes=None,
    ):
        if compress not in (None,) + COMPRESSION:
            raise InputError(f"compression must be one of {', '.join(COMPRESSION)}, not {compress}")
        self.path = os.path.abspath(path)
        self.parts = self.path + ".parts"
        self.comm, self.plan, self.meta = comm, plan, meta
        self.attrs = attrs if attrs is not None else plain_attrs(meta)
        self.overwrite, self.compress = overwrite, compress
        # a sequence is written by one ring (all ranks unless the job runs several rings):
        # parts are named and laid out by the rank in that ring
        self.ring = comm if ring is None else ring
        self.rank = 0 if self.ring is None else self.ring.Get_rank()
        self.size = 1 if self.ring is None else self.ring.Get_size()
        self.layout = meta["layout"]
        self.batches: dict = {}  # first member -> the members of each batch written or kept
        # ranks of the ring that wrote each sequence (--ring-size auto: per sequence)
        self.ring_sizes = ring_sizes
        self.mine: dict = {}  # first member -> (members, ring size): batches this rank reports
        self.world_rank = 0 if comm is None else comm.Get_rank()
        # files written but not yet fsync'ed (RINGMPI_FSYNC_S): synced together, at most
        # that often and before the output is renamed into place
        try:
            self.sync_every = env.get("RINGMPI_FSYNC_S")
        except ValueError as e:
            raise InputError(str(e)) from None
        self.unsynced: list = []
        self.synced_at = time.monotonic()
        self.ahead: Optional[tuple] = None  # (temporary file, where, nranks): build_ahead

    def sync(self, force: bool = True) -> None:
        """fsync this rank's files written since the last sync, then the parts folder.

        ``force=False``: only when ``RINGMPI_FSYNC_S`` seconds have passed since the
        last one (every time when it is 0).
        """
        due = self.sync_every is None or time.monotonic() - self.synced_at >= self.sync_every
        if not self.unsynced or not (force or due):
            return
        for path in self.unsynced:
            try:
                fsync_path(path)
            except FileNotFoundError:  # replaced since (a resumed batch): nothing to sync
                pass
        fsync_path(self.parts)
        self.unsynced = []
        self.synced_at = time.monotonic()

    def use_ring(self, ring) -> None:
        """Write the next batches from ``ring`` (the job's next phase of ring size)."""
        self.ring = ring
        self.rank, self.size = ring.Get_rank(), ring.Get_size()

    def size_of(self, i: int) -> int:
        """Ranks of the ring that writes (wrote) the batch starting at sequence ``i``."""
        return self.size if self.ring_sizes is None else int(self.ring_sizes[i])

    # -- start -------------------------------------------------------------
    def _prepare_root(self, resume: bool) -> dict:
        """Rank 0: the parts folder started or reopened (:mod:`ringmpi.job.output.parts`)."""
        return prepare_parts(
            self.path, self.plan, self.meta, resume, self.overwrite, self._marker_ok
        )

    def _marker_ok(self, marker, i: int) -> bool:
        """Does ``marker`` describe sequence ``i`` of this plan, in this store's format?"""
        return valid_marker(marker, self.plan.sequences[i].name, self.size_of(i)) and (
            self._members(marker, i) is not None
        )

    def _members(self, marker: dict, i: int) -> Optional[tuple]:
        """The sequences marker ``s<i>.done`` covers (:func:`~.layout.marker_members`)."""
        return marker_members(marker, i, [s.name for s in self.plan.sequences])

    def open(self, resume: bool = False) -> set:
        """Create (or, with ``resume``, reopen) the output; return the indices already done."""
        comm = self.comm
        done = run_on_root(comm, self._prepare_root, resume)

        def visible():
            if not os.path.isfile(os.path.join(self.parts, "manifest.json")):
                raise InputError(
                    f"{self.parts}: not visible on rank {self.rank} "
                    "(the output must be on a file system shared by all ranks)"
                )
            ok = []
            for i, marker in sorted(done.items()):  # every rank checks its ring rank's part
                n = self.size_of(i)
                r = self.world_rank % n  # its rank in the ring that wrote it
                p = os.path.join(self.parts, part_name(i, r))
                ok.append(_crc32(p) == tuple(marker["parts"][r]) and self._attrs_ok(p, i, r, n))
            return ok

        ok = np.array(run_everywhere(comm, visible), dtype=np.int32)
        if comm is not None and len(ok):
            from mpi4py import MPI

            comm.Allreduce(MPI.IN_PLACE, ok, op=MPI.MIN)
        kept = set()
        for i, good in zip(sorted(done), ok.tolist()):
            if good:
                self.batches[i] = self._members(done[i], i)
                kept.update(self.batches[i])
                if self.world_rank == 0:
                    self.mine[i] = (self.batches[i], self.size_of(i))
        return kept

    def _attrs_ok(self, path: str, i: int, rank: int, nranks: int) -> bool:
        """Is part file ``path`` rank ``rank``'s (of ``nranks``) part of sequence ``i``?"""
        import h5py

        try:
            with h5py.File(path, "r", locking=False) as f:
                a = f.attrs
                return (
                    a.get("sequence") == self.plan.sequences[i].name
                    and int(a.get("rank", -1)) == rank
                    and int(a.get("nranks", -1)) == nranks
                    and a.get("layout") == self.layout
                )
        except (OSError, ValueError, TypeError):
            return False

    # -- one sequence --------------------------------------------------------
    def _write_part(self, items: list) -> list:
        """This rank's part of a batch: ``items`` [(i, pos, out, lse), ...] in one file.

        The members' rows follow each other (``out``, ``lse``, ``pos``); a batch of
        more than one also records the member names (``sequences``) and where each
        one's rows start (``rows``, n_members + 1 offsets). Returns [size, CRC32].
        """
        first = items[0][0]
        final = os.path.join(self.parts, part_name(first, self.rank))
        if len(items) == 1:
            _, pos, out, lse = items[0]
        else:
            pos = np.concatenate([it[1] for it in items])
            out = joined([it[2] for it in items], axis=0)
            lse = joined([it[3] for it in items], axis=1)

        arrays = {"out": out, "lse": lse, "pos": pos}
        attrs = {
            "sequence": self.plan.sequences[first].name,
            "rank": self.rank,
            "nranks": self.size,
            "layout": self.layout,
        }
        if len(items) > 1:
            attrs["sequences"] = [self.plan.sequences[it[0]].name for it in items]
            attrs["rows"] = np.cumsum([0] + [len(it[1]) for it in items]).astype(np.int64)

        def fill(f):  # compressed (chunked) datasets: HDF5 writes their bytes
            for name, a in arrays.items():
                f.create_dataset(name, data=a, **self._filters(a))
            for key, value in attrs.items():
                f.attrs[key] = value

        try:
            if self.compress:
                size_crc = write_h5(final, fill, sync=False)
            else:  # the arrays' bytes straight to the file (ringmpi.job.output.layout)
                size_crc = write_arrays(final, arrays, attrs, sync=False)
            self.unsynced.append(final)
            self.sync(force=False)
            return list(size_crc)
        except (OSError, RuntimeError, ValueError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            errno = getattr(e, "errno", None)
            if errno:  # HDF5's text hides the cause after a newline: name it
                msg = f"{os.strerror(errno)}: {msg}"
            raise InputError(
                f"{final}: cannot write output part on rank {self.rank} ({msg})"
            ) from e

    def _filters(self, a: np.ndarray) -> dict:
        """Dataset options for a part array: none, or chunks of ~1 MiB + shuffle + compression."""
        if not self.compress or a.size == 0:
            return {}
        row = max(1, a[0].nbytes if a.ndim > 1 else a.itemsize)
        axis = 1 if a.ndim == 2 else 0  # lse (H, n): chunk along tokens
        n = a.shape[axis]
        rows = int(max(1, min(n, (1 << 20) // (row if axis == 0 else a.itemsize * a.shape[0]))))
        chunks = tuple(rows if d == axis else s for d, s in enumerate(a.shape))
        return {"chunks": chunks, "shuffle": True, "compression": self.compress}

    def write(self, i: int, pos: np.ndarray, out: np.ndarray, lse: np.ndarray) -> None:
        """Write this rank's part of sequence ``i``, then mark it done (collective over the ring).

        Parameters
        ----------
        pos : int64 array (n,)
            Global positions of this rank's tokens.
        out : array (n, H, D)
        lse : array (H, n)
        """
        self.write_batch([(i, pos, out, lse)])

    def write_batch(self, items: list) -> None:
        """Write a batch of sequences: a part file per rank, one marker (collective over the ring).

        ``items``: [(i, pos, out, lse), ...] as for :meth:`write`, the members in
        order. The marker ``s<first>.done`` names every member (``members``: their
        indices, ``names``), so a crash loses at most the batch being written.
        """
        ring = self.ring
        info = run_everywhere(ring, self._write_part, items)
        infos = [info] if ring is None else ring.gather(info, root=0)
        first = items[0][0]
        marker = {"sequence": self.plan.sequences[first].name, "parts": infos}
        if len(items) > 1:
            marker["members"] = [int(it[0]) for it in items]
            marker["names"] = [self.plan.sequences[it[0]].name for it in items]
        self.batches[first] = tuple(int(it[0]) for it in items)
        if self.rank == 0:
            self.mine[first] = (self.batches[first], self.size)
        path = os.path.join(self.parts, f"s{first:06d}.done")

        def mark():
            write_json(path, marker, sync=False)
            self.unsynced.append(path)
            self.sync(force=False)  # the parts and markers of the last RINGMPI_FSYNC_S seconds

        run_on_root(ring, mark)

    # -- end -------------------------------------------------------------------
    def _write_vds(self, where: dict, nranks: Optional[dict] = None) -> None:
        """Rank 0: the virtual-dataset file over the parts (:func:`~.layout.write_vds`)."""
        write_vds(
            self.path,
            self.plan,
            self.attrs,
            self.parts,
            self.size,
            self.layout,
            where,
            nranks=nranks,
        )

    @staticmethod
    def _mapping(every) -> tuple:
        """(sequence -> its batch's members, batch's first member -> its ring size) of
        ``every`` dict {first member: (members, ring size)}."""
        where, nranks = {}, {}
        for batches in every or ():
            for first, (members, n) in batches.items():
                where.update((i, tuple(members)) for i in members)
                nranks[first] = n
        return where, nranks

    def build_ahead(self, batches: list) -> None:
        """Rank 0, while the others compute (not collective): the virtual-dataset file for
        the batches kept by a resume plus ``batches`` [(members, ring size), ...] (every
        batch still to compute), built now under a temporary name in the parts folder.

        :meth:`finish` renames it into place when the batches written are exactly
        these (else it builds the file again). A failure here only leaves it to finish.
        """
        if self.world_rank != 0:
            return
        ahead = {m[0]: (tuple(m), int(r)) for m, r in batches}
        where, nranks = self._mapping([self.mine, ahead])
        try:
            tmp = write_vds(
                self.path,
                self.plan,
                self.attrs,
                self.parts,
                self.size,
                self.layout,
                where,
                nranks=nranks,
                publish=False,
            )
        except Exception:  # noqa: BLE001 - rank 0 alone: finish builds it again, collectively
            return  # (and names the error on every rank)
        self.ahead = (tmp, where, nranks)

    def discard(self) -> None:
        """Remove the file :meth:`build_ahead` left, if any (a job that did not finish)."""
        ahead, self.ahead = self.ahead, None
        if ahead and os.path.isfile(ahead[0]) and not os.path.islink(ahead[0]):
            os.unlink(ahead[0])

    def finish(self) -> None:
        """Rank 0 writes the virtual-dataset file and renames it into place (collective).

        Rank 0 learns every ring's batches with one gather (what each ring's first
        rank wrote, in every phase, and the batches a resume kept).
        """
        run_everywhere(self.comm, self.sync)  # every part durable before the output exists
        every = [self.mine] if self.comm is None else self.comm.gather(self.mine, root=0)
        where, nranks = self._mapping(every)

        def vds():
            try:
                ahead = self.ahead
                if ahead and ahead[1:] == (where, nranks):
                    publish_vds(ahead[0], self.path)
                    self.ahead = None
                else:
                    self.discard()
                    self._write_vds(where, nranks)
            except (OSError, RuntimeError, ValueError) as e:
                raise InputError(f"{self.path}: cannot write output ({e})") from e

        run_on_root(self.comm, vds)
        unlock_output(self.parts)  # a no-op where this process holds no lock


# ----------------------------------------------------------------------
# Opening a run's parts folder on rank 0: a fresh start, or a resume of the same run.
#
# A fresh start refuses to replace an earlier result unasked (``overwrite``) and
# removes everything of an earlier run under a final name; a resume checks that the
# manifest is this run's and keeps the well-formed completion markers.
# :class:`ringmpi.job.output.parts.OutputStore` (and the one-file store) call
# :func:`prepare_parts` from ``open``.


FORMAT = 2  # 2: typed attributes, NaN fill values, dimension labels

# single.h5.tmp: the one-file output being written (ringmpi.job.output.single_file);
# .NAME.<hex>.tmp: the exclusive temporaries of ringmpi.runtime.files.exclusive_temp
# (.index.h5.<hex>.tmp: the output's virtual-dataset file built ahead, OutputStore)
_NAMES = r"(s\d{6}\.(r\d{5}\.h5|done)|manifest\.json|single\.h5|index\.h5)"
OURS = re.compile(rf"^({_NAMES}(\.tmp)?|\.{_NAMES}\.[0-9a-f]{{12}}\.tmp)$")  # what a run writes
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def prepare_parts(
    path: str,
    plan: Plan,
    meta: dict,
    resume: bool,
    overwrite: bool,
    marker_ok: Callable[[dict, int], bool],
) -> dict:
    """Rank 0: check, lock and start (or, with ``resume``, reopen) ``path``'s parts folder.

    Parameters
    ----------
    path : str
        The final output file (absolute); its parts folder is ``path + ".parts"``.
    plan : Plan
        The job's input plan (no input may be the output or lie in its parts folder).
    meta : dict
        The run's description (:func:`ringmpi.job.output.parts.fingerprint`): written as
        the manifest, or compared with the one there on resume.
    resume : bool
        Continue the run whose manifest is there (a fresh start when there is none).
    overwrite : bool
        Replace an existing output or the parts of an unfinished run.
    marker_ok : callable (marker, i) -> bool
        Does a completion marker describe sequence ``i`` in the store's format?

    Returns
    -------
    dict
        {sequence index: marker} of the well-formed markers a resume found ({} otherwise).
    """
    parts = path + ".parts"
    d = os.path.dirname(path)
    if not os.path.isdir(d):
        raise InputError(f"{path}: output directory {d} does not exist")
    for p in plan.files + ([plan.weights] if plan.weights else []):
        if os.path.exists(path) and os.path.samefile(p, path):
            raise InputError(f"{path}: output would overwrite input {p}")
        folder = os.path.dirname(os.path.abspath(p))
        if os.path.isdir(parts) and os.path.samefile(folder, parts):
            raise InputError(f"{path}: input {p} is inside the output's parts folder")
    try:
        manifest = os.path.join(parts, "manifest.json")
        existed = os.path.lexists(parts)
        if existed and not (resume or overwrite) and not os.path.isdir(parts):
            raise InputError(f"{parts}: exists and is not the job's parts folder")
        dfd = open_parts_dir(parts, create=not existed)
        try:
            lock_output(parts, dfd)
            names = os.listdir(dfd)
            if resume and "manifest.json" in names:
                return resume_markers(dfd, manifest, meta, len(plan.sequences), marker_ok)
            # fresh start: never replace an earlier result unasked
            if not overwrite and os.path.lexists(path):
                raise InputError(
                    f"{path}: output exists; use --overwrite to replace it, or another -o"
                )
            if not overwrite and "manifest.json" in names:
                raise InputError(
                    f"{parts}: holds an unfinished run; use --resume to continue it, "
                    "--overwrite to start again, or another -o"
                )
            # nothing stale may survive under a final name (unlink never follows a symlink)
            if os.path.lexists(path):
                os.remove(path)
            for name in names:
                if OURS.match(name):
                    os.unlink(name, dir_fd=dfd)
        finally:
            os.close(dfd)
        fd, probe = exclusive_temp(manifest)  # can we write here at all?
        os.close(fd)
        os.unlink(probe)
        write_json(manifest, meta)
        return {}
    except OSError as e:
        raise InputError(f"{path}: cannot write output ({e.strerror or e})") from e


def resume_markers(
    dfd: int, manifest: str, meta: dict, nseq: int, marker_ok: Callable[[dict, int], bool]
) -> dict:
    """The run's manifest must match ``meta``; {index: marker} of the well-formed markers.

    Parameters
    ----------
    dfd : int
        Open descriptor of the parts folder (names are opened relative to it,
        never through a symlink).
    manifest : str
        The manifest's path, for messages.
    meta : dict
        This run's description; any differing key refuses the resume.
    nseq : int
        Sequences of the plan (markers of other indices are ignored).
    marker_ok : callable (marker, i) -> bool
        Does a marker describe sequence ``i``? (An unreadable or wrong one: redo it.)
    """

    def load(name):
        fd = os.open(name, os.O_RDONLY | _NOFOLLOW, dir_fd=dfd)
        with os.fdopen(fd) as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError("not a regular file")
            return json.loads(fh.read(1 << 24))

    try:
        old = load("manifest.json")
    except (OSError, ValueError) as e:
        raise InputError(f"{manifest}: unreadable ({e}); rerun without --resume") from e
    if not isinstance(old, dict):
        raise InputError(f"{manifest}: not a manifest; rerun without --resume")
    diff = [k for k in sorted(set(old) | set(meta)) if old.get(k) != meta.get(k)]
    if diff:
        raise InputError(
            f"{manifest}: made by a different run (differs in {', '.join(diff)}); "
            "rerun without --resume"
        )
    done = {}
    for name in sorted(os.listdir(dfd)):
        m = re.fullmatch(r"s(\d{6})\.done", name)
        if not m or int(m.group(1)) >= nseq:
            continue
        i = int(m.group(1))
        try:
            marker = load(name)
        except (OSError, ValueError):
            continue  # an unreadable marker means: redo that sequence
        if marker_ok(marker, i):
            done[i] = marker
    return done


def fingerprint(
    plan: Plan, layout: str, causal: bool, scale: Optional[float], nranks: int, ring_size=None
) -> dict:
    """What must match for --resume to reuse finished sequences."""

    def stamp(p):
        st = os.stat(p)  # ctime too: a file rewritten with its mtime reset is a new input
        return [os.path.abspath(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns]

    return {
        "format": FORMAT,
        "inputs": [stamp(p) for p in plan.files],
        "weights": stamp(plan.weights) if plan.weights else None,
        "layout": layout,
        "causal": bool(causal),
        "scale": scale,
        "nranks": nranks,
        "ring_size": nranks if ring_size is None else int(ring_size),
        "dtype": plan.dtype,
        # (H, Hkv, D), and Dv where the values' width differs (issue 42)
        "geometry": [plan.heads, plan.kv_heads, plan.head_dim]
        + ([value_width(plan)] if value_width(plan) != plan.head_dim else []),
        "sequences": [[s.name, s.length] for s in plan.sequences],
        # the masks of slices (issue 41), by (rows, SHA-256 of the sorted table); none: no key
        **_slices_stamp(plan),
    }


def _slices_stamp(plan: Plan) -> dict:
    """``{"slices": {sequence: [rows, sha256]}}`` of the sequences with a mask of slices, or {}."""
    from ..plan import digest, sliced

    got = {s.name: list(digest(sliced(s))) for s in plan.sequences if sliced(s) is not None}
    return {"slices": got} if got else {}


def plain_attrs(meta: dict) -> dict:
    """Attributes from a fingerprint alone: scalars as they are, anything else as JSON."""
    out = {"format": FORMAT}
    for k, v in meta.items():
        if k == "format":
            continue
        ok = isinstance(v, (str, bool, int, float)) and v is not None
        out[k] = v if ok else json.dumps(v)
    return out
