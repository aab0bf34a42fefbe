"""The ring on values shaped like real data (means, small spreads, sinks), every layout.

Long key counts for a few query rows come from cross-attention (48 query tokens per rank
against 65,536 keys), so each rank's rows run over every key of the ring; self-attention
(causal and not) covers the layouts' mixing of positions. Forward and backward against
the dense float64 reference: out within twice a dense float32 computation's error (plus
eps), gradients within the backward rule, float64 within 1e-12 relative. Heads x ring
(head_parallel) and decode run the same values where P allows.
"""

import numpy as np
import pytest

import ringmpi
from ringmpi.reference import attention, attention_backward
from ringmpi.testing import assert_close, dense, dense_backward, lse_budget, once, random_qkv

# not at P = 4: it merges one more partial state by the same code as P = 2 and 3
pytestmark = [pytest.mark.mpi, pytest.mark.max_ranks(3)]


def _check(comm, nq, nk, causal, layout, dtype, seed, h=4, hkv=2, d=32, grads=True, **kw):
    rng = np.random.default_rng(seed)
    # no sink keys: their large scores make score rounding (not sums) dominate; tiles test them
    q, k, v = random_qkv(rng, nq, h, hkv, d, dtype=dtype, nk=nk, realistic=True, sinks=0)
    dout = (0.2 + 0.1 * rng.standard_normal(q.shape)).astype(dtype)
    ql, dl = (ringmpi.shard(x, comm, layout, **kw) for x in (q, dout))
    kl, vl = (ringmpi.shard(x, comm, layout, **kw) for x in (k, v))
    out, lse = ringmpi.ring_attention(
        ql, kl, vl, comm, causal=causal, layout=layout, return_lse=True, **kw
    )
    tag = f"{nq}x{nk} causal={causal} {layout} {np.dtype(dtype)} {kw}"
    full = ringmpi.gather(out, nq, comm, layout, **kw)
    full_lse = ringmpi.gather(lse, nq, comm, layout, axis=-1, **kw)
    ref, ref_lse = once(comm, attention, q, k, v, causal)
    peer = (None, None) if dtype == np.float64 else once(comm, dense, q, k, v, causal)
    assert_close(comm, full, ref, peer[0], f"{tag} out")
    assert_close(comm, full_lse, ref_lse, peer[1], f"{tag} lse")
    if not grads:
        return
    g = ringmpi.ring_attention_backward(
        dl, ql, kl, vl, out, lse, comm, causal=causal, layout=layout, **kw
    )
    want = once(comm, attention_backward, dout, q, k, v, causal)
    other = (
        (None,) * 3 if dtype == np.float64 else once(comm, dense_backward, dout, q, k, v, causal)
    )
    for gi, w, o, name, n in zip(g, want, other, "qkv", (nq, nk, nk)):
        got = ringmpi.gather(gi, n, comm, layout, **kw)
        extra = 0.0 if o is None else lse_budget(full_lse, ref_lse, w)
        assert_close(comm, got, w, o, f"{tag} d{name}", factor=3.0, extra=extra)


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_long_key_rows(comm, layout, dtype):
    """48 query tokens per rank against 65,536 keys spread over the ring (cross-attention)."""
    _check(comm, 48 * comm.size, 65536, False, layout, dtype, 30, h=2, hkv=1, grads=False)


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
def test_long_key_rows_backward(comm, layout):
    """dq over 16,384 keys and dk/dv over 16,384 queries, through the ring backward."""
    _check(comm, 32 * comm.size, 16384, False, layout, np.float32, 31, h=2, hkv=1)
    _check(comm, 16384, 32 * comm.size, False, layout, np.float32, 32, h=2, hkv=1)


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention(comm, layout, causal):
    """2,053 tokens (uneven shards), GQA, forward and backward, float32."""
    _check(comm, 2053, 2053, causal, layout, np.float32, 33)


def test_head_parallel(comm):
    """Heads x ring on real-shaped values (U = 2 where P is even)."""
    if comm.size % 2:
        pytest.skip(f"head_parallel=2 needs an even P, not {comm.size}")
    _check(comm, 1031, 1031, True, "zigzag", np.float32, 34, h=4, hkv=2, head_parallel=2)


def test_decode_long_cache(comm):
    """Four new queries against a 65,536-token cache sharded over the ranks."""
    rng = np.random.default_rng(35)
    q, k, v = random_qkv(rng, 4, 4, 2, 32, dtype=np.float32, nk=65536, realistic=True)
    parts = np.array_split(np.arange(65536), comm.size)[comm.rank]
    out = ringmpi.decode_attention(q, k[parts], v[parts], comm)
    ref = once(comm, attention, q, k, v)[0]
    assert_close(comm, out, ref, once(comm, dense, q, k, v)[0], "decode out")
