"""Forward-attention benchmark of the CUDA tiles, beside torch's SDPA when torch imports.

``python -m ringmpi.gpu_bench`` prints one row per (dtype, D, N, causal):
achieved TFLOP/s of :func:`ringmpi.gpu.tile.forward_tile` on one GPU (one tile
covering the whole sequence, as a single-rank ring does), the same for
``torch.nn.functional.scaled_dot_product_attention`` on the same inputs, their
ratio, and the largest difference of the two outputs. Useful flops only:
4 N^2 D H B, half of that (N(N+1)/2 pairs) when causal. torch is used for
comparison only, never required.
"""

from __future__ import annotations

import argparse
import time
from typing import Optional

import numpy as np

from .. import softmax
from ..files import write_json
from . import tile

__all__ = ["bench_case", "main"]


def _inputs(dtype: str, b: int, h: int, n: int, d: int, seed: int):
    import cupy

    rs = cupy.random.RandomState(seed)
    xs = [rs.standard_normal((b, h, n, d), dtype=cupy.float32) for _ in range(3)]
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

    if dtype == "bfloat16":  # uint16 bits -> torch bfloat16 without a copy
        return torch.as_tensor(x.view(cupy.int16), device="cuda").view(torch.bfloat16)
    return torch.as_tensor(x, device="cuda")


def bench_case(dtype: str, d: int, n: int, causal: bool, h: int, b: int = 1, torch_mod=None):
    """One benchmark row (dict) for inputs (b, h, n, d) of ``dtype``."""
    import cupy

    q, k, v = _inputs(dtype, b, h, n, d, seed=n + d)
    acc_t = tile.acc_dtype(np.dtype("uint16") if dtype == "bfloat16" else np.dtype(dtype))
    acc, m, l = softmax.init_state(q.shape, acc_t, cupy)
    pos = np.arange(n, dtype=np.int64)
    scale = 1.0 / np.sqrt(d)

    def ours():
        acc.fill(0)
        m.fill(-np.inf)
        l.fill(0)
        tile.forward_tile(q, k, v, pos, pos, acc, m, l, scale=scale, causal=causal)

    dev = cupy.cuda.Device()
    t_ours = _time(ours, dev.synchronize)
    useful = 4.0 * b * h * d * (n * (n + 1) / 2 if causal else n * n)
    row = {"dtype": dtype, "D": d, "N": n, "causal": causal, "B": b, "H": h}
    row.update(ms=t_ours * 1e3, tflops=useful / t_ours / 1e12)
    out, _ = softmax.finalize(acc, m, l, cupy)
    if torch_mod is not None and dtype in ("float16", "bfloat16"):
        sdpa = torch_mod.nn.functional.scaled_dot_product_attention
        tq, tk, tv = (_torch_view(x, dtype) for x in (q, k, v))
        res = {}

        def theirs():
            res["o"] = sdpa(tq, tk, tv, is_causal=causal)

        t_torch = _time(theirs, torch_mod.cuda.synchronize)
        ref = cupy.asarray(res["o"].float().contiguous())
        row.update(torch_ms=t_torch * 1e3, torch_tflops=useful / t_torch / 1e12)
        row.update(ratio=t_torch / t_ours, max_diff=float(cupy.abs(out - ref).max()))
    return row


def _fmt(row: dict) -> str:
    s = (f"{row['dtype']:>9} {row['D']:>4} {row['N']:>6} {str(row['causal']):>6} "
         f"{row['H']:>3} {row['ms']:>9.2f} {row['tflops']:>8.1f}")  # fmt: skip
    if "torch_tflops" in row:
        s += f" {row['torch_ms']:>9.2f} {row['torch_tflops']:>8.1f} {row['ratio']:>6.2f}"
        s += f" {row['max_diff']:>9.2e}"
    return s


def main(argv: Optional[list] = None) -> int:
    """Run the table; ``--quick`` for a smoke run, ``--json PATH`` to save the rows."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 1024 only")
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--heads", type=int, default=16)
    args = ap.parse_args(argv)
    import cupy

    try:
        import torch

        torch.zeros(1, device="cuda")
    except Exception as exc:  # torch is optional
        print(f"torch unavailable ({type(exc).__name__}: {exc}); ringmpi columns only")
        torch = None
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(
        f"device: {name}; CuPy {cupy.__version__}"
        + (f"; torch {torch.__version__}" if torch else "")
    )
    ns = (1024,) if args.quick else (4096, 16384)
    cases = [(t, d, n, c) for t in ("bfloat16", "float16") for d in (64, 128) for n in ns
             for c in (False, True)]  # fmt: skip
    cases += [(t, d, ns[0], c) for t in ("float32", "float64") for d in (64, 128)
              for c in (False, True)]  # fmt: skip
    head = f"{'dtype':>9} {'D':>4} {'N':>6} {'causal':>6} {'H':>3} {'ms':>9} {'TFLOP/s':>8}"
    if torch is not None:
        head += f" {'torch ms':>9} {'TFLOP/s':>8} {'x torch':>6} {'max diff':>9}"
    print(head, flush=True)
    rows = []
    for dtype, d, n, causal in cases:
        row = bench_case(dtype, d, n, causal, args.heads, torch_mod=torch)
        rows.append(row)
        print(_fmt(row), flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
    if args.json:
        write_json(args.json, {"device": name, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
