"""Score modifiers in one place: the registry, the tiles' parameter block, the numpy math.

A *score modifier* is an :class:`ringmpi.spec.AttentionSpec` field that changes
each scaled score ``x = scale * q.k`` before the mask (``softcap``,
``alibi_slopes``). Every tile (numpy, fused C, CUDA) receives all of them as one
parameter block, :class:`TileMods` (qpos: see ``Mask.alibi_positions``)::

    bits    int                 bit ``slot`` set: that modifier applies
    params  float64 (H, NMODS)  per query head, one value per slot
    qpos    int64 (Sq,) or None the rows' positions in key coordinates (for the
                                modifiers that use positions)

The C kernels read it as ``(mods, mparam, mpos)`` (kernels/cpu_simd_type.h), the
CUDA kernels as the same three arguments (kernels/attention_common.cuh), the
numpy tile, the dense reference and verify through :func:`apply`. The slots,
their order (applied in slot order) and the math are defined here and in those
two headers, nowhere else.

Adding a modifier: a spec field with ``_modifier`` metadata (ringmpi/spec.py),
one :class:`ScoreMod` entry below with its numpy math, the same slot's math in
the two kernel headers, tests. The plumbing between (keywords of the public
functions, CLI flags, agreement, tile arguments, the kernels' argument lists,
backend capabilities) is generic.

The tiles' keyword form (``softcap=c``, ``alibi=(slopes, qa)``, see
:mod:`ringmpi.tile`) is kept: :func:`pack` turns keywords into the block.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import numpy as np

__all__ = [
    "NMODS",
    "ScoreMod",
    "MODS",
    "TileMods",
    "pack",
    "of_spec",
    "tile_keywords",
    "apply",
    "names",
]

#: slots of the parameter block (RM_NMODS in kernels/cpu_simd_type.h and
#: kernels/attention_common.cuh must match: tests/test_scoremods.py reads both)
NMODS = 4


@dataclasses.dataclass(frozen=True)
class ScoreMod:
    """One score modifier: where its parameters sit and how numpy applies it.

    ``field``: the AttentionSpec field; ``keyword``: its tile keyword; ``slot``:
    its bit and column of the block (applied in slot order); ``scalar``: one
    number for every head (else one per query head); ``positive``: must be > 0;
    ``positions``: the tile keyword is ``(value, qa)`` and the math uses ``qa``
    and the key positions; ``numpy(s, p, dist) -> factor``:
    modify the scores ``s`` in place (``p``: the parameters broadcast over the
    heads of ``s``; ``dist``: a callable giving abs(qa_i - k_j) as int64 (n, nk)),
    return the derivative d s'/d s as an array, or None where it is 1.
    """

    field: str
    keyword: str
    slot: int
    scalar: bool
    positive: bool
    positions: bool
    numpy: Callable
    doc: str = ""

    def check(self, value, h: int) -> np.ndarray:
        """The per-head parameters (h,) float64 of a tile keyword's value; ValueError."""
        what = self.field.replace("_", " ")
        if self.scalar and isinstance(value, (float, int)) and not isinstance(value, bool):
            x = float(value)  # the usual scalar: no numpy round trip
            if math.isfinite(x) and (x > 0 or not self.positive):
                return np.full(h, x)
        a = np.asarray(value, dtype=np.float64)
        if self.scalar:
            if a.ndim != 0 or not np.isfinite(a) or (self.positive and not a > 0):
                need = "a finite number > 0" if self.positive else "a finite number"
                raise ValueError(f"{what} must be {need}, got {value!r}")
            return np.full(h, float(a))
        if a.shape != (h,) or not np.isfinite(a).all() or (self.positive and not (a > 0).all()):
            need = "finite numbers > 0" if self.positive else "finite numbers"
            raise ValueError(f"{what} must be {h} {need} (one per query head)")
        return np.ascontiguousarray(a)


def _softcap_np(s, cap, dist):
    """s -> cap tanh(s / cap) in the scores' dtype; the derivative 1 - tanh^2."""
    c = cap.astype(s.dtype)
    t = np.tanh(s / c)
    np.multiply(t, c, out=s)
    return 1 - t * t


def _alibi_np(s, slopes, dist):
    """s -= slope_h abs(qa_i - k_j): the product in float64, rounded once (as the C tiles)."""
    d = dist().astype(np.float64)
    heads = slopes.shape[:-2]
    tmp = np.empty(d.shape, s.dtype)
    flat = slopes.reshape(-1)
    lead = s.ndim - len(heads) - 2
    for idx, slope in zip(np.ndindex(*heads), flat):  # one (n, nk) product per head
        if slope != 0:
            np.multiply(d, slope, out=tmp, casting="unsafe")
            s[(slice(None),) * lead + idx] -= tmp
    return None


MODS = (
    ScoreMod(
        "softcap",
        "softcap",
        0,
        scalar=True,
        positive=True,
        positions=False,
        numpy=_softcap_np,
        doc="s = softcap * tanh(s / softcap)",
    ),
    ScoreMod(
        "alibi_slopes",
        "alibi",
        1,
        scalar=False,
        positive=False,
        positions=True,
        numpy=_alibi_np,
        doc="s += -slopes[h] * abs(qa[i] - k_pos[j])",
    ),
)
_BY_KEYWORD = {m.keyword: m for m in MODS}
_BY_FIELD = {m.field: m for m in MODS}
assert len({m.slot for m in MODS}) == len(MODS) and max(m.slot for m in MODS) < NMODS


def names() -> tuple:
    """The spec fields that are tile score modifiers, in slot order."""
    return tuple(m.field for m in sorted(MODS, key=lambda m: m.slot))


def fields_of(bits: int) -> tuple:
    """The spec fields of the slots set in ``bits`` (what a kernel build reports it applies)."""
    return tuple(m.field for m in sorted(MODS, key=lambda m: m.slot) if bits >> m.slot & 1)


@dataclasses.dataclass(frozen=True)
class TileMods:
    """The parameter block of one tile call (module docstring); build it with :func:`pack`."""

    bits: int
    params: np.ndarray
    qpos: Optional[np.ndarray]

    def active(self) -> tuple:
        """The modifiers that apply, in slot order."""
        return tuple(m for m in sorted(MODS, key=lambda m: m.slot) if self.bits >> m.slot & 1)

    def keywords(self) -> dict:
        """The tile keywords that give this block back (``pack(mods.keywords(), ...)``)."""
        kw = {}
        for m in self.active():
            col = self.params[:, m.slot]
            v = float(col[0]) if m.scalar else col.copy()
            kw[m.keyword] = (v, self.qpos) if m.positions else v
        return kw


def pack(keywords: dict, h: int, sq: int) -> Optional[TileMods]:
    """The parameter block of the tile keywords ``keywords`` (None or no modifier: None).

    Parameters
    ----------
    keywords : dict
        Tile keyword -> value, as :mod:`ringmpi.tile` defines them (None values
        are dropped). An unknown keyword raises TypeError.
    h, sq : int
        The call's query heads and query rows.
    """
    if not keywords or all(v is None for v in keywords.values()):
        return None  # the common call: no modifier, nothing allocated
    bits, params, qpos = 0, np.zeros((h, NMODS), np.float64), None
    for key, value in keywords.items():
        if value is None:
            continue
        m = _BY_KEYWORD.get(key)
        if m is None:
            raise TypeError(
                f"unknown score modifier keyword {key!r} (known: {sorted(_BY_KEYWORD)})"
            )
        if m.positions:
            try:
                value, qa = value
            except (TypeError, ValueError):
                raise ValueError(f"{key} must be a pair (values (H,), qa (Sq,))") from None
            qa = np.asarray(qa)
            if qa.shape != (sq,) or not np.issubdtype(qa.dtype, np.integer):
                raise ValueError(f"{key} positions must be an integer array of shape ({sq},)")
            qa = np.ascontiguousarray(qa, dtype=np.int64)
            if qpos is not None and not np.array_equal(qpos, qa):
                raise ValueError("every position modifier of a call needs the same positions")
            qpos = qa
        params[:, m.slot] = m.check(value, h)
        bits |= 1 << m.slot
    return TileMods(bits, params, qpos) if bits else None


def of_spec(spec, h: int, heads=slice(None)) -> Optional[TileMods]:
    """The block of ``spec``'s modifiers for the query heads ``heads`` (``qpos`` None).

    Position modifiers get their rows' positions from the caller of :func:`apply`.

    Parameters
    ----------
    spec : AttentionSpec or dict
        The modifiers' values by spec field name (a dict may hold only some; a
        name that is no tile score modifier raises TypeError).
    h : int
        Query heads in all (per-head values must hold h numbers).
    heads : slice
        The heads the block is for (rows of ``params``, in order).
    """
    if isinstance(spec, dict):
        unknown = sorted(set(spec) - set(_BY_FIELD))
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
        fields = spec
    else:
        fields = {m.field: getattr(spec, m.field) for m in MODS}
    n = len(range(h)[heads])
    bits, params = 0, np.zeros((n, NMODS), np.float64)
    for m in MODS:
        value = fields.get(m.field)
        if value is not None:
            params[:, m.slot] = m.check(value, h)[heads]
            bits |= 1 << m.slot
    return TileMods(bits, params, None) if bits else None


def tile_keywords(spec, heads, qa: Callable) -> dict:
    """The tile keywords of ``spec``'s modifiers in use (an empty dict when none).

    ``heads``: the slice of query heads the tiles run; ``qa()``: the rows'
    positions in key coordinates (only called when a position modifier is set).
    """
    kw: dict = {}
    for m in MODS:
        value = getattr(spec, m.field)
        if value is None:
            continue
        a = np.asarray(value, dtype=np.float64)
        v = float(a) if a.ndim == 0 else np.ascontiguousarray(a[heads])
        kw[m.keyword] = (v, qa()) if m.positions else v
    return kw


def apply(s: np.ndarray, mods: Optional[TileMods], rows_qa, k_pos, head_shape: tuple, xp=np):
    """Apply ``mods`` to the scores ``s`` in place; the derivative factor or None.

    Parameters
    ----------
    s : float array (..., heads..., n, nk)
        Scaled scores of ``prod(head_shape)`` query heads (in head order), in
        their own dtype (the arithmetic is done in it; ALiBi's product in float64).
    mods : TileMods or None
        params rows for exactly those heads.
    rows_qa : int array (n,) or None
        The rows' positions in key coordinates (None: ``mods.qpos`` as is).
    k_pos : int array (nk,)
        The keys' positions.
    head_shape : tuple
        How the heads axis is laid out in ``s`` (e.g. (Hkv, G) or (H,) or ()).
    xp : module
        ``s``'s array module (CuPy for decode on a GPU: the modifiers without
        positions use numpy's ufuncs, which CuPy arrays take).

    Returns the product of the modifiers' derivatives d s'/d s (broadcastable to
    ``s``), or None where it is 1 everywhere.
    """
    if mods is None or not mods.bits:
        return None
    qa = mods.qpos if rows_qa is None else rows_qa
    cache: list = []

    def dist():
        if not cache:
            cache.append(np.abs(np.asarray(qa, np.int64)[:, None] - np.asarray(k_pos)[None, :]))
        return cache[0]

    factor = None
    for m in mods.active():
        p = mods.params[:, m.slot].reshape(tuple(head_shape) + (1, 1))
        if xp is not np:  # CuPy scores (decode): the parameters on the device
            p = xp.asarray(p)
        f = m.numpy(s, p, dist)
        if f is not None:
            factor = f if factor is None else factor * f
    return factor
