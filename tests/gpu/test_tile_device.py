"""CUDA tile kernels against the numpy tile (the spec), and ring_attention on CuPy arrays.

Skipped, with the reason, when CuPy or a CUDA device is missing. Run on a GPU:
``pytest tests/gpu/test_tile_device.py`` (one process) and
``mpiexec -n 2 python -m mpi4py -m pytest --with-mpi -m mpi tests/gpu/test_tile_device.py``.

Tolerances for the tile: the numpy tile runs in float32 (float64) on the same
rounded inputs. Besides summation order, the fp16/bf16 tensor-core kernel
rounds the probabilities to 16 bits before P V: that moves each output by at
most u * max|v| (u = 2**-11 for fp16, 2**-8 for bf16), which the bound adds.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import ringmpi
from ringmpi import gpu, softmax
from ringmpi.cpu import numpy_tile as cpu
from ringmpi.gpu import configs, device
from ringmpi.gpu import plan as gpu_plan
from ringmpi.gpu import tile as gpu_tile
from ringmpi.layout import positions
from ringmpi.mask import make_mask
from ringmpi.reference import attention
from ringmpi.testing import assert_all, dense, random_qkv

cupy = pytest.importorskip("cupy", reason="CuPy is not installed: GPU tests skipped")
try:
    _NDEV = cupy.cuda.runtime.getDeviceCount()
    _WHY = "no CUDA device visible"
except Exception as exc:  # no driver
    _NDEV, _WHY = 0, f"CUDA unavailable ({type(exc).__name__}: {exc})"
if _NDEV == 0:
    pytest.skip(f"{_WHY}: GPU tests skipped", allow_module_level=True)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, scope="module")
def _private_tune_cache(tmp_path_factory):
    """Autotune choices go to a private file (timed once per test run); kernels stay cached."""
    from ringmpi.gpu import tune

    old = os.environ.get(tune.FILE_ENV)
    os.environ[tune.FILE_ENV] = str(tmp_path_factory.mktemp("tune") / "tune.json")
    tune.forget()
    yield
    tune.forget()
    if old is None:
        del os.environ[tune.FILE_ENV]
    else:
        os.environ[tune.FILE_ENV] = old


DTYPES = ["float16", "bfloat16", "float32", "float64"]
UNIT = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 0.0, "float64": 0.0}


def to_tile(x: np.ndarray, dtype: str):
    """(numpy array rounded to dtype in its compute precision, CuPy tile array)."""
    from tools import realcases

    return realcases.to_tile(cupy, x, dtype)


def storage_of(dtype: str) -> str:
    return gpu_tile._storage(np.dtype("uint16" if dtype == "bfloat16" else dtype))


def smem_limit() -> int:
    return device.smem_optin(device.current())


def kernel_for(dtype: str, d: int, causal: bool):
    """The kernel configuration the backend picks (or the autotuner picked) for this call."""
    return gpu_tile.chosen(storage_of(dtype), d, causal, device.current())


def run_pair(rng, dtype, b, h, hkv, d, q_pos, k_pos, k_pos0, causal, bounds=None, mods=None):
    """Carry a state through one K/V block on the CPU, then fold a second block on both.

    ``bounds`` (lo, hi): the per-row mask of both blocks (the tiles' ``bounds``); ``mods``:
    the tiles' score modifier keywords (``softcap``, ``alibi``).
    """
    sq, sk, sk0 = len(q_pos), len(k_pos), len(k_pos0)
    acc_t = np.float64 if dtype == "float64" else np.float32
    qn, qg = to_tile(rng.standard_normal((b, h, sq, d)), dtype)
    kn, kg = to_tile(rng.standard_normal((b, hkv, sk, d)), dtype)
    vn, vg = to_tile(rng.standard_normal((b, hkv, sk, d)), dtype)
    k0, _ = to_tile(rng.standard_normal((b, hkv, sk0, d)), dtype)
    v0, _ = to_tile(rng.standard_normal((b, hkv, sk0, d)), dtype)
    scale = 1.0 / np.sqrt(d)
    acc, m, l = softmax.init_state(qn.shape, acc_t)
    kw = {} if bounds is None else {"bounds": bounds}
    kw.update(mods or {})
    if sk0:
        cpu.forward_tile(qn, k0, v0, q_pos, k_pos0, acc, m, l, scale=scale, causal=causal, **kw)
    ga, gm, gl = (cupy.asarray(x) for x in (acc, m, l))
    cpu.forward_tile(qn, kn, vn, q_pos, k_pos, acc, m, l, scale=scale, causal=causal, **kw)
    calls = []
    flops = gpu.forward_tile(
        qg,
        kg,
        vg,
        q_pos,
        k_pos,
        ga,
        gm,
        gl,
        scale=scale,
        causal=causal,
        progress=lambda: calls.append(1),
        **kw,
    )
    cupy.cuda.get_current_stream().synchronize()
    return (acc, m, l), tuple(cupy.asnumpy(x) for x in (ga, gm, gl)), flops, calls, vn


def check_state(cpu_state, gpu_state, dtype, vmax, what):
    (a, m, l), (ga, gm, gl) = cpu_state, gpu_state
    empty = l == 0
    assert np.array_equal(gl == 0, empty), f"{what}: rows without keys differ"
    assert np.all(np.isneginf(gm[empty])) and np.all(ga[empty] == 0), f"{what}: empty rows"
    assert np.all(np.isfinite(gm[~empty])), f"{what}: non-finite m"
    o, lse = softmax.finalize(a, m, l)
    go, glse = softmax.finalize(ga, gm, gl)
    eps = np.finfo(a.dtype).eps
    tol_o = 64 * eps * vmax + 2 * UNIT[dtype] * vmax
    tol_lse = 64 * eps * max(1.0, np.abs(lse[~empty]).max(initial=0.0))
    err_o = np.abs(go - o).max(initial=0.0)
    err_lse = np.abs(glse[~empty] - lse[~empty]).max(initial=0.0)
    assert err_o <= tol_o, f"{what}: out err {err_o:.3g} > {tol_o:.3g}"
    assert err_lse <= tol_lse, f"{what}: lse err {err_lse:.3g} > {tol_lse:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 40, 200, 256, 8, 59, 111])
def test_tile_random_shapes(dtype, d):
    rng = np.random.default_rng(d)
    for trial in range(3):
        b, hkv = int(rng.integers(1, 3)), int(rng.integers(1, 3))
        h = hkv * int(rng.integers(1, 4))  # GQA groups of 1..3
        sq, sk, sk0 = (int(x) for x in rng.integers(1, 300, 3))  # partial tiles
        # queries start anywhere from before the first key (empty rows) to after the last
        q_pos = np.arange(sq, dtype=np.int64) + int(rng.integers(-100, sk + 1))
        k_pos, k_pos0 = np.arange(sk, dtype=np.int64), np.arange(sk0, dtype=np.int64)
        for causal in (False, True):
            kern = kernel_for(dtype, d, causal)
            c, g, flops, calls, vn = run_pair(
                rng, dtype, b, h, hkv, d, q_pos, k_pos, k_pos0, causal
            )
            what = f"{dtype} D={d} trial {trial} causal={causal} ({b},{h},{hkv},{sq},{sk})"
            check_state(c, g, dtype, np.abs(vn).max(), what)
            assert flops == gpu_plan.tile_flops(kern, q_pos, k_pos, causal, b, h, hkv, d), what
            visible = (k_pos[None, :] <= q_pos[:, None]).sum() if causal else sq * sk
            assert 4 * visible * d * b * h <= flops <= 4 * sq * sk * d * b * h, what
            assert calls, "progress was never called"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
def test_tile_causal_offsets_every_layout(dtype, layout):
    """Every (query rank, key rank) pair of a P=4 ring at awkward N, GQA, D=64 and 128."""
    rng = np.random.default_rng(17)
    for n, p, d in [(1000, 4, 64), (333, 4, 128), (130, 3, 64)]:
        for rq in range(p):
            for rk in range(p):
                q_pos, k_pos = positions(n, rq, p, layout), positions(n, rk, p, layout)
                k_pos0 = positions(n, (rk + 1) % p, p, layout)
                if len(q_pos) == 0 or len(k_pos) == 0:
                    continue
                c, g, flops, _, vn = run_pair(rng, dtype, 1, 4, 2, d, q_pos, k_pos, k_pos0, True)
                what = f"{dtype} {layout} n={n} P={p} q rank {rq} k rank {rk}"
                check_state(c, g, dtype, np.abs(vn).max(), what)
                visible = (k_pos[None, :] <= q_pos[:, None]).sum()
                kern = kernel_for(dtype, d, True)
                assert flops == gpu_plan.tile_flops(kern, q_pos, k_pos, True, 1, 4, 2, d), what
                assert (flops == 0) == (visible == 0), f"{what}: skipping is wrong"


def test_fully_masked_tile_leaves_state():
    rng = np.random.default_rng(3)
    q_pos, k_pos = np.arange(100, dtype=np.int64), np.arange(100, 250, dtype=np.int64)
    c, g, flops, _, _ = run_pair(rng, "float32", 1, 2, 1, 64, q_pos, k_pos, q_pos, True)
    assert flops == 0
    for x, y in zip(c, g):
        assert np.array_equal(x, y)


# ---------------------------------------------------------------------------
# masks beyond causal: per-row bounds (lo, hi) from ringmpi.mask, as the ring passes them
# ---------------------------------------------------------------------------
LENGTHS = (3, 97, 1, 139, 60)
CU = np.concatenate(([0], np.cumsum(LENGTHS)))  # 300 tokens in 5 packed sequences
CU_K = CU + 30 * np.arange(len(CU))  # 30 more keys per sequence: packed cross-attention

# (name, nq, nk, causal, mask keywords of ring_attention)
MASKS = [
    ("window 30 causal", 400, 400, True, dict(window=(30, 0))),
    ("window 9,4", 400, 400, False, dict(window=(9, 4))),
    ("packed causal", 300, 300, True, dict(cu_seqlens=CU)),
    ("packed window 20,20", 300, 300, False, dict(cu_seqlens=CU, window=(20, 20))),
    ("cross 200x500 causal", 200, 500, True, {}),
    ("cross 500x200 causal (empty rows)", 500, 200, True, {}),
    (
        "cross packed window",
        300,
        int(CU_K[-1]),
        True,
        dict(cu_seqlens=CU, cu_seqlens_k=CU_K, window=(16, 0)),
    ),
]


def mask_tiles(layout: str, pairs=((0, 0), (1, 0), (0, 1)), p: int = 2):
    """(what, q_pos, k_pos, k_pos0, bounds) of tile calls a P-rank masked ring makes."""
    for name, nq, nk, causal, kw in MASKS:
        mask = make_mask(nq, nk, causal, **kw)
        for rq, rk in pairs:
            q_pos = positions(nq, rq, p, layout, cu_seqlens=mask.cu_q)
            k_pos = positions(nk, rk, p, layout, cu_seqlens=mask.cu_k)
            k_pos0 = positions(nk, (rk + 1) % p, p, layout, cu_seqlens=mask.cu_k)
            if len(q_pos) and len(k_pos):
                yield f"{name} {layout} q{rq} k{rk}", q_pos, k_pos, k_pos0, mask.bounds(q_pos)
    # random rows, a quarter of them empty (lo > hi), keys in shuffled runs of 50
    rng = np.random.default_rng(4)
    q_pos = np.arange(300, dtype=np.int64)
    k_pos = (50 * rng.permutation(8)[:, None] + np.arange(50)).ravel().astype(np.int64)
    lo = rng.integers(-50, 400, 300)
    hi = lo + rng.integers(-40, 120, 300)
    yield f"random rows {layout}", q_pos, k_pos, np.arange(400, 450, dtype=np.int64), (lo, hi)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
def test_tile_masks(dtype, layout):
    """Forward tile with bounds (windows, packed, cross, empty rows) against the numpy tile."""
    rng = np.random.default_rng(31)
    for d in (64, 200) if layout == "zigzag" else (64,):  # 200: the CUDA-core fp16/bf16 tile
        kern = kernel_for(dtype, d, True)
        for what, q_pos, k_pos, k_pos0, bounds in mask_tiles(layout):
            what = f"{dtype} D={d} {kern.name} {what}"
            c, g, flops, calls, vn = run_pair(
                rng, dtype, 1, 4, 2, d, q_pos, k_pos, k_pos0, True, bounds
            )
            check_state(c, g, dtype, np.abs(vn).max(), what)
            assert flops == gpu_plan.tile_flops(kern, q_pos, k_pos, True, 1, 4, 2, d, bounds)
            visible = int(visibility(q_pos, k_pos, True, bounds).sum())
            assert 4 * visible * d * 4 <= flops <= 4 * len(q_pos) * len(k_pos) * d * 4, what
            assert calls, "progress was never called"


def test_fully_masked_bounds_leave_state():
    """Bounds that hide every key: no flops, state and gradients untouched, no NaN."""
    rng = np.random.default_rng(5)
    q_pos, k_pos = np.arange(100, dtype=np.int64), np.arange(100, 250, dtype=np.int64)
    for lo, hi in [(q_pos - 20, q_pos), (q_pos + 5, q_pos)]:  # keys outside / every row empty
        for dtype in ("float16", "float32"):
            c, g, flops, _, _ = run_pair(
                rng, dtype, 1, 2, 1, 64, q_pos, k_pos, q_pos, False, (lo, hi)
            )
            assert flops == 0
            for x, y in zip(c, g):
                assert np.array_equal(x, y)
            ref, got, flops, _, _, _ = run_backward(
                rng, dtype, 1, 2, 1, 64, q_pos, k_pos, q_pos, False, (lo, hi)
            )
            assert flops == 0
            for r, x in zip(ref, got):
                assert np.array_equal(r.astype(x.dtype), x)


def test_bf16_bits_round_trip():
    """CuPy rounding is bit-identical to the numpy path (checked against a reference in
    tests/gpu/test_nvrtc.py); the error is at most half a bfloat16 ulp, subnormals too."""
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.0e38, 1e-40, -1e-39, 0.0], dtype=np.float32)
    b = gpu.to_bf16_bits(cupy.asarray(x))
    assert b.dtype == cupy.uint16
    np.testing.assert_array_equal(cupy.asnumpy(b), gpu.to_bf16_bits(x))
    back = cupy.asnumpy(gpu.from_bf16_bits(b)).astype(np.float64)
    np.testing.assert_array_equal(back[:4], [1.0, 1.0, 1.015625, -2.5])
    # ulp of bfloat16 at |x|: 2**(e - 7) for normal x (2**e <= |x|), 2**-133 below 2**-126
    e = np.floor(np.log2(np.maximum(np.abs(x).astype(np.float64), 2.0**-126)))
    assert np.all(np.abs(back - x) <= 2.0 ** (e - 8))
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32).view(np.float32)
    got = cupy.asnumpy(gpu.to_bf16_bits(cupy.asarray(raw)))
    want = gpu.to_bf16_bits(raw)
    nan = np.isnan(raw)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.all(np.isnan(gpu.from_bf16_bits(got[nan]))), "a NaN did not stay NaN"


def test_every_configuration_that_fits(monkeypatch):
    """Each forward configuration the device can run, forced through RINGMPI_GPU_CONFIG."""
    rng = np.random.default_rng(8)
    for dtype in DTYPES:
        for d in (64, 128, 200):
            for kern in configs.forward_candidates(storage_of(dtype), d, smem_limit()):
                monkeypatch.setenv(gpu_tile.CONFIG_ENV, kern.name)
                assert kernel_for(dtype, d, False) == kernel_for(dtype, d, True) == kern
                q_pos = np.arange(150, dtype=np.int64) + 60
                k_pos, k_pos0 = np.arange(190, dtype=np.int64), np.arange(70, dtype=np.int64)
                # a window with empty rows (lo > hi) and rows past the keys
                lo, hi = q_pos - 70, q_pos - 10
                hi[::7] = lo[::7] - 1
                for causal, bounds in ((False, None), (True, None), (False, (lo, hi))):
                    c, g, flops, _, vn = run_pair(
                        rng, dtype, 2, 6, 2, d, q_pos, k_pos, k_pos0, causal, bounds
                    )
                    what = f"{kern.name} {dtype} D={d} causal={causal} bounds={bounds is not None}"
                    check_state(c, g, dtype, np.abs(vn).max(), what)
                    want = gpu_plan.tile_flops(kern, q_pos, k_pos, causal, 2, 6, 2, d, bounds)
                    assert flops == want, what
    monkeypatch.setenv(gpu_tile.CONFIG_ENV, "no-such-config")
    with pytest.raises(ValueError, match="no-such-config"):
        kernel_for("float32", 64, False)


def test_check_finite_bf16_bits_on_gpu():
    from mpi4py import MPI

    x = np.ones((8, 2, 16), dtype=np.float32)
    x[3, 1, 5] = np.inf
    q = cupy.asarray(gpu.to_bf16_bits(x))
    k = cupy.asarray(gpu.to_bf16_bits(np.ones_like(x)))
    with pytest.raises(ValueError, match="q contains NaN or Inf"):
        ringmpi.ring_attention(q, k, k, MPI.COMM_SELF, check_finite=True)


_SPIN = r"""
extern "C" __global__ void spin_fill(float* x, int n, float val, long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
    x[i] = val;
}
"""


@pytest.mark.parametrize("aware", [False, True])
def test_staged_start_does_not_wait_for_the_kernel(aware):
    """Staged: start() returns while the producing kernel still runs; the data is still right.

    The pinned buffers are reserved first: allocating pinned memory synchronises the
    device (GpuRing's docstring), so a first allocation inside start() would wait for
    the kernel on a correct ring (issue 39).
    """
    from mpi4py import MPI

    if aware and not gpu.cuda_aware():
        pytest.skip("MPI is not CUDA-aware here")
    spin = cupy.RawKernel(_SPIN, "spin_fill")
    ring = gpu.GpuRing(MPI.COMM_SELF)  # a ring of one: sends to itself
    ring.cuda_aware = aware
    try:
        send = cupy.zeros(1 << 20, dtype=cupy.float32)
        recv = cupy.empty_like(send)
        ring.reserve(send.nbytes)  # pinned buffers now, not inside the timed start
        for it in range(3):
            rate = device.props(device.current())["clockRate"] * 1e3  # Hz
            spin(
                (64,),
                (256,),
                (send, np.int32(send.size), np.float32(it + 1), np.int64(int(0.2 * rate))),
            )
            done = cupy.cuda.Event()
            done.record()
            ring.start(send, recv)
            if not aware:  # CUDA-aware start synchronises the producer by design
                assert not done.done, "start() waited for the kernel: no overlap possible"
            while not done.done:
                ring.test()
            ring.wait()
            assert bool((recv == it + 1).all()), f"iteration {it}: received stale data"
    finally:
        ring.free()


# ---------------------------------------------------------------------------
# backward tile against the numpy backward tile (float64) on the same rounded inputs
# ---------------------------------------------------------------------------
def grouped(x, g):
    """(B, Hkv, S, D) -> (B, Hkv * g, S, D): each K/V head repeated for its query heads."""
    return np.repeat(x, g, axis=1)


def visibility(q_pos, k_pos, causal, bounds=None):
    """(Sq, Sk) bool: which keys each query sees (the tile contract, element by element)."""
    if bounds is not None:
        lo, hi = bounds
        return (lo[:, None] <= k_pos[None, :]) & (k_pos[None, :] <= hi[:, None])
    if causal:
        return k_pos[None, :] <= q_pos[:, None]
    return np.ones((len(q_pos), len(k_pos)), bool)


def run_backward(rng, dtype, b, h, hkv, d, q_pos, k_pos, k_pos0, causal, bounds=None, mods=None):
    """(reference increments, GPU results, flops, progress calls, tolerance bounds).

    ``mods``: the tiles' score modifier keywords (``softcap``, ``alibi``), applied to the
    state's forward, the numpy backward tile and the GPU backward tile alike.
    """
    sq, sk = len(q_pos), len(k_pos)
    g = h // hkv
    adt = np.float64 if dtype == "float64" else np.float32
    qn, _ = to_tile(rng.standard_normal((b, h, sq, d)), dtype)
    kn, kg = to_tile(rng.standard_normal((b, hkv, sk, d)), dtype)
    vn, vg = to_tile(rng.standard_normal((b, hkv, sk, d)), dtype)
    don, _ = to_tile(rng.standard_normal((b, h, sq, d)), dtype)
    k0, _ = to_tile(rng.standard_normal((b, hkv, len(k_pos0), d)), dtype)
    v0, _ = to_tile(rng.standard_normal((b, hkv, len(k_pos0), d)), dtype)
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (qn, kn, vn, don))
    scale = 1.0 / np.sqrt(d)
    kw = {} if bounds is None else {"bounds": bounds}
    kw.update(mods or {})
    # lse and out of a real ring state: an earlier block, then this one
    acc, m, l = softmax.init_state(q64.shape, np.float64)
    for kk, vv, pp in ((k0, v0, k_pos0), (k64, v64, k_pos)):
        if len(pp):
            cpu.forward_tile(
                q64,
                kk.astype(np.float64),
                vv.astype(np.float64),
                q_pos,
                pp,
                acc,
                m,
                l,
                scale=scale,
                causal=causal,
                **kw,
            )
    out, lse = softmax.finalize(acc, m, l)
    delta = (do64 * out).sum(-1)
    # += is checked too; the starting values are exact in the accumulation dtype, so a
    # block that adds nothing leaves the GPU accumulators equal to the reference
    start = [rng.standard_normal(x.shape).astype(adt).astype(np.float64) for x in (q64, k64, v64)]
    ref = [x.copy() for x in start]
    cpu.backward_tile(
        q64, k64, v64, do64, lse, delta, q_pos, k_pos, *ref, scale=scale, causal=causal, **kw
    )
    got = [cupy.asarray(x.astype(adt)) for x in start]
    calls = []
    as_acc = [cupy.asarray(x.astype(adt)) for x in (qn, don, lse, delta)]
    flops = gpu.backward_tile(
        as_acc[0],
        kg,
        vg,
        as_acc[1],
        as_acc[2],
        as_acc[3],
        q_pos,
        k_pos,
        *got,
        scale=scale,
        causal=causal,
        progress=lambda: calls.append(1),
        **kw,
    )
    cupy.cuda.get_current_stream().synchronize()
    # dense |P| and |dS| bound what rounding P and dS to 16 bits can move
    kf, vf = grouped(k64, g), grouped(v64, g)
    vis = visibility(q_pos, k_pos, causal, bounds)
    s = scale * q64 @ np.swapaxes(kf, -1, -2)
    dcap = 1.0
    if (mods or {}).get("softcap"):
        t_cap = np.tanh(s / mods["softcap"])
        s, dcap = mods["softcap"] * t_cap, 1 - t_cap * t_cap
    if (mods or {}).get("alibi") is not None:
        slopes, qa = mods["alibi"]
        s = s - np.asarray(slopes)[:, None, None] * np.abs(qa[:, None] - k_pos[None, :])
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(vis, np.exp(s - lse[..., None]), 0.0)
    p = np.nan_to_num(p)
    ds = p * (do64 @ np.swapaxes(vf, -1, -2) - delta[..., None]) * dcap
    gsum = lambda x: x.reshape(b, hkv, g, sk, d).sum(2)  # noqa: E731
    bounds = (
        scale * np.abs(ds) @ np.abs(kf),
        gsum(scale * np.swapaxes(np.abs(ds), -1, -2) @ np.abs(q64)),
        gsum(np.swapaxes(p, -1, -2) @ np.abs(do64)),
    )
    visible = int(vis.sum())
    return ref, [cupy.asnumpy(x) for x in got], flops, calls, bounds, visible


def check_backward(ref, got, bounds, dtype, what):
    eps = np.finfo(np.float64 if dtype == "float64" else np.float32).eps
    for name, r, x, bnd in zip(("dq", "dk", "dv"), ref, got, bounds):
        # products (bounded by bnd) plus the final rounding of the accumulator (|r|)
        tol = (3 * UNIT[dtype] + 128 * eps) * float(bnd.max(initial=0.0))
        tol += eps * float(np.abs(r).max(initial=0.0)) + 1e-6 * eps
        err = float(np.abs(x - r).max(initial=0.0))
        assert err <= tol, f"{what} {name}: err {err:.3g} > tol {tol:.3g}"


def bwd_kernels(dtype, d):
    try:
        return gpu.backward.chosen(storage_of(dtype), d, device.current())
    except configs.NoConfigError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 40, 200, 8, 59, 111])
def test_backward_tile_random_shapes(dtype, d):
    _, k_dq = bwd_kernels(dtype, d)
    rng = np.random.default_rng(100 + d)
    for trial in range(3):
        b, hkv = int(rng.integers(1, 3)), int(rng.integers(1, 3))
        h = hkv * int(rng.integers(1, 4))
        sq, sk, sk0 = (int(x) for x in rng.integers(1, 300, 3))
        q_pos = np.arange(sq, dtype=np.int64) + int(rng.integers(-100, sk + 1))
        k_pos = np.arange(sk, dtype=np.int64)
        k_pos0 = np.arange(sk0, dtype=np.int64) - sk0  # earlier keys: most rows see some
        for causal in (False, True):
            ref, got, flops, calls, bounds, visible = run_backward(
                rng, dtype, b, h, hkv, d, q_pos, k_pos, k_pos0, causal
            )
            what = f"{dtype} D={d} trial {trial} causal={causal} ({b},{h},{hkv},{sq},{sk})"
            check_backward(ref, got, bounds, dtype, what)
            want = gpu.backward.backward_flops(k_dq, q_pos, k_pos, causal, b, h, d)
            assert flops == want, what
            assert 10 * visible * d * b * h <= flops <= 10 * sq * sk * d * b * h, what
            assert calls, "progress was never called"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
def test_backward_tile_causal_offsets_every_layout(dtype, layout):
    """Every (query rank, key rank) pair of a P=4 ring at awkward N, GQA, D=64 and 128."""
    rng = np.random.default_rng(19)
    for n, p, d in [(1000, 4, 64), (333, 4, 128), (130, 3, 64)]:
        bwd_kernels(dtype, d)
        for rq in range(p):
            for rk in range(p):
                q_pos, k_pos = positions(n, rq, p, layout), positions(n, rk, p, layout)
                if len(q_pos) == 0 or len(k_pos) == 0:
                    continue
                k_pos0 = positions(n, (rk + 1) % p, p, layout)
                ref, got, flops, _, bounds, visible = run_backward(
                    rng, dtype, 1, 4, 2, d, q_pos, k_pos, k_pos0, True
                )
                what = f"{dtype} {layout} n={n} P={p} q rank {rq} k rank {rk}"
                check_backward(ref, got, bounds, dtype, what)
                assert (flops == 0) == (visible == 0), f"{what}: skipping is wrong"
                if visible == 0:  # nothing visible: the accumulators are untouched
                    for r, x in zip(ref, got):
                        assert np.array_equal(r.astype(x.dtype), x), what


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
def test_backward_tile_masks(dtype, layout):
    """Backward tiles with bounds (windows, packed, cross, empty rows) against the numpy tile."""
    rng = np.random.default_rng(37)
    for d in (64, 200) if layout == "zigzag" else (64,):  # 200: the CUDA-core fp16/bf16 tiles
        _, k_dq = bwd_kernels(dtype, d)
        for what, q_pos, k_pos, k_pos0, bounds in mask_tiles(layout, ((0, 0), (1, 0))):
            ref, got, flops, calls, tol, visible = run_backward(
                rng, dtype, 1, 4, 2, d, q_pos, k_pos, k_pos0, True, bounds
            )
            what = f"{dtype} D={d} {what}"
            check_backward(ref, got, tol, dtype, what)
            want = gpu.backward.backward_flops(k_dq, q_pos, k_pos, True, 1, 4, d, bounds)
            assert flops == want, what
            assert 10 * visible * d * 4 <= flops <= 10 * len(q_pos) * len(k_pos) * d * 4, what
            assert calls, "progress was never called"


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_tile_softcap_and_alibi(dtype):
    """Softcap, ALiBi and both in the backward kernels against the numpy tile, under masks.

    Causal and per-row bounds (a window with empty rows), GQA, D = 64 (tensor cores for
    fp16/bf16) and 200 (CUDA cores), ALiBi rows offset as in cross-attention.
    """
    rng = np.random.default_rng(26)
    q_pos = np.arange(150, dtype=np.int64) + 60
    k_pos, k_pos0 = np.arange(190, dtype=np.int64), np.arange(70, dtype=np.int64)
    lo, hi = q_pos - 70, q_pos - 10
    hi[::7] = lo[::7] - 1  # empty rows stay empty
    slopes = np.array([0.5, 0.25, 0.125, 2.0**-6, 2.0**-8, 0.0])
    alibi = (slopes, q_pos + 3)
    for d in (64, 200):
        _, k_dq = bwd_kernels(dtype, d)
        for mods in (dict(softcap=2.0), dict(alibi=alibi), dict(softcap=5.0, alibi=alibi)):
            for causal, bounds in ((True, None), (False, (lo, hi))):
                ref, got, flops, calls, tol, visible = run_backward(
                    rng, dtype, 2, 6, 2, d, q_pos, k_pos, k_pos0, causal, bounds, mods
                )
                what = f"{dtype} D={d} {sorted(mods)} causal={causal} bounds={bounds is not None}"
                check_backward(ref, got, tol, dtype, what)
                want = gpu.backward.backward_flops(k_dq, q_pos, k_pos, causal, 2, 6, d, bounds)
                assert flops == want and calls, what


def test_kernels_load_from_the_disk_cache():
    """A kernel compiled once is loaded from the cache by the next process (or cache clear)."""
    from ringmpi.gpu import loader

    expr = "attn_fwd_simt<float, float, 64, 32, 32>"
    loader.get_function(gpu_tile.KERNEL_FILE, expr, gpu_tile.kernel_names())
    first = loader.last_path[expr]
    assert first in ("cache", "compiled"), f"NVRTC path not used: {first}"
    loader._function.cache_clear()
    gpu_tile._function.cache_clear()
    gpu.backward._function.cache_clear()
    loader.get_function(gpu_tile.KERNEL_FILE, expr, gpu_tile.kernel_names())
    assert loader.last_path[expr] == "cache"


def test_gpu_backend_has_a_backward_tile():
    from ringmpi.backend import select

    be = select(cupy.zeros(1))
    assert be.name == "gpu" and be.backward_tile is gpu.backward_tile


# ---------------------------------------------------------------------------
# ring_attention with CuPy inputs: one process (P = 1) and under mpiexec (P = 2)
# ---------------------------------------------------------------------------
def ring_case(comm, dtype, causal, layout, n=517, h=4, hkv=2, d=64, batch=None):
    rng = np.random.default_rng(23)
    q, k, v = comm.bcast(random_qkv(rng, n, h, hkv, d, batch) if comm.rank == 0 else None)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    ref, _ = attention(q, k, v, causal=causal)
    loc = [cupy.asarray(ringmpi.shard(x, comm, layout)) for x in (q, k, v)]
    stats = {}
    out = ringmpi.ring_attention(*loc, comm, causal=causal, layout=layout, stats=stats)
    assert isinstance(out, cupy.ndarray) and out.dtype == loc[0].dtype
    full = ringmpi.gather(cupy.asnumpy(out).astype(np.float64), n, comm, layout)
    d_out, _ = dense(q, k, v, causal)
    tol = 2 * np.abs(d_out - ref).max() + 1e-6
    if dtype == np.float16:  # output rounding + probability rounding (see module doc)
        tol += UNIT["float16"] * (np.abs(ref).max() + np.abs(v.astype(np.float64)).max())
    err = np.abs(full - ref).max()
    assert_all(
        comm,
        err <= tol,
        f"{np.dtype(dtype).name} {layout} causal={causal}: err {err:.3g} > tol {tol:.3g}",
    )
    assert_all(comm, stats.get("backend") == "gpu", f"backend {stats.get('backend')}")


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_single_process(dtype, causal):
    from mpi4py import MPI

    ring_case(MPI.COMM_SELF, dtype, causal, "zigzag", batch=2)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("d", [59, 111])
def test_ring_odd_head_dims(dtype, d):
    """Head dims that are no multiple of 8: the tensor-core tiles pad rows to 16 bytes."""
    from mpi4py import MPI

    ring_case(MPI.COMM_SELF, dtype, True, "zigzag", n=300, d=d)
    ring_backward_case(MPI.COMM_SELF, dtype, True, "zigzag", n=300, d=d)


@pytest.mark.mpi
@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_mpi(comm, layout, dtype, causal):
    gpu.bind_device(comm)
    ring_case(comm, dtype, causal, layout)


@pytest.mark.mpi
def test_gpu_ring_odd_head_dims_mpi(comm):
    """D = 59 and 111 over the ring (staged or CUDA-aware, as the stage sets it)."""
    gpu.bind_device(comm)
    for d in (59, 111):
        ring_case(comm, np.float16, True, "zigzag", n=301, d=d)
        ring_backward_case(comm, np.float16, True, "striped", n=301, d=d)


@pytest.mark.mpi
def test_gpu_ring_exchange_and_overlap(comm):
    """GpuRing moves device buffers around the ring, staged and (if available) CUDA-aware."""
    gpu.bind_device(comm)
    for aware in {False, bool(gpu.cuda_aware())}:
        ring = gpu.GpuRing(comm)
        ring.cuda_aware = aware
        send = cupy.full(1 << 16, comm.rank, dtype=cupy.float32)
        recv = cupy.empty_like(send)
        ring.reserve(send.nbytes)  # pinned buffers now, not inside the timed start
        ring.start(send, recv)
        ring.test()
        ring.wait()
        prev = (comm.rank - 1) % comm.size
        ok = bool((recv == prev).all())
        rep = ring.overlap_report()
        ring.free()
        assert_all(comm, ok, f"cuda_aware={aware}: wrong data received")
        assert_all(comm, rep["steps"] == 1 and rep["exchange_s"] >= 0, f"report {rep}")


# ---------------------------------------------------------------------------
# ring_attention_backward with CuPy inputs against the dense float64 reference
# ---------------------------------------------------------------------------
def ring_backward_case(comm, dtype, causal, layout, n=517, h=4, hkv=2, d=64, batch=None):
    from ringmpi.backward import ring_attention_backward
    from ringmpi.reference import attention_backward
    from ringmpi.testing import dense_backward

    rng = np.random.default_rng(29)
    data = None
    if comm.rank == 0:
        q, k, v = random_qkv(rng, n, h, hkv, d, batch)
        data = (q, k, v, rng.standard_normal(q.shape))
    q, k, v, dout = (x.astype(dtype) for x in comm.bcast(data))
    loc = [cupy.asarray(ringmpi.shard(x, comm, layout)) for x in (q, k, v, dout)]
    out, lse = ringmpi.ring_attention(*loc[:3], comm, causal=causal, layout=layout, return_lse=True)
    stats = {}
    grads = ring_attention_backward(
        loc[3], *loc[:3], out, lse, comm, causal=causal, layout=layout, stats=stats
    )
    assert_all(comm, stats.get("backend") == "gpu", f"backend {stats.get('backend')}")
    ok = all(isinstance(g, cupy.ndarray) and g.dtype == x.dtype for g, x in zip(grads, loc))
    assert_all(comm, ok, "gradients are not CuPy arrays of the input dtype")
    full = [ringmpi.gather(cupy.asnumpy(g).astype(np.float64), n, comm, layout) for g in grads]
    ref = attention_backward(dout, q, k, v, causal=causal)
    peer = dense_backward(dout, q, k, v, causal) if dtype != np.float64 else ref
    for name, got, want, other in zip("qkv", full, ref, peer):
        err = np.abs(got - want).max()
        if dtype == np.float64:
            tol = 1e-11 * max(1.0, np.abs(want).max())
        else:
            tol = 3 * np.abs(other - want).max() + 1e-6
            if dtype == np.float16:  # output rounding and P, dS rounded to fp16 (module doc)
                tol += 32 * UNIT["float16"] * np.abs(want).max()
        assert_all(
            comm,
            err <= tol,
            f"{np.dtype(dtype).name} {layout} causal={causal} "
            f"d{name}: err {err:.3g} > tol {tol:.3g}",
        )


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_ring_single_process(dtype, causal):
    from mpi4py import MPI

    ring_backward_case(MPI.COMM_SELF, dtype, causal, "zigzag", batch=2)


@pytest.mark.mpi
@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_ring_mpi(comm, layout, dtype, causal):
    gpu.bind_device(comm)
    ring_backward_case(comm, dtype, causal, layout)


# ---------------------------------------------------------------------------
# ring_attention and its backward with CuPy inputs and masks beyond causal
# ---------------------------------------------------------------------------
RING_MASKS = [
    ("window 40 causal", 600, 600, True, dict(window=(40, 0))),
    ("packed causal", 300, 300, True, dict(cu_seqlens=CU)),
    ("packed window 20,5", 300, 300, False, dict(cu_seqlens=CU, window=(20, 5))),
    ("cross 500x200 causal (empty rows)", 500, 200, True, {}),
    ("cross packed causal", 300, int(CU_K[-1]), True, dict(cu_seqlens=CU, cu_seqlens_k=CU_K)),
]


def ring_mask_case(comm, dtype, layout, case, h=4, hkv=2, d=64):
    """Forward and backward of one masked case on CuPy arrays against the dense references."""
    from ringmpi.backward import ring_attention_backward
    from ringmpi.reference import attention_backward
    from ringmpi.testing import dense_backward

    name, nq, nk, causal, kw = case
    rng = np.random.default_rng(41)
    data = None
    if comm.rank == 0:
        data = [rng.standard_normal(s) for s in ((nq, h, d), (nk, hkv, d), (nk, hkv, d))]
        data.append(rng.standard_normal((nq, h, d)))
    q, k, v, dout = (x.astype(dtype) for x in comm.bcast(data))
    cu_q, cu_k = kw.get("cu_seqlens"), kw.get("cu_seqlens_k", kw.get("cu_seqlens"))
    ql, dl = (cupy.asarray(ringmpi.shard(x, comm, layout, cu_seqlens=cu_q)) for x in (q, dout))
    kl, vl = (cupy.asarray(ringmpi.shard(x, comm, layout, cu_seqlens=cu_k)) for x in (k, v))
    stats = {}
    out, lse = ringmpi.ring_attention(
        ql, kl, vl, comm, causal=causal, layout=layout, return_lse=True, stats=stats, **kw
    )
    assert_all(comm, stats.get("backend") == "gpu", f"backend {stats.get('backend')}")
    tag = f"{name} {layout} {np.dtype(dtype).name} P={comm.size}"
    full = ringmpi.gather(cupy.asnumpy(out).astype(np.float64), nq, comm, layout, cu_seqlens=cu_q)
    ref, _ = attention(q, k, v, causal, **kw)
    peer, _ = dense(q, k, v, causal, **kw)
    tol = 2 * np.abs(peer - ref).max() + 1e-6
    if dtype == np.float16:  # output rounding + probability rounding (see module doc)
        tol += UNIT["float16"] * (np.abs(ref).max() + np.abs(v.astype(np.float64)).max())
    err = np.abs(full - ref).max()
    assert_all(comm, err <= tol, f"{tag} out: err {err:.3g} > tol {tol:.3g}")
    assert_all(comm, bool(cupy.isfinite(out).all()), f"{tag}: non-finite output")
    grads = ring_attention_backward(
        dl, ql, kl, vl, out, lse, comm, causal=causal, layout=layout, **kw
    )
    want = attention_backward(dout, q, k, v, causal, **kw)
    other = dense_backward(dout, q, k, v, causal, **kw)
    for nm, g, w, o, n, cu in zip("qkv", grads, want, other, (nq, nk, nk), (cu_q, cu_k, cu_k)):
        got = ringmpi.gather(cupy.asnumpy(g).astype(np.float64), n, comm, layout, cu_seqlens=cu)
        tol = 3 * np.abs(o - w).max() + 1e-6
        if dtype == np.float16:  # output rounding and P, dS rounded to fp16 (module doc)
            tol += 32 * UNIT["float16"] * np.abs(w).max()
        err = np.abs(got - w).max()
        assert_all(comm, err <= tol, f"{tag} d{nm}: err {err:.3g} > tol {tol:.3g}")


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_ring_masks_single_process(dtype):
    from mpi4py import MPI

    for case in RING_MASKS:
        ring_mask_case(MPI.COMM_SELF, dtype, "zigzag", case)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "layout, dtype", [(lay, np.float32) for lay in ringmpi.LAYOUTS] + [("striped", np.float16)]
)
def test_ring_masks_mpi(comm, layout, dtype):
    gpu.bind_device(comm)
    for case in RING_MASKS:
        ring_mask_case(comm, dtype, layout, case)


GPU_RING_MODS = [
    ("softcap, window 60,0", 203, None, True, dict(softcap=4.0, window=(60, 0))),
    (
        "alibi, packed causal",
        203,
        None,
        True,
        dict(alibi_slopes=[0.5, 0.25, 0.0625, 0.0], cu_seqlens=(0, 40, 41, 203)),
    ),
    (
        "both, packed cross causal",
        163,
        150,
        True,
        dict(
            softcap=3.0,
            alibi_slopes=[0.125, 0.5, 0.0, 2.0**-5],
            cu_seqlens=(0, 3, 100, 101, 163),
            cu_seqlens_k=(0, 9, 70, 70, 150),
        ),
    ),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_backward_ring_softcap_alibi_single_process(dtype):
    """ring_attention_backward on CuPy arrays with softcap / ALiBi against the float64 reference."""
    from mpi4py import MPI
    from tools import gpucases

    for _, n, nk, causal, mask in GPU_RING_MODS:
        gpucases.backward_case(
            cupy, MPI.COMM_SELF, dtype, "zigzag", causal, mask=mask, n=n, nk=nk, d=64
        )


@pytest.mark.mpi
@pytest.mark.parametrize("layout", ringmpi.LAYOUTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_backward_ring_softcap_alibi_mpi(comm, layout, dtype):
    from tools import gpucases

    gpu.bind_device(comm)
    for _, n, nk, causal, mask in GPU_RING_MODS:
        gpucases.backward_case(cupy, comm, dtype, layout, causal, mask=mask, n=n, nk=nk, d=64)


# ---------------------------------------------------------------------------
# issue 20: values shaped like real data (means, small spreads, sinks) over
# 65,536 keys or query rows, every configuration, against the float64 reference
# (tests/tools/realcases.py; the stand-in suite runs the same cases on numpy)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
def test_tile_real_values_long_rows(monkeypatch, dtype, d):
    """16 rows x 65,536 keys, in one call and in 3 (a carried ring state), each configuration."""
    from tools import realcases

    cands = configs.forward_candidates(storage_of(dtype), d, smem_limit())
    assert cands, f"no forward configuration for {dtype} D={d}"
    for kern in cands:
        monkeypatch.setenv(gpu_tile.CONFIG_ENV, kern.name)
        assert kernel_for(dtype, d, True) == kern
        for steps in (1, 3):
            realcases.forward_long(cupy, dtype, d, steps=steps, seed=d)


def test_tile_real_values_262144_keys():
    """The longest row of issue 20's table: 8 rows x 262,144 keys, float32 (CUDA cores)."""
    from tools import realcases

    realcases.forward_long(cupy, "float32", 32, rows=8, keys=262144, seed=1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", [(16, 65536), (65536, 64)], ids=["long rows", "long columns"])
def test_backward_tile_real_values_long(dtype, d, shape):
    """dq over 65,536 keys (long rows); dk, dv over 2 x 65,536 query rows (long columns)."""
    from tools import realcases

    bwd_kernels(dtype, d)
    realcases.backward_long(cupy, dtype, d, *shape, seed=d)


def test_every_configuration_with_softcap_and_alibi(monkeypatch):
    """Softcap and ALiBi in each forward configuration against the numpy tile, under masks."""
    rng = np.random.default_rng(25)
    for dtype in DTYPES:
        for d in (64, 200):
            for kern in configs.forward_candidates(storage_of(dtype), d, smem_limit()):
                monkeypatch.setenv(gpu_tile.CONFIG_ENV, kern.name)
                q_pos = np.arange(150, dtype=np.int64) + 60
                k_pos, k_pos0 = np.arange(190, dtype=np.int64), np.arange(70, dtype=np.int64)
                lo, hi = q_pos - 70, q_pos - 10
                hi[::7] = lo[::7] - 1  # empty rows stay empty
                slopes = np.array([0.5, 0.25, 0.125, 2.0**-6, 2.0**-8, 0.0])
                alibi = (slopes, q_pos + 3)  # cross-attention style offset of qa
                cases = [dict(softcap=2.0), dict(alibi=alibi), dict(softcap=5.0, alibi=alibi)]
                for mods in cases:
                    for causal, bounds in ((True, None), (False, (lo, hi))):
                        c, g, _, _, vn = run_pair(
                            rng, dtype, 2, 6, 2, d, q_pos, k_pos, k_pos0, causal, bounds, mods
                        )
                        what = f"{kern.name} {dtype} D={d} {sorted(mods)} causal={causal}"
                        check_state(c, g, dtype, np.abs(vn).max(), what)
