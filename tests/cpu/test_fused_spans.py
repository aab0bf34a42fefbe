"""Each row's visible keys by arithmetic on consecutive positions equal the searches' (issue 23).

The fused tiles (kernels/cpu_tile.c, cpu_backward.c) find a row's visible keys in a key block
whose positions are consecutive by arithmetic (rm_span in kernels/cpu_blocks.h) and by binary
search when they only increase. The same problem with every position and bound doubled has
the same visible pairs, the same blocks and the same arithmetic, but its blocks are not
consecutive, so it takes the searches: the results must be bit-identical. Masks: packed
sequences (lengths 1, 7, 63, 64, 65, 300, 200), a window, causal with fewer queries than
keys, bounds past the last key; real-shaped values; forward and backward; every ISA path the
host runs. Each result is also checked against the numpy tile (the specification).
"""

from __future__ import annotations

import numpy as np
import pytest

from ringmpi.cpu import fused, fused_backward
from ringmpi.cpu import isa as cpu_isa
from ringmpi.cpu import numpy_tile as spec

N = 700
LENS = [1, 7, 63, 64, 65, 300, 200]


def _case(name: str):
    """(q_pos, k_pos, causal, bounds) of one mask over N keys."""
    pos = np.arange(N, dtype=np.int64)
    if name == "packed":
        starts = np.repeat(np.cumsum([0] + LENS[:-1]), LENS).astype(np.int64)
        return pos, pos, False, (starts, pos.copy())
    if name == "window":
        return pos, pos, False, (pos - 100, pos)
    if name == "causal-sq<sk":
        qp = np.arange(500, N, dtype=np.int64)
        return qp, pos, True, None
    if name == "past-end":
        return pos, pos, False, (pos - 50, pos + 1000)
    raise AssertionError(name)


def _doubled(qp, kp, causal, bounds):
    return 2 * qp, 2 * kp, causal, None if bounds is None else tuple(2 * b for b in bounds)


def _arrays(dtype, sq: int, d: int = 40):
    rng = np.random.default_rng(sq)
    q = rng.standard_normal((1, 4, sq, d))
    k = 0.5 + rng.standard_normal((1, 2, N, d))
    v = 1.0 + 0.1 * rng.standard_normal((1, 2, N, d))
    do = 0.2 + 0.1 * rng.standard_normal((1, 4, sq, d))
    return [x.astype(dtype) for x in (q, k, v, do)]


def _forward(tile, q, k, v, qp, kp, causal, bounds):
    st = [np.zeros_like(q), np.full(q.shape[:-1], -np.inf, q.dtype)]
    st.append(np.zeros(q.shape[:-1], q.dtype))
    tile(q, k, v, qp, kp, *st, scale=q.shape[-1] ** -0.5, causal=causal, bounds=bounds)
    return st


@pytest.mark.parametrize("isa", cpu_isa.host_isas())
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["packed", "window", "causal-sq<sk", "past-end"])
def test_span_arithmetic_matches_search(isa, dtype, name):
    kern = fused.LOADER.load(isa)
    bwd = fused_backward.LOADER.load(isa)
    case = _case(name)
    q, k, v, do = _arrays(dtype, len(case[0]))
    fw = {}
    for tag, (qp, kp, causal, bounds) in (("plain", case), ("doubled", _doubled(*case))):
        acc, m, l = _forward(kern.forward_tile, q, k, v, qp, kp, causal, bounds)
        out, lse = kern.finalize(acc, m, l)
        delta = (do * out).sum(-1)
        g = [np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)]
        fused_backward.backward_tile_with(
            bwd,
            q,
            k,
            v,
            do,
            lse,
            delta,
            qp,
            kp,
            *g,
            scale=q.shape[-1] ** -0.5,
            causal=causal,
            bounds=bounds,
        )
        fw[tag] = (acc, m, l, *g)
    for a, b in zip(fw["plain"], fw["doubled"]):
        assert a.tobytes() == b.tobytes()
    # and both right: the numpy tile's state (float64 inputs), within float32/64 rounding
    qp, kp, causal, bounds = case
    ref = _forward(
        spec.forward_tile, *(x.astype(np.float64) for x in (q, k, v)), qp, kp, causal, bounds
    )
    tol = 2e-5 if dtype == np.float32 else 1e-12
    out = kern.finalize(*fw["plain"][:3])[0]
    out_ref = kern.finalize(*ref)[0]
    np.testing.assert_allclose(out, out_ref, rtol=tol, atol=tol)
    assert np.isfinite(out).all() and np.abs(out).max() > 0.5
