"""BLAS threads per rank: no more than the cores the rank owns (threadpoolctl).

Every rank of a job on one node would otherwise start as many BLAS threads as
the node has cores, and P ranks x C threads fight over C cores (measured: the
numpy tile 4.2x slower). :func:`limit_blas` sets the BLAS (and OpenMP) pools of
this process to the cores this rank owns:

* the launcher bound the ranks to disjoint core sets (``srun --cpu-bind``,
  ``mpiexec -bind-to core``): the size of this rank's set;
* otherwise (every rank may run anywhere): the cores this rank may use divided
  by the ranks on the node sharing them, at least 1.

It never raises the pools above what the environment already asked for
(``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``, read by the
libraries at load). ``RINGMPI_BLAS_THREADS=N`` sets N threads per rank instead;
``RINGMPI_BLAS_THREADS=0`` leaves the pools alone.
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["cores_per_rank", "limit_blas", "BlasLimit"]


def _affinity() -> set:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux: the machine's count
        return set(range(os.cpu_count() or 1))


def cores_per_rank(mine: set, node_sets: list) -> tuple:
    """(cores, how) this rank owns, from its core set and those of every rank on its node.

    Parameters
    ----------
    mine : set of int
        The cores this rank may run on.
    node_sets : list of set of int
        The core sets of all ranks on this node (this one included).
    """
    disjoint = sum(len(s) for s in node_sets) == len(set().union(*node_sets))
    if disjoint:
        return max(1, len(mine)), "bound"
    sharing = sum(1 for s in node_sets if s & mine)
    return max(1, len(mine) // max(1, sharing)), f"{len(mine)} cores / {sharing} ranks"


class BlasLimit:
    """The limit in force: ``threads`` per rank (None: not limited), ``text`` for the start line.

    Parameters
    ----------
    threads : int or None
    text : str
    limiter : threadpoolctl.threadpool_limits or None
        Restored by :meth:`restore`.
    """

    def __init__(self, threads: Optional[int], text: str, limiter=None):
        self.threads, self.text, self._limiter = threads, text, limiter

    def restore(self) -> None:
        """Give the pools back the sizes they had before."""
        if self._limiter is not None:
            self._limiter.restore_original_limits()
            self._limiter = None


def _wanted(env) -> Optional[int]:
    """RINGMPI_BLAS_THREADS as a number (None: unset)."""
    from .schema import InputError

    want = env.get("RINGMPI_BLAS_THREADS", "").strip()
    if not want:
        return None
    if not want.isdigit():
        raise InputError(f"RINGMPI_BLAS_THREADS must be a number of threads (0: off), not {want!r}")
    return int(want)


def limit_blas(comm=None, env=None) -> BlasLimit:
    """Limit this rank's BLAS/OpenMP threads to its cores (collective over ``comm``'s node).

    Returns a :class:`BlasLimit`; call its ``restore()`` when the job ends.
    """
    from ..collective import run_everywhere

    env = os.environ if env is None else env
    want = run_everywhere(comm, _wanted, env)  # a bad value: the same error on every rank
    mine = _affinity()
    node_sets = [mine]
    if comm is not None and comm.Get_size() > 1:
        from mpi4py import MPI

        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            node_sets = [set(s) for s in node.allgather(sorted(mine))]
        finally:
            node.Free()
    if want == 0:
        return BlasLimit(None, "BLAS threads not limited (RINGMPI_BLAS_THREADS=0)")
    try:
        from threadpoolctl import threadpool_info, threadpool_limits
    except ImportError:
        return BlasLimit(None, "BLAS threads not limited (threadpoolctl is not installed)")
    if want is not None:
        n, how = want, "RINGMPI_BLAS_THREADS"
    else:
        n, how = cores_per_rank(mine, node_sets)
        now = [p["num_threads"] for p in threadpool_info() if p.get("num_threads")]
        if now and min(now) < n:  # the environment asked for fewer: keep that
            n, how = min(now), "as the environment set"
    limiter = threadpool_limits(limits=n)
    word = "thread" if n == 1 else "threads"
    return BlasLimit(n, f"BLAS {n} {word} per rank ({how})", limiter)
