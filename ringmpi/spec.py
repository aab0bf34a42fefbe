"""One call's attention options as one value: :class:`AttentionSpec`.

Every option a user can set on an attention call (the mask, the score scale,
the token layout, the heads x ring degree) travels as one frozen
``AttentionSpec`` from the public functions through the cross-rank agreement
(:func:`ringmpi.arguments.agree`) to the tiles. The rules for each field exist
here once: :meth:`AttentionSpec.validate` checks and normalises them, so two
ranks' specs compare equal exactly when they describe the same call.

A new option is one more field here (with its rule in ``validate``, the rule
itself in :mod:`ringmpi.spec`; its attribute form in
``to_attrs``/``from_attrs`` is generic; with ``metadata=_flag(...)`` it is also a
``ringmpi run`` flag, recorded in the output's attributes and the resume
fingerprint, and given to verify, with no other edit; with
``metadata=_modifier(...)`` a score modifier, also a keyword of
``ring_attention``, its backward and decode (:mod:`ringmpi.spec`) and
refused up front by the job where the tiles lack it), its name in the
``forward_mods``/``backward_mods`` of the backends whose tiles run it
(:meth:`ringmpi.backend.Backend.supports` refuses it elsewhere), and the tiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import math
import textwrap
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from .layout import check_layout
from .slices import Slices

__all__ = [
    "AttentionSpec",
    "check_window",
    "check_offsets",
    "parse_window",
    "parse_scale",
    "parse_softcap",
    "cli_fields",
    "modifier_fields",
    "spec_keywords",
    "modifier_doc",
    "check_scale",
    "check_per_head",
    "check_softcap",
    "check_positive",
    "parse_positive",
    "check_head_parallel",
]

# ----------------------------------------------------------------------
# The rules of the :class:`ringmpi.spec.AttentionSpec` fields, one function each.
#
# ``AttentionSpec.validate`` applies the ``check_*`` rules (ValueError naming the
# field); the ``parse_*`` functions read the command-line forms (argparse errors
# before anything is created).


def check_window(window) -> Optional[tuple]:
    """``window`` as (left, right) ints >= -1, or None (also for (-1, -1)); ValueError otherwise."""
    if window is None:
        return None
    try:
        left, right = (int(x) for x in window)
    except (TypeError, ValueError):
        raise ValueError(f"window must be None or (left, right), got {window!r}") from None
    if left < -1 or right < -1 or (left, right) != tuple(window):
        raise ValueError(f"window sizes must be integers >= -1 (-1: unbounded), got {window!r}")
    return None if (left, right) == (-1, -1) else (left, right)


def check_offsets(name: str, cu) -> Optional[tuple]:
    """Packed-sequence offsets as a tuple of ints (comparable across ranks), or None.

    Parameters
    ----------
    name : str
        The argument's name, for the error message.
    cu : int array (n_seq + 1,), list, CuPy array or None
        Offsets [0, n1, n1 + n2, ..., N]; their sum N is checked later, against the
        sequence length (:func:`ringmpi.mask.mask_of`).
    """
    if cu is None:
        return None
    try:
        a = np.asarray(cu.get() if hasattr(cu, "get") else cu)
    except (TypeError, ValueError):
        a = np.zeros(0)
    if a.ndim != 1 or len(a) < 2 or a.dtype.kind not in "iu" or a[0] != 0 or (np.diff(a) < 0).any():
        raise ValueError(f"{name} must be 1-D integer offsets [0, ..., N], never decreasing")
    return tuple(int(x) for x in a)


def check_scale(scale) -> Optional[float]:
    if scale is None:
        return None
    try:
        x = float(scale)
    except (TypeError, ValueError):
        raise ValueError(f"scale must be a number, got {scale!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"scale must be finite, got {x}")
    return x


def check_per_head(name: str, x) -> Optional[tuple]:
    """A per-head float array (slopes, sinks) as a tuple of finite floats, or None."""
    if x is None:
        return None
    try:
        a = np.asarray(x.get() if hasattr(x, "get") else x)
        ok = a.ndim == 1 and len(a) > 0 and a.dtype.kind in "iuf"
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a 1-D array of floats, one per query head")
    a = a.astype(np.float64)
    if not np.isfinite(a).all():
        raise ValueError(f"{name} must be finite, got {a.tolist()}")
    return tuple(float(v) for v in a)


def check_positive(name: str, c) -> Optional[float]:
    """A finite float > 0 (e.g. ``softcap``), or None; ValueError naming the field."""
    if c is None:
        return None
    try:
        x = float(c)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number > 0, got {c!r}") from None
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {x}")
    return x


def check_softcap(c) -> Optional[float]:
    """``softcap``: :func:`check_positive`."""
    return check_positive("softcap", c)


def check_head_parallel(u) -> int:
    if isinstance(u, bool) or not isinstance(u, (int, np.integer)) or u < 1:
        raise ValueError(f"head_parallel={u!r} must be a positive integer (a divisor of the ranks)")
    return int(u)


def parse_scale(text: str) -> float:
    """``--scale``: a finite number (checked before anything is created)."""
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"expected a finite number, not {text!r}")
    return x


def parse_window(text: str) -> tuple:
    """``--window L[,R]``: (L, R), or (L, L) for one number; integers >= -1 (-1: unbounded)."""
    parts = [t.strip() for t in str(text).split(",")]
    try:
        vals = [int(t) for t in parts]
    except ValueError:
        vals = []
    if len(vals) not in (1, 2) or min(vals) < -1:
        raise argparse.ArgumentTypeError(
            f"expected LEFT or LEFT,RIGHT, integers >= -1 (-1: unbounded), not {text!r}"
        )
    return (vals[0], vals[-1])


def parse_positive(text: str) -> float:
    """``--softcap C`` and the like: a finite number > 0 (checked before anything is created)."""
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, not {text!r}")
    return x


parse_softcap = parse_positive  # the name the CLI first had


def _flag(help: str, **argparse_keywords) -> dict:
    """Field metadata: the field is also the command-line flag ``--name-with-dashes``.

    ``help`` and the keywords go to ``argparse.add_argument`` (``type`` parses one
    value, ``action="store_true"`` for a bool); the default is the field's.
    """
    return {"cli": dict(help=help, **argparse_keywords)}


def _modifier(kind: str, doc: str, tile: bool = True, check=check_per_head) -> dict:
    """Field metadata: a score modifier, a keyword of every public attention function.

    ``kind`` and ``doc`` are its entry in their docstrings' Parameters
    (:func:`ringmpi.spec.spec_keywords` adds the keyword, with default None,
    and the entry); ``tile``: the tiles apply it (False: it acts at finalize; a
    tile modifier also needs its entry in :mod:`ringmpi.scoremods`); ``check``:
    ``check(name, value)`` gives the normal form or raises ValueError
    (:func:`check_per_head`: one float per query head, H checked by
    :meth:`AttentionSpec.check_heads`; :func:`check_positive`: a float > 0).
    """
    return {"modifier": {"kind": kind, "doc": doc, "tile": tile, "check": check}}


def modifier_fields() -> list:
    """[(name, {"kind", "doc", "tile", "check"}), ...]: the score-modifier fields, in order."""
    return [
        (f.name, f.metadata["modifier"])
        for f in dataclasses.fields(AttentionSpec)
        if "modifier" in f.metadata
    ]


@dataclass(frozen=True)
class AttentionSpec:
    """The options of one attention call, the same on every rank.

    Attributes
    ----------
    causal : bool
        Query at global position i sees keys at positions <= i (bottom-right
        aligned for cross-attention).
    window : (left, right) or None
        Query i sees keys i - left <= j <= i + right within its sequence; -1 is
        unbounded (``(-1, -1)`` normalises to None).
    cu_seqlens : tuple of int (n_seq + 1,) or None
        Offsets of packed query sequences; tokens attend only within their sequence.
    cu_seqlens_k : tuple of int (n_seq + 1,) or None
        Offsets of packed key/value sequences (cross-attention; default ``cu_seqlens``).
    slices : ringmpi.slices.Slices or None
        The whole mask as a union of slices (issue 41); then ``causal``, ``window``
        and the offsets stay at their defaults.
    scale : float or None
        Score scale; None means 1/sqrt(D) (:meth:`scale_for`).
    layout : {"zigzag", "striped", "contiguous", "balanced"}
        How tokens are spread over the ranks.
    head_parallel : int
        U > 1: heads x ring on P = U x R ranks (:mod:`ringmpi.parallel`).
    reproducible : bool
        out and lse bitwise the same for the same global inputs whatever P, the
        layout, the threads and the CPU ISA path (issue 40; :mod:`ringmpi.reproducible`).
    alibi_slopes : tuple of float (H,) or None
        ALiBi: the score of query i and key j gains -slope_h * abs(qa_i - j) (global
        positions; qa aligned bottom-right per sequence,
        :meth:`ringmpi.mask.Mask.alibi_positions`).
    softcap : float or None
        Scores become softcap * tanh(score / softcap), after the scale, before
        ALiBi and the mask (Gemma 2, FlashAttention's ``softcap``).
    sinks : tuple of float (H,) or None
        Per-head sink logits: each row's softmax denominator gains exp(sink_h), a
        virtual key with value 0 (gpt-oss); lse includes it.
    """

    causal: bool = field(
        default=False,
        metadata=_flag("causal mask (key j visible to query i iff j <= i)", action="store_true"),
    )
    window: Optional[tuple] = field(
        default=None,
        metadata=_flag(
            "sliding window: query i sees keys i-L..i+R (within its packed sequence, aligned "
            "bottom-right for cross-attention); -1 unbounded; one number L means L,L; under "
            "--causal R is 0",
            type=parse_window,
            metavar="L[,R]",
        ),
    )
    # from the inputs (the job reads them per sequence), not flags
    cu_seqlens: Optional[tuple] = None
    cu_seqlens_k: Optional[tuple] = None
    slices: Optional[Slices] = None
    scale: Optional[float] = field(
        default=None, metadata=_flag("score scale (default 1/sqrt(D))", type=parse_scale)
    )
    layout: str = field(
        default="zigzag",
        metadata=_flag(
            "token layout over the ranks (default: zigzag); balanced: dealt by the mask's "
            "visible pairs, for inputs whose sequences carry a 'slices' mask",
            choices=("zigzag", "striped", "contiguous", "balanced"),
        ),
    )
    head_parallel: int = 1
    reproducible: bool = field(
        default=False,
        metadata=_flag(
            "the same bits of out and lse whatever the number of ranks, the layout, the ring "
            "size and the CPU (forward on CPUs; slower, one sequence per ring call and no "
            "mid-sequence checkpoints: docs/reproducible.md)",
            action="store_true",
        ),
    )
    # score modifiers: each also a keyword of ring_attention, its backward and decode
    alibi_slopes: Optional[tuple] = field(
        default=None,
        metadata=_modifier(
            "float array (H,), optional",
            "ALiBi, the same on every rank: the score of query i and key j gains "
            "-slope_h * abs(i - j) in global positions (within its packed sequence; "
            "bottom-right aligned for cross-attention, as FlashAttention's alibi).",
        ),
    )
    softcap: Optional[float] = field(
        default=None,
        metadata={
            **_flag(
                "logit soft-capping: scores become C*tanh(score/C), after the scale, before "
                "ALiBi and the masks (Gemma 2's convention)",
                type=parse_positive,
                metavar="C",
            ),
            **_modifier(
                "float > 0, optional",
                "Scores become softcap * tanh(score / softcap), after the scale and before "
                "ALiBi and the masks (Gemma 2, FlashAttention's ``softcap``); the gradient "
                "goes through tanh (dS times 1 - tanh^2).",
                check=check_positive,
            ),
        },
    )
    sinks: Optional[tuple] = field(
        default=None,
        metadata=_modifier(
            "float array (H,), optional",
            "Per-head sink logits (gpt-oss): each row's softmax denominator gains "
            "exp(sink_h), a virtual key of value 0; ``lse`` includes it, and a row with no "
            "visible key gets out 0 and lse = sink_h. The backward also returns ``dsinks``.",
            tile=False,
        ),
    )

    @classmethod
    def of(cls, spec: Optional[AttentionSpec] = None, **options) -> AttentionSpec:
        """``spec`` itself, or a spec from the keyword options (not both: ValueError).

        The public functions call ``AttentionSpec.of(spec, causal=causal, ...)``
        with their keywords; a keyword that differs from its default next to an
        explicit ``spec`` is an error rather than a silent choice between them.
        """
        if spec is None:
            return cls(**options)
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"spec must be an AttentionSpec, got {type(spec).__name__}")
        default = cls()
        clash = [k for k, v in options.items() if _differs(v, getattr(default, k))]
        if clash:
            raise ValueError(f"pass either spec= or the keyword(s) {', '.join(clash)}, not both")
        return spec

    def validate(self) -> AttentionSpec:
        """The spec with every field checked and normalised; ValueError names the bad field.

        Normal form: ``causal`` a bool, ``window`` None or a tuple of two ints,
        the offsets tuples of ints (``cu_seqlens_k`` without ``cu_seqlens`` is an
        error; the two must count the same sequences), ``scale`` None or a finite
        float, ``layout`` a known layout, ``head_parallel`` a positive int,
        ``alibi_slopes`` and ``sinks`` None or non-empty tuples of finite floats
        (their length, H, is checked by :meth:`check_heads`), ``softcap`` None or
        a finite float > 0. Idempotent: ``s.validate().validate() == s.validate()``.
        """
        cu_q = check_offsets("cu_seqlens", self.cu_seqlens)
        cu_k = check_offsets("cu_seqlens_k", self.cu_seqlens_k)
        if cu_k is not None and cu_q is None:
            raise ValueError("cu_seqlens_k needs cu_seqlens (the query offsets)")
        if cu_k is not None and len(cu_k) != len(cu_q):
            raise ValueError(
                f"cu_seqlens has {len(cu_q) - 1} sequences but cu_seqlens_k has {len(cu_k) - 1}"
            )
        try:
            slices = Slices.of(self.slices)
        except ValueError as e:
            raise ValueError(f"slices: {e}") from None
        if slices is not None and (self.causal or self.window is not None or cu_q is not None):
            raise ValueError(
                "slices is the whole mask: leave causal, window and cu_seqlens at their defaults"
            )
        return AttentionSpec(
            causal=bool(self.causal),
            window=check_window(self.window),
            cu_seqlens=cu_q,
            cu_seqlens_k=cu_k,
            slices=slices,
            scale=check_scale(self.scale),
            layout=check_layout(self.layout),
            head_parallel=check_head_parallel(self.head_parallel),
            reproducible=bool(self.reproducible),
            **{n: meta["check"](n, getattr(self, n)) for n, meta in modifier_fields()},
        )

    def check_heads(self, h: int) -> None:
        """ValueError unless the per-head modifiers (alibi_slopes, sinks) hold ``h`` values."""
        for name in (n for n, meta in modifier_fields() if meta["check"] is check_per_head):
            x = getattr(self, name)
            if x is not None and len(x) != h:
                raise ValueError(f"{name} has {len(x)} values but q has H={h} heads")

    def scale_for(self, d: int) -> float:
        """The score scale in use for head dim ``d``: ``scale``, or 1/sqrt(d)."""
        return 1.0 / float(np.sqrt(d)) if self.scale is None else float(self.scale)

    def to_attrs(self) -> dict:
        """The spec as HDF5/JSON-friendly attributes (None fields left out).

        ``window`` and the offsets become lists of ints, ``slices`` a list of rows
        of five ints (:meth:`ringmpi.slices.Slices.table`); :meth:`from_attrs` reads
        them back (from a dict or an ``h5py`` attribute set) to an equal spec.
        """
        s = self.validate()
        out: dict[str, Any] = {}
        for f in dataclasses.fields(s):
            v = getattr(s, f.name)
            if v is None or (f.name == "reproducible" and not v):  # default outputs: as before
                continue
            if isinstance(v, Slices):  # rows (q_start, q_end, k_start, k_end, kind code)
                v = v.table().tolist()
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_attrs(cls, attrs) -> AttentionSpec:
        """The validated spec :meth:`to_attrs` wrote; other keys in ``attrs`` are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {}
        for key in names & set(attrs.keys()):
            v = attrs[key]
            if isinstance(v, np.ndarray):
                v = v.tolist()
            elif isinstance(v, np.generic):
                v = v.item()
            if isinstance(v, bytes):
                v = v.decode()
            kw[key] = tuple(v) if isinstance(v, list) else v
        return cls(**kw).validate()


def cli_fields() -> list:
    """The fields of :class:`AttentionSpec` that are command-line flags, in field order.

    Each is ``(name, flag, argparse keywords)``; ``ringmpi run`` adds them
    (:func:`ringmpi.cli.parser.build_parser`) and builds the job's spec from the
    parsed values by name (:func:`ringmpi.cli.parser.spec_from_args`), so a new spec
    field with ``metadata=_flag(...)`` is a new flag with no other edit.
    """
    out = []
    for f in dataclasses.fields(AttentionSpec):
        cli = f.metadata.get("cli")
        if cli is not None:
            kw = dict(cli)
            if kw.get("action") != "store_true":
                kw.setdefault("default", f.default)
            out.append((f.name, "--" + f.name.replace("_", "-"), kw))
    return out


def _differs(value, default) -> bool:
    if value is None or default is None:
        return (value is None) != (default is None)
    if isinstance(value, (list, tuple, np.ndarray)):
        return True  # offsets or a window given: never a default
    return value != default


# ----------------------------------------------------------------------
# The score-modifier keywords of the public functions, made from the spec's fields.
#
# ``ring_attention``, ``ring_attention_backward`` and ``decode_attention`` take every
# score modifier of :class:`ringmpi.spec.AttentionSpec` (the fields marked with
# ``_modifier`` metadata: ``alibi_slopes``, ``softcap``, ``sinks``) as a keyword
# argument with default None. Rather than each function listing them (and
# their documentation) by hand, :func:`spec_keywords` gives a function written
# with ``**modifiers`` one keyword-only parameter per modifier field: in its
# signature (``help()``, ``inspect.signature``, the API reference) and in its
# docstring, where a line ``{modifiers}`` stands. A new modifier field is then a
# keyword of all three with no edit here or there. An unknown keyword is the
# ``TypeError`` Python gives.


PLACEHOLDER = "{modifiers}"


def modifier_doc(indent: str = "    ") -> str:
    """The numpydoc Parameters entries of the modifier fields, indented by ``indent``."""
    lines = []
    for name, meta in modifier_fields():
        lines.append(f"{indent}{name} : {meta['kind']}")
        body = textwrap.wrap(meta["doc"], width=88 - len(indent) - 4)
        lines.extend(f"{indent}    {b}" for b in body)
    return "\n".join(lines)


def spec_keywords(fn):
    """Give ``fn`` (written with ``**modifiers``) one keyword per score-modifier field.

    The keywords go before the private ones (names starting with ``_``), each
    with default None; ``fn`` receives the given ones in ``modifiers``. The
    docstring line ``{modifiers}`` becomes their Parameters entries.
    """
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if not params or params[-1].kind is not inspect.Parameter.VAR_KEYWORD:
        raise TypeError(f"{fn.__name__} must end with **modifiers")
    rest = params[:-1]
    at = next((i for i, p in enumerate(rest) if p.name.startswith("_")), len(rest))
    mods = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
        for name, _ in modifier_fields()
    ]
    new = sig.replace(parameters=rest[:at] + mods + rest[at:])
    allowed = frozenset(new.parameters)
    names = frozenset(m.name for m in mods)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for key in kwargs:
            if key not in allowed:
                raise TypeError(f"{fn.__name__}() got an unexpected keyword argument {key!r}")
        return fn(*args, **kwargs)

    wrapper.__signature__ = new
    wrapper.modifier_names = names
    doc = fn.__doc__ or ""
    line = next((ln for ln in doc.splitlines() if ln.strip() == PLACEHOLDER), None)
    if line is not None:
        indent = line[: len(line) - len(line.lstrip())]
        wrapper.__doc__ = doc.replace(line, modifier_doc(indent), 1)
    return wrapper
