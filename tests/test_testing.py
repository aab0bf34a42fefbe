"""ringmpi.testing's own helpers: the oracle computed once per communicator (issue 38)."""

import numpy as np
import pytest
from mpi4py import MPI

from ringmpi import testing
from ringmpi.reference import attention
from ringmpi.testing import assert_all, once


def _qkv(seed, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((40, 2, 8)).astype(dtype) for _ in range(3))


def test_once_keeps_results_by_the_bytes_of_the_call(monkeypatch):
    calls = []

    def oracle(x, scale=1.0):
        calls.append(1)
        return np.asarray(x) * scale

    x = np.arange(6.0)
    a = once(MPI.COMM_SELF, oracle, x, scale=2.0)
    b = once(MPI.COMM_SELF, oracle, x.copy(), scale=2.0)  # equal bytes: kept
    assert len(calls) == 1 and np.array_equal(a, 2 * x) and b is a
    once(MPI.COMM_SELF, oracle, x, scale=3.0)  # another keyword
    once(MPI.COMM_SELF, oracle, x.astype(np.float32), scale=2.0)  # another dtype
    once(MPI.COMM_SELF, oracle, x.reshape(2, 3), scale=2.0)  # another shape
    y = x.copy()
    y[5] = np.nextafter(y[5], 10)  # one ulp
    once(MPI.COMM_SELF, oracle, y, scale=2.0)
    assert len(calls) == 5
    with pytest.raises(ValueError, match="read-only"):
        a[0] = 1.0  # a kept oracle cannot be edited behind the next test's back
    monkeypatch.setattr(testing, "_ONCE_KEEP", 2)
    for s in range(4):
        once(MPI.COMM_SELF, oracle, x, scale=10.0 + s)
    assert len(testing._ONCE) == 2


def test_once_matches_the_direct_call():
    q, k, v = _qkv(1)
    ref, lse = once(MPI.COMM_SELF, attention, q, k, v, True, window=(5, 0))
    want, want_lse = attention(q, k, v, True, window=(5, 0))
    assert np.array_equal(ref, want) and np.array_equal(lse, want_lse)


def test_once_raises_the_oracles_error():
    def broken():
        raise KeyError("no such case")

    with pytest.raises(KeyError, match="no such case"):
        once(MPI.COMM_SELF, broken)


@pytest.mark.mpi
def test_once_gives_every_rank_rank_zeros_result(comm):
    q, k, v = _qkv(2, np.float32)
    calls = []

    def counted(*args, **kw):
        calls.append(1)
        return attention(*args, **kw)

    ref, lse = once(comm, counted, q, k, v, False)
    want, want_lse = attention(q, k, v, False)
    ok = np.array_equal(ref, want) and np.array_equal(lse, want_lse) and not ref.flags.writeable
    assert_all(comm, ok, "once's result differs from the direct call or is writeable")
    ran = comm.allgather(len(calls))
    assert_all(comm, ran == [1] + [0] * (comm.size - 1), f"oracle ran on ranks {ran}")


@pytest.mark.mpi
def test_once_raises_on_every_rank(comm):
    def broken():
        raise KeyError("no such case")

    try:
        once(comm, broken)
        msg = None
    except (KeyError, RuntimeError) as exc:
        msg = str(exc)
    assert_all(comm, msg is not None and "no such case" in msg, f"raised {msg!r}")
