"""Shared test helpers: dense low-precision attention and cross-rank asserts."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI


def dense(q, k, v, causal=False, scale=None, dtype=np.float32):
    """Dense attention computed entirely in ``dtype``: the peer a ring result is judged against."""
    q, k, v = (np.asarray(x, dtype=dtype) for x in (q, k, v))
    h, hkv, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = dtype(1.0 / np.sqrt(d)) if scale is None else dtype(scale)
    qh = np.moveaxis(q, -3, -2)
    kh = np.repeat(np.moveaxis(k, -3, -2), h // hkv, axis=-3)
    vh = np.repeat(np.moveaxis(v, -3, -2), h // hkv, axis=-3)
    s = (qh * scale) @ np.swapaxes(kh, -1, -2)
    if causal:
        n = s.shape[-1]
        s = np.where(np.tril(np.ones((n, n), dtype=bool)), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    z = p.sum(axis=-1, keepdims=True)
    return np.moveaxis((p / z) @ vh, -2, -3), (m + np.log(z))[..., 0]


def assert_all(comm: MPI.Comm, ok: bool, msg: str) -> None:
    """Fail on every rank together when any rank's condition is false."""
    ok_all = comm.allreduce(bool(ok), op=MPI.LAND)
    bad = comm.allgather(None if ok else msg)
    assert ok_all, "; ".join(f"rank {r}: {m}" for r, m in enumerate(bad) if m)


def random_qkv(rng, n, h, hkv, d, batch=None, dtype=np.float64):
    """Global q (n, h, d), k and v (n, hkv, d), with a leading batch axis if given."""
    lead = () if batch is None else (batch,)
    q = rng.standard_normal((*lead, n, h, d))
    k = rng.standard_normal((*lead, n, hkv, d))
    v = rng.standard_normal((*lead, n, hkv, d))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)
