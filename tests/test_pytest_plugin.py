"""ringmpi.pytest_plugin: a failure on one rank of a user's suite never hangs it (issue 26, item 5).

Each test starts ``mpiexec -n 2 python -m pytest -p ringmpi.pytest_plugin`` on a
small user suite under a timeout and checks how and how fast it ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

USER_SUITE = """
from mpi4py import MPI


def test_fine():
    assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.Get_size()


def test_one_rank_raises_then_the_other_waits():
    comm = MPI.COMM_WORLD
    if comm.rank == 1:
        raise ValueError("boom on rank 1")
    comm.allreduce(1)  # rank 0 waits here for rank 1 forever without the plugin


def test_after():
    pass
"""

FAILS_ALONE = """
from mpi4py import MPI


def test_rank0_asserts():
    assert MPI.COMM_WORLD.rank != 0, "rank 0 saw a wrong value"


def test_next_still_runs():
    assert MPI.COMM_WORLD.allreduce(1) == 2
"""


def _mpiexec() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else "mpiexec"


def _pytest_on_two_ranks(tmp_path, source: str, timeout: float = 120.0, *extra: str):
    path = tmp_path / "test_user.py"
    path.write_text(textwrap.dedent(source))
    cmd = [
        _mpiexec(),
        "-n",
        "2",
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "ringmpi.pytest_plugin",
        *extra,
        str(path),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGMPI_TEST_AGREE_S="5")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    return r.returncode, r.stdout + r.stderr, time.perf_counter() - t0


@pytest.mark.timeout(200) if hasattr(pytest.mark, "timeout") else (lambda f: f)
def test_one_rank_raising_before_a_collective_aborts_promptly_with_its_message(tmp_path):
    rc, text, secs = _pytest_on_two_ranks(tmp_path, USER_SUITE)
    assert rc != 0, text
    assert "boom on rank 1" in text and "aborting the MPI job" in text, text
    assert "test_one_rank_raises_then_the_other_waits failed on rank 1" in text, text
    assert secs < 60, f"took {secs:.1f} s"  # 5 s agreement timeout + start-up


def test_a_failure_on_one_rank_fails_the_test_on_every_rank(tmp_path):
    rc, text, _ = _pytest_on_two_ranks(tmp_path, FAILS_ALONE)
    assert rc == 1, text
    # rank 0 reports its own assertion, rank 1 the same test as failed on rank 0
    assert "rank 0 saw a wrong value" in text, text
    assert "failed on rank(s) 0: AssertionError: rank 0 saw a wrong value" in text, text
    assert text.count("1 failed, 1 passed") == 2, text  # both ranks ran the next test
