"""Masks as a union of slices: :class:`Slices` and builders of common patterns (issue 41).

A slice is a rectangle of (query, key) positions with a diagonal rule,
``(q_start, q_end, k_start, k_end, kind)`` over the half-open ranges
[q_start, q_end) of global query positions and [k_start, k_end) of global key
positions. With iq = i - q_start and jk = j - k_start the local indices of
query i and key j, and Lq, Lk the slice's sides, query i sees key j iff

    full:        always
    causal:      jk <= iq + Lk - Lq      (the diagonal ends at the bottom-right corner)
    inv_causal:  jk >= iq                (the diagonal starts at the top-left corner)
    bi_causal:   iq <= jk <= iq + Lk - Lq  (both: a band Lk - Lq + 1 keys wide)

so every slice gives each of its rows one interval of keys (maybe empty: a
causal slice with Lk < Lq hides its first rows). A mask is the union of its
slices; overlapping slices count each pair once. The per-row normal form
(:meth:`Slices.row_intervals`) lists each row's visible keys as sorted,
disjoint, non-adjacent intervals; the ring loops run the single-interval tiles
once per "layer" (the k-th interval of every row), all folding into the same
online-softmax state (:mod:`ringmpi.mask`).

The masks of :mod:`ringmpi.mask` are special cases (causal is one causal
slice, a causal window one causal and one bi-causal slice) but keep their own
single-interval path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

__all__ = [
    "Slice",
    "Slices",
    "KINDS",
    "KIND_CODES",
    "global_local",
    "prefix_lm",
    "shared_prefix",
    "block_sparse",
]

#: the slice kinds, by their code in :meth:`Slices.table`
KINDS = ("full", "causal", "inv_causal", "bi_causal")
#: the codes in words, "0 full, 1 causal, 2 inv_causal, 3 bi_causal" (messages, attributes)
KIND_CODES = ", ".join(f"{i} {k}" for i, k in enumerate(KINDS))


class Slice(NamedTuple):
    """One slice: half-open query and key ranges of global positions and a kind of :data:`KINDS`."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    kind: str

    def bounds(self, q_pos: np.ndarray) -> tuple:
        """(lo, hi): int64 inclusive key interval of each query in ``q_pos`` (lo > hi: none)."""
        q_pos = np.asarray(q_pos, dtype=np.int64)
        lq, lk = self.q_end - self.q_start, self.k_end - self.k_start
        iq = q_pos - self.q_start
        lo = np.zeros_like(q_pos)
        hi = np.full_like(q_pos, lk - 1)
        if self.kind in ("causal", "bi_causal"):
            hi = np.minimum(hi, iq + lk - lq)
        if self.kind in ("inv_causal", "bi_causal"):
            lo = np.maximum(lo, iq)
        outside = (q_pos < self.q_start) | (q_pos >= self.q_end)
        lo = np.where(outside, 0, lo) + self.k_start
        hi = np.where(outside, -1, hi) + self.k_start
        return lo, hi


def _slice(x) -> Slice:
    """One slice from a 5-sequence (the kind as a name or a code); ValueError when malformed."""
    try:
        q0, q1, k0, k1, kind = x
    except (TypeError, ValueError):
        raise ValueError(f"a slice is (q_start, q_end, k_start, k_end, kind), got {x!r}") from None
    if isinstance(kind, (int, np.integer)) and not isinstance(kind, bool) and 0 <= kind < 4:
        kind = KINDS[int(kind)]
    if isinstance(kind, bytes):
        kind = kind.decode()
    if kind not in KINDS:
        raise ValueError(f"slice {tuple(x)!r}: kind must be one of {', '.join(KINDS)}")
    ends = []
    for v in (q0, q1, k0, k1):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"slice {tuple(x)!r}: positions must be integers")
        ends.append(int(v))
    q0, q1, k0, k1 = ends
    if not (0 <= q0 <= q1 and 0 <= k0 <= k1):
        raise ValueError(
            f"slice {tuple(x)!r}: needs 0 <= q_start <= q_end and 0 <= k_start <= k_end"
        )
    return Slice(q0, q1, k0, k1, str(kind))


@dataclass(frozen=True, init=False)
class Slices:
    """A mask as a union of slices, the same value on every rank (hashable, comparable).

    Parameters
    ----------
    slices : iterable of (q_start, q_end, k_start, k_end, kind)
        Half-open global query and key ranges and a kind of :data:`KINDS`
        ("full", "causal", "inv_causal", "bi_causal"; or its code 0..3). Stored
        sorted, with exact duplicates removed; a slice without rows or keys is
        kept but hides nothing and shows nothing.

    Raises
    ------
    ValueError
        A malformed slice (not five entries, non-integer or negative positions,
        an end before its start, an unknown kind).

    Examples
    --------
    Prefix-LM attention over 6 tokens with a prefix of 2: the prefix sees itself
    in full, the rest is causal::

        Slices([(0, 2, 0, 2, "full"), (2, 6, 0, 6, "causal")])
    """

    slices: tuple

    def __init__(self, slices=()):
        if isinstance(slices, Slices):
            items = slices.slices
        else:
            if isinstance(slices, np.ndarray):
                slices = slices.tolist()
            try:
                items = tuple(_slice(s) for s in slices)
            except TypeError:
                raise ValueError(
                    f"Slices takes an iterable of slices, got {type(slices).__name__}"
                ) from None
        object.__setattr__(self, "slices", tuple(sorted(set(items))))

    @classmethod
    def of(cls, x) -> Optional[Slices]:
        """``x`` as :class:`Slices` (from Slices, a list of 5-tuples or a (n, 5) table), or None."""
        return None if x is None else cls(x)

    def __len__(self) -> int:
        return len(self.slices)

    def __iter__(self):
        return iter(self.slices)

    def __repr__(self) -> str:
        return f"Slices({[tuple(s) for s in self]!r})"

    @property
    def extent(self) -> tuple:
        """(queries, keys) the slices need at least: the largest q_end and k_end (0 if none)."""
        return (max((s.q_end for s in self), default=0), max((s.k_end for s in self), default=0))

    def check(self, nq: int, nk: int) -> Slices:
        """``self``, or ValueError when a slice reaches beyond ``nq`` queries or ``nk`` keys."""
        for s in self:
            if s.q_end > nq or s.k_end > nk:
                raise ValueError(
                    f"slices: slice {tuple(s)!r} reaches beyond the {nq} queries x {nk} keys"
                )
        return self

    def table(self) -> np.ndarray:
        """The slices as an int64 (n, 5) table, the kind as its code in :data:`KINDS`."""
        rows = [(s.q_start, s.q_end, s.k_start, s.k_end, KINDS.index(s.kind)) for s in self]
        return np.array(rows, dtype=np.int64).reshape(-1, 5)

    def row_intervals(self, q_pos) -> tuple:
        """The normal form: each query's visible keys as sorted disjoint intervals.

        Parameters
        ----------
        q_pos : int array (n,)
            Global query positions (any order).

        Returns
        -------
        lo, hi : int64 arrays (L, n)
            Interval t of query r is lo[t, r] <= j <= hi[t, r], inclusive; for each
            row the intervals are sorted, disjoint and not adjacent (overlapping or
            touching slices merged), the row's first intervals first, and rows with
            fewer than L intervals padded with empty ones (lo = 0, hi = -1). L is the
            most intervals any of these rows has (0 when none sees a key).
        """
        q_pos = np.asarray(q_pos, dtype=np.int64).reshape(-1)
        n = len(q_pos)
        t = self.table()
        t = t[(t[:, 0] < t[:, 1]) & (t[:, 2] < t[:, 3])]
        none = np.zeros((0, n), np.int64)
        if n == 0 or len(t) == 0:
            return none, none.copy()
        # one entry per (slice, covered row): work O(entries), no loop over slices
        order = np.argsort(q_pos, kind="stable")
        sq = q_pos[order]
        first = np.searchsorted(sq, t[:, 0])
        cnt = np.searchsorted(sq, t[:, 1]) - first
        sid = np.repeat(np.arange(len(t)), cnt)
        at = np.arange(int(cnt.sum())) + np.repeat(first - np.cumsum(cnt) + cnt, cnt)
        row, pos = order[at], sq[at]
        q0, q1, k0, k1, kind = t[sid].T
        iq, lq, lk = pos - q0, q1 - q0, k1 - k0
        lo = np.where((kind == 2) | (kind == 3), iq, 0)  # inv_causal, bi_causal
        hi = np.where((kind == 1) | (kind == 3), np.minimum(lk - 1, iq + lk - lq), lk - 1)
        keep = np.maximum(lo, 0) <= hi
        row, lo, hi = row[keep], np.maximum(lo, 0)[keep] + k0[keep], hi[keep] + k0[keep]
        if len(row) == 0:
            return none, none.copy()
        o = np.lexsort((lo, row))  # by row, then by start
        row, lo, hi = row[o], lo[o], hi[o]
        # the running end of each row's intervals (a max that restarts at each row), and a
        # new interval wherever the next start lies beyond it + 1 (overlapping or touching
        # intervals merge)
        span = int(hi.max()) + 2
        reach = np.maximum.accumulate(hi + row * span) - row * span
        start = np.ones(len(row), bool)
        start[1:] = (row[1:] != row[:-1]) | (lo[1:] > reach[:-1] + 1)
        at = np.flatnonzero(start)
        g_row, g_lo = row[at], lo[at]
        g_hi = reach[np.append(at[1:] - 1, len(row) - 1)]
        # layer: the interval's rank within its row
        k = np.arange(len(g_row))
        new_row = np.ones(len(g_row), bool)
        new_row[1:] = g_row[1:] != g_row[:-1]
        layer = k - np.maximum.accumulate(np.where(new_row, k, 0))
        depth = int(layer.max()) + 1
        out_lo = np.zeros((depth, n), np.int64)
        out_hi = np.full((depth, n), -1, np.int64)
        out_lo[layer, g_row] = g_lo
        out_hi[layer, g_row] = g_hi
        return out_lo, out_hi

    def to_dense(self, nq: int, nk: int) -> np.ndarray:
        """The explicit mask: a bool (nq, nk) array, True where query i sees key j."""
        self.check(nq, nk)
        dense = np.zeros((nq, nk), dtype=bool)
        j = np.arange(nk)
        for s in self:
            rows = np.arange(s.q_start, s.q_end)
            lo, hi = s.bounds(rows)
            dense[s.q_start : s.q_end] |= (lo[:, None] <= j) & (j <= hi[:, None])
        return dense

    def to_svg(
        self,
        nq: Optional[int] = None,
        nk: Optional[int] = None,
        *,
        cell: int = 4,
        outline: bool = True,
        title: Optional[str] = None,
    ) -> str:
        """The mask as an SVG picture: a square per visible (query, key) pair.

        Queries run down, keys across, position 0 at the top left. Drawn from the
        normal form (:meth:`row_intervals`: one rectangle per interval of a row), so
        the picture is the mask the ring computes, overlaps counted once. Keep it
        small (a few hundred positions).

        Parameters
        ----------
        nq, nk : int, optional
            Queries and keys drawn (default: :attr:`extent`).
        cell : int
            Side of one pair's square in pixels.
        outline : bool
            Draw each slice's rectangle as a dashed outline.
        title : str, optional
            The picture's title (tooltip and accessible name); default the repr.

        Returns
        -------
        str
            A standalone SVG document (the same text for the same arguments).
        """
        ext_q, ext_k = self.extent
        nq = ext_q if nq is None else int(nq)
        nk = ext_k if nk is None else int(nk)
        self.check(nq, nk)
        cell = int(cell)
        if cell < 1:
            raise ValueError(f"cell must be a positive number of pixels, got {cell}")
        pad = 1  # room for the frame's stroke
        w, h = nk * cell + 2 * pad, nq * cell + 2 * pad
        text = repr(self) if title is None else str(title)
        esc = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        esc = esc.replace('"', "&quot;")
        out = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
            f'viewBox="0 0 {w} {h}" role="img" aria-label="{esc}">',
            f"<title>{esc}</title>",
            f'<rect x="{pad}" y="{pad}" width="{nk * cell}" height="{nq * cell}" '
            'fill="#f2f2f2" stroke="#888" stroke-width="1"/>',
            '<g fill="#24528a">',
        ]
        lo, hi = self.row_intervals(np.arange(nq))
        for t, r in zip(*np.nonzero(hi >= lo)):
            x0, x1 = int(lo[t, r]), int(hi[t, r]) + 1
            out.append(
                f'<rect x="{pad + x0 * cell}" y="{pad + int(r) * cell}" '
                f'width="{(x1 - x0) * cell}" height="{cell}"/>'
            )
        out.append("</g>")
        if outline:
            out.append('<g fill="none" stroke="#d9822b" stroke-width="1" stroke-dasharray="3 2">')
            for s in self:
                if s.q_start < s.q_end and s.k_start < s.k_end:
                    out.append(
                        f'<rect x="{pad + s.k_start * cell}" y="{pad + s.q_start * cell}" '
                        f'width="{(s.k_end - s.k_start) * cell}" '
                        f'height="{(s.q_end - s.q_start) * cell}"/>'
                    )
            out.append("</g>")
        out.append("</svg>")
        return "\n".join(out) + "\n"

    def pairs(self, nq: Optional[int] = None, block: int = 1 << 16) -> int:
        """Visible (query, key) pairs of the union, each counted once.

        ``nq``: the queries to count over (default: :attr:`extent`); memory
        O(len(self) x ``block``).
        """
        nq = self.extent[0] if nq is None else int(nq)
        total = 0
        for a in range(0, nq, block):
            lo, hi = self.row_intervals(np.arange(a, min(nq, a + block), dtype=np.int64))
            total += int(np.maximum(hi - lo + 1, 0).sum())
        return total


# ----------------------------------------------------------------------
# Builders. Each returns the Slices of an n x n self-attention pattern.


def _count(name: str, x, low: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {x!r}")
    return int(x)


def _band(q0: int, q1: int, a: int, b: int, nk: int) -> list:
    """Slices of rows [q0, q1) seeing keys [i + a, i + b] clipped to [0, nk) (a <= b)."""
    x, y = -a, nk - 1 - b  # rows i <= x start at key 0; rows i >= y end at key nk - 1
    parts = (
        ("full", max(q0, y), min(q1, x + 1), lambda r0, r1: (0, nk)),
        ("causal", max(q0, -b), min(q1, x + 1, y), lambda r0, r1: (0, r1 + b)),
        ("inv_causal", max(q0, y, x + 1), min(q1, nk - a), lambda r0, r1: (r0 + a, nk)),
        ("bi_causal", max(q0, x + 1), min(q1, y), lambda r0, r1: (r0 + a, r1 + b)),
    )
    return [(r0, r1, *keys(r0, r1), kind) for kind, r0, r1, keys in parts if r0 < r1]


def global_local(n: int, window, global_tokens: int = 0, causal: bool = False) -> Slices:
    """Sliding-window attention plus global tokens (Longformer, BigBird, StreamingLLM sinks).

    Query i sees key j iff i - left <= j <= i + right (the window), or j <
    ``global_tokens`` (every query sees the global tokens), or i < ``global_tokens``
    (the global tokens see every key); with ``causal`` only keys j <= i of those.

    Parameters
    ----------
    n : int
        Tokens.
    window : int or (left, right)
        Window sizes; one int w means (w, w); -1 is unbounded on that side; under
        ``causal`` right is 0.
    global_tokens : int
        The first tokens that attend and are attended globally (0 <= g <= n).
    causal : bool
    """
    n, g = _count("n", n), _count("global_tokens", global_tokens)
    if g > n:
        raise ValueError(f"global_tokens={g} is more than the n={n} tokens")
    try:
        left, right = (window, window) if np.ndim(window) == 0 else tuple(window)
        left, right = _count("window left", left, -1), _count("window right", right, -1)
    except (TypeError, ValueError):
        raise ValueError(
            f"window must be w or (left, right), integers >= -1, got {window!r}"
        ) from None
    left = n if left == -1 else left
    right = 0 if causal else (n if right == -1 else right)
    out = _band(0, n, -left, right, n)
    if causal:
        out += [(0, g, 0, g, "causal"), (g, n, 0, g, "full")]
    else:
        out += [(0, n, 0, g, "full"), (0, g, 0, n, "full")]
    return Slices(out)


def prefix_lm(n: int, prefix: int) -> Slices:
    """Prefix-LM (T5, UniLM): the first ``prefix`` tokens see each other in full, the rest causal.

    Query i sees key j iff j < prefix or j <= i.
    """
    n, p = _count("n", n), _count("prefix", prefix)
    if p > n:
        raise ValueError(f"prefix={p} is more than the n={n} tokens")
    return Slices([(0, p, 0, p, "full"), (p, n, 0, n, "causal")])


def shared_prefix(prompt_len: int, answer_lens) -> Slices:
    """One prompt and several answers packed after it, each answer seeing the prompt.

    The sequence is the prompt (``prompt_len`` tokens, causal) then the answers
    in order; an answer's token sees the whole prompt and, causally, its own
    answer, never another answer (several samples of one prompt in one pass).
    The sequence holds prompt_len + sum(answer_lens) tokens.
    """
    p = _count("prompt_len", prompt_len)
    try:
        lens = [_count("an answer length", a) for a in answer_lens]
    except TypeError:
        raise ValueError(f"answer_lens must be a list of lengths, got {answer_lens!r}") from None
    out, o = [(0, p, 0, p, "causal")], p
    for a in lens:
        out += [(o, o + a, 0, p, "full"), (o, o + a, o, o + a, "causal")]
        o += a
    return Slices(out)


def block_sparse(
    n: int, block: int, pattern=None, *, density: float = 0.25, seed=None, causal: bool = False
) -> Slices:
    """Block-sparse attention: query block a sees key block b where ``pattern[a, b]``.

    Parameters
    ----------
    n : int
        Tokens; the last block may be shorter than ``block``.
    block : int
        Block size (>= 1); there are nb = ceil(n / block) blocks.
    pattern : bool array (nb, nb), optional
        Which block pairs are visible. Default: random, each pair visible with
        probability ``density`` (``numpy.random.default_rng(seed)``), the diagonal
        always.
    density : float
        In [0, 1]; only without ``pattern``.
    seed : int, optional
        Only without ``pattern``.
    causal : bool
        Keep only keys j <= i: blocks above the diagonal are dropped and the
        diagonal blocks are causal.

    Runs of visible blocks in one block row become one slice.
    """
    n, block = _count("n", n), _count("block", block, 1)
    nb = -(-n // block)
    if pattern is None:
        if not 0.0 <= float(density) <= 1.0:
            raise ValueError(f"density must be in [0, 1], got {density!r}")
        pat = np.random.default_rng(seed).random((nb, nb)) < float(density)
        np.fill_diagonal(pat, True)
    else:
        pat = np.asarray(pattern)
        if pat.shape != (nb, nb) or pat.dtype.kind not in "biu":
            raise ValueError(
                f"pattern must be a bool ({nb}, {nb}) array for n={n}, block={block}, "
                f"got {pat.dtype} {pat.shape}"
            )
        pat = pat.astype(bool)
    if causal:
        pat = np.tril(pat, -1)  # the diagonal blocks come back as causal slices below
    out = []
    for a in range(nb):
        q0, q1 = a * block, min(n, (a + 1) * block)
        cols = np.flatnonzero(pat[a])
        for run in np.split(cols, np.flatnonzero(np.diff(cols) > 1) + 1) if len(cols) else ():
            out.append((q0, q1, int(run[0]) * block, min(n, (int(run[-1]) + 1) * block), "full"))
        if causal and (pattern is None or np.asarray(pattern)[a, a]):
            out.append((q0, q1, q0, q1, "causal"))
    return Slices(out)
