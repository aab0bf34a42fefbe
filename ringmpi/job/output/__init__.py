"""The job's output: part files (:mod:`.parts`) or one file by parallel HDF5 (:mod:`.single_file`).

This package decides which one a job writes (``--output-mode``) and builds its store.

:func:`mpio_status` says whether every rank can write one file collectively
(h5py built with MPI on mpi4py's MPI library); :func:`resolve_mode` turns
``auto``/``parts``/``single`` into what this job does, before anything is written.
"""

from __future__ import annotations

import os

from ..plan import InputError

__all__ = ["MODES", "mpio_status", "resolve_mode", "make_store"]

MODES = ("auto", "parts", "single")


def _libmpi() -> set:
    """Real paths of the MPI libraries (libmpi.so*) mapped into this process (Linux)."""
    libs = set()
    try:
        with open("/proc/self/maps") as fh:
            for ln in fh:
                path = ln.split()[-1] if ln.count("/") else ""
                base = os.path.basename(path)
                if base.startswith("libmpi.so") or base.startswith("libmpich.so"):
                    libs.add(os.path.realpath(path))
    except OSError:
        pass
    return libs


def _local_status() -> tuple:
    """(usable, reason) of parallel HDF5 in this process."""
    try:
        import h5py
        from mpi4py import MPI
    except ImportError as e:
        return False, f"cannot import {e.name}"
    if not h5py.get_config().mpi:
        return False, (
            f"h5py {h5py.__version__} was built without MPI (parallel HDF5); install an "
            "MPI build (Debian: python3-h5py-mpi, used inside mpiexec; pip: "
            "HDF5_MPI=ON CC=mpicc pip install --no-binary=h5py h5py) or use --output-mode parts"
        )
    libs = _libmpi()
    if len(libs) > 1:
        names = ", ".join(sorted(libs))
        return False, (
            f"h5py's HDF5 and mpi4py use different MPI libraries ({names}); "
            "build them on the same MPI or use --output-mode parts"
        )
    try:  # the handle conversion h5py does for driver="mpio"
        fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
        fapl.set_fapl_mpio(MPI.COMM_SELF, MPI.INFO_NULL)
    except Exception as e:  # noqa: BLE001 - report what h5py says
        return False, f"h5py cannot use an mpi4py communicator ({type(e).__name__}: {e})"
    return True, f"h5py {h5py.__version__} on HDF5 {h5py.version.hdf5_version} with MPI"


def mpio_status(comm) -> tuple:
    """Whether every rank of ``comm`` can write one file collectively, and why not.

    Returns
    -------
    (bool, str)
        The same on every rank: usable, and a reason (the first failing rank's).
    """
    if comm is None:
        return False, "not run under MPI (no communicator)"
    st = _local_status()
    every = comm.allgather(st)
    bad = [(r, why) for r, (ok, why) in enumerate(every) if not ok]
    if bad:
        r, why = bad[0]
        return False, why if comm.Get_size() == 1 else f"rank {r}: {why}"
    return True, every[0][1]


def resolve_mode(mode: str, comm, nrings: int) -> str:
    """``parts`` or ``single`` for ``--output-mode MODE`` (collective; nothing is written).

    ``auto`` is ``single`` where :func:`mpio_status` allows it and the job is one
    ring, else ``parts``. ``single`` where it is not possible raises InputError.
    """
    if mode not in MODES:
        raise InputError(f"--output-mode must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "parts" or (mode == "auto" and nrings != 1):
        return "parts"  # (auto: one file needs one ring; no need to probe the MPI build)
    ok, why = mpio_status(comm)
    if mode == "auto":
        return "single" if ok and nrings == 1 else "parts"
    if not ok:
        raise InputError(f"--output-mode single: {why}")
    if nrings != 1:
        raise InputError(
            f"--output-mode single writes one file from one ring; this job has {nrings} rings "
            "(--ring-size): use --output-mode parts"
        )
    return "single"


def make_store(mode: str, path: str, comm, plan, meta: dict, **kw):
    """The output store of ``--output-mode`` ``mode`` (``"parts"`` or ``"single"``).

    Both stores import this package (its modes and their check), so the one a
    job asks for is imported here, and only that one.
    """
    if mode == "single":
        from .single_file import SingleFileStore as cls
    else:
        from .parts import OutputStore as cls
    return cls(path, comm, plan, meta, **kw)
