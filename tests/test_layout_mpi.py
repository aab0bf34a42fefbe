"""The balanced layout (issue 41) over the ring, forward and backward, against dense float64.

Every mask kind the layout deals by (builders of slices, causal, a causal window,
packed sequences) goes through shard, ring_attention, its backward and gather with
``layout="balanced"``; the reference is the dense float64 attention of the explicit
mask (tests/tools/slicecases.py for slices), computed once per call.
"""

import numpy as np
import pytest
from tools.slicecases import builder_cases, dense_of, random_slices

import ringmpi
from ringmpi import slices as sl
from ringmpi.layout import counts
from ringmpi.mask import make_mask, mask_of
from ringmpi.reference import attention, attention_backward
from ringmpi.spec import AttentionSpec
from ringmpi.testing import (
    assert_all,
    assert_close,
    dense,
    dense_backward,
    lse_budget,
    once,
    raises_everywhere,
    random_qkv,
)

pytestmark = pytest.mark.mpi

N = 150
CU = np.array([0, 37, 38, 110, N])


def _cases(n: int) -> list:
    """(name, mask keywords of the call and of shard, reference keywords, ring Mask)."""
    out = []
    for name, s, _ in builder_cases(n):
        kw = dict(slices=s)
        out.append((name, kw, dict(mask=dense_of(s, n, n)), mask_of(AttentionSpec(**kw), n, n)))
    for name, kw in (
        ("causal", dict(causal=True)),
        ("causal window", dict(causal=True, window=(20, -1))),
        ("packed window", dict(cu_seqlens=CU, window=(9, 4))),
    ):
        out.append((name, kw, kw, make_mask(n, n, **{"causal": False, **kw})))
    return out


def _run(comm, rng, case, dtype, n=N):
    name, kw, ref_kw, mask = case
    lay = "balanced"
    q, k, v = random_qkv(rng, n, 4, 2, 16, dtype=dtype, realistic=True)
    dout = rng.standard_normal(q.shape).astype(dtype)
    ql, kl, vl, dl = (ringmpi.shard(x, comm, lay, **kw) for x in (q, k, v, dout))
    want_count = counts(n, comm.size, lay, mask=mask)[comm.rank]
    assert_all(comm, len(ql) == want_count, f"{name}: shard gave {len(ql)}, not {want_count}")
    stats: dict = {}
    out, lse = ringmpi.ring_attention(
        ql, kl, vl, comm, layout=lay, return_lse=True, stats=stats, **kw
    )
    grads = ringmpi.ring_attention_backward(dl, ql, kl, vl, out, lse, comm, layout=lay, **kw)
    tag = f"{name} balanced {np.dtype(dtype)} P={comm.size}"
    full = ringmpi.gather(out, n, comm, lay, **kw)
    full_lse = ringmpi.gather(lse, n, comm, lay, axis=-1, **kw)
    ref, ref_lse = once(comm, attention, q, k, v, **ref_kw)
    f32 = dtype != np.float64
    peer = once(comm, dense, q, k, v, **ref_kw) if f32 else (None, None)
    assert_close(comm, full, ref, peer[0], f"{tag} out")
    assert_close(comm, full_lse, ref_lse, peer[1], f"{tag} lse")
    want = once(comm, attention_backward, dout, q, k, v, **ref_kw)
    other = once(comm, dense_backward, dout, q, k, v, **ref_kw) if f32 else (None,) * 3
    for g, w, o, nm in zip(grads, want, other, "qkv"):
        got = ringmpi.gather(g, n, comm, lay, **kw)
        extra = lse_budget(full_lse, ref_lse, w) if f32 else 0.0
        assert_close(comm, got, w, o, f"{tag} d{nm}", factor=3.0, extra=extra)
    # every visible pair counted once over the ranks
    pairs = ringmpi.cost.mask_pairs(mask) * 4 * 16
    fwd = comm.allreduce(stats["flops"])
    assert_all(comm, fwd == 4 * pairs, f"{tag}: flops {fwd}, want {4 * pairs}")


@pytest.mark.parametrize("kernel", ["auto", "numpy"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_balanced_matches_the_dense_reference(comm, dtype, kernel, monkeypatch):
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", kernel)  # auto: the fused tiles where they build
    for i, case in enumerate(_cases(N)):
        _run(comm, np.random.default_rng(20 + i), case, dtype)


def test_balanced_with_heads_x_ring(comm):
    """head_parallel = P: the one ring position's tokens split over its members."""
    u, n = comm.size, 90
    s = sl.global_local(n, (6, 2), 3)
    rng = np.random.default_rng(8)
    q, k, v = random_qkv(rng, n, 2 * u, u, 8, realistic=True)
    dout = rng.standard_normal(q.shape)
    cut = [ringmpi.shard(x, comm, "balanced", head_parallel=u, slices=s) for x in (q, k, v, dout)]
    kw = dict(layout="balanced", slices=s, head_parallel=u)
    out, lse = ringmpi.ring_attention(*cut[:3], comm, return_lse=True, **kw)
    grads = ringmpi.ring_attention_backward(cut[3], *cut[:3], out, lse, comm, **kw)
    mask = dense_of(s, n, n)
    ref, _ = once(comm, attention, q, k, v, mask=mask)
    want = once(comm, attention_backward, dout, q, k, v, mask=mask)
    for got, w, nm in zip((out, *grads), (ref, *want), ("out", "dq", "dk", "dv")):
        full = ringmpi.gather(got, n, comm, "balanced", head_parallel=u, slices=s)
        assert_close(comm, full, w, None, f"balanced heads x ring {nm}")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_balanced_cross_attention(comm, dtype):
    """Queries dealt by their cost, keys cut contiguously; shard/gather take mask=."""
    nq, nk = 75, 181
    raw = random_slices(np.random.default_rng(6), nq, nk, 6)
    cu_q, cu_k = np.array([0, 30, 31, nq]), np.array([0, 90, 100, nk])
    cases = [
        ("slices 75x181", dict(slices=sl.Slices(raw)), None, dict(mask=dense_of(raw, nq, nk))),
        ("packed causal", dict(causal=True, cu_seqlens=cu_q, cu_seqlens_k=cu_k), cu_k, None),
    ]
    for i, (name, kw, kv_cu, ref_kw) in enumerate(cases):
        ref_kw = kw if ref_kw is None else ref_kw
        mask = mask_of(AttentionSpec(**kw), nq, nk)
        q_cu = kw.get("cu_seqlens")
        rng = np.random.default_rng(30 + i)
        q, k, v = random_qkv(rng, nq, 4, 2, 16, nk=nk, dtype=dtype, realistic=True)
        dout = rng.standard_normal(q.shape).astype(dtype)
        ql, dl = (ringmpi.shard(x, comm, "balanced", cu_seqlens=q_cu, mask=mask) for x in (q, dout))
        kl, vl = (ringmpi.shard(x, comm, "balanced", cu_seqlens=kv_cu, mask=mask) for x in (k, v))
        out, lse = ringmpi.ring_attention(
            ql, kl, vl, comm, layout="balanced", return_lse=True, **kw
        )
        grads = ringmpi.ring_attention_backward(
            dl, ql, kl, vl, out, lse, comm, layout="balanced", **kw
        )
        tag = f"cross {name} balanced {np.dtype(dtype)} P={comm.size}"
        got = ringmpi.gather(out, nq, comm, "balanced", cu_seqlens=q_cu, mask=mask)
        got_lse = ringmpi.gather(lse, nq, comm, "balanced", -1, cu_seqlens=q_cu, mask=mask)
        ref, ref_lse = once(comm, attention, q, k, v, **ref_kw)
        f32 = dtype != np.float64
        peer = once(comm, dense, q, k, v, **ref_kw) if f32 else (None, None)
        assert_close(comm, got, ref, peer[0], f"{tag} out")
        assert_close(comm, got_lse, ref_lse, peer[1], f"{tag} lse")
        want = once(comm, attention_backward, dout, q, k, v, **ref_kw)
        other = once(comm, dense_backward, dout, q, k, v, **ref_kw) if f32 else (None,) * 3
        for g, w, o, nm, n, cu in zip(
            grads, want, other, "qkv", (nq, nk, nk), (q_cu, kv_cu, kv_cu)
        ):
            full = ringmpi.gather(g, n, comm, "balanced", cu_seqlens=cu, mask=mask)
            extra = lse_budget(got_lse, ref_lse, w) if f32 else 0.0
            assert_close(comm, full, w, o, f"{tag} d{nm}", factor=3.0, extra=extra)


def test_balanced_bad_input_raises_on_every_rank(comm):
    n = 30 * comm.size
    x = np.ones((n, 2, 4))
    raises_everywhere(comm, lambda: ringmpi.shard(x, comm, "balanced"), "computed from the mask")
    raises_everywhere(
        comm, lambda: ringmpi.gather(x[:1], n, comm, "balanced"), "computed from the mask"
    )
    # cut for one mask, called with another: the token counts disagree
    s = sl.global_local(n, 3, 2 * comm.size)
    ql = ringmpi.shard(x, comm, "balanced", slices=s)
    if comm.size > 1:
        raises_everywhere(
            comm,
            lambda: ringmpi.ring_attention(ql, ql, ql, comm, layout="balanced", causal=True),
            "layout='balanced'",
        )
    raises_everywhere(
        comm,
        lambda: ringmpi.shard(
            x, comm, "balanced", causal=True, mask=mask_of(AttentionSpec(), n, n)
        ),
        "not both",
    )
