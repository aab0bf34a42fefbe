"""GPU tile cases on values shaped like real data over long rows (issue 20), for any CuPy.

The same code runs in tests/gpu/test_tile_device.py on a real device (where it checks the CUDA
kernels' float32 sums) and in tests/gpu/test_tile_standin.py on the CuPy stand-in (where
the arithmetic is the numpy tile's: it checks the Python side and these cases, never
CUDA). Inputs: :func:`ringmpi.testing.random_qkv` with ``realistic=True`` (means,
small value spread, sink keys), rounded to the tile dtype before the float64
reference sees them. The rule is :func:`ringmpi.testing.assert_close`'s: twice
(forward) or three times (backward) the error of a dense float32 computation on
the same inputs, plus eps; 16-bit tiles add the rounding of P (and dS) to 16 bits
before their MMAs (``unit * bound``, the bound of tests/gpu/test_tile_device.py's module doc).
"""

from __future__ import annotations

import numpy as np

from ringmpi import gpu, softmax
from ringmpi.reference import attention, attention_backward
from ringmpi.testing import assert_close, dense, dense_backward, lse_budget, random_qkv

__all__ = ["UNIT", "head_major", "seq_major", "to_tile", "forward_long", "backward_long"]

UNIT = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 0.0, "float64": 0.0}


def head_major(x: np.ndarray) -> np.ndarray:
    """(S, H, D) -> (1, H, S, D), contiguous."""
    return np.ascontiguousarray(np.moveaxis(x, -3, -2)[None])


def seq_major(x: np.ndarray) -> np.ndarray:
    """(1, H, S, D) -> (S, H, D)."""
    return np.moveaxis(x[0], -2, -3)


def to_tile(cupy, x: np.ndarray, dtype: str):
    """(``x`` rounded to ``dtype``, as float32/float64 numpy; the device tile array)."""
    if dtype == "bfloat16":
        bits = gpu.to_bf16_bits(x.astype(np.float32))
        return gpu.from_bf16_bits(bits), cupy.asarray(bits)
    if dtype == "float16":
        h = x.astype(np.float16)
        return h.astype(np.float32), cupy.asarray(h)
    r = x.astype(dtype)
    return r, cupy.asarray(r)


def forward_long(
    cupy, dtype: str, d: int, *, rows: int = 16, keys: int = 65536, steps=1, seed: int = 0
) -> None:
    """Last ``rows`` queries (causal) x ``keys`` keys, the keys in ``steps`` tile calls.

    Parameters
    ----------
    cupy : module
        CuPy or the stand-in.
    dtype : str
        Tile storage: float16, bfloat16, float32 or float64.
    d : int
        Head size (2 query heads share 1 K/V head).
    steps : int
        Key blocks folded one after the other into one carried state (a ring's steps).
    """
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, rows, 2, 1, d, nk=keys, realistic=True)
    (qn, qg), (kn, _), (vn, _) = (to_tile(cupy, head_major(x), dtype) for x in (q, k, v))
    q64, k64, v64 = (seq_major(x).astype(np.float64) for x in (qn, kn, vn))
    ref, ref_lse = attention(q64, k64, v64, True)
    acc_t = np.float64 if dtype == "float64" else np.float32
    peer, peer_lse = (None, None) if dtype == "float64" else dense(q64, k64, v64, True)
    q_pos = np.arange(keys - rows, keys, dtype=np.int64)
    state = [cupy.asarray(x) for x in softmax.init_state(qn.shape, acc_t)]
    cuts = np.linspace(0, keys, steps + 1).astype(int)
    for a, b in zip(cuts[:-1], cuts[1:]):
        kg = to_tile(cupy, kn[:, :, a:b], dtype)[1]
        vg = to_tile(cupy, vn[:, :, a:b], dtype)[1]
        k_pos = np.arange(a, b, dtype=np.int64)
        gpu.forward_tile(qg, kg, vg, q_pos, k_pos, *state, scale=1 / np.sqrt(d), causal=True)
    out, lse = softmax.finalize(*(cupy.asnumpy(x) for x in state))
    what = f"{dtype} D={d} {rows}x{keys} in {steps} steps"
    extra = 2 * UNIT[dtype] * float(np.abs(v64).max())  # P rounded to 16 bits before P V
    assert_close(None, seq_major(out), ref, peer, f"{what} out", extra=extra)
    # the 16-bit (tensor-core) tiles score with scale * log2(e) rounded to float32 and keep
    # m in base 2: a few float32 ulps of the largest score |s|, which sinks make large
    s_max = float(np.abs(np.einsum("qhd,khd->hqk", q64, k64[:, [0, 0]]) / np.sqrt(d)).max())
    lse_extra = 4 * 2.0**-24 * s_max if UNIT[dtype] else 0.0
    assert_close(None, lse[0], ref_lse, peer_lse, f"{what} lse", extra=lse_extra)


def backward_long(cupy, dtype: str, d: int, sq: int, sk: int, *, seed: int = 0) -> None:
    """dq, dk, dv of one non-causal (sq, sk) tile from the exact lse and delta.

    Long rows (sk large) sum dq over every key; long columns (sq large) sum dk and dv
    over every query row of both query heads of the K/V head.
    """
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, sq, 2, 1, d, nk=sk, realistic=True)
    dout = 0.2 + 0.1 * rng.standard_normal(q.shape)
    tiles = [to_tile(cupy, head_major(x), dtype) for x in (q, k, v, dout)]
    q64, k64, v64, do64 = (seq_major(t[0]).astype(np.float64) for t in tiles)
    want = attention_backward(do64, q64, k64, v64)
    acc_t = np.float64 if dtype == "float64" else np.float32
    peer = (None,) * 3 if dtype == "float64" else dense_backward(do64, q64, k64, v64)
    out, lse = attention(q64, k64, v64)  # lse (H, Sq)
    delta = np.einsum("shd,shd->hs", do64, out)
    lse_a, delta_a = (np.ascontiguousarray(x[None]).astype(acc_t) for x in (lse, delta))
    qa, doa = (cupy.asarray(tiles[i][0].astype(acc_t)) for i in (0, 3))
    grads = [cupy.zeros(t[0].shape, acc_t) for t in tiles[:3]]
    pos_q, pos_k = np.arange(sq, dtype=np.int64), np.arange(sk, dtype=np.int64)
    scale = 1 / np.sqrt(d)
    gpu.backward_tile(
        qa,
        tiles[1][1],
        tiles[2][1],
        doa,
        cupy.asarray(lse_a),
        cupy.asarray(delta_a),
        pos_q,
        pos_k,
        *grads,
        scale=scale,
        causal=False,
    )
    got = [seq_major(cupy.asnumpy(g)) for g in grads]
    # what the 16-bit P and dS move, and what the rounded lse and delta move (the peer
    # computes its own): |P| |K|, |P|^T |Q| products of the dense float64 problem
    qh, kh, vh, doh = (np.moveaxis(x, -3, -2) for x in (q64, k64, v64, do64))
    kh, vh = np.repeat(kh, 2, axis=0), np.repeat(vh, 2, axis=0)
    p = np.exp(scale * qh @ np.swapaxes(kh, -1, -2) - lse[..., None])
    ds = np.abs(p * (doh @ np.swapaxes(vh, -1, -2) - delta[..., None]))
    pt, dst = np.swapaxes(p, -1, -2), np.swapaxes(ds, -1, -2)
    bounds = (scale * ds @ np.abs(kh), scale * (dst @ np.abs(qh)).sum(0), (pt @ np.abs(doh)).sum(0))
    by_p = (scale * p @ np.abs(kh), scale * (pt @ np.abs(qh)).sum(0), 0 * bounds[2])
    eps = float(np.finfo(acc_t).eps)
    d_err = float(np.abs(delta_a[0].astype(np.float64) - delta).max())
    for g, w, o, bnd, bp, nm in zip(got, want, peer, bounds, by_p, "qkv"):
        extra = 3 * UNIT[dtype] * float(bnd.max()) + d_err * float(bp.max())
        extra += lse_budget(lse_a[0], lse, w) + eps * float(np.abs(w).max())
        what = f"{dtype} D={d} {sq}x{sk} d{nm}"
        assert_close(None, g, w, o, what, factor=3.0, extra=0.0 if o is None else extra)
