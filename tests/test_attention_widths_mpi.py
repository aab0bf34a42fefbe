"""Keys and values of different widths (Dk != Dv) over the ring, forward and backward.

Multi-head latent attention (issue 42): q and k have the key width Dk, v and the output
the value width Dv. Every layout, causal / window / packed / cross, GQA and MQA, float32
and float64, against the dense float64 reference on values shaped like real data
(nonzero means, a small value spread, a few huge keys), with the tolerance rule of
:mod:`ringmpi.testing` (it can fail: see test_a_wrong_scale_fails). The packed K/V
message carries B Hkv Sk (Dk + Dv) elements per block: the bytes each rank sends are
those the cost model predicts.
"""

import numpy as np
import pytest

import ringmpi
from ringmpi import cost
from ringmpi.layout import counts as layout_counts
from ringmpi.mask import make_mask
from ringmpi.reference import attention, attention_backward
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

LENGTHS = (3, 61, 1, 90)
CU = np.concatenate(([0], np.cumsum(LENGTHS)))  # 155 tokens in four sequences

# (name, nq, nk, causal, mask keywords, (H, Hkv), (Dk, Dv), batch)
CASES = [
    ("causal mqa 192/128", 130, 130, True, {}, (4, 1), (192, 128), None),
    ("window gqa 40/24", 157, 157, False, dict(window=(23, 9)), (6, 2), (40, 24), 2),
    (
        "packed causal 8/64",
        int(CU[-1]),
        int(CU[-1]),
        True,
        dict(cu_seqlens=CU),
        (4, 2),
        (8, 64),
        None,
    ),
    ("cross causal mqa 40/24", 70, 151, True, {}, (3, 1), (40, 24), None),
    (
        "cross packed window 8/64",
        int(CU[-1]),
        int(CU[-1]) + 4 * 11,
        True,
        dict(cu_seqlens=CU, cu_seqlens_k=CU + 11 * np.arange(len(CU)), window=(30, 0)),
        (2, 2),
        (8, 64),
        None,
    ),
    ("none mha 24/40", 101, 101, False, {}, (2, 2), (24, 40), 2),
]


def _problem(comm, case, dtype, seed):
    name, nq, nk, causal, mask, (h, hkv), (dk, dv), batch = case
    if comm.rank == 0:
        rng = np.random.default_rng(seed)
        q, k, v = random_qkv(rng, nq, h, hkv, dk, batch, realistic=True, nk=nk, dv=dv)
        dout = 0.2 + 0.1 * rng.standard_normal((*q.shape[:-1], dv))
        data = tuple(x.astype(dtype) for x in (q, k, v, dout))
    else:
        data = None
    return comm.bcast(data)


def _run(comm, case, layout, dtype, seed, scale=None):
    name, nq, nk, causal, mask, (h, hkv), (dk, dv), batch = case
    q, k, v, dout = _problem(comm, case, dtype, seed)
    cu_q, cu_k = mask.get("cu_seqlens"), mask.get("cu_seqlens_k", mask.get("cu_seqlens"))
    ql, dl = (ringmpi.shard(x, comm, layout, cu_seqlens=cu_q) for x in (q, dout))
    kl, vl = (ringmpi.shard(x, comm, layout, cu_seqlens=cu_k) for x in (k, v))
    stats: dict = {}
    kw = dict(causal=causal, layout=layout, scale=scale, **mask)
    out, lse = ringmpi.ring_attention(ql, kl, vl, comm, return_lse=True, stats=stats, **kw)
    tag = f"{name} {layout} {np.dtype(dtype)}"
    assert_all(
        comm,
        out.shape == (*ql.shape[:-1], dv) and out.dtype == dtype and out.flags.c_contiguous,
        f"{tag}: out {out.shape} {out.dtype}",
    )
    bstats: dict = {}
    grads = ringmpi.ring_attention_backward(dl, ql, kl, vl, out, lse, comm, stats=bstats, **kw)
    for g, x, nm in zip(grads, (ql, kl, vl), "qkv"):
        ok = g.shape == x.shape and g.dtype == x.dtype
        assert_all(comm, ok, f"{tag}: d{nm} {g.shape} {g.dtype} vs {x.shape}")
    full = ringmpi.gather(out, nq, comm, layout, cu_seqlens=cu_q)
    full_lse = ringmpi.gather(lse, nq, comm, layout, axis=-1, cu_seqlens=cu_q)
    return q, k, v, dout, full, full_lse, grads, stats, bstats


def _check(comm, case, layout, dtype, seed):
    name, nq, nk, causal, mask, (h, hkv), (dk, dv), batch = case
    q, k, v, dout, full, full_lse, grads, stats, bstats = _run(comm, case, layout, dtype, seed)
    tag = f"{name} {layout} {np.dtype(dtype)}"
    ref, ref_lse = once(comm, attention, q, k, v, causal, **mask)
    low = dtype != np.float64
    peer = once(comm, dense, q, k, v, causal, **mask) if low else (None, None)
    assert_close(comm, full, ref, peer[0], f"{tag} out")
    assert_close(comm, full_lse, ref_lse, peer[1], f"{tag} lse", extra=_scale_ulp(q, k, low))
    want = once(comm, attention_backward, dout, q, k, v, causal, **mask)
    other = once(comm, dense_backward, dout, q, k, v, causal, **mask) if low else (None,) * 3
    cu_q, cu_k = mask.get("cu_seqlens"), mask.get("cu_seqlens_k", mask.get("cu_seqlens"))
    for g, w, o, nm, n, cu in zip(grads, want, other, "qkv", (nq, nk, nk), (cu_q, cu_k, cu_k)):
        got = ringmpi.gather(g, n, comm, layout, cu_seqlens=cu)
        extra = 0.0 if o is None else lse_budget(full_lse, ref_lse, w)
        if o is not None and nm == "q":
            extra += _delta_budget(dout, full, ref, k)
        assert_close(comm, got, w, o, f"{tag} d{nm}", factor=3.0, extra=extra)
    # the model flops of the visible pairs: 2 (Dk + Dv) forward, 2 (3 Dk + 2 Dv) backward
    pairs = cost.mask_pairs(make_mask(nq, nk, causal, **_mask_kw(mask)))
    b = 1 if batch is None else batch
    fwd = comm.allreduce(stats["flops"])
    bwd = comm.allreduce(bstats["flops"])
    assert_all(comm, fwd == 2 * pairs * (dk + dv) * h * b, f"{tag}: forward flops {fwd}")
    assert_all(comm, bwd == 2 * pairs * (3 * dk + 2 * dv) * h * b, f"{tag}: backward {bwd}")
    return stats


def _scale_ulp(q, k, low: bool) -> float:
    """One float32 ulp of the largest |score|: the tiles round scale * q to float32 before
    the product, the dense peer rounds the product; with a scale that is not a power of two
    (1/sqrt(24)) and the huge sink keys the lse differs by that much (the same at Dk == Dv,
    numpy and fused tiles alike; cf. _lse_extra of tests/test_backend_conformance.py)."""
    if not low:
        return 0.0
    q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
    g = q64.shape[-2] // k64.shape[-2]
    kk = np.repeat(k64, g, axis=-2)
    s = np.einsum("...qhd,...khd->...hqk", q64, kk) * q64.shape[-1] ** -0.5
    return 2.0**-24 * float(np.abs(s).max())


def _delta_budget(dout, out, ref, k) -> float:
    """How far the float32 delta = dO . O moves dq: scale x max|delta - exact| x max|k|.

    The backward forms delta from the forward's float32 output, summing Dv products in
    float32 (dq_i = scale sum_j P_ij (dP_ij - delta_i) k_j, P summing to 1); wide values
    (Dv = 64) with a large scale (Dk = 8) and the huge sink keys make this term exceed the
    dense peer's error at some P (cf. delta_budget of tests/tools/conformance.py)."""
    f32 = np.float32
    delta = (np.asarray(dout, f32) * np.asarray(out, f32)).sum(axis=-1, dtype=f32)
    exact = (np.asarray(dout, np.float64) * ref).sum(axis=-1)
    err = float(np.abs(delta.astype(np.float64) - exact).max(initial=0.0))
    return k.shape[-1] ** -0.5 * err * float(np.abs(np.asarray(k, np.float64)).max(initial=0.0))


def _mask_kw(mask: dict) -> dict:
    return dict(
        window=mask.get("window"),
        cu_seqlens=mask.get("cu_seqlens"),
        cu_seqlens_k=mask.get("cu_seqlens_k"),
    )


@pytest.mark.parametrize("kernel", ["auto", "numpy"])
@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_widths_match_reference(comm, layout, dtype, kernel, monkeypatch):
    """Every case, forward and backward, against the dense float64 reference; auto: the
    fused C tiles where they build, numpy: the specification."""
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", kernel)
    for i, case in enumerate(CASES):
        _check(comm, case, layout, dtype, 200 + i)


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
def test_ring_sends_dk_plus_dv_per_token(comm, layout):
    """Each rank sends, per ring step it forwards, Sk Hkv (Dk + Dv) elements of its block."""
    case = (
        "full mqa 192/128",
        64 * comm.size + 1,
        64 * comm.size + 1,
        False,
        {},
        (4, 1),
        (192, 128),
        None,
    )
    _, _, _, _, _, _, _, stats, _ = _run(comm, case, layout, np.float32, 11)
    counts = layout_counts(case[2], comm.size, layout)
    # at step s < P - 1 a rank forwards the block of rank (rank - s) mod P
    want = sum(
        cost.kv_bytes(int(counts[(comm.rank - s) % comm.size]), 1, 192, 4, dv=128)
        for s in range(comm.size - 1)
    )
    got = stats["bytes_sent"]
    assert_all(comm, got == want, f"bytes_sent {got} != {want} (Sk Hkv (Dk + Dv) per step)")


def test_scale_default_is_one_over_sqrt_dk_and_settable(comm):
    """The scale defaults to 1/sqrt(Dk); a given scale (MLA: the unabsorbed head width) wins."""
    case = CASES[0]
    name, nq, nk, causal, mask, (h, hkv), (dk, dv), batch = case
    q, k, v, _, full, _, _, _, _ = _run(comm, case, "zigzag", np.float64, 5)
    ref, _ = attention(q, k, v, causal, scale=dk**-0.5)
    assert_close(comm, full, ref, None, "default scale")
    q, k, v, _, full, _, _, _, _ = _run(comm, case, "zigzag", np.float64, 5, scale=0.07)
    ref, _ = attention(q, k, v, causal, scale=0.07)
    assert_close(comm, full, ref, None, "scale=0.07")


def test_a_wrong_scale_fails(comm):
    """The comparison is not vacuous: 1/sqrt(Dv) instead of 1/sqrt(Dk) is caught."""
    case = CASES[0]
    name, nq, nk, causal, mask, (h, hkv), (dk, dv), batch = case
    q, k, v, _, full, _, _, _, _ = _run(comm, case, "zigzag", np.float32, 5)
    ref, _ = attention(q, k, v, causal)
    assert_close(comm, full, ref, dense(q, k, v, causal)[0], "right scale")
    wrong, _ = attention(q, k, v, causal, scale=dv**-0.5)
    with pytest.raises(AssertionError, match="max err"):
        assert_close(comm, full, wrong, dense(q, k, v, causal, dv**-0.5)[0], "wrong scale")


def test_bad_widths_raise_on_every_rank(comm):
    """k and v that differ in more than the last axis, or dout of the key width: one error."""
    rng = np.random.default_rng(0)
    n = 20 * comm.size
    q, k, v = random_qkv(rng, n, 4, 2, 16, dv=8)
    ql, kl, vl = (ringmpi.shard(x, comm) for x in (q, k, v))
    bad_v = vl[:, :1] if comm.rank == comm.size - 1 else vl  # Hkv 1 on the last rank
    raises_everywhere(comm, lambda: ringmpi.ring_attention(ql, kl, bad_v, comm), "differ")
    wide_q = np.concatenate([ql, ql], axis=-1)
    raises_everywhere(comm, lambda: ringmpi.ring_attention(wide_q, kl, vl, comm), "head dim")
    out, lse = ringmpi.ring_attention(ql, kl, vl, comm, return_lse=True)
    assert_all(comm, out.shape[-1] == 8, f"out {out.shape}")
    dout_k = np.ones(ql.shape)  # the key width: the output has Dv = 8
    raises_everywhere(
        comm,
        lambda: ringmpi.ring_attention_backward(dout_k, ql, kl, vl, out, lse, comm),
        "dout has shape",
    )
    # one rank whose v is narrower than the others': the agreement names the field
    v_odd = vl[..., :4] if comm.size > 1 and comm.rank == 1 else vl
    if comm.size > 1:
        raises_everywhere(comm, lambda: ringmpi.ring_attention(ql, kl, v_odd, comm), "kv shape")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_score_modifiers_and_sinks_with_other_widths(comm, dtype):
    """softcap, ALiBi and sinks with Dk = 40, Dv = 24 (GQA 4/2, causal window, zigzag),
    forward and backward (dsinks too) against the dense float64 reference."""
    rng = np.random.default_rng(9)
    n = 61 * comm.size + 3
    q, k, v = comm.bcast(random_qkv(rng, n, 4, 2, 40, realistic=True, dv=24))
    dout = comm.bcast(0.2 + 0.1 * rng.standard_normal((n, 4, 24)))
    q, k, v, dout = (x.astype(dtype) for x in (q, k, v, dout))
    kw = dict(
        causal=True,
        window=(50, 0),
        softcap=8.0,
        alibi_slopes=(0.25, 0.0625, 0.0, 0.015625),
        sinks=(1.5, -0.5, 3.0, 0.0),
    )
    loc = [ringmpi.shard(x, comm, "zigzag") for x in (q, k, v, dout)]
    out, lse = ringmpi.ring_attention(*loc[:3], comm, return_lse=True, **kw)
    grads = ringmpi.ring_attention_backward(loc[3], *loc[:3], out, lse, comm, **kw)
    full = ringmpi.gather(out, n, comm)
    full_lse = ringmpi.gather(lse, n, comm, axis=-1)
    ref, ref_lse = once(comm, attention, q, k, v, **kw)
    low = dtype != np.float64
    peer = once(comm, dense, q, k, v, **kw) if low else (None, None)
    assert_close(comm, full, ref, peer[0], "modifiers out")
    assert_close(comm, full_lse, ref_lse, peer[1], "modifiers lse", extra=_scale_ulp(q, k, low))
    want = once(comm, attention_backward, dout, q, k, v, **kw)
    other = once(comm, dense_backward, dout, q, k, v, **kw) if low else (None,) * 4
    for g, w, o, nm in zip(grads, want, other, ("dq", "dk", "dv", "dsinks")):
        got = g if nm == "dsinks" else ringmpi.gather(g, n, comm)
        extra = 0.0 if o is None else lse_budget(full_lse, ref_lse, w)
        if o is not None and nm == "dq":
            extra += _delta_budget(dout, full, ref, k)
        assert_close(comm, got, w, o, f"modifiers {nm}", factor=3.0, extra=extra)


def test_heads_x_ring_with_other_widths(comm):
    """Heads x ring (head_parallel=2) carries q, k (Dk) and v, out, dout (Dv) through its
    all-to-alls: forward and backward against the dense float64 reference."""
    if comm.size % 2:
        pytest.skip("head_parallel=2 needs an even number of ranks")
    rng = np.random.default_rng(12)
    q, k, v = comm.bcast(random_qkv(rng, 97, 4, 2, 40, realistic=True, dv=24))
    dout = comm.bcast(0.2 + 0.1 * rng.standard_normal((97, 4, 24)))
    kw = dict(layout="zigzag", head_parallel=2)
    loc = [ringmpi.shard(x, comm, **kw) for x in (q, k, v, dout)]
    out, lse = ringmpi.ring_attention(*loc[:3], comm, causal=True, return_lse=True, **kw)
    grads = ringmpi.ring_attention_backward(loc[3], *loc[:3], out, lse, comm, causal=True, **kw)
    assert_close(
        comm, ringmpi.gather(out, 97, comm, **kw), attention(q, k, v, True)[0], None, "out"
    )
    for g, w, nm in zip(grads, attention_backward(dout, q, k, v, True), "qkv"):
        assert_close(comm, ringmpi.gather(g, 97, comm, **kw), w, None, f"d{nm}")
