"""Collective argument checks: every rank raises the same error, before any message.

Each rank describes its own arguments in a small dict and notes anything
locally wrong; one ``allgather`` later every rank knows every rank's view and
raises the identical ``ValueError``, naming the field and the rank. A rank
that raised alone would leave the others waiting in the ring forever.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from mpi4py import MPI

from .partition import LAYOUTS, counts

__all__ = ["describe", "agree", "RingArgs"]


class RingArgs(dict):
    """Agreed metadata: n (global tokens), counts (per rank), batched, shapes."""

    __getattr__ = dict.__getitem__


def _shape_errors(q, k, v, dtypes: tuple) -> Optional[str]:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return f"{name} must be an array, got {type(x).__name__}"
    if q.ndim not in (3, 4):
        return f"q must be (S, H, D) or (B, S, H, D), got ndim={q.ndim} shape={tuple(q.shape)}"
    for name, x in (("k", k), ("v", v)):
        if x.ndim != q.ndim:
            return f"{name} has ndim={x.ndim} but q has ndim={q.ndim}"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if str(x.dtype) not in dtypes:
            return f"{name} has dtype {x.dtype}; supported: {', '.join(dtypes)}"
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}"
    if k.shape != v.shape:
        return f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}"
    if q.shape[-1] != k.shape[-1]:
        return f"head dim differs: q has D={q.shape[-1]}, k/v have D={k.shape[-1]}"
    if q.shape[-1] < 1:
        return "head dim D must be >= 1"
    h, hkv = q.shape[-2], k.shape[-2]
    if hkv < 1 or h % hkv:
        return f"H={h} query heads is not a multiple of Hkv={hkv} key/value heads"
    if q.shape[-3] != k.shape[-3]:
        return f"local lengths differ: q holds {q.shape[-3]} tokens, k/v hold {k.shape[-3]}"
    if q.ndim == 4 and q.shape[0] != k.shape[0]:
        return f"batch sizes differ: q has B={q.shape[0]}, k/v have B={k.shape[0]}"
    return None


def _nonfinite(xp, arrays: dict) -> Optional[str]:
    for name, x in arrays.items():
        if x is not None and x.size and not bool(xp.isfinite(x).all()):
            return f"{name} contains NaN or Inf (check_finite=True)"
    return None


def describe(q, k, v, *, causal, layout, scale, backend, check_finite=False, extra=None) -> dict:
    """This rank's view of the call, with a local error message or None."""
    meta: dict[str, Any] = {"error": None}
    err = _shape_errors(q, k, v, backend.dtypes)
    if err is None and layout not in LAYOUTS:
        err = f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}"
    if err is None and scale is not None:
        try:
            scale = float(scale)
        except (TypeError, ValueError):
            err = f"scale must be a number, got {scale!r}"
        else:
            if not math.isfinite(scale):
                err = f"scale must be finite, got {scale}"
    if err is None and check_finite:
        arrays = {"q": q, "k": k, "v": v, **(extra or {})}
        err = _nonfinite(backend.xp, arrays)
    meta["error"] = err
    if err is None:
        meta.update(
            ndim=q.ndim,
            s_local=int(q.shape[-3]),
            q_shape=tuple(q.shape[:-3]) + tuple(q.shape[-2:]),
            kv_shape=tuple(k.shape[:-3]) + tuple(k.shape[-2:]),
            dtype=str(q.dtype),
            tile_dtype=str(backend.xp.dtype(backend.tile_dtype(q.dtype))),
            device="gpu" if backend.name == "gpu" else "cpu",
            layout=layout,
            causal=bool(causal),
            scale=scale,
        )
    return meta


_AGREE = (
    "ndim",
    "q_shape",
    "kv_shape",
    "dtype",
    "tile_dtype",
    "device",
    "layout",
    "causal",
    "scale",
)


def agree(comm: MPI.Comm, meta: dict, what: str = "ring_attention") -> RingArgs:
    """Gather every rank's view; raise the same ValueError everywhere on any problem."""
    views = comm.allgather(meta)
    bad = [(r, m["error"]) for r, m in enumerate(views) if m["error"]]
    if bad:
        r, msg = bad[0]
        more = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
        raise ValueError(f"{what}: rank {r}: {msg}{more}")
    first = views[0]
    for key in _AGREE:
        for r, m in enumerate(views[1:], start=1):
            if m[key] != first[key]:
                raise ValueError(
                    f"{what}: ranks disagree on {key.replace('_', ' ')}: "
                    f"rank 0 has {first[key]!r}, rank {r} has {m[key]!r}"
                )
    size = comm.Get_size()
    local = [m["s_local"] for m in views]
    n = sum(local)
    expected = counts(n, size, first["layout"])
    for r in range(size):
        if local[r] != expected[r]:
            raise ValueError(
                f"{what}: rank {r} holds {local[r]} tokens, but layout {first['layout']!r} "
                f"puts {int(expected[r])} of the n={n} tokens on it; "
                "cut the sequence with ringmpi.shard(x, comm, layout=...)"
            )
    return RingArgs(first, n=n, counts=[int(c) for c in expected], views=views)
