"""The reproducible mode's C kernel against its numpy oracle: the same bits on every ISA path.

Single rank (COMM_SELF); the P-independence is tests/test_reproducible_mpi.py's. Each case
hashes out and lse of ``ring_attention(..., reproducible=True)`` run by the numpy code
(``RINGMPI_CPU_KERNEL=numpy``) and by the kernel built for every ISA path this host runs
(AVX-512, AVX2, scalar where available), on values shaped like real data, and checks
the result against the dense float64 reference (the rule of
:func:`ringmpi.testing.assert_close`).
"""

import numpy as np
import pytest
from mpi4py import MPI
from tools.modcases import MODS
from tools.reprokernels import by_every_path, flags_keep_the_bits, isa_objects
from tools.slicecases import builder_cases, dense_of, random_slices

import ringmpi
from ringmpi import reproducible
from ringmpi.cpu import fused_reproducible
from ringmpi.cpu.isa import host_isas
from ringmpi.reference import attention
from ringmpi.testing import assert_close, dense, random_qkv

SELF = MPI.COMM_SELF
CU = (0, 40, 41, 170, 283)
MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "window": dict(window=(37, 5)),
    "packed causal window": dict(cu_seqlens=np.array(CU), causal=True, window=(20, -1)),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mask", list(MASKS))
def test_kernel_on_every_isa_gives_the_numpy_bits(dtype, mask, monkeypatch):
    """N = 283 (4 key blocks, the last partial), D = 24, Dv = 40 (a 16-column tail)."""
    rng = np.random.default_rng(7)
    q, k, _ = random_qkv(rng, 283, 4, 2, 24, dtype=dtype, realistic=True)
    v = (0.5 + 0.1 * rng.standard_normal((283, 2, 40))).astype(dtype)
    kw = MASKS[mask]
    got = by_every_path(q, k, v, kw, monkeypatch)
    ref = attention(q, k, v, **kw)
    peer = dense(q, k, v, **kw) if dtype == np.float32 else (None, None)
    out, lse = got[host_isas()[0]]
    assert_close(SELF, out, ref[0], peer[0], f"{mask} out")
    assert_close(SELF, lse, ref[1], peer[1], f"{mask} lse")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_slices_give_the_numpy_bits_on_every_isa(dtype, monkeypatch):
    """Masks of slices (rows with several disjoint key ranges, rows with none): the kernel's
    visibility over every range of a row gives the numpy code's bits, exact against the
    explicit mask."""
    n = 283
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    cases = [
        (name, s, rule(i, j))
        for name, s, rule in builder_cases(n)
        if name in ("global_local", "block_sparse causal")
    ]
    raw = random_slices(np.random.default_rng(2), n, n, 7)
    cases.append(("random 7 slices", ringmpi.Slices(raw), dense_of(raw, n, n)))
    for c, (name, s, mask) in enumerate(cases):
        rng = np.random.default_rng(60 + c)
        q, k, v = random_qkv(rng, n, 4, 2, 24, dtype=dtype, realistic=True)
        got = by_every_path(q, k, v, dict(slices=s), monkeypatch)
        ref = attention(q, k, v, mask=mask)
        peer = dense(q, k, v, mask=mask) if dtype == np.float32 else (None, None)
        out, lse = got[host_isas()[0]]
        assert_close(SELF, out, ref[0], peer[0], f"{name} out")
        assert_close(SELF, lse, ref[1], peer[1], f"{name} lse")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mod", list(MODS))
def test_modifiers_give_the_numpy_bits_on_every_isa(dtype, causal, mod, monkeypatch):
    """Softcap, ALiBi and sinks (issue 40): numpy and every ISA path agree bit for bit, and
    the result is at least as close to the float64 reference as the default mode's.

    N = 283, GQA (4 query heads on 2 kv heads), real-shaped values. ALiBi on a packed
    causal mask too (its positions restart per sequence), where the case is causal.
    """
    rng = np.random.default_rng(17)
    q, k, v = random_qkv(rng, 283, 4, 2, 24, dtype=dtype, realistic=True)
    kw = dict(MODS[mod], causal=causal)
    if causal and mod == "alibi":
        kw["cu_seqlens"] = np.array(CU)
    got = by_every_path(q, k, v, kw, monkeypatch)
    ref = attention(q, k, v, **kw)
    peer = dense(q, k, v, **kw) if dtype == np.float32 else (None, None)
    out, lse = got["numpy"]
    assert_close(SELF, out, ref[0], peer[0], f"{mod} out")
    assert_close(SELF, lse, ref[1], peer[1], f"{mod} lse")
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "auto")
    default = ringmpi.ring_attention(q, k, v, SELF, return_lse=True, **kw)
    for name, mine, theirs, r in zip(("out", "lse"), (out, lse), default, ref):
        err, err_default = (float(np.abs(x.astype(np.float64) - r).max()) for x in (mine, theirs))
        # the result dtype's rounding; float64: both modes are a few units in the last place
        # off, and which is closer is noise
        ulp = float(np.spacing(np.abs(r).max().astype(dtype))) * (8 if dtype == np.float64 else 1)
        assert err <= max(err_default, ulp), f"{mod} {name}: {err:.3g} > default {err_default:.3g}"


def test_det_tanh_accuracy_and_edges():
    """det_tanh within 6 units in the last place of np.tanh (itself within about 1), small
    arguments included (where 1 - e^(-2x) would lose them); signed zeros, NaN, saturation."""
    rng = np.random.default_rng(0)
    tiny = np.exp(rng.uniform(-700, 3, 20000)) * rng.choice([-1, 1], 20000)
    x = np.concatenate([np.linspace(-25, 25, 200001), tiny])
    got, want = reproducible.det_tanh(x), np.tanh(x)
    assert np.max(np.abs(got - want) / np.spacing(np.abs(want))) <= 6
    edge = reproducible.det_tanh(np.array([0.0, -0.0, 40.0, -1e300, np.inf, np.nan]))
    assert edge[0] == 0 and not np.signbit(edge[0]) and np.signbit(edge[1])
    assert edge[2] == 1.0 and edge[3] == -1.0 and edge[4] == 1.0 and np.isnan(edge[5])


def test_every_isa_path_compiles(tmp_path):
    """The AVX-512, AVX2 and scalar paths of the kernel compile with the kernel's flags, also
    the ones this host cannot run (compiled here, not run: the bits of a path are checked
    only where the host runs it, in the tests above)."""
    assert set(isa_objects("cpu_reproducible.c", tmp_path)) == {"avx512", "avx2", "scalar"}


def test_batch_and_longer_rows_match_the_numpy_code(monkeypatch):
    """A batch of 2, 700 keys (11 blocks), D = 64 = Dv: full register tiles and panels."""
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 700, 4, 1, 64, batch=2, realistic=True)
    got = by_every_path(q, k, v, dict(causal=True), monkeypatch)
    ref = attention(q, k, v, True)
    assert_close(SELF, got[host_isas()[0]][0], ref[0], dense(q, k, v, True)[0], "batch out")


def test_compiler_flags_from_the_environment_do_not_change_the_bits(monkeypatch, tmp_path):
    """$RINGMPI_CFLAGS with -ffast-math and FMA contraction: the kernel's own flags win
    (softcap's tanh and ALiBi's products included)."""
    q, k, v = random_qkv(np.random.default_rng(2), 150, 2, 1, 16, realistic=True)
    kw = dict(causal=True, softcap=2.0, alibi_slopes=[0.25, 0.0625])
    flags_keep_the_bits(
        fused_reproducible, fused_reproducible.ReproKernel, q, k, v, kw, monkeypatch, tmp_path
    )


def test_det_exp_accuracy_and_edges():
    t = -np.concatenate(
        [np.linspace(0, 345, 200001), np.abs(np.random.default_rng(0).normal(size=1000))]
    )
    got, want = reproducible.det_exp(t), np.exp(t)
    assert np.max(np.abs(got - want) / want) < 5e-16
    edge = reproducible.det_exp(np.array([0.0, -0.0, -345.0, -345.5, -1e300, -np.inf, np.nan]))
    assert edge[0] == 1.0 and edge[1] == 1.0 and edge[2] > 0
    assert edge[3] == 0.0 and edge[4] == 0.0 and edge[5] == 0.0 and np.isnan(edge[6])


def test_folds_follow_the_dtype_and_the_key_count():
    assert reproducible.folds(16384, np.float32) == 2
    assert reproducible.folds(1 << 25, np.float32) == 3
    assert reproducible.folds(8192, np.float64) == 2
    assert reproducible.folds(16384, np.float64) == 3
    assert reproducible.folds(1 << 24, np.float64) == 4


def test_kernel_refuses_keys_off_the_block_grid():
    kern = fused_reproducible.load(host_isas()[-1])
    q = np.zeros((1, 1, 4, 8))
    kt = kern.pad_keys(np.zeros((1, 1, 10, 8)))
    pos = np.arange(3, 13, dtype=np.int64)  # does not start a key block
    bounds = np.zeros(4, dtype=np.int64), np.full(4, 20, dtype=np.int64)
    with pytest.raises(ValueError, match="refused"):
        kern.block(q, kt, None, pos, *bounds, 1.0, np.full((1, 1, 4), -np.inf), sk=10)


_HASH_SCRIPT = """
import hashlib, os, numpy as np
from mpi4py import MPI
import ringmpi
from ringmpi.testing import random_qkv
q, k, v = random_qkv(np.random.default_rng(4), 200, 2, 1, 16, realistic=True)
q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
h = []
for kernel in ("numpy", "fused"):
    os.environ["RINGMPI_CPU_KERNEL"] = kernel
    out, lse = ringmpi.ring_attention(q, k, v, MPI.COMM_SELF, causal=True, return_lse=True,
                                      reproducible=True, softcap=4.0, alibi_slopes=[0.5, 0.25],
                                      sinks=[1.0, 9.0])
    o32, l32 = ringmpi.ring_attention(q32, k32, v32, MPI.COMM_SELF, causal=True,
                                      return_lse=True, reproducible=True, sinks=[1.0, 9.0])
    raw = b"".join(x.tobytes() for x in (out, lse, o32, l32))
    h.append(hashlib.sha256(raw).hexdigest())
print(" ".join(h))
"""


def test_numpy_cpu_dispatch_does_not_change_the_bits():
    """numpy's AVX-512 loops switched off (NPY_DISABLE_CPU_FEATURES, what an AVX2 machine
    runs): the same bits, with softcap, ALiBi and sinks too. np.exp, np.log and np.tanh
    differ there; the mode uses none of them."""
    import subprocess
    import sys

    try:  # numpy >= 2
        from numpy._core._multiarray_umath import __cpu_features__ as feats
    except ImportError:  # numpy 1.x (the site stack's 1.24)
        from numpy.core._multiarray_umath import __cpu_features__ as feats

    off = [f for f, on in feats.items() if on and (f.startswith("AVX512") or f == "X86_V4")]
    if not off:
        pytest.skip("numpy has no AVX-512 loops to switch off on this host")
    runs = []
    for extra in ({}, {"NPY_DISABLE_CPU_FEATURES": " ".join(off)}):
        env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", **extra}
        proc = subprocess.run(
            [sys.executable, "-c", _HASH_SCRIPT], env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs.append(proc.stdout.split())
    assert runs[0][0] == runs[0][1] == runs[1][0] == runs[1][1], runs


def test_det_log_accuracy():
    x = np.concatenate([np.linspace(1, 1e6, 100001), np.exp(np.linspace(-700, 700, 10001))])
    got, want = reproducible.det_log(x), np.log(x)
    assert np.max(np.abs(got - want) / np.maximum(np.abs(want), 1.0)) < 5e-16
    assert np.isnan(reproducible.det_log(np.array([np.nan])))[0]
