"""BLAS threads per rank and the start line (issue 26, item 3; item 7's one-process line)."""

from __future__ import annotations

import io

import pytest

from ringmpi.cli.make_data import make_data
from ringmpi.job import report as progress_mod
from ringmpi.job.plan import InputError
from ringmpi.job.report import one_process_note
from ringmpi.job.resources import cores_per_rank, limit_blas
from ringmpi.job.run import run

threadpoolctl = pytest.importorskip("threadpoolctl")  # an install_requires: present in CI


def test_cores_per_rank_bound_or_shared():
    assert cores_per_rank({0, 1}, [{0, 1}, {2, 3}]) == (2, "bound")
    assert cores_per_rank({0}, [{0}, {1}, {2}]) == (1, "bound")
    n, how = cores_per_rank(set(range(8)), [set(range(8))] * 3)
    assert n == 2 and how == "8 cores / 3 ranks"
    assert cores_per_rank({0, 1}, [{0, 1}] * 4)[0] == 1  # never 0


def _blas_threads():
    return sorted({p["num_threads"] for p in threadpoolctl.threadpool_info()})


def test_limit_blas_sets_and_restores(monkeypatch):
    before = _blas_threads()
    monkeypatch.setenv("RINGMPI_BLAS_THREADS", "1")
    lim = limit_blas(None)
    assert lim.threads == 1 and _blas_threads() == [1]
    assert lim.text == "BLAS 1 thread per rank (RINGMPI_BLAS_THREADS)"
    lim.restore()
    assert _blas_threads() == before
    monkeypatch.setenv("RINGMPI_BLAS_THREADS", "0")
    lim = limit_blas(None)
    assert lim.threads is None and "not limited" in lim.text
    monkeypatch.setenv("RINGMPI_BLAS_THREADS", "two")
    with pytest.raises(InputError, match="RINGMPI_BLAS_THREADS must be a number"):
        limit_blas(None)


def test_default_limit_is_the_cores_of_the_rank(monkeypatch):
    monkeypatch.delenv("RINGMPI_BLAS_THREADS", raising=False)
    import os

    cores = len(os.sched_getaffinity(0))
    with threadpoolctl.threadpool_limits(limits=cores):  # as if OMP_NUM_THREADS were unset
        lim = limit_blas(None)
        assert lim.threads == cores and _blas_threads() == [cores]
        lim.restore()
    if cores == 1:
        return
    with threadpoolctl.threadpool_limits(limits=1):  # OMP_NUM_THREADS=1 asked for fewer: kept
        lim = limit_blas(None)
        assert lim.threads == 1 and "as the environment set" in lim.text
        lim.restore()


def test_start_line_names_threads_and_one_process(tmp_path, monkeypatch):
    (x,) = make_data(str(tmp_path / "in.h5"), seq_len=64, heads=2, kv_heads=1, head_dim=8)
    for var in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "PMIX_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RINGMPI_BLAS_THREADS", "1")
    stream = io.StringIO()
    monkeypatch.setattr(progress_mod.sys, "stderr", stream)
    run([x], str(tmp_path / "out.h5"), output_mode="parts")
    first = stream.getvalue().splitlines()[0]
    assert "BLAS 1 thread per rank" in first, first
    assert "not started by mpiexec/srun, so 1 rank does all the work" in first, first


def test_one_process_note_under_a_launcher():
    assert one_process_note({"PMI_SIZE": "1", "PMI_RANK": "0"}).startswith("1 rank, as ")
    assert "not started by mpiexec" in one_process_note({})
