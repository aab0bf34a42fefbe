"""Masks of slices over the ring, forward and backward, against the dense float64 reference.

The reference takes the explicit boolean mask written by tests/tools/slicecases.py
straight from the slices' definition (not ringmpi.slices' normal form).
"""

import numpy as np
import pytest
from tools.slicecases import dense_of, random_slices, ring_cases

import ringmpi
from ringmpi import slices as sl
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

N = 150


def _run(comm, rng, case, layout, dtype, **mods):
    name, nq, nk, s, mask = case
    h, hkv, d = 4, 2, 16
    q, k, v = random_qkv(rng, nq, h, hkv, d, nk=nk, dtype=dtype, realistic=True)
    dout = rng.standard_normal(q.shape).astype(dtype)
    ql, dl = (ringmpi.shard(x, comm, layout) for x in (q, dout))
    kl, vl = (ringmpi.shard(x, comm, layout) for x in (k, v))
    stats: dict = {}
    out, lse = ringmpi.ring_attention(
        ql, kl, vl, comm, layout=layout, slices=s, return_lse=True, stats=stats, **mods
    )
    bstats: dict = {}
    grads = ringmpi.ring_attention_backward(
        dl, ql, kl, vl, out, lse, comm, layout=layout, slices=s, stats=bstats, **mods
    )
    tag = f"{name} {layout} {np.dtype(dtype)} {sorted(mods)}"
    full = ringmpi.gather(out, nq, comm, layout)
    full_lse = ringmpi.gather(lse, nq, comm, layout, axis=-1)
    ref, ref_lse = once(comm, attention, q, k, v, mask=mask, **mods)
    f32 = dtype != np.float64
    peer = once(comm, dense, q, k, v, mask=mask, **mods) if f32 else (None, None)
    assert_close(comm, full, ref, peer[0], f"{tag} out")
    assert_close(comm, full_lse, ref_lse, peer[1], f"{tag} lse")
    empty = ~mask.any(axis=1)
    ok = (full[empty] == 0).all() and (full_lse[:, empty] == -np.inf).all()
    assert_all(comm, ok, f"{tag}: rows with no visible key must give out 0 and lse -inf")
    want = once(comm, attention_backward, dout, q, k, v, mask=mask, **mods)
    other = once(comm, dense_backward, dout, q, k, v, mask=mask, **mods) if f32 else (None,) * 3
    for g, w, o, nm, n in zip(grads, want, other, "qkv", (nq, nk, nk)):
        got = ringmpi.gather(g, n, comm, layout)
        extra = lse_budget(full_lse, ref_lse, w) if f32 else 0.0
        assert_close(comm, got, w, o, f"{tag} d{nm}", factor=3.0, extra=extra)
    # every visible pair counted once, over all ranks, forward and backward
    pairs = int(mask.sum()) * h * d
    fwd, bwd = comm.allreduce(stats["flops"]), comm.allreduce(bstats["flops"])
    assert_all(comm, (fwd, bwd) == (4 * pairs, 10 * pairs), f"{tag}: flops {fwd}, {bwd}")
    return stats


@pytest.mark.parametrize("kernel", ["auto", "numpy"])
@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_slices_match_the_explicit_mask(comm, layout, dtype, kernel, monkeypatch):
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", kernel)  # auto: the fused tiles where they build
    for i, case in enumerate(ring_cases(N)):
        _run(comm, np.random.default_rng(10 + i), case, layout, dtype)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_slices_with_score_modifiers(comm, layout):
    mods = dict(softcap=20.0, alibi_slopes=[0.25, 0.0625, 0.5, 0.125], sinks=[1.0, 0.0, -1.0, 2.0])
    cases = [c for c in ring_cases(N) if c[0] in ("prefix_lm", "random 7 slices 150x150")]
    for i, case in enumerate(cases):  # with sinks an empty row gets out 0 and lse = sink_h
        _run_mods(comm, np.random.default_rng(40 + i), case, layout, mods)


def _run_mods(comm, rng, case, layout, mods):
    name, nq, nk, s, mask = case
    q, k, v = random_qkv(rng, nq, 4, 2, 16, nk=nk, realistic=True)
    dout = rng.standard_normal(q.shape)
    ql, kl, vl, dl = (ringmpi.shard(x, comm, layout) for x in (q, k, v, dout))
    out, lse = ringmpi.ring_attention(
        ql, kl, vl, comm, layout=layout, slices=s, return_lse=True, **mods
    )
    grads = ringmpi.ring_attention_backward(
        dl, ql, kl, vl, out, lse, comm, layout=layout, slices=s, **mods
    )
    ref, ref_lse = once(comm, attention, q, k, v, mask=mask, **mods)
    want = once(comm, attention_backward, dout, q, k, v, mask=mask, **mods)
    tag = f"{name} {layout} modifiers"
    assert_close(comm, ringmpi.gather(out, nq, comm, layout), ref, None, f"{tag} out")
    assert_close(comm, ringmpi.gather(lse, nq, comm, layout, axis=-1), ref_lse, None, f"{tag} lse")
    for g, w, nm, n in zip(grads[:3], want[:3], "qkv", (nq, nk, nk)):
        assert_close(comm, ringmpi.gather(g, n, comm, layout), w, None, f"{tag} d{nm}")
    assert_close(comm, grads[3], want[3], None, f"{tag} dsinks")


def test_a_local_mask_skips_ring_steps(comm):
    """A causal window of slices under the contiguous layout needs two ring steps at most."""
    n = 40 * comm.size
    s = sl.global_local(n, (10, 0), 0, causal=True)
    stats = _run(
        comm,
        np.random.default_rng(5),
        ("window", n, n, s, dense_of(s, n, n)),
        "contiguous",
        np.float64,
    )
    assert_all(comm, stats["steps"] == min(2, comm.size), f"steps {stats['steps']}")


def test_bad_slices_raise_on_every_rank(comm):
    n = 30 * comm.size
    q = np.ones((n, 2, 4))
    ql = ringmpi.shard(q, comm)
    ok = sl.prefix_lm(n, 3)
    raises_everywhere(
        comm,
        lambda: ringmpi.ring_attention(ql, ql, ql, comm, slices=ok, causal=True),
        "slices is the whole mask",
    )
    raises_everywhere(
        comm,
        lambda: ringmpi.ring_attention(ql, ql, ql, comm, slices=sl.prefix_lm(n + 1, 3)),
        "reaches beyond",
    )
    raises_everywhere(
        comm,
        lambda: ringmpi.ring_attention(ql, ql, ql, comm, slices=[(0, 1, 0, 1, "diag")]),
        "slices:",
        "kind",
    )
    # a rank that disagrees about the slices
    mine = ok if comm.rank else sl.prefix_lm(n, 4)
    if comm.size > 1:
        raises_everywhere(
            comm, lambda: ringmpi.ring_attention(ql, ql, ql, comm, slices=mine), "slices"
        )


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
def test_slices_with_heads_x_ring_and_a_batch(comm, layout):
    """head_parallel = P (the ring is one group) and a batch axis, forward and backward."""
    u, n = comm.size, 90
    raw = random_slices(np.random.default_rng(3), n, n, 5)
    s, mask = sl.Slices(raw), dense_of(raw, n, n)
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, n, 2 * u, u, 8, batch=2, realistic=True)
    dout = rng.standard_normal(q.shape)
    cut = [ringmpi.shard(x, comm, layout, head_parallel=u) for x in (q, k, v, dout)]
    kw = dict(layout=layout, slices=s, head_parallel=u)
    out, lse = ringmpi.ring_attention(*cut[:3], comm, return_lse=True, **kw)
    grads = ringmpi.ring_attention_backward(cut[3], *cut[:3], out, lse, comm, **kw)
    ref, _ = once(comm, attention, q, k, v, mask=mask)
    want = once(comm, attention_backward, dout, q, k, v, mask=mask)
    for got, w, nm in zip((out, *grads), (ref, *want), ("out", "dq", "dk", "dv")):
        full = ringmpi.gather(got, n, comm, layout, head_parallel=u)
        assert_close(comm, full, w, None, f"{layout} heads x ring {nm}")
