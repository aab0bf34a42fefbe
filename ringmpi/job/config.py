"""How the batch job runs, as one value: :class:`JobOptions` (what it computes is the spec).

:func:`ringmpi.job.run.run` takes ``(inputs, output, spec, options)``: the
:class:`ringmpi.spec.AttentionSpec` says what attention is computed (mask, scale,
layout: the same object the library takes, recorded in the output and the
resume fingerprint), :class:`JobOptions` how the job gets there (device, rings,
files, memory, reading, RoPE of features inputs). :func:`split_keywords` keeps
the older keyword form ``run(inputs, output, causal=True, device="cpu", ...)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from ..spec import AttentionSpec
from .schema import InputError

__all__ = ["JobOptions", "split_keywords", "options_from_args"]


@dataclass(frozen=True)
class JobOptions:
    """The batch job's settings other than the attention itself.

    Attributes
    ----------
    device : {"auto", "cpu", "gpu"}
        auto: the GPU when CuPy sees one on every rank.
    weights : str or None
        Projection weights file for raw-feature inputs ``x``.
    resume, overwrite : bool
        Keep the sequences an earlier run finished; replace an existing output.
    quiet : bool
        No progress display (the summary is still returned).
    max_memory : int or None
        Per-rank memory budget in bytes (None: 80% of free memory per rank).
    strided : {"auto", "hyperslab", "blocks"}
        How the striped layout reads its tokens.
    prefetch : bool
        Read the next sequence while this one computes.
    compress : {"gzip", "lzf"} or None
        Compression of the part files.
    ring_size : int, "auto" or None
        Ranks per ring (None: one ring of all ranks).
    output_mode : {"auto", "parts", "single"}
        Per-rank part files + a virtual-dataset file, or one file written collectively.
    rope : bool ; rope_theta, rope_scale : float
        Rotary position embeddings on the projected q and k of features inputs.
    checkpoint_every : float
        Save the running ring state at most every this many seconds of a sequence
        (:mod:`ringmpi.job.checkpoint`); 0: never.
    alibi : bool ; alibi_slopes_file : str or None
        ALiBi with the standard slopes for the input's H heads, or with the H
        slopes of a .npy/text file (:mod:`ringmpi.job.modifiers`).
    """

    device: str = "auto"
    weights: Optional[str] = None
    resume: bool = False
    quiet: bool = False
    max_memory: Optional[int] = None
    strided: str = "auto"
    prefetch: bool = True
    overwrite: bool = False
    compress: Optional[str] = None
    ring_size: Any = None
    output_mode: str = "auto"
    rope: bool = False
    rope_theta: float = 10000.0
    rope_scale: float = 1.0
    checkpoint_every: float = 600.0
    alibi: bool = False
    alibi_slopes_file: Optional[str] = None


_JOB_FIELDS = dataclasses.fields(JobOptions)
_FLAG_OF = {"strided": "strided_read", "prefetch": "no_prefetch"}
_SPEC = {f.name for f in dataclasses.fields(AttentionSpec)}
_JOB = {f.name for f in dataclasses.fields(JobOptions)}
# per sequence, from the inputs; heads x ring is a library feature the job does not offer
_NOT_JOB = {"cu_seqlens", "cu_seqlens_k", "head_parallel"}


def split_keywords(
    spec: Optional[AttentionSpec], options: Optional[JobOptions], keywords: dict
) -> tuple:
    """``(spec, options)`` from explicit values and/or the keyword form of ``run``.

    A keyword names a field of either class; giving a field both in ``spec`` (or
    ``options``) and as a keyword is refused, like an unknown keyword (TypeError).
    """
    unknown = sorted(set(keywords) - (_SPEC | _JOB) | (set(keywords) & _NOT_JOB))
    if unknown:
        raise TypeError(f"run() got unexpected keyword argument(s): {', '.join(unknown)}")
    spec_kw = {k: v for k, v in keywords.items() if k in _SPEC}
    job_kw = {k: v for k, v in keywords.items() if k in _JOB}
    spec = AttentionSpec.of(spec, **spec_kw)
    if options is None:
        options = JobOptions(**job_kw)
    elif job_kw:
        raise TypeError(f"pass either options= or the keyword(s) {', '.join(job_kw)}, not both")
    elif not isinstance(options, JobOptions):
        raise TypeError(f"options must be a JobOptions, got {type(options).__name__}")
    try:
        spec = spec.validate()
    except ValueError as e:
        raise InputError(f"--{_flag_of(str(e))}: {e}") from None
    return spec, options


def _flag_of(message: str) -> str:
    """The spec field a validation message names, as the flag users typed (best effort)."""
    for name in sorted(_SPEC, key=len, reverse=True):
        if name in message:
            return name.replace("_", "-")
    return "spec"


def options_from_args(args) -> JobOptions:
    """The :class:`JobOptions` of parsed ``ringmpi run`` flags."""
    ring = args.ring_size
    if ring not in (None, "auto"):
        try:
            ring = int(ring)
        except ValueError:
            pass  # choose_ring_size words the error with the flag's name
    # the flags are the fields' names, but for these two
    names = {f.name: _FLAG_OF.get(f.name, f.name) for f in _JOB_FIELDS}
    kw = {k: getattr(args, flag) for k, flag in names.items() if hasattr(args, flag)}
    kw.update(prefetch=not args.no_prefetch, ring_size=ring)
    return JobOptions(**kw)
