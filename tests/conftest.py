import re

import numpy as np
import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--nvrtc-archs",
        default="all",
        help="GPU archs the NVRTC compile checks build for (comma list, e.g. sm_90; "
        "default all: ringmpi.gpu.nvrtc.ARCHS). make test: sm_90; make test-cuda: all",
    )


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


# `make test-mpi` hands each rank only the files that mark tests mpi in their text (the
# Makefile's MPI_FILES greps for this pattern): a multi-rank test whose file does not
# match would never run at P > 1, so the collection fails instead.
_MPI_FILE = re.compile(r"mark\.mpi|pytestmark = .*mpi")


def pytest_collection_modifyitems(config, items):
    _check_mpi_files(items)
    _deselect_above_max_ranks(config, items)


def _deselect_above_max_ranks(config, items):
    """``@pytest.mark.max_ranks(n)``: not collected at P > n (pytest --with-mpi under mpiexec)."""
    if not config.getoption("with_mpi", default=False):
        return
    from mpi4py import MPI

    size = MPI.COMM_WORLD.Get_size()
    keep, drop = [], []
    for item in items:
        m = item.get_closest_marker("max_ranks")
        (drop if m is not None and size > int(m.args[0]) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _check_mpi_files(items):
    seen = {}
    for item in items:
        if item.get_closest_marker("mpi") is None:
            continue
        path = str(item.path)
        if path not in seen:
            with open(path, encoding="utf-8") as f:
                seen[path] = bool(_MPI_FILE.search(f.read()))
        if not seen[path]:
            raise pytest.UsageError(
                f"{path}: an mpi test in a file the Makefile's MPI_FILES does not list "
                "(mark it with pytest.mark.mpi or pytestmark in the file itself)"
            )
