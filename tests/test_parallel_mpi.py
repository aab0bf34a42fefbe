"""Heads x ring (head_parallel=U) and 2-D grids against the dense float64 reference."""

import numpy as np
import pytest

import ringmpi
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

H = 12  # divisible by U = 2, 3, 4


def _cases(size):
    for u in [x for x in (2, 3, 4) if size % x == 0]:
        for hkv in sorted({1, u, 2 * u} & {d for d in range(1, H + 1) if H % d == 0}):
            yield u, hkv


def _params(size):
    return [(u, hkv, lay) for u, hkv in _cases(size) for lay in ringmpi.LAYOUTS]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_head_parallel_forward_backward(comm, rng, causal, dtype):
    cases = _params(comm.size)
    if not cases:
        pytest.skip(f"no head_parallel degree > 1 divides P={comm.size}")
    for u, hkv, layout in cases:
        n = 97 * comm.size + 5
        q, k, v = random_qkv(rng, n, H, hkv, 16, dtype=dtype)
        dout = rng.standard_normal(q.shape).astype(dtype)
        kw = dict(layout=layout, head_parallel=u)
        sl = [ringmpi.shard(x, comm, **kw) for x in (q, k, v, dout)]
        out, lse = ringmpi.ring_attention(*sl[:3], comm, causal=causal, return_lse=True, **kw)
        grads = ringmpi.ring_attention_backward(sl[3], *sl[:3], out, lse, comm, causal=causal, **kw)
        full = ringmpi.gather(out, n, comm, **kw)
        full_lse = ringmpi.gather(lse, n, comm, axis=-1, **kw)
        ref, ref_lse = once(comm, attention, q, k, v, causal)
        case = f"U={u} Hkv={hkv} {layout} causal={causal} {np.dtype(dtype)}"
        peer = None if dtype == np.float64 else once(comm, dense, q, k, v, causal)
        assert_close(comm, full, ref, None if peer is None else peer[0], f"{case} out")
        assert_close(comm, full_lse, ref_lse, None if peer is None else peer[1], f"{case} lse")
        want = once(comm, attention_backward, dout, q, k, v, causal)
        other = None if dtype == np.float64 else once(comm, dense_backward, dout, q, k, v, causal)
        for name, g, w, o in zip("qkv", grads, want, other or (None,) * 3):
            got = ringmpi.gather(g, n, comm, **kw)
            assert_all(comm, g.dtype == dtype, f"{case} d{name} dtype {g.dtype}")
            extra = 0.0 if o is None else lse_budget(full_lse, ref_lse, w)
            assert_close(comm, got, w, o, f"{case} d{name}", factor=3.0, extra=extra)


def test_head_parallel_batched(comm, rng):
    if comm.size % 2:
        pytest.skip("needs an even P")
    n, u = 64 * comm.size + 3, 2
    q, k, v = random_qkv(rng, n, 4, 2, 8, batch=3)
    sl = [ringmpi.shard(x, comm, layout="zigzag", head_parallel=u) for x in (q, k, v)]
    out = ringmpi.ring_attention(*sl, comm, causal=True, head_parallel=u)
    full = ringmpi.gather(out, n, comm, head_parallel=u)
    assert_close(comm, full, once(comm, attention, q, k, v, True)[0], None, "batched out")


def test_head_parallel_bad_arguments(comm, rng):
    q, k, v = random_qkv(rng, 30 * comm.size, 6, 2, 8)
    loc = [ringmpi.shard(x, comm) for x in (q, k, v)]
    bad_u = comm.size + 1
    raises_everywhere(
        comm, lambda: ringmpi.ring_attention(*loc, comm, head_parallel=bad_u), "head_parallel"
    )
    if comm.size % 4 == 0:  # Hkv=2 vs U=4: fine; H=6 vs U=4: not a multiple
        raises_everywhere(comm, lambda: ringmpi.ring_attention(*loc, comm, head_parallel=4), "H=6")


def test_grid_rings_run_independent_sequences(comm, rng):
    if comm.size % 2:
        pytest.skip("needs an even P")
    ring, across = ringmpi.grid(comm, ring_size=comm.size // 2 if comm.size > 2 else 1)
    try:
        g = across.Get_rank()
        assert_all(comm, ring.Get_size() * across.Get_size() == comm.size, "grid sizes")
        assert_all(comm, ring.Get_rank() == comm.rank % ring.Get_size(), "ring rank order")
        seqs = [random_qkv(np.random.default_rng(s), 101 + 7 * s, 4, 2, 16) for s in range(2)]
        q, k, v = seqs[g]
        sl = [ringmpi.shard(x, ring) for x in (q, k, v)]
        out = ringmpi.ring_attention(*sl, ring, causal=True)
        full = ringmpi.gather(out, len(q), ring)
        assert_close(comm, full, attention(q, k, v, True)[0], None, f"ring {g}")
    finally:
        ring.Free()
        across.Free()


def test_grid_bad_ring_size(comm):
    raises_everywhere(comm, lambda: ringmpi.grid(comm, ring_size=comm.size + 1), "ring_size")
    raises_everywhere(comm, lambda: ringmpi.grid(comm, ring_size=0), "ring_size")


_LENGTHS = (3, 257, 1, 139, 113)
_CU = np.concatenate(([0], np.cumsum(_LENGTHS)))
# (name, nq, nk, causal, mask keywords): masks pass through the all-to-all unchanged
_MASKS = [
    ("window 37,20", 300, 300, False, dict(window=(37, 20))),
    (
        "packed + window causal",
        int(_CU[-1]),
        int(_CU[-1]),
        True,
        dict(window=(50, 0), cu_seqlens=_CU),
    ),  # noqa: E501
    ("cross 300x500 causal", 300, 500, True, {}),
    (
        "cross packed",
        int(_CU[-1]),
        int(_CU[-1]) + 5 * 9,
        False,
        dict(cu_seqlens=_CU, cu_seqlens_k=_CU + 9 * np.arange(len(_CU))),
    ),
]


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
def test_head_parallel_with_masks(comm, layout):
    """Windows, packed sequences and cross-attention with heads x ring, forward and backward."""
    us = [x for x in (2, 3) if comm.size % x == 0]
    if not us:
        pytest.skip(f"no head_parallel degree in (2, 3) divides P={comm.size}")
    for i, (name, nq, nk, causal, mask) in enumerate(_MASKS):
        u = us[i % len(us)]
        rng = np.random.default_rng(40 + i)
        h, hkv, d = 6, 2 if u == 2 else 3, 16
        q, dout = (rng.standard_normal((nq, h, d)) for _ in range(2))
        k, v = (rng.standard_normal((nk, hkv, d)) for _ in range(2))
        cu_q, cu_k = mask.get("cu_seqlens"), mask.get("cu_seqlens_k", mask.get("cu_seqlens"))
        kw = dict(layout=layout, head_parallel=u)
        ql, dl = (ringmpi.shard(x, comm, cu_seqlens=cu_q, **kw) for x in (q, dout))
        kl, vl = (ringmpi.shard(x, comm, cu_seqlens=cu_k, **kw) for x in (k, v))
        out, lse = ringmpi.ring_attention(
            ql, kl, vl, comm, causal=causal, return_lse=True, **kw, **mask
        )
        grads = ringmpi.ring_attention_backward(
            dl, ql, kl, vl, out, lse, comm, causal=causal, **kw, **mask
        )
        tag = f"{name} U={u} {layout}"
        ref, ref_lse = once(comm, attention, q, k, v, causal, **mask)
        assert_close(
            comm, ringmpi.gather(out, nq, comm, cu_seqlens=cu_q, **kw), ref, None, f"{tag} out"
        )
        full_lse = ringmpi.gather(lse, nq, comm, axis=-1, cu_seqlens=cu_q, **kw)
        assert_close(comm, full_lse, ref_lse, None, f"{tag} lse")
        want = once(comm, attention_backward, dout, q, k, v, causal, **mask)
        for g, w, nm, n, cu in zip(grads, want, "qkv", (nq, nk, nk), (cu_q, cu_k, cu_k)):
            got = ringmpi.gather(g, n, comm, cu_seqlens=cu, **kw)
            assert_close(comm, got, w, None, f"{tag} d{nm}")


def test_head_parallel_masks_disagree(comm, rng):
    """cu_seqlens that differ between ranks: one clear error everywhere, no hang."""
    if comm.size % 2:
        pytest.skip("needs an even P")
    n = 40 * comm.size
    q, k, v = random_qkv(rng, n, 4, 2, 8)
    cu = np.array([0, 10 + (comm.rank == comm.size - 1), n])
    loc = [ringmpi.shard(x, comm, head_parallel=2) for x in (q, k, v)]
    raises_everywhere(
        comm,
        lambda: ringmpi.ring_attention(*loc, comm, head_parallel=2, cu_seqlens=cu),
        "cu_seqlens",
    )


def test_head_parallel_ticks_and_stats(comm, rng):
    """The heads x ring path runs the same loops: on_step, on_tick and stats work there too."""
    if comm.size % 2:
        pytest.skip("needs an even P")
    u, n = 2, 80 * comm.size + 3
    q, k, v = random_qkv(rng, n, 4, 2, 16)
    kw = dict(layout="zigzag", head_parallel=u)
    sl = [ringmpi.shard(x, comm, **kw) for x in (q, k, v)]
    steps, ticks, st, st_b = [], set(), {}, {}

    def on_step(s, t):
        steps.append((s, t))

    out, lse = ringmpi.ring_attention(
        *sl, comm, causal=True, return_lse=True, stats=st, on_step=on_step, on_tick=ticks.add, **kw
    )
    ring = comm.size // u
    assert_all(comm, steps == [(s + 1, ring) for s in range(ring)], f"on_step calls {steps}")
    assert_all(comm, ticks == set(range(ring)), f"on_tick steps {sorted(ticks)}")
    assert_all(comm, st["steps"] == ring and st["alltoall_bytes"] > 0, f"stats {st}")
    assert_all(comm, st["flops"] > 0 and st["backend"] in st["tile"], f"stats {st}")
    ringmpi.ring_attention_backward(sl[0], *sl, out, lse, comm, causal=True, stats=st_b, **kw)
    assert_all(comm, st_b["steps"] == ring and st_b["alltoall_bytes"] > 0, f"stats {st_b}")
    assert_close(
        comm,
        ringmpi.gather(out, n, comm, **kw),
        once(comm, attention, q, k, v, True)[0],
        None,
        "out",
    )
