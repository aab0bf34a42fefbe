"""The float32 reproducible forward's C kernel (issue 40) against its numpy oracle.

Single rank (COMM_SELF); the P-independence is tests/test_reproducible_mpi.py's (its float32
cases run this method), the oracle's pieces against exact arithmetic
tests/test_reproducible_float32.py's. The kernel runs on every ISA path this host executes;
the numpy code of :mod:`ringmpi.reproducible_float32` is its oracle.
"""

import numpy as np
import pytest
from mpi4py import MPI
from tools.reprokernels import (
    by_every_path,
    flags_keep_the_bits,
    fma_instructions,
    isa_objects,
)

from ringmpi.cpu import fused_reproducible_float32
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
    "sinks causal": dict(causal=True, sinks=np.array([0.5, 3.0, -2.0, 40.0])),
}


@pytest.mark.parametrize("mask", list(MASKS))
def test_kernel_on_every_isa_gives_the_numpy_bits(mask, monkeypatch):
    """N = 283 (two 256-key blocks, the second partial), D = 24, Dv = 40 (a column tail),
    GQA, real-shaped values: the bits of the numpy code, and the accuracy rule."""
    rng = np.random.default_rng(7)
    q, k, _ = random_qkv(rng, 283, 4, 2, 24, dtype=np.float32, realistic=True)
    v = (0.5 + 0.1 * rng.standard_normal((283, 2, 40))).astype(np.float32)
    kw = MASKS[mask]
    got = by_every_path(q, k, v, kw, monkeypatch)
    ref = attention(q, k, v, **kw)
    peer = dense(q, k, v, **kw)
    out, lse = got["numpy"]
    assert_close(SELF, out, ref[0], peer[0], f"{mask} out")
    assert_close(SELF, lse, ref[1], peer[1], f"{mask} lse")


def test_cross_attention_gives_the_numpy_bits(monkeypatch):
    """Cross-attention (more keys than queries, one sequence with no keys: out 0); masks of
    slices run here too (tests/cpu/test_fused_reproducible.py, float32 cases)."""
    rng = np.random.default_rng(8)
    nq, nk = 90, 600
    q, _, _ = random_qkv(rng, nq, 2, 1, 16, dtype=np.float32, realistic=True)
    _, k, v = random_qkv(rng, nk, 2, 1, 16, dtype=np.float32, realistic=True)
    kw = dict(cu_seqlens=np.array([0, 30, nq]), cu_seqlens_k=np.array([0, 0, nk]))
    got = by_every_path(q, k, v, kw, monkeypatch)
    ref = attention(q, k, v, **kw)
    peer = dense(q, k, v, **kw)
    assert_close(SELF, got["numpy"][0], ref[0], peer[0], "cross out")
    assert not got["numpy"][0][:30].any()


def test_rows_of_70k_keys_are_accurate(monkeypatch):
    """Four query rows against 70,000 keys (274 blocks; the keys' scores spread over several
    windows: huge keys among them): the kernel's bits are the numpy code's, and out is
    within the float32 rule of the dense float64 reference."""
    rng = np.random.default_rng(9)
    nk = 70000
    _, k, v = random_qkv(rng, nk, 1, 1, 16, dtype=np.float32, realistic=True)
    q = (1.0 + 0.2 * rng.standard_normal((4, 1, 16))).astype(np.float32)
    k[rng.choice(nk, 5, replace=False)] *= 30.0  # a few huge keys: scores far above the rest
    kw = dict(cu_seqlens=np.array([0, 4]), cu_seqlens_k=np.array([0, nk]))
    got = by_every_path(q, k, v, kw, monkeypatch)
    ref = attention(q, k, v, **kw)
    peer = dense(q, k, v, **kw)
    assert_close(SELF, got["numpy"][0], ref[0], peer[0], "70k keys out")
    assert_close(SELF, got["numpy"][1], ref[1], peer[1], "70k keys lse")


def test_compiler_flags_from_the_environment_do_not_change_the_bits(monkeypatch, tmp_path):
    """$RINGMPI_CFLAGS with -ffast-math and FMA contraction: the float32 kernel's own flags
    win (its explicit float32 FMAs stay, nothing else is fused or reassociated)."""
    q, k, v = random_qkv(np.random.default_rng(2), 300, 2, 1, 16, dtype=np.float32,
                         realistic=True)  # fmt: skip
    kw = dict(causal=True, sinks=[1.0, 9.0])
    flags_keep_the_bits(
        fused_reproducible_float32,
        fused_reproducible_float32.Float32Kernel,
        q,
        k,
        v,
        kw,
        monkeypatch,
        tmp_path,
    )


def test_every_isa_path_compiles_without_float64_fmas(tmp_path):
    """AVX-512, AVX2 and scalar compile (the ones this host cannot run too); the float32
    fused multiply-adds are the method's, the float64 code (the folds) has none, and the
    scalar path no FMA instruction at all (it emulates the float32 one exactly)."""
    for isa, dis in isa_objects("cpu_reproducible_float32.c", tmp_path).items():
        if dis is None:  # no objdump
            continue
        fused = fma_instructions(dis)
        assert not [x for x in fused if x.endswith(("pd", "sd"))], f"{isa}: a float64 FMA"
        assert (isa == "scalar") == (not fused), f"{isa}: FMAs {sorted(set(fused))}"


def test_kernel_refuses_keys_off_the_block_grid():
    kern = fused_reproducible_float32.load(host_isas()[-1])
    q = np.zeros((1, 1, 4, 8), dtype=np.float32)
    kt, vp = kern.pad_keys(np.zeros((1, 1, 10, 8))), kern.pad_values(np.zeros((1, 1, 10, 8)))
    pos = np.arange(3, 13, dtype=np.int64)  # does not start a key block
    lo, hi = np.zeros((1, 4), dtype=np.int64), np.full((1, 4), 20, dtype=np.int64)
    state = (np.full((1, 1, 4), -np.inf), np.zeros((1, 1, 4, 3)), np.zeros((1, 1, 4, 3, 8)),
             np.ones(3), np.ones((1, 1, 3, 8)))  # fmt: skip
    with pytest.raises(ValueError, match="refused"):
        kern.block(q, kt, vp, pos, lo, hi, state, sk=10, dv=8, rows=(0, 4))
