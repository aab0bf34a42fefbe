"""The score-modifier math of kernels/attention_common.cuh, compiled as host C++ by g++.

The header's softcap value and derivative and its ALiBi term are ``RING_HD``
(``__host__ __device__`` under nvcc / NVRTC, plain inline C++ otherwise), so a tiny
harness compiled here with g++ (``-Wall -Wextra -Werror``) runs them on the CPU and
this test compares them with numpy: the float64 instantiations against float64
numpy, the float32 ones against the float64 formula, at 1e-6 relative. This is the
only part of the CUDA arithmetic that runs without a GPU; the device's own tanhf /
tanh (CUDA's math library, not the host's libm used here) and every kernel run
only in tests/test_gpu.py on a device. Also checked: the loader splices the header
into both kernel modules, and its text is part of every kernel cache key.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest

from ringmpi.kernel_files import kernel_path

HARNESS = r"""
#include <stdio.h>
#include "attention_common.cuh"

// one line per input: x cap slope qa kp -> value grad alibi modify (A = float, double)
template <typename A> static void row(double x, double c, double s, long long qa, long long kp) {
  A grad = (A)0;
  const A v = softcap_apply((A)x, (A)c, grad);
  const A v2 = softcap_value((A)x, (A)c);
  const A al = alibi_term((A)s, qa, kp);
  const A mod = modify_score((A)x, (A)c, (A)s, qa, kp, true);
  const A plain = modify_score((A)x, (A)0, (A)s, qa, kp, true);  // no cap
  printf("%.17g %.17g %.17g %.17g %.17g %.17g\n", (double)v, (double)v2, (double)grad,
         (double)al, (double)mod, (double)plain);
}

int main(void) {
  double x, c, s;
  long long qa, kp;
  int prec;
  while (scanf("%d %lf %lf %lf %lld %lld", &prec, &x, &c, &s, &qa, &kp) == 6) {
    if (prec == 32) row<float>(x, c, s, qa, kp);
    else row<double>(x, c, s, qa, kp);
  }
  return 0;
}
"""


def _cases():
    """Inputs: scores on both sides of the cap (and far past it), slopes, distances to 2^22."""
    rng = np.random.default_rng(11)
    n = 400
    cap = rng.choice([0.5, 2.5, 15.0, 30.0, 50.0], n)
    x = cap * rng.uniform(-4, 4, n)
    x[:8] = [0.0, 1e-6, -1e-6, 3.0, -3.0, 200.0, -200.0, 0.25]
    slope = rng.choice([0.5, 0.25, 2.0**-8, 0.0, 0.0625, -0.125], n)
    qa = rng.integers(-(2**22), 2**22, n)
    kp = qa + rng.integers(-(2**21), 2**21, n)
    kp[:4] = qa[:4]  # distance 0
    return x, cap, slope, qa, kp


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """Path of the compiled harness (g++, or $CXX); skipped, saying so, without a C++ compiler.

    (CI's machine is promised Python and gcc only; where g++ is missing this host check
    of the header cannot run. ``RINGMPI_REQUIRE_CXX=1`` turns the skip into a failure.)
    """
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        why = "no C++ compiler (g++, c++ or $CXX): the header's host check did not run"
        if os.environ.get("RINGMPI_REQUIRE_CXX") == "1":
            pytest.fail(why)
        pytest.skip(why)
    d = tmp_path_factory.mktemp("header")
    src = d / "harness.cpp"
    src.write_text(HARNESS)
    exe = d / "harness"
    inc = kernel_path("attention_common.cuh").parent
    cmd = [cxx, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-I", str(inc),
           str(src), "-o", str(exe)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"{' '.join(cmd)}:\n{res.stderr}"
    return exe


def _run(exe, prec: int):
    x, cap, slope, qa, kp = _cases()
    rows = zip(x.tolist(), cap.tolist(), slope.tolist(), qa.tolist(), kp.tolist())
    lines = [f"{prec} {a!r} {b!r} {c!r} {d} {e}" for a, b, c, d, e in rows]
    res = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True,
                         text=True, timeout=60, check=True)  # fmt: skip
    out = np.array([[float(t) for t in ln.split()] for ln in res.stdout.splitlines()])
    assert out.shape == (len(x), 6), out.shape
    return (x, cap, slope, qa, kp), out.T


def _close(name, got, want, rtol=1e-6, atol=0.0):
    err = np.abs(got - want)
    bad = err > rtol * np.abs(want) + atol
    assert not bad.any(), (
        f"{name}: {bad.sum()} of {len(want)} off, worst {got[bad][0]!r} vs {want[bad][0]!r}"
    )


@pytest.mark.parametrize("prec", [64, 32])
def test_modifier_functions_match_numpy(harness, prec):
    (x, cap, slope, qa, kp), (val, val2, grad, al, mod, plain) = _run(harness, prec)
    dt = np.float64 if prec == 64 else np.float32
    # the inputs as the harness saw them (rounded to A), then float64 numpy formulas
    xa, ca, sa = (np.asarray(a, dtype=dt).astype(np.float64) for a in (x, cap, slope))
    t = np.tanh(xa / ca)
    _close("softcap value", val, ca * t)
    _close("softcap_value", val2, ca * t)
    # 1 - tanh^2 cancels where |x| >> c: in float32 t carries 6e-8, so the derivative is
    # good to that much absolutely (the numpy float32 spec computes the same 1 - t * t)
    _close("softcap derivative", grad, 1 - t * t, atol=0.0 if prec == 64 else 3e-7)
    dist = np.abs(qa - kp).astype(np.float64)
    _close("alibi term", al, -sa * dist)
    _close("modify_score (softcap, then ALiBi)", mod, ca * t - sa * dist,
           atol=1e-6 * np.abs(ca * t).max())  # fmt: skip
    _close("modify_score (ALiBi only)", plain, xa - sa * dist, atol=1e-6 * np.abs(xa).max())
    assert np.all(np.abs(val) <= ca) and np.all((grad >= 0) & (grad <= 1))


def test_harness_comparison_can_fail(harness):
    """The comparison above is not vacuous: a sign slip or tanh's derivative missed fails it."""
    (x, cap, _, qa, kp), (val, _, grad, al, _, _) = _run(harness, 64)
    t = np.tanh(x / cap)
    with pytest.raises(AssertionError, match="alibi"):
        _close("alibi", al, np.abs(qa - kp) * 0.5)
    with pytest.raises(AssertionError, match="derivative"):
        _close("derivative", grad, 1 - t)
    with pytest.raises(AssertionError, match="value"):
        _close("value", val, x)


def test_header_is_spliced_into_both_modules_and_keys_the_cache(tmp_path, monkeypatch):
    """Each module's text holds the header once; a changed header changes every cache key."""
    from ringmpi.gpu import loader, sources

    header = kernel_path("attention_common.cuh").read_text()
    body = "template <typename A> RING_HD A softcap_apply(A x, A cap, A& grad) {"
    for name in (sources.FORWARD_FILE, sources.BACKWARD_FILES):
        code = sources.source(name)
        assert code.count("#define RM_ATTENTION_COMMON_CUH") == 1, name
        assert body in code, name
        assert not any(ln.lstrip().startswith('#include "') for ln in code.splitlines()), name
    # a copy of the kernels dir with one byte of the header changed: other code, other keys
    for f in ("attention_fwd.cu", "attention_bwd.cu", "attention_common.cuh"):
        (tmp_path / f).write_text(kernel_path(f).read_text())
    monkeypatch.setenv("RINGMPI_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr("ringmpi.gpu.nvrtc.version", lambda: (12, 9))
    expr = "attn_bwd_dq_simt<float, float, 64, 32, 32>"
    before = loader._paths(sources.source(sources.BACKWARD_FILES), expr, "sm_90")
    (tmp_path / "attention_common.cuh").write_text(header.replace("RING_LN2 0.69", "RING_LN2 0.7"))
    after = loader._paths(sources.source(sources.BACKWARD_FILES), expr, "sm_90")
    assert before[0] != after[0]
    # only the kernels' own header may be included, and only from beside the .cu file
    (tmp_path / "attention_fwd.cu").write_text('#include "other.cuh"\n')
    with pytest.raises(ValueError, match="include only"):
        sources.source(sources.FORWARD_FILE)
    (tmp_path / "attention_fwd.cu").write_text('#include "attention_common.cuh"\n')
    (tmp_path / "attention_common.cuh").unlink()
    with pytest.raises(FileNotFoundError, match="attention_common.cuh"):
        sources.source(sources.FORWARD_FILE)
