"""Windows, packed sequences and cross-attention over the ring, forward and backward."""

import time

import numpy as np
import pytest

import ringmpi
from ringmpi.reference import attention, attention_backward
from ringmpi.testing import assert_all, assert_close, dense, dense_backward, lse_budget, once

pytestmark = pytest.mark.mpi

LENGTHS = (3, 257, 1, 439, 313)
CU = np.concatenate(([0], np.cumsum(LENGTHS)))

# (name, nq, nk, causal, mask keywords)
CASES = [
    ("packed", CU[-1], CU[-1], False, dict(cu_seqlens=CU)),
    ("packed causal", CU[-1], CU[-1], True, dict(cu_seqlens=CU)),
    ("window 64 causal", 700, 700, True, dict(window=(64, 0))),
    ("window 37,20", 700, 700, False, dict(window=(37, 20))),
    ("window + packed", CU[-1], CU[-1], True, dict(window=(50, 0), cu_seqlens=CU)),
    ("cross 300x1000", 300, 1000, False, {}),
    ("cross 300x1000 causal", 300, 1000, True, {}),
    ("cross 1000x300 causal (empty rows)", 1000, 300, True, {}),
    (
        "cross packed causal",
        int(CU[-1]),
        int(CU[-1]) + 5 * 40,
        True,
        dict(cu_seqlens=CU, cu_seqlens_k=CU + 40 * np.arange(len(CU))),
    ),
]


def _run(comm, rng, case, layout, dtype):
    name, nq, nk, causal, mask = case
    h, hkv, d = 4, 2, 16
    q = rng.standard_normal((nq, h, d)).astype(dtype)
    k = rng.standard_normal((nk, hkv, d)).astype(dtype)
    v = rng.standard_normal((nk, hkv, d)).astype(dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    cu_q, cu_k = mask.get("cu_seqlens"), mask.get("cu_seqlens_k", mask.get("cu_seqlens"))
    ql, dl = (ringmpi.shard(x, comm, layout, cu_seqlens=cu_q) for x in (q, dout))
    kl, vl = (ringmpi.shard(x, comm, layout, cu_seqlens=cu_k) for x in (k, v))
    stats: dict = {}
    out, lse = ringmpi.ring_attention(
        ql, kl, vl, comm, causal=causal, layout=layout, return_lse=True, stats=stats, **mask
    )
    grads = ringmpi.ring_attention_backward(
        dl, ql, kl, vl, out, lse, comm, causal=causal, layout=layout, **mask
    )
    tag = f"{name} {layout} {np.dtype(dtype)}"
    full = ringmpi.gather(out, nq, comm, layout, cu_seqlens=cu_q)
    full_lse = ringmpi.gather(lse, nq, comm, layout, axis=-1, cu_seqlens=cu_q)
    ref, ref_lse = once(comm, attention, q, k, v, causal, **mask)
    peer = (None, None) if dtype == np.float64 else once(comm, dense, q, k, v, causal, **mask)
    assert_close(comm, full, ref, peer[0], f"{tag} out")
    assert_close(comm, full_lse, ref_lse, peer[1], f"{tag} lse")
    want = once(comm, attention_backward, dout, q, k, v, causal, **mask)
    other = (
        (None,) * 3
        if dtype == np.float64
        else once(comm, dense_backward, dout, q, k, v, causal, **mask)
    )
    for g, w, o, nm, n, cu in zip(grads, want, other, "qkv", (nq, nk, nk), (cu_q, cu_k, cu_k)):
        got = ringmpi.gather(g, n, comm, layout, cu_seqlens=cu)
        extra = 0.0 if o is None else lse_budget(full_lse, ref_lse, w)
        assert_close(comm, got, w, o, f"{tag} d{nm}", factor=3.0, extra=extra)
    return stats


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_masks_match_reference(comm, layout, dtype):
    for i, case in enumerate(CASES):
        _run(comm, np.random.default_rng(100 + i), case, layout, dtype)


def test_window_skips_steps_and_messages(comm):
    """A short causal window under contiguous: fewer ring steps and bytes (the times are
    printed, not asserted: benchmarks/mask_bench.py measures them)."""
    n, h, d = 8192, 4, 64
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((n, h, d)).astype(np.float32) for _ in range(3))
    loc = [ringmpi.shard(x, comm, "contiguous") for x in (q, k, v)]
    full_sent = comm.size * (comm.size - 1) * 2 * (n // comm.size) * h * d * 4  # all ranks
    times = {}
    for label, kw in (("full", {}), ("window", dict(window=(64, 0)))):
        best = []
        for _ in range(2):
            st: dict = {}
            comm.Barrier()
            t0 = time.perf_counter()
            ringmpi.ring_attention(*loc, comm, causal=True, layout="contiguous", stats=st, **kw)
            best.append(comm.allreduce(time.perf_counter() - t0, op=max))
        times[label] = min(best)
        if label == "window":
            sent = comm.allreduce(st["bytes_sent"])
            want_steps = min(2, comm.size)  # own block plus the previous rank's
            assert_all(comm, st["steps"] == want_steps, f"steps {st['steps']} != {want_steps}")
            assert_all(comm, st["steps_skipped"] == comm.size - want_steps, f"{st}")
            if comm.size > 1:  # each block moves one hop instead of P - 1
                assert_all(comm, sent == 2 * n * h * d * 4, f"sent {sent} bytes in all")
                assert_all(comm, comm.size == 2 or sent < full_sent, f"{sent} >= {full_sent}")
    if comm.rank == 0:
        print(f"\nP={comm.size}: full causal {times['full']:.3f} s, window {times['window']:.3f} s")


def test_bad_mask_arguments_raise_everywhere(comm):
    from ringmpi.testing import raises_everywhere

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((40 * comm.size, 2, 8)) for _ in range(3))
    loc = [ringmpi.shard(x, comm) for x in (q, k, v)]
    w = (3, -5) if comm.rank == comm.size - 1 else (3, 0)
    raises_everywhere(comm, lambda: ringmpi.ring_attention(*loc, comm, window=w), "window")
    bad_cu = [0, 10, 40 * comm.size + 1]
    raises_everywhere(
        comm, lambda: ringmpi.ring_attention(*loc, comm, cu_seqlens=bad_cu), "cu_seqlens"
    )
    if comm.size > 1:
        cu = [0, 7, 40 * comm.size] if comm.rank else [0, 8, 40 * comm.size]
        raises_everywhere(
            comm, lambda: ringmpi.ring_attention(*loc, comm, cu_seqlens=cu), "disagree"
        )
