"""Ring size per sequence under ``--ring-size auto``: one rank for short work, more for long.

A dataset of many sequences is data-parallel work: a ring of one rank per
sequence has no exchange at all, and many rings share the sequences. A
sequence whose compute alone would hold one rank for a good part of the
job's time is the opposite: the rings of one would wait for it at the end
(and its memory may need more ranks), so it gets a larger ring. The rule,
from the plan alone (the same on every run, so ``--resume`` finds the same
assignment):

* work of a sequence ``w`` = its model flops (visible pairs of the mask);
  one rank's fair share of the job ``W / P``;
* a sequence takes the smallest ring size R (a divisor of P) with
  ``w / R <= W / (P x BALANCE)`` (no call holds its ring longer than a
  ``1/BALANCE`` share of one rank's time), whose per-rank memory fits the
  budget and whose every rank gets tokens (R <= the sequence's length);
  else the largest ring that the sequence's length allows.

The job then runs one *phase* per ring size, the largest first
(:func:`phases`): the ranks form rings of that size, deal that phase's
batches round-robin, and move on together; one output, one marker per batch,
one summary (``ring_sizes``: tokens per ring size).
"""

from __future__ import annotations

from .batch import BALANCE
from .budget import rank_bytes, seq_counts
from .report import visible_pairs

__all__ = ["assign_ring_sizes", "phases", "divisors"]


def divisors(n: int) -> list:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def assign_ring_sizes(plan, size: int, layout: str, causal: bool, budget: int,
                      window=None) -> list:  # fmt: skip
    """Ranks per ring for every sequence of ``plan`` (a list, in plan order), as the module says.

    Parameters
    ----------
    plan : ringmpi.job.schema.Plan
    size : int
        Ranks of the job P.
    layout : str
        Token layout (sizes the per-rank memory).
    causal : bool
    budget : int
        Per-rank memory budget (bytes).
    window : (left, right), optional
        Sliding window (fewer visible pairs).
    """
    seqs = plan.sequences
    work = [float(visible_pairs(s, causal, window)) for s in seqs]
    limit = sum(work) / (size * BALANCE)
    many = len(seqs) > 1
    out = []
    for s, w in zip(seqs, work):
        shortest = min(s.length, s.length_k)
        pick = None
        for r in divisors(size):
            if r > 1 and r > shortest:
                break
            n, nk = seq_counts(s, r, layout)
            fits = rank_bytes(plan, n, prefetch=many, n_local_k=nk, ranks=r) <= budget
            if fits and w / r <= limit:
                pick = r
                break
        if pick is None:  # the largest ring the sequence can feed (memory is checked later)
            pick = max(r for r in divisors(size) if r == 1 or r <= shortest)
        out.append(pick)
    return out


def phases(sizes: list) -> list:
    """[(ring size, plan indices in order), ...], the largest ring size first."""
    by: dict = {}
    for i, r in enumerate(sizes):
        by.setdefault(int(r), []).append(i)
    return [(r, by[r]) for r in sorted(by, reverse=True)]
