"""Benchmark of the CUDA tiles, forward and backward, beside torch's SDPA when torch imports.

``python -m ringmpi.gpu.bench`` prints one table, a row per (pass, dtype, D, N,
causal): achieved TFLOP/s of :func:`ringmpi.gpu.tile.forward_tile` (or of
:func:`ringmpi.gpu.backward.backward_tile`) on one GPU (one tile covering the
whole sequence, as a single-rank ring does), the configuration that ran, the
same for ``torch.nn.functional.scaled_dot_product_attention`` (its backward
through autograd) on the same inputs, their ratio, and the largest difference
of the two results (the output, or dQ). Useful flops only: 4 N^2 D H B forward,
10 N^2 D H B backward, half of that (N(N+1)/2 pairs) when causal. torch is
used for comparison only, never required. ``--configs`` adds a row per forward
configuration (forced through ``RINGMPI_GPU_CONFIG``) for bf16 at N = 4096.
A row that fails (an exception in the kernel, the comparison or torch) is
printed as FAILED with the error and kept in the JSON; the table goes on, and
the exit status is 1 when any row failed.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Optional

import numpy as np

from .. import softmax
from ..runtime.files import write_json
from . import backward, configs, device, kernel_args, tile

__all__ = ["bench_case", "main"]


def _inputs(dtype: str, shapes: list, seed: int):
    import cupy

    rs = cupy.random.RandomState(seed)
    xs = [rs.standard_normal(s, dtype=cupy.float32) for s in shapes]
    if dtype == "bfloat16":
        return [tile.to_bf16_bits(x) for x in xs]
    return [x.astype(dtype) for x in xs]


def _time(fn, sync, min_s: float = 0.3, max_reps: int = 50) -> float:
    """Seconds per call: one warm-up, then repeat until ``min_s`` has passed."""
    fn()
    sync()
    reps, t0 = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        if reps >= max_reps or (reps >= 3 and time.perf_counter() - t0 >= min_s):
            sync()
            if time.perf_counter() - t0 >= min_s or reps >= max_reps:
                break
    return (time.perf_counter() - t0) / reps


def _torch_view(x, dtype: str):
    import cupy
    import torch

    if dtype == "bfloat16":  # uint16 bits -> torch bfloat16
        return torch.as_tensor(x.view(cupy.int16), device="cuda").view(torch.bfloat16)
    return torch.as_tensor(x, device="cuda")


def _storage_dtype(dtype: str):
    return np.dtype("uint16" if dtype == "bfloat16" else dtype)


def bench_case(
    dtype: str,
    d: int,
    n: int,
    causal: bool,
    h: int,
    b: int = 1,
    torch_mod=None,
    direction: str = "fwd",
    min_s: float = 0.3,
) -> dict:
    """One benchmark row (dict) for inputs (b, h, n, d) of ``dtype``; direction fwd or bwd.

    Parameters
    ----------
    dtype : {"bfloat16", "float16", "float32", "float64"}
    d, n, h, b : int
        Head dim, tokens, heads and batch: q, k, v, dout are (b, h, n, d).
    causal : bool
    torch_mod : module, optional
        torch, for the SDPA columns.
    direction : {"fwd", "bwd"}
    min_s : float
        Seconds each timing runs at least.
    """
    import cupy

    shape = (b, h, n, d)
    q, k, v, do = _inputs(dtype, [shape] * 4, seed=n + d)
    sdt = _storage_dtype(dtype)
    acc_t = tile.acc_dtype(sdt)
    pos = np.arange(n, dtype=np.int64)
    scale = 1.0 / np.sqrt(d)
    dev = device.current()
    storage = kernel_args.storage(sdt)

    def forward():
        acc, m, l = softmax.init_state(q.shape, acc_t, cupy)
        tile.forward_tile(q, k, v, pos, pos, acc, m, l, scale=scale, causal=causal)
        return acc, m, l

    out, lse = softmax.finalize(*forward(), cupy)
    pairs = n * (n + 1) / 2 if causal else n * n
    row = {"pass": direction, "dtype": dtype, "D": d, "N": n, "causal": causal, "B": b, "H": h}
    if direction == "fwd":
        row["config"] = tile.chosen(storage, d, causal, dev).name
        useful = 4.0 * b * h * d * pairs
        t_ours = _time(forward, cupy.cuda.Device().synchronize, min_s)
        mine = out
    else:
        row["config"] = "+".join(c.name for c in backward.chosen(storage, d, dev))
        useful = 10.0 * b * h * d * pairs
        delta = (
            (do.astype(acc_t) * out).sum(-1)
            if dtype != "bfloat16"
            else (kernel_args.from_bf16_bits(do) * out).sum(-1)
        )
        grads = [cupy.zeros(shape, dtype=acc_t) for _ in range(3)]

        def bwd():
            backward.backward_tile(
                q, k, v, do, lse, delta, pos, pos, *grads, scale=scale, causal=causal
            )

        bwd()
        mine = grads[0].copy()  # dQ of one call
        t_ours = _time(bwd, cupy.cuda.Device().synchronize, min_s)
    row.update(ms=t_ours * 1e3, tflops=useful / t_ours / 1e12)
    if torch_mod is not None and dtype in ("float16", "bfloat16"):
        sdpa = torch_mod.nn.functional.scaled_dot_product_attention
        tq, tk, tv, tdo = (_torch_view(x, dtype) for x in (q, k, v, do))
        res = {}
        if direction == "fwd":

            def theirs():
                res["x"] = sdpa(tq, tk, tv, is_causal=causal)

        else:
            tq, tk, tv = (x.clone().requires_grad_() for x in (tq, tk, tv))
            o = sdpa(tq, tk, tv, is_causal=causal)

            def theirs():
                res["x"] = torch_mod.autograd.grad(o, (tq, tk, tv), tdo, retain_graph=True)[0]

        t_torch = _time(theirs, torch_mod.cuda.synchronize, min_s)
        ref = cupy.asarray(res["x"].float().contiguous())
        row.update(torch_ms=t_torch * 1e3, torch_tflops=useful / t_torch / 1e12)
        row.update(ratio=t_torch / t_ours, max_diff=float(cupy.abs(mine - ref).max()))
    return row


HEAD = (
    f"{'pass':>4} {'dtype':>9} {'D':>4} {'N':>6} {'causal':>6} {'config':>14} {'ms':>9} "
    f"{'TFLOP/s':>8} {'torch ms':>9} {'TFLOP/s':>8} {'x torch':>7} "
    f"{'max diff':>9}"
)


def _fmt(row: dict) -> str:
    s = (
        f"{row['pass']:>4} {row['dtype']:>9} {row['D']:>4} {row['N']:>6} "
        f"{str(row['causal']):>6} {row['config']:>14} {row['ms']:>9.3f} "
        f"{row['tflops']:>8.1f}"
    )
    if "torch_tflops" in row:
        s += f" {row['torch_ms']:>9.3f} {row['torch_tflops']:>8.1f} {row['ratio']:>7.2f}"
        s += f" {row['max_diff']:>9.2e}"
    else:
        s += f" {'-':>9} {'-':>8} {'-':>7} {'-':>9}"
    return s


def _fmt_failed(row: dict) -> str:
    return (
        f"{row['pass']:>4} {row['dtype']:>9} {row['D']:>4} {row['N']:>6} "
        f"{str(row['causal']):>6} FAILED: {row['error']}"
    )


def run_row(
    rows: list, dtype: str, d: int, n: int, causal: bool, save=None, forced: str = "", **kw
) -> bool:
    """Run one row, print it and append it to ``rows``; a failure is a row too. True if ok.

    ``save``, if given, is called after the row was appended (the JSON so far).
    """
    try:
        row = bench_case(dtype, d, n, causal, **kw)
        if forced:
            row["forced"] = forced
        ok = True
    except Exception as exc:  # one broken row must not cost the rest of the table
        row = {
            "pass": kw.get("direction", "fwd"),
            "dtype": dtype,
            "D": d,
            "N": n,
            "causal": causal,
            "error": f"{type(exc).__name__}: {exc}"[:500],
        }
        ok = False
    rows.append(row)
    print(_fmt(row) if ok else _fmt_failed(row), flush=True)
    if save is not None:
        save()
    return ok


def cases(quick: bool, ns: Optional[tuple] = None) -> list:
    """(pass, dtype, D, N, causal) of the table (``ns``: the sequence lengths, if given)."""
    ns = ns or ((1024,) if quick else (4096, 16384))
    out = [
        (p, t, d, n, c)
        for p in ("fwd", "bwd")
        for t in ("bfloat16", "float16")
        for d in (64, 128)
        for n in ns
        for c in (False, True)
    ]
    out += [
        (p, t, 64, ns[0], c)
        for p in ("fwd", "bwd")
        for t in ("float32", "float64")
        for c in (False, True)
    ]
    return out


def main(argv: Optional[list] = None) -> int:
    """Print the table; ``--quick`` for a smoke run, ``--json PATH`` to save the rows.

    The JSON is rewritten after every row, so a run stopped by a time limit keeps
    the rows it finished.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 1024 only")
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument(
        "--configs",
        action="store_true",
        help="also time every forward configuration (bf16, N=4096)",
    )
    ap.add_argument("--n", type=int, action="append", help="sequence length (repeatable)")
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds per timing")
    args = ap.parse_args(argv)
    import cupy

    try:
        import torch

        torch.zeros(1, device="cuda")
    except Exception as exc:  # torch is optional
        print(f"torch unavailable ({type(exc).__name__}: {exc}); ringmpi columns only")
        torch = None
    dev = device.current()
    name = device.name(dev)
    versions = f"CuPy {cupy.__version__}" + (f"; torch {torch.__version__}" if torch else "")
    print(f"device: {name}; {versions}")
    print(HEAD, flush=True)
    rows: list = []
    head = {"device": name, "cupy": cupy.__version__, "complete": False}

    def save() -> None:
        if args.json:
            failed = sum("error" in r for r in rows)
            write_json(args.json, {**head, "rows": rows, "failed": failed})

    kw = {"h": args.heads, "torch_mod": torch, "min_s": args.min_time, "save": save}
    ok = True
    for direction, dtype, d, n, causal in cases(args.quick, tuple(args.n or ())):
        ok &= run_row(rows, dtype, d, n, causal, direction=direction, **kw)
        cupy.get_default_memory_pool().free_all_blocks()
    if args.configs:
        n = args.n[0] if args.n else 1024 if args.quick else 4096
        print("\nevery forward configuration (RINGMPI_GPU_CONFIG), bf16, N =", n)
        print(HEAD, flush=True)
        old = os.environ.get(tile.CONFIG_ENV)
        try:
            for d in (64, 128):
                for cfg in configs.forward_candidates("bf16_t", d, device.smem_optin(dev)):
                    os.environ[tile.CONFIG_ENV] = cfg.name
                    for causal in (False, True):
                        ok &= run_row(rows, "bfloat16", d, n, causal, forced=cfg.name, **kw)
        finally:
            if old is None:
                os.environ.pop(tile.CONFIG_ENV, None)
            else:
                os.environ[tile.CONFIG_ENV] = old
    failed = sum("error" in r for r in rows)
    if failed:
        print(f"{failed} of {len(rows)} rows FAILED")
    head["complete"] = True
    save()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
