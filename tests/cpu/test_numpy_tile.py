"""The numpy tile (the spec) against the dense reference, one process."""

import numpy as np
import pytest

import ringmpi
from ringmpi import softmax
from ringmpi.cpu import numpy_tile as cpu
from ringmpi.reference import attention


def internal(x, idx):
    return np.ascontiguousarray(np.moveaxis(x[:, idx], 1, 2))


def simulated_ring(q, k, v, size, layout, causal, dtype):
    """Run every rank's ring steps in one process; returns global (out, lse)."""
    n = q.shape[1]
    out = np.zeros(q.shape, dtype=dtype)
    lse = np.zeros((q.shape[0], q.shape[2], n), dtype=dtype)
    flops = 0
    for r in range(size):
        qp = ringmpi.positions(n, r, size, layout)
        qi = internal(q, qp).astype(dtype)
        acc, m, l = softmax.init_state(qi.shape, dtype)
        for src in range(size):
            kp = ringmpi.positions(n, src, size, layout)
            ki, vi = internal(k, kp).astype(dtype), internal(v, kp).astype(dtype)
            flops += cpu.forward_tile(
                qi, ki, vi, qp, kp, acc, m, l, scale=q.shape[-1] ** -0.5, causal=causal
            )
        o, ls = softmax.finalize(acc, m, l)
        out[:, qp] = np.moveaxis(o, 1, 2)
        lse[..., qp] = ls
    return out, lse, flops


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_tile_matches_reference(rng, layout, causal):
    q = rng.standard_normal((2, 1500, 4, 16))
    k = rng.standard_normal((2, 1500, 2, 16))
    v = rng.standard_normal((2, 1500, 2, 16))
    ref, ref_lse = attention(q, k, v, causal=causal)
    out, lse, _ = simulated_ring(q, k, v, 3, layout, causal, np.float64)
    assert np.abs(out - ref).max() < 1e-12
    assert np.abs(lse - ref_lse).max() < 1e-12


def test_causal_skips_fully_masked_tiles(rng):
    n, size = 4096, 2
    q, k, v = (rng.standard_normal((1, n, 1, 8)) for _ in range(3))
    *_, full = simulated_ring(q, k, v, size, "contiguous", False, np.float64)
    for layout in ringmpi.LAYOUTS:
        *_, masked = simulated_ring(q, k, v, size, layout, True, np.float64)
        # half the pairs are visible; skipping must remove a large share of the work
        assert masked < 0.8 * full, layout


def test_rows_without_visible_key(rng):
    q = rng.standard_normal((1, 2, 5, 8))
    k = rng.standard_normal((1, 1, 7, 8))
    acc, m, l = softmax.init_state(q.shape, np.float64)
    f = cpu.forward_tile(
        q, k, k, np.arange(5), np.arange(10, 17), acc, m, l, scale=1.0, causal=True
    )
    assert f == 0
    out, lse = softmax.finalize(acc, m, l)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_large_logits_do_not_overflow(rng, dtype):
    q = rng.standard_normal((1, 300, 2, 32)) * 100
    k = rng.standard_normal((1, 300, 2, 32))
    v = rng.standard_normal((1, 300, 2, 32))
    ref, _ = attention(q, k, v, causal=True)
    out, lse, _ = simulated_ring(q, k, v, 2, "zigzag", True, dtype)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert np.abs(out - ref).max() < (1e-3 if dtype == np.float32 else 1e-10)
