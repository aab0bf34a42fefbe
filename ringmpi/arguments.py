"""The arguments of a ring call, agreed by every rank before the first message.

:func:`prepare` is the entry of both ring loops: it checks the arguments on
every rank together and converts q, k, v to the tiles' head-major layout;
:func:`to_external` converts results back.


Each rank describes its own arguments in a small dict and notes anything
locally wrong; one ``allgather`` later every rank knows every rank's view and
raises the identical ``ValueError``, naming the field and the rank. A rank
that raised alone would leave the others waiting in the ring forever.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
from mpi4py import MPI

from .backend import Backend, select
from .collective import first_error
from .mask import Mask, check_window, make_mask
from .partition import LAYOUTS, counts
from .watchdog import watch

__all__ = [
    "describe",
    "agree",
    "resolve",
    "prepare",
    "to_internal",
    "to_external",
    "report",
    "RingArgs",
]


@dataclass(frozen=True)
class RingArgs:
    """What every rank agreed on for one ring call.

    Attributes
    ----------
    n, nk : int
        Global number of query tokens and of key/value tokens (equal unless
        cross-attention).
    counts, counts_k : list of int
        Query / key tokens held by each rank (what the layout gives).
    layout : str
    causal : bool
    scale : float
        The score scale in use (1/sqrt(D) unless given).
    batched : bool
        Whether the inputs have a leading batch axis.
    in_dtype, tile_dtype, acc_dtype
        Input dtype, dtype the tile computes in, dtype of the accumulated state.
    mask : ringmpi.mask.Mask
        Causal flag, window, packed-sequence offsets.
    """

    n: int
    counts: list
    layout: str
    causal: bool
    scale: float
    batched: bool
    in_dtype: Any
    tile_dtype: Any
    acc_dtype: Any
    nk: int  # keys in all (n unless cross-attention)
    counts_k: list
    mask: Mask


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
    if q.ndim == 4 and q.shape[0] != k.shape[0]:
        return f"batch sizes differ: q has B={q.shape[0]}, k/v have B={k.shape[0]}"
    return None


def _nonfinite(xp, arrays: dict) -> Optional[str]:
    for name, x in arrays.items():
        if x is None or not x.size:
            continue
        if str(x.dtype) == "uint16":  # bfloat16 bit patterns: exponent all ones is Inf/NaN
            bad = bool(((x & 0x7F80) == 0x7F80).any())
        else:
            bad = not bool(xp.isfinite(x).all())
        if bad:
            return f"{name} contains NaN or Inf (check_finite=True)"
    return None


def _cu(name: str, cu) -> tuple:
    """Packed-sequence offsets as a tuple (compared across ranks); ValueError if malformed."""
    if cu is None:
        return None
    a = np.asarray(cu.get() if hasattr(cu, "get") else cu)
    if a.ndim != 1 or len(a) < 2 or a.dtype.kind not in "iu" or a[0] != 0 or (np.diff(a) < 0).any():
        raise ValueError(f"{name} must be 1-D integer offsets [0, ..., N], never decreasing")
    return tuple(int(x) for x in a)


def describe(
    q, k, v, *, causal, layout, scale, backend, check_finite=False, extra=None,
    window=None, cu_seqlens=None, cu_seqlens_k=None,
) -> dict:  # fmt: skip
    """This rank's view of the call, with a local error message or None."""
    meta: dict[str, Any] = {"error": None}
    err = _shape_errors(q, k, v, backend.dtypes)
    try:
        masks = (check_window(window), _cu("cu_seqlens", cu_seqlens),
                 _cu("cu_seqlens_k", cu_seqlens_k))  # fmt: skip
    except ValueError as e:
        err, masks = err or str(e), (None, None, None)
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
            s_local_k=int(k.shape[-3]),
            window=masks[0],
            cu_seqlens=masks[1],
            cu_seqlens_k=masks[2],
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
    "window",
    "cu_seqlens",
    "cu_seqlens_k",
)


def agree(comm: MPI.Comm, meta: dict, what: str = "ring_attention") -> dict:
    """Gather every rank's view; raise the same ValueError everywhere on any problem.

    Returns the agreed view of rank 0 plus ``n`` and ``counts``.
    """
    views = comm.allgather(meta)
    msg = first_error([m["error"] for m in views], what)
    if msg is not None:
        raise ValueError(msg)
    first = views[0]
    for key in _AGREE:
        for r, m in enumerate(views[1:], start=1):
            if m[key] != first[key]:
                raise ValueError(
                    f"{what}: ranks disagree on {key.replace('_', ' ')}: "
                    f"rank 0 has {first[key]!r}, rank {r} has {m[key]!r}"
                )
    size, layout = comm.Get_size(), first["layout"]
    n, nk = sum(m["s_local"] for m in views), sum(m["s_local_k"] for m in views)
    try:
        mask = make_mask(n, nk, first["causal"], first["window"], first["cu_seqlens"],
                         first["cu_seqlens_k"])  # fmt: skip
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    got = {}
    for key, name, total, cu in (
        ("s_local", "q", n, mask.cu_q),
        ("s_local_k", "k/v", nk, mask.cu_k),
    ):
        expected = counts(total, size, layout, cu_seqlens=cu)
        for r in range(size):
            if views[r][key] != expected[r]:
                raise ValueError(
                    f"{what}: rank {r} holds {views[r][key]} {name} tokens, but layout {layout!r} "
                    f"puts {int(expected[r])} of the n={total} tokens on it; cut the sequence "
                    "with ringmpi.shard(x, comm, layout=...) (and cu_seqlens=... if packed)"
                )
        got[key] = [int(c) for c in expected]
    return dict(first, n=n, nk=nk, counts=got["s_local"], counts_k=got["s_local_k"], mask=mask)


def resolve(agreed: dict, q, backend) -> RingArgs:
    """The typed call arguments from the agreed view and this rank's q."""
    d = q.shape[-1]
    scale = agreed["scale"]
    return RingArgs(
        n=agreed["n"],
        counts=agreed["counts"],
        layout=agreed["layout"],
        causal=agreed["causal"],
        scale=1.0 / float(np.sqrt(d)) if scale is None else float(scale),
        batched=q.ndim == 4,
        in_dtype=q.dtype,
        tile_dtype=backend.tile_dtype(q.dtype),
        acc_dtype=backend.acc_dtype(q.dtype),
        nk=agreed["nk"],
        counts_k=agreed["counts_k"],
        mask=agreed["mask"],
    )


def prepare(
    q, k, v, comm, *, causal, layout, scale, check_finite, what, extra=None,
    window=None, cu_seqlens=None, cu_seqlens_k=None,
):  # fmt: skip
    """Agree on the call across ranks and bring q, k, v to the tiles' layout.

    Returns
    -------
    backend : Backend
    args : ringmpi.arguments.RingArgs
    qi : (B, H, S, D) ; ki, vi : (B, Hkv, S, D)
        Contiguous, in the backend's tile dtype.
    """
    be: Backend = select(q)
    meta = describe(
        q, k, v, causal=causal, layout=layout, scale=scale, backend=be,
        check_finite=check_finite, extra=extra, window=window, cu_seqlens=cu_seqlens,
        cu_seqlens_k=cu_seqlens_k,
    )  # fmt: skip
    with watch(f"{what}: the argument agreement (allgather) with the other ranks"):
        agreed = agree(comm, meta, what)
    args = resolve(agreed, q, be)
    return be, args, *(to_internal(be.xp, x, args.tile_dtype) for x in (q, k, v))


def to_internal(xp, x, dtype):
    """(B?, S, H, D) -> (B, H, S, D), ``dtype``, C-contiguous."""
    x = x if x.ndim == 4 else x[None]
    return xp.ascontiguousarray(xp.moveaxis(x, -3, -2), dtype=dtype)


def to_external(x, like, cast=None):
    """(B, H, S, D) -> the layout (B?, S, H, D) and dtype of ``like`` (``cast(x, dtype)``)."""
    x = x.swapaxes(-2, -3)
    x = x.astype(like.dtype, order="C") if cast is None else cast(x, like.dtype)
    return x if like.ndim == 4 else x[0]


def report(stats: Optional[dict], t_start: float, **fields) -> None:
    """Fill the caller's ``stats`` dict (if any) with ``fields`` and total_s."""
    if stats is not None:
        stats.update(fields, total_s=time.perf_counter() - t_start)
