"""One call's attention options as one value: :class:`AttentionSpec`.

Every option a user can set on an attention call (the mask, the score scale,
the token layout, the heads x ring degree) travels as one frozen
``AttentionSpec`` from the public functions through the cross-rank agreement
(:func:`ringmpi.arguments.agree`) to the tiles. The rules for each field exist
here once: :meth:`AttentionSpec.validate` checks and normalises them, so two
ranks' specs compare equal exactly when they describe the same call.

A new option is one more field here (with its rule in ``validate``, the rule
itself in :mod:`ringmpi.spec_rules`; its attribute form in
``to_attrs``/``from_attrs`` is generic; with ``metadata=_flag(...)`` it is also a
``ringmpi run`` flag, recorded in the output's attributes and the resume
fingerprint, and given to verify, with no other edit; with
``metadata=_modifier(...)`` a score modifier, also a keyword of
``ring_attention``, its backward and decode (:mod:`ringmpi.keywords`) and
refused up front by the job where the tiles lack it), its name in the
``forward_mods``/``backward_mods`` of the backends whose tiles run it
(:meth:`ringmpi.backend.Backend.supports` refuses it elsewhere), and the tiles.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from .partition import check_cu_seqlens, check_layout
from .spec_rules import (
    check_head_parallel,
    check_offsets,
    check_per_head,
    check_positive,
    check_scale,
    check_window,
    parse_positive,
    parse_scale,
    parse_softcap,
    parse_window,
)

__all__ = [
    "AttentionSpec",
    "check_window",
    "check_offsets",
    "parse_window",
    "parse_scale",
    "parse_softcap",
    "cli_fields",
    "modifier_fields",
]


def _flag(help: str, **argparse_keywords) -> dict:
    """Field metadata: the field is also the command-line flag ``--name-with-dashes``.

    ``help`` and the keywords go to ``argparse.add_argument`` (``type`` parses one
    value, ``action="store_true"`` for a bool); the default is the field's.
    """
    return {"cli": dict(help=help, **argparse_keywords)}


def _modifier(kind: str, doc: str, tile: bool = True, check=check_per_head) -> dict:
    """Field metadata: a score modifier, a keyword of every public attention function.

    ``kind`` and ``doc`` are its entry in their docstrings' Parameters
    (:func:`ringmpi.keywords.spec_keywords` adds the keyword, with default None,
    and the entry); ``tile``: the tiles apply it (False: it acts at finalize; a
    tile modifier also needs its entry in :mod:`ringmpi.scoremods`); ``check``:
    ``check(name, value)`` gives the normal form or raises ValueError
    (:func:`check_per_head`: one float per query head, H checked by
    :meth:`AttentionSpec.check_heads`; :func:`check_positive`: a float > 0).
    """
    return {"modifier": {"kind": kind, "doc": doc, "tile": tile, "check": check}}


def modifier_fields() -> list:
    """[(name, {"kind", "doc", "tile", "check"}), ...]: the score-modifier fields, in order."""
    return [(f.name, f.metadata["modifier"]) for f in dataclasses.fields(AttentionSpec)
            if "modifier" in f.metadata]  # fmt: skip


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
    scale : float or None
        Score scale; None means 1/sqrt(D) (:meth:`scale_for`).
    layout : {"zigzag", "striped", "contiguous"}
        How tokens are spread over the ranks.
    head_parallel : int
        U > 1: heads x ring on P = U x R ranks (:mod:`ringmpi.hybrid`).
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
    scale: Optional[float] = field(
        default=None, metadata=_flag("score scale (default 1/sqrt(D))", type=parse_scale)
    )
    layout: str = field(
        default="zigzag",
        metadata=_flag(
            "token layout over the ranks (default: zigzag)",
            choices=("zigzag", "striped", "contiguous"),
        ),
    )
    head_parallel: int = 1
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
        return AttentionSpec(
            causal=bool(self.causal),
            window=check_window(self.window),
            cu_seqlens=cu_q,
            cu_seqlens_k=cu_k,
            scale=check_scale(self.scale),
            layout=check_layout(self.layout),
            head_parallel=check_head_parallel(self.head_parallel),
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

    def mask(self, nq: int, nk: int):
        """The :class:`ringmpi.mask.Mask` of this spec for ``nq`` queries and ``nk`` keys.

        Checks the offsets against the lengths (ValueError: they must end at nq / nk).
        """
        from .mask import Mask  # mask.py builds on this module, not the other way round

        s = self.validate()
        cu_q = cu_k = None
        if s.cu_seqlens is not None:
            cu_q = check_cu_seqlens(s.cu_seqlens, nq)
            cu_k = check_cu_seqlens(s.cu_seqlens_k or s.cu_seqlens, nk)
        return Mask(int(nq), int(nk), s.causal, s.window, cu_q, cu_k)

    def to_attrs(self) -> dict:
        """The spec as HDF5/JSON-friendly attributes (None fields left out).

        ``window`` and the offsets become lists of ints; :meth:`from_attrs` reads
        them back (from a dict or an ``h5py`` attribute set) to an equal spec.
        """
        s = self.validate()
        out: dict[str, Any] = {}
        for f in dataclasses.fields(s):
            v = getattr(s, f.name)
            if v is None:
                continue
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
    (:func:`ringmpi.options.build_parser`) and builds the job's spec from the
    parsed values by name (:func:`ringmpi.options.spec_from_args`), so a new spec
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
