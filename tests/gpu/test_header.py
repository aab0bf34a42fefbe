"""The score-modifier hook of kernels/attention_common.cuh, compiled as host C++ by g++.

Every CUDA kernel sends its scaled scores through one hook of the header:
``ring_mods_load`` (a query head's parameters from the (H, RM_NMODS) block, times the
kernel's score unit: 1, or log2(e) in the base-2 tensor-core kernels), ``ring_modify``
(forward) and ``ring_modify_d`` (backward: also d s'/d s). They are ``RING_HD``
(``__host__ __device__`` under nvcc / NVRTC, plain inline C++ otherwise), so a tiny
harness compiled here with g++ (``-Wall -Wextra -Werror``) runs them on the CPU and
this test compares them with the numpy spec, :func:`ringmpi.scoremods.apply`, over
every combination of the registered modifiers: the float64 instantiation at 1e-14,
the float32 one against float64 numpy at 1e-6 relative (its derivative 1 - t^2 to
3e-7 absolute), and with unit = log2(e) the value times the unit and the same
derivative. The harness names no modifier: it hands the hook whole parameter rows
(NaN in the inactive slots and in the other head's row, which must not be read).
This is the only part of the CUDA arithmetic that runs without a GPU; the device's
own tanhf / tanh (CUDA's math library, not the host's libm used here) and every
kernel run only in tests/gpu/test_tile_device.py on a device. Also checked: the header's slot
defines match :mod:`ringmpi.scoremods`, the kernels (.cu) name no modifier, the loader
splices the header into both kernel modules, and its text is part of every kernel
cache key.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from ringmpi import scoremods
from ringmpi.runtime.kernel_files import kernel_path

LOG2E = 1.4426950408889634

HARNESS = r"""
#include <math.h>
#include <stdio.h>
#include "attention_common.cuh"

// first line: RM_NMODS RM_POS_MODS. Then per input line
//   prec mods unit pos qa kp x p[0] .. p[RM_NMODS - 1]
// -> ring_modify, ring_modify_d and its derivative, in A = float (prec 32) or double,
// with p the parameter row of head 1 (head 0's row is NaN: it must not be read)
template <typename A>
static void row(unsigned mods, double unit, int pos, long long qa, long long kp, double x,
                const double* p) {
  double mparam[2 * RM_NMODS];
  for (int i = 0; i < RM_NMODS; ++i) {
    mparam[i] = NAN;
    mparam[RM_NMODS + i] = p[i];
  }
  const RingMods<A> md = ring_mods_load(mods, mparam, 1, (A)unit);
  const A xs = (A)x * (A)unit;
  const A v = ring_modify(mods, md, xs, qa, kp, pos != 0);
  A d = (A)-7;
  const A vd = ring_modify_d(mods, md, xs, qa, kp, d, pos != 0);
  printf("%.17g %.17g %.17g\n", (double)v, (double)vd, (double)d);
}

int main(void) {
  printf("%d %u\n", RM_NMODS, (unsigned)RM_POS_MODS);
  int prec, pos;
  unsigned mods;
  double unit, x, p[RM_NMODS];
  long long qa, kp;
  while (scanf("%d %u %lf %d %lld %lld %lf", &prec, &mods, &unit, &pos, &qa, &kp, &x) == 7) {
    for (int i = 0; i < RM_NMODS; ++i)
      if (scanf("%lf", &p[i]) != 1) return 1;
    if (prec == 32) row<float>(mods, unit, pos, qa, kp, x, p);
    else row<double>(mods, unit, pos, qa, kp, x, p);
  }
  return 0;
}
"""

# sample parameter values per modifier (spec field); a new modifier adds its own here
# (the default: positive ones in [0.5, 50], others in [-1, 1])
SAMPLES = {
    "softcap": [0.5, 2.5, 15.0, 30.0, 50.0],
    "alibi_slopes": [0.5, 0.25, 2.0**-8, 0.0, 0.0625, -0.125],
}


def _sample(rng, m, n):
    if m.field in SAMPLES:
        return rng.choice(SAMPLES[m.field], n)
    return rng.uniform(0.5, 50.0, n) if m.positive else rng.uniform(-1.0, 1.0, n)


def _cases(n_per=60):
    """Every combination of the registered modifiers (and none), both units, pos on / off.

    Scores on both sides of a cap (and far past it), parameters from SAMPLES, distances
    to 2^22 (exact in float32).
    """
    rng = np.random.default_rng(11)
    combos = [
        sum(1 << m.slot for m in c)
        for r in range(len(scoremods.MODS) + 1)
        for c in itertools.combinations(scoremods.MODS, r)
    ]
    rows = []
    for bits, unit in itertools.product(combos, (1.0, LOG2E)):
        x = rng.choice([0.5, 3.0, 30.0, 150.0], n_per) * rng.uniform(-4, 4, n_per)
        x[:8] = [0.0, 1e-6, -1e-6, 3.0, -3.0, 200.0, -200.0, 0.25]
        qa = rng.integers(-(2**22), 2**22, n_per)
        kp = qa + rng.integers(-(2**21), 2**21, n_per)
        kp[:4] = qa[:4]  # distance 0
        pos = (rng.random(n_per) > 0.2).astype(int)
        params = np.full((n_per, scoremods.NMODS), np.nan)  # inactive slots: never read
        for m in scoremods.MODS:
            if bits >> m.slot & 1:
                params[:, m.slot] = _sample(rng, m, n_per)
        for i in range(n_per):
            rows.append((bits, unit, int(pos[i]), int(qa[i]), int(kp[i]), float(x[i]), params[i]))
    return rows


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
    cmd = [
        cxx,
        "-std=c++17",
        "-O2",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-I",
        str(inc),
        str(src),
        "-o",
        str(exe),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"{' '.join(cmd)}:\n{res.stderr}"
    return exe


def _run(exe, prec: int, rows):
    """(RM_NMODS, RM_POS_MODS), and per row (ring_modify, ring_modify_d, derivative)."""
    lines = [
        f"{prec} {bits} {unit!r} {pos} {qa} {kp} {x!r} " + " ".join(repr(float(v)) for v in p)
        for bits, unit, pos, qa, kp, x, p in rows
    ]
    res = subprocess.run(
        [str(exe)],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    head, *body = res.stdout.splitlines()
    out = np.array([[float(t) for t in ln.split()] for ln in body]).reshape(-1, 3)
    assert out.shape == (len(rows), 3), out.shape
    return tuple(int(t) for t in head.split()), out.T


def _spec(rows, prec: int):
    """The numpy spec per row: (value, derivative (1 where none), magnitude of the terms)."""
    dt = np.float64 if prec == 64 else np.float32
    val, der, mag = [], [], []
    for bits, unit, pos, qa, kp, x, p in rows:
        if not pos:  # no real positions: the position modifiers stay out
            bits &= ~sum(1 << m.slot for m in scoremods.MODS if m.positions)
        params = np.where(np.isnan(p), 0.0, p).astype(dt).astype(np.float64)[None, :]
        s = np.array([[float(dt(x))]])  # the score as the harness saw it (rounded to A)
        mods = scoremods.TileMods(bits, params, np.array([qa])) if bits else None
        f = scoremods.apply(s, mods, None, np.array([kp]), ())
        val.append(unit * s[0, 0])
        der.append(1.0 if f is None else float(np.asarray(f).reshape(-1)[0]))
        mag.append(unit * (abs(x) + np.abs(params).sum() * (1 + abs(qa - kp))))
    return np.array(val), np.array(der), np.array(mag)


def _close(name, got, want, atol):
    bad = np.abs(got - want) > atol
    assert not bad.any(), (
        f"{name}: {bad.sum()} of {len(want)} off, worst {got[bad][0]!r} vs {want[bad][0]!r}"
    )


@pytest.mark.parametrize("prec", [64, 32])
def test_modifier_hook_matches_numpy(harness, prec):
    rows = _cases()
    _, (val, val_d, der) = _run(harness, prec, rows)
    want, want_d, mag = _spec(rows, prec)
    rtol = 1e-14 if prec == 64 else 1e-6
    _close("ring_modify", val, want, rtol * mag)
    # forward and backward compute the same modified score
    assert np.array_equal(val, val_d), "ring_modify and ring_modify_d differ"
    # 1 - tanh^2 cancels where |x| >> c: in float32 t carries 6e-8, so the derivative is
    # good to that much absolutely (the numpy float32 spec computes the same 1 - t * t)
    _close("ring_modify_d derivative", der, want_d, 1e-14 if prec == 64 else 3e-7)
    plain = want_d == 1.0
    assert np.all(der[plain] == 1.0), "derivative not exactly 1 without a derivative term"
    assert np.isfinite(der).all()


def test_unit_scales_the_score_not_the_derivative(harness):
    """unit = log2(e) (the base-2 kernels): value times log2(e), the same derivative."""
    rows = [r for r in _cases() if r[1] == 1.0]
    base2 = [(b, LOG2E, *rest) for b, _, *rest in rows]
    _, (v1, _, d1) = _run(harness, 64, rows)
    _, (v2, _, d2) = _run(harness, 64, base2)
    _, _, mag = _spec(rows, 64)
    _close("value, unit log2(e)", v2, LOG2E * v1, 1e-14 * LOG2E * mag)
    _close("derivative, unit log2(e)", d2, d1, 1e-14)


def test_harness_comparison_can_fail(harness):
    """The comparison is not vacuous: a sign slip, a lost term or tanh's derivative missed."""
    rows = [r for r in _cases() if r[1] == 1.0 and r[2] == 1]
    _, (val, _, der) = _run(harness, 64, rows)
    want, want_d, mag = _spec(rows, 64)
    with pytest.raises(AssertionError, match="value"):
        _close("value", -val, want, 1e-14 * mag)
    for m in scoremods.MODS:  # leaving out any one modifier shows
        dropped = [(b & ~(1 << m.slot), *rest) for b, *rest in rows]
        w2, _, _ = _spec(dropped, 64)
        with pytest.raises(AssertionError, match=m.field):
            _close(m.field, val, w2, 1e-14 * mag)
    with pytest.raises(AssertionError, match="derivative"):
        _close("derivative", der, np.sqrt(want_d), 1e-14)


def test_header_slots_match_the_registry(harness):
    """RM_NMODS, one RM_MOD_<KEYWORD> per registered modifier at its slot, RM_POS_MODS."""
    (nmods, pos_mods), _ = _run(harness, 64, [])
    assert nmods == scoremods.NMODS
    assert pos_mods == sum(1 << m.slot for m in scoremods.MODS if m.positions)
    text = kernel_path("attention_common.cuh").read_text()
    slots = {k: int(v) for k, v in re.findall(r"^#define RM_MOD_(\w+)\s+(\d+)", text, re.M)}
    assert slots == {m.keyword.upper(): m.slot for m in scoremods.MODS}


def _code(text: str) -> str:
    """C/C++ text without its comments."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def test_kernels_name_no_modifier():
    """The seam: outside attention_common.cuh no kernel code names a score modifier."""
    words = set()
    for m in scoremods.MODS:
        words |= {m.keyword, *m.field.split("_")}
    words = {w.rstrip("s").lower() for w in words if len(w) > 3}
    for name in ("attention_fwd.cu", "attention_bwd.cu"):
        code = _code(kernel_path(name).read_text()).lower()
        found = sorted(w for w in words if w in code)
        assert not found, f"{name} names {found} outside comments"


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
