"""Decode latency: decode_attention (merge of partials) vs a ring pass over the same cache.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/decode_bench.py --cache 32768
    OMP_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py benchmarks/decode_bench.py --cache 32768

Both compute the attention of Sq new queries (the same on every rank) against a
K/V cache of --cache tokens split evenly over the ranks. The ring pass moves the
cache blocks around the ring (P - 1 messages of a whole shard, KVRing) and
folds each into the state; decode_attention moves no K/V, only (D + 1) values
per query row and head in a log2(P) reduction. Prints the median of --repeat
runs of each, and their ratio, with the max difference between the two outputs.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import ringmpi
from ringmpi import softmax
from ringmpi.arguments import to_internal
from ringmpi.backend import select
from ringmpi.ring import KVRing


def ring_pass(q, k, v, comm):
    """Every rank: queries q against all ranks' (k, v), by rotating the shards round the ring."""
    be = select(q)
    qi, ki, vi = (to_internal(np, x, np.float32) for x in (q, k, v))
    acc, m, l = softmax.init_state(qi.shape, np.float32)
    cnt = comm.allgather(k.shape[0])
    q_pos = np.arange(q.shape[0], dtype=np.int64)
    with KVRing(comm, be, ki, vi, cnt) as kv:
        for _, src, kb, vb in kv:
            k_pos = np.arange(cnt[src], dtype=np.int64)
            be.forward_tile(
                qi,
                kb,
                vb,
                q_pos,
                k_pos,
                acc,
                m,
                l,
                scale=q.shape[-1] ** -0.5,
                causal=False,
                progress=kv.ring.test,
            )
    out, _ = softmax.finalize(acc, m, l)
    return np.moveaxis(out[0], 0, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=int, default=32768, help="cached tokens in all")
    ap.add_argument("--sq", type=int, default=1, help="new query tokens")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=21)
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(0)
    q = rng.standard_normal((a.sq, a.heads, a.head_dim), dtype=np.float32)
    part = np.array_split(np.arange(a.cache), comm.size)[comm.rank]
    r2 = np.random.default_rng(1 + comm.rank)
    k = r2.standard_normal((len(part), a.kv_heads, a.head_dim), dtype=np.float32)
    v = r2.standard_normal((len(part), a.kv_heads, a.head_dim), dtype=np.float32)
    res = {}
    for name, fn in (("decode", ringmpi.decode_attention), ("ring pass", ring_pass)):
        times = []
        for _ in range(a.repeat):
            comm.Barrier()
            t0 = time.perf_counter()
            out = fn(q, k, v, comm)
            times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        res[name] = (float(np.median(times)), out)
    diff = float(np.abs(res["decode"][1] - res["ring pass"][1]).max())
    diff = comm.allreduce(diff, op=MPI.MAX)
    if comm.rank == 0:
        t_dec, t_ring = res["decode"][0], res["ring pass"][0]
        print(
            f"P={comm.size} cache={a.cache} Sq={a.sq} H={a.heads} Hkv={a.kv_heads} "
            f"D={a.head_dim}: decode {t_dec * 1e3:.3f} ms, ring pass {t_ring * 1e3:.3f} ms, "
            f"ring/decode {t_ring / t_dec:.1f}x, max |diff| {diff:.1e}"
        )


if __name__ == "__main__":
    main()
