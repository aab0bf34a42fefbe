"""The words of ``ringmpi verify``: the mask the reference used, a line per sequence, the verdict.

:func:`ringmpi.job.verify.verify` returns the result these format.
"""

from __future__ import annotations

from .progress import duration
from .schema import Plan

__all__ = ["describe_mask", "format_verify"]


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
