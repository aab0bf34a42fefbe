"""Probe: one HDF5 file per run written collectively by all ranks (driver "mpio").

A proof for wiring parallel HDF5 output into ``ringmpi run``; it does not touch
the job modules. Each rank owns the tokens ``ringmpi.positions(S, rank, P, layout)``
of every sequence and writes its rows of ``out`` (S, H, D) and its columns of
``lse`` (H, S) with ONE write call per dataset: the file selection is the union of
the rank's token runs (two for zigzag), the memory selection the rank's local
array. Written under ``NAME.tmp``, closed collectively, renamed by rank 0, then
read back by every rank (its own rows, collectively) and by rank 0 (everything).

Run under an MPI whose h5py has MPI (Debian: python3-h5py-mpi inside mpiexec):

    mpiexec -n P python tests/cluster/mpio_probe.py DIR            # the cases
    mpiexec -n P python tests/cluster/mpio_probe.py DIR --phase crash
    mpiexec -n P python tests/cluster/mpio_probe.py DIR --phase resume

``crash`` allocates every sequence up front, writes and flushes sequence 0, writes
half of sequence 1 and ends every rank with os._exit (no close); ``resume`` reopens
the same temporary file with mode "r+", checks sequence 0, rewrites sequence 1, and
renames. Rank 0 prints one ``PROBE`` line per case and the process exits 1 when a
case that should work did not (expected refusals are listed as such).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import h5py
import numpy as np
from mpi4py import MPI

from ringmpi.layout import positions

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def expected(pos: np.ndarray, h: int, d: int, seq: int):
    """Exact float32 values of out (n, H, D) and lse (H, n) at global positions ``pos``."""
    base = (pos[:, None, None] * (h * d) + np.arange(h * d).reshape(1, h, d) + seq * 7) % (1 << 24)
    lse = -((pos[None, :] * h + np.arange(h)[:, None] + seq) % (1 << 24)).astype(np.float32)
    return base.astype(np.float32), lse


def runs(pos: np.ndarray) -> list:
    """``pos`` as arithmetic runs (start, count, step): two for zigzag, one for striped."""
    out, i, n = [], 0, len(pos)
    while i < n:
        step = int(pos[i + 1] - pos[i]) if i + 1 < n else 1
        j = i + 1
        while j < n and pos[j] - pos[j - 1] == step:
            j += 1
        out.append((int(pos[i]), j - i, step))
        i = j
    return out


def selection(dset, pos: np.ndarray, axis: int):
    """File dataspace of ``dset`` selecting the tokens ``pos`` along ``axis`` (all of the rest)."""
    space = dset.id.get_space()
    space.select_none()
    for first, cnt, step in runs(pos):
        start, count, stride = [0] * dset.ndim, list(dset.shape), [1] * dset.ndim
        start[axis], count[axis], stride[axis] = first, cnt, step
        if step > 1:  # cnt blocks of one token each, step apart; the other axes whole
            block = list(dset.shape)
            block[axis] = 1
            count = [1] * dset.ndim
            count[axis] = cnt
            space.select_hyperslab(
                tuple(start), tuple(count), tuple(stride), tuple(block), op=h5py.h5s.SELECT_OR
            )
        else:
            space.select_hyperslab(tuple(start), tuple(count), op=h5py.h5s.SELECT_OR)
    return space


def transfer(collective: bool):
    """Dataset transfer property list: MPI-IO collective or independent."""
    dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
    mode = h5py.h5fd.MPIO_COLLECTIVE if collective else h5py.h5fd.MPIO_INDEPENDENT
    dxpl.set_dxpl_mpio(mode)
    return dxpl


def write_rows(dset, pos, arr, axis, collective: bool) -> None:
    """This rank's tokens of one dataset in one H5Dwrite (every rank calls it, also with none)."""
    fspace = selection(dset, pos, axis)
    arr = np.ascontiguousarray(arr)
    mspace = h5py.h5s.create_simple(arr.shape if arr.size else (1,))
    if not arr.size:
        mspace.select_none()
        arr = np.zeros(1, dtype=arr.dtype)
    dset.id.write(mspace, fspace, arr, dxpl=transfer(collective))


def read_rows(dset, pos, axis, collective: bool) -> np.ndarray:
    """This rank's tokens of one dataset in one H5Dread."""
    shape = list(dset.shape)
    shape[axis] = len(pos)
    out = np.empty(shape, dtype=dset.dtype)
    fspace = selection(dset, pos, axis)
    mspace = h5py.h5s.create_simple(tuple(shape) if out.size else (1,))
    buf = out
    if not out.size:
        mspace.select_none()
        buf = np.zeros(1, dtype=dset.dtype)
    dset.id.read(mspace, fspace, buf, dxpl=transfer(collective))
    return out


def agree(ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank."""
    return bool(COMM.allreduce(bool(ok), op=MPI.LAND))


def sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def create(f, name: str, s: int, h: int, d: int, chunk: int, gzip: bool):
    """Collectively create one sequence's ``out`` and ``lse`` (same arguments on every rank)."""
    kw = dict(track_times=False)
    if chunk:
        kw["chunks"] = True
    g = f.create_group(name, track_order=False)
    o_kw, l_kw = dict(kw), dict(kw)
    if chunk:
        o_kw["chunks"] = (min(chunk, s), h, d)
        l_kw["chunks"] = (h, min(chunk, s))
    if gzip:
        o_kw.update(compression="gzip", compression_opts=1)
        l_kw.update(compression="gzip", compression_opts=1)
    return (
        g.create_dataset("out", (s, h, d), dtype="f4", **o_kw),
        g.create_dataset("lse", (h, s), dtype="f4", **l_kw),
    )


def run_case(path, lengths, h, d, layout, collective, chunk=0, gzip=False, **open_kw):
    """Write, close, rename, read back. Returns (ok, detail, seconds to write and close)."""
    tmp = path + ".tmp"
    t0 = time.perf_counter()
    err = None
    try:
        with h5py.File(tmp, "w", driver="mpio", comm=COMM, **open_kw) as f:
            f.attrs["writer"] = "mpio_probe"  # attributes: collective, same value on all ranks
            sets = [create(f, f"seq{i:03d}", s, h, d, chunk, gzip) for i, s in enumerate(lengths)]
            for i, (s, (do, dl)) in enumerate(zip(lengths, sets)):
                pos = positions(s, RANK, SIZE, layout)
                out, lse = expected(pos, h, d, i)
                write_rows(do, pos, out, 0, collective)
                write_rows(dl, pos, lse, 1, collective)
    except Exception as e:  # noqa: BLE001 - a probe reports what HDF5 says
        err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    errs = COMM.allgather(err)
    if any(errs):
        if RANK == 0 and os.path.exists(tmp):
            os.remove(tmp)
        COMM.Barrier()
        first = next(e for e in errs if e)
        return False, f"write failed on ranks {[r for r, e in enumerate(errs) if e]}: {first}", 0.0
    wrote = COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    if RANK == 0:
        fd = os.open(tmp, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        os.replace(tmp, path)
    COMM.Barrier()
    # every rank reads its own tokens collectively through mpio
    good = True
    with h5py.File(path, "r", driver="mpio", comm=COMM) as f:
        for i, s in enumerate(lengths):
            pos = positions(s, RANK, SIZE, layout)
            out, lse = expected(pos, h, d, i)
            g = f[f"seq{i:03d}"]
            good &= np.array_equal(read_rows(g["out"], pos, 0, True), out)
            good &= np.array_equal(read_rows(g["lse"], pos, 1, True), lse)
    # rank 0 reads the whole file serially, as a user would
    if RANK == 0:
        with h5py.File(path, "r") as f:
            for i, s in enumerate(lengths):
                out, lse = expected(np.arange(s), h, d, i)
                good &= np.array_equal(f[f"seq{i:03d}/out"][...], out)
                good &= np.array_equal(f[f"seq{i:03d}/lse"][...], lse)
    good = agree(good and not os.path.exists(tmp))
    mb = sum(s * h * (d + 1) * 4 for s in lengths) / 1e6
    detail = f"{mb:.1f} MB in {wrote:.3f} s, read back {'exact' if good else 'WRONG'}"
    if RANK == 0:
        detail += f", sha256 {sha(path)}"
    return good, detail, wrote


def peek(path: str, locking_env: str | None) -> str:
    """A separate serial process opens ``path`` for reading; what happens (rank 0 only)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    env.pop("HDF5_USE_FILE_LOCKING", None)
    if locking_env is not None:
        env["HDF5_USE_FILE_LOCKING"] = locking_env
    code = "import sys, h5py; f = h5py.File(sys.argv[1], 'r'); print(sorted(f))"
    res = subprocess.run(
        [sys.executable, "-c", code, path], env=env, capture_output=True, text=True, timeout=60
    )
    if res.returncode == 0:
        return "opens"
    last = [ln for ln in res.stderr.splitlines() if ln.strip()][-1:]
    return f"refused ({last[0][-120:] if last else res.returncode})"


def writer_open_peek(d0: str) -> str:
    """While the mpio writer holds a file open, can another process read it?"""
    tmp = os.path.join(d0, "peek.h5.tmp")
    seen = ""
    with h5py.File(tmp, "w", driver="mpio", comm=COMM) as f:
        create(f, "seq000", 64, 2, 8, 0, False)
        f.flush()
        COMM.Barrier()
        if RANK == 0:
            seen = (
                f"default locking: {peek(tmp, None)}; "
                f"HDF5_USE_FILE_LOCKING=FALSE: {peek(tmp, 'FALSE')}"
            )
        COMM.Barrier()
    if RANK == 0:
        os.remove(tmp)
    return seen


def cases(args) -> int:
    lengths, h, d = args.lengths, args.heads, args.dim
    d0 = args.dir
    plan = [
        # name, kwargs, should work
        ("contiguous collective", dict(collective=True), True),
        ("contiguous independent", dict(collective=False), True),
        ("chunked(256) collective", dict(collective=True, chunk=256), True),
        ("chunked(256) independent", dict(collective=False, chunk=256), True),
        ("chunked(256)+gzip collective", dict(collective=True, chunk=256, gzip=True), True),
        # HDF5 writes filtered (compressed) chunks in parallel only collectively
        ("chunked(256)+gzip independent", dict(collective=False, chunk=256, gzip=True), False),
        ("contiguous collective locking=False", dict(collective=True, locking=False), True),
        ("striped layout collective", dict(collective=True, layout="striped"), True),
        ("contiguous layout collective", dict(collective=True, layout="contiguous"), True),
    ]
    bad = 0
    if RANK == 0:
        print(
            f"PROBE P={SIZE} h5py {h5py.__version__} HDF5 {h5py.version.hdf5_version} "
            f"mpi={h5py.get_config().mpi} {MPI.Get_library_version().splitlines()[0]} "
            f"HDF5_USE_FILE_LOCKING={os.environ.get('HDF5_USE_FILE_LOCKING', '(unset)')} "
            f"lengths={lengths} H={h} D={d}",
            flush=True,
        )
    for k, (name, kw, should) in enumerate(plan):
        kw = dict(kw)
        layout = kw.pop("layout", "zigzag")
        path = os.path.join(d0, f"case{k}.h5")
        ok, detail, _ = run_case(path, lengths, h, d, layout, **kw)
        verdict = "ok" if ok == should else "UNEXPECTED"
        bad += ok != should
        if RANK == 0:
            what = "works" if ok else "refused"
            print(f"PROBE {verdict}: {name} ({layout}): {what}; {detail}", flush=True)
    seen = writer_open_peek(d0)
    if RANK == 0:
        print(f"PROBE info: a reader while the mpio writer holds the file: {seen}", flush=True)
    if args.bench:
        s = args.bench
        times = {True: [], False: []}
        for _ in range(3):
            for coll in (True, False):
                path = os.path.join(d0, f"bench{int(coll)}.h5")
                COMM.Barrier()
                ok, _, wrote = run_case(path, [s], h, d, "zigzag", collective=coll)
                times[coll].append(wrote)
                bad += not ok
                if RANK == 0:
                    os.remove(path)
                COMM.Barrier()
        if RANK == 0:
            mb = s * h * (d + 1) * 4 / 1e6
            med = {c: sorted(t)[1] for c, t in times.items()}
            print(
                f"PROBE bench S={s} H={h} D={d} ({mb:.0f} MB, create+write+close, median of 3): "
                f"collective {med[True]:.2f} s, independent {med[False]:.2f} s",
                flush=True,
            )
    return bad


def crash(args) -> None:
    """Allocate everything, finish sequence 0 (flushed), half of sequence 1, then die."""
    lengths, h, d = args.lengths, args.heads, args.dim
    tmp = os.path.join(args.dir, "resume.h5.tmp")
    f = h5py.File(tmp, "w", driver="mpio", comm=COMM, libver=(args.libver, "latest"))
    sets = [create(f, f"seq{i:03d}", s, h, d, 0, False) for i, s in enumerate(lengths)]
    f.flush()  # the metadata is complete now; later writes touch raw data only
    for i in (0, 1):
        s = lengths[i]
        pos = positions(s, RANK, SIZE, "zigzag")
        out, lse = expected(pos, h, d, i)
        if i == 1:  # half of this rank's rows, as if killed mid-write
            pos, out, lse = pos[: len(pos) // 2], out[: len(pos) // 2], lse[:, : len(pos) // 2]
        write_rows(sets[i][0], pos, out, 0, True)
        write_rows(sets[i][1], pos, lse, 1, True)
        if i == 0:
            f.flush()  # sequence 0 is on disk: this is where a done marker would go
    COMM.Barrier()
    if RANK == 0:
        print(f"PROBE crash: P={SIZE}, {tmp} left open after seq000 + half of seq001", flush=True)
    sys.stdout.flush()
    os._exit(0)


def resume(args) -> int:
    """Reopen the crashed temporary file, check sequence 0, rewrite the rest, rename."""
    lengths, h, d = args.lengths, args.heads, args.dim
    tmp = os.path.join(args.dir, "resume.h5.tmp")
    path = tmp[:-4]
    ok0 = True
    with h5py.File(tmp, "r+", driver="mpio", comm=COMM) as f:
        pos = positions(lengths[0], RANK, SIZE, "zigzag")
        out, lse = expected(pos, h, d, 0)
        g = f["seq000"]
        ok0 = np.array_equal(read_rows(g["out"], pos, 0, True), out)
        ok0 &= np.array_equal(read_rows(g["lse"], pos, 1, True), lse)
        for i in range(1, len(lengths)):
            pos = positions(lengths[i], RANK, SIZE, "zigzag")
            out, lse = expected(pos, h, d, i)
            g = f[f"seq{i:03d}"]
            write_rows(g["out"], pos, out, 0, True)
            write_rows(g["lse"], pos, lse, 1, True)
    ok0 = agree(ok0)
    if RANK == 0:
        os.replace(tmp, path)
    COMM.Barrier()
    good = True
    if RANK == 0:
        with h5py.File(path, "r") as f:
            for i, s in enumerate(lengths):
                out, lse = expected(np.arange(s), h, d, i)
                good &= np.array_equal(f[f"seq{i:03d}/out"][...], out)
                good &= np.array_equal(f[f"seq{i:03d}/lse"][...], lse)
        print(
            f"PROBE {'ok' if ok0 and good else 'UNEXPECTED'}: resume after a crash at P={SIZE}: "
            f"seq000 {'intact' if ok0 else 'DAMAGED'} in the reopened file, whole file "
            f"{'exact' if good else 'WRONG'} after rewriting the rest, sha256 {sha(path)}",
            flush=True,
        )
    return int(not agree(ok0 and good))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="directory for the probe files (shared by all ranks)")
    ap.add_argument("--phase", choices=("cases", "crash", "resume"), default="cases")
    ap.add_argument(
        "--lengths", type=lambda t: [int(x) for x in t.split(",")], default=[1000, 37, 4099, 2]
    )
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--libver", default="earliest", help="crash phase: lowest file format")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--bench", type=int, default=0, help="also time S tokens, coll. vs indep.")
    args = ap.parse_args()
    if not h5py.get_config().mpi:
        if RANK == 0:
            print("PROBE refused: this h5py has no MPI (Debian: run it inside mpiexec)")
        return 1
    if RANK == 0:
        os.makedirs(args.dir, exist_ok=True)
    COMM.Barrier()
    if args.phase == "crash":
        crash(args)
    if args.phase == "resume":
        return resume(args)
    return int(COMM.allreduce(cases(args), op=MPI.MAX) > 0)


if __name__ == "__main__":
    sys.exit(main())
