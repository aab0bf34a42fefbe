"""What ``ringmpi verify`` reads: one head's whole-sequence inputs, the output's recorded options.

:mod:`ringmpi.job.verify` compares the output with dense attention of these inputs;
the attributes say which mask, scale and positions the run used.
"""

from __future__ import annotations

import json

import numpy as np

from ..rope import apply_rope, positions_in_sequence
from ..spec import AttentionSpec
from .schema import InputError, Plan

__all__ = ["read_head", "output_attr", "output_meta"]


def read_head(plan: Plan, seq, head: int, kv: bool, rope=None) -> tuple:
    """Whole-sequence inputs of one head: q (S, D) for query head ``head`` or k, v (S_k, D).

    Features inputs are projected in float64, x @ w + b (biases when the weights
    file has them; keys and values from ``x_kv`` when the sequence has it), rotated
    by ``rope`` = (theta, scale) at the positions within each packed sequence (q
    and k only), then rounded to the input dtype.

    Parameters
    ----------
    plan : Plan
        The job's input plan (files, weights, dtype, head size).
    seq : SeqInfo
        The sequence of ``plan`` to read.
    head : int
        Query head (``kv`` False) or key/value head (``kv`` True).
    kv : bool
        Read k and v instead of q.
    rope : tuple of (float, float), optional
        RoPE (theta, scale) of the run; None: no rotation.
    """
    import h5py

    dt = np.dtype(plan.dtype)
    names = ("k", "v") if kv else ("q",)
    parts: dict = {n: [] for n in names}
    w = None
    if plan.mode == "features":
        with h5py.File(plan.weights, "r", locking=False) as f:
            d = plan.head_dim
            cut = slice(head * d, (head + 1) * d)
            w = {n: np.asarray(f["w" + n][:, cut], np.float64) for n in names}
            bias = {n: np.asarray(f["b" + n][cut], np.float64) for n in names if "b" + n in f}
    src = "x_kv" if (kv and seq.x_kv) else "x"
    for path in plan.files:
        with h5py.File(path, "r", locking=False) as f:
            node = f[seq.group] if seq.group else f
            b = (seq.batch,) if seq.batch is not None else ()
            for n in names:
                if w is None:
                    parts[n].append(node[n][b + (slice(None), head)])
                else:
                    y = np.asarray(node[src][b], np.float64) @ w[n]
                    parts[n].append(y + bias[n] if n in bias else y)
    full = {n: np.concatenate(parts[n]) for n in names}
    if rope is not None and w is not None:
        cu = (seq.cu_seqlens if seq.cu_seqlens_k is None else seq.cu_seqlens_k) if kv else (
            seq.cu_seqlens)  # fmt: skip
        n = "k" if kv else "q"
        pos = positions_in_sequence(np.arange(len(full[n])), cu)
        full[n] = apply_rope(full[n][:, None, :], pos, *rope)[:, 0]
    return tuple(full[n].astype(dt) for n in names)


def output_attr(f, key: str):
    """A root attribute of open output file ``f``: typed (format 2) or a JSON string (format 1)."""
    val = f.attrs[key]
    if isinstance(val, bytes):
        val = val.decode()
    if isinstance(val, str) and int(f.attrs.get("format", 1)) < 2:
        return json.loads(val)
    return val.item() if isinstance(val, np.generic) else val


def output_meta(output: str) -> dict:
    """The options ``output`` records: causal, scale, layout, rope (theta, scale) and the spec.

    Raises :class:`~ringmpi.job.schema.InputError` when ``output`` is not a ringmpi
    output file.
    """
    import h5py

    try:
        with h5py.File(output, "r") as f:
            got = {k: output_attr(f, k) for k in ("causal", "scale", "layout")}
            # positions (outputs before them have none: no rope)
            got["rope"] = bool(f.attrs.get("rope", False))
            got["rope_theta"] = float(f.attrs.get("rope_theta", 10000.0))
            got["rope_scale"] = float(f.attrs.get("rope_scale", 1.0))
            # the whole spec the run recorded (any later field by its own name)
            got["spec"] = AttentionSpec.from_attrs(f.attrs)
            return got
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise InputError(f"{output}: not a ringmpi output file ({e})") from e
