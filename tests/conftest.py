import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD
