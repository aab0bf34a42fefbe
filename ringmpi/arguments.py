"""The arguments of an attention call, agreed by every rank before the first message.

:func:`agree` is the one agreement of every entry point (forward, backward,
heads x ring, decode): each rank validates the :class:`ringmpi.spec.AttentionSpec`,
checks its own arrays and asks the backend whether its tiles can run the call
(:meth:`ringmpi.backend.Backend.supports`), and notes anything locally wrong in
a small dict; one ``allgather`` later every rank knows every rank's view and
raises the identical ``ValueError``, naming the field and the rank. A rank
that raised alone would leave the others waiting in the ring forever.
:func:`to_internal` converts arrays to the tiles' head-major layout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from mpi4py import MPI

from .backend import Backend, is_cupy, select
from .collective import agree_views
from .layout import counts
from .mask import Mask, mask_of
from .spec import AttentionSpec, modifier_fields

__all__ = ["agree", "to_internal", "report", "RingArgs"]


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
        The score scale in use (1/sqrt(Dk), Dk the key width, unless given).
    batched : bool
        Whether the inputs have a leading batch axis.
    in_dtype, tile_dtype, acc_dtype
        Input dtype, dtype the tile computes in, dtype of the accumulated state.
    mask : ringmpi.mask.Mask
        Causal flag, window, packed-sequence offsets.
    spec : ringmpi.spec.AttentionSpec
        The validated spec every rank agreed on.
    backend : ringmpi.backend.Backend
        The tiles that run the call (the same kind on every rank).
    members, members_k : list of int
        Query / key tokens of each rank of this rank's head group (heads x ring;
        ``[own count]`` without); ``counts`` and ``counts_k`` are then per ring position.
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
    spec: AttentionSpec
    backend: Backend
    members: list
    members_k: list


def _shape_errors(q, k, v) -> Optional[str]:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return f"{name} must be an array, got {type(x).__name__}"
    if q.ndim not in (3, 4):
        return f"q must be (S, H, D) or (B, S, H, D), got ndim={q.ndim} shape={tuple(q.shape)}"
    for name, x in (("k", k), ("v", v)):
        if x.ndim != q.ndim:
            return f"{name} has ndim={x.ndim} but q has ndim={q.ndim}"
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}"
    # keys and values may differ in width (Dk != Dv: multi-head latent attention, issue 42),
    # in nothing else
    if k.shape[:-1] != v.shape[:-1]:
        return (
            f"k shape {tuple(k.shape)} and v shape {tuple(v.shape)} differ before the last "
            "axis (only the widths Dk and Dv may differ)"
        )
    if q.shape[-1] != k.shape[-1]:
        return (
            f"head dim differs: q has D={q.shape[-1]}, k has D={k.shape[-1]} (queries and keys "
            "share the key width; only v may be narrower or wider)"
        )
    if q.shape[-1] < 1:
        return "head dim D must be >= 1"
    if v.shape[-1] < 1:
        return "value width Dv must be >= 1"
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


def _extra_errors(be, q, dv: int, dout, out, lse, check_finite: bool) -> Optional[str]:
    """This rank's complaint about the backward's dout, out and lse (q is checked already).

    ``dv`` is the value width: out and dout are q's shape with Dv last.
    """
    shape = tuple(q.shape)
    want_lse = shape[:-3] + (shape[-2], shape[-3])
    shape = shape[:-1] + (int(dv),)
    for name, x, want in (("dout", dout, shape), ("out", out, shape), ("lse", lse, want_lse)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return f"{name} must be an array, got {type(x).__name__}"
        if tuple(x.shape) != want:
            return f"{name} has shape {tuple(x.shape)}, expected {want}"
        ok = be.dtypes if name != "lse" else ("float16", "float32", "float64")
        if str(x.dtype) not in ok:
            return f"{name} has dtype {x.dtype}; supported: {', '.join(ok)}"
        if is_cupy(x) != is_cupy(q):
            return f"{name} is a {type(x).__name__} but q is a {type(q).__name__}"
    xp = be.xp
    if check_finite:
        for name, x in (("dout", dout), ("out", out)):
            if x.size and not bool(xp.isfinite(be.decode(x)).all()):
                return f"{name} contains NaN or Inf (check_finite=True)"
        if lse.size and bool(xp.isnan(lse).any() or xp.isposinf(lse).any()):
            return "lse contains NaN or +Inf (check_finite=True)"
    return None


def _head_errors(u: int, size: int, h: int, hkv: int) -> Optional[str]:
    """Heads x ring: U must divide the ranks and H, and Hkv and U one the other."""
    if size % u:
        return f"head_parallel={u!r} must be a positive divisor of the {size} ranks"
    if h % u:
        return f"H={h} query heads is not a multiple of head_parallel={u}"
    if hkv % u and u % hkv:
        return f"Hkv={hkv} and head_parallel={u}: one must divide the other"
    return None


# view entries every rank must hold equal (the spec's fields are added to them)
_SAME = ("ndim", "q shape", "kv shape", "dtype", "tile dtype", "device")
_FIELDS = tuple(AttentionSpec.__dataclass_fields__)


def _view(comm, spec, arrays: dict, be, check_finite: bool, decode) -> dict:
    """This rank's description of the call, with its local error message or None."""
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    err = _shape_errors(q, k, v)
    try:
        spec = spec.validate()
    except ValueError as e:
        err, spec = err or str(e), None
    if err is None:
        try:
            spec.check_heads(int(q.shape[-2]))
        except ValueError as e:
            err = str(e)
        if decode:  # the modifiers decode does not apply: refused
            for name, _ in modifier_fields():
                if getattr(spec, name) is not None and name not in decode:
                    why = (
                        "needs token positions, which a decode cache has not"
                        if name == "alibi_slopes"
                        else "is not supported by decode"
                    )
                    err = err or f"{name} {why}"
    if err is None:
        backward = "dout" in arrays
        why = be.supports(
            spec,
            q.dtype,
            int(q.shape[-1]),
            backward=backward,
            tiles=not decode,
            dv=int(v.shape[-1]),
        )
        if why:
            err = f"the {be.name} backend cannot run this call: {'; '.join(why)}"
    if err is None and spec.head_parallel > 1:
        err = _head_errors(spec.head_parallel, comm.Get_size(), q.shape[-2], k.shape[-2])
    if err is None and check_finite:
        err = _nonfinite(be.xp, {"q": q, "k": k, "v": v})
    if err is None and "dout" in arrays:
        err = _extra_errors(
            be, q, v.shape[-1], arrays["dout"], arrays["out"], arrays["lse"], check_finite
        )
    if err is not None:
        return {"error": err}
    q_rest = tuple(q.shape) if decode else tuple(q.shape[:-3]) + tuple(q.shape[-2:])
    view = {
        "error": None,
        "s_local": int(q.shape[-3]),
        "s_local_k": int(k.shape[-3]),
        "ndim": q.ndim,
        "q shape": q_rest,
        "kv shape": tuple(k.shape[:-3]) + tuple(k.shape[-2:]) + (int(v.shape[-1]),),
        "dtype": str(q.dtype),
        "tile dtype": str(be.xp.dtype(be.tile_dtype(q.dtype))),
        "device": "gpu" if be.name == "gpu" else "cpu",
    }
    view.update((f, getattr(spec, f)) for f in _FIELDS)
    return view


def _counts(views: list, size: int, spec, mask, what: str) -> dict:
    """Every rank's q and k/v token counts, checked against what the layout gives it."""
    u, layout = spec.head_parallel, spec.layout
    got = {}
    for key, name, total, cu in (
        ("s_local", "q", mask.nq, mask.cu_q),
        ("s_local_k", "k/v", mask.nk, mask.cu_k),
    ):
        expected = [int(c) for c in counts(total, size, layout, u, cu_seqlens=cu, mask=mask)]
        for r in range(size):
            if views[r][key] != expected[r]:
                how = f"layout={layout!r}" + (f", head_parallel={u}" if u > 1 else "")
                raise ValueError(
                    f"{what}: rank {r} holds {views[r][key]} {name} tokens, but {how} "
                    f"puts {expected[r]} of the n={total} tokens on it; cut the sequence "
                    f"with ringmpi.shard(x, comm, {how}) (and cu_seqlens=... if packed)"
                )
        got[key] = expected
    return got


def agree(
    comm: MPI.Comm,
    spec: AttentionSpec,
    arrays: dict,
    *,
    what: str = "ring_attention",
    check_finite: bool = False,
    decode=(),
) -> RingArgs:
    """Check the call on every rank together (one ``allgather``) and return what they agreed.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        The ranks of the call.
    spec : ringmpi.spec.AttentionSpec
        The options, validated here (a bad field raises on every rank).
    arrays : dict of arrays
        ``q`` (B?, S_local, H, Dk), ``k`` (B?, S_local_k, Hkv, Dk) and ``v``
        (B?, S_local_k, Hkv, Dv); for the backward also ``dout`` and ``out``
        (B?, S_local, H, Dv) and ``lse`` (B?, H, S_local).
    what : str
        The caller's name, the prefix of every error message.
    check_finite : bool
        Also reject NaN or Inf in the arrays.
    decode : tuple of str
        Non-empty for decode: q is the same on every rank, any number of cached
        keys per rank, no layout and no mask; it names the score modifiers the
        caller applies (the others are refused).

    Returns
    -------
    RingArgs

    Raises
    ------
    ValueError
        The same message on every rank: the first rank's local problem, a field
        the ranks disagree on, or token counts the layout does not give.
    """
    q, v = arrays["q"], arrays["v"]
    shapes = getattr(q, "shape", None), getattr(v, "shape", None)
    widths = (shapes[0][-1], shapes[1][-1]) if all(s for s in shapes) else None
    be: Backend = select(q, widths)
    view = _view(comm, spec, arrays, be, check_finite, decode)
    views = agree_views(comm, view, what, _SAME + _FIELDS)
    first, size, rank = views[0], comm.Get_size(), comm.Get_rank()
    spec = AttentionSpec(**{f: first[f] for f in _FIELDS})
    u = spec.head_parallel
    nk = sum(m["s_local_k"] for m in views)
    n = first["s_local"] if decode else sum(m["s_local"] for m in views)
    try:
        mask = mask_of(spec, n, nk)
        if decode:
            cnt = {"s_local": [n] * size, "s_local_k": [m["s_local_k"] for m in views]}
        else:
            cnt = _counts(views, size, spec, mask, what)
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith(f"{what}: ") else f"{what}: {msg}") from None
    g0 = rank - rank % u
    per_ring = {
        key: [sum(c[g * u : (g + 1) * u]) for g in range(size // u)] for key, c in cnt.items()
    }
    return RingArgs(
        n=n,
        counts=per_ring["s_local"],
        layout=spec.layout,
        causal=spec.causal,
        scale=spec.scale_for(q.shape[-1]),
        batched=q.ndim == 4,
        in_dtype=q.dtype,
        tile_dtype=be.tile_dtype(q.dtype),
        acc_dtype=be.acc_dtype(q.dtype),
        nk=nk,
        counts_k=per_ring["s_local_k"],
        mask=mask,
        spec=spec,
        backend=be,
        members=cnt["s_local"][g0 : g0 + u],
        members_k=cnt["s_local_k"][g0 : g0 + u],
    )


def to_internal(xp, x, dtype):
    """(B?, S, H, D) -> (B, H, S, D), ``dtype``, C-contiguous."""
    x = x if x.ndim == 4 else x[None]
    return xp.ascontiguousarray(xp.moveaxis(x, -3, -2), dtype=dtype)


def report(stats: Optional[dict], t_start: float, **fields) -> None:
    """Fill the caller's ``stats`` dict (if any) with ``fields`` and total_s."""
    if stats is not None:
        stats.update(fields, total_s=time.perf_counter() - t_start)
