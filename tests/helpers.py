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


def dense_backward(dout, q, k, v, causal, dtype=np.float32):
    """Dense attention backward computed entirely in ``dtype``: the peer for float32 results."""
    f = np.dtype(dtype).type
    q, k, v, dout = (np.moveaxis(np.asarray(x, dtype=f), -3, -2) for x in (q, k, v, dout))
    g = q.shape[-3] // k.shape[-3]
    kh, vh = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    scale = f(q.shape[-1] ** -0.5)
    s = (q * scale) @ np.swapaxes(kh, -1, -2)
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], dtype=bool)), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    delta = np.sum(dout * (p @ vh), axis=-1, keepdims=True)
    ds = p * (dout @ np.swapaxes(vh, -1, -2) - delta)
    dq = scale * (ds @ kh)
    dk = scale * (np.swapaxes(ds, -1, -2) @ q)
    dv = np.swapaxes(p, -1, -2) @ dout

    def fold(x):  # (..., H, S, D) -> (..., S, Hkv, D), summed over each query group
        x = x.reshape(*x.shape[:-3], x.shape[-3] // g, g, *x.shape[-2:]).sum(axis=-3)
        return np.moveaxis(x, -3, -2)

    return np.moveaxis(dq, -2, -3), fold(dk), fold(dv)


def raises_everywhere(comm, fn, *words):
    """Every rank must raise ValueError with one identical message containing ``words``."""
    try:
        fn()
        msg = None
    except ValueError as exc:
        msg = str(exc)
    msgs = comm.allgather(msg)
    assert_all(comm, msg is not None, "no ValueError raised on this rank")
    assert_all(comm, len(set(msgs)) == 1, f"ranks raised different messages: {msgs}")
    for w in words:
        assert_all(comm, w in msg, f"{w!r} missing from {msg!r}")
