"""Masks beyond causal, as functions of global positions: windows, packed sequences, cross.

Every mask ringmpi supports gives each query a contiguous range of visible keys,
so a mask is fully described by two int64 arrays over the queries,

    lo[i] <= key position j <= hi[i]   (global key positions; lo > hi: no visible key)

which the tiles test per element and per block (a block pair outside every
range is skipped, not computed). For query i of packed sequence s (offsets
cu_q / cu_k; one sequence when not packed) with local index iq, lengths Lq and
Lk, and the bottom-right diagonal iq + Lk - Lq (FlashAttention's alignment for
cross-attention; iq itself when Lq = Lk):

    keys of sequence s only:   cu_k[s] <= j < cu_k[s + 1]
    causal:                    j - cu_k[s] <= iq + Lk - Lq
    window (left, right):      iq + Lk - Lq - left <= j - cu_k[s] <= iq + Lk - Lq + right

with -1 meaning unbounded on that side; under ``causal`` the right bound is 0.

A union of slices (:class:`ringmpi.slices.Slices`, issue 41) may give a query
several disjoint ranges. Such a mask is cut into layers, layer t holding the
t-th range of every query (:meth:`Mask.layers`); the loops run the same
single-range tiles once per layer that sees the block, all folding into one
online-softmax state (the layers of a row are disjoint key sets, so the state
is exactly that of their union), and the backward sums the layers' gradients,
every one computed with the row's global lse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

from . import cost, scoremods
from .layout import check_cu_seqlens, positions
from .slices import Slices
from .spec import AttentionSpec

__all__ = [
    "mask_of",
    "Mask",
    "Layer",
    "make_mask",
    "StepPlan",
    "plan_steps",
    "tile_modifiers",
]


class Layer(NamedTuple):
    """One layer of a mask of slices: the tiles' ``bounds`` (lo, hi), tagged as such.

    A plain pair to every tile (``lo, hi = bounds``). Unlike the single-range
    masks, whose ranges move with the query position (so rows close in position
    see nearly the same keys and blocks of rows have tight bounds), a layer's
    ranges may differ from row to row in any way: the numpy tile groups the rows
    by their range instead of by position for it, so that the work it scores
    follows the visible pairs (issue 41); other tiles may ignore the tag.

    Attributes
    ----------
    lo, hi : int64 arrays (Sq,)
        First and last visible key position of each query row (lo > hi: none).
    """

    lo: np.ndarray
    hi: np.ndarray


@dataclass(frozen=True)
class Mask:
    """Which keys each query sees; identical on every rank (built from agreed arguments)."""

    nq: int
    nk: int
    causal: bool
    window: Optional[tuple]
    cu_q: Optional[np.ndarray]
    cu_k: Optional[np.ndarray]
    slices: Optional[Slices] = None  # the whole mask when set (no causal, window or offsets)

    @property
    def plain(self) -> bool:
        """True when the tiles' own ``causal`` flag says it all (self-attention, one sequence)."""
        return (
            self.window is None and self.cu_q is None and self.nq == self.nk and self.slices is None
        )

    def bounds(self, q_pos: np.ndarray) -> tuple:
        """(lo, hi): int64 arrays of the first and last visible key position of each query.

        Only for single-range masks; a union of slices has :meth:`layers` (ValueError here).
        """
        if self.slices is not None:
            raise ValueError("a mask of slices may give a query several key ranges: use layers()")
        q_pos = np.asarray(q_pos, dtype=np.int64)
        cu_q = self.cu_q if self.cu_q is not None else np.array([0, self.nq], dtype=np.int64)
        cu_k = self.cu_k if self.cu_k is not None else np.array([0, self.nk], dtype=np.int64)
        s = np.searchsorted(cu_q, q_pos, side="right") - 1
        iq = q_pos - cu_q[s]
        len_q = cu_q[s + 1] - cu_q[s]
        k0, len_k = cu_k[s], cu_k[s + 1] - cu_k[s]
        diag = iq + len_k - len_q
        lo = np.zeros_like(q_pos)
        hi = len_k - 1
        if self.causal:
            hi = np.minimum(hi, diag)
        if self.window is not None:
            left, right = self.window
            if left >= 0:
                lo = np.maximum(lo, diag - left)
            if right >= 0:
                hi = np.minimum(hi, diag + right)
        return k0 + lo, k0 + hi

    def layers(self, q_pos: np.ndarray) -> list:
        """[(lo, hi), ...]: the queries' visible keys as layers of one range per query.

        One layer, :meth:`bounds`, for the single-range masks; for slices, layer t
        holds the t-th of each query's sorted disjoint ranges (lo > hi where a
        query has fewer), :meth:`ringmpi.slices.Slices.row_intervals`; no layer
        when none of these queries sees a key. A mask of slices gives :class:`Layer`
        pairs (the tiles may group rows by range for them), the others a plain tuple.
        """
        if self.slices is None:
            return [self.bounds(q_pos)]
        lo, hi = self.slices.row_intervals(q_pos)
        return [Layer(a, b) for a, b in zip(lo, hi)]

    def alibi_positions(self, q_pos: np.ndarray) -> np.ndarray:
        """ALiBi query positions in key coordinates: int64 (Sq,) for the tiles' ``alibi``.

        qa = q_pos + Lk_s - Lq_s for the packed sequence s holding the query (its
        end aligned with the keys' end, as FlashAttention aligns cross-attention
        bottom-right); q_pos itself for self-attention. The tiles add
        ``-slope_h * abs(qa_i - k_pos_j)`` to the score.
        """
        q_pos = np.asarray(q_pos, dtype=np.int64)
        cu_q = self.cu_q if self.cu_q is not None else np.array([0, self.nq], dtype=np.int64)
        cu_k = self.cu_k if self.cu_k is not None else np.array([0, self.nk], dtype=np.int64)
        s = np.searchsorted(cu_q, q_pos, side="right") - 1
        return q_pos + (cu_k[s + 1] - cu_q[s + 1])

    @staticmethod
    def visible(lo: np.ndarray, hi: np.ndarray, ks: np.ndarray) -> bool:
        """Whether any query with bounds (lo, hi) sees any of the sorted key positions ``ks``."""
        if len(lo) == 0 or len(ks) == 0:
            return False
        n_in = np.searchsorted(ks, hi, side="right") - np.searchsorted(ks, lo, side="left")
        return bool((n_in > 0).any())


def mask_of(spec: AttentionSpec, nq: int, nk: int) -> Mask:
    """The :class:`Mask` of ``spec`` for ``nq`` queries and ``nk`` keys.

    Checks the spec and the offsets against the lengths (ValueError: they must end
    at nq / nk).
    """
    s = spec.validate()
    cu_q = cu_k = None
    if s.cu_seqlens is not None:
        cu_q = check_cu_seqlens(s.cu_seqlens, nq)
        cu_k = check_cu_seqlens(s.cu_seqlens_k or s.cu_seqlens, nk)
    if s.slices is not None:
        s.slices.check(nq, nk)
    return Mask(int(nq), int(nk), s.causal, s.window, cu_q, cu_k, s.slices)


def make_mask(nq: int, nk: int, causal: bool, window=None, cu_seqlens=None, cu_seqlens_k=None):
    """Validate the mask arguments (ValueError) and build the :class:`Mask`.

    Shorthand for ``mask_of(AttentionSpec(causal, window, cu_seqlens, cu_seqlens_k), nq, nk)``:
    the rules live in :mod:`ringmpi.spec`.
    """
    spec = AttentionSpec(
        causal=causal, window=window, cu_seqlens=cu_seqlens, cu_seqlens_k=cu_seqlens_k
    )
    return mask_of(spec, nq, nk)


@dataclass(frozen=True)
class StepPlan:
    """The ring steps a masked call needs, the same on every rank.

    Attributes
    ----------
    q_pos : int64 array
        This rank's query positions.
    bounds : (lo, hi) or None
        Visible key range per query (None: the tiles' ``causal`` flag says it all).
    nsteps : int
        Ring steps to run: after the last step any rank needs, no block moves.
    compute : list of bool
        Per step, whether this rank's queries see any key of the block it holds.
    layers : list of Layer, optional
        A mask of slices: this rank's layers (:meth:`Mask.layers`); ``bounds`` is None.
    layer_steps : list of list of int, optional
        A mask of slices: per step, the layers that see a key of the block.
    """

    q_pos: np.ndarray
    bounds: Optional[tuple]
    nsteps: int
    compute: list
    layers: Optional[list] = None
    layer_steps: Optional[list] = None

    def tile_at(self, tile, step: int):
        """The tile to call at ``step``: ``tile`` itself, or for a mask of slices a tile that
        calls ``tile`` once per layer seeing the block (``bounds=`` that layer's ranges, a
        :class:`Layer`; returns the summed flops). The layers' keys are disjoint per row:
        forward they fold into one online-softmax state, backward their gradients (each
        with the row's global lse) add up.
        """
        if self.layers is None:
            return tile
        layers = [self.layers[t] for t in self.layer_steps[step]]

        def run(*args, **kwargs):
            return sum(tile(*args, bounds=b, **kwargs) for b in layers)

        return run

    def pairs(self, step: int, k_pos: np.ndarray, causal: bool) -> int:
        """Visible (query, key) pairs of this rank's queries and the block of ``step``."""
        if self.layers is None:
            return cost.visible_pairs(self.q_pos, k_pos, causal, self.bounds)
        lay = [self.layers[t] for t in self.layer_steps[step]]
        return sum(cost.visible_pairs(self.q_pos, k_pos, False, b) for b in lay)


def plan_steps(mask: Mask, rank: int, size: int, layout: str) -> StepPlan:
    """Which ring steps are needed (any rank) and which this rank computes.

    At step s rank r holds the K/V block of rank (r - s) mod P. A masked call
    (window, packed sequences, cross-attention) checks every (rank, step) pair
    against the key positions, so a block nobody sees costs no tile, and when
    every later step is hidden from every rank (a window shorter than the
    distance to the next ranks' blocks), the ring stops early: fewer steps and
    fewer messages.
    """
    q_pos = positions(mask.nq, rank, size, layout, cu_seqlens=mask.cu_q, mask=mask)
    if mask.plain:
        return StepPlan(q_pos, None, size, [True] * size)
    k_all = [
        np.sort(positions(mask.nk, r, size, layout, cu_seqlens=mask.cu_k, mask=mask))
        for r in range(size)
    ]
    if mask.slices is not None:
        return _plan_layers(mask, rank, size, layout, q_pos, k_all)
    last, mine = 0, []
    for r in range(size):
        pos = (
            q_pos
            if r == rank
            else positions(mask.nq, r, size, layout, cu_seqlens=mask.cu_q, mask=mask)
        )
        lo, hi = mask.bounds(pos)
        need = [mask.visible(lo, hi, k_all[(r - s) % size]) for s in range(size)]
        if any(need):
            last = max(last, max(s for s, x in enumerate(need) if x))
        if r == rank:
            mine, bounds = need, (lo, hi)
    return StepPlan(q_pos, bounds, last + 1, mine[: last + 1])


def _plan_layers(mask: Mask, rank: int, size: int, layout: str, q_pos, k_all) -> StepPlan:
    """:func:`plan_steps` for a mask of slices: which layers see which steps' blocks."""
    last, mine, layers = 0, [], []
    for r in range(size):
        pos = q_pos if r == rank else positions(mask.nq, r, size, layout, mask=mask)
        lay = mask.layers(pos)
        need = [
            [t for t, (lo, hi) in enumerate(lay) if mask.visible(lo, hi, k_all[(r - s) % size])]
            for s in range(size)
        ]
        if any(need):
            last = max(last, max(s for s, x in enumerate(need) if x))
        if r == rank:
            mine, layers = need, lay
    mine = mine[: last + 1]
    return StepPlan(q_pos, None, last + 1, [bool(x) for x in mine], layers, mine)


def tile_modifiers(spec: AttentionSpec, mask: Mask, q_pos: np.ndarray, heads=slice(None)) -> dict:
    """The tiles' score-modifier keywords for this rank's queries (only those in use).

    Parameters
    ----------
    spec : ringmpi.spec.AttentionSpec
        The agreed spec (its score modifiers, :mod:`ringmpi.scoremods`).
    mask : Mask
        The call's mask (position modifiers are aligned per packed sequence).
    q_pos : int64 array (Sq,)
        This rank's global query positions.
    heads : slice
        The query heads this rank's tiles run (heads x ring: the member's share).

    Returns
    -------
    dict of tile keywords (e.g. ``softcap`` (float), ``alibi`` ((slopes float64
    (H_local,), qa int64 (Sq,)))), as :mod:`ringmpi.backend` defines them; empty
    without modifiers.
    """
    return scoremods.tile_keywords(spec, heads, lambda: mask.alibi_positions(q_pos))
