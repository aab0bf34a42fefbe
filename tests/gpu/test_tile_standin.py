"""The GPU Python path on one process, on the CuPy stand-in (tests/tools/fakecupy: NOT a GPU).

Backend dispatch, bfloat16 bits, every kernel configuration that fits (forced),
odd head dims (59, 111: the padded 16-byte rows of the tensor-core kernels),
the configuration choice by shared memory and compute capability, autotune's
cache, and the benchmark table that survives a failing row. Kernel arithmetic is
the numpy tile's (tests/tools/standin_kernels.py checks each launch); the CUDA
kernels themselves run only in tests/gpu/test_tile_device.py on a real device.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from tools import gpucases, standin, standin_kernels

DTYPES = ["float16", "bfloat16", "float32", "float64"]
STORAGE = {"float16": "half_t", "bfloat16": "bf16_t", "float32": "float", "float64": "double"}


@pytest.fixture(scope="module")
def cupy():
    """The CuPy stand-in, for this module only (see tests/tools/standin.py)."""
    with standin.installed() as cp:
        yield cp


@pytest.fixture
def smem(cupy, monkeypatch):
    """Set the stand-in device's opt-in shared memory per block (caches cleared around)."""

    def set_limit(nbytes: int, major: int = 9, minor: int = 0) -> None:
        props = cupy.cuda.runtime.PROPS
        monkeypatch.setitem(props, "sharedMemPerBlockOptin", nbytes)
        monkeypatch.setitem(props, "major", major)
        monkeypatch.setitem(props, "minor", minor)
        standin.clear_caches()

    yield set_limit
    monkeypatch.undo()
    standin.clear_caches()


def self_comm():
    from mpi4py import MPI

    return MPI.COMM_SELF


def test_the_standin_says_what_it_is(cupy):
    from ringmpi import gpu

    assert cupy.STANDIN and "standin" in cupy.__version__
    info = gpu.info()
    assert "stand-in" in info["device"] and info["compute_capability"] == "90", info
    x = cupy.zeros(3)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(x)  # as CuPy: no silent device -> host copies
    with pytest.raises(TypeError, match="host array"):
        x + np.ones(3)


def test_backend_dispatch(cupy):
    from ringmpi import gpu
    from ringmpi.backend import select

    be = select(cupy.zeros((2, 2), dtype=np.float32))
    assert be.name == "gpu" and be.xp is cupy and be.ring is gpu.GpuRing
    assert be.forward_tile is gpu.forward_tile and be.backward_tile is gpu.backward_tile
    assert "uint16" in be.dtypes and "bfloat16" in be.dtypes
    assert select(np.zeros(2)).name in ("fused", "numpy")
    bits = gpu.to_bf16_bits(cupy.asarray(np.array([1.5, -2.25], dtype=np.float32)))
    assert be.decode(bits).dtype == np.float32 and np.array_equal(
        be.decode(bits).get(), [1.5, -2.25]
    )
    out = be.cast_out(cupy.asarray(np.array([[1.0, 3.0]], dtype=np.float32)), np.uint16)
    assert type(out) is cupy.ndarray and out.dtype == np.uint16


def test_bf16_bits_on_device_match_the_host(cupy):
    from ringmpi import gpu

    rng = np.random.default_rng(2)
    raw = rng.integers(0, 2**32, 1 << 14, dtype=np.uint64).astype(np.uint32).view(np.float32)
    raw[:6] = [np.inf, -np.inf, 0.0, -0.0, 3.0e38, 1e-40]
    got = gpu.to_bf16_bits(cupy.asarray(raw))
    assert type(got) is cupy.ndarray and got.dtype == np.uint16
    want = gpu.to_bf16_bits(raw)
    nan = np.isnan(raw)
    np.testing.assert_array_equal(got.get()[~nan], want[~nan])
    back = gpu.from_bf16_bits(got)
    assert type(back) is cupy.ndarray and back.dtype == np.float32
    assert np.all(np.isnan(back.get()[nan])), "a NaN did not stay NaN"
    np.testing.assert_array_equal(back.get()[:4], [np.inf, -np.inf, 0.0, -0.0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [59, 111, 64, 200])
def test_every_forward_configuration(cupy, monkeypatch, dtype, d):
    """Each configuration that fits, forced, through ring_attention (P=1) against float64."""
    from ringmpi.gpu import configs, tile

    cands = configs.forward_candidates(STORAGE[dtype], d, 232448)
    assert cands
    for kern in cands:
        monkeypatch.setenv(tile.CONFIG_ENV, kern.name)
        n0 = len(cupy.launches)
        gpucases.forward_case(cupy, self_comm(), dtype, "zigzag", True, d=d, n=150)
        ran = {e for e, *_ in cupy.launches[n0:]}
        assert ran == {kern.expr}, f"forced {kern.name}, ran {ran}"
        _, got_d, ld = standin_kernels.geometry[-1]
        # tensor cores: rows padded to 16 bytes (59 -> 64, 111 -> 112); CUDA cores: as is
        assert got_d == d and ld == (-(-d // 8) * 8 if kern.mma else d), (kern.name, d, ld)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [59, 111, 200])
@pytest.mark.parametrize("limit", [232448, 101376])
def test_backward_configurations(cupy, smem, dtype, d, limit):
    """Backward (dK/dV + dQ kernels chosen by shared memory) at P=1, odd and wide heads."""
    from ringmpi.gpu import backward, configs

    smem(limit)
    try:
        k_dkdv, k_dq = backward.chosen(STORAGE[dtype], d, 0)
    except configs.NoConfigError as exc:
        assert limit < 232448, exc  # only the small device may lack a configuration
        return
    assert k_dkdv.smem <= limit and k_dq.smem <= limit
    n0 = len(cupy.launches)
    gpucases.backward_case(cupy, self_comm(), dtype, "zigzag", True, d=d, n=130)
    ran = {e for e, *_ in cupy.launches[n0:]}
    assert {k_dkdv.expr, k_dq.expr} <= ran, ran


def test_padding_reaches_the_kernel_as_16_byte_rows(cupy):
    """D=59 fp16: the tensor-core kernel gets ld=64 with zero padding; fp32 keeps ld=59."""
    from ringmpi import gpu, softmax

    rng = np.random.default_rng(5)
    shapes = [(1, 2, 40, 59), (1, 1, 50, 59), (1, 1, 50, 59)]
    for dtype, want_ld in (("float16", 64), ("float32", 59)):
        q, k, v = (gpucases.to_device(cupy, x, dtype) for x in gpucases.data(rng, shapes))
        acc, m, l = softmax.init_state(q.shape, np.float32, cupy)
        pos_q, pos_k = np.arange(40, dtype=np.int64) + 10, np.arange(50, dtype=np.int64)
        n0 = len(cupy.launches)
        gpu.forward_tile(q, k, v, pos_q, pos_k, acc, m, l, scale=0.13, causal=True)
        assert len(cupy.launches) == n0 + 1
        assert ("mma" in cupy.launches[-1][0]) == (dtype == "float16")
        assert standin_kernels.geometry[-1][1:] == (59, want_ld)
        assert bool(cupy.isfinite(acc).all()) and float(l.min()) > 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_packed_kernel_keeps_the_state_in_natural_units(cupy, monkeypatch, dtype):
    """attn_fwd_mma2 takes the natural scale and stores m as attn_fwd_mma does (issue 39).

    The stand-in reads the scale's unit from the kernel's parameter name (``scale_log2``
    would be a base-2 kernel, whose m went back through m log2(e) ln 2 and moved lse by
    about an ulp): the packed and the unpacked tensor-core kernels must leave the
    same (acc, m, l) bits, and the packed kernel's m store has no base-2 conversion.
    """
    from ringmpi import gpu, softmax
    from ringmpi.gpu import configs, sources, tile

    rng = np.random.default_rng(39)
    shapes = [(1, 4, 70, 64), (1, 2, 90, 64), (1, 2, 90, 64)]
    q, k, v = (gpucases.to_device(cupy, x, dtype) for x in gpucases.data(rng, shapes))
    pos_q, pos_k = np.arange(70, dtype=np.int64) + 20, np.arange(90, dtype=np.int64)
    states = {}
    for kern in configs.forward_candidates(STORAGE[dtype], 64, 232448):
        monkeypatch.setenv(tile.CONFIG_ENV, kern.name)
        acc, m, l = softmax.init_state(q.shape, np.float32, cupy)
        gpu.forward_tile(q, k, v, pos_q, pos_k, acc, m, l, scale=0.125 * 1.1, causal=True)
        assert cupy.launches[-1][0] == kern.expr
        states[kern.name] = [x.get() for x in (acc, m, l)]
    assert {"m64n64", "m128n64"} <= set(states), list(states)
    for name, st in states.items():
        for what, a, b in zip("acc m l".split(), st, states["m64n64"]):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} {what} vs m64n64")
    names = [n for _, n in standin_kernels.signatures()["attn_fwd_mma2"][1]]
    assert names[names.index("causal") - 1] == "scale", names
    code = sources.source(sources.FORWARD_FILE)
    body = code[code.index("attn_fwd_mma2(") : code.index("attn_fwd_simt(")]
    stores = [ln for ln in body.splitlines() if "m_state[row_of" in ln and "] =" in ln]
    assert stores and not any("RING_LN2" in ln or "LOG2E" in ln for ln in stores), stores


def test_a_bad_launch_is_refused(cupy):
    """The stand-in's launch checks can fail: unpadded rows, missing shared-memory opt-in."""
    from tools.standin_kernels import LaunchError

    from ringmpi.gpu import configs, loader, tile

    kern = configs.select_forward("half_t", 59, 232448)
    fn = tile._function(kern, 0)
    q = cupy.zeros((1, 2, 40, 59), dtype=np.float16)  # rows not padded to ld = 64
    kv = cupy.zeros((1, 1, 50, 59), dtype=np.float16)
    acc, m, l = cupy.zeros((1, 2, 40, 59), dtype=np.float32), cupy.zeros((1, 2, 40)), None
    pos = cupy.asarray(np.arange(50, dtype=np.int64))
    args = (q, kv, kv, acc, m, l, pos[:40], pos, pos, np.uint64(0), np.uint64(0))
    args += tuple(np.int32(x) for x in (2, 1, 40, 50, 59, 64)) + (np.float32(1), np.int32(1))
    with pytest.raises(LaunchError):
        fn((1, 2, 1), (kern.threads,), args, shared_mem=kern.smem)
    raw = loader.get_function(tile.KERNEL_FILE, kern.expr, tile.kernel_names())
    if kern.smem > 48 * 1024:
        raw.max_dynamic_shared_size_bytes = 48 * 1024
        with pytest.raises(cupy.cuda.runtime.CUDARuntimeError, match="shared memory"):
            raw((1,), (kern.threads,), args, shared_mem=kern.smem)


def test_the_launch_limit_counts_static_shared_memory(cupy, smem, monkeypatch):
    """Dynamic shared memory fits the opt-in limit less the kernel's static (issue 39).

    attn_fwd_mma2 has 5,120 B of static shared memory (its per-row arrays): on a
    device whose limit holds its dynamic shared memory but not both, the stand-in
    refuses the opt-in as cuFuncSetAttribute does, and the choice skips it.
    """
    from ringmpi import gpu, softmax
    from ringmpi.gpu import configs, loader, tile

    kern = next(c for c in configs.forward_all("bf16_t", 64) if c.name == "m128n64")
    assert kern.static == 5120 and kern.smem > 48 * 1024
    smem(kern.smem + kern.static - 1)
    raw = loader.get_function(tile.KERNEL_FILE, kern.expr, tile.kernel_names())
    assert raw.shared_size_bytes == kern.static
    with pytest.raises(cupy.cuda.runtime.CUDARuntimeError, match="5120 B static"):
        raw.max_dynamic_shared_size_bytes = kern.smem
    assert kern not in configs.forward_candidates("bf16_t", 64, kern.smem + kern.static - 1)
    monkeypatch.setenv(tile.CONFIG_ENV, kern.name)
    with pytest.raises(configs.NoConfigError, match="m128n64"):
        tile.chosen("bf16_t", 64, True, 0)
    monkeypatch.delenv(tile.CONFIG_ENV)
    q, k, v = (cupy.zeros((1, 2, 40, 64), dtype=np.uint16) for _ in range(3))
    acc, m, l = softmax.init_state(q.shape, np.float32, cupy)
    pos = np.arange(40, dtype=np.int64)
    gpu.forward_tile(q, k, v, pos, pos, acc, m, l, scale=0.125, causal=True)
    assert cupy.launches[-1][0] != kern.expr  # another configuration ran
    smem(kern.total)  # exactly enough: the opt-in and the launch go through
    monkeypatch.setenv(tile.CONFIG_ENV, kern.name)
    gpu.forward_tile(q, k, v, pos, pos, acc, m, l, scale=0.125, causal=True)
    assert cupy.launches[-1][0] == kern.expr


def test_configuration_choice_follows_the_device(cupy, smem, monkeypatch):
    from ringmpi.gpu import configs, device, tile

    for limit in (232448, 166912, 101376):
        smem(limit)
        for st in ("half_t", "bf16_t", "float", "double"):
            for d in (59, 111, 128, 256):
                fits = configs.forward_candidates(st, d, limit)
                if not fits:
                    with pytest.raises(configs.NoConfigError):
                        tile.chosen(st, d, True, 0)
                    continue
                got = tile.chosen(st, d, True, 0)  # tuning off: the preferred one
                assert got == fits[0] and got.smem <= limit, (limit, st, d, got)
    smem(101376)
    too_big = [c for c in configs.forward_all("bf16_t", 64) if c.smem > 101376]
    for c in too_big:
        monkeypatch.setenv(tile.CONFIG_ENV, c.name)
        with pytest.raises(configs.NoConfigError, match="valid:"):
            tile.chosen("bf16_t", 64, False, 0)
    monkeypatch.delenv(tile.CONFIG_ENV, raising=False)
    smem(232448, major=7, minor=5)
    with pytest.raises(RuntimeError, match="8.0 or newer"):
        device.check_arch(0)


def test_autotune_times_once_and_caches(cupy, monkeypatch, tmp_path):
    from ringmpi.gpu import configs, tile, tune

    monkeypatch.setattr(tile, "TUNE_SHAPE", (1, 2, 1, 64))
    monkeypatch.setenv(tune.TUNE_ENV, "1")
    monkeypatch.setenv(tune.FILE_ENV, str(tmp_path / "tune.json"))
    tune.forget()
    cands = configs.forward_candidates("bf16_t", 64, 232448)
    assert len(cands) > 1
    n0 = len(cupy.launches)
    best = tile.chosen("bf16_t", 64, True, 0)
    timed = [e for e, *_ in cupy.launches[n0:]]
    assert {c.expr for c in cands} == set(timed) and len(timed) == 6 * len(cands)
    saved = json.loads((tmp_path / "tune.json").read_text())["choices"]
    key = tune.key(cupy.cuda.runtime.PROPS["name"].decode(), "bf16_t", 64, True)
    assert saved[key]["config"] == best.name and set(saved[key]["ms"]) == {c.name for c in cands}
    n1 = len(cupy.launches)
    assert tile.chosen("bf16_t", 64, True, 0) == best and len(cupy.launches) == n1  # in memory
    tune.forget()
    assert tile.chosen("bf16_t", 64, True, 0) == best and len(cupy.launches) == n1  # the file
    tile.chosen("bf16_t", 64, False, 0)  # another shape class: timed anew
    assert len(cupy.launches) == n1 + 6 * len(cands)
    (tmp_path / "tune.json").write_text("{not json")
    tune.forget()
    tile.chosen("bf16_t", 64, True, 0)  # a broken file: timed again, rewritten
    assert len(cupy.launches) == n1 + 12 * len(cands)
    assert key in json.loads((tmp_path / "tune.json").read_text())["choices"]
    tune.forget()


def test_bench_table_survives_a_failing_row(cupy, monkeypatch, tmp_path, capsys):
    from ringmpi.gpu import bench

    real = bench.bench_case

    def flaky(dtype, d, n, causal, *a, **kw):
        if dtype == "float16" and d == 128 and causal and kw.get("direction") == "bwd":
            raise RuntimeError("injected failure")
        return real(dtype, d, n, causal, *a, **kw)

    monkeypatch.setattr(bench, "bench_case", flaky)
    out = tmp_path / "bench.json"
    rc = bench.main(["--n", "64", "--heads", "2", "--min-time", "0", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 1 and "FAILED: RuntimeError: injected failure" in text
    saved = json.loads(out.read_text())
    assert saved["complete"] is True and saved["failed"] == 1
    rows = saved["rows"]
    assert len(rows) == len(bench.cases(False, (64,)))
    bad = [r for r in rows if "error" in r]
    assert len(bad) == 1 and bad[0]["pass"] == "bwd", bad
    assert all(r["tflops"] > 0 for r in rows if "error" not in r)
    assert rows[-1]["pass"] == "bwd" and rows[-1]["dtype"] == "float64"  # the table went on


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_values_long_rows_python_side(cupy, monkeypatch, dtype):
    """Issue 20's cases (tests/tools/realcases.py) on the stand-in: 16 rows x 65,536 keys.

    Realistic values (means, small spreads, sinks) through every forward configuration's
    launch (plan, padding, bf16 bits, carried state over 3 calls) against float64. The
    arithmetic here is the numpy tile's, NOT the CUDA kernels': tests/gpu/test_tile_device.py
    runs the same cases on a device, where the kernels' float32 sums are what is tested.
    """
    from tools import realcases

    from ringmpi.gpu import configs, tile

    cands = configs.forward_candidates(STORAGE[dtype], 64, 232448)
    for kern in cands:
        monkeypatch.setenv(tile.CONFIG_ENV, kern.name)
        n0 = len(cupy.launches)
        for steps in (1, 3):
            realcases.forward_long(cupy, dtype, 64, steps=steps, seed=7)
        ran = {e for e, *_ in cupy.launches[n0:]}
        assert ran == {kern.expr}, f"forced {kern.name}, ran {ran}"
        assert len(cupy.launches) - n0 == 4, "one launch per tile call"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(16, 65536), (65536, 64)], ids=["long rows", "long columns"])
def test_real_values_backward_long_python_side(cupy, dtype, shape):
    """The backward cases of realcases on the stand-in (numpy arithmetic, not CUDA)."""
    from tools import realcases

    n0 = len(cupy.launches)
    realcases.backward_long(cupy, dtype, 64, *shape, seed=8)
    ran = sorted(e.split("<")[0] for e, *_ in cupy.launches[n0:])
    assert ran == ["attn_bwd_dkdv_" + ran[0].split("_")[-1], "attn_bwd_dq_" + ran[0].split("_")[-1]]


def test_realcases_rule_can_fail(cupy, monkeypatch):
    """The realcases tolerance is not vacuous: a row-long float32 chain breaks it.

    The stand-in's CUDA-core forward is swapped for one that adds P V key by key into one
    float32 total per output element (the pattern issue 20 removed from the kernels).
    """
    from tools import realcases

    def chained(expr, grid, block, args, smem):
        q, k, v, acc, m, l, qp, kp = (x._a for x in args[:8])
        scale = np.float32(float(args[-5]))  # before causal and the 3 modifier arguments
        assert scale > 0
        s = np.einsum("hqd,kd->hqk", q[0], k[0, 0], dtype=np.float32) * scale
        s[:, kp[None, :] > qp[:, None]] = -np.inf  # causal
        mx = s.max(-1, keepdims=True)
        p = np.exp(s - mx, dtype=np.float32)
        o = np.zeros(acc.shape[1:], np.float32)
        for j in range(k.shape[2]):
            o += p[:, :, j : j + 1] * v[0, 0, j]
        acc[0], m[0], l[0] = o, mx[..., 0], p.sum(-1, dtype=np.float64)

    static = cupy._kernel._IMPLS["attn_fwd_simt"][1]  # (impl, static shared memory)
    monkeypatch.setitem(cupy._kernel._IMPLS, "attn_fwd_simt", (chained, static))
    standin.clear_caches()
    try:
        with pytest.raises(AssertionError, match="out: max err"):
            realcases.forward_long(cupy, "float32", 32, rows=8, keys=65536, seed=24)
    finally:
        monkeypatch.undo()
        standin.clear_caches()


def test_realcases_backward_rule_can_fail(cupy, monkeypatch):
    """The backward rule catches dV summed row by row into one float32 total (2 x 65,536)."""
    from tools import realcases

    numpy_kernel = standin_kernels._backward

    def chained(expr, grid, block, args, smem):
        numpy_kernel(expr, grid, block, args, smem)
        if "_dkdv_" in expr:
            q, k, _, do, lse, _, _, dv = (x._a for x in args[:8])
            s = np.einsum("hqd,kd->hqk", q[0], k[0, 0], dtype=np.float32)
            scale = np.float32(float(args[-5]))  # before causal and the 3 modifier arguments
            assert scale > 0
            p = np.exp(s * scale - lse[0][..., None])
            o = np.zeros(dv.shape[2:], np.float32)
            for i in range(q.shape[2]):  # every query row of both heads, in order
                for h in range(q.shape[1]):
                    o += p[h, i][:, None] * do[0, h, i]
            dv[0, 0] = o

    static = cupy._kernel._IMPLS["attn_bwd_dkdv_simt"][1]  # (impl, static shared memory)
    monkeypatch.setitem(cupy._kernel._IMPLS, "attn_bwd_dkdv_simt", (chained, static))
    standin.clear_caches()
    try:
        with pytest.raises(AssertionError, match="dv: max err"):
            realcases.backward_long(cupy, "float32", 64, 65536, 64, seed=8)
    finally:
        monkeypatch.undo()
        standin.clear_caches()
