"""Peer semantics: masks of slices through torch FlexAttention on the CPU vs ringmpi, one process.

For each builder of :mod:`ringmpi.slices` and one random union of slices (with rows that
no slice reaches), the same mask runs through

- ringmpi's single-rank forward, ``ring_attention(q, k, v, MPI.COMM_SELF, slices=s)``
  (the fused C tile where it builds, else the numpy tile: printed), and
- ``torch.nn.attention.flex_attention`` with a ``mask_mod`` and a block mask made from the
  same :class:`ringmpi.Slices`, compiled with ``torch.compile`` (the fused CPU template of
  inductor) or, where compiling fails, eager (which materialises the scores; said in the
  table),

on values shaped like real data (``ringmpi.testing.random_qkv(..., realistic=True)``:
non-zero means, sink keys), float32, grouped-query heads. Both are judged by the rule of
``ringmpi.testing`` (FlashAttention's): the max error against the dense float64 reference
under the explicit boolean mask must be at most 2x the error of a plain float32 dense
computation of the same rows plus 1e-6. At large N the check covers evenly spaced rows
(``--check-rows``; the mask's rows are cut alike), the timing every row.

The ``mask_mod`` is the mask's normal form (:meth:`ringmpi.Slices.row_intervals`): each
row's visible keys as L sorted disjoint intervals, two int64 (L, N) tables, and
``mask_mod(b, h, q, k)`` is the OR over t < L of ``lo[t, q] <= k <= hi[t, q]`` (L is small:
1 to 3 for the builders, more for block-sparse rows). ``create_block_mask`` evaluates it
over the whole N x N grid once per pattern; its time is printed apart, not in Flex's.

A row that sees no key: ringmpi gives out = 0 (lse = -inf); torch 2.13's compiled and eager
CPU Flex give 0 as well. Where Flex gives NaN for such rows the table counts them and the
comparison reads them as 0 (``empty rows`` column: count, and what Flex gave).

Timing: median of ``--repeat`` alternating calls, process CPU time (the machine is shared:
wall time is printed too), one thread each (``torch.set_num_threads``; the fused tile is
single-threaded; run under OMP_NUM_THREADS=1). Flex's time excludes the compile (one warm-up
call) and the block mask; ringmpi's includes its whole call (the plan from the slices).
The ratio is Flex time / ringmpi time (> 1: ringmpi faster).

Needs torch (not a dependency of ringmpi), e.g. a separate environment::

    python3 -m venv .peer-venv && .peer-venv/bin/pip install torch numpy h5py mpi4py mpich
    .peer-venv/bin/pip install -e .
    OMP_NUM_THREADS=1 .peer-venv/bin/python benchmarks/flex_peer.py --n 2048 16384

Exit status 1 when ringmpi or Flex misses the tolerance on any pattern (or ringmpi's empty
rows are not exactly 0), 2 when torch or its FlexAttention is missing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import ringmpi
from ringmpi import reference, slices
from ringmpi.testing import random_qkv, tolerance


def patterns(n: int, seed: int = 0) -> list:
    """(name, Slices) of every builder at size ``n`` and one random union with uncovered rows."""
    w, g, blk = max(8, n // 64), max(2, n // 256), max(16, n // 64)
    rng = np.random.default_rng(seed)
    rand = []
    for _ in range(12):  # rows [0, n // 16) are covered by no slice: empty rows
        q0, q1 = np.sort(rng.integers(n // 16, n + 1, 2))
        k0, k1 = np.sort(rng.integers(0, n + 1, 2))
        rand.append((int(q0), int(q1), int(k0), int(k1), str(rng.choice(slices.KINDS))))
    return [
        (f"global_local(n, {w}, {g})", slices.global_local(n, w, g)),
        (f"global_local(n, ({w}, 0), {g}, causal)", slices.global_local(n, (w, 0), g, True)),
        ("prefix_lm(n, n // 4)", slices.prefix_lm(n, n // 4)),
        (
            "shared_prefix(n // 4, [n//8, n//4, n//8, n//4])",
            slices.shared_prefix(n // 4, [n // 8, n // 4, n // 8, n // 4]),
        ),
        (
            f"block_sparse(n, {blk}, seed=0, causal)",
            slices.block_sparse(n, blk, seed=0, causal=True),
        ),
        ("random union of 12 slices", ringmpi.Slices(rand)),
    ]


def mask_mod_of(s: ringmpi.Slices, n: int, torch):
    """A FlexAttention mask_mod for ``s`` over n x n: the OR of the rows' interval lookups."""
    lo, hi = s.row_intervals(np.arange(n))
    lo_t, hi_t = torch.from_numpy(lo), torch.from_numpy(hi)
    layers = lo.shape[0]

    def mask_mod(b, h, q_idx, kv_idx):
        seen = (lo_t[0, q_idx] <= kv_idx) & (kv_idx <= hi_t[0, q_idx])
        for t in range(1, layers):
            seen = seen | ((lo_t[t, q_idx] <= kv_idx) & (kv_idx <= hi_t[t, q_idx]))
        return seen

    if layers == 0:  # nothing visible anywhere

        def mask_mod(b, h, q_idx, kv_idx):  # noqa: F811
            return kv_idx < 0

    return mask_mod, layers


def _timed(times: dict, key: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, its (process CPU, wall) seconds appended to ``times[key]``."""
    w0, c0 = time.perf_counter(), time.process_time()
    res = fn(*args, **kwargs)
    times.setdefault(key, []).append((time.process_time() - c0, time.perf_counter() - w0))
    return res


def run(args, torch, flex_attention, create_block_mask) -> bool:
    from mpi4py import MPI

    ok_all = True
    torch.set_num_threads(args.threads)
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    print(
        f"H={h} Hkv={hkv} D={d} float32, torch {torch.__version__} ({args.threads} thread), "
        f"median of {args.repeat}, process CPU seconds (wall in brackets)"
    )
    head = (
        f"{'N':>6} {'pattern':<46} {'L':>2} {'vis/N^2':>7} {'empty':>9} {'flex':>8}"
        f" {'ring err/tol':>12} {'flex err/tol':>12} {'ringmpi s':>16} {'flex s':>16}"
        f" {'flex/ring':>9} {'blockmask s':>11}"
    )
    print(head)
    for n in args.n:
        rng = np.random.default_rng(n)
        q, k, v = random_qkv(rng, n, h, hkv, d, dtype=np.float32, realistic=True)
        qt, kt, vt = (
            torch.from_numpy(np.ascontiguousarray(x.transpose(1, 0, 2)))[None] for x in (q, k, v)
        )
        step = max(1, n // args.check_rows)
        rows = np.arange(0, n, step)
        for name, s in patterns(n):
            torch._dynamo.reset()  # a fresh compile per pattern: no cache-limit fallback to eager
            mask_mod, layers = mask_mod_of(s, n, torch)
            t0 = time.perf_counter()
            bm = create_block_mask(mask_mod, None, None, n, n, device="cpu")
            t_bm = time.perf_counter() - t0
            mode = "compiled"
            with torch.no_grad():
                try:
                    flex = torch.compile(flex_attention, dynamic=False)
                    flex(qt, kt, vt, block_mask=bm, enable_gqa=hkv != h)  # compile, warm up
                except Exception as e:  # noqa: BLE001 (the table says which ran)
                    print(
                        f"  compile failed ({type(e).__name__}: {str(e)[:120]}), eager", flush=True
                    )
                    mode, flex = "eager", flex_attention
            times: dict = {}
            st: dict = {}
            gqa = hkv != h
            for _ in range(args.repeat):
                out_r = _timed(
                    times,
                    "ring",
                    ringmpi.ring_attention,
                    q,
                    k,
                    v,
                    MPI.COMM_SELF,
                    slices=s,
                    stats=st,
                )
                with torch.no_grad():
                    out_f = _timed(times, "flex", flex, qt, kt, vt, block_mask=bm, enable_gqa=gqa)
            out_f = out_f[0].numpy().transpose(1, 0, 2)  # (H, S, D) -> (S, H, D)
            # the rule, on the checked rows: float64 reference and float32 peer, explicit mask
            dense = s.to_dense(n, n)[rows]
            ref, ref_lse = reference.attention(q[rows], k, v, mask=dense, block=256)
            peer, _ = reference.attention(q[rows], k, v, mask=dense, dtype=np.float32, block=256)
            tol = tolerance(ref, peer, dtype="float32")
            empty_all = ~s.to_dense(n, n).any(axis=1)
            flex_empty = out_f[empty_all]
            flex_says = (
                "-"
                if not empty_all.any()
                else "NaN"
                if np.isnan(flex_empty).any()
                else "0"
                if not np.abs(flex_empty).any()
                else "other"
            )
            out_f = np.where(np.isnan(out_f) & empty_all[:, None, None], 0.0, out_f)
            err_r = float(np.abs(out_r[rows].astype(np.float64) - ref).max())
            err_f = float(np.abs(out_f[rows].astype(np.float64) - ref).max())
            ring_empty_ok = not np.abs(out_r[empty_all]).any()
            ok = err_r <= tol and err_f <= tol and ring_empty_ok and flex_says in ("-", "0", "NaN")
            ok_all &= ok
            (cr, wr), (cf, wf) = (
                tuple(statistics.median(x[i] for x in times[key]) for i in (0, 1))
                for key in ("ring", "flex")
            )
            print(
                f"{n:>6} {name:<46} {layers:>2} {s.pairs(n) / n**2:7.3f}"
                f" {int(empty_all.sum()):>5} {flex_says:>3} {mode:>8}"
                f" {err_r / tol:12.3f} {err_f / tol:12.3f} {cr:7.3f} ({wr:6.3f})"
                f" {cf:7.3f} ({wf:6.3f}) {cf / cr:9.2f} {t_bm:11.2f}"
                + ("" if ok else "  DISAGREE"),
                flush=True,
            )
            if name == patterns(n)[0][0]:
                print(f"       (ringmpi tile: {st['backend']}; rows checked: every {step})")
            del out_r, out_f, dense, ref, peer, ref_lse
    return ok_all


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[2048, 16384])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the fused tile: 1)")
    ap.add_argument(
        "--check-rows", type=int, default=2048, help="rows checked against the reference (spread)"
    )
    args = ap.parse_args()
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        print(f"flex_peer: needs torch with FlexAttention ({e})", file=sys.stderr)
        raise SystemExit(2) from None
    ok = run(args, torch, flex_attention, create_block_mask)
    print("agree: every pattern within the rule" if ok else "DISAGREE on some pattern (above)")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
