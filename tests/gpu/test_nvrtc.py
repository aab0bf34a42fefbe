"""GPU code checked without a GPU: NVRTC compiles every kernel, and the host-side logic.

NVRTC comes from the ``test`` extra (nvidia-cuda-nvrtc-cu12). If it cannot be
loaded the compile tests FAIL: a missing compiler must not pass CI silently.
``RINGMPI_SKIP_NVRTC=1`` skips them deliberately (for machines that cannot
install it). The other tests here (configuration choice for a device's shared
memory, bfloat16 rounding, bfloat16 finiteness checks) need neither.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from ringmpi import arguments
from ringmpi.gpu import backward, configs, kernel_args, nvcc, nvrtc
from ringmpi.gpu import tile as gpu

SKIP_NVRTC = os.environ.get("RINGMPI_SKIP_NVRTC") == "1"
needs_nvrtc = pytest.mark.skipif(SKIP_NVRTC, reason="RINGMPI_SKIP_NVRTC=1: NVRTC check skipped")
# sharedMemPerBlockOptin of real devices: sm_86/89/120 (A10, L4, L40S, RTX), sm_80/87, sm_90
LIMITS = {"sm_86": 101_376, "sm_80": 166_912, "sm_90": 232_448}


def _archs(config) -> tuple:
    """The archs the NVRTC checks compile for: ``--nvrtc-archs`` (tests/conftest.py)."""
    opt = config.getoption("nvrtc_archs")
    return nvrtc.ARCHS if opt == "all" else tuple(a for a in opt.split(",") if a)


def pytest_generate_tests(metafunc):
    # each NVRTC check once per compiled arch
    if "arch" in metafunc.fixturenames and "results" in metafunc.fixturenames:
        metafunc.parametrize("arch", _archs(metafunc.config))


@pytest.fixture(scope="module")
def results(request):
    try:
        return nvrtc.check(_archs(request.config))
    except nvrtc.NvrtcError as exc:  # fail, not skip
        pytest.fail(str(exc))


# the module's NVRTC compile of every kernel (the fixture, timed with its first user) takes
# 2-5 minutes on two busy cores: more than the suite's 300 s per-test limit
@needs_nvrtc
@pytest.mark.timeout(1800)
def test_every_instantiation_compiles(results, arch):
    res = results[arch]
    assert res.ok, f"NVRTC compile for {arch} failed:\n{res.log}"
    names = gpu.kernel_names() + backward.kernel_names()
    assert set(names) == {n for ns in nvrtc.sources().values() for n in ns}
    missing = [n for n in names if n not in res.lowered]
    assert not missing, f"{arch}: instantiations not lowered: {missing}"
    assert res.binary_size > 0
    assert len(gpu.kernel_names()) >= 16 and len(backward.kernel_names()) >= 16
    for kind in (
        "attn_fwd_mma<",
        "attn_fwd_mma2<",
        "attn_fwd_simt<",
        "attn_bwd_dkdv_mma<",
        "attn_bwd_dq_mma<",
        "attn_bwd_dkdv_simt<",
        "attn_bwd_dq_simt<",
    ):
        assert any(n.startswith(kind) for n in res.lowered), f"{arch}: no {kind} compiled"


@needs_nvrtc
@pytest.mark.timeout(1800)
def test_no_register_spills(results, arch):
    res = results[arch]
    assert res.ok, res.log
    for expr, mangled in res.lowered.items():
        r = res.resources.get(mangled)
        assert r is not None, f"{arch}: no ptxas report for {expr}"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{arch} {expr} spills: {r}"


@needs_nvrtc
@pytest.mark.timeout(1800)
def test_static_shared_memory_is_what_ptxas_reports(results, arch):
    """Each configuration's static shared memory equals ptxas's (issue 39).

    The choice by shared memory (configs.fits: dynamic + static within the device's
    opt-in limit) and the CuPy stand-in's launch checks use these numbers.
    """
    res = results[arch]
    assert res.ok, res.log
    byexpr = {}
    for storage in configs.STORAGES:
        for d in range(1, configs.MAX_D + 1):
            for c in configs.forward_all(storage, d):
                byexpr[c.expr] = c
            for lst in configs.backward_all(storage, d):
                byexpr.update((c.expr, c) for c in lst)
    assert set(byexpr) == set(res.lowered)
    wrong = {}
    for expr, c in byexpr.items():
        got = res.resources[res.lowered[expr]].get("smem")
        if got != c.static:
            wrong[expr] = (c.static, got)
    assert not wrong, f"{arch}: (configs' static, ptxas smem): {wrong}"


@pytest.mark.parametrize("arch", list(LIMITS))
def test_every_selection_fits_with_its_static_shared_memory(arch):
    limit = LIMITS[arch]
    for storage in configs.STORAGES:
        for d in range(1, configs.MAX_D + 1):
            assert configs.select_forward(storage, d, limit).total <= limit
            try:
                chosen = configs.select_backward(storage, d, limit)
            except configs.NoConfigError:
                continue
            assert all(c.total <= limit for c in chosen)
    assert configs.fits(configs.Config("x", "x", 1, 1, 1, 100, False, static=20), 120)
    assert not configs.fits(configs.Config("x", "x", 1, 1, 1, 100, False, static=21), 120)


@needs_nvrtc
def test_compile_error_is_reported():
    res = nvrtc.compile_source("__global__ void f() { undefined_thing(); }", (), "sm_80")
    assert not res.ok and "undefined_thing" in res.log


@needs_nvrtc
@pytest.mark.timeout(1800)
def test_nvrtc_gives_no_warning(results, arch):
    res = results[arch]
    assert res.ok, res.log
    warnings = [ln for ln in res.log.splitlines() if "warning" in ln.lower()]
    assert not warnings, f"{arch}: NVRTC warnings:\n" + "\n".join(warnings[:20])


# nvcc (the CUDA toolkit's compiler), where one is installed: the same module texts with
# every instantiation, -arch=sm_90 -ptx, warnings as errors (ringmpi/gpu/nvcc.py): its front
# end and NVVM; ptxas runs in the NVRTC check above
needs_nvcc = pytest.mark.skipif(nvcc.find_nvcc() is None, reason="no nvcc: nvcc check skipped")


@needs_nvcc
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("module", list(nvrtc.sources()), ids=str)
def test_nvcc_compiles_every_kernel_without_warnings(module):
    names = nvrtc.sources()[module]
    ok, log = nvcc.compile_module(module, names, "sm_90", nvcc.find_nvcc(), timeout=3000)
    assert ok, f"nvcc -arch=sm_90 -ptx {module}:\n{log}"


@needs_nvcc
@pytest.mark.timeout(600)
def test_nvcc_check_reports_a_warning(tmp_path, monkeypatch):
    """The nvcc check is not vacuous: a kernel with an unused variable fails it."""
    (tmp_path / "attention_common.cuh").write_text("// empty\n")
    (tmp_path / "w.cu").write_text(
        '#include "attention_common.cuh"\n'
        "template <int N> __global__ void k(int* p) { int unused = N; p[0] = 1; }\n"
    )
    monkeypatch.setenv("RINGMPI_KERNEL_DIR", str(tmp_path))
    ok, log = nvcc.compile_module("w.cu", ("k<1>",), "sm_90", nvcc.find_nvcc())
    assert not ok and "unused" in log, log


# ---------------------------------------------------------------------------
# configuration choice for the device's shared memory (no GPU needed)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(LIMITS))
def test_selection_fits_the_device(arch):
    limit = LIMITS[arch]
    names = set(gpu.kernel_names())
    for storage in configs.STORAGES:
        for d in range(1, configs.MAX_D + 1):
            kern = configs.select_forward(storage, d, limit)
            assert kern.expr in names, kern
            assert kern.smem <= limit, f"{arch} {storage} D={d}: {kern}"
            for c in configs.forward_candidates(storage, d, limit):
                assert c.smem <= limit and c.expr in names
    with pytest.raises(ValueError):
        configs.select_forward("float", configs.MAX_D + 1, limit)


def test_selection_uses_the_largest_tiles_that_fit():
    # the configurations the review found over sm_86's 101,376 B get smaller tiles there
    for storage, d, big in [
        ("float", 128, 115_712),
        ("double", 128, 107_520),
        ("float", 256, 102_912),
        ("half_t", 200, 102_912),
        ("bf16_t", 256, 102_912),
    ]:
        assert configs.select_forward(storage, d, LIMITS["sm_80"]).smem == big
        small = configs.select_forward(storage, d, LIMITS["sm_86"])
        assert small.smem < LIMITS["sm_86"] < big
    # fp64 D = 256 needs 100,864 B (+ 16 B static): it fits sm_86 (just), not a 64 KiB device
    assert configs.select_forward("double", 256, LIMITS["sm_86"]).smem == 100_864
    with pytest.raises(configs.NoConfigError, match="smallest needs 100880 B"):
        configs.select_forward("double", 256, 65_536)
    # lower limits pick smaller tiles, never an oversized one
    for limit in (65_536, 80_000):
        for d in (64, 128, 256):
            assert configs.select_forward("float", d, limit).smem <= limit


@pytest.mark.parametrize("arch", list(LIMITS))
def test_backward_selection_fits_the_device(arch):
    limit = LIMITS[arch]
    names = set(backward.kernel_names())
    for storage in configs.STORAGES:
        for d in range(1, configs.MAX_D + 1):
            if arch == "sm_86" and storage == "double" and d > 128:
                with pytest.raises(configs.NoConfigError, match="dK/dV configuration fits"):
                    configs.select_backward(storage, d, limit)
                continue
            dkdv, dq = configs.select_backward(storage, d, limit)
            for c in (dkdv, dq):
                assert c.expr in names and c.smem <= limit, f"{arch} {storage} D={d}: {c}"
            assert dkdv.mma == dq.mma == (storage in ("half_t", "bf16_t") and d <= 128)
    # 99 KB devices get the 32-key dQ blocks at D = 128, the others the 64-key ones
    assert configs.select_backward("half_t", 128, LIMITS["sm_86"])[1].bn == 32
    assert configs.select_backward("half_t", 128, LIMITS["sm_80"])[1].bn == 64
    assert configs.select_backward("float", 256, LIMITS["sm_86"])[0].bm == 16
    assert configs.select_backward("float", 256, LIMITS["sm_90"])[0].bm == 32


def test_forced_configuration():
    smallest = configs.forward_all("float", 128)[-1]
    assert configs.select_forward("float", 128, LIMITS["sm_90"], smallest.name) == smallest
    with pytest.raises(configs.NoConfigError, match="valid: simt64x64"):
        configs.select_forward("float", 128, LIMITS["sm_90"], "nonsense")
    # a forced configuration that does not fit the device is refused, not launched
    big = configs.forward_all("float", 128)[0].name
    with pytest.raises(configs.NoConfigError, match=big):
        configs.select_forward("float", 128, LIMITS["sm_86"], big)


# ---------------------------------------------------------------------------
# bfloat16 bits (numpy path; tests/gpu/test_tile_device.py checks the CuPy path against it)
# ---------------------------------------------------------------------------
def bf16_reference(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 bits by comparing distances in float64 (ties to even)."""
    u = x.astype(np.float32).view(np.uint32)
    with np.errstate(invalid="ignore"):
        return _bf16_reference(u)


def _bf16_reference(u: np.ndarray) -> np.ndarray:
    sign = (u >> 16) & 0x8000
    mag = (u & 0x7FFFFFFF).view(np.float32).astype(np.float64)
    lo = ((u & 0x7FFFFFFF) >> 16).astype(np.uint32)  # truncated magnitude bits
    v_lo = (lo << 16).view(np.float32).astype(np.float64)
    hi = lo + 1
    # the value above the largest finite bfloat16 counts as 2**128 (it rounds to inf)
    v_hi = np.where(hi == 0x7F80, 2.0**128, (hi << 16).view(np.float32).astype(np.float64))
    up = (mag - v_lo > v_hi - mag) | ((mag - v_lo == v_hi - mag) & (lo % 2 == 1))
    bits = np.where(up, hi, lo)
    bits = np.where(np.isinf(mag), 0x7F80, bits)
    bits = np.where(np.isnan(mag), 0x7FC0 | (lo & 0x3F), bits)  # any quiet NaN
    return (bits | sign).astype(np.uint16)


def is_nan_bits(b: np.ndarray) -> np.ndarray:
    return ((b & 0x7F80) == 0x7F80) & ((b & 0x7F) != 0)


def test_bf16_rounding_matches_reference():
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    special = np.array(
        [
            0,
            0x80000000,
            0x00000001,
            0x007FFFFF,
            0x00800000,
            0x3F808000,
            0x3F818000,
            0x3F80FFFF,
            0x7F7F7FFF,
            0x7F7F8000,
            0x7F7FFFFF,
            0x7F800000,
            0xFF800000,
            0x7F800001,
            0x7FFFFFFF,
            0xFF800001,
            0xFFFFFFFF,
            0x7FC00000,
            0x000116C2,
        ],
        dtype=np.uint32,
    )
    x = np.concatenate((raw, special)).view(np.float32)
    got, want = gpu.to_bf16_bits(x), bf16_reference(x)
    nan = np.isnan(x)
    assert np.all(is_nan_bits(got[nan])), "a NaN did not stay NaN"
    assert np.array_equal(got[nan] & 0x8000, want[nan] & 0x8000), "NaN sign lost"
    bad = np.flatnonzero(got[~nan] != want[~nan])
    assert bad.size == 0, f"{bad.size} mismatches, e.g. {x[~nan][bad[:3]]}"
    # half an ulp of bfloat16 at the value's magnitude bounds the error (subnormals too)
    fin = np.isfinite(x) & (np.abs(x) < 3.3e38)
    back = kernel_args.from_bf16_bits(got[fin]).astype(np.float64)
    e = np.floor(np.log2(np.maximum(np.abs(x[fin]).astype(np.float64), 2.0**-126)))
    assert np.all(np.abs(back - x[fin]) <= 2.0 ** (e - 8))


def test_bf16_nan_payloads_and_inf():
    x = np.array(
        [0x7F800001, 0x7F80FFFF, 0xFFFFFFFF, 0x7FBFFFFF, 0x7F800000, 0xFF800000], dtype=np.uint32
    ).view(np.float32)
    b = gpu.to_bf16_bits(x)
    assert np.all(is_nan_bits(b[:4])) and np.all(np.isnan(kernel_args.from_bf16_bits(b[:4])))
    assert list(kernel_args.from_bf16_bits(b[4:])) == [np.inf, -np.inf]


def test_check_finite_sees_bf16_bits():
    ok = gpu.to_bf16_bits(np.array([1.0, -3e38, 1e-40, 0.0], dtype=np.float32))
    assert arguments._nonfinite(np, {"q": ok}) is None
    for bad in (np.inf, -np.inf, np.nan):
        b = gpu.to_bf16_bits(np.array([1.0, bad], dtype=np.float32))
        assert "q contains NaN or Inf" in arguments._nonfinite(np, {"q": b})
    assert arguments._nonfinite(np, {"q": np.array([1.0, np.nan])}) is not None


# ---------------------------------------------------------------------------
# the autotune cache (the launch plan is tested in tests/gpu/test_plan.py)
# ---------------------------------------------------------------------------
def test_autotune_times_once_and_caches(tmp_path, monkeypatch):
    from ringmpi.gpu import tune

    monkeypatch.setenv(tune.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(tune.FILE_ENV, raising=False)
    monkeypatch.delenv(tune.TUNE_ENV, raising=False)
    tune.forget()
    calls = []

    def measure(name):
        calls.append(name)
        if name == "broken":
            raise RuntimeError("launch failed")
        return {"a": 3.0, "b": 1.0, "c": 2.0}[name]

    k = tune.key("NVIDIA H200", "bf16_t", 128, True)
    assert tune.choose(k, ["a", "b", "c", "broken"], measure) == "b"
    assert sorted(calls) == ["a", "b", "broken", "c"]
    assert tune.choose(k, ["a", "b", "c"], measure) == "b" and len(calls) == 4  # memory
    tune.forget()
    assert tune.choose(k, ["a", "b", "c"], measure) == "b" and len(calls) == 4  # file
    data = (tmp_path / tune.FILE_NAME).read_text()
    assert '"config": "b"' in data and "launch failed" in data
    # a cached choice that is no longer a candidate is timed again
    assert tune.choose(k, ["a", "c"], measure) == "c" and len(calls) == 6
    # a single candidate is never timed; tuning off gives the preferred one
    assert tune.choose(tune.key("x", "float", 64, False), ["z"], measure) == "z"
    monkeypatch.setenv(tune.TUNE_ENV, "0")
    assert tune.choose(tune.key("y", "float", 64, False), ["c", "a"], measure) == "c"
    assert len(calls) == 6
    monkeypatch.setenv(tune.TUNE_ENV, "yes")
    with pytest.raises(ValueError, match="RINGMPI_GPU_TUNE"):
        tune.choose(tune.key("w", "float", 64, False), ["c", "a"], measure)
    monkeypatch.setenv(tune.TUNE_ENV, "1")
    with pytest.raises(RuntimeError, match="no configuration ran"):
        tune.choose(tune.key("v", "float", 64, False), ["broken", "broken"], measure)
    tune.forget()


def test_autotune_survives_a_bad_cache_file(tmp_path, monkeypatch):
    from ringmpi.gpu import tune

    monkeypatch.setenv(tune.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(tune.FILE_ENV, raising=False)
    (tmp_path / tune.FILE_NAME).write_text("{not json")
    tune.forget()
    assert tune.choose("k", ["a", "b"], lambda n: {"a": 2.0, "b": 1.0}[n]) == "b"
    tune.forget()
    assert tune.cached("k", ["a", "b"]) == "b"
    tune.forget()


@needs_nvrtc
def test_kernel_cache_compiles_once(tmp_path, monkeypatch):
    """loader: each instantiation is compiled by NVRTC once and found in the cache after."""
    from ringmpi.gpu import loader

    monkeypatch.setenv("RINGMPI_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(loader, "_arch", lambda dev: "sm_80")  # no device here
    exprs = ("attn_fwd_simt<float, float, 64, 32, 32>", "attn_fwd_mma<bf16_t, 64>")
    assert loader.precompile(gpu.KERNEL_FILE, exprs, 0, workers=2) == dict.fromkeys(
        exprs, "compiled"
    )
    assert loader.precompile(gpu.KERNEL_FILE, exprs, 0) == dict.fromkeys(exprs, "cache")
    code = loader.source(gpu.KERNEL_FILE)
    cubin, mangled = loader._lookup(code, exprs[1], "sm_80")
    assert cubin.read_bytes()[:4] == b"\x7fELF" and mangled.startswith("_Z12attn_fwd_mma")
    assert loader._lookup(code, exprs[1], "sm_90") is None  # the arch is part of the key
    assert loader._lookup(code + "\n", exprs[1], "sm_80") is None  # and the source
    bad = loader.precompile(gpu.KERNEL_FILE, ("attn_fwd_mma<float, 64>",), 0)
    assert "could not compile" in bad["attn_fwd_mma<float, 64>"]


@needs_nvrtc
def test_builtins_load_from_the_directory_of_libnvrtc(tmp_path):
    """libnvrtc has no RUNPATH: its builtins are loaded from its own directory first."""
    import glob

    lib = nvrtc.find_library()
    folder = os.path.dirname(os.path.realpath(lib))
    beside = [
        p for p in glob.glob(os.path.join(folder, "libnvrtc-builtins.so*")) if ".alt." not in p
    ]
    nvrtc.version()  # loads libnvrtc (and the builtins)
    if not beside:  # a system CUDA: the loader's own search path finds them
        assert nvrtc.BUILTINS is None
    else:
        assert nvrtc.BUILTINS in beside, (nvrtc.BUILTINS, beside)
        with open("/proc/self/maps") as f:
            mapped = {ln.split()[-1] for ln in f if "libnvrtc-builtins" in ln}
        assert os.path.realpath(nvrtc.BUILTINS) in {os.path.realpath(p) for p in mapped}
    # a directory without builtins: nothing is loaded from elsewhere
    alone = tmp_path / "libnvrtc.so.13"
    alone.write_bytes(b"")
    assert nvrtc.preload_builtins(str(alone)) is None
    (tmp_path / "libnvrtc-builtins.so.13.0").write_bytes(b"not an ELF file")
    assert nvrtc.preload_builtins(str(alone)) is None  # unloadable: skipped, no error
