"""Masks beyond causal: time and bytes of sliding windows vs full causal; packed-sequence balance.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/mask_bench.py --n 32768
    OMP_NUM_THREADS=1 python benchmarks/mask_bench.py --tile  # fused vs numpy masked tile, one rank
    python benchmarks/mask_bench.py --balance  # work balance, 16 packed sequences, no MPI

Windows: ring_attention(causal=True, window=(W, 0)) under the contiguous layout
against full causal attention of the same inputs, same run, with each CPU tile of
--kernels (RINGMPI_CPU_KERNEL): time (max over ranks, median of --repeat; the
repeats go round all configurations in turn, so each sees the same machine
load), ring steps run and K/V bytes sent in all.
Tile: one forward tile call with mask bounds, fused C kernel vs numpy tile, over
all N rows and keys (positions 0..N-1), for a causal window and for causal packed
sequences, with plain causal (no bounds) as the yardstick; median of --repeat,
alternating.
Balance: for 16 sequences of mixed length packed with cu_seqlens, the visible
(query, key) pairs each rank computes under a causal mask, max/mean per layout.

Slices (issue 41: cost follows the mask), under MPI, every layout, each CPU tile of --kernels:

    OMP_NUM_THREADS=1 MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 mpiexec -n 4 python -m mpi4py \
        benchmarks/mask_bench.py --slices --n 16384

For each builder of ringmpi.slices, ring_attention(slices=...) on every layout:
- work: the flops the tiles report scoring (stats["tile_flops"]: whole blocks or strips,
  masked part included) over the visible pairs the planner counts (stats["flops"], which
  must equal cost.flops(cost.rank_pairs(...)) on every rank: checked), per rank, the
  slowest-ratio rank and the total;
- balance: the planner's imbalance (cost.imbalance: max/mean of the ranks' visible
  pairs) beside the measured ones: max/mean over ranks of the tile flops, of the tiles'
  thread CPU time (time.thread_time around each tile call: what the rank computed, not the
  time it waited for a core; ranks are oversubscribed when P exceeds the cores), and of
  the tiles' wall time (stats["compute_s"]). Times: median of --repeat per rank.

Tile calls (``--tile-calls``, one process, no MPI): every forward tile call the P =
--ranks[0] ranks make for global_local(n, 256, 64) on each layout, timed (thread CPU
time) and grouped by the mean visible keys a row has in the call: where a layout cuts
the rows' key ranges into short pieces, the tile runs at a fraction of its speed.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import ringmpi
from ringmpi.mask import make_mask


def _packed_lengths(rng, n_seq: int = 16) -> np.ndarray:
    return rng.integers(50, 4000, n_seq)


def windows(args) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(0)
    n, h, d = args.n, args.heads, args.head_dim
    q, k, v = (rng.standard_normal((n, h, d)).astype(np.float32) for _ in range(3))
    loc = [ringmpi.shard(x, comm, "contiguous") for x in (q, k, v)]
    configs = [(kern, w) for kern in args.kernels for w in [None, *args.windows]]
    times: dict = {c: [] for c in configs}
    info: dict = {}
    for _ in range(args.repeat):
        for kern, w in configs:
            os.environ["RINGMPI_CPU_KERNEL"] = kern
            kw = {} if w is None else {"window": (w, 0)}
            st: dict = {}
            comm.Barrier()
            t0 = time.perf_counter()
            ringmpi.ring_attention(*loc, comm, causal=True, layout="contiguous", stats=st, **kw)
            times[kern, w].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            info[kern, w] = (st["backend"], st["steps"], comm.allreduce(st["bytes_sent"]))
    if comm.rank == 0:
        print(
            f"N={n} H={h} D={d} float32 causal, contiguous, P={comm.size}, median of {args.repeat}"
        )
        print(
            f"{'tile':>6} {'window':>8} {'time s':>8} {'x full':>7} {'steps':>6}"
            f" {'MiB sent':>9} {'x full':>7}"
        )
        for kern, w in configs:
            backend, steps, sent = info[kern, w]
            t = float(np.median(times[kern, w]))
            t_full = float(np.median(times[kern, None]))
            b_full = info[kern, None][2]
            name = "full" if w is None else str(w)
            frac = sent / b_full if b_full else float("nan")
            print(
                f"{backend:>6} {name:>8} {t:8.3f} {t / t_full:7.3f} {steps:6d}"
                f" {sent / 2**20:9.1f} {frac:7.3f}"
            )


def tile(args) -> None:
    from ringmpi.cpu import fused, numpy_tile
    from ringmpi.softmax import init_state

    if not fused.available():
        raise SystemExit(f"fused tile unavailable: {fused.unavailable_reason()}")
    rng = np.random.default_rng(0)
    n, h, d = args.n, args.heads, args.head_dim
    lengths = _packed_lengths(rng)
    cu = np.concatenate(([0], np.cumsum(lengths)))
    cu = cu[cu < n].tolist() + [n]  # sequences cut to N tokens
    pos = np.arange(n, dtype=np.int64)
    cases = [
        ("causal, no bounds (yardstick)", None),
        (f"window ({args.tile_window}, 0) causal", dict(window=(args.tile_window, 0))),
        (f"packed causal, {len(cu) - 1} seqs", dict(cu_seqlens=np.array(cu))),
    ]
    q, k, v = (rng.standard_normal((1, h, n, d)).astype(np.float32) for _ in range(3))
    print(f"one tile, N={n} H={h} D={d} float32, fused {fused.isa()}, median of {args.repeat}")
    print(f"{'mask':>30} {'fused s':>8} {'numpy s':>8} {'numpy/fused':>12}")
    for name, kw in cases:
        bounds = None if kw is None else make_mask(n, n, True, **kw).bounds(pos)
        t = {"fused": [], "numpy": []}
        for _ in range(args.repeat):
            for label, fn in (("fused", fused.forward_tile), ("numpy", numpy_tile.forward_tile)):
                st = init_state(q.shape, np.float32)
                t0 = time.perf_counter()
                fn(q, k, v, pos, pos, *st, scale=d**-0.5, causal=True, bounds=bounds)
                t[label].append(time.perf_counter() - t0)
        tf, tn = float(np.median(t["fused"])), float(np.median(t["numpy"]))
        print(f"{name:>30} {tf:8.3f} {tn:8.3f} {tn / tf:12.2f}")


def balance(args) -> None:
    rng = np.random.default_rng(1)
    lengths = _packed_lengths(rng)
    cu = np.concatenate(([0], np.cumsum(lengths)))
    n = int(cu[-1])
    mask = make_mask(n, n, True, cu_seqlens=cu)
    print(f"16 packed sequences, lengths {lengths.min()}..{lengths.max()}, N={n}, causal")
    print(f"{'P':>3} {'layout':>11} {'max/mean work':>14}")
    for p in args.ranks:
        for layout in ringmpi.LAYOUTS:
            work = []
            for r in range(p):
                lo, hi = mask.bounds(ringmpi.positions(n, r, p, layout, cu_seqlens=cu))
                work.append(int(np.maximum(hi - lo + 1, 0).sum()))
            work = np.array(work, dtype=float)
            print(f"{p:>3} {layout:>11} {work.max() / work.mean():14.3f}")


def slice_masks(n: int) -> list:
    """(name, Slices) of each builder at length n (the masks of docs/masks.md's table)."""
    from ringmpi import slices

    return [
        ("global_local(n, 256, 64)", slices.global_local(n, 256, 64)),
        ("global_local(n, 256, 64, causal)", slices.global_local(n, 256, 64, causal=True)),
        ("prefix_lm(n, n // 4)", slices.prefix_lm(n, n // 4)),
        (
            "shared_prefix(n//4, [n//8, n//4, n//8, n//4])",
            slices.shared_prefix(n // 4, [n // 8, n // 4, n // 8, n // 4]),
        ),
        ("block_sparse(n, 256, seed=0, causal)", slices.block_sparse(n, 256, seed=0, causal=True)),
    ]


_TILE_CPU = [0.0]  # thread CPU seconds inside forward tile calls (this rank)


def _time_tiles() -> None:
    """Wrap the CPU forward tiles so that their thread CPU time adds up in _TILE_CPU."""
    from ringmpi.cpu import fused, numpy_tile

    for mod in (fused, numpy_tile):
        tile = mod.forward_tile

        def timed(*a, _tile=tile, **kw):
            t0 = time.thread_time()
            try:
                return _tile(*a, **kw)
            finally:
                _TILE_CPU[0] += time.thread_time() - t0

        mod.forward_tile = timed


def slices_work(args) -> None:
    from mpi4py import MPI

    from ringmpi import cost
    from ringmpi.mask import mask_of
    from ringmpi.spec import AttentionSpec
    from ringmpi.testing import random_qkv

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    _time_tiles()
    n, h, d = args.n, args.heads, args.head_dim
    q, k, v = random_qkv(np.random.default_rng(0), n, h, h, d, dtype=np.float32, realistic=True)
    layouts = ringmpi.LAYOUTS + ("balanced",)
    if rank == 0:
        print(
            f"N={n} H={h} D={d} float32, P={size}, median of {args.repeat}; ratios are "
            "max/mean over ranks; work = tile flops / planner flops"
        )
        print(
            f"{'mask':<44} {'tile':>6} {'layout':>10} {'planner':>8} {'tile fl':>8}"
            f" {'cpu s':>8} {'wall s':>8} {'slowest s':>9} {'work':>6} {'work max':>8}"
        )
    for name, s in slice_masks(n):
        mask = mask_of(AttentionSpec(slices=s), n, n)
        for kern in args.kernels:
            os.environ["RINGMPI_CPU_KERNEL"] = kern
            for lay in layouts:
                planner = cost.rank_pairs(mask, size, lay)
                loc = [ringmpi.shard(x, comm, lay, slices=s) for x in (q, k, v)]
                cpu, wall = [], []
                repeat = args.repeat if kern == "fused" else 1
                for _ in range(repeat):
                    st: dict = {}
                    _TILE_CPU[0] = 0.0
                    comm.Barrier()
                    ringmpi.ring_attention(*loc, comm, layout=lay, slices=s, stats=st)
                    cpu.append(_TILE_CPU[0])
                    wall.append(st["compute_s"])
                want = cost.flops(int(planner[rank]), d, h)
                if st["flops"] != want:
                    raise SystemExit(
                        f"rank {rank}: stats flops {st['flops']} != planner {want} ({name}, {lay})"
                    )
                mine = (
                    st["tile_flops"],
                    st["flops"],
                    float(np.median(cpu)),
                    float(np.median(wall)),
                )
                rows = np.array(comm.gather(mine, root=0) or [], dtype=float)
                if rank == 0:
                    tf, fl, c, w = rows.T

                    def imb(x):
                        return float(x.max() / x.mean()) if x.mean() > 0 else 1.0

                    print(
                        f"{name:<44} {st['backend']:>6} {lay:>10}"
                        f" {cost.imbalance(mask, size, lay):8.3f} {imb(tf):8.3f} {imb(c):8.3f}"
                        f" {imb(w):8.3f} {c.max():9.3f} {tf.sum() / fl.sum():6.3f}"
                        f" {float((tf / np.maximum(fl, 1)).max()):8.3f}",
                        flush=True,
                    )


def tile_calls(args) -> None:
    """One process: every tile call a ring at P = --ranks[0] would make for global_local,
    per layout, timed (thread CPU time), grouped by the keys a row sees in that call."""
    from ringmpi import slices
    from ringmpi.cpu import fused
    from ringmpi.mask import mask_of, plan_steps
    from ringmpi.softmax import init_state
    from ringmpi.spec import AttentionSpec

    n, h, d, size = args.n, args.heads, args.head_dim, args.ranks[0]
    s = slices.global_local(n, 256, 64)
    mask = mask_of(AttentionSpec(slices=s), n, n)
    rng = np.random.default_rng(0)
    print(f"global_local(n, 256, 64), N={n} H={h} D={d} float32, P={size}, fused {fused.isa()}")
    print(f"{'layout':>10} {'keys/row/call':>14} {'calls':>6} {'GFLOP':>7} {'GFLOP/s':>8}")
    for lay in ringmpi.LAYOUTS + ("balanced",):
        groups: dict = {}
        for r in range(size):
            plan = plan_steps(mask, r, size, lay)
            q = rng.standard_normal((1, h, len(plan.q_pos), d)).astype(np.float32)
            acc, m, l = init_state(q.shape, np.float32)
            for step in np.flatnonzero(plan.compute):
                k_pos = ringmpi.positions(n, (r - step) % size, size, lay, mask=mask)
                k, v = (rng.standard_normal((1, h, len(k_pos), d)).astype(np.float32) for _ in "kv")
                ks = np.sort(k_pos)
                for t in plan.layer_steps[step]:
                    lo, hi = plan.layers[t]
                    seen = np.searchsorted(ks, hi, "right") - np.searchsorted(ks, lo, "left")
                    per_row = float(seen[seen > 0].mean()) if (seen > 0).any() else 0.0
                    c0 = time.thread_time()
                    fl = fused.forward_tile(
                        q,
                        k,
                        v,
                        plan.q_pos,
                        k_pos,
                        acc,
                        m,
                        l,
                        scale=d**-0.5,
                        causal=False,
                        bounds=(lo, hi),
                    )
                    dt = time.thread_time() - c0
                    key = "<= 64" if per_row <= 64 else "65-256" if per_row <= 256 else "> 256"
                    g = groups.setdefault(key, [0, 0.0, 0.0])
                    g[0], g[1], g[2] = g[0] + 1, g[1] + fl, g[2] + dt
        for key in ("<= 64", "65-256", "> 256", None):
            if key and key not in groups:
                continue
            vals = [groups[key]] if key else list(groups.values())
            calls, fl, dt = (sum(x[i] for x in vals) for i in range(3))
            print(f"{lay:>10} {key or 'all':>14} {calls:6d} {fl / 1e9:7.2f} {fl / dt / 1e9:8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--windows", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--kernels",
        nargs="+",
        default=["fused", "numpy"],
        choices=["fused", "numpy"],
        help="CPU tiles to time side by side (RINGMPI_CPU_KERNEL)",
    )
    ap.add_argument("--balance", action="store_true", help="only the packed-sequence balance")
    ap.add_argument("--tile", action="store_true", help="only fused vs numpy masked tile")
    ap.add_argument(
        "--slices", action="store_true", help="masks of slices: tile work and rank balance (MPI)"
    )
    ap.add_argument(
        "--tile-calls",
        action="store_true",
        help="global_local's tile calls per layout at P = --ranks[0], by keys per row (no MPI)",
    )
    ap.add_argument("--tile-window", type=int, default=256)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args()
    if args.balance:
        balance(args)
    elif args.tile:
        tile(args)
    elif args.slices:
        slices_work(args)
    elif args.tile_calls:
        tile_calls(args)
    else:
        windows(args)


if __name__ == "__main__":
    main()
