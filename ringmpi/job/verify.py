"""``ringmpi verify``: compare an output file with dense attention computed from the inputs.

Every sequence is checked one of three ways, and the verdict says which:

* **full** (S <= ``max_tokens``, default 4096, or ``full=True``): every query
  row of every head against the dense float64 reference, in blocks of rows
  (memory O(rows x S), never S x S);
* **sampled** (longer sequences, the default): ``sample_rows`` random query rows
  per head (default S / 128 within [256, 2048]; seeded, the same on every rank)
  against the float64 reference over all S keys (O(rows x S) per head), plus two
  cheap checks of *every* row: out and lse are finite where they must be (a
  missing part reads NaN), and each output value lies within the range of the
  values of the keys it can see (an
  attention output is a convex combination of value rows), up to rounding;
* **skipped** (longer sequences with ``sample_rows=0``).

A checked row passes when ``|ring - ref64| <= 2 * max|dense_lowp - ref64| + eps``
(out and finite lse; the dense low-precision peer is computed on the same rows in
the precision the ring accumulated in; eps 1e-4 float16, 1e-6 float32, 1e-12
float64) and rows with lse = -inf agree exactly. The result is PASSED only if
something was checked and nothing failed; "nothing checked" is its own verdict.
The (sequence, head) pairs are shared round-robin over the ranks (fewer pairs
than ranks: each pair's rows are split over several), and rank 0 reports progress
every few seconds, also within one head.

The output's attributes say which mask and positions the run used (``causal``,
``window``, ``rope``, ``rope_theta``, ``rope_scale``); the inputs say which
sequences are packed (``cu_seqlens``, ``cu_seqlens_k``) or cross-attention. The
reference uses all of them (:mod:`ringmpi.mask`, :func:`ringmpi.rope.apply_rope`
at positions within each packed sequence), and the report names them. Under a
mask other than plain causal, the all-row value-range check uses the range of
the value rows of each query's packed sequence (a superset of its visible keys:
looser, never wrong), and every row's lse must be -inf exactly when the mask
leaves it no key.

This module splits the work over the ranks and judges it; the dense rows are
:mod:`ringmpi.job.verify_rows`, what is read :mod:`ringmpi.job.verify_read`, the
words :mod:`ringmpi.job.verify_report`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Optional, TextIO

import numpy as np

from .. import scoremods
from ..collective import run_everywhere
from ..mask import make_mask
from ..testing import EPS
from .progress import LOG_EVERY, duration
from .schema import InputError, make_plan
from .verify_read import output_meta, read_head
from .verify_report import describe_mask, format_verify
from .verify_rows import (
    RANGE_SLACK,
    SAMPLE_ROWS,
    default_sample_rows,
    dense_head,
    range_bad,
    rows_attention,
    sample_rows_of,
)

__all__ = [
    "dense_head",
    "rows_attention",
    "sample_rows_of",
    "default_sample_rows",
    "verify",
    "format_verify",
    "MAX_TOKENS",
    "SAMPLE_ROWS",
]

MAX_TOKENS = 4096  # longest sequence checked in full by default (longer: sampled rows)


class _Reporter:
    """Verify progress on rank 0: a line every LOG_EVERY seconds (cost: rows x S per task)."""

    def __init__(self, costs: list, enabled: bool, stream: Optional[TextIO] = None):
        self.total = float(sum(costs)) or 1.0
        self.done = 0.0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.t0 = self.last = time.perf_counter()

    def advance(self, cost: float, what: str) -> None:
        self.done += cost
        now = time.perf_counter()
        if not self.enabled or now - self.last < LOG_EVERY or self.done >= self.total:
            return
        self.last = now
        f = self.done / self.total
        eta = (now - self.t0) * (1 - f) / f
        self.stream.write(f"ringmpi verify: {100 * f:.0f}% ({what}), ETA {duration(eta)}\n")
        self.stream.flush()


def verify(
    output: str,
    inputs: Sequence[str],
    weights: Optional[str] = None,
    comm=None,
    max_tokens: int = MAX_TOKENS,
    sample_rows: Optional[int] = None,
    seed: int = 0,
    quiet: bool = False,
    full: bool = False,
) -> dict:
    """Check ``output`` against dense attention of ``inputs`` (collective over ``comm``).

    Parameters
    ----------
    max_tokens : int
        Sequences up to this length are checked in full.
    sample_rows : int, optional
        Query rows per head checked in a longer sequence (0: skip those). The
        default, :func:`default_sample_rows`, is S / 128 within [256, 2048]: the
        check then costs a fixed share of the run's work (~2 x rows / S of its
        flops, in numpy; measured at S = 65,536, H = 12, P = 2: see docs/batch-job.md).
    seed : int
        Seed of the row sample.
    quiet : bool
        No progress lines on rank 0.
    full : bool
        Check every sequence in full, whatever its length (``max_tokens`` ignored).

    Returns
    -------
    dict
        ``ok`` (something checked, nothing failed), ``status`` ("passed",
        "failed" or "nothing checked"), ``sequences`` (one dict per checked
        sequence: mode, rows checked/total/failed, errors and tolerances),
        ``skipped`` (names), counts ``full``, ``sampled``, ``failed``, and
        ``ranks_checking`` (ranks that had rows to check: the (sequence, head)
        pairs go round-robin over the ranks, and when there are fewer pairs than
        ranks each pair's rows are split over several).
    """
    from .threads import limit_blas

    blas = limit_blas(comm)  # numpy float64 matmuls: no more BLAS threads than cores per rank
    try:
        return _verify(output, inputs, weights, comm, max_tokens, sample_rows, seed, quiet, full)
    finally:
        blas.restore()


def _at(per_head, h: int):
    """Head ``h``'s value of a per-head spec field, or None."""
    return None if per_head is None else per_head[h]


def _reduced(comm, a: np.ndarray, op: str) -> np.ndarray:
    """``a`` reduced elementwise over ``comm`` (``op`` "max" or "sum"); ``a`` itself without one."""
    if comm is None:
        return a
    from mpi4py import MPI

    out = np.empty_like(a)
    comm.Allreduce(a, out, op=MPI.MAX if op == "max" else MPI.SUM)
    return out


def _verify(output, inputs, weights, comm, max_tokens, sample_rows, seed, quiet, full) -> dict:
    """The body of :func:`verify` (collective over ``comm``)."""
    import h5py

    t_start = time.perf_counter()
    rank = 0 if comm is None else comm.Get_rank()
    size = 1 if comm is None else comm.Get_size()
    plan = make_plan(comm, inputs, weights, 1)
    if full:
        max_tokens = max([s.length for s in plan.sequences] + [int(max_tokens)])

    meta = run_everywhere(comm, output_meta, output)
    spec = meta["spec"]  # outputs before windows have none: window None
    window = spec.window
    rope = (meta["rope_theta"], meta["rope_scale"]) if meta["rope"] else None
    if rope is not None and plan.mode != "features":
        raise InputError(f"{output}: made with --rope, but the inputs hold q, k, v (not features)")
    causal = spec.causal
    scale = float(meta["scale"]) if meta["scale"] is not None else plan.head_dim**-0.5
    dt = np.dtype(plan.dtype)
    low = np.dtype(np.float64 if dt == np.float64 else np.float32)
    group = plan.heads // plan.kv_heads
    nseq = len(plan.sequences)
    mode = []
    for s in plan.sequences:
        if s.length <= max_tokens:
            mode.append("full")
        elif sample_rows is None or sample_rows > 0:
            mode.append("sampled")
        else:
            mode.append("skipped")
    checked = [i for i in range(nseq) if mode[i] != "skipped"]
    base = [(i, h) for i in checked for h in range(plan.heads)]
    # fewer (sequence, head) pairs than ranks: split each pair's rows over several ranks
    nparts = -(-size // len(base)) if base else 1
    tasks = [(i, h, p) for i, h in base for p in range(nparts)]
    mine = tasks[rank::size]

    def rows_of(i):
        n = plan.sequences[i].length
        return default_sample_rows(n) if sample_rows is None else int(sample_rows)

    def nrows(i):
        n = plan.sequences[i].length
        return n if mode[i] == "full" else min(n, rows_of(i))

    report = _Reporter(
        [nrows(i) * plan.sequences[i].length_k / nparts for i, _, _ in mine],
        rank == 0 and not quiet,
    )
    # per sequence: max ring err out, max dense err out, ring err lse, dense err lse
    errs = np.zeros((nseq, 4), dtype=np.float64)
    # per sequence: rows checked, -inf/non-finite mismatches, rows out of range
    cnt = np.zeros((nseq, 3), dtype=np.float64)
    row_errs = []  # (i, err_out per row, err_lse per row) of this rank's tasks

    masks = [
        make_mask(s.length, s.length_k, causal, window, s.cu_seqlens, s.cu_seqlens_k)
        for s in plan.sequences
    ]

    def work():
        with h5py.File(output, "r") as f:
            for i, h, part in mine:
                seq = plan.sequences[i]
                mask = masks[i]
                what = f"sequence {seq.name}, head {h}, {mode[i]}"
                (q,) = read_head(plan, seq, h, kv=False, rope=rope)
                k, v = read_head(plan, seq, h // group, kv=True, rope=rope)
                node = f[seq.group] if seq.group else f
                b = (seq.batch,) if seq.batch is not None else ()
                ring_o = np.asarray(node["out"][b + (slice(None), h)], np.float64)
                ring_l = np.asarray(node["lse"][b + (h,)], np.float64)
                rows = (
                    np.arange(seq.length, dtype=np.int64)
                    if mode[i] == "full"
                    else sample_rows_of(seq.length, rows_of(i), seed, i, h)
                )
                rows = rows[rows % nparts == part]  # this part's rows (all rows: nparts == 1)
                own = np.arange(seq.length) % nparts == part

                def tick(done_rows, what=what, nk=seq.length_k):
                    report.advance(done_rows * nk / 2, what)  # two precisions per row block

                mods = dict(mods=scoremods.of_spec(spec, plan.heads, slice(h, h + 1)),
                            sink=_at(spec.sinks, h))  # fmt: skip
                ref_o, ref_l = rows_attention(q, k, v, rows, causal, scale, np.float64, mask, tick,
                                              **mods)  # fmt: skip
                lo_o, lo_l = rows_attention(q, k, v, rows, causal, scale, low, mask, tick, **mods)
                lo_o = lo_o.astype(dt).astype(np.float64)
                ro, rl = ring_o[rows], ring_l[rows]
                fin = np.isfinite(ref_l)
                with np.errstate(invalid="ignore"):
                    eo = np.abs(ro - ref_o).max(axis=1, initial=0.0)
                    el = np.where(fin, np.abs(rl - ref_l), 0.0)
                eo = np.where(np.isnan(eo), np.inf, eo)
                el = np.where(np.isnan(el), np.inf, el)
                e = errs[i]
                e[0] = max(e[0], eo.max(initial=0.0))
                e[1] = max(e[1], np.abs(lo_o - ref_o).max(initial=0.0))
                e[2] = max(e[2], el.max(initial=0.0))
                e[3] = max(e[3], np.abs(lo_l[fin] - ref_l[fin]).max(initial=0.0))
                # every row, sampled or not: finite where it must be, within the value range
                whole_fin = np.isfinite(ring_o).all(axis=1) & ~np.isnan(ring_l)
                whole_fin &= ~np.isposinf(ring_l)
                mism = np.zeros(seq.length, bool)
                mism[rows] = np.isfinite(rl) != fin
                slack = RANGE_SLACK[plan.dtype] * float(np.abs(v).max(initial=0.0)) + 1e-30
                if not mask.plain:  # every row: lse = -inf exactly where the mask hides all keys
                    blo, bhi = mask.bounds(np.arange(seq.length, dtype=np.int64))
                    # (with sinks no row is -inf: a row without keys has lse = its sink)
                    mism |= np.isneginf(ring_l) != ((blo > bhi) & (spec.sinks is None))
                sink = spec.sinks is not None
                out_range = range_bad(v, ring_o, ring_l, causal, slack, mask, sink) & whole_fin
                mism &= own  # each row's whole-row checks are counted by one part only
                out_range &= own
                cnt[i, 0] += len(rows)
                cnt[i, 1] += np.count_nonzero(own & (mism | ~whole_fin))
                cnt[i, 2] += np.count_nonzero(out_range)
                row_errs.append((i, rows, eo, el, own & (mism | ~whole_fin | out_range)))

    run_everywhere(comm, work)
    errs = _reduced(comm, errs, "max")
    eps = EPS[plan.dtype]
    tol = np.stack([2 * errs[:, 1] + eps, 2 * errs[:, 3] + eps], axis=1)
    # rows failing the comparison (counted once per row, also when several checks fail)
    failed = np.zeros(nseq, dtype=np.float64)
    for i, rows, eo, el, flagged in row_errs:
        bad_rows = flagged.copy()
        bad_rows[rows] |= (eo > tol[i, 0]) | (el > tol[i, 1])
        failed[i] += np.count_nonzero(bad_rows)
    cnt, failed = _reduced(comm, cnt, "sum"), _reduced(comm, failed, "sum")
    rows_out = []
    for i in checked:
        s = plan.sequences[i]
        good = bool(failed[i] == 0)
        rows_out.append(
            {
                "sequence": s.name,
                "tokens": s.length,
                "mode": mode[i],
                "rows_checked": int(cnt[i, 0]),
                "rows_total": int(s.length * plan.heads),
                "rows_failed": int(failed[i]),
                "rows_not_finite": int(cnt[i, 1]),
                "rows_out_of_range": int(cnt[i, 2]),
                "err_out": float(errs[i, 0]),
                "tol_out": float(tol[i, 0]),
                "err_lse": float(errs[i, 2]),
                "tol_lse": float(tol[i, 1]),
                "ok": good,
            }
        )
    busy = 1 if comm is None else comm.allreduce(int(bool(mine)))
    nfail = sum(not r["ok"] for r in rows_out)
    status = "nothing checked" if not rows_out else ("failed" if nfail else "passed")
    return {
        "ok": status == "passed",
        "status": status,
        "sequences": rows_out,
        "skipped": [plan.sequences[i].name for i in range(nseq) if mode[i] == "skipped"],
        "full": mode.count("full"),
        "sampled": mode.count("sampled"),
        "failed": nfail,
        "max_tokens": int(max_tokens),
        "sample_rows": -1 if sample_rows is None else int(sample_rows),  # -1: S / 128 rule
        "mask": describe_mask(plan, causal, window, rope),
        "ranks_checking": int(busy),
        "seconds": time.perf_counter() - t_start,
    }
