"""Helpers of the conformance suite (tests/test_backend_conformance.py).

Every registered tile against the spec.

A *variant* is one registered tile backend as it runs here: ``numpy`` (the spec itself),
``fused-<isa>`` for every ISA path the host executes (the fused backend with its default
kernels pointed at that path's builds, in this process), and ``gpu-standin`` (the GPU
backend on the CuPy stand-in of tests/tools/standin.py: its Python side, argument checks
and launch plans; the arithmetic there is the numpy tile's, no CUDA runs). Tiles are
called through the :class:`ringmpi.backend.Backend` that ``select`` returns: what is
checked is what the ring loops run. A *case* is a mask (with shapes: odd sizes, GQA,
batch) and a *modifier* set, on values shaped like real data (``random_qkv(realistic=True)``:
means, small value spread, huge sink keys). Every query row is fed in the case layout's
order; the keys come in ``blocks`` visiting K/V blocks of that layout, folded one after
the other into one state (forward) or one dq (backward).
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional
from unittest import mock

import numpy as np

import ringmpi
from ringmpi import backend, gpu, scoremods, softmax
from ringmpi.cpu import fused, fused_backward
from ringmpi.cpu import isa as cpu_isa
from ringmpi.mask import mask_of, tile_modifiers
from ringmpi.reference import attention, attention_backward
from ringmpi.spec import AttentionSpec
from ringmpi.testing import dense, dense_backward, random_qkv

from . import standin

__all__ = [
    "Case",
    "CASES",
    "MODS",
    "SLOPES",
    "FUSED",
    "VARIANTS",
    "TOL",
    "Variant",
    "registry_names",
    "variant",
    "Problem",
    "problem",
    "spec_of",
    "run_forward",
    "run_backward",
    "visible_pairs",
    "close",
    "spec_result",
    "storage",
]

#: tile vs the numpy tile (the spec), relative to max(1, max |spec|): the same terms summed
#: in another order (float32: a few hundred terms, exp within a few ulps; float64 ~1e-15)
TOL = {"float16": 2e-5, "bfloat16": 2e-5, "float32": 2e-5, "float64": 1e-12}

#: whether the fused C tiles (forward and backward) build here (no C compiler: they do not)
FUSED = fused.available() and fused_backward.available()
#: variants: the registered backends as they run on this host (see the module docstring)
VARIANTS = ("numpy", *(f"fused-{isa}" for isa in cpu_isa.host_isas() if FUSED), "gpu-standin")

PACKED = (0, 3, 97, 98, 211)  # 211 tokens: sequences of 3, 94, 1 and 113


@dataclass(frozen=True)
class Case:
    """One mask with its shapes.

    Attributes
    ----------
    nq, nk : int
        Query and key tokens (cross-attention when different: causal aligned bottom-right).
    causal, window, cu_q, cu_k
        The mask, as :func:`ringmpi.ring_attention` takes it.
    b, h, hkv, d : int
        Batch, query heads, key/value heads (GQA when h > hkv), head dim (key width).
    dv : int, optional
        Value width, default d (keys and values of different widths: multi-head
        latent attention, issue 42).
    layout : str
        Order of the query rows (those of ranks 0 and 1 of 2) and the visiting key blocks.
    blocks : int
        Visiting K/V blocks (those of ranks 0 .. blocks-1 of the layout).
    """

    nq: int
    nk: int
    causal: bool = False
    window: Optional[tuple] = None
    cu_q: Optional[tuple] = None
    cu_k: Optional[tuple] = None
    b: int = 1
    h: int = 4
    hkv: int = 2
    d: int = 64
    layout: str = "zigzag"
    blocks: int = 3
    dv: Optional[int] = None

    @property
    def width_v(self) -> int:
        """The value width Dv."""
        return self.d if self.dv is None else self.dv


CASES = {
    "none": Case(203, 203, layout="contiguous"),
    "causal": Case(203, 203, causal=True, b=2, h=3, hkv=1, d=59),
    "window": Case(250, 250, window=(37, 20), layout="striped"),
    "window_causal": Case(250, 250, causal=True, window=(64, 0), d=59),
    "window_left": Case(181, 181, window=(25, -1), h=2, hkv=2),  # one-sided: no right bound
    "window_right": Case(181, 181, window=(-1, 15), d=59, layout="striped"),
    "packed_causal": Case(211, 211, causal=True, cu_q=PACKED, d=59),
    "packed_window": Case(211, 211, window=(20, 7), cu_q=PACKED, layout="striped"),
    "cross_causal": Case(77, 203, causal=True, h=6, hkv=2, d=59),  # bottom-right
    "cross_packed": Case(90, 200, causal=True, cu_q=(0, 40, 41, 90), cu_k=(0, 100, 103, 200)),
    # keys 0..139 are hidden from every query: two of the three tile calls see nothing
    "cross_window": Case(40, 200, causal=True, window=(20, 0), layout="contiguous"),
    # rows 0..141 see no key (bottom-right causal, Lq > Lk); the middle packed query
    # sequence of empty_packed has no keys at all
    "empty_rows": Case(203, 61, causal=True, d=59, layout="contiguous", blocks=2),
    "empty_packed": Case(120, 90, cu_q=(0, 50, 70, 120), cu_k=(0, 45, 45, 90), window=(9, 3)),
    # keys and values of different widths (multi-head latent attention): wider keys than
    # values under MQA, narrow keys with wide values, the unabsorbed MLA head shape
    "widths_causal": Case(203, 203, causal=True, h=4, hkv=1, d=40, dv=24),
    "widths_window": Case(181, 181, window=(30, 9), d=8, dv=64, layout="striped"),
    "widths_packed": Case(211, 211, causal=True, cu_q=PACKED, d=40, dv=24, h=6, hkv=2),
    "widths_cross": Case(77, 150, causal=True, h=2, hkv=2, d=192, dv=128, blocks=2),
}

#: ALiBi slopes in :data:`MODS`: the case's own (:func:`_slopes` of its heads)
SLOPES = "slopes of the case's heads"
#: score modifier sets: name -> spec fields (a set of one runs on fewer masks, see
#: test_backend_conformance.py); sinks act at finalize and are tested through ring_attention
#: (test_backend_conformance.py::test_sinks_through_ring_attention)
MODS = {
    "plain": {},
    "softcap": {"softcap": 4.0},
    "alibi": {"alibi_slopes": SLOPES},
    "both": {"softcap": 4.0, "alibi_slopes": SLOPES},
}


def _slopes(h: int) -> tuple:
    """ALiBi slopes 2^-2, 2^-4, ... for h heads, the last one 0 (a head without bias)."""
    s = [2.0 ** (-2 * (i + 1)) for i in range(h)]
    s[-1] = 0.0
    return tuple(s)


def spec_of(case: str, mod: str) -> AttentionSpec:
    """The validated :class:`AttentionSpec` of a case and modifier set."""
    c = CASES[case]
    fields = {f: _slopes(c.h) if v is SLOPES else v for f, v in MODS[mod].items()}
    return AttentionSpec(
        causal=c.causal, window=c.window, cu_seqlens=c.cu_q, cu_seqlens_k=c.cu_k, **fields
    ).validate()


def registry_names() -> set:
    """The tile backends :mod:`ringmpi.backend` can build (its ``_<name>_backend`` factories)."""
    names = [n for n in vars(backend) if n.startswith("_") and n.endswith("_backend")]
    return {n[1 : -len("_backend")] for n in names if callable(getattr(backend, n))}


@dataclass
class Variant:
    """One variant's backend and its array module (numpy, or the CuPy stand-in)."""

    name: str
    be: backend.Backend
    xp: Any

    def to_dev(self, x):
        """A host array on this variant's device (C-contiguous)."""
        return self.xp.asarray(np.ascontiguousarray(x))

    def to_host(self, x) -> np.ndarray:
        """A device array back on the host."""
        return x if isinstance(x, np.ndarray) else self.xp.asnumpy(x)


@contextmanager
def _fused_isa(isa: str):
    """The fused backend's default kernels (forward and backward) built for ``isa``.

    Pins the defaults of :mod:`ringmpi.cpu.fused` and :mod:`ringmpi.cpu.fused_backward`
    to that path's builds (``LOADER.pinned``: what ``$RINGMPI_CPU_ISA`` selects in a fresh
    process) and restores them afterwards.
    """
    with fused.LOADER.pinned(isa), fused_backward.LOADER.pinned(isa):
        yield


@contextmanager
def variant(name: str):
    """The registered backend of variant ``name`` (one of :data:`VARIANTS`), for a block."""
    kind, _, isa = name.partition("-")
    if kind == "gpu":
        with standin.installed() as cupy:
            yield Variant(name, backend.select(cupy.zeros(1, dtype=np.float32)), cupy)
        return
    with mock.patch.dict(os.environ, RINGMPI_CPU_KERNEL=kind):
        if kind == "fused":
            with _fused_isa(isa):
                be = backend.select(np.zeros(1))
                if be.describe().count(f"fused C ({isa})") != 2:  # the switch did not take
                    raise RuntimeError(f"{name}: the backend runs {be.describe()!r}")
                yield Variant(name, be, np)
        else:
            yield Variant(name, backend.select(np.zeros(1)), np)


def _head_major(x: np.ndarray, idx) -> np.ndarray:
    """(B, N, H, D) global -> (B, H, len(idx), D) for the tokens idx."""
    return np.ascontiguousarray(np.moveaxis(x[:, idx], 1, 2))


@dataclass(frozen=True)
class Problem:
    """Inputs (float64 holding values rounded to the storage dtype), positions, references."""

    q: np.ndarray  # (B, Nq, H, D), k and v (B, Nk, Hkv, D), dout like q
    k: np.ndarray
    v: np.ndarray
    dout: np.ndarray
    q_pos: np.ndarray  # every query row, in the case's layout order
    k_blocks: tuple  # positions of the visiting key blocks
    bounds: Optional[tuple]  # per-row key ranges (None: the causal flag says it all)
    mods: dict  # the tiles' modifier keywords for q_pos
    ref: tuple  # dense float64 (out, lse)
    grads: tuple  # dense float64 (dq, dk, dv)
    peer: Optional[tuple]  # dense float32 (out, lse), None for float64
    peer_grads: Optional[tuple]


def storage(dtype: str) -> np.dtype:
    """The input dtype of a storage name (bfloat16 travels as uint16 bits, :mod:`ringmpi.gpu`)."""
    return np.dtype({"float16": np.float16, "bfloat16": np.uint16}.get(dtype, dtype))


def _tile(var: Variant, x: np.ndarray, tdt):
    """float64 ``x`` on the variant's device in tile dtype ``tdt`` (uint16: bfloat16 bits)."""
    return var.to_dev(gpu.to_bf16_bits(x) if tdt == np.uint16 else x.astype(tdt))


@functools.cache
def problem(case: str, mod: str, dtype: str) -> Problem:
    """Inputs and dense references of one case (cached), values rounded to ``dtype``.

    Parameters
    ----------
    case, mod, dtype : str
        Keys of :data:`CASES` and :data:`MODS`; the storage dtype (float16, bfloat16 (GPU),
        float32, float64).
    """
    c = CASES[case]
    spec = spec_of(case, mod)
    rng = np.random.default_rng(sorted(CASES).index(case) * 31 + len(mod))
    q, k, v = random_qkv(
        rng, c.nq, c.h, c.hkv, c.d, batch=c.b, realistic=True, nk=c.nk, dv=c.width_v
    )
    dout = 0.2 + 0.1 * rng.standard_normal((*q.shape[:-1], c.width_v))

    def rounded(x):  # the values the storage dtype holds, as float64
        if dtype == "bfloat16":
            return gpu.from_bf16_bits(gpu.to_bf16_bits(x)).astype(np.float64)
        return x.astype(storage(dtype)).astype(np.float64)

    q, k, v, dout = (rounded(x) for x in (q, k, v, dout))
    mask = mask_of(spec, c.nq, c.nk)
    q_pos = np.concatenate(
        [ringmpi.positions(c.nq, r, 2, c.layout, cu_seqlens=mask.cu_q) for r in range(2)]
    )
    kb = tuple(
        ringmpi.positions(c.nk, r, c.blocks, c.layout, cu_seqlens=mask.cu_k)
        for r in range(c.blocks)
    )
    bounds = None if mask.plain else mask.bounds(q_pos)
    kw = dict(
        window=c.window,
        cu_seqlens=c.cu_q,
        cu_seqlens_k=c.cu_k,
        **{f: getattr(spec, f) for f in scoremods.names()},
    )
    ref = attention(q, k, v, c.causal, **kw)
    grads = attention_backward(dout, q, k, v, c.causal, **kw)
    low = dtype != "float64"
    peer = dense(q, k, v, c.causal, **kw) if low else None
    peer_grads = dense_backward(dout, q, k, v, c.causal, **kw) if low else None
    mods = tile_modifiers(spec, mask, q_pos)
    return Problem(q, k, v, dout, q_pos, kb, bounds, mods, ref, grads, peer, peer_grads)


def _tile_kw(p: Problem, case: str, mods: Optional[dict] = None) -> dict:
    """The tile keywords of a case; ``mods`` replaces its modifier keywords."""
    c = CASES[case]
    kw = dict(scale=c.d**-0.5, causal=c.causal, bounds=p.bounds)
    return {**kw, **(p.mods if mods is None else mods)}


def _blocks(var: Variant, p: Problem, tdt):
    """(positions, k, v) of each visiting key block, on the variant's device in ``tdt``."""
    for kp in p.k_blocks:
        yield (kp, *(_tile(var, _head_major(x, kp), tdt) for x in (p.k, p.v)))


def run_forward(var: Variant, case: str, mod: str, dtype: str, *, mods=None, merged=False):
    """One variant's forward tile over every key block of a case, then the backend's finish.

    Parameters
    ----------
    var : Variant
    case, mod, dtype : str
        Keys of :data:`CASES` and :data:`MODS`; the storage dtype (float16, bfloat16 (GPU),
        float32, float64).
    mods : dict, optional
        Modifier keywords replacing the case's (to show that a wrong one is caught).
    merged : bool
        Each key block from an empty state, finished alone, the partial results combined
        with :func:`ringmpi.softmax.merge` (what the carried state must equal).

    Returns
    -------
    out : (B, Sq, H, D) float64, rows in q_pos order
    lse : (B, H, Sq) float64
    l : (B, H, Sq) the carried state's row sums (None when ``merged``)
    flops : list of int, one per tile call
    """
    p = problem(case, mod, dtype)
    be, st = var.be, storage(dtype)
    tdt, adt = be.tile_dtype(st), be.acc_dtype(st)
    q = _tile(var, _head_major(p.q, p.q_pos), tdt)
    shape = (*q.shape[:-1], p.v.shape[-1])  # the state has the value width
    state = softmax.init_state(shape, adt, var.xp)
    out = lse = None
    flops = []
    for kp, k, v in _blocks(var, p, tdt):
        if merged:
            state = softmax.init_state(shape, adt, var.xp)
        flops.append(be.forward_tile(q, k, v, p.q_pos, kp, *state, **_tile_kw(p, case, mods)))
        if merged:
            o, s = (var.to_host(x).astype(np.float64) for x in be.finish(*state))
            o = np.moveaxis(o, 1, 2)  # merge takes (B, H, S, D) with lse (B, H, S)
            out, lse = (o, s) if out is None else softmax.merge(out, lse, o, s)
    if merged:
        return np.moveaxis(out, 1, 2), lse, None, flops
    out, lse = (var.to_host(x).astype(np.float64) for x in be.finish(*state))
    return out, lse, var.to_host(state[2]), flops


def run_backward(var: Variant, case: str, mod: str, dtype: str) -> tuple:
    """One variant's backward tile over every key block, from the float64 forward's lse/delta.

    Parameters
    ----------
    var : Variant
    case, mod, dtype : str
        As in :func:`run_forward`.

    Returns
    -------
    dq : (B, Sq, H, D) float64, rows in q_pos order
    dk, dv : lists of (B, Hkv, Sk_b, D) float64, one per key block
    lse : (B, H, Sq) float64, the (rounded) lse the tiles got
    flops : list of int, one per tile call
    """
    p = problem(case, mod, dtype)
    be, st = var.be, storage(dtype)
    tdt, adt = be.tile_dtype(st), be.acc_dtype(st)
    q, dout = (_tile(var, _head_major(x, p.q_pos), tdt) for x in (p.q, p.dout))
    lse = np.ascontiguousarray(p.ref[1][..., p.q_pos]).astype(adt)
    delta = _delta(p, adt)
    lse_d, delta_d = var.to_dev(lse), var.to_dev(delta)
    dq = var.xp.zeros(q.shape, adt)
    dks, dvs, flops = [], [], []  # (dout has the value width, q the key width)
    for kp, k, v in _blocks(var, p, tdt):
        dk, dv = var.xp.zeros(k.shape, adt), var.xp.zeros(v.shape, adt)
        flops.append(
            be.backward_tile(
                q, k, v, dout, lse_d, delta_d, p.q_pos, kp, dq, dk, dv, **_tile_kw(p, case)
            )
        )
        dks.append(var.to_host(dk).astype(np.float64))
        dvs.append(var.to_host(dv).astype(np.float64))
    dq = np.moveaxis(var.to_host(dq).astype(np.float64), 1, 2)
    return dq, dks, dvs, lse.astype(np.float64), flops


def _delta(p: Problem, adt) -> np.ndarray:
    """delta = dout . out in the accumulation dtype, from the rounded dout (head-major)."""
    out = _head_major(p.ref[0], p.q_pos)
    return np.sum(_head_major(p.dout, p.q_pos).astype(adt) * out.astype(adt), axis=-1)


def delta_budget(var: Variant, case: str, mod: str, dtype: str) -> float:
    """How far the harness's own float32 ``delta`` moves every backend's dq: scale x
    max|delta - exact| x max|k| (dq_i = scale sum_j P_ij (dP_ij - delta_i) k_j, a row's P
    summing to 1; softcap's derivative is at most 1). The sum's rounding depends on numpy's
    version and the CPU (numpy 1.24 on an AMD EPYC: several times numpy 2's)."""
    p = problem(case, mod, dtype)
    adt = var.be.acc_dtype(storage(dtype))
    exact = np.sum(_head_major(p.dout, p.q_pos) * _head_major(p.ref[0], p.q_pos), axis=-1)
    err = float(np.abs(_delta(p, adt).astype(np.float64) - exact).max(initial=0.0))
    return _tile_kw(p, case)["scale"] * err * float(np.abs(p.k).max(initial=0.0))


def visible_pairs(case: str, mod: str, dtype: str) -> list:
    """(query row, key) pairs visible in each tile call of a case (same keys as :func:`problem`)."""
    p = problem(case, mod, dtype)
    c = CASES[case]
    if p.bounds is None:  # the causal flag, or no mask
        big = np.iinfo(np.int64)
        lo = np.full(len(p.q_pos), big.min)
        hi = p.q_pos if c.causal else np.full(len(p.q_pos), big.max)
    else:
        lo, hi = p.bounds
    return [int(((lo[:, None] <= kp) & (kp <= hi[:, None])).sum()) for kp in p.k_blocks]


def close(got: np.ndarray, want: np.ndarray, dtype: str, what: str, floor: float = 0.0) -> float:
    """Assert ``got`` within :data:`TOL` of the spec's ``want`` (inf entries equal); err/bound.

    Parameters
    ----------
    got, want : arrays of one shape
        A variant's result and the numpy tile's.
    dtype, what : str
        The storage dtype (picks the tolerance); a label for the message.
    floor : float
        The bound is at least this: two tiles that each round like a dense computation
        in the working precision differ by about as much (see :func:`peer_floor`).
    """
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    fin = np.isfinite(want)
    assert np.array_equal(got[~fin], want[~fin]), f"{what}: infinite entries differ"
    assert np.isfinite(got[fin]).all(), f"{what}: non-finite where the spec is finite"
    err = float(np.abs(got[fin] - want[fin]).max(initial=0.0))
    bound = max(TOL[dtype] * max(1.0, float(np.abs(want[fin]).max(initial=0.0))), floor)
    assert err <= bound, f"{what}: max err {err:.3g} > {bound:.3g} (vs the numpy tile)"
    return err / bound


def peer_floor(peer, ref) -> float:
    """:func:`close`'s floor for a low-precision result: twice the dense peer's max error.

    A fixed relative bound between two float32 tiles holds for short rows but not for
    gradients summed over many keys at D = 64-192 (fused vs numpy dq 2.3e-05-2.8e-05
    against 2e-05, with a dense float32 peer 1.8e-05-6.3e-05 from the float64
    reference): both tiles are also held to the dense rule, so the floor only admits
    rounding of the size a dense float32 computation makes (issue 42).
    """
    if peer is None:
        return 0.0
    return 2.0 * float(np.abs(np.asarray(peer, np.float64) - np.asarray(ref, np.float64)).max())


@functools.cache
def spec_result(direction: str, case: str, mod: str, dtype: str) -> tuple:
    """:func:`run_forward` (``"fwd"``) or :func:`run_backward` of the numpy backend, cached."""
    with variant("numpy") as var:
        return (run_forward if direction == "fwd" else run_backward)(var, case, mod, dtype)
