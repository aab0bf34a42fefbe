"""The fused C backward tile against the numpy backward tile (the spec) and dense gradients.

Every ISA path the CPU can run is checked: this module runs in this process against the
build for the host, and ``test_isa_path`` reruns it in a subprocess per narrower path with
``RINGMPI_CFLAGS`` forcing it (AVX2+FMA, scalar) and ``RINGMPI_EXPECT_SIMD`` saying which
vector width the build must report.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ringmpi
from ringmpi.cpu import fused_backward
from ringmpi.cpu import isa as cpu_isa
from ringmpi.cpu import numpy_tile as backward
from ringmpi.reference import attention, attention_backward

pytestmark = pytest.mark.skipif(
    not fused_backward.available(),
    reason=f"fused backward kernel unavailable: {fused_backward.unavailable_reason()}",
)

# fused vs numpy tile, as a fraction of the largest gradient entry: float32 sums of a few
# hundred terms with an exp good to ~2e-7; float64 ~1e-15 per term
TOL = {np.float32: 2e-5, np.float64: 1e-12}

# narrower ISA paths, forced by compiler flags, and the vector width each build reports
ISA_PATHS = {
    "avx2": ("-mno-avx512f", 32),
    "scalar": ("-mno-avx2 -mno-fma -mno-avx512f", 0),
}


def _cpu_flags() -> set:
    """The host's CPU feature flags (ringmpi.cpu.isa reads /proc/cpuinfo), or an empty set."""
    return set(cpu_isa.host_features() or ())


def _internal(x, idx):
    """(B, N, H, D) global -> (B, H, len(idx), D) for the tokens idx."""
    return np.ascontiguousarray(np.moveaxis(x[:, idx], 1, 2))


def _global(rng, b, n, h, hkv, d, q_scale=1.0):
    q = rng.standard_normal((b, n, h, d)) * q_scale
    k = rng.standard_normal((b, n, hkv, d))
    v = rng.standard_normal((b, n, hkv, d))
    dout = rng.standard_normal((b, n, h, d))
    return dout, q, k, v


def _both_tiles(args, *, scale, causal, progress=None):
    """Run the numpy and the fused tile on copies of the same accumulators."""
    q, k, v, do, lse, delta, qp, kp, dq, dk, dv = args
    res = []
    for tile in (backward.backward_tile, fused_backward.backward_tile):
        acc = [a.copy() for a in (dq, dk, dv)]
        f = tile(q, k, v, do, lse, delta, qp, kp, *acc, scale=scale, causal=causal)
        res.append((f, acc))
    return res


def _assert_close(got, want, dtype, tol=None, what=""):
    tol = TOL[dtype] if tol is None else tol
    assert got.dtype == want.dtype == dtype
    assert np.isfinite(got).all(), what
    err = np.abs(got - want).max()
    bound = tol * max(1.0, np.abs(want).max())
    assert err <= bound, f"{what}: {err:.3g} > {bound:.3g}"


def _ring(dout, q, k, v, size, layout, causal, dtype, tol=None):
    """Every rank's tile calls, with both tiles; asserts each call's results and flops agree.

    Returns the global fused gradients (float64 arrays shaped like q, k, v) and total flops.
    """
    n, d = q.shape[1], q.shape[-1]
    scale = d**-0.5
    out, lse = attention(q, k, v, causal=causal)
    grads = [np.zeros(x.shape) for x in (q, k, v)]
    flops = 0
    for r in range(size):
        qp = ringmpi.positions(n, r, size, layout)
        qi, doi = _internal(q, qp).astype(dtype), _internal(dout, qp).astype(dtype)
        lse_i = np.ascontiguousarray(lse[:, :, qp]).astype(dtype)
        delta = np.sum(doi * _internal(out, qp).astype(dtype), axis=-1)
        dq = {"numpy": np.zeros_like(qi), "fused": np.zeros_like(qi)}
        for src in range(size):
            kp = ringmpi.positions(n, src, size, layout)
            ki, vi = _internal(k, kp).astype(dtype), _internal(v, kp).astype(dtype)
            dk = {t: np.zeros_like(ki) for t in dq}
            dv = {t: np.zeros_like(vi) for t in dq}
            f_n = backward.backward_tile(
                qi,
                ki,
                vi,
                doi,
                lse_i,
                delta,
                qp,
                kp,
                dq["numpy"],
                dk["numpy"],
                dv["numpy"],
                scale=scale,
                causal=causal,
            )
            f_f = fused_backward.backward_tile(
                qi,
                ki,
                vi,
                doi,
                lse_i,
                delta,
                qp,
                kp,
                dq["fused"],
                dk["fused"],
                dv["fused"],
                scale=scale,
                causal=causal,
            )
            assert f_f == f_n
            flops += f_f
            _assert_close(dk["fused"], dk["numpy"], dtype, tol, what=f"dk {r}<-{src}")
            _assert_close(dv["fused"], dv["numpy"], dtype, tol, what=f"dv {r}<-{src}")
            grads[1][:, kp] += np.moveaxis(dk["fused"], 1, 2)
            grads[2][:, kp] += np.moveaxis(dv["fused"], 1, 2)
        _assert_close(dq["fused"], dq["numpy"], dtype, tol, what=f"dq {r}")
        grads[0][:, qp] = np.moveaxis(dq["fused"], 1, 2)
    return grads, flops


def _dense_peer(dout, q, k, v, causal, dtype):
    """Dense gradients in ``dtype`` from the inputs the tiles get (lse rounded to dtype).

    The tiles take P = exp(S - lse) with a saved lse; rounding lse to float32 alone moves
    every P of a row by eps |lse| relative, which dominates with large logits, so the
    float32 bound comes from a peer that starts from the same rounded values.
    """
    f = np.dtype(dtype).type
    out, lse = attention(q, k, v, causal=causal)
    qh, kh, vh, do, oh = (
        np.moveaxis(np.asarray(x), -3, -2).astype(f) for x in (q, k, v, dout, out)
    )
    g = qh.shape[-3] // kh.shape[-3]
    kh, vh = np.repeat(kh, g, axis=-3), np.repeat(vh, g, axis=-3)
    scale = f(q.shape[-1] ** -0.5)
    qs = qh * scale
    s = qs @ np.swapaxes(kh, -1, -2)
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], dtype=bool)), s, -np.inf)
    p = np.exp(s - lse.astype(f)[..., None])
    delta = np.sum(do * oh, axis=-1, keepdims=True)
    ds = p * (do @ np.swapaxes(vh, -1, -2) - delta)

    def fold(x):  # (B, H, S, D) -> (B, S, Hkv, D), summed over each group
        x = x.reshape(x.shape[0], -1, g, *x.shape[2:]).sum(axis=2)
        return np.moveaxis(x, 1, 2)

    dq = np.moveaxis(scale * (ds @ kh), 1, 2)
    return dq, fold(np.swapaxes(ds, -1, -2) @ qs), fold(np.swapaxes(p, -1, -2) @ do)


def _assert_matches_dense(grads, dout, q, k, v, causal, dtype):
    """float64: to 1e-11 of the largest entry; float32: within 3x a dense float32 peer's error."""
    ref = attention_backward(dout, q, k, v, causal=causal)
    peer = _dense_peer(dout, q, k, v, causal, dtype) if dtype == np.float32 else None
    for i, name in enumerate("qkv"):
        err = np.abs(grads[i] - ref[i]).max()
        if dtype == np.float64:
            tol = 1e-11 * max(1.0, np.abs(ref[i]).max())
        else:
            tol = 3 * np.abs(peer[i] - ref[i]).max() + 1e-6
        assert err <= tol, f"d{name}: {err:.3g} > {tol:.3g}"


def test_built_for_the_expected_isa():
    """The loaded build uses the widest path the flags allow (or the forced one)."""
    want = os.environ.get("RINGMPI_EXPECT_SIMD")
    if want is None:  # the path RINGMPI_CPU_ISA selects: the widest the host runs by default
        from ringmpi.cpu import build

        if not _cpu_flags():
            pytest.skip("no /proc/cpuinfo to tell the CPU's vector extensions")
        want = {"avx512": 64, "avx2": 32, "scalar": 0}[build.resolve_isa(None)]
    assert fused_backward.simd_width() == int(want)


@pytest.mark.parametrize("isa", sorted(ISA_PATHS))
def test_isa_path(isa):
    """Rerun this module with the kernel built for a narrower ISA path."""
    if "RINGMPI_EXPECT_SIMD" in os.environ:
        pytest.skip("already running a forced ISA path")
    flags, width = ISA_PATHS[isa]
    if width == fused_backward.simd_width():
        pytest.skip(f"{isa} is the native path here, checked by this run")
    if isa == "avx2" and not {"avx2", "fma"} <= _cpu_flags():
        pytest.skip("this CPU cannot run AVX2+FMA code")
    env = dict(os.environ)
    env["RINGMPI_CFLAGS"] = (env.get("RINGMPI_CFLAGS", "") + " " + flags).strip()
    env["RINGMPI_EXPECT_SIMD"] = str(width)
    env["RINGMPI_CPU_ISA"] = "auto"  # the flags pick the path; a forced narrower one would win
    env["OMP_NUM_THREADS"] = "1"
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d", [16, 64, 80, 128])
@pytest.mark.parametrize("hkv", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_numpy_tile_and_dense(dtype, d, hkv, causal):
    """Batch 2, H=4 sharing hkv K/V heads, odd lengths (partial strips, panels, blocks)."""
    rng = np.random.default_rng(d * 10 + hkv)
    dout, q, k, v = _global(rng, 2, 151, 4, hkv, d)
    grads, _ = _ring(dout, q, k, v, 2, "zigzag", causal, dtype)
    _assert_matches_dense(grads, dout, q, k, v, causal, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d, dv", [(40, 24), (8, 64), (192, 128), (576, 512), (59, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_value_width_other_than_key_width(dtype, d, dv, causal):
    """Keys of width Dk, values (dout, dv) of width Dv (issue 42): the fused backward equals
    the numpy tile (dq, dk Dk wide, dv Dv wide) and counts 2 (3 Dk + 2 Dv) flops per pair."""
    rng = np.random.default_rng(d * 1000 + dv)
    b, h, hkv, sq, sk = 1, 4, 1 if d > 100 else 2, 45, 150
    q = rng.standard_normal((b, h, sq, d)).astype(dtype)
    k = (0.5 + rng.standard_normal((b, hkv, sk, d))).astype(dtype)
    v = (1.0 + 0.1 * rng.standard_normal((b, hkv, sk, dv))).astype(dtype)
    do = (0.2 + 0.1 * rng.standard_normal((b, h, sq, dv))).astype(dtype)
    qp = np.arange(sq, dtype=np.int64) + (sk - sq)
    kp = np.arange(sk, dtype=np.int64)
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), np.repeat(k, h // hkv, 1)) * d**-0.5
    if causal:
        s = np.where(kp[None, :] <= qp[:, None], s, -np.inf)
    lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    delta = rng.standard_normal((b, h, sq))
    zeros = [np.zeros(x.shape, dtype) for x in (q, k, v)]
    args = (q, k, v, do, lse.astype(dtype), delta.astype(dtype), qp, kp, *zeros)
    (f_spec, want), (f_fused, got) = _both_tiles(args, scale=d**-0.5, causal=causal)
    for g, w, name in zip(got, want, ("dq", "dk", "dv")):
        _assert_close(g, w, dtype, what=f"{name} Dk={d} Dv={dv}")
    assert got[2].shape[-1] == dv and f_fused == f_spec
    if not causal:
        assert f_spec == 2 * b * h * sq * sk * (3 * d + 2 * dv)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("size", [2, 3])
def test_causal_layouts_full_ring(dtype, layout, size):
    """Causal positions of every layout (the kernel skips blocks fully in the future)."""
    rng = np.random.default_rng(size)
    n, d = 700, 64
    dout, q, k, v = _global(rng, 1, n, 4, 2, d)
    grads, flops = _ring(dout, q, k, v, size, layout, True, dtype)
    _assert_matches_dense(grads, dout, q, k, v, True, dtype)
    assert flops <= 10 * 4 * n * n * d


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bq,bk", [(1, 1), (6, 32), (30, 100), (500, 1000)])
def test_block_sizes_agree(monkeypatch, dtype, bq, bk):
    """Tiny to huge blocks (rounded up to whole strips and panels): same gradients."""
    monkeypatch.setattr(fused_backward, "BLOCK_Q", bq)
    monkeypatch.setattr(fused_backward, "BLOCK_K", bk)
    rng = np.random.default_rng(bq + bk)
    dout, q, k, v = _global(rng, 1, 400, 2, 1, 32)
    grads, _ = _ring(dout, q, k, v, 2, "zigzag", True, dtype)
    _assert_matches_dense(grads, dout, q, k, v, True, dtype)


def _tile_args(rng, dtype, b, h, hkv, sq, sk, d, qp, kp, lse=None, q_scale=1.0):
    q = (rng.standard_normal((b, h, sq, d)) * q_scale).astype(dtype)
    k, v = (rng.standard_normal((b, hkv, sk, d)).astype(dtype) for _ in range(2))
    do = rng.standard_normal((b, h, sq, d)).astype(dtype)
    if lse is None:
        lse = rng.uniform(2, 6, (b, h, sq)).astype(dtype)
    delta = rng.standard_normal((b, h, sq)).astype(dtype)
    zeros = [np.zeros((b, x, s, d), dtype=dtype) for x, s in ((h, sq), (hkv, sk), (hkv, sk))]
    return [q, k, v, do, lse, delta, qp, kp, *zeros]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rows_without_visible_key_get_no_gradient(dtype):
    """lse = -inf rows: zero dq, no contribution to dk/dv, never NaN; fully future: skipped."""
    rng = np.random.default_rng(5)
    qp = np.arange(40, dtype=np.int64) * 3  # 0..117
    kp = np.arange(70, dtype=np.int64) + 60  # rows with qp < 60 see no key
    lse = rng.uniform(2, 6, (2, 4, 40)).astype(dtype)
    lse[:, :, :20] = -np.inf
    args = _tile_args(rng, dtype, 2, 4, 2, 40, 70, 16, qp, kp, lse=lse)
    for causal in (True, False):  # lse = -inf means no probability mass even unmasked
        (f_n, ref), (f_f, got) = _both_tiles(args, scale=0.25, causal=causal)
        assert f_f == f_n > 0
        for a, b in zip(got, ref):
            _assert_close(a, b, dtype)
        assert not got[0][:, :, :20].any() and got[0][:, :, 20:].all()
    # every row empty: no gradient anywhere
    args[4] = np.full_like(lse, -np.inf)
    (_, ref), (_, got) = _both_tiles(args, scale=0.25, causal=False)
    assert not any(g.any() for g in got)
    # every key in the future of every query: nothing computed, accumulators untouched
    args[7] = kp + 1000
    (f_n, _), (f_f, got) = _both_tiles(args, scale=0.25, causal=True)
    assert f_f == f_n == 0 and not any(g.any() for g in got)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_large_logits(dtype):
    """q * 100: scores ~1e3, P = exp(S - lse) from the saved lse; finite, close to dense."""
    rng = np.random.default_rng(11)
    dout, q, k, v = _global(rng, 1, 300, 2, 2, 32, q_scale=100.0)
    smax = np.abs(np.einsum("bqhd,bkhd->bhqk", q, k)).max() * 32**-0.5
    assert smax > 300
    # a score of size |s| carries a rounding error ~ eps |s| in either tile; exp turns it
    # into the same relative error of P, so the tiles agree to ~eps |s| of the gradients
    tol = 10 * np.finfo(dtype).eps * smax
    for causal in (False, True):
        grads, _ = _ring(dout, q, k, v, 2, "striped", causal, dtype, tol)
        _assert_matches_dense(grads, dout, q, k, v, causal, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_shuffled_positions_and_accumulation(dtype):
    """Non-monotonic positions (explicit per-key mask), accumulators that start non-zero."""
    rng = np.random.default_rng(13)
    qp = rng.permutation(300)[:90].astype(np.int64)
    kp = rng.permutation(300)[:170].astype(np.int64)
    args = _tile_args(rng, dtype, 1, 3, 1, 90, 170, 80, qp, kp)
    for a in args[8:]:
        a[...] = rng.standard_normal(a.shape)
    for causal in (False, True):
        (f_n, ref), (f_f, got) = _both_tiles(args, scale=0.3, causal=causal)
        assert f_f == f_n
        for a, b in zip(got, ref):
            _assert_close(a, b, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_accuracy(dtype):
    """One key, D=1, q_i = x_i, k = v = dO = 1, lse = delta = 0, scale 1: dq_i = exp(x_i).

    The kernel's exp rounds t = x log2(e) once, so the bound is a few ulp plus eps |x|.
    """
    x = -np.concatenate([np.linspace(0, 1, 500), np.linspace(1, 80, 1500)]).astype(dtype)
    n = len(x)
    one = np.ones((1, 1, 1, 1), dtype=dtype)
    q = x.reshape(1, 1, n, 1)
    do = np.ones((1, 1, n, 1), dtype=dtype)
    zero = np.zeros((1, 1, n), dtype=dtype)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(one), np.zeros_like(one)
    pos = np.zeros(n, dtype=np.int64)
    fused_backward.backward_tile(
        q, one, one, do, zero, zero, pos, pos[:1], dq, dk, dv, scale=1.0, causal=True
    )
    ref = np.exp(x.astype(np.float64))
    eps = float(np.finfo(dtype).eps)
    err = np.abs(dq[0, 0, :, 0] - ref) / ref
    bound = 3 * eps + eps * np.abs(x)
    assert np.all(err <= bound), float(np.max(err / bound))
    np.testing.assert_allclose(dv[0, 0, 0, 0], ref.sum(), rtol=10 * eps)


def test_progress_called_and_result_unchanged(monkeypatch):
    monkeypatch.setattr(fused_backward, "BLOCK_Q", 96)
    monkeypatch.setattr(fused_backward, "BLOCK_K", 256)
    monkeypatch.setattr(fused_backward, "CHUNK_PAIRS", 96 * 256)
    rng = np.random.default_rng(3)
    pos = np.arange(1000, dtype=np.int64)
    args = _tile_args(rng, np.float32, 1, 2, 1, 1000, 1000, 64, pos, pos)
    plain = [a.copy() for a in args[8:]]
    fused_backward.backward_tile(*args[:8], *plain, scale=0.125, causal=True)
    calls = []
    with_cb = [a.copy() for a in args[8:]]
    fused_backward.backward_tile(
        *args[:8], *with_cb, scale=0.125, causal=True, progress=lambda: calls.append(1)
    )
    # the kernel calls back once at least CHUNK_PAIRS (row, key) pairs were computed since the
    # last call (at most one block pair, 96 x 256 here, more), plus one call at the end:
    # between the visible pairs / (2 chunks) and all pairs / chunk + 1
    chunk = fused_backward.CHUNK_PAIRS
    assert 2 * 1000 * 1001 // 2 // (2 * chunk) <= len(calls) <= 2 * 1000 * 1000 // chunk + 1
    for a, b in zip(plain, with_cb):
        np.testing.assert_array_equal(a, b)


def test_progress_exception_stops_the_kernel_and_propagates(monkeypatch):
    monkeypatch.setattr(fused_backward, "CHUNK_PAIRS", 1000)
    rng = np.random.default_rng(4)
    pos = np.arange(600, dtype=np.int64)
    args = _tile_args(rng, np.float32, 1, 2, 2, 600, 600, 32, pos, pos)
    calls = []

    def boom():
        calls.append(1)
        raise RuntimeError("progress failed")

    with pytest.raises(RuntimeError, match="progress failed"):
        fused_backward.backward_tile(*args, scale=0.2, causal=False, progress=boom)
    assert len(calls) == 1  # the kernel stopped at the first failing call


def test_other_dtypes_and_layouts_fall_back_to_numpy():
    rng = np.random.default_rng(9)
    pos = np.arange(30, dtype=np.int64)
    args = _tile_args(rng, np.float16, 1, 2, 1, 30, 30, 8, pos, pos)
    (f_n, ref), (f_f, got) = _both_tiles(args, scale=0.3, causal=True)
    assert f_f == f_n and got[0].dtype == np.float16
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a, b)
    # a non-contiguous accumulator: the numpy tile updates it in place, bit for bit
    args = _tile_args(rng, np.float32, 1, 2, 1, 30, 30, 8, pos, pos)
    dq_big = np.zeros((1, 2, 30, 16), dtype=np.float32)
    dq_ref = np.zeros((1, 2, 30, 8), dtype=np.float32)
    backward.backward_tile(*args[:8], dq_ref, *args[9:], scale=0.3, causal=True)
    dk2, dv2 = np.zeros_like(args[9]), np.zeros_like(args[10])
    fused_backward.backward_tile(*args[:8], dq_big[..., :8], dk2, dv2, scale=0.3, causal=True)
    np.testing.assert_array_equal(dq_big[..., :8], dq_ref)
    assert not dq_big[..., 8:].any()
    # inputs in another dtype or layout are converted for the kernel
    args = _tile_args(rng, np.float32, 1, 2, 1, 30, 30, 8, pos, pos)
    (_, ref), _ = _both_tiles(args, scale=0.3, causal=True)
    args[0] = np.asfortranarray(args[0].astype(np.float64))
    acc = [np.zeros_like(a) for a in args[8:]]
    fused_backward.backward_tile(*args[:8], *acc, scale=0.3, causal=True)
    for a, b in zip(acc, ref):
        _assert_close(a, b, np.float32)


def test_bad_shapes_raise():
    rng = np.random.default_rng(2)
    pos = np.arange(10, dtype=np.int64)
    args = _tile_args(rng, np.float32, 1, 3, 2, 10, 10, 8, pos, pos)
    with pytest.raises(ValueError, match="not a multiple"):
        fused_backward.backward_tile(*args, scale=1.0, causal=False)
    args = _tile_args(rng, np.float32, 1, 2, 1, 10, 10, 8, pos, pos)
    args[4] = args[4][:, :, :5]
    with pytest.raises(ValueError, match="lse has shape"):
        fused_backward.backward_tile(*args, scale=1.0, causal=False)


@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
def test_spec_flops_counts_like_the_numpy_tile(monkeypatch, layout):
    """The vectorised count equals the numpy tile's, also with small blocks and shuffles."""
    monkeypatch.setattr(backward, "BLOCK_Q", 48)
    monkeypatch.setattr(backward, "BLOCK_K", 80)
    rng = np.random.default_rng(1)
    cases = [
        (ringmpi.positions(900, r, 3, layout), ringmpi.positions(900, s, 3, layout))
        for r in range(3)
        for s in range(3)
    ]
    cases.append((rng.permutation(200)[:60], rng.permutation(200)[:80]))
    for qp, kp in cases:
        qp, kp = qp.astype(np.int64), kp.astype(np.int64)
        args = _tile_args(rng, np.float32, 1, 2, 1, len(qp), len(kp), 4, qp, kp)
        for causal in (False, True):
            f = backward.backward_tile(*args, scale=0.5, causal=causal)
            assert fused_backward.spec_flops(qp, kp, causal=causal, batch=1, heads=2, d=4) == f
