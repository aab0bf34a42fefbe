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
batches by cost (:func:`deal`), and move on together; one output, one marker per batch,
one summary (``ring_sizes``: tokens per ring size).
"""

from __future__ import annotations

import numpy as np

from ..cost import flops as model_flops
from .batch import BALANCE
from .budget import rank_bytes, seq_counts
from .report import visible_pairs

__all__ = ["assign_ring_sizes", "phases", "divisors", "deal"]

# The dealing's cost model (seconds; only the ratios matter, the same on every rank): a
# batch costs its model flops at the tile's rate, its bytes read and written (with the
# copies and the short-sequence overheads that grow with its tokens), a fixed cost per
# sequence and one per batch (its ring call, part file and marker); rank 0 also builds the
# output's virtual-dataset file, so its ring starts with that much work already dealt.
# Fitted to the batches of the 2,000-sequence benchmark (2-core AVX-512 machine, P = 2,
# rings of one, direct I/O; 15 batches, residuals within 0.06 s but for one of 0.15 s):
# 105-110 GFLOP/s and ~3.8 ms per 1,000 tokens (~0.8 GB/s of the 3 kB a token reads and
# writes); the index ~0.5 ms per sequence.
RATE = {"cpu": 100e9, "gpu": 20e12}  # flop/s
IO_BYTES_S = 0.8e9
SEQ_S = 3e-4
BATCH_S = 4e-3
INDEX_SEQ_S = 0.5e-3


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


def deal(plan, batches: list, rings: int, causal: bool, window=None, device: str = "cpu",
         head_start: int = 0) -> list:  # fmt: skip
    """Batches per ring: the dearest first, each to the ring with the least work dealt so far.

    Longest-processing-time-first list scheduling: the rings' predicted times end
    within the cheapest batch dealt last of each other (dealing in the phase's order
    could leave a dear batch for last and one ring computing it alone).

    Parameters
    ----------
    plan : ringmpi.job.schema.Plan
    batches : list of ringmpi.job.batch.Batch
        The phase's batches, in order.
    rings : int
        Rings sharing them.
    causal, window :
        The mask (the batches' visible pairs).
    device : str
        ``cpu`` or ``gpu`` (the rate of the cost model).
    head_start : int
        Sequences whose virtual-dataset entries ring 0's first rank builds meanwhile
        (``INDEX_SEQ_S`` each, dealt to ring 0 before any batch).

    Returns
    -------
    list of lists of Batch, one per ring, each in the phase's order. Without a head
    start and with equal costs this is the round-robin.
    """
    per_flop = 1.0 / RATE.get(device, RATE["cpu"])
    row = plan.head_dim * np.dtype(plan.dtype).itemsize
    costs = []
    for b in batches:
        seqs = [plan.sequences[i] for i in b.members]
        flops = sum(model_flops(visible_pairs(s, causal, window), plan.head_dim, plan.heads)
                    for s in seqs)  # fmt: skip
        nbytes = (b.length * (2 * plan.heads) + b.length_k * 2 * plan.kv_heads) * row
        costs.append(flops * per_flop + nbytes / IO_BYTES_S + len(seqs) * SEQ_S + BATCH_S)
    load = [0.0] * rings
    load[0] = head_start * INDEX_SEQ_S
    mine: list = [[] for _ in range(rings)]
    for j in sorted(range(len(batches)), key=lambda j: (-costs[j], j)):
        r = min(range(rings), key=lambda x: (load[x], x))
        mine[r].append(j)
        load[r] += costs[j]
    return [[batches[j] for j in sorted(js)] for js in mine]
