"""The reproducible backward's C kernel against its numpy oracle: the same bits on every ISA path.

Single rank (COMM_SELF); the P-independence is tests/test_reproducible_backward_mpi.py's
(which runs whichever tile ``$RINGMPI_CPU_KERNEL`` picks). Each case hashes dq, dk, dv of
``ring_attention_backward(..., reproducible=True)`` run by the numpy tile
(``RINGMPI_CPU_KERNEL=numpy``, ``reproducible_backward._tile``) and by the kernel built for
every ISA path this host runs (AVX-512, AVX2, scalar where available), on values shaped
like real data, and checks the result against the dense float64 reference gradients
(the rule of tests/test_backward_mpi.py), without and with the score modifiers of
tests/tools/modcases.py (softcap and ALiBi run in the tile; sinks outside it). The
tile-level tests call the kernel and ``_tile`` directly: strided views as ``loop`` passes
them, partial tiles, the modifiers, the largest P (NaN and an lse that is not the
forward's).
"""

from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI
from tools.fingerprint import digest
from tools.modcases import MODS, SLOPES
from tools.reprokernels import fma_instructions, isa_objects

import ringmpi
from ringmpi import reproducible_backward, reproducible_float32
from ringmpi.cpu import fused_reproducible_backward, fused_reproducible_float32
from ringmpi.cpu.isa import host_isas
from ringmpi.reference import attention_backward
from ringmpi.reproducible import grids
from ringmpi.testing import dense_backward, random_qkv

SELF = MPI.COMM_SELF
N = 283  # 4 blocks of 64, the last partial
CU = (0, 40, 41, 170, N)
MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "window": dict(window=(37, 5)),
    "packed causal window": dict(cu_seqlens=np.array(CU), causal=True, window=(20, -1)),
}


def _inputs(dtype, seed, n=N, h=4, hkv=2, dk=24, dv=40, batch=None):
    """q, k (real-shaped), v of width ``dv`` (nonzero mean), dout; (S, H, D) or (B, S, H, D)."""
    rng = np.random.default_rng(seed)
    q, k, _ = random_qkv(rng, n, h, hkv, dk, batch, dtype=dtype, realistic=True)
    lead = k.shape[:-1]
    v = (0.5 + 0.1 * rng.standard_normal(lead + (dv,))).astype(dtype)
    dout = rng.standard_normal(q.shape[:-1] + (dv,)).astype(dtype)
    return q, k, v, dout


def _by_every_path(q, k, v, dout, kw, monkeypatch):
    """{"numpy": (dq, dk, dv), "<isa>": (dq, dk, dv), ...} of the same backward call.

    The forward (whichever kernel: its bits are the same) runs once; its out and lse feed
    every backward.
    """
    call = dict(reproducible=True, **kw)
    out, lse = ringmpi.ring_attention(q, k, v, SELF, return_lse=True, **call)

    def grads():
        st = {}
        g = ringmpi.ring_attention_backward(dout, q, k, v, out, lse, SELF, stats=st, **call)
        return g, st["tile"]

    # float32 inputs without softcap or ALiBi: the float32 method's kernel and oracle
    spec = SimpleNamespace(softcap=kw.get("softcap"), alibi_slopes=kw.get("alibi_slopes"))
    tail = " float32" if reproducible_float32.eligible(spec, q.dtype, k.shape[-3]) else ""
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "numpy")
    g, tile = grads()
    assert tile == "reproducible numpy" + tail
    got = {"numpy": g}
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "fused")
    for isa in host_isas():
        with fused_reproducible_backward.LOADER.pinned(isa), \
                fused_reproducible_float32.LOADER.pinned(isa):  # fmt: skip
            got[isa], tile = grads()
        assert tile == f"reproducible C {isa}" + tail, tile
    return got


def _all_give_the_numpy_bits(got: dict, tag: str) -> None:
    want = digest(*got["numpy"])
    bad = [name for name, res in got.items() if digest(*res) != want]
    assert not bad, f"{tag}: {bad} differ from the numpy tile"


def _check_accuracy(got, q, k, v, dout, kw, tag):
    """tests/test_backward_mpi.py's rule: float64 1e-11 relative; float32 3x the dense
    float32 peer's error (+1e-6)."""
    ref = attention_backward(dout, q, k, v, **kw)
    f32 = q.dtype == np.float32
    peer = dense_backward(dout, q, k, v, **kw) if f32 else ref
    for name, a, want, other in zip("qkv", got, ref, peer):
        assert a.shape == want.shape and a.dtype == q.dtype, f"{tag} d{name}: {a.shape} {a.dtype}"
        err = float(np.abs(a - want).max())
        if f32:
            tol = 3 * float(np.abs(other - want).max()) + 1e-6
        else:
            tol = 1e-11 * max(1.0, float(np.abs(want).max()))
        assert err <= tol, f"{tag} d{name}: max err {err:.3g} > tol {tol:.3g}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mask", list(MASKS))
def test_kernel_on_every_isa_gives_the_numpy_bits(dtype, mask, monkeypatch):
    """N = 283 (a partial last block), GQA 4 on 2, Dk = 24 and Dv = 40 (vector tails)."""
    kw = MASKS[mask]
    inputs = _inputs(dtype, seed=7)
    got = _by_every_path(*inputs, kw, monkeypatch)
    _all_give_the_numpy_bits(got, f"{mask} {np.dtype(dtype)}")
    _check_accuracy(got[host_isas()[0]], *inputs, kw, f"{mask} {np.dtype(dtype)}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_batch_and_one_kv_head_per_query_head(dtype, monkeypatch):
    """A batch of 2, H = Hkv = 2, D = 64 = Dv (whole vectors, no tails), 150 rows, causal."""
    inputs = _inputs(dtype, seed=3, n=150, h=2, hkv=2, dk=64, dv=64, batch=2)
    kw = dict(causal=True)
    got = _by_every_path(*inputs, kw, monkeypatch)
    _all_give_the_numpy_bits(got, f"batch {np.dtype(dtype)}")
    _check_accuracy(got[host_isas()[0]], *inputs, kw, f"batch {np.dtype(dtype)}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("mod", list(MODS))
def test_modifiers_on_every_isa_give_the_numpy_bits(mod, mask, dtype, monkeypatch):
    """Softcap, ALiBi, sinks and all three (tests/tools/modcases.py) at N = 283, GQA 4 on 2:
    the kernel on every ISA path gives the numpy tile's bits, within the reference's rule
    (``attention_backward`` with the same modifiers)."""
    kw = dict(MASKS[mask], **MODS[mod])
    inputs = _inputs(dtype, seed=17)
    got = _by_every_path(*inputs, kw, monkeypatch)
    tag = f"{mod} {mask} {np.dtype(dtype)}"
    _all_give_the_numpy_bits(got, tag)
    _check_accuracy(got[host_isas()[0]], *inputs, kw, tag)


@pytest.mark.parametrize("mod", ["alibi", "all three"])
def test_cross_attention_with_alibi(mod, monkeypatch):
    """Nq = 131 rows on Nk = 300 keys in two packed sequences (cu_seqlens_k != cu_seqlens),
    a batch of 2, causal: ALiBi's query positions are shifted to the end of each
    sequence's keys, so qa_i - k_j differs from the rows' own positions; float64 (the
    tight rule) and every ISA path."""
    q, _, _, dout = _inputs(np.float64, seed=5, n=131, batch=2)
    _, k, v, _ = _inputs(np.float64, seed=6, n=300, batch=2)
    kw = dict(cu_seqlens=np.array([0, 60, 131]), cu_seqlens_k=np.array([0, 110, 300]))
    kw.update(causal=True, **MODS[mod])
    got = _by_every_path(q, k, v, dout, kw, monkeypatch)
    _all_give_the_numpy_bits(got, f"cross {mod}")
    _check_accuracy(got[host_isas()[0]], q, k, v, dout, kw, f"cross {mod}")


def test_accuracy_can_fail(monkeypatch):
    """The accuracy check above catches a wrong gradient (the tolerance is not vacuous)."""
    inputs = _inputs(np.float64, seed=7)
    got = _by_every_path(*inputs, {}, monkeypatch)["numpy"]
    bad = (got[0], got[1] * (1 + 1e-9), got[2])
    with pytest.raises(AssertionError, match="dk: max err"):
        _check_accuracy(bad, *inputs, {}, "perturbed")


def _tile_args(seed, b=1, h=4, hkv=2, r=64, c=64, dk=24, dv=40, nf=3):
    """Inputs of one tile as ``loop`` passes them: strided float64 views of bigger arrays."""
    rng = np.random.default_rng(seed)
    qd = rng.standard_normal((b, h, r + 5, dk + dv + 2))  # (q | dO | lse | delta) rows
    qd[..., dk + dv] = 4.0 + rng.standard_normal((b, h, r + 5))  # lse: P below ~e^2
    sl = slice(2, r + 2)
    q, do = qd[:, :, sl, :dk], qd[:, :, sl, dk : dk + dv]
    lse, delta = qd[:, :, sl, dk + dv], qd[:, :, sl, dk + dv + 1]
    k = np.ascontiguousarray(rng.standard_normal((b, h, c, dk)))
    v = np.ascontiguousarray(0.5 + rng.standard_normal((b, h, c, dv)))
    vis = rng.random((r, c)) < 0.6
    vis[0, 0] = True  # loop skips a tile that no row sees into
    kh = np.arange(h) // (h // hkv)
    qg = [x[:, kh, None, :] for x in grids(1024, 8 * rng.random((b, hkv, dk)), nf)]
    kg = [x[:, :, None, None, :] for x in grids(4096, 8 * rng.random((b, hkv, dk)), nf)]
    vg = [x[:, :, None, None, :] for x in grids(4096, 8 * rng.random((b, hkv, dv)), nf)]
    return [q, do, lse, delta, k, v, vis, 0.2, (qg, kg, vg)], hkv


def _run_tile(fn, args, hkv):
    """(largest P, the fold sums) of one tile, the sums strided like loop's."""
    q, k, v = args[0], args[4], args[5]
    b, h, r, dk = q.shape
    c, dv, nf = k.shape[2], v.shape[-1], len(args[8][0])
    dq = np.zeros((nf, b, h, r + 3, dk))
    pkg = np.zeros((c, 1 + nf, b, hkv, dk + dv))  # the travelling package's layout
    dk_f = [np.moveaxis(pkg[:, 1 + f, ..., :dk], 0, 2) for f in range(nf)]
    dv_f = [np.moveaxis(pkg[:, 1 + f, ..., dk:], 0, 2) for f in range(nf)]
    pmax = fn(*args, [x[:, :, 1 : r + 1] for x in dq], dk_f, dv_f, hkv)
    return pmax, dq, pkg


@pytest.mark.parametrize(
    "shape",
    [
        dict(),
        dict(b=2, h=2, hkv=1, r=27, c=64, dk=5, dv=64),
        dict(h=3, hkv=3, r=64, c=11, dk=64, dv=3, nf=2),
        dict(h=1, hkv=1, r=1, c=1, dk=1, dv=1, nf=4),
    ],
    ids=["full", "partial rows", "partial keys", "1x1"],
)
def test_tile_gives_the_numpy_bits(shape):
    """One tile on strided views, every ISA path: P's maximum and every fold sum."""
    args, hkv = _tile_args(1, **shape)
    want = _run_tile(reproducible_backward._tile, args, hkv)
    assert want[0] > 0
    for isa in host_isas():
        got = _run_tile(fused_reproducible_backward.load(isa).tile, args, hkv)
        assert got[0] == want[0], f"{isa}: max P {got[0]} != {want[0]}"
        assert digest(got[1], got[2]) == digest(want[1], want[2]), f"{isa}: fold sums differ"


def _mods(which, h, r, c, cap=3.0):
    """``mods`` of a tile at rows 100.. and keys 70.. (ALiBi distances of both signs)."""
    slopes = np.resize(SLOPES, h) if "alibi" in which else None
    qa = np.arange(100, 100 + r, dtype=np.int64) if slopes is not None else None
    return (cap if "softcap" in which else None, slopes, qa, np.arange(70, 70 + c))


@pytest.mark.parametrize("which", ["softcap", "alibi", "softcap alibi"])
@pytest.mark.parametrize(
    "shape",
    [dict(), dict(b=2, h=2, hkv=1, r=27, c=37, dk=5, dv=64)],
    ids=["full", "partial"],
)
def test_tile_with_modifiers_gives_the_numpy_bits(which, shape):
    """One tile with softcap (saturating on part of the scores), ALiBi or both, every ISA
    path: P's maximum and every fold sum; and the modifiers change them (not a no-op)."""
    args, hkv = _tile_args(5, **shape)
    args[0] *= 3.0  # scores up to ~10: softcap 3 is nonlinear on many, saturates on some
    h, r, c = args[0].shape[1], args[0].shape[2], args[4].shape[2]
    mods = _mods(which, h, r, c)

    want = _run_tile(partial(reproducible_backward._tile, mods=mods), args, hkv)
    plain = _run_tile(reproducible_backward._tile, args, hkv)
    assert digest(want[1], want[2]) != digest(plain[1], plain[2])
    for isa in host_isas():
        kern = fused_reproducible_backward.load(isa)
        got = _run_tile(partial(kern.tile, mods=mods), args, hkv)
        assert got[0] == want[0], f"{isa} {which}: max P {got[0]} != {want[0]}"
        assert digest(got[1], got[2]) == digest(want[1], want[2]), f"{isa} {which}: sums differ"


def test_kernel_refuses_bad_modifiers():
    """Malformed ``mods``: a clear ValueError naming what is wrong, before the kernel runs."""
    kern = fused_reproducible_backward.load(host_isas()[-1])
    args, hkv = _tile_args(3)
    h, r, c = args[0].shape[1], args[0].shape[2], args[4].shape[2]
    good = _mods("softcap alibi", h, r, c)
    cases = {
        "mods is": (1.0, None),
        "softcap 0.0": (0.0,) + good[1:],
        "softcap inf": (np.inf,) + good[1:],
        r"slopes \(3,\)": (good[0], good[1][:3], good[2], good[3]),
        "needs qa": (good[0], good[1], None, good[3]),
        "needs kp": (good[0], good[1], good[2], None),
        "qa": (good[0], good[1], good[2][:5], good[3]),
        "kp": (good[0], good[1], good[2], good[3].astype(np.float64)),
        "beyond 2": (good[0], good[1], good[2], good[3] + 2**53),
    }
    for msg, mods in cases.items():
        with pytest.raises(ValueError, match=msg):
            _run_tile(partial(kern.tile, mods=mods), args, hkv)


def test_empty_tile_adds_nothing():
    """The kernel on no rows (or no keys): largest P 0 and the sums untouched (loop never
    passes such a tile; the numpy code's chains need one term)."""
    args, hkv = _tile_args(4)
    for cut in ("rows", "keys"):
        a = list(args)
        if cut == "rows":
            a[:4] = [x[:, :, :0] for x in a[:4]]
            a[6] = a[6][:0]
        else:
            a[4:6] = [x[:, :, :0] for x in a[4:6]]
            a[6] = a[6][:, :0]
        pmax, dq, pkg = _run_tile(fused_reproducible_backward.load().tile, a, hkv)
        assert pmax == 0.0 and not dq.any() and not pkg.any(), cut


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_tile_largest_p_nan_and_a_wrong_lse():
    """A NaN query row: max P NaN, as numpy's max; an lse far below the scores (s - lse
    above 709): +inf where numpy's P is at least 8e307; both far above the bound (numpy
    warns of its inf - inf)."""
    kern = fused_reproducible_backward.load(host_isas()[-1])
    args, hkv = _tile_args(2)
    args[0][0, 1, 3, 0] = np.nan
    assert np.isnan(_run_tile(kern.tile, args, hkv)[0])
    assert np.isnan(_run_tile(reproducible_backward._tile, args, hkv)[0])
    args, hkv = _tile_args(2)
    args[2][0, 0, 5] = -1000.0
    assert _run_tile(kern.tile, args, hkv)[0] == np.inf
    assert _run_tile(reproducible_backward._tile, args, hkv)[0] > 8e307


def test_kernel_refuses_bad_arguments():
    kern = fused_reproducible_backward.load(host_isas()[-1])
    args, hkv = _tile_args(3, r=64, c=64)
    _, dq, pkg = _run_tile(kern.tile, args, hkv)
    with pytest.raises(ValueError, match="at most 64"):
        big, hkv2 = _tile_args(3, r=65)
        _run_tile(kern.tile, big, hkv2)
    with pytest.raises(ValueError, match="float64"):
        bad = list(args)
        bad[4] = bad[4].astype(np.float32)
        _run_tile(kern.tile, bad, hkv)
    with pytest.raises(ValueError, match="vis"):
        bad = list(args)
        bad[6] = bad[6][:, :10]
        _run_tile(kern.tile, bad, hkv)
    with pytest.raises(ValueError, match="contiguous last axis"):
        bad = list(args)
        bad[4] = np.asfortranarray(bad[4])
        _run_tile(kern.tile, bad, hkv)


def test_kernel_choice(monkeypatch):
    """``numpy``: the numpy tile; ``fused``: the kernel, or a RuntimeError naming why not."""
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "numpy")
    assert reproducible_backward.kernel() is None
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "fused")
    assert reproducible_backward.kernel() is not None

    class NoBuild(fused_reproducible_backward.ReproBackwardKernel):
        @classmethod
        def build(cls, isa):
            raise RuntimeError("no compiler here")

    broken = fused_reproducible_backward.Loader(NoBuild, "broken", warn=False)
    monkeypatch.setattr(fused_reproducible_backward, "LOADER", broken)
    with pytest.raises(RuntimeError, match="unavailable.*no compiler here"):
        reproducible_backward.kernel()
    monkeypatch.setenv("RINGMPI_CPU_KERNEL", "auto")
    assert reproducible_backward.kernel() is None


def test_every_isa_path_compiles(tmp_path):
    """The AVX-512, AVX2 and scalar paths compile with the kernel's flags, also the ones this
    host cannot run (compiled here, not run: the bits of a path are checked only where the
    host runs it, above); none of them contains a fused multiply-add instruction (the
    float32 method's backward, with its single-rounding FMAs, is the float32 kernel's:
    tests/cpu/test_fused_reproducible_float32.py)."""
    for isa, dis in isa_objects("cpu_reproducible_backward.c", tmp_path).items():
        if dis is None:  # no objdump
            continue
        assert not fma_instructions(dis), f"{isa}: an FMA instruction"


def test_compiler_flags_from_the_environment_do_not_change_the_bits(monkeypatch, tmp_path):
    """$RINGMPI_CFLAGS with -ffast-math and FMA contraction: the kernel's own flags win (a
    fresh build in a fresh cache gives the numpy tile's bits)."""
    inputs = _inputs(np.float64, seed=11, n=150, dk=16, dv=24)
    kw = dict(causal=True)
    want = digest(*_by_every_path(*inputs, kw, monkeypatch)["numpy"])
    monkeypatch.setenv("RINGMPI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("RINGMPI_CFLAGS", "-ffast-math -ffp-contract=fast")
    fresh = fused_reproducible_backward.Loader(
        fused_reproducible_backward.ReproBackwardKernel,
        "reproducible backward C kernel",
        warn=False,
    )
    monkeypatch.setattr(fused_reproducible_backward, "LOADER", fresh)
    got = _by_every_path(*inputs, kw, monkeypatch)
    assert all(str(tmp_path) in str(fresh.load(isa).path) for isa in host_isas())
    _all_give_the_numpy_bits(got, "RINGMPI_CFLAGS=-ffast-math")
    assert digest(*got["numpy"]) == want
