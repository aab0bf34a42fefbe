"""Masks of slices for the tests: an explicit-mask oracle, random unions, the builders' cases.

``dense_of`` writes the boolean mask of a list of slices straight from the
definition of each kind (ringmpi/slices.py's module docstring), element by
element over whole rows and columns, without :class:`ringmpi.slices.Slices`:
the ring and the normal form are both checked against it.
"""

from __future__ import annotations

import numpy as np

from ringmpi import slices as sl

KINDS = ("full", "causal", "inv_causal", "bi_causal")


def dense_of(slices, nq: int, nk: int) -> np.ndarray:
    """bool (nq, nk): query i sees key j iff some slice shows the pair (overlaps count once)."""
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    out = np.zeros((nq, nk), dtype=bool)
    for q0, q1, k0, k1, kind in slices:
        iq, jk, lq, lk = i - q0, j - k0, q1 - q0, k1 - k0
        seen = (q0 <= i) & (i < q1) & (k0 <= j) & (j < k1)
        if kind in ("causal", "bi_causal"):
            seen = seen & (jk <= iq + lk - lq)
        if kind in ("inv_causal", "bi_causal"):
            seen = seen & (jk >= iq)
        out |= seen
    return out


def random_slices(rng, nq: int, nk: int, count: int) -> list:
    """``count`` random slices inside nq x nk (overlapping, every kind, some thin or empty)."""
    out = []
    for _ in range(count):
        q0, q1 = np.sort(rng.integers(0, nq + 1, 2))
        k0, k1 = np.sort(rng.integers(0, nk + 1, 2))
        out.append((int(q0), int(q1), int(k0), int(k1), KINDS[int(rng.integers(4))]))
    return out


def builder_cases(n: int) -> list:
    """[(name, Slices, predicate (i, j) -> bool array)] for each builder at length n.

    The predicate is the builder's documented rule, written independently.
    """
    g, p = min(5, n), n // 3
    ans = [n // 5, 0, n // 4, n - p - n // 5 - n // 4]
    ends = np.cumsum([p, *ans])
    # shared_prefix: the answer holding position x (-1 in the prompt)
    seg = lambda x: np.searchsorted(ends, x, side="right") - 1  # noqa: E731
    rng = np.random.default_rng(n)
    nb = -(-n // 16)
    pattern = rng.random((nb, nb)) < 0.3
    blk = lambda i, j: pattern[i // 16, j // 16]  # noqa: E731
    return [
        ("prefix_lm", sl.prefix_lm(n, p), lambda i, j: (j < p) | (j <= i)),
        (
            "global_local",
            sl.global_local(n, (7, 3), g),
            lambda i, j: ((i - 7 <= j) & (j <= i + 3)) | (j < g) | (i < g),
        ),
        (
            "global_local causal",
            sl.global_local(n, 11, g, causal=True),
            lambda i, j: (((i - 11 <= j) & (j <= i)) | (j < g) | (i < g)) & (j <= i),
        ),
        (
            "shared_prefix",
            sl.shared_prefix(p, ans),
            lambda i, j: (j <= i) & ((j < p) | (seg(i) == seg(j))),
        ),
        ("block_sparse", sl.block_sparse(n, 16, pattern), blk),
        (
            "block_sparse causal",
            sl.block_sparse(n, 16, pattern, causal=True),
            lambda i, j: blk(i, j) & (j <= i),
        ),
    ]


def ring_cases(n: int) -> list:
    """(name, nq, nk, Slices, explicit bool mask) for the ring tests: each builder at
    length n, two random unions of n x n (overlapping, rows that see nothing) and a
    random cross-attention one (n // 2 queries, n + 31 keys)."""
    out = [(name, n, n, s, dense_of(s, n, n)) for name, s, _ in builder_cases(n)]
    for seed, (nq, nk, count) in enumerate(((n, n, 7), (n, n, 3), (n // 2, n + 31, 6))):
        raw = random_slices(np.random.default_rng(seed), nq, nk, count)
        out.append(
            (f"random {count} slices {nq}x{nk}", nq, nk, sl.Slices(raw), dense_of(raw, nq, nk))
        )
    return out
