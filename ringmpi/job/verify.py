"""``ringmpi verify``: compare an output file with dense attention computed from the inputs.

For each sequence and query head the dense float64 reference is computed over
the whole sequence, and so is a dense computation in the low precision the ring
used (float32 for float16/float32 inputs). The ring passes when

    max |ring - ref64| <= 2 * max |dense_lowp - ref64| + eps

for ``out`` and for the finite entries of ``lse`` (eps: 1e-4 float16, 1e-6
float32, 1e-12 float64), and rows with lse = -inf agree exactly. The (sequence,
head) pairs are shared round-robin over the ranks; each pair is computed in
blocks of query rows, so memory is O(S * D + rows * S), never S x S.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Optional

import numpy as np

from .. import reference
from ..collective import run_everywhere
from ..testing import EPS
from .schema import InputError, Plan, make_plan

__all__ = ["dense_head", "verify", "format_verify"]

ROWS = 512  # query rows per block of the dense computation


def dense_head(q, k, v, causal: bool, scale: float, dtype) -> tuple:
    """Dense attention of one head, q, k, v (S, D), in ``dtype`` and blocks of query rows.

    Returns out (S, D) and lse (S,); a row with no visible key gives 0, -inf.
    """
    out, lse = reference.attention(
        q[:, None], k[:, None], v[:, None], causal, scale, dtype=dtype, block=ROWS
    )
    return out[:, 0], lse[0]


def _read_head(plan: Plan, seq, head: int, kv: bool) -> tuple:
    """Whole-sequence inputs of one head: q (S, D) for query head ``head`` or k, v for kv head."""
    import h5py

    dt = np.dtype(plan.dtype)
    names = ("k", "v") if kv else ("q",)
    parts: dict = {n: [] for n in names}
    w = None
    if plan.mode == "features":
        with h5py.File(plan.weights, "r", locking=False) as f:
            d = plan.head_dim
            w = {n: np.asarray(f["w" + n][:, head * d : (head + 1) * d], np.float64) for n in names}
    for path in plan.files:
        with h5py.File(path, "r", locking=False) as f:
            node = f[seq.group] if seq.group else f
            b = (seq.batch,) if seq.batch is not None else ()
            for n in names:
                if w is None:
                    parts[n].append(node[n][b + (slice(None), head)])
                else:
                    x = np.asarray(node["x"][b], np.float64)
                    parts[n].append((x @ w[n]).astype(dt))
    return tuple(np.concatenate(parts[n]).astype(dt) for n in names)


def verify(
    output: str, inputs: Sequence[str], weights: Optional[str] = None, comm=None, max_tokens=65536
) -> dict:
    """Check ``output`` against dense attention of ``inputs`` (collective over ``comm``).

    Returns {"ok": bool, "sequences": [per-sequence dict], "skipped": [...]}.
    """
    import h5py

    rank = 0 if comm is None else comm.Get_rank()
    size = 1 if comm is None else comm.Get_size()
    plan = make_plan(comm, inputs, weights, 1)

    def attrs():
        try:
            with h5py.File(output, "r") as f:
                return {k: json.loads(f.attrs[k]) for k in ("causal", "scale", "layout")}
        except (OSError, KeyError, ValueError) as e:
            raise InputError(f"{output}: not a ringmpi output file ({e})") from e

    meta = run_everywhere(comm, attrs)
    causal = bool(meta["causal"])
    scale = meta["scale"] if meta["scale"] is not None else 1.0 / np.sqrt(plan.head_dim)
    dt = np.dtype(plan.dtype)
    low = np.dtype(np.float64 if dt == np.float64 else np.float32)
    group = plan.heads // plan.kv_heads
    seqs = [i for i, s in enumerate(plan.sequences) if s.length <= max_tokens]
    skipped = [s.name for s in plan.sequences if s.length > max_tokens]
    tasks = [(i, h) for i in seqs for h in range(plan.heads)]
    # per sequence: ring err out, dense err out, ring err lse, dense err lse, -inf mismatches
    errs = np.zeros((len(plan.sequences), 5), dtype=np.float64)

    def work():
        with h5py.File(output, "r") as f:
            for i, h in tasks[rank::size]:
                seq = plan.sequences[i]
                (q,) = _read_head(plan, seq, h, kv=False)
                k, v = _read_head(plan, seq, h // group, kv=True)
                node = f[seq.group] if seq.group else f
                b = (seq.batch,) if seq.batch is not None else ()
                ring_o = np.asarray(node["out"][b + (slice(None), h)], np.float64)
                ring_l = np.asarray(node["lse"][b + (h,)], np.float64)
                ref_o, ref_l = dense_head(q, k, v, causal, scale, np.dtype(np.float64))
                lo_o, lo_l = dense_head(q, k, v, causal, scale, low)
                lo_o = lo_o.astype(dt).astype(np.float64)
                fin = np.isfinite(ref_l)
                e = errs[i]
                e[0] = max(e[0], np.abs(ring_o - ref_o).max())
                e[1] = max(e[1], np.abs(lo_o - ref_o).max())
                e[2] = max(e[2], np.abs(ring_l[fin] - ref_l[fin]).max(initial=0.0))
                e[3] = max(e[3], np.abs(lo_l[fin] - ref_l[fin]).max(initial=0.0))
                e[4] += np.count_nonzero(np.isfinite(ring_l) != fin)
                e[4] += np.count_nonzero(~np.isfinite(ring_o))

    run_everywhere(comm, work)
    if comm is not None:
        from mpi4py import MPI

        mx = np.empty_like(errs)
        comm.Allreduce(errs, mx, op=MPI.MAX)
        sm = np.empty_like(errs[:, 4])
        comm.Allreduce(np.ascontiguousarray(errs[:, 4]), sm, op=MPI.SUM)
        mx[:, 4] = sm
        errs = mx
    eps = EPS[plan.dtype]
    rows, ok = [], True
    for i in seqs:
        e = errs[i]
        tol_o, tol_l = 2 * e[1] + eps, 2 * e[3] + eps
        good = bool(e[0] <= tol_o and e[2] <= tol_l and e[4] == 0)
        ok &= good
        rows.append(
            {
                "sequence": plan.sequences[i].name,
                "tokens": plan.sequences[i].length,
                "err_out": float(e[0]),
                "tol_out": float(tol_o),
                "err_lse": float(e[2]),
                "tol_lse": float(tol_l),
                "mismatched_rows": int(e[4]),
                "ok": good,
            }
        )
    return {"ok": ok, "sequences": rows, "skipped": skipped}


def format_verify(res: dict) -> str:
    """One line per sequence plus a verdict."""
    lines = []
    for r in res["sequences"]:
        lines.append(
            f"  verify {r['sequence']}: max|out-ref| {r['err_out']:.2e} <= {r['tol_out']:.2e}, "
            f"max|lse-ref| {r['err_lse']:.2e} <= {r['tol_lse']:.2e}: {'OK' if r['ok'] else 'FAIL'}"
        )
    for name in res["skipped"]:
        lines.append(f"  verify {name}: skipped (longer than --max-tokens)")
    lines.append(f"ringmpi verify: {'PASSED' if res['ok'] else 'FAILED'}")
    return "\n".join(lines)
