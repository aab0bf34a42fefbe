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
import io
import math
import os
import stat
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..collective import run_on_root
from ..spec import AttentionSpec, modifier_fields
from .input import files as trust
from .plan import InputError, sliced

__all__ = [
    "JobOptions",
    "split_keywords",
    "options_from_args",
    "alibi_slopes",
    "read_slopes",
    "resolve",
    "check_tiles",
    "check_masks",
    "MAX_SLOPES_BYTES",
]


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
        (:mod:`ringmpi.job.output.checkpoint`); 0: never.
    alibi : bool ; alibi_slopes_file : str or None
        ALiBi with the standard slopes for the input's H heads, or with the H
        slopes of a .npy/text file (:mod:`ringmpi.job.options`).
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
# slices: per sequence, a 'slices' dataset in the input (issue 41), not one for the whole job
_NOT_JOB = {"cu_seqlens", "cu_seqlens_k", "head_parallel", "slices"}


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
    if spec.slices is not None:
        raise InputError(
            "slices: the batch job takes a mask of slices per sequence, as a 'slices' "
            "dataset beside q in the input (docs/batch-job.md), not for the whole job"
        )
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


# ----------------------------------------------------------------------
# The batch job's score modifiers: ALiBi slopes (standard or from a file) and sinks.
#
# ``ringmpi run --alibi`` uses the standard geometric slopes of the ALiBi paper
# (Press et al., "Train Short, Test Long", 2022) for the H heads of the input;
# ``--alibi-slopes FILE`` reads H floats from a ``.npy`` file or a text file;
# ``--softcap C`` is a spec field; a ``sinks`` dataset (H,) in the weights file
# gives per-head sink logits. :func:`resolve` puts them into the job's
# :class:`ringmpi.spec.AttentionSpec` before anything is created, so the output's
# attributes, the resume fingerprint and verify all see them (a resume with other
# settings is refused by the fingerprint).


#: largest slopes file read (a few thousand heads in text fit many times over)
MAX_SLOPES_BYTES = 1 << 20


def alibi_slopes(h: int) -> tuple:
    """The standard ALiBi slopes of ``h`` heads: a geometric sequence, as float64 numbers.

    For h a power of two, slope_i = 2^(-8 i / h), i = 1..h. Otherwise, with p
    the largest power of two below h, the p slopes of p heads followed by every
    other slope of 2p heads (the odd-numbered ones), h - p of them.

    Parameters
    ----------
    h : int
        Query heads, >= 1.

    Returns
    -------
    tuple of float (h,)
    """
    if isinstance(h, bool) or not isinstance(h, (int, np.integer)) or h < 1:
        raise ValueError(f"ALiBi needs a positive number of heads, got {h!r}")
    h = int(h)

    def power_of_two(n: int) -> list:
        return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]

    p = 1 << (h.bit_length() - 1)
    if p == h:
        return tuple(power_of_two(h))
    return tuple(power_of_two(p) + power_of_two(2 * p)[0::2][: h - p])


def read_slopes(path: str) -> tuple:
    """ALiBi slopes from a ``.npy`` file (no pickles) or a text file of numbers.

    The file is untrusted content: a regular file only (a FIFO would block), at
    most :data:`MAX_SLOPES_BYTES`, a 1-D array of finite numbers; text is split
    on whitespace and commas, ``#`` starts a comment, each token parsed as a
    float (nothing evaluated). InputError names the file and the problem.
    """
    why = trust.check_regular(path)
    if why:
        raise InputError(f"{path}: {why}")
    try:
        # non-blocking: a FIFO swapped in after the check cannot hang the open
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise InputError(f"{path}: not a regular file: refusing to read it")
            data = f.read(MAX_SLOPES_BYTES + 1)
    except OSError as e:
        raise InputError(f"{path}: cannot read the ALiBi slopes ({e.strerror or e})") from None
    if len(data) > MAX_SLOPES_BYTES:
        raise InputError(f"{path}: larger than {MAX_SLOPES_BYTES} bytes: not a slopes file")
    if data.startswith(b"\x93NUMPY"):
        try:
            a = np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise InputError(f"{path}: not a readable .npy array ({e})") from None
        if not isinstance(a, np.ndarray) or a.dtype.kind not in "iuf":
            raise InputError(f"{path}: the .npy file must hold numbers")
        a = a.astype(np.float64)
    else:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"{path}: neither a .npy file nor UTF-8 text") from None
        words = []
        for line in text.splitlines():
            words += line.split("#", 1)[0].replace(",", " ").split()
        try:
            a = np.array([float(w) for w in words], dtype=np.float64)
        except ValueError as e:
            raise InputError(f"{path}: not a list of numbers ({e})") from None
    if a.ndim != 1 or len(a) == 0:
        raise InputError(f"{path}: the ALiBi slopes must be a 1-D list, got shape {a.shape}")
    if not all(math.isfinite(x) for x in a.tolist()):
        raise InputError(f"{path}: the ALiBi slopes must be finite numbers")
    return tuple(float(x) for x in a)


def resolve(
    comm, spec: AttentionSpec, plan, alibi: bool = False, slopes_file: Optional[str] = None
) -> AttentionSpec:
    """The job's spec with its modifiers filled in from the flags and the inputs (collective).

    Parameters
    ----------
    comm : MPI communicator or None
    spec : AttentionSpec
        The spec from the flags (``softcap`` already in it; ``alibi_slopes`` and
        ``sinks`` when given through the API).
    plan : ringmpi.job.plan.Plan
        The scanned inputs (H, and the weights file's ``sinks``).
    alibi : bool
        ``--alibi``: the standard slopes for H heads.
    slopes_file : str, optional
        ``--alibi-slopes FILE`` (read on rank 0, the same on every rank).

    Raises
    ------
    InputError
        The same on every rank: both ALiBi flags, slopes not H long, sinks given
        twice.
    """
    h = plan.heads
    kw = {}
    if alibi and slopes_file is not None:
        raise InputError("--alibi and --alibi-slopes FILE: give one of them")
    if (alibi or slopes_file is not None) and spec.alibi_slopes is not None:
        raise InputError("ALiBi slopes given twice (in the spec and by --alibi/--alibi-slopes)")
    if alibi:
        kw["alibi_slopes"] = alibi_slopes(h)
    elif slopes_file is not None:
        kw["alibi_slopes"] = run_on_root(comm, read_slopes, slopes_file)
    if plan.sinks is not None:
        if spec.sinks is not None and tuple(spec.sinks) != tuple(plan.sinks):
            raise InputError(f"{plan.weights}: holds sinks, and other sinks were given")
        kw["sinks"] = plan.sinks
    spec = dataclasses.replace(spec, **kw) if kw else spec
    for name in ("alibi_slopes", "sinks"):
        x = getattr(spec, name)
        if x is not None and len(x) != h:
            where = f"{slopes_file}: " if name == "alibi_slopes" and slopes_file else ""
            raise InputError(f"{where}{name} has {len(x)} values but the input has H={h} heads")
    try:
        return spec.validate()
    except ValueError as e:
        raise InputError(str(e)) from None


def check_reproducible(spec: AttentionSpec, device: str) -> None:
    """InputError (before any file is made) when reproducible mode cannot run this job.

    The reasons the library gives per call (:func:`ringmpi.reproducible.refusals`), and
    the device: the mode runs on the CPUs only.
    """
    if not spec.reproducible:
        return
    from ..reproducible import refusals

    why = refusals(spec, np)
    if device == "gpu":
        why.insert(0, "--reproducible runs on the CPUs (use --device cpu)")
    if why:
        raise InputError("; ".join(why))


def check_tiles(spec: AttentionSpec, device: str) -> None:
    """InputError (before any file is made) when the job's tiles cannot apply a modifier.

    The same check the library makes per call (:meth:`ringmpi.backend.Backend.supports`),
    made once up front so that a refused ``--softcap``/``--alibi`` leaves nothing behind.

    Parameters
    ----------
    spec : AttentionSpec
        The resolved spec of the job.
    device : {"cpu", "gpu"}
        The device every rank agreed on (:func:`ringmpi.job.run.pick_device`).
    """
    from ..backend import select

    wanted = [f for f, meta in modifier_fields() if meta["tile"] and getattr(spec, f) is not None]
    if not wanted:
        return
    try:
        if device == "gpu":
            import cupy

            be = select(cupy.zeros(0))
        else:
            be = select(np.zeros(0))
    except (ImportError, RuntimeError):
        return  # the job reports an unusable backend itself, the usual way
    missing = [f for f in wanted if f not in be.forward_mods or f not in be.backward_mods]
    if missing:
        flags = ", ".join(
            "--" + ("alibi" if f == "alibi_slopes" else f.replace("_", "-")) for f in missing
        )
        hint = "; RINGMPI_CPU_KERNEL=numpy runs them on the CPU" if device == "cpu" else ""
        raise InputError(
            f"{flags}: the {be.name} tiles do not apply {', '.join(missing)} yet{hint}"
        )


def check_masks(spec: AttentionSpec, plan, device: str) -> None:
    """InputError (the same on every rank, before any file is made) when the input's masks of
    slices do not go with the options.

    A sequence's ``slices`` dataset is its whole mask: ``--causal`` and ``--window``
    are refused beside it, and so is the GPU (its tiles do not run slices yet).
    ``--layout balanced`` is dealt by the mask's visible pairs: every sequence needs a
    ``slices`` dataset (the masks of ``--causal``/``--window`` have zigzag and striped).

    Parameters
    ----------
    spec : AttentionSpec
        The job's spec.
    plan : ringmpi.job.plan.Plan
        The scanned input (the same on every rank).
    device : {"cpu", "gpu"}
    """
    from ..layout import MASK_LAYOUTS

    masked = [s for s in plan.sequences if sliced(s) is not None]
    path = plan.files[0]
    if masked:
        where = f"{path}: sequence {masked[0].name} holds a mask of slices ('slices')"
        if spec.causal or spec.window is not None:
            flag = "--causal" if spec.causal else "--window"
            raise InputError(
                f"{where}, its whole mask: {flag} cannot be combined with it (write the "
                "causal or windowed parts as slices)"
            )
        if device == "gpu":
            raise InputError(
                f"{where}: the GPU tiles do not run masks of slices yet; use --device cpu"
            )
    if spec.layout in MASK_LAYOUTS:
        bare = [s for s in plan.sequences if sliced(s) is None]
        if bare:
            raise InputError(
                f"{path}: --layout {spec.layout} is dealt by a mask of slices, but sequence "
                f"{bare[0].name} has no 'slices' dataset (for --causal or --window use "
                "zigzag or striped)"
            )
