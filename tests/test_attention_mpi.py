"""ring_attention against the dense float64 reference, at whatever P mpiexec gives."""

import numpy as np
import pytest

import ringmpi
from ringmpi.reference import attention
from ringmpi.testing import assert_all, dense, once, random_qkv

pytestmark = pytest.mark.mpi


def shapes(size):
    """(n, H, Hkv, D, batch) cases: awkward lengths, GQA, head dims, batch axis."""
    return [
        (1, 4, 1, 16, None),
        (max(size - 1, 1), 4, 2, 64, 2),
        (97, 4, 2, 80, None),
        (97, 4, 4, 16, 3),
        (1000, 4, 1, 64, None),
        (1000, 2, 2, 16, 2),
    ]


def run_case(comm, rng, n, h, hkv, d, batch, dtype, causal, layout):
    q, k, v = comm.bcast(random_qkv(rng, n, h, hkv, d, batch) if comm.rank == 0 else None)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    ref, ref_lse = once(comm, attention, q, k, v, causal=causal)
    loc = [ringmpi.shard(x, comm, layout) for x in (q, k, v)]
    out, lse = ringmpi.ring_attention(*loc, comm, causal=causal, layout=layout, return_lse=True)
    return q, k, v, ref, ref_lse, loc, out, lse


@pytest.mark.parametrize("kernel", ["auto", "numpy"])
@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matches_reference(comm, layout, causal, dtype, kernel, monkeypatch):
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", kernel)  # auto: the fused tile where it builds
    rng = np.random.default_rng(7)
    for n, h, hkv, d, batch in shapes(comm.size):
        case = f"n={n} H={h} Hkv={hkv} D={d} B={batch}"
        q, k, v, ref, ref_lse, loc, out, lse = run_case(
            comm, rng, n, h, hkv, d, batch, dtype, causal, layout
        )
        ok = out.dtype == dtype and out.shape == loc[0].shape and out.flags.c_contiguous
        assert_all(comm, ok, f"out dtype/shape/layout {case}")
        want_lse = np.float64 if dtype == np.float64 else np.float32
        lse_shape = loc[0].shape[:-3] + (h, loc[0].shape[-3])
        assert_all(comm, lse.dtype == want_lse and lse.shape == lse_shape, f"lse {case}")
        full = ringmpi.gather(out, n, comm, layout)
        full_lse = ringmpi.gather(lse, n, comm, layout, axis=-1)
        err = np.abs(full - ref).max()
        lerr = np.abs(full_lse - ref_lse).max()
        if dtype == np.float64:
            tol = 1e-12 * max(1.0, np.abs(ref).max())
            ltol = 1e-12 * max(1.0, np.abs(ref_lse).max())
        else:
            d_out, d_lse = once(comm, dense, q, k, v, causal)
            tol = 2 * np.abs(d_out - ref).max() + 1e-6
            ltol = 2 * np.abs(d_lse - ref_lse).max() + 1e-6
        assert_all(comm, err <= tol, f"{case}: max err {err:.3g} > tol {tol:.3g}")
        assert_all(comm, lerr <= ltol, f"{case}: lse err {lerr:.3g} > tol {ltol:.3g}")


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
def test_float16_computed_in_float32(comm, layout):
    rng = np.random.default_rng(3)
    q, k, v, ref, _, loc, out, lse = run_case(
        comm, rng, 333, 4, 2, 64, None, np.float16, True, layout
    )
    assert_all(comm, out.dtype == np.float16 and lse.dtype == np.float32, "dtypes")
    full = ringmpi.gather(out, 333, comm, layout).astype(np.float64)
    d_out, _ = once(comm, dense, q, k, v, True)
    # float32 arithmetic, then one rounding to float16 (half an ulp: 2**-11 relative)
    tol = 2 * np.abs(d_out - ref).max() + 1e-6 + 2.0**-11 * np.abs(ref).max()
    err = np.abs(full - ref).max()
    assert_all(comm, err <= tol, f"float16 err {err:.3g} > {tol:.3g}")


@pytest.mark.parametrize("causal", [False, True])
def test_bitwise_repeatable(comm, causal):
    rng = np.random.default_rng(11)
    q, k, v = comm.bcast(random_qkv(rng, 700, 4, 2, 32, dtype=np.float32))
    loc = [ringmpi.shard(x, comm) for x in (q, k, v)]
    a, la = ringmpi.ring_attention(*loc, comm, causal=causal, return_lse=True)
    b, lb = ringmpi.ring_attention(*loc, comm, causal=causal, return_lse=True)
    same = a.tobytes() == b.tobytes() and la.tobytes() == lb.tobytes()
    assert_all(comm, same, "two identical calls differ")


def test_large_logits_stay_finite(comm):
    rng = np.random.default_rng(5)
    q, k, v = comm.bcast(random_qkv(rng, 257, 2, 1, 64, dtype=np.float64))
    q = q * 100
    ref, ref_lse = once(comm, attention, q, k, v, causal=True)
    loc = [ringmpi.shard(x.astype(np.float32), comm) for x in (q, k, v)]
    out, lse = ringmpi.ring_attention(*loc, comm, causal=True, return_lse=True)
    ok = np.isfinite(out).all() and np.isfinite(lse).all()
    assert_all(comm, ok, "non-finite output for logits scaled by 100")
    full = ringmpi.gather(out, 257, comm)
    d_out, _ = once(comm, dense, q, k, v, True)
    err, tol = np.abs(full - ref).max(), 2 * np.abs(d_out - ref).max() + 1e-6
    assert_all(comm, err <= tol, f"err {err:.3g} > {tol:.3g}")


def test_stats_are_filled(comm):
    rng = np.random.default_rng(2)
    q, k, v = comm.bcast(random_qkv(rng, 256, 2, 2, 16, dtype=np.float32))
    stats = {}
    steps = []
    loc = [ringmpi.shard(x, comm) for x in (q, k, v)]
    ringmpi.ring_attention(*loc, comm, stats=stats, on_step=lambda s, t: steps.append((s, t)))
    ok = stats["steps"] == comm.size and stats["flops"] > 0
    ok = ok and 0 <= stats["wait_s"] <= stats["total_s"] and steps[-1] == (comm.size, comm.size)
    assert_all(comm, ok, f"stats {stats} steps {steps}")
