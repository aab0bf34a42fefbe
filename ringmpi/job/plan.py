"""What a batch job computes: its sequences (:class:`Plan`, :class:`SeqInfo`) and its error.

The plan is built by :mod:`ringmpi.job.input.scan` on rank 0 and broadcast; every part of the
job (reading, batching, writing, verifying) works from it. :class:`InputError` is the one
error a bad input or option gives: the same line on every rank, exit status 2.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..collective import CollectiveError
from ..slices import Slices

__all__ = [
    "InputError",
    "fail",
    "SeqInfo",
    "Plan",
    "value_width",
    "layout_mask",
    "digest",
    "sliced",
]


class InputError(CollectiveError):
    """A problem with the input or output files, phrased as one line naming the file."""


def fail(path: str, problem: str):
    """Raise InputError "PATH: PROBLEM"."""
    raise InputError(f"{path}: {problem}")


@dataclass
class SeqInfo:
    """One sequence of the input.

    Attributes
    ----------
    name : str
        Display name ("seq", "b=3" for a batch index, or the group name).
    group : str
        HDF5 group holding the datasets ("" for the root).
    batch : int or None
        Index along the leading batch axis, or None when the datasets are (S, ...).
    lengths : list of int
        Number of query tokens of this sequence in each input file, in file order.
    lengths_k : list of int, optional
        Number of key/value tokens in each file (cross-attention); None: ``lengths``.
    cu_seqlens, cu_seqlens_k : int64 array (n+1,), optional
        Offsets of packed sequences on the global query / key token axis.
    x_kv : bool
        Features inputs: keys and values are projected from ``x_kv``, not ``x``.
    storage : tuple of dict, optional
        Per file, {dataset name: file offset of its bytes, or None}: where a
        contiguous dataset in the machine's byte order lies, so that the reader
        can fetch it without HDF5 (:func:`ringmpi.job.input.files.raw_offset`); None for
        a batch axis.
    slices : ringmpi.slices.Slices, optional
        The sequence's whole mask as a union of slices, from its ``slices`` dataset
        (issue 41); None: the job's ``--causal``/``--window`` apply.
    """

    name: str
    group: str
    batch: Optional[int]
    lengths: list
    lengths_k: Optional[list] = None
    cu_seqlens: Optional[np.ndarray] = None
    cu_seqlens_k: Optional[np.ndarray] = None
    x_kv: bool = False
    storage: Optional[tuple] = None
    slices: Optional[Slices] = None

    @property
    def length(self) -> int:
        """Total number of query tokens S (S_q)."""
        return int(sum(self.lengths))

    @property
    def length_k(self) -> int:
        """Total number of key/value tokens S_k (S unless cross-attention)."""
        return int(sum(self.lengths if self.lengths_k is None else self.lengths_k))

    @property
    def offsets(self) -> np.ndarray:
        """Global index of the first query token held by each file, shape (n_files,)."""
        return np.concatenate(([0], np.cumsum(self.lengths)[:-1])).astype(np.int64)

    @property
    def offsets_k(self) -> np.ndarray:
        """Global index of the first key/value token held by each file, shape (n_files,)."""
        lk = self.lengths if self.lengths_k is None else self.lengths_k
        return np.concatenate(([0], np.cumsum(lk)[:-1])).astype(np.int64)

    @property
    def cross(self) -> bool:
        """Whether q and k/v have different lengths."""
        return self.length != self.length_k

    @property
    def packed(self) -> bool:
        """Whether the sequence holds packed sequences (``cu_seqlens``)."""
        return self.cu_seqlens is not None


@dataclass
class Plan:
    """Everything the ranks need to know about the input, built by :func:`scan`."""

    files: list
    mode: str  # "qkv" or "features"
    structure: str  # "single", "batch" or "groups"
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    sequences: list = field(default_factory=list)
    features: int = 0
    weights: Optional[str] = None
    warnings: list = field(default_factory=list)  # one line each, printed by the job
    sinks: Optional[tuple] = None  # per-head sink logits (H,) from the weights file
    # per file: the (device, inode), (size, mtime, ctime) whose every link the ranks walked
    # together, or None (ringmpi.job.input.files.links_known)
    walked: list = field(default_factory=list)
    # the value width Dv (v and out; multi-head latent attention: it may differ from the
    # key width head_dim); 0 means head_dim
    value_dim: int = 0

    @property
    def dv(self) -> int:
        """The value width: ``value_dim``, or ``head_dim`` where not set."""
        return value_width(self)

    @property
    def batch_size(self) -> int:
        """Length of the batch axis (0 unless structure == "batch")."""
        return len(self.sequences) if self.structure == "batch" else 0


def value_width(plan) -> int:
    """The value width Dv of a plan (or of a stand-in with heads, head_dim, ...): its
    ``value_dim``, or ``head_dim`` where that is not set (keys and values of one width)."""
    return getattr(plan, "value_dim", 0) or plan.head_dim


def digest(cu) -> tuple:
    """(entries, SHA-256 hex) of an int64 offsets array (n+1,), or of a Slices' (n, 5) table
    (the plan's broadcast, :mod:`ringmpi.job.input.scan`; the resume fingerprint)."""
    if isinstance(cu, Slices):
        cu = cu.table()
    a = np.ascontiguousarray(cu, dtype=np.int64)
    return len(a), hashlib.sha256(a.tobytes()).hexdigest()


def sliced(unit) -> Optional[Slices]:
    """The mask of slices of a sequence or batch, or None (also for stand-ins without one)."""
    return getattr(unit, "slices", None)


def layout_mask(unit, layout: str):
    """The mask layout ``balanced`` deals the tokens of ``unit`` by; None for the other layouts.

    ``unit``: a :class:`SeqInfo` or a batch (anything with ``length``, ``length_k`` and
    ``slices``). The job takes ``balanced`` only for sequences with a mask of slices
    (:func:`ringmpi.job.options.check_masks`); their batches hold them alone.
    """
    from ..layout import MASK_LAYOUTS

    if layout not in MASK_LAYOUTS or sliced(unit) is None:
        return None
    from ..mask import mask_of
    from ..spec import AttentionSpec

    return mask_of(AttentionSpec(slices=unit.slices), unit.length, unit.length_k)
