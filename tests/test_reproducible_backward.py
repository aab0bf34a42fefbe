"""Reproducible backward (issue 40) on one rank: threads, numpy's CPU dispatch, the deal.

The multi-rank cases (every P, layout and mask) are in
tests/test_reproducible_backward_mpi.py; here the bits must not move with the OpenMP and
BLAS thread counts, numpy's SIMD loops (``NPY_DISABLE_CPU_FEATURES``) or the forward's
CPU kernel, which each run in a fresh interpreter.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from ringmpi import reproducible, reproducible_backward

_HASH_SCRIPT = """
import hashlib, numpy as np
from mpi4py import MPI
import ringmpi
from ringmpi.testing import random_qkv
h = []
mods = dict(softcap=5.0, alibi_slopes=[0.5, 0.25, 0.125, 0.0625], sinks=[1.0, -1.0, 6.0, 0.0])
for dtype, extra in [(t, m) for t in (np.float32, np.float64) for m in ({}, mods)]:
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, 200, 4, 2, 16, dtype=dtype, realistic=True)
    dout = rng.standard_normal(q.shape).astype(dtype)
    kw = dict(causal=True, window=(90, -1), reproducible=True, **extra)
    out, lse = ringmpi.ring_attention(q, k, v, MPI.COMM_SELF, return_lse=True, **kw)
    grads = ringmpi.ring_attention_backward(dout, q, k, v, out, lse, MPI.COMM_SELF, **kw)
    h.append(hashlib.sha256(b"".join(g.tobytes() for g in grads)).hexdigest())
print(" ".join(h))
"""


def _features():
    try:  # numpy >= 2
        from numpy._core import _multiarray_umath as umath
    except ImportError:  # numpy 1.x
        from numpy.core import _multiarray_umath as umath
    return umath.__cpu_features__, list(getattr(umath, "__cpu_dispatch__", []))


def _hashes(**extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    proc = subprocess.run(
        [sys.executable, "-c", _HASH_SCRIPT], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()


def test_threads_and_numpy_cpu_dispatch_do_not_change_the_bits():
    """OMP_NUM_THREADS 1 and 2 (OpenMP and BLAS pools), numpy's AVX-512 loops off, every
    dispatched SIMD target off (baseline loops only), the forward's numpy code instead of
    its C kernel: the same dq, dk, dv hashes, float32 and float64, without and with
    softcap, ALiBi and sinks (then dsinks too)."""
    feats, dispatch = _features()
    avx512 = [f for f, on in feats.items() if on and (f.startswith("AVX512") or f == "X86_V4")]
    targets = [f for f in dispatch if feats.get(f)] + avx512
    runs = {
        "1 thread": _hashes(),
        "2 threads": _hashes(OMP_NUM_THREADS="2", OPENBLAS_NUM_THREADS="2"),
        "forward numpy": _hashes(RINGMPI_CPU_KERNEL="numpy"),
    }
    if avx512:
        runs["AVX-512 off"] = _hashes(NPY_DISABLE_CPU_FEATURES=" ".join(avx512))
    if targets:
        runs["dispatch off"] = _hashes(NPY_DISABLE_CPU_FEATURES=" ".join(dict.fromkeys(targets)))
    want = runs["1 thread"]
    assert len(want) == 4, runs
    assert all(h == want for h in runs.values()), runs
    if not targets:
        pytest.skip("numpy dispatches no SIMD target above its baseline on this host")


def test_chains_are_fixed_sequences():
    """The block partials are the left-to-right sums of the products, entry by entry."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((2, 5, 7))
    x = rng.standard_normal((2, 7, 4))
    got = reproducible_backward._chain(w, x, False)
    want = np.zeros((2, 5, 4))
    for j in range(7):
        want = want + w[:, :, j, None] * x[:, None, j, :] if j else w[:, :, 0, None] * x[:, None, 0]
    assert np.array_equal(got, want)
    y = rng.standard_normal((2, 5, 4))
    got = reproducible_backward._chain(w, y, True)
    want = w[:, 0, :, None] * y[:, 0:1, :]
    for i in range(1, 5):
        want = want + w[:, i, :, None] * y[:, i : i + 1, :]
    assert np.array_equal(got, want)


def test_modified_scores_are_the_forwards():
    """The backward's batched softcap and ALiBi give, entry by entry, the bits of the
    forward's :func:`ringmpi.reproducible.modify` on each (batch, head), and softcap's
    derivative is 1 - t t of the same det_tanh value t."""
    rng = np.random.default_rng(8)
    s = 4.0 * rng.standard_normal((2, 3, 5, 7))
    slopes = np.array([0.5, 0.3, 1 / 3])
    qa, kp = np.array([3, 9, 10, 64, 65]), np.arange(60, 67)
    for cap, sl in ((2.5, None), (None, slopes), (2.5, slopes)):
        got = s.copy()
        dmod = reproducible_backward.modify_batched(
            got, cap, sl, qa if sl is not None else None, kp
        )
        for b in range(2):
            for h in range(3):
                want = reproducible.modify(
                    s[b, h].copy(), cap, None if sl is None else sl[h], qa, kp
                )
                assert np.array_equal(got[b, h], want)
        if cap is None:
            assert dmod is None
        else:
            t = reproducible.det_tanh(s * (1.0 / cap))
            assert np.array_equal(dmod, 1.0 - t * t)
            assert (dmod >= 0).all() and (dmod <= 1).all()
