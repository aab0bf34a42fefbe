"""The fused C tiles with the score modifiers of issue 25: softcap and ALiBi.

Each case runs a ring in one process: every query rank of P = 3 folds every rank's K/V
block (positions of ``ringmpi.positions``, all three layouts, so zigzag / striped / packed
positions are non-contiguous), once with the numpy tile (the specification) and once
with the fused kernel of each ISA path the host executes (``fused.load``: avx512, avx2
and scalar on an AVX-512 machine). The assembled result is compared with the dense
float64 reference (:func:`ringmpi.reference.attention` with ``softcap`` and
``alibi_slopes``) by the suite's rule (twice the float32 dense peer's error), every
state with the numpy tile's. Inputs are shaped like real data
(``random_qkv(..., realistic=True)``: nonzero means, small value spread, sink keys).

The backward tiles likewise: call by call equal to the numpy tile's gradients, assembled
within the suite's backward rule (three times the float32 dense peer's error, plus the
budget of a float32 lse) of :func:`ringmpi.reference.attention_backward` with the
modifiers (softcap's dS includes tanh's derivative).

The seam (issue 21): the tiles take the modifiers as the parameter block of
:func:`ringmpi.scoremods.pack` (kernel arguments ``(mods, mparam, mpos)``); the C header's
slots match the registry, unknown keywords and slots a build lacks are refused, and
builds from before the seam (benchmarks/kernel_ab.py's baselines) still run plain calls.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import ringmpi
from ringmpi import reference, scoremods
from ringmpi.cpu import build, fused, fused_backward
from ringmpi.cpu import isa as cpu_isa
from ringmpi.cpu import numpy_tile as spec
from ringmpi.layout import positions
from ringmpi.mask import make_mask
from ringmpi.runtime.kernel_files import kernel_path
from ringmpi.softmax import finalize, init_state
from ringmpi.testing import assert_close, lse_budget, random_qkv, tolerance

pytestmark = pytest.mark.skipif(
    not fused.available(), reason=f"fused kernel unavailable: {fused.unavailable_reason()}"
)

ISAS = cpu_isa.host_isas() if fused.available() else ()
H, HKV, D, P = 4, 2, 24, 3  # GQA; D not a multiple of the vector width
LENGTHS = (3, 157, 1, 239, 113)
CU = np.concatenate(([0], np.cumsum(LENGTHS)))
NP = int(CU[-1])  # 513
SLOPES = np.array([0.5, 0.125, 2.0**-5, 0.0])  # per query head; one head without ALiBi
CAP = 4.0  # bites: realistic scores reach about 10

# name: (nq, nk, causal, mask keywords)
MASKS = {
    "causal": (500, 500, True, {}),
    "full": (500, 500, False, {}),
    "window 37,20": (500, 500, False, dict(window=(37, 20))),
    "packed causal": (NP, NP, True, dict(cu_seqlens=CU)),
    "window + packed": (NP, NP, False, dict(window=(20, 30), cu_seqlens=CU)),
    "cross 200x500 causal": (200, 500, True, {}),
    "cross 500x200 causal (empty rows)": (500, 200, True, {}),
}
MODS = {"softcap": dict(softcap=CAP), "alibi": dict(alibi_slopes=SLOPES), "both": {}}
MODS["both"] = dict(softcap=CAP, alibi_slopes=SLOPES)

# states of the fused and the numpy tile: float32 exp/tanh within a few ulps over ~500 terms
TOL = {np.float32: dict(rtol=2e-5, atol=2e-6), np.float64: dict(rtol=1e-12, atol=1e-13)}


@functools.cache
def _problem(mask_name: str, mod_name: str, dtype):
    """Inputs (S, H, D), the mask, the float64 reference (out, lse) and the float32 peer."""
    nq, nk, causal, kw = MASKS[mask_name]
    rng = np.random.default_rng(sorted(MASKS).index(mask_name))
    q, k, v = random_qkv(rng, nq, H, HKV, D, dtype=dtype, realistic=True, nk=nk)
    mods = MODS[mod_name]
    mask = make_mask(nq, nk, causal, **kw)
    ref = reference.attention(q, k, v, causal, **kw, **mods)
    peer = None
    if dtype != np.float64:
        peer = reference.attention(q, k, v, causal, dtype=np.float32, **kw, **mods)
    return q, k, v, mask, ref, peer


def _heads(x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Rows ``pos`` of a (S, H, D) array in the tiles' layout (1, H, n, D), C-contiguous."""
    return np.ascontiguousarray(np.moveaxis(x[pos], 0, 1))[None]


def _tile_kw(mask, q_pos, mod_name: str) -> dict:
    """The tile keywords of one query rank: mask bounds (or causal) and the modifiers."""
    mods = MODS[mod_name]
    kw = dict(scale=D**-0.5, causal=mask.causal)
    if not mask.plain:
        kw["bounds"] = mask.bounds(q_pos)
    if "softcap" in mods:
        kw["softcap"] = mods["softcap"]
    if "alibi_slopes" in mods:
        kw["alibi"] = (SLOPES, mask.alibi_positions(q_pos))
    return kw


def _ring(mask_name, mod_name, dtype, layout, tiles):
    """Every tile's (out (S, H, D), lse (H, S)) over P ranks; states checked against numpy's."""
    q, k, v, mask, _, _ = _problem(mask_name, mod_name, dtype)
    outs = {name: (np.zeros(q.shape), np.zeros((H, mask.nq))) for name in tiles}
    k_ranks = [positions(mask.nk, r, P, layout, cu_seqlens=mask.cu_k) for r in range(P)]
    for r in range(P):
        q_pos = positions(mask.nq, r, P, layout, cu_seqlens=mask.cu_q)
        qi = _heads(q, q_pos)
        kw = _tile_kw(mask, q_pos, mod_name)
        states = {name: init_state(qi.shape, dtype) for name in tiles}
        for k_pos in k_ranks:
            ki, vi = _heads(k, k_pos), _heads(v, k_pos)
            for name, tile in tiles.items():
                tile(qi, ki, vi, q_pos, k_pos, *states[name], **kw)
            for name in tiles:
                for a, b in zip(states[name], states["numpy"]):
                    np.testing.assert_allclose(a, b, **TOL[dtype], err_msg=f"{name} {r}")
        for name, st in states.items():
            out, lse = finalize(*st)
            outs[name][0][q_pos] = np.moveaxis(out[0], 0, 1)
            outs[name][1][:, q_pos] = lse[0]
    return outs


def _check(got, ref, peer, dtype, what):
    """The suite's rule: within twice the float32 peer's error (float64: relative 1e-12)."""
    for name, a, want, pw in zip(("out", "lse"), got, ref, peer or (None, None)):
        fin = np.isfinite(want)
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(want), err_msg=what)
        tol = tolerance(want, pw, dtype=np.dtype(dtype).name)
        err = float(np.abs(a[fin] - want[fin]).max(initial=0.0))
        assert err <= tol, f"{what} {name}: error {err:.3g} > tolerance {tol:.3g}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mod_name", sorted(MODS))
@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_forward_matches_numpy_tile_and_reference(mask_name, mod_name, dtype):
    """Fused forward (every ISA path) == numpy tile (states) and dense float64 (result)."""
    q, k, v, mask, ref, peer = _problem(mask_name, mod_name, dtype)
    tiles = {"numpy": spec.forward_tile, **{isa: fused.load(isa).forward_tile for isa in ISAS}}
    layouts = ringmpi.LAYOUTS if mask_name in ("causal", "window + packed") else ("zigzag",)
    for layout in layouts:
        outs = _ring(mask_name, mod_name, dtype, layout, tiles)
        for name, got in outs.items():
            _check(got, ref, peer, dtype, f"{name} {layout} {mask_name} {mod_name}")


@pytest.mark.skipif(
    not {"avx512", "avx2"} <= set(ISAS), reason="needs a CPU that runs both AVX-512 and AVX2"
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mask_name", ["causal", "window 37,20", "window + packed"])
def test_forward_avx2_and_avx512_agree_bit_for_bit(mask_name, dtype):
    """Softcap + ALiBi keep the two vector paths bit-identical (same tanh operations)."""
    q, k, v, mask, _, _ = _problem(mask_name, "both", dtype)
    for layout in ringmpi.LAYOUTS:
        q_pos = positions(mask.nq, 1, P, layout, cu_seqlens=mask.cu_q)
        k_pos = positions(mask.nk, 2, P, layout, cu_seqlens=mask.cu_k)
        qi, ki, vi = _heads(q, q_pos), _heads(k, k_pos), _heads(v, k_pos)
        kw = _tile_kw(mask, q_pos, "both")
        st = init_state(qi.shape, dtype)
        init = (st[0] + 0.5, np.full_like(st[1], 1.0), np.full_like(st[2], 2.0))  # non-empty
        for start in (st, init):
            got = []
            for isa in ("avx512", "avx2"):
                s = tuple(a.copy() for a in start)
                fused.load(isa).forward_tile(qi, ki, vi, q_pos, k_pos, *s, **kw)
                got.append(s)
            for a, c in zip(*got):
                np.testing.assert_array_equal(a, c, err_msg=f"{mask_name} {layout}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernel_tanh_within_a_few_ulps(isa, dtype):
    """The tiles' tanh against float64 numpy: at most 4 ulps, +-1 far out, NaN kept."""
    x = np.concatenate([np.linspace(-50, 50, 100001), np.geomspace(1e-30, 60, 50001)])
    x = np.concatenate([x, -x[100001:], [0.0, np.inf, -np.inf]]).astype(dtype)
    y = fused.load(isa).tanh(x)
    want = np.tanh(x.astype(np.float64))
    ulps = np.abs(y - want) / np.spacing(np.abs(want).astype(dtype)).astype(np.float64)
    assert ulps.max() <= 4, (isa, float(ulps.max()), x[np.argmax(ulps)])
    assert (y[x > 45] == 1).all() and (y[x < -45] == -1).all()
    assert np.isnan(fused.load(isa).tanh(np.array([np.nan, 1.0], dtype=dtype))[0])


def test_bad_modifiers_are_refused():
    """A clear ValueError for a bad softcap or ALiBi argument, before the kernel runs."""
    q, k, v, mask, _, _ = _problem("causal", "both", np.float32)
    pos = np.arange(mask.nq, dtype=np.int64)
    qi, ki, vi = _heads(q, pos), _heads(k, pos), _heads(v, pos)
    st = init_state(qi.shape, np.float32)
    kern = fused.load(ISAS[0])
    bad = [
        (dict(softcap=0.0), "softcap"),
        (dict(softcap=float("nan")), "softcap"),
        (dict(alibi=(SLOPES[:2], pos)), "slopes"),
        (dict(alibi=(np.array([np.inf, 0, 0, 0]), pos)), "slopes"),
        (dict(alibi=(SLOPES, pos[:-1])), "positions"),
        (dict(alibi=SLOPES), "pair"),
    ]
    for kw, word in bad:
        with pytest.raises(ValueError, match=word):
            kern.forward_tile(qi, ki, vi, pos, pos, *st, scale=0.2, causal=True, **kw)


# fused vs numpy backward tile, relative to the largest entry
GTOL = {np.float32: 2e-5, np.float64: 1e-12}
BACKWARD_MASKS = ["causal", "window 37,20", "window + packed", "cross 500x200 causal (empty rows)"]


@functools.cache
def _backward_problem(mask_name: str, mod_name: str):
    """float64 inputs, dout, the reference (out, lse) and gradients; the float32 peer's."""
    q, k, v, mask, ref, _ = _problem(mask_name, mod_name, np.float64)
    _, _, causal, kw = MASKS[mask_name]
    mods = MODS[mod_name]
    dout = 0.3 + 0.1 * np.random.default_rng(7).standard_normal(q.shape)
    grads = reference.attention_backward(dout, q, k, v, causal, **kw, **mods)
    args = [a.astype(np.float32) for a in (dout, q, k, v)]
    peer = reference.attention_backward(*args, causal, dtype=np.float32, **kw, **mods)
    return q, k, v, dout, mask, ref, grads, peer


@functools.cache
def _bw_lib(isa: str):
    return fused_backward.open_library(build.build_library("cpu_backward.c", isa))


def _close(got, want, dtype, what):
    err = float(np.abs(got - want).max(initial=0.0))
    bound = GTOL[dtype] * max(1.0, float(np.abs(want).max(initial=0.0)))
    assert err <= bound, f"{what}: {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mod_name", sorted(MODS))
@pytest.mark.parametrize("mask_name", BACKWARD_MASKS)
def test_backward_matches_numpy_tile_and_reference(mask_name, mod_name, dtype):
    """Fused backward (every ISA path) == numpy tile per call; assembled == dense float64."""
    q, k, v, dout, mask, (out, lse), ref, peer = _backward_problem(mask_name, mod_name)
    tiles = {"numpy": spec.backward_tile}
    for isa in ISAS:
        tiles[isa] = functools.partial(fused_backward.backward_tile_with, _bw_lib(isa))
    layouts = ringmpi.LAYOUTS if mask_name == "window + packed" else ("zigzag",)
    for layout in layouts:
        grads = {t: [np.zeros(x.shape) for x in (q, k, v)] for t in tiles}
        k_ranks = [positions(mask.nk, r, P, layout, cu_seqlens=mask.cu_k) for r in range(P)]
        for r in range(P):
            qp = positions(mask.nq, r, P, layout, cu_seqlens=mask.cu_q)
            kw = _tile_kw(mask, qp, mod_name)
            qi, doi = _heads(q, qp).astype(dtype), _heads(dout, qp).astype(dtype)
            lse_i = np.ascontiguousarray(lse[None][:, :, qp]).astype(dtype)
            delta = np.sum(doi * _heads(out, qp).astype(dtype), axis=-1)
            dq = {t: np.zeros_like(qi) for t in tiles}
            for kp in k_ranks:
                ki, vi = _heads(k, kp).astype(dtype), _heads(v, kp).astype(dtype)
                dk = {t: np.zeros_like(ki) for t in tiles}
                dv = {t: np.zeros_like(vi) for t in tiles}
                for t, fn in tiles.items():
                    fn(qi, ki, vi, doi, lse_i, delta, qp, kp, dq[t], dk[t], dv[t], **kw)
                for t in tiles:
                    _close(dk[t], dk["numpy"], dtype, f"{t}: dk {r} {layout}")
                    _close(dv[t], dv["numpy"], dtype, f"{t}: dv {r} {layout}")
                    grads[t][1][kp] += np.moveaxis(dk[t][0], 0, 1)
                    grads[t][2][kp] += np.moveaxis(dv[t][0], 0, 1)
            for t in tiles:
                _close(dq[t], dq["numpy"], dtype, f"{t}: dq {r} {layout}")
                grads[t][0][qp] = np.moveaxis(dq[t][0], 0, 1)
        for t, got in grads.items():
            for i, name in enumerate(("dq", "dk", "dv")):
                p = None if dtype == np.float64 else peer[i]
                extra = 0.0 if p is None else lse_budget(lse.astype(dtype), lse, ref[i])
                what = f"{t} {layout} {mask_name} {mod_name}: {name}"
                assert_close(MPI.COMM_SELF, got[i], ref[i], p, what, factor=3.0, extra=extra)


def _small(dtype=np.float32):
    """Tile arguments of one small causal call: (q, k, v, pos, state, backward extras)."""
    q, k, v, mask, _, _ = _problem("causal", "both", dtype)
    pos = np.arange(mask.nq, dtype=np.int64)
    qi, ki, vi = _heads(q, pos), _heads(k, pos), _heads(v, pos)
    st = init_state(qi.shape, dtype)
    out, lse = finalize(*st)
    extra = (qi, lse, np.zeros(lse.shape, dtype))  # dout, lse, delta (values do not matter)
    return qi, ki, vi, pos, st, extra


def test_header_slots_match_the_registry():
    """kernels/cpu_simd_type.h: RM_NMODS and RM_MOD_<KEYWORD> as ringmpi.scoremods says;
    every build reports all the registered slots (rm_tile_mods, rm_backward_mods)."""
    text = kernel_path("cpu_simd_type.h").read_text()
    defs = {k: int(v) for k, v in re.findall(r"#define (RM_NMODS|RM_MOD_\w+) +(\d+)", text)}
    assert defs.pop("RM_NMODS") == scoremods.NMODS
    assert defs == {f"RM_MOD_{m.keyword.upper()}": m.slot for m in scoremods.MODS}
    every = sum(1 << m.slot for m in scoremods.MODS)
    for isa in ISAS:
        assert fused.load(isa).mods == every
        assert fused_backward.LOADER.load(isa).mods == every


def test_unknown_modifier_keyword_is_a_type_error():
    """A keyword that is no score modifier: TypeError from scoremods.pack, in both tiles."""
    qi, ki, vi, pos, st, (do, lse, delta) = _small()
    kern, lib = fused.load(ISAS[0]), _bw_lib(ISAS[0])
    with pytest.raises(TypeError, match="unknown score modifier keyword 'sofcap'"):
        kern.forward_tile(qi, ki, vi, pos, pos, *st, scale=0.2, causal=True, sofcap=3.0)
    grads = (np.zeros_like(qi), np.zeros_like(ki), np.zeros_like(vi))
    with pytest.raises(TypeError, match="unknown score modifier keyword 'sofcap'"):
        fused_backward.backward_tile_with(
            lib, qi, ki, vi, do, lse, delta, pos, pos, *grads, scale=0.2, causal=True, sofcap=3.0
        )


def test_a_build_without_a_slot_refuses_it(monkeypatch):
    """A build that lacks a slot (Library.mods) refuses that modifier, runs the others."""
    qi, ki, vi, pos, st, (do, lse, delta) = _small()
    kern, lib = fused.load(ISAS[0]), _bw_lib(ISAS[0])
    softcap_only = 1 << next(m.slot for m in scoremods.MODS if m.keyword == "softcap")
    monkeypatch.setattr(kern, "mods", softcap_only)
    monkeypatch.setattr(lib, "ringmpi_mods", softcap_only)
    alibi = (SLOPES, pos)
    with pytest.raises(ValueError, match="without the score modifiers alibi_slopes"):
        kern.forward_tile(qi, ki, vi, pos, pos, *st, scale=0.2, causal=True, alibi=alibi)
    grads = (np.zeros_like(qi), np.zeros_like(ki), np.zeros_like(vi))
    with pytest.raises(ValueError, match="without the score modifiers alibi_slopes"):
        fused_backward.backward_tile_with(
            lib,
            qi,
            ki,
            vi,
            do,
            lse,
            delta,
            pos,
            pos,
            *grads,
            scale=0.2,
            causal=True,
            alibi=alibi,
        )
    kern.forward_tile(qi, ki, vi, pos, pos, *st, scale=0.2, causal=True, softcap=CAP)


#: the last revision whose kernels take (softcap, slopes, apos) instead of (mods, mparam, mpos)
BEFORE_SEAM = "0b83dfe"
ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True).stdout


def test_builds_from_before_the_seam_run_plain_calls(tmp_path, monkeypatch):
    """benchmarks/kernel_ab.py's baselines: a build of the kernels before the seam runs plain calls
    (the same bits as the current build) and refuses every modifier."""
    try:
        names = _git("ls-tree", "--name-only", f"{BEFORE_SEAM}:kernels").decode().split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"revision {BEFORE_SEAM} is not in this checkout")
    for name in names:
        if name.endswith((".c", ".h")):
            (tmp_path / name).write_bytes(_git("show", f"{BEFORE_SEAM}:kernels/{name}"))
    isa = ISAS[0]
    monkeypatch.setenv("RINGMPI_KERNEL_DIR", str(tmp_path))
    old_fwd = fused.Kernel(build.build_library("cpu_tile.c", isa))
    old_bwd = fused_backward.BackwardKernel(build.build_library("cpu_backward.c", isa))
    monkeypatch.delenv("RINGMPI_KERNEL_DIR")
    assert old_fwd.mods == 0 and old_bwd.mods == 0
    qi, ki, vi, pos, st, _ = _small()
    states, grads = [], []
    for fwd, bwd in ((old_fwd, old_bwd), (fused.load(isa), fused_backward.LOADER.load(isa))):
        s = tuple(a.copy() for a in st)
        fwd.forward_tile(qi, ki, vi, pos, pos, *s, scale=0.2, causal=True)
        out, lse = fwd.finalize(*s)
        g = (np.zeros_like(qi), np.zeros_like(ki), np.zeros_like(vi))
        delta = (qi * out).sum(-1)
        fused_backward.backward_tile_with(
            bwd, qi, ki, vi, qi, lse, delta, pos, pos, *g, scale=0.2, causal=True
        )
        states.append(s)
        grads.append(g)
    for a, b in zip(states[0] + grads[0], states[1] + grads[1]):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="without the score modifiers softcap"):
        old_fwd.forward_tile(qi, ki, vi, pos, pos, *st, scale=0.2, causal=True, softcap=CAP)
    g = (np.zeros_like(qi), np.zeros_like(ki), np.zeros_like(vi))
    with pytest.raises(ValueError, match="without the score modifiers alibi_slopes"):
        fused_backward.backward_tile_with(
            old_bwd,
            qi,
            ki,
            vi,
            qi,
            lse,
            delta,
            pos,
            pos,
            *g,
            scale=0.2,
            causal=True,
            alibi=(SLOPES, pos),
        )
