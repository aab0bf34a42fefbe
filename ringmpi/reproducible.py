"""Reproducible mode (issue 40): out and lse bitwise independent of P, layout, threads, ISA.

``ring_attention(..., reproducible=True)`` replaces the forward ring loop of
:mod:`ringmpi.attention` by :func:`loop`, two passes over the same ring:

1. Each row's global maximum score M (a maximum is exact, so its value does not
   depend on which rank saw which key, or in what order).
2. Each (row, key) pair's weight p = exp(s - M) and its products p * v_j, summed
   per row with a reproducible summation: every summand is split on fixed grids
   (:func:`grids`, from the global key count and a global bound: 1 for p, the
   global max |v| of each (batch, kv head, column) for p * v) into ``FOLDS`` parts
   whose sums over any subset of keys are exact in float64. The fold sums
   therefore do not depend on how the keys were grouped or ordered; they are added
   in a fixed order at the end: out = o / l rounded once to the output dtype,
   lse = M + log(l).

A score is computed by this module's own fixed-order loop over the head dim
(:func:`scores`: elementwise float64 multiply and add, no BLAS), so it is the same
number whatever the shape of the call it is part of. Neither the numpy tile nor
the fused C tiles run in this mode: the CPU kernel selection, its ISA path and
the BLAS/OpenMP thread counts do not touch the bits. docs/reproducible.md has the
argument and the limits.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from . import cost
from .layout import positions
from .mask import plan_steps
from .ring import KVRing

__all__ = ["FOLDS", "refusals", "scores", "grids", "fold_into", "loop"]

FOLDS = 3  # each fold keeps about 51 - log2(nk) more bits of every summand
_ROWS = 256  # query rows per chunk: memory only, the bits do not depend on it
_KEYS = 128  # keys per chunk: memory only
_E_MIN = -960  # lowest grid exponent: keeps every constant and quantum a normal float64


def refusals(spec, xp, *, backward: bool = False, tiles: bool = True) -> list:
    """Why a call with ``spec.reproducible`` cannot run (empty: it can, or the mode is off).

    For :meth:`ringmpi.backend.Backend.supports`; ``xp`` is the backend's array module.
    """
    if not getattr(spec, "reproducible", False):
        return []
    why = []
    if xp is not np:
        why.append(
            "reproducible=True (the GPU kernels sum in an order that depends on the block "
            "split and the launch configuration; the mode runs on numpy arrays only)"
        )
    if backward:
        why.append("reproducible=True in the backward (not written yet; forward only)")
    if not tiles:
        why.append("reproducible=True in decode (not written yet)")
    if getattr(spec, "slices", None) is not None:
        why.append("reproducible=True with slices (not written yet)")
    for name in ("alibi_slopes", "softcap", "sinks"):
        if getattr(spec, name, None) is not None:
            why.append(f"reproducible=True with {name} (not written yet)")
    if spec.head_parallel > 1:
        why.append("reproducible=True with head_parallel > 1 (not tested yet)")
    return why


def scores(q, k, scale: float):
    """(rows, keys) float64 scores ``scale * q . k``, summed over D in index order.

    Each entry is ((q0 k0 + q1 k1) + q2 k2) + ... in float64, then times scale:
    elementwise operations only, so an entry does not depend on the other rows
    or keys in the call (a BLAS product may).

    Parameters
    ----------
    q : (rows, D) float64 ; k : (keys, D) float64
    """
    qt, kt = np.ascontiguousarray(q.T), np.ascontiguousarray(k.T)
    s = np.multiply(qt[0, :, None], kt[0, None, :])
    tmp = np.empty_like(s)
    for j in range(1, len(qt)):
        np.multiply(qt[j, :, None], kt[j, None, :], out=tmp)
        s += tmp
    s *= scale
    return s


def grids(nk: int, bound) -> list:
    """The ``FOLDS`` splitting constants for sums of at most ``nk`` summands |x| <= bound.

    Fold f has a grid exponent E_f with nk * bound_f < 2^E_f and the constant
    c_f = 1.5 * 2^(E_f + 2), whose float64 spacing is q_f = 2^(E_f - 50): for
    |x| <= 2^E_f, (c_f + x) - c_f is x rounded to a multiple of q_f, exactly, and
    x minus it is exact too (|residual| <= q_f / 2, the next fold's bound). A sum of
    at most nk such parts is a multiple of q_f below 2^(E_f + 1): 51 bits, exact
    in float64 whatever the order or grouping.

    Parameters
    ----------
    nk : int
        The most summands one sum can have (the global key count).
    bound : float64 array
        An upper bound of the summands' magnitudes, per sum group (broadcasts).

    Returns
    -------
    list of float64 arrays (shape of ``bound``), one per fold.
    """
    bits = max(int(nk), 1).bit_length()  # nk <= 2^bits
    _, e = np.frexp(np.asarray(bound, dtype=np.float64))  # bound < 2^e
    e = np.maximum(e.astype(np.int64) + bits, _E_MIN)
    out = []
    for _ in range(FOLDS):
        out.append(np.ldexp(1.5, e + 2))
        e = np.maximum(e - 51 + bits, _E_MIN)
    return out


def fold_into(x, consts: list, sums: list, axis: int, scratch: bool = False) -> None:
    """Add the fold parts of the float64 summands ``x``, summed over ``axis``, into ``sums``.

    ``consts[f]`` broadcasts against ``x``; ``sums[f]`` has the shape of ``x`` summed
    over ``axis``. Every addition here is exact (:func:`grids`), so the order of
    numpy's sums and of the calls does not change the result. ``scratch``: ``x`` may
    be overwritten (it is a temporary of the caller).
    """
    hi = np.empty_like(x)
    last = len(consts) - 1
    for f, (c, acc) in enumerate(zip(consts, sums)):
        np.add(x, c, out=hi)
        hi -= c
        acc += hi.sum(axis=axis)
        if f < last:  # the last fold's remainder is dropped (the method's error)
            if scratch:
                x -= hi
            else:
                x, scratch = x - hi, True


def loop(comm, args, qi, ki, vi, on_step, on_tick, heads=slice(None), on_state=None, start=None):
    """The reproducible forward over ``comm``: (out (B, S, H, Dv), lse (B, H, S), stats).

    The signature and the results of :func:`ringmpi.attention._loop` (out in the
    accumulation dtype, rounded once from float64; lse likewise); ``on_step`` counts
    the steps of both passes (``nsteps`` = 2 x the ring steps). The checkpoint
    seam (``on_state``, ``start``) is refused: the state of this mode is not the
    online-softmax state the batch job saves.
    """
    if on_state is not None or start is not None:  # the same on every rank (documented)
        raise ValueError("ring_attention: reproducible=True cannot be checkpointed or resumed yet")
    mask, layout = args.mask, args.layout
    rank, size = comm.Get_rank(), comm.Get_size()
    plan = plan_steps(mask, rank, size, layout)
    lo, hi = mask.bounds(plan.q_pos)
    b, h, sq, d = qi.shape
    hkv, dv = ki.shape[1], vi.shape[-1]  # dv: the value width (issue 42)
    g = h // hkv
    q64 = qi.astype(np.float64)
    nk = int(args.nk)

    # the global bound of |v| per (batch, kv head, column): a maximum, the same for every P
    vmax = np.abs(vi).max(axis=2).astype(np.float64) if vi.shape[2] else np.zeros((b, hkv, dv))
    comm.Allreduce(MPI.IN_PLACE, vmax, op=MPI.MAX)
    v_grid = grids(nk, vmax)  # each (B, Hkv, Dv)
    l_grid = grids(nk, np.float64(1.0))  # exp(s - M) <= 1

    m = np.full((b, h, sq), -np.inf)
    l_parts = [np.zeros((b, h, sq)) for _ in range(FOLDS)]
    o_parts = [np.zeros((b, h, sq, dv)) for _ in range(FOLDS)]
    stats = dict(compute_s=0.0, wait_s=0.0, flops=0, tile_flops=0, bytes_sent=0)
    computed = 0

    def tick(step):
        if on_tick is not None:
            on_tick(step)

    for pass_ in (0, 1):
        kv_ring = KVRing(comm, args.backend, ki, vi, args.counts_k, plan.nsteps)
        with kv_ring as kv:
            for step, src, kb, vb in kv:
                if plan.compute[step]:
                    t0 = time.perf_counter()
                    k_pos = positions(nk, src, size, layout, cu_seqlens=mask.cu_k, mask=mask)
                    k64 = kb.astype(np.float64)
                    v64 = vb.astype(np.float64) if pass_ else None
                    for r0 in range(0, sq, _ROWS):
                        r1 = min(sq, r0 + _ROWS)
                        tick(step)
                        for k0 in range(0, len(k_pos), _KEYS):
                            k1 = min(len(k_pos), k0 + _KEYS)
                            kp = k_pos[k0:k1]
                            vis = (kp[None, :] >= lo[r0:r1, None]) & (
                                kp[None, :] <= hi[r0:r1, None]
                            )
                            if not vis.any():
                                continue
                            for bb in range(b):
                                for hh in range(h):
                                    kh = hh // g
                                    s = scores(q64[bb, hh, r0:r1], k64[bb, kh, k0:k1], args.scale)
                                    if pass_ == 0:
                                        s[~vis] = -np.inf
                                        np.maximum(
                                            m[bb, hh, r0:r1], s.max(axis=1), out=m[bb, hh, r0:r1]
                                        )
                                        continue
                                    _accumulate(
                                        s,
                                        vis,
                                        m[bb, hh, r0:r1],
                                        v64[bb, kh, k0:k1],
                                        (l_grid, [x[bb, hh, r0:r1] for x in l_parts]),
                                        (
                                            [c[bb, kh] for c in v_grid],
                                            [x[bb, hh, r0:r1] for x in o_parts],
                                        ),
                                    )
                    stats["compute_s"] += time.perf_counter() - t0
                    if pass_:
                        pairs = plan.pairs(step, k_pos, args.causal)
                        stats["flops"] += cost.flops(pairs, d, h, b, dv=dv)
                        stats["tile_flops"] += 2 * sq * len(k_pos) * (d + dv) * h * b
                        computed += 1
                if on_step is not None:
                    on_step(pass_ * plan.nsteps + step + 1, 2 * plan.nsteps)
        stats["wait_s"] += kv.ring.wait_s
        stats["bytes_sent"] += kv.bytes_sent
    out, lse = _finish(l_parts, o_parts, m, args.acc_dtype)
    stats.update(
        steps=plan.nsteps,
        steps_computed=computed,
        steps_skipped=size - plan.nsteps,
        steps_resumed=0,
    )
    return out, lse, stats


def _accumulate(s, vis, m_rows, v, l_acc, o_acc) -> None:
    """Pass 2 on one (rows, keys) block of one head: fold p and p * v into the row sums."""
    with np.errstate(invalid="ignore", over="ignore"):
        t = np.where(vis, s - m_rows[:, None], -np.inf)
    p = np.exp(t)  # C-contiguous, freshly made: the same loop of numpy's exp for every P
    fold_into(p, *l_acc, axis=1)
    fold_into(p[:, :, None] * v[None, :, :], *o_acc, axis=1, scratch=True)


def _finish(l_parts, o_parts, m, dtype):
    """out (B, S, H, D) and lse (B, H, S) in ``dtype`` from the fold sums, added in fold order."""
    l = l_parts[0].copy()
    o = o_parts[0].copy()
    for x, y in zip(l_parts[1:], o_parts[1:]):
        l += x
        o += y
    seen = l > 0
    safe = np.where(seen, l, 1.0)
    out = np.where(seen[..., None], o / safe[..., None], 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(seen, m + np.log(safe), -np.inf)
    lse = np.where(np.isnan(l), np.nan, lse)
    out = np.ascontiguousarray(np.moveaxis(out, 1, 2)).astype(dtype)
    return out, lse.astype(dtype)
