"""Absorbed multi-head latent attention on the fused CPU tile, and its ring traffic (issue 42).

    python benchmarks/mla_bench.py                      # N=16384, H=16: minutes per call
    python benchmarks/mla_bench.py --n 2048 --rounds 3  # a quick look
    mpiexec -n 2 python -m mpi4py benchmarks/mla_bench.py --n 2048 --ring

Speed: the fused forward tile, float32, one call over N queries and N keys (no mask), H
query heads and one K/V head, at D = 128 (Dk = Dv) and at Dk = 576, Dv = 512 (the absorbed
latent), alternated for ``--rounds`` rounds in one process (so machine noise hits both
alike). The D = 128 rate (model flops 4 N^2 D H / the median time) predicts the MLA call's
time from its flop count, 2 N^2 (Dk + Dv) H; the ratio measured / predicted is what the
issue bounds by 1.2.

Ring (``--ring``, under mpiexec): ``ring_attention`` with the absorbed shapes, causal, and
each rank's ``stats["bytes_sent"]`` against what the planner's cost model predicts,
``cost.kv_bytes`` of each block a rank forwards (every rank sends at each step but the last).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _tile_seconds(be, n: int, h: int, dk: int, dv: int, rng) -> tuple:
    """(seconds, model flops) of one fused forward tile call over n x n pairs."""
    from ringmpi import cost, softmax

    q = rng.standard_normal((1, h, n, dk)).astype(np.float32)
    k = (0.5 + rng.standard_normal((1, 1, n, dk))).astype(np.float32)
    v = (1.0 + 0.1 * rng.standard_normal((1, 1, n, dv))).astype(np.float32)
    pos = np.arange(n, dtype=np.int64)
    acc, m, l = softmax.init_state((1, h, n, dv), np.float32)
    t0 = time.perf_counter()
    be.forward_tile(q, k, v, pos, pos, acc, m, l, scale=dk**-0.5, causal=False)
    return time.perf_counter() - t0, cost.flops(n * n, dk, h, dv=dv)


def speed(n: int, h: int, rounds: int) -> dict:
    from ringmpi.backend import select

    be = select(np.zeros(1, np.float32), (576, 512))
    rng = np.random.default_rng(0)
    runs = {"d128": [], "mla": []}
    flops = {}
    for _ in range(rounds):  # A B B A
        for key, (dk, dv) in (("d128", (128, 128)), ("mla", (576, 512))):
            t, flops[key] = _tile_seconds(be, n, h, dk, dv, rng)
            runs[key].append(t)
        for key, (dk, dv) in (("mla", (576, 512)), ("d128", (128, 128))):
            t, flops[key] = _tile_seconds(be, n, h, dk, dv, rng)
            runs[key].append(t)
    t128, tmla = (float(np.median(runs[k])) for k in ("d128", "mla"))
    rate = flops["d128"] / t128
    predicted = flops["mla"] / rate
    return {
        "tile": be.describe(),
        "n": n,
        "heads": h,
        "d128_s": t128,
        "d128_gflops": rate / 1e9,
        "mla_s": tmla,
        "mla_gflops": flops["mla"] / tmla / 1e9,
        "mla_predicted_s": predicted,
        "ratio": tmla / predicted,
    }


def ring(n: int, h: int) -> None:
    from mpi4py import MPI

    import ringmpi
    from ringmpi import cost
    from ringmpi.layout import counts

    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(1)
    q = rng.standard_normal((n, h, 576)).astype(np.float32)
    k = (0.5 + rng.standard_normal((n, 1, 576))).astype(np.float32)
    v = (1.0 + 0.1 * rng.standard_normal((n, 1, 512))).astype(np.float32)
    loc = [ringmpi.shard(x, comm, "zigzag") for x in (q, k, v)]
    st: dict = {}
    comm.Barrier()
    t0 = time.perf_counter()
    ringmpi.ring_attention(*loc, comm, causal=True, scale=192**-0.5, stats=st)
    t = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    cnt = counts(n, comm.size, "zigzag")
    want = sum(
        cost.kv_bytes(int(cnt[(comm.rank - s) % comm.size]), 1, 576, 4, dv=512)
        for s in range(comm.size - 1)
    )
    rows = comm.gather((comm.rank, st["bytes_sent"], want))
    if comm.rank == 0:
        print(f"ring P={comm.size} N={n} H={h} absorbed MLA, causal: {t:.2f} s; {st['tile']}")
        for r, got, w in rows:
            print(
                f"  rank {r}: sent {got:,} bytes, planner {w:,}: "
                + ("equal" if got == w else "DIFFER")
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--ring", action="store_true")
    a = p.parse_args()
    if a.ring:
        ring(a.n, a.heads)
        return
    r = speed(a.n, a.heads, a.rounds)
    print(
        f"fused forward, float32, N={r['n']}, H={r['heads']}, Hkv=1 ({r['tile']}):\n"
        f"  D=128:           {r['d128_s']:.3f} s, {r['d128_gflops']:.1f} GFLOP/s\n"
        f"  Dk=576, Dv=512:  {r['mla_s']:.3f} s, {r['mla_gflops']:.1f} GFLOP/s; "
        f"predicted from the D=128 rate {r['mla_predicted_s']:.3f} s: ratio {r['ratio']:.2f}"
    )


if __name__ == "__main__":
    main()
