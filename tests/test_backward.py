"""Backward pass, one process: reference vs finite differences, backward tile vs reference."""

import numpy as np
import pytest
from mpi4py import MPI

import ringmpi
from ringmpi.backward import ring_attention_backward
from ringmpi.cpu.numpy_tile import backward_tile
from ringmpi.reference import attention, attention_backward
from ringmpi.testing import dense_backward


def internal(x, idx):
    """(B, N, H, D) global -> (B, H, len(idx), D) for the tokens idx."""
    return np.ascontiguousarray(np.moveaxis(x[:, idx], 1, 2))


def loss(dout, q, k, v, causal):
    """Scalar L = sum(dout * attention(q, k, v)); its gradient is attention_backward(dout, ...)."""
    return float(np.sum(dout * attention(q, k, v, causal=causal)[0]))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [1, 2])
def test_reference_matches_finite_differences(rng, causal, hkv):
    b, n, h, d = 2, 5, 2, 3
    q = rng.standard_normal((b, n, h, d))
    k = rng.standard_normal((b, n, hkv, d))
    v = rng.standard_normal((b, n, hkv, d))
    dout = rng.standard_normal((b, n, h, d))
    grads = attention_backward(dout, q, k, v, causal=causal)
    eps = 1e-6
    for name, x, g in zip("qkv", (q, k, v), grads):
        assert g.shape == x.shape and g.dtype == np.float64, name
        fd = np.empty_like(x)
        for idx in np.ndindex(x.shape):
            keep = x[idx]
            x[idx] = keep + eps
            up = loss(dout, q, k, v, causal)
            x[idx] = keep - eps
            down = loss(dout, q, k, v, causal)
            x[idx] = keep
            fd[idx] = (up - down) / (2 * eps)
        # central differences: truncation O(eps^2), cancellation O(1e-16 / eps)
        err = np.abs(fd - g).max()
        assert err < 1e-8 * max(1.0, np.abs(g).max()), f"d{name}: {err:.3g}"


def test_reference_unbatched_matches_batched(rng):
    q, k, v, dout = (rng.standard_normal((7, 4, 8)) for _ in range(4))
    k, v = k[:, :2], v[:, :2]
    one = attention_backward(dout, q, k, v, causal=True)
    many = attention_backward(dout[None], q[None], k[None], v[None], causal=True)
    for a, b in zip(one, many):
        assert np.array_equal(a, b[0])


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 48 query and 80 key rows, so small sequences cross many block edges."""
    from ringmpi.cpu import numpy_tile

    monkeypatch.setattr(numpy_tile, "BLOCK_Q", 48)
    monkeypatch.setattr(numpy_tile, "BLOCK_K", 80)


def simulated_ring(dout, q, k, v, size, layout, causal, dtype):
    """Every rank's backward tile calls in one process; global (dq, dk, dv, flops)."""
    n = q.shape[1]
    scale = q.shape[-1] ** -0.5
    out, lse = attention(q, k, v, causal=causal)
    dq = np.zeros(q.shape)
    dk = np.zeros(k.shape)
    dv = np.zeros(v.shape)
    flops = 0
    for r in range(size):  # queries of rank r against every block
        qp = ringmpi.positions(n, r, size, layout)
        qi, doi = internal(q, qp).astype(dtype), internal(dout, qp).astype(dtype)
        lse_i = lse[:, :, qp].astype(dtype)
        delta = np.sum(doi * internal(out, qp).astype(dtype), axis=-1)
        dq_i = np.zeros_like(qi)
        for src in range(size):
            kp = ringmpi.positions(n, src, size, layout)
            ki, vi = internal(k, kp).astype(dtype), internal(v, kp).astype(dtype)
            dk_i, dv_i = np.zeros_like(ki), np.zeros_like(vi)
            flops += backward_tile(
                qi,
                ki,
                vi,
                doi,
                lse_i,
                delta,
                qp,
                kp,
                dq_i,
                dk_i,
                dv_i,
                scale=scale,
                causal=causal,
            )
            dk[:, kp] += np.moveaxis(dk_i, 1, 2)
            dv[:, kp] += np.moveaxis(dv_i, 1, 2)
        dq[:, qp] = np.moveaxis(dq_i, 1, 2)
    return dq, dk, dv, flops


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_tile_matches_reference_float64(rng, small_blocks, layout, causal):
    n = 501
    q = rng.standard_normal((2, n, 4, 16))
    k = rng.standard_normal((2, n, 2, 16))
    v = rng.standard_normal((2, n, 2, 16))
    dout = rng.standard_normal((2, n, 4, 16))
    ref = attention_backward(dout, q, k, v, causal=causal)
    got = simulated_ring(dout, q, k, v, 3, layout, causal, np.float64)
    for name, a, b in zip("qkv", got, ref):
        err = np.abs(a - b).max()
        assert err < 1e-11 * max(1.0, np.abs(b).max()), f"d{name}: {err:.3g}"


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_tile_float32_within_dense_float32_error(rng, small_blocks, layout):
    n = 700
    q = rng.standard_normal((1, n, 4, 32))
    k = rng.standard_normal((1, n, 1, 32))
    v = rng.standard_normal((1, n, 1, 32))
    dout = rng.standard_normal((1, n, 4, 32))
    ref = attention_backward(dout, q, k, v, causal=True)
    peer = dense_backward(dout, q, k, v, True)
    got = simulated_ring(dout, q, k, v, 3, layout, True, np.float32)
    for name, a, b, c in zip("qkv", got, ref, peer):
        err, tol = np.abs(a - b).max(), 3 * np.abs(c - b).max() + 1e-6
        assert err <= tol, f"d{name}: {err:.3g} > {tol:.3g}"


def test_causal_skips_fully_masked_tiles(rng, small_blocks):
    n, size = 1024, 2
    q, k, v, dout = (rng.standard_normal((1, n, 1, 8)) for _ in range(4))
    *_, full = simulated_ring(dout, q, k, v, size, "contiguous", False, np.float64)
    assert full == 10 * n * n * 8
    for layout in ringmpi.LAYOUTS:
        *_, masked = simulated_ring(dout, q, k, v, size, layout, True, np.float64)
        assert masked < 0.8 * full, layout


def test_rows_without_visible_key_get_no_gradient(rng):
    q, dout = rng.standard_normal((2, 1, 2, 5, 8))
    k, v = rng.standard_normal((2, 1, 1, 7, 8))
    lse = np.full((1, 2, 5), -np.inf)
    delta = np.zeros((1, 2, 5))
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    f = backward_tile(
        q,
        k,
        v,
        dout,
        lse,
        delta,
        np.arange(5),
        np.arange(10, 17),
        dq,
        dk,
        dv,
        scale=1.0,
        causal=True,
    )
    assert f == 0 and not dq.any() and not dk.any() and not dv.any()
    # same rows, no mask: lse = -inf still means "no probability mass", never NaN
    backward_tile(
        q,
        k,
        v,
        dout,
        lse,
        delta,
        np.arange(5),
        np.arange(10, 17),
        dq,
        dk,
        dv,
        scale=1.0,
        causal=False,
    )
    assert not dq.any() and not dk.any() and not dv.any()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_ring_on_one_rank_keeps_shapes_and_dtypes(rng, dtype):
    comm = MPI.COMM_SELF
    for lead in ((), (2,)):
        q, dout = (rng.standard_normal((*lead, 50, 4, 8)).astype(dtype) for _ in range(2))
        k, v = (rng.standard_normal((*lead, 50, 2, 8)).astype(dtype) for _ in range(2))
        out, lse = ringmpi.ring_attention(q, k, v, comm, causal=True, return_lse=True)
        dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, comm, causal=True)
        for g, x in zip((dq, dk, dv), (q, k, v)):
            assert g.shape == x.shape and g.dtype == x.dtype
        ref = attention_backward(dout, q, k, v, causal=True)
        for g, r in zip((dq, dk, dv), ref):
            tol = 1e-11 if dtype == np.float64 else (1e-4 if dtype == np.float32 else 2e-2)
            assert np.abs(g - r).max() <= tol * max(1.0, np.abs(r).max())


def test_large_logits_stay_finite(rng):
    q = rng.standard_normal((1, 300, 2, 32)) * 100
    k, v, dout = (rng.standard_normal((1, 300, 2, 32)) for _ in range(3))
    comm = MPI.COMM_SELF
    loc = [x.astype(np.float32) for x in (dout, q, k, v)]
    out, lse = ringmpi.ring_attention(*loc[1:], comm, causal=True, return_lse=True)
    grads = ring_attention_backward(*loc, out, lse, comm, causal=True)
    assert all(np.isfinite(g).all() for g in grads)
    ref = attention_backward(dout, q, k, v, causal=True)
    peer = dense_backward(dout, q, k, v, True)
    # p = exp(s - lse) turns the float32 lse's absolute error (a few ulps of |lse| ~ 300)
    # into a relative error of p that the peer, normalizing its own p, does not have;
    # how much of it shows depends on the BLAS (reference BLAS: ~6x OpenBLAS's)
    lse_err = np.abs(lse - attention(q, k, v, causal=True)[1]).max()
    for a, b, c in zip(grads, ref, peer):
        bound = 3 * np.abs(c - b).max() + lse_err * np.abs(b).max() + 1e-6
        assert np.abs(a - b).max() <= bound


def test_stats_are_filled(rng):
    q, k, v, dout = (rng.standard_normal((64, 2, 8)) for _ in range(4))
    out, lse = ringmpi.ring_attention(q, k, v, MPI.COMM_SELF, return_lse=True)
    stats = {}
    ring_attention_backward(dout, q, k, v, out, lse, MPI.COMM_SELF, stats=stats)
    assert stats["steps"] == 1 and stats["flops"] == 10 * 64 * 64 * 8 * 2
    assert 0 <= stats["compute_s"] <= stats["total_s"]
