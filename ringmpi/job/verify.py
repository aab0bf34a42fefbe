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
sequences are packed (``cu_seqlens``, ``cu_seqlens_k``), carry a mask of slices
(``slices``: the reference then applies the explicit mask, each row's visible keys
being the union of its slices' ranges) or are cross-attention. The
reference uses all of them (:mod:`ringmpi.mask`, :func:`ringmpi.rope.apply_rope`
at positions within each packed sequence), and the report names them. Under a
mask other than plain causal, the all-row value-range check uses the range of
the value rows of each query's packed sequence (a superset of its visible keys:
looser, never wrong), and every row's lse must be -inf exactly when the mask
leaves it no key.

``compare(output, other)`` (``ringmpi verify OUTPUT --against OTHER``) needs no
inputs: it compares two outputs bit for bit (every ``out`` and ``lse``) and says
where they first differ, e.g. runs of the same inputs at different P in
reproducible mode.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Optional, TextIO

import numpy as np

from .. import reference, scoremods
from ..collective import run_everywhere
from ..mask import make_mask, mask_of
from ..rope import apply_rope, positions_in_sequence
from ..runtime import interrupt
from ..spec import AttentionSpec
from ..testing import EPS
from .input.scan import make_plan
from .plan import InputError, Plan, sliced, value_width
from .report import LOG_EVERY, duration

__all__ = [
    "compare",
    "format_compare",
    "dense_head",
    "rows_attention",
    "sample_rows_of",
    "default_sample_rows",
    "verify",
    "format_verify",
    "MAX_TOKENS",
    "SAMPLE_ROWS",
    "read_head",
    "output_attr",
    "output_meta",
    "describe_mask",
    "range_bad",
    "ROWS",
    "MIN_SAMPLE_ROWS",
    "SCORES",
    "BLOCK_ROWS",
    "RANGE_SLACK",
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
        flops, in numpy; measured at S = 65,536, H = 12, P = 2: see docs/performance.md).
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
    from .resources import limit_blas

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
        mask_of(AttentionSpec(slices=sliced(s)), s.length, s.length_k)
        if sliced(s) is not None
        else make_mask(s.length, s.length_k, causal, window, s.cu_seqlens, s.cu_seqlens_k)
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

                mods = dict(
                    mods=scoremods.of_spec(spec, plan.heads, slice(h, h + 1)),
                    sink=_at(spec.sinks, h),
                )
                ref_o, ref_l = rows_attention(
                    q, k, v, rows, causal, scale, np.float64, mask, tick, **mods
                )
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
                    blind = ~sees_a_key(mask, np.arange(seq.length, dtype=np.int64))
                    # (with sinks no row is -inf: a row without keys has lse = its sink)
                    mism |= np.isneginf(ring_l) != (blind & (spec.sinks is None))
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


# ----------------------------------------------------------------------
# What ``ringmpi verify`` reads: one head's whole-sequence inputs, the output's recorded options.
#
# :mod:`ringmpi.job.verify` compares the output with dense attention of these inputs;
# the attributes say which mask, scale and positions the run used.


def read_head(plan: Plan, seq, head: int, kv: bool, rope=None) -> tuple:
    """Whole-sequence inputs of one head: q (S, D) for query head ``head`` or k, v (S_k, D).

    Features inputs are projected in float64, x @ w + b (biases when the weights
    file has them; keys and values from ``x_kv`` when the sequence has it), rotated
    by ``rope`` = (theta, scale) at the positions within each packed sequence (q
    and k only), then rounded to the input dtype.

    Parameters
    ----------
    plan : Plan
        The job's input plan (files, weights, dtype, head size).
    seq : SeqInfo
        The sequence of ``plan`` to read.
    head : int
        Query head (``kv`` False) or key/value head (``kv`` True).
    kv : bool
        Read k and v instead of q.
    rope : tuple of (float, float), optional
        RoPE (theta, scale) of the run; None: no rotation.
    """
    import h5py

    dt = np.dtype(plan.dtype)
    names = ("k", "v") if kv else ("q",)
    parts: dict = {n: [] for n in names}
    w = None
    if plan.mode == "features":
        with h5py.File(plan.weights, "r", locking=False) as f:
            # the columns of this head: v's are Dv wide (which may differ from D)
            cut = {
                n: slice(head * wd, (head + 1) * wd)
                for n in names
                for wd in [value_width(plan) if n == "v" else plan.head_dim]
            }
            w = {n: np.asarray(f["w" + n][:, cut[n]], np.float64) for n in names}
            bias = {n: np.asarray(f["b" + n][cut[n]], np.float64) for n in names if "b" + n in f}
    src = "x_kv" if (kv and seq.x_kv) else "x"
    for path in plan.files:
        with h5py.File(path, "r", locking=False) as f:
            node = f[seq.group] if seq.group else f
            b = (seq.batch,) if seq.batch is not None else ()
            for n in names:
                if w is None:
                    parts[n].append(node[n][b + (slice(None), head)])
                else:
                    y = np.asarray(node[src][b], np.float64) @ w[n]
                    parts[n].append(y + bias[n] if n in bias else y)
    full = {n: np.concatenate(parts[n]) for n in names}
    if rope is not None and w is not None:
        cu = (
            (seq.cu_seqlens if seq.cu_seqlens_k is None else seq.cu_seqlens_k)
            if kv
            else (seq.cu_seqlens)
        )
        n = "k" if kv else "q"
        pos = positions_in_sequence(np.arange(len(full[n])), cu)
        full[n] = apply_rope(full[n][:, None, :], pos, *rope)[:, 0]
    return tuple(full[n].astype(dt) for n in names)


def output_attr(f, key: str):
    """A root attribute of open output file ``f``: typed (format 2) or a JSON string (format 1)."""
    val = f.attrs[key]
    if isinstance(val, bytes):
        val = val.decode()
    if isinstance(val, str) and int(f.attrs.get("format", 1)) < 2:
        return json.loads(val)
    return val.item() if isinstance(val, np.generic) else val


def output_meta(output: str) -> dict:
    """The options ``output`` records: causal, scale, layout, rope (theta, scale) and the spec.

    Raises :class:`~ringmpi.job.input.scan.InputError` when ``output`` is not a ringmpi
    output file.
    """
    import h5py

    try:
        with h5py.File(output, "r") as f:
            got = {k: output_attr(f, k) for k in ("causal", "scale", "layout")}
            # positions (outputs before them have none: no rope)
            got["rope"] = bool(f.attrs.get("rope", False))
            got["rope_theta"] = float(f.attrs.get("rope_theta", 10000.0))
            got["rope_scale"] = float(f.attrs.get("rope_scale", 1.0))
            # the whole spec the run recorded (any later field by its own name)
            got["spec"] = AttentionSpec.from_attrs(f.attrs)
            return got
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise InputError(f"{output}: not a ringmpi output file ({e})") from e


# ----------------------------------------------------------------------
# The words of ``ringmpi verify``: the mask the reference used, a line per sequence, the verdict.
#
# :func:`ringmpi.job.verify.verify` returns the result these format.


def describe_mask(plan: Plan, causal: bool, window, rope) -> str:
    """The mask and positions the reference used, in words.

    Parameters
    ----------
    plan : Plan
        The job's input plan (packed and cross-attention sequences are named).
    causal : bool
    window : tuple of (int, int) or None
    rope : tuple of (float, float) or None
        RoPE (theta, scale), or None without RoPE.
    """
    parts = ["causal" if causal else "bidirectional"]
    if window is not None:
        parts.append(f"window {tuple(window)}")
    masked = [s for s in plan.sequences if sliced(s) is not None]
    if masked:
        if len(masked) == len(plan.sequences):  # each one's slices are its whole mask
            parts = []
        parts.append(f"a mask of slices in {len(masked)} sequence(s)")
    packed = [s for s in plan.sequences if s.packed]
    if packed:
        n = sum(len(s.cu_seqlens) - 1 for s in packed)
        parts.append(f"{n} packed sequence(s) in {len(packed)} input sequence(s)")
    cross = [s for s in plan.sequences if s.cross or s.x_kv]
    if cross:
        parts.append(f"cross-attention in {len(cross)} sequence(s)")
    if rope is not None:
        parts.append(f"RoPE (theta {rope[0]:g}, scale {rope[1]:g})")
    return ", ".join(parts)


def format_verify(res: dict) -> str:
    """One line per sequence plus a verdict that says what was and was not checked."""
    lines = []
    for r in res["sequences"]:
        per_head = r["rows_checked"] // max(1, r["rows_total"] // max(1, r["tokens"]))
        if r["mode"] == "full":
            how = f"full ({r['rows_checked']:,} rows)"
        else:
            how = (
                f"sampled ({per_head:,} of {r['tokens']:,} rows per head; all rows: finite, "
                "in range)"
            )
        bad = ""
        if r["rows_failed"]:
            bad = f", {r['rows_failed']:,} row(s) FAILED"
            if r["rows_not_finite"]:
                bad += f" ({r['rows_not_finite']:,} not finite / -inf mismatch)"
            if r["rows_out_of_range"]:
                bad += f" ({r['rows_out_of_range']:,} outside the value range)"
        op_o = "<=" if r["err_out"] <= r["tol_out"] else ">"
        op_l = "<=" if r["err_lse"] <= r["tol_lse"] else ">"
        lines.append(
            f"  verify {r['sequence']}: {how}: max|out-ref| {r['err_out']:.2e} {op_o} "
            f"{r['tol_out']:.2e}, max|lse-ref| {r['err_lse']:.2e} {op_l} {r['tol_lse']:.2e}{bad}"
            f": {'OK' if r['ok'] else 'FAIL'}"
        )
    for name in res["skipped"]:
        lines.append(
            f"  verify {name}: skipped (longer than --max-tokens {res['max_tokens']:,}, "
            "and --sample-rows 0)"
        )
    n_checked = len(res["sequences"])
    what = f"{res['full']} full, {res['sampled']} sampled, {len(res['skipped'])} skipped"
    if res.get("mask"):
        what += f"; reference: {res['mask']}"
    if res["status"] == "nothing checked":
        lines.append(
            f"ringmpi verify: NOTHING CHECKED ({what}): not a pass; raise --max-tokens or "
            "use --sample-rows > 0"
        )
    elif res["status"] == "failed":
        lines.append(f"ringmpi verify: FAILED ({res['failed']} of {n_checked} checked; {what})")
    else:
        lines.append(f"ringmpi verify: PASSED ({what})")
    if "seconds" in res:
        lines[-1] += f" in {duration(res['seconds'])}"
    return "\n".join(lines)


# ----------------------------------------------------------------------
# The dense rows of ``ringmpi verify``: reference attention of chosen query rows, the row sample,
# and the value-range check of every row (:mod:`ringmpi.job.verify` runs them).

ROWS = 512  # query rows per block of the dense computation (full check of short sequences)
SAMPLE_ROWS = 2048  # most query rows per head checked in a longer sequence by default
MIN_SAMPLE_ROWS = 256  # fewest (the default is S / 128 between the two: a share of the run)
SCORES = 1 << 24  # score elements per block of rows (128 MiB in float64)
BLOCK_ROWS = 64  # query rows per block (measured: 64 rows x 65,536 keys as fast as 256)
# slack of the range check, relative to max|v|: rounding of the accumulation and output
RANGE_SLACK = {"float16": 4e-3, "float32": 1e-4, "float64": 1e-10}


def dense_head(q, k, v, causal: bool, scale: float, dtype) -> tuple:
    """Dense attention of one head, q, k, v (S, D), in ``dtype`` and blocks of query rows.

    Returns out (S, D) and lse (S,); a row with no visible key gives 0, -inf.
    """
    out, lse = reference.attention(
        q[:, None], k[:, None], v[:, None], causal, scale, dtype=dtype, block=ROWS
    )
    return out[:, 0], lse[0]


def rows_attention(
    q,
    k,
    v,
    rows: np.ndarray,
    causal: bool,
    scale: float,
    dtype,
    mask=None,
    on_block=None,
    mods=None,
    sink=None,
) -> tuple:
    """Dense attention of the query rows ``rows`` of one head against all S keys, in ``dtype``.

    Parameters
    ----------
    q : array (S, D)
    k, v : arrays (S_k, D)
    rows : int array (R,)
        Query rows (token positions) to compute.
    causal : bool
        Row i sees keys j <= i (ignored when ``mask`` is given).
    scale : float
    dtype : numpy dtype
        Arithmetic precision.
    mask : ringmpi.mask.Mask, optional
        Row i sees keys lo[i] <= j <= hi[i] of ``mask.bounds`` (window, packed, cross).
    on_block : callable(int), optional
        Called with the number of rows after each block of rows (progress).
    mods : ringmpi.scoremods.TileMods, optional
        This head's score modifiers (params (1, NMODS), :func:`ringmpi.scoremods.of_spec`),
        applied by :func:`ringmpi.scoremods.apply` (position modifiers use
        ``mask.alibi_positions``; ``mask`` is then needed).
    sink : float, optional
        This head's sink logit: the row's softmax denominator gains exp(sink).

    Only the keys some row of a block can see are computed (under causal, a block
    of rows up to r needs keys 0..r): a masked key adds exactly 0 to the sums.

    Returns
    -------
    out : (R, D) and lse : (R,) in ``dtype``; a row with no visible key gives 0, -inf.
    """
    dt = np.dtype(dtype)
    kd, vd = np.asarray(k, dt), np.asarray(v, dt)
    n = kd.shape[0]
    # at most BLOCK_ROWS rows per block: under causal, sorted rows then need few keys each
    block = max(1, min(BLOCK_ROWS, SCORES // max(1, n)))
    outs, lses = [], []
    for a in range(0, len(rows), block):
        interrupt.check()
        r = rows[a : a + block]
        j0, j1 = 0, n  # the keys any row of the block can see: [j0, j1)
        if mask is not None and mask.slices is not None:  # the explicit mask of these rows
            lo, hi = _layers(mask, r)
            shown = lo <= hi
            j0 = max(0, int(lo[shown].min())) if shown.any() else 0
            j1 = max(j0, min(n, int(hi[shown].max()) + 1)) if shown.any() else 0
        elif mask is not None and not mask.plain:
            lo, hi = mask.bounds(r)
            j0, j1 = max(0, int(lo.min())), min(n, int(hi.max()) + 1)
            j1 = max(j0, j1)
        elif causal:
            j1 = min(n, int(r.max()) + 1)
        s = np.asarray(q[r], dt) @ kd[j0:j1].T
        s *= dt.type(scale)
        if mods is not None:
            qa = mask.alibi_positions(r) if mask is not None else r
            scoremods.apply(s, mods, qa, np.arange(j0, j1), ())
        # in place (measured 2.6x faster than np.where copies at 2048 rows x 65536 keys)
        if mask is not None and mask.slices is not None:  # visible: in any of the row's ranges
            j = np.arange(j0, j1)[None, :]
            seen = np.zeros(s.shape, bool)
            for a, b in zip(lo, hi):
                seen |= (j >= a[:, None]) & (j <= b[:, None])
            np.putmask(s, ~seen, -np.inf)
        elif mask is not None and not mask.plain:
            j = np.arange(j0, j1)[None, :]
            np.putmask(s, (j < lo[:, None]) | (j > hi[:, None]), -np.inf)
        elif causal:  # keys up to min(r) are visible to every row of the block
            c = max(j0, int(r.min()) + 1)
            if c < j1:
                np.putmask(s[:, c - j0 :], np.arange(c, j1)[None, :] > r[:, None], -np.inf)
        m = s.max(axis=-1, keepdims=True) if j1 > j0 else np.zeros((len(r), 1), dt)
        if sink is not None:  # one more logit per row, of value 0
            m = np.maximum(m, dt.type(sink))
        m = np.where(np.isfinite(m), m, 0).astype(dt)
        s -= m
        e = np.exp(s, out=s)
        z = e.sum(axis=-1)
        if sink is not None:
            z += np.exp(dt.type(sink) - m[:, 0])
        with np.errstate(divide="ignore", invalid="ignore"):
            o = np.where(z[:, None] > 0, (e @ vd[j0:j1]) / z[:, None], 0)
            lse = np.where(z > 0, m[:, 0] + np.log(z), -np.inf)
        outs.append(o.astype(dt))
        lses.append(lse.astype(dt))
        if on_block is not None:
            on_block(len(r))
    if not outs:
        return np.zeros((0, q.shape[1]), dt), np.zeros(0, dt)
    return np.concatenate(outs), np.concatenate(lses)


def default_sample_rows(length: int) -> int:
    """Rows per head the sampled check uses by default for a sequence of ``length`` tokens."""
    return int(min(SAMPLE_ROWS, max(MIN_SAMPLE_ROWS, length // 128)))


def sample_rows_of(length: int, count: int, seed: int, seq_index: int, head: int) -> np.ndarray:
    """The sorted query rows the sampled check uses for one (sequence, head): all if count >= S."""
    if count >= length:
        return np.arange(length, dtype=np.int64)
    rng = np.random.default_rng([seed, seq_index, head])
    return np.sort(rng.choice(length, size=count, replace=False)).astype(np.int64)


def _layers(mask, rows: np.ndarray) -> tuple:
    """(lo, hi): int64 (L, R) arrays, the key ranges of ``rows`` under ``mask`` (L >= 1)."""
    got = mask.layers(rows)
    if not got:  # no row sees a key: one empty range each
        return np.zeros((1, len(rows)), np.int64), np.full((1, len(rows)), -1, np.int64)
    return np.stack([a for a, _ in got]), np.stack([b for _, b in got])


def sees_a_key(mask, rows: np.ndarray) -> np.ndarray:
    """bool (R,): whether each query of ``rows`` sees at least one key under ``mask``."""
    lo, hi = _layers(mask, rows)
    return (lo <= hi).any(axis=0)


def range_bad(
    v: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    causal: bool,
    slack: float,
    mask=None,
    sink: bool = False,
):
    """Rows whose output leaves the range of the visible value rows (or is not 0 when none is).

    Under a mask other than plain causal the range is that of the value rows of
    the query's packed sequence (the keys it may see lie there). With ``sink``
    (attention sinks: a virtual key of value 0) the range includes 0.
    """
    # min and max are exact in any dtype: no float64 copy (float16 in float32, for the slack)
    v64 = np.asarray(v, np.float32 if np.asarray(v).dtype == np.float16 else None)
    if mask is not None and not mask.plain:
        cu_k = mask.cu_k if mask.cu_k is not None else np.array([0, mask.nk], np.int64)
        cu_q = mask.cu_q if mask.cu_q is not None else np.array([0, mask.nq], np.int64)
        nseg = len(cu_k) - 1
        seg_lo = np.full((nseg, v64.shape[1]), np.inf)
        seg_hi = np.full((nseg, v64.shape[1]), -np.inf)
        full = np.flatnonzero(np.diff(cu_k) > 0)
        if len(full):
            seg_lo[full] = np.minimum.reduceat(v64, cu_k[full], axis=0)
            seg_hi[full] = np.maximum.reduceat(v64, cu_k[full], axis=0)
            # reduceat runs to the next index: an empty segment between two full ones is
            # skipped, so each full segment ends at its own end (the next full start)
        seg = np.searchsorted(cu_q, np.arange(mask.nq), side="right") - 1
        lo, hi = seg_lo[seg], seg_hi[seg]
    elif causal:
        lo = np.minimum.accumulate(v64, axis=0)
        hi = np.maximum.accumulate(v64, axis=0)
    else:
        lo = np.broadcast_to(v64.min(axis=0, initial=np.inf), v64.shape)
        hi = np.broadcast_to(v64.max(axis=0, initial=-np.inf), v64.shape)
    if sink:  # a convex combination of the visible values and the sink's 0
        lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)
    with np.errstate(invalid="ignore"):
        bad = ((out < lo - slack) | (out > hi + slack)).any(axis=1)
    none = np.isneginf(lse)  # no visible key: out must be 0
    bad = np.where(none, (out != 0).any(axis=1), bad)
    return bad


# ----------------------------------------------------------------------
# ``ringmpi verify OUTPUT --against OTHER``: two outputs, bit for bit.

COMPARED = ("out", "lse")  # the datasets compared, in every sequence's group
SLAB_BYTES = 64 << 20  # read in slabs of rows of about this size (both files)


def _results(f) -> dict:
    """{path: dataset} of every ``out`` and ``lse`` in open output file ``f``."""
    import h5py

    found = {}

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset) and name.rsplit("/", 1)[-1] in COMPARED:
            found["/" + name] = obj

    f.visititems(visit)
    return found


def _check_sources(path: str, ds) -> None:
    """A virtual dataset whose part files are missing reads its fill value: refuse it."""
    import os

    if not ds.is_virtual:
        return
    base = os.path.dirname(os.path.abspath(path))
    for src in ds.virtual_sources():
        name = src.file_name
        full = name if os.path.isabs(name) else os.path.join(base, name)
        if name != "." and not os.path.isfile(full):
            raise InputError(f"{path}: {ds.name} reads part file {name}, which is missing")


def _first_difference(a: np.ndarray, b: np.ndarray):
    """(first differing index, count, max |a - b| over finite pairs) of two slabs, bitwise."""
    ua = a.view(f"u{a.dtype.itemsize}")
    ub = b.view(f"u{b.dtype.itemsize}")
    neq = ua != ub
    n = int(np.count_nonzero(neq))
    if not n:
        return None, 0, 0.0
    first = np.unravel_index(int(np.argmax(neq.reshape(-1))), a.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(a[neq].astype(np.float64) - b[neq].astype(np.float64))
    d = d[np.isfinite(d)]
    return tuple(int(i) for i in first), n, float(d.max(initial=0.0))


def _compare(output: str, other: str) -> dict:
    """The body of :func:`compare` (one process)."""
    import h5py

    output_meta(output)  # InputError unless both are ringmpi outputs
    output_meta(other)
    res = {"output": output, "other": other, "datasets": 0, "elements": 0, "differ": []}
    with h5py.File(output, "r") as fa, h5py.File(other, "r") as fb:
        da, db = _results(fa), _results(fb)
        res["only"] = {output: sorted(set(da) - set(db)), other: sorted(set(db) - set(da))}
        attrs = {}
        for key in sorted(set(fa.attrs) | set(fb.attrs)):
            va, vb = fa.attrs.get(key), fb.attrs.get(key)
            if not np.array_equal(np.asarray(va), np.asarray(vb)):
                attrs[key] = tuple(x.item() if isinstance(x, np.generic) else x for x in (va, vb))
        res["attrs"] = attrs
        for name in sorted(set(da) & set(db)):
            a, b = da[name], db[name]
            _check_sources(output, a)
            _check_sources(other, b)
            res["datasets"] += 1
            if a.shape != b.shape or a.dtype != b.dtype:
                why = f"shape/dtype {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
                res["differ"].append({"name": name, "why": why})
                continue
            res["elements"] += int(a.size)
            if a.size == 0:
                continue
            row_bytes = max(1, a.size // max(1, a.shape[0]) * a.dtype.itemsize)
            step = max(1, SLAB_BYTES // row_bytes)
            first, count, worst = None, 0, 0.0
            for r0 in range(0, a.shape[0], step):
                interrupt.check()
                sa, sb = a[r0 : r0 + step], b[r0 : r0 + step]
                at, n, w = _first_difference(sa, sb)
                if n and first is None:
                    first = (at[0] + r0,) + at[1:]
                    values = (sa[at].item(), sb[at].item())
                count += n
                worst = max(worst, w)
            if count:
                res["differ"].append(
                    {"name": name, "first": first, "values": values, "count": count, "max": worst}
                )
    res["identical"] = not res["differ"] and not any(res["only"].values()) and res["datasets"] > 0
    return res


def compare(output: str, other: str, comm=None) -> dict:
    """Compare two ``ringmpi run`` outputs bit for bit (collective over ``comm``).

    Every ``out`` and ``lse`` dataset of ``output`` is compared with the one at the
    same path in ``other``, element by element as bit patterns (so -0.0 differs
    from 0.0, and NaN payloads count), in slabs of rows (memory: two slabs of
    about 64 MiB). Rank 0 reads; every rank gets the result or the same error.

    Returns
    -------
    dict
        ``identical`` (every dataset present in both and equal, at least one
        compared), ``datasets`` and ``elements`` compared, ``differ`` (per
        differing dataset: ``name``, the ``first`` differing index, both
        ``values`` there, the ``count`` of differing elements and the ``max``
        absolute difference over finite pairs; or ``why`` for another shape or
        dtype), ``only`` (datasets present in one file only) and ``attrs``
        (recorded attributes that differ: information, not a failure).
    """
    from ..collective import run_on_root

    return run_on_root(comm, _compare, output, other)


def format_compare(res: dict) -> str:
    """The report of :func:`compare`: the verdict and, where they differ, the first place."""
    lines = []
    for key, (va, vb) in res["attrs"].items():
        lines.append(f"  attribute {key}: {va!r} vs {vb!r}")
    for path, names in res["only"].items():
        for name in names:
            lines.append(f"  only in {path}: {name}")
    for d in res["differ"]:
        if "why" in d:
            lines.append(f"  {d['name']}: {d['why']}")
            continue
        idx = ", ".join(map(str, d["first"]))
        va, vb = d["values"]
        lines.append(
            f"  {d['name']}: {d['count']} elements differ, first at [{idx}] "
            f"({va!r} vs {vb!r}), max |difference| {d['max']:.3g}"
        )
    n, e = res["datasets"], res["elements"]
    if res["identical"]:
        head = f"IDENTICAL: {n} datasets, {e} elements, every bit equal"
    elif n == 0:
        head = "NOTHING COMPARED: no out/lse datasets in common"
    else:
        k = len(res["differ"]) + sum(len(v) for v in res["only"].values())
        head = f"DIFFERENT: {k} of the datasets differ or are missing ({n} compared, {e} elements)"
    return "\n".join([f"compare {res['output']} with {res['other']}", *lines, head])
