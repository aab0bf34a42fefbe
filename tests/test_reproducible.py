"""ringmpi.reproducible on one rank (issue 40): how the rows and keys are dealt out.

The multi-rank cases of the mode (every P, layout and mask) are in
tests/test_reproducible_mpi.py.
"""

import numpy as np
from mpi4py import MPI

from ringmpi import reproducible


def test_deal_rows_round_trip():
    """deal_rows puts every row at its global position; undeal_rows brings it back. Any
    dtype's bits (float32 rows of the float32 backward, float16), shuffled positions and
    positions already in order (the identity permutations it skips)."""
    rng = np.random.default_rng(2)
    for pos in (rng.permutation(150), np.arange(150)):
        for dtype in (np.float64, np.float32, np.float16):
            rows = (rng.standard_normal((150, 3)) * 100).astype(dtype)
            rows[0, 0] = -0.0
            for balanced in (False, True):
                mine, at, back = reproducible.deal_rows(MPI.COMM_SELF, rows, pos, 150,
                                                                 balanced)  # fmt: skip
                assert mine.dtype == dtype
                assert np.array_equal(at, np.arange(150))
                assert mine[pos].tobytes() == rows.tobytes()
                again = reproducible.undeal_rows(MPI.COMM_SELF, mine, back)
                assert again.dtype == dtype and again.tobytes() == rows.tobytes()


def test_block_owners():
    """Contiguous runs of blocks, or a zigzag of runs; every rank's blocks in order."""
    owners = reproducible.block_owners
    assert owners(64 * 10, 2).tolist() == [0] * 5 + [1] * 5
    assert owners(64 * 8, 2, balanced=True).tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
    assert owners(10, 3, balanced=True).tolist() == [0]  # one block, P = 3
    assert owners(301, 5).tolist() == owners(301, 5, balanced=False).tolist()


def test_deal_keys_in_place_returns_views():
    """Keys already on their blocks in position order (one rank, every position) are not
    copied: the views of k and v come back, with the starts and counts of one rank."""
    rng = np.random.default_rng(5)
    k = rng.standard_normal((2, 3, 300, 8)).astype(np.float32) + 4.0
    v = rng.standard_normal((2, 3, 300, 5)).astype(np.float32)
    kd, vd, starts, counts = reproducible.deal_keys(MPI.COMM_SELF, k, v, np.arange(300), 300,
                                                    block=64)  # fmt: skip
    assert np.shares_memory(kd, k) and np.shares_memory(vd, v)
    assert kd.tobytes() == k.tobytes() and vd.tobytes() == v.tobytes()
    assert (starts, counts) == ([0], [300])


def test_deal_keys_puts_shuffled_keys_in_position_order():
    """Keys held in another order (a striped or zigzag layout) come back in position order,
    every bit and dtype kept (a -0 and a NaN among them), k and v of different widths and
    dtypes."""
    rng = np.random.default_rng(6)
    pos = rng.permutation(301)
    k = (rng.standard_normal((1, 2, 301, 6)) * 30).astype(np.float32)
    v = rng.standard_normal((1, 2, 301, 3))
    k[0, 1, 7, 2], v[0, 0, 9, 1] = -0.0, np.nan
    kd, vd, starts, counts = reproducible.deal_keys(MPI.COMM_SELF, k, v, pos, 301, block=256)
    back = np.argsort(pos)
    assert kd.dtype == np.float32 and kd.flags.c_contiguous and vd.flags.c_contiguous
    assert kd.tobytes() == k[:, :, back].tobytes()
    assert vd.tobytes() == v[:, :, back].tobytes()
    assert (starts, counts) == ([0], [301])
