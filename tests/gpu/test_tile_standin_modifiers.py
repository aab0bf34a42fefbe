"""Score modifiers (softcap, ALiBi) on the GPU Python path, one process, on the CuPy stand-in.

NOT a GPU: the stand-in (tests/tools/fakecupy) runs the numpy tile on what each kernel
launch hands it (tests/tools/standin_kernels.py), so these tests cover the argument
plumbing of the forward and backward kernels (order, types, per-head slopes, the rows'
ALiBi positions, GQA packing, every configuration) and ring_attention_backward with
the modifiers against the dense float64 reference. The CUDA arithmetic runs only in
tests/gpu/test_tile_device.py on a device (jobs/gpu_check.sh, stage ``mods``); the header's
modifier functions run on the host in tests/gpu/test_header.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from tools import gpucases, standin

STORAGE = {"float16": "half_t", "bfloat16": "bf16_t", "float32": "float", "float64": "double"}


@pytest.fixture(scope="module")
def cupy():
    """The CuPy stand-in, for this module only (see tests/tools/standin.py)."""
    with standin.installed() as cp:
        yield cp


def self_comm():
    from mpi4py import MPI

    return MPI.COMM_SELF


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_forward_modifiers_reach_every_configuration(cupy, monkeypatch, dtype):
    """softcap and ALiBi (slopes per query head, rows' qa) arrive at each forced kernel.

    The stand-in runs the numpy tile on what the launch hands it, so this checks the
    argument plumbing (order, types, per-head slopes, GQA packing); the CUDA arithmetic
    runs in tests/gpu/test_tile_device.py on a device.
    """
    from ringmpi.cpu import numpy_tile
    from ringmpi.gpu import configs, tile
    from ringmpi.softmax import init_state

    rng = np.random.default_rng(3)
    bsz, h, hkv, sq, sk, d = 1, 4, 2, 70, 90, 64
    q = 0.5 + rng.standard_normal((bsz, h, sq, d))
    k, v = (0.5 + rng.standard_normal((bsz, hkv, sk, d)) for _ in range(2))
    q, k, v = (gpucases.rounded(x, dtype) for x in (q, k, v))
    q_pos = np.arange(20, 20 + sq, dtype=np.int64)
    k_pos = np.arange(sk, dtype=np.int64)[::-1].copy()  # not sorted
    slopes = np.array([0.5, 0.25, 0.125, 0.0])
    kw = dict(scale=d**-0.5, causal=True, softcap=3.0, alibi=(slopes, q_pos + 7))
    adt = np.float64 if dtype == "float64" else np.float32
    want = init_state(q.shape, adt)
    numpy_tile.forward_tile(*(x.astype(adt) for x in (q, k, v)), q_pos, k_pos, *want, **kw)
    plain = init_state(q.shape, adt)
    numpy_tile.forward_tile(
        *(x.astype(adt) for x in (q, k, v)), q_pos, k_pos, *plain, scale=d**-0.5, causal=True
    )
    assert not np.allclose(plain[0], want[0])  # the modifiers change the state
    for kern in configs.forward_candidates(STORAGE[dtype], d, 232448):
        monkeypatch.setenv(tile.CONFIG_ENV, kern.name)
        dq, dk, dv = (gpucases.to_device(cupy, x, dtype) for x in (q, k, v))
        st = [cupy.asarray(a) for a in init_state(q.shape, adt)]
        tile.forward_tile(dq, dk, dv, q_pos, k_pos, *st, **kw)
        for a, b in zip(st, want):
            np.testing.assert_allclose(a.get(), b, rtol=1e-5, atol=1e-6, err_msg=kern.name)
    with pytest.raises(ValueError, match="softcap"):
        tile.forward_tile(dq, dk, dv, q_pos, k_pos, *st, scale=0.1, causal=True, softcap=-1.0)


MOD_SETS = {
    "softcap": dict(softcap=2.5),
    "alibi": dict(alibi=True),
    "softcap+alibi": dict(softcap=4.0, alibi=True),
}


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("mods", list(MOD_SETS))
def test_backward_modifiers_reach_every_configuration(cupy, monkeypatch, dtype, mods):
    """softcap and ALiBi reach both backward kernels of every configuration pair.

    Each (dK/dV, dQ) pair of configurations is forced in turn; the stand-in runs the
    numpy tile on what each launch hands it, so a kernel argument that is dropped,
    misordered or of the wrong type fails here (against the numpy tile called directly
    with the same modifiers, under a window with empty rows). The CUDA arithmetic runs in
    tests/gpu/test_tile_device.py on a device.
    """
    import itertools

    from ringmpi.cpu import numpy_tile
    from ringmpi.gpu import backward, configs
    from ringmpi.softmax import finalize, init_state

    rng = np.random.default_rng(4)
    bsz, h, hkv, sq, sk = 1, 4, 2, 70, 90
    adt = np.float64 if dtype == "float64" else np.float32
    q_pos = np.arange(20, 20 + sq, dtype=np.int64)
    k_pos = np.arange(sk, dtype=np.int64)[::-1].copy()  # not sorted
    lo, hi = q_pos - 45, q_pos.copy()
    hi[::9] = lo[::9] - 1  # rows that see no key
    slopes = np.array([0.5, 0.25, 0.125, 0.0])
    mod_kw = {"softcap": MOD_SETS[mods]["softcap"]} if "softcap" in MOD_SETS[mods] else {}
    if "alibi" in MOD_SETS[mods]:
        mod_kw["alibi"] = (slopes, q_pos + 5)  # a bottom-right offset of the ALiBi rows
    for d in (64, 200):
        shapes = [(bsz, h, sq, d), (bsz, hkv, sk, d), (bsz, hkv, sk, d), (bsz, h, sq, d)]
        q, k, v, do = (gpucases.rounded(x, dtype).astype(adt) for x in gpucases.data(rng, shapes))
        kw = dict(scale=d**-0.5, causal=True, bounds=(lo, hi))
        state = init_state(q.shape, adt)
        numpy_tile.forward_tile(q, k, v, q_pos, k_pos, *state, **kw, **mod_kw)
        out, lse = finalize(*state)
        delta = (do * out).sum(-1)
        want = [np.zeros_like(x) for x in (q, k, v)]
        numpy_tile.backward_tile(q, k, v, do, lse, delta, q_pos, k_pos, *want, **kw, **mod_kw)
        plain = [np.zeros_like(x) for x in (q, k, v)]
        numpy_tile.backward_tile(q, k, v, do, lse, delta, q_pos, k_pos, *plain, **kw)
        assert not np.allclose(plain[0], want[0]), "the modifiers do not change dq"
        dev = [gpucases.to_device(cupy, x, dtype) for x in (k, v)]
        pairs = list(itertools.product(*configs.backward_all(STORAGE[dtype], d)))
        assert len(pairs) >= 2 or dtype == "float64", pairs
        for k_dkdv, k_dq in pairs:
            monkeypatch.setattr(backward, "chosen", lambda s, dd, dv_, a=k_dkdv, b=k_dq: (a, b))
            got = [cupy.zeros(x.shape, dtype=adt) for x in (q, k, v)]
            n0 = len(cupy.launches)
            backward.backward_tile(
                cupy.asarray(q),
                *dev,
                cupy.asarray(do),
                cupy.asarray(lse),
                cupy.asarray(delta),
                q_pos,
                k_pos,
                *got,
                **kw,
                **mod_kw,
            )
            ran = [e for e, *_ in cupy.launches[n0:]]
            assert ran == [k_dkdv.expr, k_dq.expr], ran
            for name, g, w in zip(("dq", "dk", "dv"), got, want):
                what = f"{k_dkdv.name}/{k_dq.name} D={d} {name}"
                np.testing.assert_allclose(
                    g.get(), w, rtol=0, atol=1e-5 * np.abs(w).max(), err_msg=what
                )
    with pytest.raises(ValueError, match="softcap"):
        backward.backward_tile(
            cupy.asarray(q),
            *dev,
            cupy.asarray(do),
            cupy.asarray(lse),
            cupy.asarray(delta),
            q_pos,
            k_pos,
            *got,
            scale=0.1,
            causal=True,
            softcap=0.0,
        )
    with pytest.raises(ValueError, match="slopes"):
        backward.backward_tile(
            cupy.asarray(q),
            *dev,
            cupy.asarray(do),
            cupy.asarray(lse),
            cupy.asarray(delta),
            q_pos,
            k_pos,
            *got,
            scale=0.1,
            causal=True,
            alibi=(slopes[:3], q_pos),
        )


RING_MODS = [
    ("softcap, window 60,0", dict(softcap=4.0, window=(60, 0))),
    ("alibi, packed", dict(alibi_slopes=[0.5, 0.25, 0.0625, 0.0], cu_seqlens=(0, 40, 41, 203))),
    (
        "both, packed window 25,4",
        dict(
            softcap=3.0,
            alibi_slopes=[0.125, 0.5, 0.0, 2.0**-5],
            window=(25, 4),
            cu_seqlens=(0, 90, 203),
        ),
    ),
]


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("case", RING_MODS, ids=[c[0] for c in RING_MODS])
def test_ring_backward_with_modifiers_on_the_gpu_backend(cupy, dtype, case):
    """ring_attention(_backward) on device arrays with softcap / ALiBi against float64 (P=1)."""
    _, mods = case
    gpucases.backward_case(cupy, self_comm(), dtype, "zigzag", True, mask=mods)


def test_launches_are_checked_against_the_kernel_signatures(cupy, monkeypatch):
    """Every launch is compared with the parameters parsed from kernels/*.cu.

    All kernels end in (unsigned mods, const double* mparam, const long long* mpos); a
    launch with the old (softcap, slopes, apos) tail, a dropped or mistyped argument, a
    parameter block of the wrong shape or dtype, or positions missing (or given where no
    active modifier uses them) is refused before the numpy tile runs.
    """
    from tools import standin_kernels

    from ringmpi import scoremods
    from ringmpi.gpu import kernel_args, tile
    from ringmpi.softmax import init_state

    tail = [("unsigned", "mods"), ("double*", "mparam"), ("longlong*", "mpos")]
    sigs = standin_kernels.signatures()
    assert len(sigs) == 7 and all(p[-3:] == tail for _, p in sigs.values()), sigs
    rng = np.random.default_rng(5)
    q = cupy.asarray(rng.standard_normal((1, 6, 20, 32)).astype(np.float32))  # H != NMODS
    k, v = (cupy.asarray(rng.standard_normal((1, 2, 24, 32)).astype(np.float32)) for _ in "kv")
    q_pos, k_pos = np.arange(4, 24, dtype=np.int64), np.arange(24, dtype=np.int64)
    slopes = np.array([0.5, 0.25, 0.125, 0.0, 2.0**-5, 1.0])

    def call(**mods):
        st = [cupy.asarray(a) for a in init_state(q.shape, np.float32)]
        tile.forward_tile(q, k, v, q_pos, k_pos, *st, scale=0.2, causal=True, **mods)
        return st

    good = call(softcap=2.0, alibi=(slopes, q_pos))
    assert not np.allclose(good[0].get(), call()[0].get())
    real = kernel_args.modifier_args
    null = kernel_args.NULL

    def positions_dropped(m, dev):
        bits, mparam, _ = real(m, dev)
        return bits, mparam, null

    def positions_added(m, dev):
        bits, mparam, _ = real(m, dev)
        return bits, mparam, cupy.asarray(q_pos)

    fakes = {
        "the old tail": (lambda m, dev: (np.float32(2.0), null, null), "mods must be uint32"),
        "dropped": (lambda m, dev: real(m, dev)[:2], "arguments for the"),
        "int32 bits": (lambda m, dev: (np.int32(m.bits),) + real(m, dev)[1:], "uint32"),
        "float32 block": (
            lambda m, dev: (
                np.uint32(m.bits),
                cupy.asarray(m.params.astype(np.float32)),
                real(m, dev)[2],
            ),
            "mparam has dtype float32",
        ),
        "block (NMODS, H)": (
            lambda m, dev: (
                np.uint32(m.bits),
                cupy.asarray(np.ascontiguousarray(m.params.T)),
                real(m, dev)[2],
            ),
            "mparam has shape",
        ),
        "unknown bit": (
            lambda m, dev: (np.uint32(m.bits | 1 << (scoremods.NMODS - 1)),) + real(m, dev)[1:],
            "no modifier",
        ),
        "positions missing": (positions_dropped, "mpos"),
    }
    for fake, msg in fakes.values():
        monkeypatch.setattr(kernel_args, "modifier_args", fake)
        with pytest.raises(standin_kernels.LaunchError, match=msg):
            call(softcap=2.0, alibi=(slopes, q_pos))
    monkeypatch.setattr(kernel_args, "modifier_args", positions_added)
    with pytest.raises(standin_kernels.LaunchError, match="no active modifier uses positions"):
        call(softcap=2.0)
    monkeypatch.setattr(kernel_args, "modifier_args", real)
    for a, b in zip(call(softcap=2.0, alibi=(slopes, q_pos)), good):
        np.testing.assert_array_equal(a.get(), b.get())
    with pytest.raises(TypeError, match="unknown score modifier keyword 'softcapp'"):
        call(softcapp=2.0)
