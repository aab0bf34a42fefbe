"""Exact gradients of ring attention: the backward pass over the same ring.

For one head with P = softmax(scale * Q K^T) (rows normalised by the saved
log-sum-exp, so P_ij = exp(scale * q_i.k_j - lse_i)), O = P V and an upstream
gradient dO, the gradients are

    delta_i = sum_d dO_id O_id            (= sum_j P_ij (dO V^T)_ij)
    dV      = P^T dO
    dS      = P * (dO V^T - delta)        (softmax Jacobian, row by row)
    dQ      = scale * dS K
    dK      = scale * dS^T Q

Every term is a sum over key blocks (dQ) or over query blocks (dK, dV), so the
work splits over the ring exactly like the forward pass: q, dO, O, lse and the
dQ accumulator stay home while K/V travel. The dK/dV of a block are sums over
every rank's queries, so they travel too: each rank adds its contribution to
the accumulator of the block it holds and passes it on; after the P compute
steps one more hop brings every accumulator home.

The accumulator for a block arrives from the previous rank while this rank is
computing its own contribution into a scratch buffer; the two are added after
the compute and sent on, so the dK/dV hop overlaps the next rank's compute just
as the K/V hop overlaps ours. Nothing is rounded to the input dtype until the
end: accumulation is float32 (float64 for float64 inputs).

Per step a rank computes 10 * Sq * Sk * D * H flops (five matrix products;
causal tiles that are fully masked are skipped) and sends 2 * Sk * Hkv * D
input-dtype elements (K/V) plus 2 * Sk * Hkv * D accumulation-dtype elements
(dK/dV).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np
from mpi4py import MPI

from .attention import _maybe_fault, advance, kv_view, pack_kv, prepare
from .backend import is_cupy
from .cpu import BLOCK_K, BLOCK_Q, blocks
from .partition import positions
from .ring import Ring

__all__ = ["ring_attention_backward", "backward_tile", "TAG_DKV"]

TAG_DKV = 7302


def backward_tile(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    dout: np.ndarray,
    lse: np.ndarray,
    delta: np.ndarray,
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    dq: np.ndarray,
    dk: np.ndarray,
    dv: np.ndarray,
    *,
    scale: float,
    causal: bool,
    progress: Optional[Callable[[], None]] = None,
) -> int:
    """Add the gradients from one (query block, K/V block) pair, in place.

    Parameters
    ----------
    q, dout : (B, H, Sq, D)
        Queries and the upstream gradient of the output, accumulation dtype.
    k, v : (B, Hkv, Sk, D)
        The visiting keys and values; query head h reads K/V head h // (H/Hkv).
    lse : (B, H, Sq)
        Log-sum-exp of the scores over all keys (from the forward pass);
        -inf marks a row with no visible key, which gets no gradient.
    delta : (B, H, Sq)
        Row sums of dout * out.
    q_pos : (Sq,) ; k_pos : (Sk,)
        int64 global token positions.
    dq : (B, H, Sq, D) ; dk, dv : (B, Hkv, Sk, D)
        Accumulators, updated in place (dk and dv sum over the query heads of
        each group).
    scale : float
    causal : bool
        Key j is visible to query i iff k_pos[j] <= q_pos[i]; block pairs with
        no visible key are skipped.
    progress : callable, optional
        Called between blocks (lets MPI progress a pending exchange).

    Returns
    -------
    int
        Floating-point operations of the five matrix products (10 * pairs * D
        per head), counting only blocks that were not skipped.
    """
    bsz, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = h // hkv
    if sq == 0 or sk == 0:
        return 0
    dt = dq.dtype.type
    # grouped views: query head h = hkv_index * g + group_index, so a (G, n)
    # block of rows flattens to G*n rows that all read the same K/V head
    q5 = q.reshape(bsz, hkv, g, sq, d)
    do5 = dout.reshape(bsz, hkv, g, sq, d)
    dq5 = dq.reshape(bsz, hkv, g, sq, d)
    # p = exp(s - lse): a row with lse = -inf saw no key; +inf makes its p zero
    lse4 = np.where(np.isneginf(lse), np.inf, lse).astype(dt).reshape(bsz, hkv, g, sq)
    delta4 = delta.astype(dt, copy=False).reshape(bsz, hkv, g, sq)
    kblocks = list(blocks(k_pos, BLOCK_K))
    flops = 0
    for qa, qb, qlo, qhi in blocks(q_pos, BLOCK_Q):
        n = qb - qa
        live = [kb for kb in kblocks if not (causal and qhi < kb[2])]
        if not live:
            continue  # every key of this block is in the future of every query
        qs = (q5[:, :, :, qa:qb] * dt(scale)).reshape(bsz, hkv, g * n, d)
        dob = np.ascontiguousarray(do5[:, :, :, qa:qb]).reshape(bsz, hkv, g * n, d)
        lse_b = np.ascontiguousarray(lse4[..., qa:qb]).reshape(bsz, hkv, g * n, 1)
        delta_b = np.ascontiguousarray(delta4[..., qa:qb]).reshape(bsz, hkv, g * n, 1)
        dq_b = np.zeros((bsz, hkv, g * n, d), dtype=dt)
        for ka, kb, _klo, khi in live:
            kk, vv = k[:, :, ka:kb], v[:, :, ka:kb]
            p = qs @ np.swapaxes(kk, -1, -2)  # scores, (B, Hkv, G*n, nk)
            if causal and qlo < khi:
                bias = np.where(q_pos[qa:qb, None] >= k_pos[None, ka:kb], 0.0, -np.inf)
                p.reshape(bsz, hkv, g, n, kb - ka)[...] += bias.astype(dt)
            p -= lse_b
            np.exp(p, out=p)  # probabilities, masked entries exactly 0
            dv[:, :, ka:kb] += np.swapaxes(p, -1, -2) @ dob
            ds = dob @ np.swapaxes(vv, -1, -2)  # dP = dO V^T
            ds -= delta_b
            ds *= p  # dS = P * (dP - delta); scale is folded into qs and dq
            dq_b += ds @ kk
            dk[:, :, ka:kb] += np.swapaxes(ds, -1, -2) @ qs
            flops += 10 * bsz * h * n * (kb - ka) * d
            if progress is not None:
                progress()
        dq5[:, :, :, qa:qb] += dt(scale) * dq_b.reshape(bsz, hkv, g, n, d)
    return flops


def _extra_errors(xp, q, dout, out, lse, check_finite: bool) -> Optional[str]:
    """This rank's complaint about dout, out and lse (q is checked by prepare)."""
    shape = tuple(q.shape)
    want_lse = shape[:-3] + (shape[-2], shape[-3])
    for name, x, want in (("dout", dout, shape), ("out", out, shape), ("lse", lse, want_lse)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return f"{name} must be an array, got {type(x).__name__}"
        if tuple(x.shape) != want:
            return f"{name} has shape {tuple(x.shape)}, expected {want}"
        if str(x.dtype) not in ("float16", "float32", "float64"):
            return f"{name} has dtype {x.dtype}; supported: float16, float32, float64"
        if is_cupy(x) != is_cupy(q):
            return f"{name} is a {type(x).__name__} but q is a {type(q).__name__}"
    if check_finite:
        for name, x in (("dout", dout), ("out", out)):
            if x.size and not bool(xp.isfinite(x).all()):
                return f"{name} contains NaN or Inf (check_finite=True)"
        if lse.size and bool(xp.isnan(lse).any() or xp.isposinf(lse).any()):
            return "lse contains NaN or +Inf (check_finite=True)"
    return None


def ring_attention_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    comm: Optional[MPI.Comm] = None,
    *,
    causal: bool = False,
    layout: str = "zigzag",
    scale: Optional[float] = None,
    check_finite: bool = False,
    stats: Optional[dict] = None,
):
    """Exact gradients of ring attention for this rank's shards.

    Parameters
    ----------
    dout : array (S_local, H, D) or (B, S_local, H, D)
        Gradient of the loss with respect to this rank's attention output.
    q : array (S_local, H, D) or (B, S_local, H, D)
        This rank's queries, laid out as ``ringmpi.shard(..., layout=layout)``.
    k, v : array (S_local, Hkv, D) or (B, S_local, Hkv, D)
        This rank's keys and values; H % Hkv == 0.
    out : array, shape of q
        The output ``ring_attention`` returned for these inputs.
    lse : array (H, S_local) or (B, H, S_local)
        The log-sum-exp ``ring_attention(..., return_lse=True)`` returned.
    comm : mpi4py.MPI.Comm, optional
        The ranks holding the sequence, in ring order. Default MPI.COMM_WORLD.
    causal, layout, scale
        Exactly as given to the forward call.
    check_finite : bool
        Raise ValueError on every rank if q, k, v, dout or out hold NaN or Inf
        (or lse holds NaN or +Inf).
    stats : dict, optional
        Filled with compute_s, wait_s, total_s, flops, steps.

    Returns
    -------
    dq, dk, dv : arrays with the shapes and dtypes of q, k and v; the gradients
        with respect to this rank's own queries, keys and values.

    Notes
    -----
    numpy inputs only (the numpy tile is used whatever RINGMPI_CPU_KERNEL
    says). Every argument problem raises the same ValueError on all ranks
    before any message is exchanged.
    """
    t_start = time.perf_counter()
    comm = MPI.COMM_WORLD if comm is None else comm
    # q, k, v and the options: one allgather, identical errors everywhere
    be, args, qi, ki, vi = prepare(
        q, k, v, comm, causal=causal, layout=layout, scale=scale,
        check_finite=check_finite, what="ring_attention_backward",
    )  # fmt: skip
    # dout, out, lse: a second allgather, so a local problem raises everywhere
    err = None
    if be.name == "gpu":
        err = "CuPy arrays are not supported yet; the backward pass runs on numpy"
    if err is None:
        err = _extra_errors(be.xp, q, dout, out, lse, check_finite)
    bad = [(r, e) for r, e in enumerate(comm.allgather(err)) if e]
    if bad:
        r, msg = bad[0]
        more = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
        raise ValueError(f"ring_attention_backward: rank {r}: {msg}{more}")

    acc = np.dtype(args.acc_dtype)
    rank, size = comm.Get_rank(), comm.Get_size()
    n, cnt = args.n, args.counts
    q_pos = positions(n, rank, size, layout)

    def internal(x):  # (B?, S, H, D) -> (B, H, S, D) in the accumulation dtype
        x = x if x.ndim == 4 else x[None]
        return np.ascontiguousarray(np.moveaxis(x, -3, -2), dtype=acc)

    qa = qi.astype(acc, copy=False)
    do = internal(dout)
    # delta_i = dO_i . O_i, from the output the forward pass delivered
    delta = np.einsum("bhsd,bhsd->bhs", do, internal(out))
    lse_i = np.asarray(lse if lse.ndim == 3 else lse[None], dtype=acc)
    dq = np.zeros(qa.shape, dtype=acc)

    kv_shape = ki.shape
    smax = max(cnt)
    kv_bufs = pack_kv(np, ki, vi, smax)
    del ki, vi
    # dK/dV accumulators: two travelling buffers and one scratch for this
    # rank's contribution, each (2, B, Hkv, count, D) when viewed
    dsize = 2 * kv_shape[0] * kv_shape[1] * smax * kv_shape[3]
    d_bufs = [np.zeros(dsize, dtype=acc), np.empty(dsize, dtype=acc)]
    scratch = np.empty(dsize, dtype=acc) if size > 1 else None
    ring_kv, ring_d = Ring(comm), Ring(comm)

    def progress() -> None:
        ring_kv.test()
        ring_d.test()

    def dview(buf, count):
        return kv_view(buf, kv_shape, count)

    flops, compute_s = 0, 0.0
    try:
        for step in range(size):
            _maybe_fault(rank, step)
            src, kv = advance(ring_kv, kv_bufs, step, rank, size, kv_shape, cnt)
            # step 0 starts the accumulator of our own block; later steps write
            # into scratch while the block's accumulator is still arriving
            here = d_bufs[step % 2]
            mine = dview(here if step == 0 else scratch, cnt[src])
            if step > 0:
                mine[...] = 0
            t0 = time.perf_counter()
            flops += backward_tile(
                qa, kv[0], kv[1], do, lse_i, delta, q_pos,
                positions(n, src, size, layout), dq, mine[0], mine[1],
                scale=args.scale, causal=causal, progress=progress,
            )  # fmt: skip
            compute_s += time.perf_counter() - t0
            if size > 1:
                ring_d.wait()  # the accumulator for src has arrived; our last send is done
                if step > 0:
                    dview(here, cnt[src])[...] += mine
                # pass it on; the last hop (after step P-1) brings each block home
                nxt_d = d_bufs[(step + 1) % 2]
                nxt_owner = (src - 1) % size if step + 1 < size else rank
                ring_d.start(
                    here[: dview(here, cnt[src]).size],
                    nxt_d[: dview(nxt_d, cnt[nxt_owner]).size],
                    tag=TAG_DKV,
                )
            ring_kv.wait()
        ring_d.wait()
    finally:
        ring_kv.free()
        ring_d.free()
    dkv = dview(d_bufs[size % 2] if size > 1 else d_bufs[0], cnt[rank])

    def external(x, like):  # (B, H, S, D) -> like's layout and dtype
        x = np.moveaxis(x, -2, -3).astype(like.dtype)
        return x if like.ndim == 4 else x[0]

    grads = external(dq, q), external(dkv[0], k), external(dkv[1], v)
    if stats is not None:
        stats.update(
            compute_s=compute_s,
            wait_s=ring_kv.wait_s + ring_d.wait_s,
            total_s=time.perf_counter() - t_start,
            flops=flops,
            steps=size,
            backend="numpy",
        )
    return grads
