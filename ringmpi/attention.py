"""The ring loop: exact softmax attention over a sequence split across MPI ranks.

Every rank keeps its queries and the online-softmax state at home. K and V
travel together in one packed buffer: at step s rank r holds the block that
rank (r - s) mod P started with. Before computing on that block the rank has
already posted the exchange that brings the next one, so the transfer runs
while the tile kernel works. After P steps every query has met every key.

Per step a rank computes 4 * Sq * Sk * D * H flops (fewer under a causal mask,
whose fully masked tiles are skipped) and sends 2 * Sk * Hkv * D elements.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import numpy as np
from mpi4py import MPI

from . import softmax, validate
from .backend import Backend, select
from .partition import positions

__all__ = ["ring_attention", "prepare", "pack_kv", "kv_view", "advance"]

# Test-only fault injection: "RANK:STEP" raises on that rank before that step.
_FAULT_ENV = "RINGMPI_TEST_FAULT"


def _maybe_fault(rank: int, step: int) -> None:
    spec = os.environ.get(_FAULT_ENV)
    if spec:
        r, s = (int(t) for t in spec.split(":"))
        if r == rank and s == step:
            raise RuntimeError(f"injected fault on rank {rank} at ring step {step}")


def prepare(q, k, v, comm, *, causal, layout, scale, check_finite, what, extra=None):
    """Agree on the call across ranks and bring the arrays to the internal layout.

    Returns (backend, args, qi, ki, vi) where qi is (B, H, S, D) and ki, vi are
    (B, Hkv, S, D) in the backend's tile dtype, and args carries n, counts,
    batched, scale, the input dtype and the accumulation dtype.
    """
    be: Backend = select(q)
    meta = validate.describe(
        q, k, v, causal=causal, layout=layout, scale=scale, backend=be,
        check_finite=check_finite, extra=extra,
    )  # fmt: skip
    args = validate.agree(comm, meta, what)
    xp = be.xp
    args["batched"] = q.ndim == 4
    args["scale"] = 1.0 / float(np.sqrt(q.shape[-1])) if scale is None else float(scale)
    args["in_dtype"] = q.dtype
    args["tile_dtype"] = be.tile_dtype(q.dtype)
    args["acc_dtype"] = be.acc_dtype(q.dtype)

    def internal(x):  # (B?, S, H, D) -> (B, H, S, D), tile dtype, contiguous
        x = x if x.ndim == 4 else x[None]
        return xp.ascontiguousarray(xp.moveaxis(x, -3, -2), dtype=args.tile_dtype)

    return be, args, internal(q), internal(k), internal(v)


def kv_view(buf, shape_kv: tuple, count: int):
    """View the first ``count`` tokens' worth of a flat K/V buffer as (2, B, Hkv, count, D)."""
    b, hkv, _, d = shape_kv
    return buf[: 2 * b * hkv * count * d].reshape(2, b, hkv, count, d)


def pack_kv(xp, ki, vi, smax: int):
    """Two flat buffers sized for the largest block; the first holds this rank's K and V."""
    b, hkv, s, d = ki.shape
    bufs = [xp.empty(2 * b * hkv * smax * d, dtype=ki.dtype) for _ in range(2)]
    view = kv_view(bufs[0], ki.shape, s)
    view[0] = ki
    view[1] = vi
    return bufs


def advance(ring, bufs, step: int, rank: int, size: int, kv_shape: tuple, cnt: list):
    """Post the exchange that brings step+1's block, return (owner, K/V view) for ``step``.

    At step s rank r holds the block rank (r - s) mod P started with, in
    ``bufs[s % 2]``; the block for s + 1 arrives in the other buffer. Sizes are
    exact: blocks of different owners may differ by a token or two.
    """
    src = (rank - step) % size
    cur, nxt = bufs[step % 2], bufs[(step + 1) % 2]
    if step + 1 < size:
        nxt_src = (src - 1) % size
        send = cur[: kv_view(cur, kv_shape, cnt[src]).size]
        recv = nxt[: kv_view(nxt, kv_shape, cnt[nxt_src]).size]
        ring.start(send, recv)
    return src, kv_view(cur, kv_shape, cnt[src])


def ring_attention(
    q,
    k,
    v,
    comm: Optional[MPI.Comm] = None,
    *,
    causal: bool = False,
    layout: str = "zigzag",
    scale: Optional[float] = None,
    return_lse: bool = False,
    check_finite: bool = False,
    stats: Optional[dict] = None,
    on_step: Optional[Callable[[int, int], None]] = None,
):
    """Exact softmax attention of this rank's queries against the whole sequence.

    Parameters
    ----------
    q : array (S_local, H, D) or (B, S_local, H, D)
        This rank's queries, laid out as ``ringmpi.shard(..., layout=layout)``.
        numpy arrays run on the CPU, CuPy arrays on the GPU.
    k, v : array (S_local, Hkv, D) or (B, S_local, Hkv, D)
        This rank's keys and values; H % Hkv == 0 (grouped-query attention).
    comm : mpi4py.MPI.Comm, optional
        The ranks holding the sequence, in ring order. Default MPI.COMM_WORLD.
    causal : bool
        Query at global position i sees keys at positions <= i.
    layout : {"zigzag", "striped", "contiguous"}
        How tokens are spread over ranks; must match how q, k, v were cut.
    scale : float, optional
        Score scale, default 1/sqrt(D).
    return_lse : bool
        Also return the log-sum-exp of the scores, (..., H, S_local).
    check_finite : bool
        Raise ValueError on every rank if any input holds NaN or Inf.
        Without it, NaN in an input propagates to the outputs it touches.
    stats : dict, optional
        Filled with compute_s, wait_s, total_s, flops, steps, backend.
    on_step : callable, optional
        Called as on_step(step, nsteps) after each ring step.

    Returns
    -------
    out : array, shape and dtype of q
    lse : array (..., H, S_local), float32 (float64 for float64 inputs); only
        with ``return_lse=True``.
    """
    t_start = time.perf_counter()
    comm = MPI.COMM_WORLD if comm is None else comm
    be, args, qi, ki, vi = prepare(
        q, k, v, comm, causal=causal, layout=layout, scale=scale,
        check_finite=check_finite, what="ring_attention",
    )  # fmt: skip
    xp = be.xp
    rank, size = comm.Get_rank(), comm.Get_size()
    n, cnt = args.n, args.counts
    q_pos = positions(n, rank, size, layout)
    kv_shape = ki.shape
    bufs = pack_kv(xp, ki, vi, max(cnt))
    del ki, vi
    acc, m, l = softmax.init_state(qi.shape, args.acc_dtype, xp)
    ring = be.ring(comm)
    flops, compute_s = 0, 0.0
    try:
        for step in range(size):
            _maybe_fault(rank, step)
            src, kv = advance(ring, bufs, step, rank, size, kv_shape, cnt)
            t0 = time.perf_counter()
            flops += be.forward_tile(
                qi, kv[0], kv[1], q_pos, positions(n, src, size, layout), acc, m, l,
                scale=args.scale, causal=causal, progress=ring.test,
            )  # fmt: skip
            compute_s += time.perf_counter() - t0
            ring.wait()
            if on_step is not None:
                on_step(step + 1, size)
    finally:
        ring.free()
    out, lse = be.finish(acc, m, l)
    out = be.cast_out(out, args.in_dtype)
    if not args.batched:
        out, lse = out[0], lse[0]
    if stats is not None:
        stats.update(
            compute_s=compute_s,
            wait_s=ring.wait_s,
            total_s=time.perf_counter() - t_start,
            flops=flops,
            steps=size,
            backend=be.name,
        )
    return (out, lse) if return_lse else out
