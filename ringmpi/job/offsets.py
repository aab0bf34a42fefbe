"""Packed-sequence offsets stay out of the plan's broadcast: every rank reads them itself.

Rank 0 scans the inputs and broadcasts the :class:`ringmpi.job.schema.Plan` as a
pickle. A ``cu_seqlens`` may hold up to ``MAX_PACKED`` + 1 offsets per group, and an
input may have many groups: pickled into that one broadcast they would cost rank 0
a copy of all of them at once, and every rank the whole pickle before anything is
checked. Instead :func:`strip` replaces each offsets array by its length and
SHA-256; each other rank then reads the arrays from the first input itself, with
the same bounded slab reads and checks as rank 0 (:func:`ringmpi.job.inputs.read_offsets`),
and :func:`fill` refuses, on every rank alike, an array that differs from what rank 0
checked (the file changed while the job was planning).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace

import numpy as np

from . import inputs

__all__ = ["strip", "fill", "digest"]

NAMES = ("cu_seqlens", "cu_seqlens_k")


def digest(cu: np.ndarray) -> tuple:
    """(entries, SHA-256 hex) of an int64 offsets array, shape (n+1,)."""
    a = np.ascontiguousarray(cu, dtype=np.int64)
    return len(a), hashlib.sha256(a.tobytes()).hexdigest()


def strip(plan):
    """(plan without offsets arrays, {(sequence index, name): (entries, sha256)}).

    Parameters
    ----------
    plan : Plan
        As :func:`ringmpi.job.schema.scan` built it; left unchanged.
    """
    sums: dict = {}
    seqs = []
    for i, s in enumerate(plan.sequences):
        gone = {}
        for name in NAMES:
            cu = getattr(s, name)
            if cu is not None:
                sums[(i, name)] = digest(cu)
                gone[name] = None
        seqs.append(replace(s, **gone) if gone else s)
    return replace(plan, sequences=seqs), sums


def fill(plan, sums: dict):
    """The plan with its offsets arrays read from the first input and checked against ``sums``.

    Raises InputError naming the file when an array cannot be read, fails the
    checks, or differs from the one rank 0 checked.

    Parameters
    ----------
    plan : Plan
        A plan from :func:`strip` (offsets missing).
    sums : dict
        ``{(sequence index, name): (entries, sha256)}`` from :func:`strip`.
    """
    from .. import interrupt

    if not sums:
        return plan
    path = plan.files[0]
    f = inputs.open_input(path)
    try:
        fsize = os.path.getsize(path)
        seqs = list(plan.sequences)
        for (i, name), (n, sha) in sorted(sums.items()):
            interrupt.check()
            s = seqs[i]
            node = f[s.group] if s.group else f
            if name not in node:
                gone = "is gone (the file changed while the job was planning)"
                inputs.fail(path, f"'{name}' of sequence {s.name} {gone}")
            cu = inputs.read_offsets(path, node, name, fsize, n - 1)
            if digest(cu) != (n, sha):
                inputs.fail(
                    path,
                    f"'{name}' of sequence {s.name} differs from what rank 0 checked "
                    "(the file changed while the job was planning)",
                )
            seqs[i] = replace(s, **{name: cu})
        return replace(plan, sequences=seqs)
    finally:
        f.close()
