"""decode_attention: few queries against a sharded cache, merged by a custom MPI reduction."""

import numpy as np
import pytest

import ringmpi
from ringmpi.reference import attention
from ringmpi.testing import assert_all, assert_close, dense, once, raises_everywhere, random_qkv

pytestmark = pytest.mark.mpi


def _shards(n_total, size, rng):
    """Uneven cache shard sizes with at least one empty shard when size > 1."""
    cuts = np.sort(rng.integers(0, n_total + 1, size - 1))
    sizes = np.diff(np.concatenate(([0], cuts, [n_total])))
    if size > 1:
        sizes[size // 2] += sizes[0]
        sizes[0] = 0
    return sizes


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("batch", [None, 2])
def test_decode_matches_reference(comm, dtype, sq, batch):
    rng = np.random.default_rng(7)  # same on every rank
    n, h, hkv, d = 333, 4, 2, 32
    lead = () if batch is None else (batch,)
    q = rng.standard_normal((*lead, sq, h, d)).astype(dtype)
    k = rng.standard_normal((*lead, n, hkv, d)).astype(dtype)
    v = rng.standard_normal((*lead, n, hkv, d)).astype(dtype)
    sizes = _shards(n, comm.size, rng)
    lo = int(sizes[: comm.rank].sum())
    sl = slice(lo, lo + int(sizes[comm.rank]))
    kl, vl = k[..., sl, :, :], v[..., sl, :, :]
    out, lse = ringmpi.decode_attention(q, kl, vl, comm, return_lse=True)
    assert_all(comm, out.shape == q.shape and out.dtype == dtype, f"out {out.shape} {out.dtype}")
    ref, ref_lse = once(comm, attention, q, k, v)
    peer = None if dtype == np.float64 else once(comm, dense, q, k, v)
    assert_close(comm, out, ref, None if peer is None else peer[0], "decode out")
    assert_close(comm, lse, ref_lse, None if peer is None else peer[1], "decode lse")
    same = comm.allgather(out.tobytes())
    assert_all(comm, len(set(same)) == 1, "ranks ended with different outputs")


def test_decode_all_empty_cache_gives_zero_and_minus_inf(comm):
    q = np.ones((2, 3, 8))
    k = np.zeros((0, 3, 8))
    out, lse = ringmpi.decode_attention(q, k, k, comm, return_lse=True)
    assert_all(comm, not out.any() and np.isneginf(lse).all(), "empty cache must give 0, -inf")


def test_decode_bad_arguments(comm):
    q = np.ones((2, 4, 8))
    kv = np.ones((5, 2, 8))
    bad = np.ones((5, 3, 8)) if comm.rank == comm.size - 1 else kv
    raises_everywhere(comm, lambda: ringmpi.decode_attention(q, bad, bad, comm), "decode_attention")
    if comm.size > 1:
        qq = np.ones((3 if comm.rank == 0 else 2, 4, 8))
        raises_everywhere(comm, lambda: ringmpi.decode_attention(qq, kv, kv, comm), "disagree")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("widths", [(576, 512), (40, 24), (8, 64)])
def test_decode_latent_cache_of_other_widths(comm, dtype, widths):
    """A sharded cache whose values are narrower or wider than its keys (issue 42): the
    absorbed MLA latent cache is one K/V head of keys 576 wide (latent + rotary) and
    values 512 wide (the latent); 16 query heads, realistic values, softcap, the scale
    of the unabsorbed head width (1/sqrt(192)) as MLA uses."""
    dk, dv = widths
    rng = np.random.default_rng(11)  # same on every rank
    n, h = 301, 16
    q, k, v = random_qkv(rng, n, h, 1, dk, realistic=True, dv=dv)
    q = np.ascontiguousarray(q[-2:]).astype(dtype)  # two new tokens
    k, v = k.astype(dtype), v.astype(dtype)
    sizes = _shards(n, comm.size, rng)
    lo = int(sizes[: comm.rank].sum())
    sl = slice(lo, lo + int(sizes[comm.rank]))
    kw = dict(scale=192**-0.5, softcap=30.0)
    out, lse = ringmpi.decode_attention(q, k[sl], v[sl], comm, return_lse=True, **kw)
    ok = out.shape == (2, h, dv) and out.dtype == dtype
    assert_all(comm, ok, f"out {out.shape} {out.dtype}")
    ref, ref_lse = once(comm, attention, q, k, v, **kw)
    peer = (None, None) if dtype == np.float64 else once(comm, dense, q, k, v, **kw)
    assert_close(comm, out, ref, peer[0], f"decode {widths} out")
    assert_close(comm, lse, ref_lse, peer[1], f"decode {widths} lse")
