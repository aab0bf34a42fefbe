"""What ``ringmpi bench`` measures with besides its timer: model flops, the kernel, meters.

The model flop count (:mod:`ringmpi.cost`), the CPU kernel and its ISA path, the
float32 matrix-product rate of this process, a resident-set sampler, and torch's
scaled_dot_product_attention as a yardstick (:mod:`ringmpi.bench` runs them).
Everything beyond the standard library is imported on use: ``ringmpi bench --help``
stays light.
"""

from __future__ import annotations

import threading
import time

__all__ = ["model_flops", "kernel_isa", "RssPeak", "matmul_rate", "torch_sdpa"]


def model_flops(n: int, h: int, d: int, causal: bool, pass_: str = "fwd") -> float:
    """Model flops of one call on a whole sequence: 4 N^2 H D forward, 10 backward (causal: half).

    Parameters
    ----------
    n : int
        Tokens N of the sequence (all ranks together).
    h : int
        Query heads H.
    d : int
        Head size D.
    causal : bool
        Half the pairs are visible.
    pass_ : {"fwd", "bwd"}
    """
    from .cost import flops

    return flops(n * n / (2 if causal else 1), d, h, backward=pass_ != "fwd")


def kernel_isa() -> str:
    """The CPU kernel and its ISA path, e.g. 'fused avx2' (or 'numpy')."""
    import numpy as np

    from .backend import select

    name = select(np.empty(0, np.float32)).name
    if name != "fused":
        return name
    from .cpu import fused

    return f"fused {fused.isa()}"


class RssPeak:
    """Sample this process's resident set in a thread; ``peak`` is the maximum seen.

    Parameters
    ----------
    period : float
        Seconds between samples.
    """

    def __init__(self, period: float = 0.002):
        from .job.budget import resident_bytes

        self.period, self.peak, self._stop = period, 0, threading.Event()
        self._resident = resident_bytes

    def rss(self) -> int:
        """The resident set now, in bytes (:func:`ringmpi.job.budget.resident_bytes`)."""
        return self._resident()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.period)

    def __enter__(self):
        self.peak = self.rss()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.rss())


def matmul_rate(n: int = 2048, reps: int = 3) -> float:
    """GFLOP/s of this process's float32 (n, n) x (n, n) product, best of ``reps``."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = a.T.copy()
    a @ b
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best / 1e9


def torch_sdpa(cases: list, heads: int, dtype: str, repeat: int, threads: int) -> list[dict]:
    """torch SDPA on the plain ``cases`` with ``threads`` threads ([] without torch).

    Parameters
    ----------
    cases : list of dict
        ``n``, ``d``, ``causal``, ``pass_`` and ``mod`` of each case (only "plain"
        ones run: SDPA has no softcap or ALiBi).
    heads : int
        Query heads H; q, k, v are (1, H, N, D).
    dtype : str
        torch dtype name ("float32", "float64").
    repeat : int
        Timed runs per case (best kept).
    threads : int
        torch intra-op threads (restored afterwards).
    """
    try:
        import torch
    except ImportError:
        return []
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    out = []
    try:
        for c in cases:
            if c["mod"] != "plain":
                continue  # SDPA has no softcap / ALiBi: a yardstick for plain rows only
            h = heads
            bwd = c["pass_"] == "bwd"
            q, k, v = (
                torch.randn(1, h, c["n"], c["d"], dtype=dt, requires_grad=bwd) for _ in range(3)
            )
            f = torch.nn.functional.scaled_dot_product_attention
            best = 1e30
            for _ in range(repeat):
                if bwd:  # autograd through SDPA: time the backward call only
                    y = f(q, k, v, is_causal=c["causal"])
                    g = torch.randn_like(y)
                    t = time.perf_counter()
                    y.backward(g)
                else:
                    t = time.perf_counter()
                    f(q, k, v, is_causal=c["causal"])
                best = min(best, time.perf_counter() - t)
                q.grad = k.grad = v.grad = None
            rate = model_flops(c["n"], h, c["d"], c["causal"], c["pass_"]) / best / 1e9
            out.append(dict(c, threads=threads, time_s=best, gflops_per_thread=rate / threads))
    finally:
        torch.set_num_threads(old)
    return out
