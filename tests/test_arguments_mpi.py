"""Bad arguments raise the same ValueError on every rank, before any message."""

import numpy as np
import pytest

import ringmpi
from ringmpi.testing import raises_everywhere

pytestmark = pytest.mark.mpi


def local_qkv(comm, n=64, h=4, hkv=2, d=16, dtype=np.float32, layout="zigzag"):
    rng = np.random.default_rng(0)
    s = len(ringmpi.positions(n, comm.rank, comm.size, layout))
    q = rng.standard_normal((s, h, d)).astype(dtype)
    k = rng.standard_normal((s, hkv, d)).astype(dtype)
    return q, k, k.copy()


def last(comm):
    return comm.rank == comm.size - 1


def test_layout_mismatch_on_one_rank(comm):
    if comm.size < 2:
        pytest.skip("a disagreement between ranks needs at least 2 ranks")
    q, k, v = local_qkv(comm)
    layout = "striped" if last(comm) else "zigzag"
    raises_everywhere(
        comm,
        lambda: ringmpi.ring_attention(q, k, v, comm, layout=layout),
        "layout",
        f"rank {comm.size - 1}",
    )


@pytest.mark.parametrize("field", ["causal", "scale", "dtype", "head dim", "heads"])
def test_metadata_mismatch_on_one_rank(comm, field):
    if comm.size < 2:
        pytest.skip("a disagreement between ranks needs at least 2 ranks")
    odd = last(comm)
    kw = {}
    q, k, v = local_qkv(comm)
    if field == "causal":
        kw["causal"] = odd
    elif field == "scale":
        kw["scale"] = 0.5 if odd else None
    elif field == "dtype" and odd:
        q, k, v = (x.astype(np.float64) for x in (q, k, v))
    elif field == "head dim" and odd:
        q, k, v = local_qkv(comm, d=32)
    elif field == "heads" and odd:
        q, k, v = local_qkv(comm, h=8)
    raises_everywhere(
        comm,
        lambda: ringmpi.ring_attention(q, k, v, comm, **kw),
        "disagree",
        f"rank {comm.size - 1}",
    )


def bad_inputs(comm):
    q, k, v = local_qkv(comm)
    odd = last(comm)
    yield "ndim", (q[..., 0] if odd else q, k, v), "ndim"
    yield "D", (q, k[..., :8] if odd else k, v[..., :8] if odd else v), "head dim"
    yield (
        "gqa",
        (q, k[:, :1].repeat(3, 1) if odd else k, v[:, :1].repeat(3, 1) if odd else v),
        ("multiple"),
    )
    yield "int", (q.astype(np.int32) if odd else q, k, v), "dtype"
    yield "dtypes", (q, k.astype(np.float64) if odd else k, v), "dtype"
    # q and k/v may differ in length (cross-attention), k and v may not
    yield "lengths", (q, k[:-1] if odd and len(k) else k, v), "shape"
    # the last rank holds `extra` more tokens than zigzag gives it: a count no layout cut
    base = list(ringmpi.layout.counts(64, comm.size, "zigzag"))
    extra = 1
    while comm.size > 1 and base[:-1] + [base[-1] + extra] == list(
        ringmpi.layout.counts(64 + extra, comm.size, "zigzag")
    ):
        extra += 1
    s = base[comm.rank] + (extra if odd else 0)
    yield (
        "wrong layout counts",
        (np.resize(q, (s, *q.shape[1:])), np.resize(k, (s, 2, 16)), np.resize(v, (s, 2, 16))),
        "tokens",
    )


@pytest.mark.parametrize("case", range(7))
def test_bad_input_on_one_rank_raises_everywhere(comm, case):
    name, (q, k, v), word = list(bad_inputs(comm))[case]
    if name == "lengths" and len(local_qkv(comm)[0]) == 0:
        pytest.skip("the last rank holds no token to drop")
    if name == "wrong layout counts" and comm.size == 1:
        pytest.skip("one rank may hold any number of tokens")
    raises_everywhere(comm, lambda: ringmpi.ring_attention(q, k, v, comm), word)


def test_nan_with_check_finite(comm):
    q, k, v = local_qkv(comm)
    if last(comm):
        q[0, 0, 0] = np.nan
    raises_everywhere(comm, lambda: ringmpi.ring_attention(q, k, v, comm, check_finite=True), "NaN")


def test_unknown_layout(comm):
    q, k, v = local_qkv(comm)
    raises_everywhere(comm, lambda: ringmpi.ring_attention(q, k, v, comm, layout="x"), "layout")
