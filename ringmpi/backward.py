"""Exact gradients of ring attention: the backward pass over the same ring.

Every gradient term (see :mod:`ringmpi.cpu.numpy_tile` for the formulas) is a
sum over key blocks (dQ) or over query blocks (dK, dV), so the work splits over
the ring exactly like the forward pass: q, dO, O, lse and the dQ accumulator
stay home while K/V travel (:class:`ringmpi.ring.KVRing`). The dK/dV of a block
are sums over every rank's queries, so they travel too: each rank adds its
contribution to the accumulator of the block it holds and passes it on; after
the P compute steps one more hop brings every accumulator home.

The accumulator for a block arrives from the previous rank while this rank is
computing its own contribution into a scratch buffer; the two are added after
the compute and sent on, so the dK/dV hop overlaps the next rank's compute just
as the K/V hop overlaps ours. Nothing is rounded to the input dtype until the
end: accumulation is float32 (float64 for float64 inputs).

Per step a rank computes 10 * Sq * Sk * D * H flops (five matrix products;
causal tiles that are fully masked are skipped) and sends 2 * Sk * Hkv * D
input-dtype elements (K/V) plus 2 * Sk * Hkv * D accumulation-dtype elements
(dK/dV). With keys and values of different widths (issue 42) the products
take 2 * (3 Dk + 2 Dv) flops per pair and head and a block is Sk * Hkv * (Dk + Dv)
elements. The tile comes from the backend (:attr:`ringmpi.backend.Backend.backward_tile`).
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
from mpi4py import MPI

from . import cost, reproducible_backward
from .arguments import RingArgs, agree, report, to_internal
from .layout import positions
from .mask import plan_steps, tile_modifiers
from .parallel import HeadGroups
from .ring import KVRing
from .runtime import interrupt
from .runtime.watchdog import watch
from .spec import AttentionSpec, spec_keywords

__all__ = ["ring_attention_backward", "TAG_DKV"]

TAG_DKV = 7302


@spec_keywords
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
    head_parallel: int = 1,
    window: Optional[tuple] = None,
    cu_seqlens=None,
    cu_seqlens_k=None,
    slices=None,
    reproducible: bool = False,
    spec: Optional[AttentionSpec] = None,
    **modifiers,
):
    """Exact gradients of ring attention for this rank's shards.

    Parameters
    ----------
    dout : array (S_local, H, Dv) or (B, S_local, H, Dv)
        Gradient of the loss with respect to this rank's attention output.
    q : array (S_local, H, Dk) or (B, S_local, H, Dk)
        This rank's queries, laid out as ``ringmpi.shard(..., layout=layout)``.
    k : array (S_local, Hkv, Dk) or (B, S_local, Hkv, Dk)
    v : array (S_local, Hkv, Dv) or (B, S_local, Hkv, Dv)
        This rank's keys and values; H % Hkv == 0; the value width Dv may differ from
        the key width Dk (multi-head latent attention).
    out : array, shape of dout
        The output ``ring_attention`` returned for these inputs.
    lse : array (H, S_local) or (B, H, S_local)
        The log-sum-exp ``ring_attention(..., return_lse=True)`` returned.
    comm : mpi4py.MPI.Comm, optional
        The ranks holding the sequence, in ring order. Default MPI.COMM_WORLD.
    causal, layout, scale, head_parallel, window, cu_seqlens, cu_seqlens_k, slices
        Exactly as given to the forward call, and so are the score modifiers:
    {modifiers}
    reproducible : bool
        dq, dk, dv (and dsinks) bitwise the same for the same global inputs whatever P,
        the layout, the threads and numpy's CPU dispatch (issue 40;
        :mod:`ringmpi.reproducible_backward`, docs/reproducible.md): numpy arrays, every
        mask and score modifier, heads x ring.
    check_finite : bool
        Raise ValueError on every rank if q, k, v, dout or out hold NaN or Inf
        (or lse holds NaN or +Inf).
    stats : dict, optional
        Filled with compute_s, wait_s, total_s, flops, tile_flops, steps,
        steps_computed, steps_skipped, bytes_sent, alltoall_bytes, backend and tile
        (as the forward; flops: 10 D per visible pair and query head).
    spec : ringmpi.spec.AttentionSpec, optional
        The forward's options as one value (then leave their keywords at the defaults).

    Returns
    -------
    dq, dk, dv : arrays with the shapes and dtypes of q, k and v; the gradients
        with respect to this rank's own queries, keys and values.
    dsinks : array (H,), only when ``sinks`` is given
        The gradient with respect to the sink logits, summed over every row of
        every rank (one Allreduce; the same on every rank): -sum_i
        exp(sink_h - lse_i) delta_i. Accumulation dtype (float32, float64 for
        float64 inputs), summed in float64; numpy (CuPy for CuPy inputs).

    Notes
    -----
    Runs on every backend (numpy, fused C, CUDA); bfloat16 held as uint16 bits on
    the GPU comes back as uint16 bits. Every argument problem (also a backend
    without a backward tile: :meth:`ringmpi.backend.Backend.supports`) raises the
    same ValueError on all ranks before any message is exchanged.
    """
    t_start = time.perf_counter()
    comm = MPI.COMM_WORLD if comm is None else comm
    spec = AttentionSpec.of(
        spec,
        causal=causal,
        layout=layout,
        scale=scale,
        window=window,
        cu_seqlens=cu_seqlens,
        cu_seqlens_k=cu_seqlens_k,
        slices=slices,
        head_parallel=head_parallel,
        reproducible=reproducible,
        **modifiers,
    )
    # every array and option in one allgather: identical errors everywhere
    arrays = {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse}
    args = agree(comm, spec, arrays, what="ring_attention_backward", check_finite=check_finite)
    if args.spec.reproducible:  # its own loop (issue 40): ringmpi.reproducible_backward
        return reproducible_backward.backward(comm, args, dout, q, k, v, out, lse, stats, t_start)
    be = args.backend
    xp, acc = be.xp, args.acc_dtype
    with HeadGroups(comm, args, q.shape[-2], k.shape[-2]) as groups:
        qs = [groups.scatter(_batched(x), "q") for x in (q, dout, out)]
        ki, vi = (
            to_internal(xp, groups.scatter(_batched(x), "kv"), args.tile_dtype) for x in (k, v)
        )
        qa = be.decode(to_internal(xp, qs[0], args.tile_dtype)).astype(acc, copy=False)
        do = to_internal(xp, be.decode(qs[1]), acc)
        # delta_i = dO_i . O_i, from the output the forward pass delivered
        delta = (do * to_internal(xp, be.decode(qs[2]), acc)).sum(axis=-1)
        lse_i = xp.asarray(groups.scatter(lse if lse.ndim == 3 else lse[None], "lse"), dtype=acc)
        del arrays, qs
        dq, dk, dv, st = _loop(groups.ring, args, qa, ki, vi, do, lse_i, delta, groups.heads)
        dsinks = _dsinks(comm, args, lse_i, delta, groups.heads)
        # a K/V head replicated over the group got gradient from several members: summed
        # here, in the accumulation dtype
        grads = tuple(
            groups.gather(g.swapaxes(-2, -3), kind, add=kind == "kv")
            for g, kind in ((dq, "q"), (dk, "kv"), (dv, "kv"))
        )
    grads = tuple(_external(be.cast_out(g, like.dtype), like) for g, like in zip(grads, (q, k, v)))
    report(
        stats,
        t_start,
        **st,
        alltoall_bytes=groups.alltoall_bytes,
        backend=be.name,
        tile=be.describe(),
    )
    return grads if dsinks is None else (*grads, dsinks)


def _dsinks(comm, args: RingArgs, lse_i, delta, heads):
    """dsinks (H,) summed over every row of every rank, or None without sinks.

    The sink is a key of value 0 with probability p_i = exp(sink_h - lse_i)
    (lse includes the sink), so dL/dsink_h = sum_i p_i (0 - delta_i).
    """
    sinks = args.spec.sinks
    if sinks is None:
        return None
    xp = args.backend.xp
    full = np.asarray(sinks, dtype=np.float64)
    mine = xp.asarray(full[heads], dtype=lse_i.dtype).reshape(1, -1, 1)
    part = -(xp.exp(mine - lse_i) * delta).astype(xp.float64).sum(axis=(0, 2))
    local = np.zeros(len(full))
    local[heads] = part.get() if hasattr(part, "get") else part
    total = np.empty_like(local)
    with watch("ring_attention_backward: the dsinks Allreduce"):
        comm.Allreduce(local, total, op=MPI.SUM)
    return xp.asarray(total.astype(args.acc_dtype))


def _batched(x):
    return x if x.ndim == 4 else x[None]


def _external(x, like):
    return x if like.ndim == 4 else x[0]


def _loop(comm, args: RingArgs, qa, ki, vi, do, lse_i, delta, heads=slice(None)) -> tuple:
    """The backward ring over ``comm``: (dq, dk, dv) in the tile layout and accumulation dtype.

    Parameters
    ----------
    qa : (B, H, S, Dk) ; do : (B, H, S, Dv)
        Queries and dO in the accumulation dtype.
    ki : (B, Hkv, S_k, Dk) ; vi : (B, Hkv, S_k, Dv)
        This ring position's K/V block in the tile dtype.
    lse_i, delta : (B, H, S)
        The forward's log-sum-exp and the row sums of dO * O.
    heads : slice
        The query heads of ``qa`` among the call's (heads x ring), for per-head options.

    Returns
    -------
    dq : (B, H, S, Dk) ; dk : (B, Hkv, S_k, Dk) ; dv : (B, Hkv, S_k, Dv) ; stats : dict
    """
    be, acc, layout, causal = args.backend, args.acc_dtype, args.layout, args.causal
    xp = be.xp
    rank, size = comm.Get_rank(), comm.Get_size()
    cnt = args.counts_k
    plan = plan_steps(args.mask, rank, size, layout)
    masked = {} if plan.bounds is None else {"bounds": plan.bounds}
    masked.update(tile_modifiers(args.spec, args.mask, plan.q_pos, heads))
    dq = xp.zeros(qa.shape, dtype=acc)

    # dK/dV accumulators: two travelling buffers and one scratch for this
    # rank's contribution, each (B, Hkv, count, Dk) then (B, Hkv, count, Dv) when viewed
    b, hkv, _, d = ki.shape
    dv_width = vi.shape[-1]
    dsize = b * hkv * max(cnt) * (d + dv_width)
    d_bufs = [xp.zeros(dsize, dtype=acc), xp.zeros(dsize, dtype=acc)]
    scratch = xp.empty(dsize, dtype=acc) if plan.nsteps > 1 else None
    h = qa.shape[1]
    flops, tile_flops, compute_s, computed = 0, 0, 0.0, 0
    with interrupt.catching(), KVRing(comm, be, ki, vi, cnt, plan.nsteps) as kv:
        del ki, vi
        ring_d = be.ring(comm)
        stopped = True  # until the loop ends normally: then free waits, else it cancels
        try:

            def progress() -> None:
                kv.ring.test()
                ring_d.test()

            for step, src, kb, vb in kv:
                # step 0 starts the accumulator of our own block; later steps write
                # into scratch while the block's accumulator is still arriving
                here = d_bufs[step % 2]
                span = kv.span(cnt[src])
                mine = here if step == 0 else scratch
                mine_k, mine_v = kv.parts(mine, cnt[src])
                if plan.compute[step]:
                    if step > 0:
                        mine[:span] = 0
                    t0 = time.perf_counter()
                    k_pos = positions(
                        args.nk, src, size, layout, cu_seqlens=args.mask.cu_k, mask=args.mask
                    )
                    tile_flops += plan.tile_at(be.backward_tile, step)(
                        qa,
                        kb,
                        vb,
                        do,
                        lse_i,
                        delta,
                        plan.q_pos,
                        k_pos,
                        dq,
                        mine_k,
                        mine_v,
                        scale=args.scale,
                        causal=causal,
                        progress=progress,
                        **masked,
                    )
                    compute_s += time.perf_counter() - t0
                    computed += 1
                    pairs = plan.pairs(step, k_pos, causal)
                    flops += cost.flops(pairs, d, h, b, backward=True, dv=dv_width)
                if plan.nsteps == 1:
                    continue  # our own block only: its accumulator is already home
                with watch(f"ring step {step}: the dK/dV block from rank {ring_d.prev}"):
                    ring_d.wait()  # the accumulator for src has arrived; our last send is done
                if step > 0 and plan.compute[step]:
                    here[:span] += mine[:span]
                nxt_d = d_bufs[(step + 1) % 2]
                here_n = span
                if step + 1 < plan.nsteps:  # pass it on to the next rank
                    nxt_n = kv.span(cnt[kv.owner(step + 1)])
                    ring_d.start(here[:here_n], nxt_d[:nxt_n], tag=TAG_DKV)
                else:  # the last hop: every accumulator straight home (next rank after P steps)
                    home = kv.span(cnt[rank])
                    ring_d.start(
                        here[:here_n],
                        nxt_d[:home],
                        tag=TAG_DKV,
                        dest=src,
                        source=(rank + step) % size,
                    )
            with watch(f"the last dK/dV hop to rank {rank}"):
                ring_d.wait()
            stopped = False
        finally:
            ring_d.free(abandon=stopped)
    dkv = kv.parts(d_bufs[plan.nsteps % 2] if plan.nsteps > 1 else d_bufs[0], cnt[rank])
    stats = dict(
        compute_s=compute_s,
        wait_s=kv.ring.wait_s + ring_d.wait_s,
        flops=flops,
        tile_flops=tile_flops,
        steps=plan.nsteps,
        steps_computed=computed,
        steps_skipped=size - plan.nsteps,
        bytes_sent=kv.bytes_sent,
    )
    return dq, dkv[0], dkv[1], stats
